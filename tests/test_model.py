"""Tests for model.py: the BitNet layout (separate BitLinear projections, SubLN), causality, the document mask,
the states read by distillation, and torch.compile."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from model import GPT, DecodeState, GPTConfig, apply_rope, document_mask, precompute_rope
from quant import BitLinear, set_lambda

SMALL = dict(vocab_size=61, block_size=32, n_layer=2, n_head=2, n_embd=32, eot=60)


def make(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SMALL, **kw}))


def test_hidden_projections_are_bitlinear_and_embedding_head_norms_stay_fp():
    model = make(quant=True)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    bit = {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, BitLinear)}
    assert bit == set(names)
    assert sum(isinstance(m, BitLinear) for m in model.modules()) == 7 * SMALL["n_layer"]
    assert type(model.lm_head) is nn.Linear and type(model.wte) is nn.Embedding
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))
    fp = make(quant=False)
    assert not any(isinstance(m, BitLinear) for m in fp.modules())


def test_subln_is_an_rmsnorm_right_before_o_proj_and_down_proj():
    seen = {}
    for subln in (True, False):
        model = make(subln=subln, quant=False)
        for parent, name in ((model.h[1].attn, "o_proj"), (model.h[1].mlp, "down_proj")):
            getattr(parent, name).register_forward_pre_hook(
                lambda m, a, key=(name, subln): seen.__setitem__(key, a[0]))
            if subln:
                parent.subln.register_forward_pre_hook(lambda m, a, key=(name, "raw"): seen.__setitem__(key, a[0]))
        model(torch.randint(0, 60, (2, 16)), torch.randint(0, 60, (2, 16)))
    for name, width in (("o_proj", 32), ("down_proj", GPTConfig(**SMALL).hidden_dim())):
        raw = seen[(name, "raw")]
        assert raw.shape[-1] == width  # heads concatenated / the gated MLP activation
        assert torch.allclose(seen[(name, True)], F.rms_norm(raw, (width,), eps=1e-5), atol=1e-6)
        rms_on = seen[(name, True)].pow(2).mean(-1)
        rms_off = seen[(name, False)].pow(2).mean(-1)
        assert rms_on.min() > 0.5 and rms_off.max() < 0.1  # small init: only SubLN brings it to unit scale


def test_lambda_zero_ternary_model_equals_fp_model_exactly():
    q = make(quant=True)
    fp = make(quant=False)
    missing, unexpected = fp.load_state_dict(q.state_dict(), strict=False)
    assert not missing and all(k.endswith("lambda_") for k in unexpected)
    set_lambda(q, 0.0)
    idx = torch.randint(0, 60, (2, 20))
    assert torch.equal(q(idx, idx)[0], fp(idx, idx)[0])
    set_lambda(q, 1.0)
    assert not torch.allclose(q(idx, idx)[0], fp(idx, idx)[0])


def test_loss_is_cross_entropy_and_starts_near_ln_vocab():
    model = make()
    idx, tgt = torch.randint(0, 60, (4, 24)), torch.randint(0, 60, (4, 24))
    logits, loss = model(idx, tgt)
    assert torch.allclose(loss, F.cross_entropy(logits.view(-1, 61), tgt.view(-1)))
    assert abs(loss.item() - math.log(61)) < 0.3
    tgt[:, :10] = -1  # ignore_index
    assert torch.allclose(model(idx, tgt)[1], F.cross_entropy(logits[:, 10:].reshape(-1, 61), tgt[:, 10:].reshape(-1)))


@pytest.mark.parametrize("doc_mask", [False, True])
def test_model_is_causal(doc_mask):
    model = make(doc_mask=doc_mask)
    idx = torch.randint(0, 60, (1, 24))
    idx2 = idx.clone()
    idx2[0, 12:] = (idx2[0, 12:] + 7) % 60
    a, b = model(idx, idx)[0], model(idx2, idx2)[0]
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6) and not torch.allclose(a[:, 12:], b[:, 12:])


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = precompute_rope(8, 32, 10000.0)
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)

    def score(m, n):
        qm = apply_rope(q.view(1, 1, 1, 8), cos[m:m + 1], sin[m:m + 1])
        kn = apply_rope(k.view(1, 1, 1, 8), cos[n:n + 1], sin[n:n + 1])
        return (qm * kn).sum()
    assert torch.allclose(score(5, 2), score(20, 17), atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 4), atol=1e-3)


def test_rope_without_cat_is_the_rotation_formula_bit_for_bit():
    """apply_rope (x * cos + halves-swapped x * signed sin, no cat) equals the textbook rotation of
    the two halves, (x1 cos - x2 sin, x2 cos + x1 sin) computed in fp32 and concatenated, bit for
    bit, for fp32 and bf16 x laid out as the model's q (transposed heads), at every position; the
    tables are cos and sin of m * theta^(-2i/hd)."""
    hd, L = 16, 64
    cos, sin = precompute_rope(hd, L, 10000.0)
    inv_freq = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angle = torch.arange(L, dtype=torch.float64)[:, None] * inv_freq
    torch.testing.assert_close(cos[:, 0], angle.cos().float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[:, 1], angle.sin().float(), rtol=0, atol=1e-5)
    assert torch.equal(cos[:, 1], cos[:, 0]) and torch.equal(sin[:, 0], -sin[:, 1])
    c, s = cos[:, 0], sin[:, 1]  # (L, hd/2)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, L, 3, hd, generator=g) * 10).to(dtype).transpose(1, 2)  # (B, nh, T, hd)
        x1, x2 = x.float().chunk(2, dim=-1)
        want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(dtype)
        got = apply_rope(x, cos, sin)
        assert got.dtype == dtype and torch.equal(got, want), dtype


def test_rope_function_equals_autograd_through_the_formula():
    """model.RoPE (the eager path of apply_rope: no flip, a written-out backward) gives the forward
    and the gradient of autograd through x * cos + flip(x) * sin bit for bit, fp32 and bf16, for
    the model's transposed q and for per-document tables (B, 1, T, 2, hd/2)."""
    hd, L, B, nh = 16, 32, 2, 3
    cos, sin = precompute_rope(hd, L, 10000.0)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, L, (B, L), generator=g)
    for c, s in ((cos, sin), (cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(B, L, nh, hd, generator=g) * 3).to(dtype).transpose(1, 2)
            dy = torch.randn(B, nh, L, hd, generator=g).to(dtype)
            x1 = x.detach().requires_grad_()
            y = apply_rope(x1, c, s)
            y.backward(dy)
            x2 = x.detach().requires_grad_()
            xs = x2.unflatten(-1, (2, -1)).float()
            want = (xs * c + xs.flip(-2) * s).flatten(-2).to(dtype)
            want.backward(dy)
            assert torch.equal(y, want) and torch.equal(x1.grad, x2.grad), dtype


def test_packed_row_with_doc_mask_equals_each_document_alone():
    model = make(doc_mask=True)
    eot = SMALL["eot"]
    docs = [torch.tensor([eot] + list(range(1, 9))), torch.tensor([eot] + list(range(20, 26))),
            torch.tensor([eot, 40, 41, 42, 43])]
    row = torch.cat(docs).unsqueeze(0)  # (1, 21)
    targets = torch.cat([torch.cat([d[1:], torch.tensor([-1])]) for d in docs]).unsqueeze(0)
    logits, _ = model(row, targets)
    loss_tok = F.cross_entropy(logits[0], targets[0], ignore_index=-1, reduction="none")
    start = 0
    for d in docs:
        t = torch.cat([d[1:], torch.tensor([-1])]).unsqueeze(0)
        alone, _ = model(d.unsqueeze(0), t)
        n = len(d)
        assert torch.allclose(logits[0, start:start + n], alone[0], atol=1e-5)
        alone_loss = F.cross_entropy(alone[0], t[0], ignore_index=-1, reduction="none")
        assert torch.allclose(loss_tok[start:start + n], alone_loss, atol=1e-5)
        start += n
    plain = make(doc_mask=False)
    assert not torch.allclose(plain(row, targets)[0][0, 9:], logits[0, 9:], atol=1e-3)  # the mask matters


def test_states_are_the_ones_the_forward_uses():
    model = make(quant=True)
    idx, tgt = torch.randint(0, 60, (2, 16)), torch.randint(0, 60, (2, 16))
    logits, loss = model(idx, tgt)
    logits2, loss2, states = model.forward_with_states(idx, tgt, qkv_layer=-1, hiddens=True)
    assert torch.equal(logits, logits2) and torch.equal(loss, loss2)
    hiddens, (q, k, v) = states["hiddens"], states["qkv"]
    assert len(hiddens) == SMALL["n_layer"]
    assert torch.allclose(model.lm_head(model.norm_f(hiddens[-1])), logits, atol=1e-6)
    # recompute the last layer's q, k, v from the previous block's output
    blk = model.h[-1]
    x = blk.attn_norm(hiddens[-2])
    B, T, C = x.shape
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    q_ref = apply_rope(blk.attn.q_proj(x).view(B, T, 2, C // 2).transpose(1, 2), cos, sin)
    v_ref = blk.attn.v_proj(x).view(B, T, 2, C // 2).transpose(1, 2)
    assert torch.allclose(q, q_ref, atol=1e-6) and torch.allclose(v, v_ref, atol=1e-6) and k.shape == q.shape


@pytest.mark.parametrize("kw", [dict(), dict(doc_mask=True), dict(quant=False), dict(subln=False)])
def test_forward_returns_logits_and_loss_in_every_mode(kw):
    model = make(**kw)
    idx = torch.randint(0, 61, (2, 16))
    with_targets, without = model(idx, idx), model(idx)
    assert len(with_targets) == 2 and len(without) == 2
    assert with_targets[0].shape == (2, 16, 61) and with_targets[1].dim() == 0
    assert without[0].shape == (2, 1, 61) and without[1] is None  # generation: last position only
    assert torch.allclose(without[0][:, 0], with_targets[0][:, -1], atol=1e-5)


def test_document_mask_positions_restart_and_attention_stays_in_the_document():
    eot = 9
    idx = torch.tensor([[eot, 1, 2, eot, 3, eot, 4, 5]])
    pos, mask = document_mask(idx, eot)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    doc = [0, 0, 0, 1, 1, 2, 2, 2]
    expected = [[doc[i] == doc[j] and j <= i for j in range(8)] for i in range(8)]
    assert mask.shape == (1, 1, 8, 8) and mask[0, 0].tolist() == expected
    # a row that starts inside a document (no eot first) is its own document 0 until the first eot
    pos, mask = document_mask(torch.tensor([[1, 2, eot, 3]]), eot)
    assert pos.tolist() == [[0, 1, 0, 1]] and not mask[0, 0, 2, 1] and mask[0, 0, 1, 0]


def test_generate_greedy_matches_argmax_loop():
    model = make()
    idx = torch.randint(0, 60, (1, 5))
    out = model.generate(idx, 6, top_k=1)
    ref = idx
    for _ in range(6):
        logits = model(ref, torch.zeros_like(ref))[0][:, -1]
        ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)



def test_greedy_sampling_is_the_argmax_with_no_draw_and_the_lowest_id_among_equals():
    """sample_next with top_k=1: the argmax of the logits (among the first vocab ids), whatever the temperature;
    it draws nothing (the generator's state is unchanged: greedy decoding leaves a later sampled run's draws as
    they were) and of equal logits takes the lowest id every time (the exponential race took one of them at
    random)."""
    from model import sample_next
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 5.0], [2.0, 2.0, 2.0, -1.0, 0.0]])
    state = torch.get_rng_state()
    for temperature in (1.0, 0.1, 7.0):
        for _ in range(20):
            assert sample_next(logits, temperature, top_k=1).tolist() == [[4], [0]]
            assert sample_next(logits, temperature, top_k=1, vocab=4).tolist() == [[1], [0]]
    assert torch.equal(torch.get_rng_state(), state)
    assert sample_next(logits, top_k=2).shape == (2, 1) and not torch.equal(torch.get_rng_state(), state)

