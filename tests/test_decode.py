"""Tests for tools/decode.py, the static-KV-cache decoder: its eager step gives model.generate's logits bit for bit at
every step (across the refill at block_size; fp, ternary at lambda 1 and frozen packed models, with and without GQA),
the fixed-shape step the CUDA graph captures agrees to float rounding with the same greedy tokens and never
reallocates its buffers, sampling draws the same tokens, doc_mask models keep model.generate, and on CUDA the
captured step decodes the same tokens. Run: python -m pytest tests/test_decode.py"""

import pytest
import torch

from kernels.packed_linear import freeze_ternary
from model import GPT, GPTConfig
from tools import decode

SMALL = dict(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32, eot=60)
GQA = dict(n_head=4, n_kv_head=1, head_dim=24, qk_norm=True)  # Qwen3's attention: 4 query heads share one K/V head


def make(packed=False, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL, **kw})).eval()  # quant=True: lambda 1, ternary
    return freeze_ternary(model) if packed else model


MODELS = {"fp": dict(quant=False), "fp-gqa": dict(quant=False, **GQA), "ternary": {}, "ternary-gqa": GQA,
          "packed": dict(packed=True), "packed-gqa": dict(packed=True, **GQA)}


def _lockstep(model, decoders, steps=30, B=3, T=5):
    """Greedy decoding, model.generate's dynamic cache (model._decode) beside each decoder, fed the same tokens
    (the dynamic path's argmax). Yields (dynamic logits, {mode: logits}) per step; the context passes block_size
    (16) after 11 steps, so the cache is refilled from the last 16 tokens, as model.generate does."""
    idx = torch.randint(0, SMALL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(1))
    cache, pos, L = None, None, model.config.block_size
    with torch.no_grad():
        for _ in range(steps):
            if pos is None or pos >= L:
                ctx, cache = idx[:, -L:], [{} for _ in model.h]
                ref, got, pos = model._decode(ctx, cache, 0), {m: d.prefill(ctx) for m, d in decoders.items()}, ctx.size(1)
            else:
                ref = model._decode(idx[:, -1:], cache, pos)
                got, pos = {m: d.step(idx[:, -1:], pos) for m, d in decoders.items()}, pos + 1
            yield ref, got
            idx = torch.cat([idx, ref[:, -1].argmax(-1, keepdim=True)], dim=1)


@pytest.mark.parametrize("name", MODELS)
def test_static_cache_step_equals_the_dynamic_step_at_every_step_across_the_refill(name):
    model = make(**MODELS[name])
    decoders = {mode: decode.Decoder(model, mode) for mode in ("eager", "fixed")}
    buffers, n = None, 0
    for ref, got in _lockstep(model, decoders):
        assert torch.equal(got["eager"], ref), n  # bit for bit
        # the fixed-shape step (masked attention over the whole buffer) rounds differently: ~1e-7 relative here
        torch.testing.assert_close(got["fixed"], ref, rtol=0, atol=1e-5 * ref.abs().max().item())
        assert torch.equal(got["fixed"].argmax(-1), ref.argmax(-1)), n
        ptrs = [(c.k.data_ptr(), c.v.data_ptr()) for c in decoders["fixed"].layers]
        assert buffers in (None, ptrs), n  # a captured graph reads these addresses: never reallocated, not at refill
        buffers, n = ptrs, n + 1
    assert n == 30 and decoders["fixed"].layers[0].k.shape == (3, model.config.kv_heads(), 16, model.config.head_size())


@pytest.mark.parametrize("name", ["ternary-gqa", "packed"])
def test_generate_gives_model_generates_tokens_greedy_and_sampled(name):
    model = make(**MODELS[name])
    idx = torch.randint(0, 60, (2, 4), generator=torch.Generator().manual_seed(3))
    want = model.generate(idx, 25, top_k=1)
    assert want.shape == (2, 29)
    for mode in ("eager", "fixed"):
        assert torch.equal(decode.generate(model, idx, 25, top_k=1, mode=mode), want), mode
    dec = decode.Decoder(model, "auto")  # eager on CPU; reused: buffers kept, the same tokens again
    assert dec.mode == "eager" and torch.equal(dec.generate(idx, 25, top_k=1), want)
    torch.manual_seed(7)
    sampled = model.generate(idx, 25, temperature=0.8, top_k=20)
    torch.manual_seed(7)
    assert torch.equal(dec.generate(idx, 25, temperature=0.8, top_k=20), sampled)
    assert not torch.equal(sampled, want)  # sampling did draw other tokens than the argmax


def test_doc_mask_models_keep_model_generate():
    model = make(doc_mask=True)
    idx = torch.tensor([[60, 5, 6, 60, 7]])  # end-of-text (60) starts each document: positions restart
    assert torch.equal(decode.generate(model, idx, 8, top_k=1), model.generate(idx, 8, top_k=1))
    with pytest.raises(ValueError, match="model.generate"):
        decode.Decoder(model, "eager").prefill(idx)


