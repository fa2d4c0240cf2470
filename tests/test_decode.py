"""Tests for generation from the static KV cache (model.KVCache, GPT.generate / decode_step) and
tools/decode.py: model.generate's logits are the full forward's of the cropped context at every step
(across the refill at block_size; fp, ternary at lambda 1 and frozen packed models, with and without
GQA), the fixed-shape step a CUDA graph captures agrees to float rounding with the same tokens,
greedy and sampled, from buffers never reallocated; doc_mask models decode with full forwards; no op
runs between steps and none reads the host inside one; the fixed step compiles whole (through the
packed layers' registered op) for every position. CUDA: tests/gpu_decode.py. Run: python -m pytest
tests/test_decode.py"""

import re

import pytest
import torch
import torch.nn.functional as F

from kernels.packed_linear import freeze_ternary
from model import GPT, DecodeState, GPTConfig
from tools import decode

SMALL = dict(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32, eot=60)
GQA = dict(n_head=4, n_kv_head=1, head_dim=24, qk_norm=True)  # Qwen3's attention: 4 query heads share one K/V head


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


def make(packed=False, use_triton=None, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL, **kw})).eval()  # quant=True: lambda 1, ternary
    return freeze_ternary(model, use_triton) if packed else model


MODELS = {"fp": dict(quant=False), "fp-gqa": dict(quant=False, **GQA), "ternary": {}, "ternary-gqa": GQA,
          "packed": dict(packed=True), "packed-gqa": dict(packed=True, **GQA)}


def _logits_of(gen, model, *args, **kw):
    """(tokens, the logits of every step (B, 1, V)) of gen(*args, **kw): the LM head's outputs, one
    per step."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.clone()))
    try:
        return gen(*args, **kw), seen
    finally:
        hook.remove()


@pytest.mark.parametrize("name", MODELS)
def test_each_step_gives_the_full_forwards_logits_across_the_refill(name):
    """Greedy, 14 new tokens after 5: a prefill, 11 cached steps, then the context reaches
    block_size (16) and each token is a refill from the last 16 tokens. Reference: the full forward
    of the cropped context. The refill is that forward bit for bit; a cached step agrees to float
    rounding (its matmuls have other row counts; a ternary model's activation on a rounding tie may
    move to the next int8 code: a quantisation step); the fixed-shape step (tools/decode.py fixed)
    agrees with the eager one to float rounding."""
    model = make(**MODELS[name])
    idx = torch.randint(0, 60, (3, 5), generator=torch.Generator().manual_seed(1))
    out, eager = _logits_of(model.generate, model, idx, 14, top_k=1)
    dec = decode.Decoder(model, "fixed")
    fixed_out, fixed = _logits_of(dec.generate, model, idx, 14, top_k=1)
    assert out.shape == (3, 19) and torch.equal(fixed_out, out) and len(eager) == len(fixed) == 14
    quantised = "fp" not in name
    with torch.no_grad():
        for n, t in enumerate(range(5, 19)):
            want = model(out[:, :t][:, -16:])[0]  # (3, 1, V)
            assert torch.equal(want.argmax(-1), out[:, t:t + 1]), n
            if n == 0 or t > 16:  # the prefill and the refills
                assert torch.equal(eager[n], want) and torch.equal(fixed[n], want), n
            scale = want.abs().max().item()
            atol = (1e-2 if quantised else 1e-5) * scale
            torch.testing.assert_close(eager[n], want, rtol=0, atol=atol)
            torch.testing.assert_close(fixed[n], eager[n], rtol=0, atol=1e-5 * scale)
    k = dec.state.cache[0].k
    assert k.shape == (3, model.config.kv_heads(), 16, model.config.head_size())
    dec.generate(idx[:, :2], 20, top_k=1)  # the same batch again, refills and all: the same buffers
    assert dec.state.cache[0].k is k


@pytest.mark.parametrize("name", ["ternary-gqa", "packed"])
def test_the_fixed_step_samples_the_eager_steps_tokens_and_keeps_its_buffers(name):
    model = make(**MODELS[name])
    idx = torch.randint(0, 60, (2, 4), generator=torch.Generator().manual_seed(3))
    dec = decode.Decoder(model, "fixed")
    runs = {}
    auto = decode.Decoder(model, "auto")  # eager on CPU
    for gen in (model.generate, auto.generate, dec.generate):
        torch.manual_seed(7)
        runs.setdefault("sampled", []).append(gen(idx, 25, temperature=0.8, top_k=20))
        runs.setdefault("greedy", []).append(gen(idx, 25, top_k=1))
    for kind, outs in runs.items():
        assert outs[0].shape == (2, 29) and all(torch.equal(o, outs[0]) for o in outs), kind
    assert not torch.equal(runs["sampled"][0], runs["greedy"][0])  # sampling did draw other tokens
    state = dec.state
    dec.generate(idx[:, :1], 3, top_k=1)
    assert dec.state is state  # the same batch: kept (a captured graph reads these buffers)
    dec.generate(idx[:1], 3, top_k=1)
    assert dec.state.seq.size(0) == 1  # another batch: new buffers


def test_doc_mask_models_decode_with_full_forwards():
    """A doc_mask model restarts positions at each end-of-text: each token from the full forward of
    the cropped context (a refill every token), in every mode."""
    model = make(doc_mask=True)
    idx = torch.tensor([[60, 5, 6, 60, 7]])  # end-of-text (60) starts each document
    out = model.generate(idx, 14, top_k=1)
    ref = idx
    with torch.no_grad():
        for _ in range(14):
            ref = torch.cat([ref, model(ref[:, -16:])[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    assert torch.equal(decode.generate(model, idx, 14, top_k=1, mode="fixed"), ref)


def test_graph_modes_refuse_a_cpu_model_and_unknown_modes():
    model = make()
    with pytest.raises(ValueError, match="CUDA graph"):
        decode.Decoder(model, "graph")
    with pytest.raises(ValueError, match="eager, fixed, graph, compile"):
        decode.Decoder(model, "fast")


def test_the_graph_modes_loop_captures_once_per_sampling_and_warms_up_in_place(monkeypatch):
    """graph mode's loop on CPU, with the CUDA capture replaced by its warm-up and a plain call: the
    step is captured at its first call after the prefill, again only for other sampling settings,
    and its warm-up runs leave the position where they found it (a prompt of block_size - 1 tokens:
    a warm-up that moved on would write past the cache). The fixed step's tokens."""
    captures = []

    class Replayed:
        def __init__(self, fn, compile, s):
            captures.append(int(s.pos))
            decode._warm_up(fn, s)
            self.replay = fn

    monkeypatch.setattr(decode, "_captured", Replayed)
    model = make(**MODELS["packed"])
    dec = decode.Decoder(model, "fixed")
    dec.mode = "graph"
    idx = torch.randint(0, 60, (2, 15), generator=torch.Generator().manual_seed(5))
    want = decode.generate(model, idx, 8, top_k=1, mode="fixed")
    assert torch.equal(dec.generate(idx, 8, top_k=1), want) and captures == [15]
    want = decode.generate(model, idx[:, :9], 8, top_k=1, mode="fixed")
    assert torch.equal(dec.generate(idx[:, :9], 8, top_k=1), want) and captures == [15]  # replayed
    dec.generate(idx[:, :9], 3, top_k=2)
    assert captures == [15, 9]