GQA = dict(n_kv_head=1, head_dim=24, qk_norm=True)  # Qwen3's attention: 2 query heads share one K/V head


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_generate_with_kv_cache_equals_full_forwards_past_block_size(quant, gqa, one_thread):
    # the cache must give what cropping and re-running the whole context gives, also once the context is
    # longer than block_size (the cache is refilled from the last block_size tokens), for a batch of prompts
    model = make(quant=quant, block_size=16, **(GQA if gqa else {})).eval()
    idx = torch.randint(0, 60, (3, 5))
    out = model.generate(idx, 14, top_k=1)  # 11 cached steps, then 3 refills
    ref = idx
    for _ in range(14):
        logits = model(ref[:, -16:])[0][:, -1]
        ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    s = DecodeState(model, 3)  # and the logits: a prefill then one step vs one full forward
    with torch.no_grad():
        model.forward_with_states(idx, cache=s.cache, pos=0)
        step = model.forward_with_states(out[:, 5:6], cache=s.cache, pos=5)[0]
        torch.testing.assert_close(step, model(out[:, :6])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fullgraph_compile_matches_eager_forward_and_backward():
    # At the endpoints lambda = 1 (ternary) and 0 (fp). In between, the blend v + lambda * (Q(v) - v) lies
    # off the int8 grid, and inductor's different fp rounding can flip a later rounding to the neighbouring
    # int8 code, moving logits by a quantisation step; that is the quantiser, not the compile.
    model = make(quant=True)
    idx, tgt = torch.randint(0, 60, (2, 16)), torch.randint(0, 60, (2, 16))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # inductor: a graph break or a host sync would raise
    for lam in (1.0, 0.0):
        set_lambda(model, lam)
        logits_c, loss_c = compiled(idx, tgt)
        loss_c.backward()
        grads_c = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        logits_e, loss_e = model(idx, tgt)
        loss_e.backward()
        assert torch.allclose(logits_c, logits_e, atol=1e-5) and torch.allclose(loss_c, loss_e, atol=1e-6)
        for gc, p in zip(grads_c, model.parameters()):
            assert torch.allclose(gc, p.grad, atol=1e-5)
        model.zero_grad(set_to_none=True)


def test_compile_runs_the_norms_formula_not_the_eager_rmsnormcpu(monkeypatch):
    """quant.RMSNormCPU (the eager CPU norm: in-place forward, hand-written backward) is never traced: under
    torch.compile the norms run F.rms_norm and the quantiser as formulas, which inductor fuses and differentiates.
    Traced, torch 2.11's compile returned wrong gradients (torch 2.13's did not, so the test above cannot
    tell); eager, every norm still runs it."""
    import quant
    calls, forward = [], quant.RMSNormCPU.forward

    def watched(ctx, *args):
        calls.append(torch.compiler.is_compiling())
        return forward(ctx, *args)
    monkeypatch.setattr(quant.RMSNormCPU, "forward", staticmethod(watched))
    model = make(quant=True)
    idx = torch.randint(0, 60, (2, 16))
    torch._dynamo.reset()
    torch.compile(model, backend="eager", fullgraph=True)(idx, idx)[1].backward()
    assert calls == []
    model(idx, idx)
    norms = sum(isinstance(m, quant.RMSNorm) and m.weight is not None for m in model.modules())
    assert calls == [False] * norms and norms > 0


@pytest.mark.slow
@pytest.mark.parametrize("doc_mask", [False, True])
def test_changing_lambda_does_not_recompile(doc_mask):
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    model = make(quant=True, doc_mask=doc_mask)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    idx = torch.randint(0, 61, (2, 16))
    outs = []
    for lam in (0.0, 0.3, 1.0, 0.7):
        set_lambda(model, lam)
        outs.append(compiled(idx, idx)[0])
    assert counter.frame_count == 1  # one graph for every lambda: it is read from a buffer, not baked in
    set_lambda(model, 0.0)
    assert torch.equal(outs[0], model(idx, idx)[0]) and not torch.allclose(outs[0], outs[2])


# -----------------------------------------------------------------------------
# fused projections: q/k/v and gate/up as one matmul each, every matrix with its own gamma


def _unfused(model):
    import copy
    other = copy.deepcopy(model)
    for m in other.modules():
        if hasattr(m, "fused"):
            m.fused = False
    return other


@pytest.mark.parametrize("quant,lam,gqa", [(True, 1.0, False), (True, 0.3, False), (False, 0.0, False),
                                           (True, 1.0, True)])
def test_fused_projections_equal_separate_ones_forward_and_backward(quant, lam, gqa):
    fused = make(quant=quant, **(GQA if gqa else {}))  # GQA: q, k, v of unequal widths (48, 24, 24)
    set_lambda(fused, lam)
    sep = _unfused(fused)
    with torch.no_grad():  # very different scales per matrix: one shared gamma would quantise them differently
        for block in fused.h:
            block.attn.k_proj.weight.mul_(5.0)
            block.mlp.up_proj.weight.mul_(0.2)
    sep.load_state_dict(fused.state_dict())
    idx = torch.randint(0, 60, (3, 32), generator=torch.Generator().manual_seed(1))
    lf, loss_f = fused(idx, idx)
    ls, loss_s = sep(idx, idx)
    torch.testing.assert_close(lf, ls, rtol=1e-5, atol=1e-5)
    loss_f.backward()
    loss_s.backward()
    for (name, a), b in zip(fused.named_parameters(), sep.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the state dict keeps q, k, v (gate, up) as separate matrices: checkpoints and exports are unchanged
    assert {"h.0.attn.q_proj.weight", "h.0.attn.k_proj.weight", "h.0.mlp.gate_proj.weight"} <= set(fused.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_autograd_through_silu_times_up_bit_for_bit_with_one_gradient(dtype):
    """SiLUMul on the stacked [gate | up] product: the forward and the gradient equal autograd through
    F.silu(gate) * up of the split product, bit for bit, and backward makes no cat (its gradient is one tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from model import SiLUMul

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    gu = (torch.randn(3, 7, 2 * 24) * 4).to(dtype).requires_grad_()
    g = torch.randn(3, 7, 24).to(dtype)
    gate, up = gu.split(24, dim=-1)
    ref = F.silu(gate) * up
    ref_grad, = torch.autograd.grad(ref, gu, g)
    h = SiLUMul.apply(gu)
    ops = Ops()
    ops.seen = []
    with ops:
        grad, = torch.autograd.grad(h, gu, g)
    assert torch.equal(h, ref) and torch.equal(grad, ref_grad)
    assert not any(name.startswith("cat") for name in ops.seen), ops.seen


def test_stacked_linear_keeps_one_gamma_per_matrix_and_quantises_its_input_once():
    from quant import activation_fake_quant, stacked_linear, weight_fake_quant
    torch.manual_seed(0)
    layers = [BitLinear(16, n) for n in (8, 4, 12)]
    with torch.no_grad():
        layers[1].weight.mul_(10.0)  # gamma 10x the others'
    x = torch.randn(2, 5, 16)
    outs = stacked_linear(x, layers)
    xq = activation_fake_quant(x)
    for m, y in zip(layers, outs):  # the closed form, matrix by matrix, each with its own absmean
        torch.testing.assert_close(y, xq @ weight_fake_quant(m.weight).T, rtol=1e-5, atol=1e-6)
    one_gamma = weight_fake_quant(torch.cat([m.weight for m in layers]))  # what a shared scale would compute
    assert (torch.cat(outs, -1) - xq @ one_gamma.T).abs().max() > 0.1
    with pytest.raises(ValueError, match="quantise their input"):
        stacked_linear(x, [BitLinear(16, 4), BitLinear(16, 4, quantize_input=False)])


# -----------------------------------------------------------------------------
# grouped-query attention (n_kv_head), a head_dim of its own and q/k norms: what from_pretrained needs


def test_todays_config_builds_todays_attention():
    """Checkpoints saved before n_kv_head, head_dim and qk_norm existed have none of them: the defaults give the
    model they were trained as (square q, k, v, o; no q/k norm parameters)."""
    model, c = make(), GPTConfig(**SMALL)
    assert (c.kv_heads(), c.head_size()) == (2, 16)
    attn = model.h[0].attn
    assert all(getattr(attn, n).weight.shape == (32, 32) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert not any("q_norm" in n or "k_norm" in n for n in model.state_dict())
    assert model.rope_cos.shape == (32, 2, 8)  # (block_size, both halves, hd/2)


def test_gqa_model_shapes_and_its_states():
    model = make(n_head=4, **GQA)  # 4 query heads of 24, 1 K/V head; q_proj 32 -> 96, k and v 32 -> 24
    attn = model.h[0].attn
    shapes = [getattr(attn, n).weight.shape for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert shapes == [(96, 32), (24, 32), (24, 32), (32, 96)]
    assert attn.subln.weight.shape == (96,) and attn.q_norm.weight.shape == attn.k_norm.weight.shape == (24,)
    assert model.rope_cos.shape == (32, 2, 12)
    q, k, v = model.forward_with_states(torch.randint(0, 60, (2, 10)), qkv_layer=-1)[2]["qkv"]
    assert q.shape == (2, 4, 10, 24) and k.shape == v.shape == (2, 1, 10, 24)  # the K/V heads, not repeated
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        make(n_head=4, n_kv_head=3)


def test_gqa_equals_attention_with_each_kv_head_repeated_for_its_query_heads():
    """GQA with 2 K/V heads for 4 query heads is full multi-head attention whose K/V head h is K/V head h // 2 of
    the grouped model (transformers' repeat_kv)."""
    gqa = make(quant=False, n_head=4, n_kv_head=2)
    mha = make(quant=False, n_head=4)
    sd = gqa.state_dict()
    for key in [k for k in sd if k.endswith(("k_proj.weight", "v_proj.weight"))]:
        sd[key] = sd[key].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)  # K/V head j -> heads 2j, 2j+1
    mha.load_state_dict(sd)
    idx = torch.randint(0, 60, (2, 20))
    torch.testing.assert_close(gqa(idx, idx)[0], mha(idx, idx)[0], rtol=1e-5, atol=1e-5)


def test_gqa_model_with_qk_norms_trains():
    model = make(n_head=4, **GQA)
    idx, tgt = torch.randint(0, 60, (4, 24)), torch.randint(0, 60, (4, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(idx, tgt)[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for name, p in model.named_parameters():  # every matrix and gain gets a gradient, q/k norms included
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_packed_inference_with_gqa():
    """freeze_ternary stacks q, k, v of unequal widths into one packed call; the same numbers as layer by layer,
    and within the packed path's tolerance of the fake-quantised model (tests/test_packed.py says why 5%)."""
    import copy
    from kernels.packed_linear import freeze_ternary
    model = make(n_head=4, **GQA).eval()
    frozen = freeze_ternary(copy.deepcopy(model))
    idx = torch.randint(0, 60, (2, 16))
    with torch.no_grad():
        ref, out = model(idx, idx)[0], frozen(idx, idx)[0]
        torch.testing.assert_close(out, ref, rtol=0, atol=0.05 * ref.abs().max().item())
        assert torch.equal(out, _unfused(frozen)(idx, idx)[0])
        assert torch.equal(frozen.generate(idx[:, :4], 6, top_k=1)[:, :4], idx[:, :4])


def test_qk_clip_with_gqa_records_every_query_heads_max_and_caps_it_exactly():
    import lessons.muon_variants as mv
    torch.manual_seed(0)
    model = make(quant=False, n_head=4, n_kv_head=2).train()
    with torch.no_grad():  # the query heads' logits far apart: head h's rows scaled by 3^h
        model.h[0].attn.q_proj.weight.mul_(torch.tensor([1.0, 3.0, 9.0, 27.0]).repeat_interleave(8)[:, None] * 20)
    qk = mv.QKClip(model, rows=2)
    x = torch.randint(0, 60, (2, 16))

    def recorded():
        qk.after_step(0, ok=False)
        model(x)
        return qk.max_logits[0].clone()
    before = recorded()
    q, k, _ = model.forward_with_states(x, qkv_layer=0)[2]["qkv"]
    s = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / math.sqrt(8)  # (2, 4, T, T), each head's own K
    s = s.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(before, s.amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    qk.tau = tau = float(before.sort().values[1:3].mean())  # heads 2 and 3 over tau: one of each K/V group's pair
    over = before > tau
    assert over.tolist() == [False, False, True, True]
    w_k = model.h[0].attn.k_proj.weight.clone()
    qk.after_step(1, ok=True)
    after = recorded()
    # the shared K head takes sqrt of its group's smallest gamma (head 3's); the untouched group's K rows stay
    k_scale = (tau / before[3]).sqrt()
    assert torch.equal(model.h[0].attn.k_proj.weight[:8], w_k[:8])
    torch.testing.assert_close(model.h[0].attn.k_proj.weight[8:], w_k[8:] * k_scale)
    torch.testing.assert_close(after[over], torch.full((2,), tau), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[~over], before[~over], rtol=1e-5, atol=0)  # its K/V partners keep theirs
    with pytest.raises(ValueError, match="qk_norm=True"):
        mv.QKClip(make(qk_norm=True), tau=100.0)


def test_relation_distillation_reads_gqa_states():
    from distill import attention_relation_loss
    teacher, student = make(n_head=4, n_kv_head=2, quant=False), make(n_head=4, n_kv_head=1, head_dim=16)
    idx = torch.randint(0, 60, (2, 12))
    t_qkv = teacher.forward_with_states(idx, qkv_layer=-1)[2]["qkv"]
    s_qkv = student.forward_with_states(idx, qkv_layer=-1)[2]["qkv"]
    assert torch.equal(attention_relation_loss(t_qkv, t_qkv, 8), torch.zeros(()))
    loss = attention_relation_loss(s_qkv, t_qkv, 8)  # K/V: 16 wide in the student, 16 in the teacher
    loss.backward()
    assert loss > 0 and student.h[-1].attn.k_proj.weight.grad.abs().sum() > 0


# -----------------------------------------------------------------------------
# the norms under bf16 autocast


@pytest.mark.parametrize("quant", [False, True])
def test_norms_under_bf16_autocast_reach_the_fused_kernel_and_are_nn_rmsnorm_in_fp32(quant, monkeypatch):
    """Every norm casts its fp32 gain to its input's dtype: under bf16 autocast (bf16 SubLN and q/k-norm inputs, fp32
    gains) torch.rms_norm sees one dtype and does not fall back to the unfused RMSNorm ("Mismatch dtype between input
    and weight", warned once per process), and in fp32 each norm is nn.RMSNorm's op on the same tensors, bit for bit."""
    model = make(quant=quant, qk_norm=True)
    idx = torch.randint(0, 61, (2, 16))
    seen, rms_norm = [], torch.rms_norm
    monkeypatch.setattr(torch, "rms_norm", lambda x, shape, w=None, eps=None: (
        seen.append((x.dtype, w.dtype)), rms_norm(x, shape, w, eps))[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, idx)[1].backward()
    assert (torch.bfloat16, torch.bfloat16) in seen and all(a == b for a, b in seen), seen
    monkeypatch.undo()
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == SMALL["n_layer"] * 6 + 1  # attn, mlp, two SubLN, q and k norms per block; norm_f
    x = torch.randn(3, 5, 32)
    for n in (model.norm_f, model.h[0].mlp_norm, model.h[0].attn.subln):
        ref = nn.RMSNorm(n.normalized_shape, eps=n.eps)
        ref.weight.data.copy_(torch.randn(n.normalized_shape))
        n.weight.data.copy_(ref.weight.data)
        got = n(x[..., :n.normalized_shape[0]])
        want = ref(x[..., :n.normalized_shape[0]])
        if quant and n is not model.norm_f:
            want = quant_of(want, n)
        assert torch.equal(got, want)


def quant_of(y, norm):
    from quant import activation_fake_quant, ste
    return ste(y, activation_fake_quant(y), norm.lambda_)