def test_graph_modes_refuse_a_cpu_model_and_unknown_modes():
    model = make()
    with pytest.raises(ValueError, match="CUDA graph"):
        decode.Decoder(model, "graph")
    with pytest.raises(ValueError, match="eager, fixed, graph, compile"):
        decode.Decoder(model, "fast")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp", "packed"])
def test_the_fixed_step_compiles_as_one_graph_that_serves_every_position(name):
    """torch.compile(fullgraph=True) traces the fixed step without a break (mode=compile on CUDA), and a new position
    is a new value of the position tensor, not a recompilation. CPU: inductor's C++ code, the packed layers' torch
    path; agreement with the eager fixed step to float rounding."""
    import torch._dynamo
    torch._dynamo.reset()  # the other parametrisation compiled the same code for its own model
    model = make(**MODELS[name])
    dec = decode.Decoder(model, "fixed")
    idx = torch.randint(0, 60, (1, 5), generator=torch.Generator().manual_seed(4))
    step = torch.compile(lambda: dec._step(dec.token), fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        dec.prefill(idx)
        for pos, token in ((5, 11), (6, 12), (7, 13)):
            dec.token.fill_(token)
            dec.pos.fill_(pos)
            got = step()
            dec.pos.fill_(pos)
            want = dec._step(dec.token)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_generate_owns_the_token_no_op_outside_the_step_and_no_host_read():
    """Between steps the loop runs no aten op at all (the step samples, writes the token and advances the position
    on the device): the ops outside _sample_step (the argument check's one read of the prompt, the prefill, the
    final concatenation) do not grow with the tokens; inside it nothing reads a tensor to the host
    (aten._local_scalar_dense: .item(), bool(), .tolist()) and no Python list becomes an index (aten.lift_fresh);
    greedy tokens are model.generate's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.inside, self.outside, self.names = False, 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.inside:  # the step: no host read, no list index
                self.names.add(str(func.overloadpacket))
            self.outside += not self.inside
            return func(*args, **(kwargs or {}))

    model = make(**MODELS["packed"])
    idx = torch.randint(0, 60, (2, 4), generator=torch.Generator().manual_seed(3))
    for mode in ("eager", "fixed"):
        dec = decode.Decoder(model, mode)
        step = dec._sample_step

        def counted(*a):
            count.inside = True
            try:
                return step(*a)
            finally:
                count.inside = False
        dec.generate(idx, 2, top_k=1)  # the packed layers unpack their codes once, at the first call
        dec._sample_step = counted
        outside = []
        for n in (6, 12):  # 4 + 12 = 16 tokens: no refill
            with Count() as count:
                got = dec.generate(idx, n, top_k=1)
            assert torch.equal(got, model.generate(idx, n, top_k=1)), mode
            assert not count.names & {"aten._local_scalar_dense", "aten.lift_fresh", "aten.nonzero"}, count.names
            outside.append(count.outside)
        assert outside[0] == outside[1], (mode, outside)  # the prefill and the last read, not a per-token cost


def test_generate_refuses_what_it_cannot_sample_and_keeps_to_the_tokenizers_vocabulary():
    """model.generate and Decoder.generate: one ValueError naming the argument for top_k 0 or negative, a NaN or
    non-positive temperature, an empty prompt or an id outside the vocabulary; with vocab (sample.py passes the
    tokenizer's) no id at or past it is drawn, even where its logit is the largest (a --pad_vocab row)."""
    model = make(**MODELS["packed"])
    idx = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(3))
    bad = [(dict(top_k=0), "top_k=0"), (dict(top_k=-3), "top_k=-3"), (dict(temperature=float("nan")), "temperature"),
           (dict(temperature=0.0), "temperature=0.0"), (dict(vocab=0), "vocab=0")]
    for gen in (model.generate, decode.Decoder(model, "eager").generate, decode.Decoder(model, "fixed").generate):
        for kw, said in bad:
            with pytest.raises(ValueError, match=said.replace("(", r"\(")):
                gen(idx, 3, **kw)
        for prompt, said in ((idx[:, :0], "T >= 1"), (idx + 60, "outside the vocabulary")):
            with pytest.raises(ValueError, match=said):
                gen(prompt, 3)
    with torch.no_grad():
        model.lm_head.weight[50:] = 0.0
        model.lm_head.weight[55] = 50.0 * model.lm_head.weight[:50].abs().max()  # id 55 the likeliest everywhere
    assert (model.generate(idx, 6, top_k=1)[:, 4:] == 55).all()
    for gen in (model.generate, decode.Decoder(model, "eager").generate):
        torch.manual_seed(0)
        out = gen(idx, 12, temperature=2.0, vocab=50)[:, 4:]
        assert out.max() < 50, out