def test_the_decoder_makes_the_models_device_current_for_its_loop(monkeypatch):
    """The graph, its capture stream and the Triton kernels run on the current CUDA device, whatever device the
    model is on: Decoder.generate runs its loop under kernels.quantize.on_device(the model's device), once per
    call (a model on cuda:1 with cuda:0 current would otherwise capture nothing and replay stale tokens)."""
    entered = []
    real = decode.on_device

    def recorded(dev):
        entered.append(dev)
        return real(dev)
    monkeypatch.setattr(decode, "on_device", recorded)
    model = make(**MODELS["packed"])
    idx = torch.randint(0, 60, (1, 5), generator=torch.Generator().manual_seed(6))
    decode.Decoder(model, "fixed").generate(idx, 4, top_k=1)
    assert entered == [torch.device("cpu")]


def test_no_op_runs_between_steps_and_none_reads_the_host_inside_one():
    """Per token the loop runs no aten op outside the step (GPT.decode_step: it samples, writes the
    token and advances the position on the device): what runs outside it (the argument check's one
    read of the prompt, the final concatenation) does not grow with the tokens, in the eager and the
    fixed mode. Inside a step nothing reads a tensor to the host (aten._local_scalar_dense: .item(),
    bool(), .tolist()), no Python list becomes an index (aten.lift_fresh) and nothing is
    concatenated (RoPE without cat, the cache written in place)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.inside, self.outside, self.names = False, 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.inside:
                self.names.add(str(func.overloadpacket))
            self.outside += not self.inside
            return func(*args, **(kwargs or {}))

    model = make(**MODELS["packed"])
    idx = torch.randint(0, 60, (2, 4), generator=torch.Generator().manual_seed(3))
    want = model.generate(idx, 9, top_k=1)  # the packed layers unpack their codes at the first call
    step, count = model.decode_step, Count()

    def counted(*a):
        count.inside = True
        try:
            return step(*a)
        finally:
            count.inside = False
    model.decode_step = counted  # generate's steps and the Decoder's call it through the model
    fixed = decode.Decoder(model, "fixed")
    fixed.generate(idx, 1, top_k=1)  # its buffers, made once
    for gen in (model.generate, fixed.generate):
        outside = []
        for n in (3, 9):  # 4 + 9 = 13 tokens: no refill
            count.outside, count.names = 0, set()
            with count:
                assert torch.equal(gen(idx, n, top_k=1), want[:, :4 + n])
            bad = {"aten._local_scalar_dense", "aten.lift_fresh", "aten.nonzero", "aten.cat"}
            assert count.names and not count.names & bad, count.names
            outside.append(count.outside)
        assert outside[0] == outside[1], outside  # the argument check, the last read: not per token


def test_the_packed_step_compiles_whole_through_the_registered_op_for_every_position(monkeypatch):
    """torch.compile(fullgraph=True, aot_eager: dynamo, the op's fake and AOT autograd, not
    inductor's code generation) traces the fixed step of a packed model on its Triton path, each
    packed layer one registered op (kernels/op.py, nanobitnet::ternary_linear); a new position is a
    new value of the position tensor: one frame serves every step, and its greedy tokens are the
    eager fixed step's on the layers' CPU path. The op runs the kernels' torch references here (the
    same numbers, tests/test_packed.py; Triton's interpreter takes seconds a call)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    import kernels.ternary_matmul as tm
    import quant
    from kernels import op
    monkeypatch.setattr(tm, "quantize_activations", quant.activation_quant)
    monkeypatch.setattr(tm, "ternary_matmul", tm.ternary_matmul_reference)
    monkeypatch.setattr(tm, "rmsnorm_quantize", lambda x, g, eps=None: quant.activation_quant(
        F.rms_norm(x, (x.shape[-1],), g.to(x.dtype), torch.finfo(x.dtype).eps if eps is None else eps)))

    def bound(w, w_scale, K, norm=None):  # the eager launches' stand-in: the op's own function
        if norm is None:
            return lambda x: op.linear(x, w, w_scale)
        return lambda x: op.norm_linear(x, norm[0], norm[1], w, w_scale)
    monkeypatch.setattr(op, "BoundLinear", bound)
    idx = torch.randint(0, 60, (1, 3), generator=torch.Generator().manual_seed(4))
    want = decode.generate(make(packed=True, n_layer=1), idx, 6, top_k=1, mode="fixed")
    model = make(packed=True, use_triton=True, n_layer=1)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    s = DecodeState(model, 1)
    step = torch.compile(lambda: model.decode_step(s, s.pos, 1.0, 1), fullgraph=True,
                         backend=counter)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(idx, 6, top_k=1, state=s, step=lambda pos: step())  # 5 compiled steps
    assert torch.equal(got, want) and counter.frame_count == 1
    ops = [str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("ternary_linear" in op for op in ops) == 4, ops  # qkv, o, gate/up, down: stacked


@pytest.mark.slow
def test_the_fixed_step_compiles_with_inductor_and_decodes_the_same_tokens():
    """mode=compile's compiler on the fixed step of a packed model (CPU: the layers' torch path,
    inductor's C++ code): one frame for every position, the eager fixed step's greedy tokens."""
    torch._dynamo.reset()
    model = make(**MODELS["packed"])
    idx = torch.randint(0, 60, (1, 5), generator=torch.Generator().manual_seed(4))
    want = decode.generate(model, idx, 6, top_k=1, mode="fixed")
    s = DecodeState(model, 1)
    step = torch.compile(lambda: model.decode_step(s, s.pos, 1.0, 1), fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(idx, 6, top_k=1, state=s, step=lambda pos: step()), want)


def test_generate_refuses_what_it_cannot_sample_and_keeps_to_the_tokenizers_vocabulary():
    """model.generate and Decoder.generate: one ValueError naming the argument for top_k 0 or negative, a NaN or
    non-positive temperature, an empty prompt or an id outside the vocabulary; with vocab (sample.py passes the
    tokenizer's) no id at or past it is drawn, even where its logit is the largest (a --pad_vocab row)."""
    model = make(**MODELS["packed"])
    idx = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(3))
    bad = [(dict(top_k=0), "top_k=0"), (dict(top_k=-3), "top_k=-3"), (dict(temperature=float("nan")), "temperature"),
           (dict(temperature=0.0), "temperature=0.0"), (dict(vocab=0), "vocab=0")]
    for gen in (model.generate, decode.Decoder(model, "fixed").generate):
        for kw, said in bad:
            with pytest.raises(ValueError, match=said.replace("(", r"\(")):
                gen(idx, 3, **kw)
        for prompt, said in ((idx[:, :0], "T >= 1"), (idx + 60, "outside the vocabulary"),
                             (idx[0], "(B, T)")):
            with pytest.raises(ValueError, match=re.escape(said)):
                gen(prompt, 3)
    with torch.no_grad():
        model.lm_head.weight[50:] = 0.0
        model.lm_head.weight[55] = 50.0 * model.lm_head.weight[:50].abs().max()  # id 55 the likeliest everywhere
    assert (model.generate(idx, 6, top_k=1)[:, 4:] == 55).all()
    for gen in (model.generate, decode.Decoder(model, "fixed").generate):
        torch.manual_seed(0)
        out = gen(idx, 12, temperature=2.0, vocab=50)[:, 4:]
        assert out.max() < 50, out
