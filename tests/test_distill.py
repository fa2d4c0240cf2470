"""Tests for distill.py: closed forms, independent loop implementations, masking, gradients.
Run: python -m pytest tests/test_distill.py -q"""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from distill import (PRESETS, BitDistillLoss, attention_relation_loss, hidden_state_loss, late_layer_weights,
                     logits_kd_loss, match_layers)


def _qkv(B, H, T, d, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, d, generator=g).requires_grad_(requires_grad) for _ in range(3))


def _loop_relation_loss(student_qkv, teacher_qkv, n_rel, temperature=1.0, mask=None, causal=True):
    """Straightforward per-tensor, per-head, per-row KL with Python floats; independent of distill.py."""
    def vectors(x, b, a, i):  # relation-head a of token i: slice of the concatenated heads, L2-normalised
        flat = [float(x[b, h, i, e]) for h in range(x.shape[1]) for e in range(x.shape[3])]
        dr = len(flat) // n_rel
        v = flat[a * dr:(a + 1) * dr]
        n = math.sqrt(sum(c * c for c in v))
        return [c / n for c in v]

    def row(x, b, a, i, keys):
        qi = vectors(x, b, a, i)
        s = [sum(u * w for u, w in zip(qi, vectors(x, b, a, j))) / temperature for j in keys]
        m = max(s)
        z = sum(math.exp(v - m) for v in s)
        return [math.exp(v - m) / z for v in s]

    B, _, T, _ = student_qkv[0].shape
    valid = [[True] * T for _ in range(B)] if mask is None else mask.tolist()
    total = 0.0
    for xs, xt in zip(student_qkv, teacher_qkv):
        kl_sum, rows = 0.0, 0
        for b in range(B):
            for a in range(n_rel):
                for i in range(T):
                    if not valid[b][i]:
                        continue
                    keys = [j for j in range(T) if (j <= i or not causal) and valid[b][j]]
                    pt, ps = row(xt, b, a, i, keys), row(xs, b, a, i, keys)
                    kl_sum += sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt, ps))
                    rows += 1
        total += kl_sum / rows
    return total / n_rel


# ----------------------------------------------------------------------------- logits KD

def test_logits_kd_identical_is_exactly_zero():
    z = torch.randn(2, 5, 11)
    assert logits_kd_loss(z, z.clone()).item() == 0.0


def test_logits_kd_matches_closed_form_v3_tau2():
    zs, zt, tau = [0.3, -1.0, 2.0], [1.5, 0.5, -0.5], 2.0

    def softmax(z):
        e = [math.exp(v / tau) for v in z]
        return [v / sum(e) for v in e]
    pt, ps = softmax(zt), softmax(zs)
    expected = tau ** 2 * sum(p * math.log(p / q) for p, q in zip(pt, ps))
    got = logits_kd_loss(torch.tensor([[zs]]), torch.tensor([[zt]]), temperature=tau).item()
    assert got == pytest.approx(expected, rel=1e-6)


def test_logits_kd_v2_tau2_hand_value():
    # z_t = (2, 0), z_s = (0, 0), tau = 2: p_t = (s, 1-s) with s = sigmoid(1), p_s = (1/2, 1/2)
    s = 1 / (1 + math.exp(-1))
    expected = 4 * (s * math.log(2 * s) + (1 - s) * math.log(2 * (1 - s)))
    got = logits_kd_loss(torch.zeros(1, 2), torch.tensor([[2.0, 0.0]]), temperature=2.0).item()
    assert got == pytest.approx(expected, rel=1e-6)


def test_logits_kd_mask_excludes_padding_and_averages_over_valid_only():
    torch.manual_seed(0)
    zs, zt = torch.randn(3, 6, 7), torch.randn(3, 6, 7)
    mask = torch.rand(3, 6) > 0.4
    mask[0, 0] = True
    loss = logits_kd_loss(zs, zt, mask=mask)
    zs2, zt2 = zs.clone(), zt.clone()
    zs2[~mask] = 100 * torch.randn_like(zs2[~mask])
    zt2[~mask] = -50.0
    assert torch.equal(logits_kd_loss(zs2, zt2, mask=mask), loss)
    assert logits_kd_loss(zs[mask], zt[mask]).item() == pytest.approx(loss.item(), rel=1e-6)
    assert logits_kd_loss(zs, zt, mask=mask.long()).item() == pytest.approx(loss.item(), rel=1e-6)
    assert logits_kd_loss(zs, zt).item() != pytest.approx(loss.item(), rel=1e-3)


def test_logits_kd_no_valid_token_is_zero_not_nan():
    out = logits_kd_loss(torch.randn(2, 3, 5), torch.randn(2, 3, 5), mask=torch.zeros(2, 3, dtype=torch.bool))
    assert out.item() == 0.0


def test_logits_kd_bf16_teacher_computes_in_fp32():
    zs, zt = torch.randn(2, 4, 9), torch.randn(2, 4, 9)
    out = logits_kd_loss(zs, zt.bfloat16())
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(logits_kd_loss(zs, zt.bfloat16().float()).item(), rel=1e-6)


# ----------------------------------------------------------------------------- attention relations

def test_relation_loss_identical_is_exactly_zero():
    qkv = _qkv(2, 4, 6, 8, seed=1)
    for causal in (True, False):
        assert attention_relation_loss(qkv, tuple(x.clone() for x in qkv), 4, causal=causal).item() == 0.0
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert attention_relation_loss(qkv, qkv, 8, mask=mask).item() == 0.0


def test_relation_loss_positive_for_different_inputs():
    assert attention_relation_loss(_qkv(2, 4, 6, 8, 1), _qkv(2, 4, 6, 8, 2), 4).item() > 1e-3


def test_relation_loss_invariant_to_positive_per_vector_scaling():
    s, t = _qkv(2, 2, 5, 8, 3), _qkv(2, 2, 5, 8, 4)
    g = torch.Generator().manual_seed(5)
    # A_r = 4 = 2 * H, so every relation vector lies inside one head vector and scales with it
    scaled = tuple(x * (0.01 + 10 * torch.rand(2, 2, 5, 1, generator=g)) for x in s)
    a, b = attention_relation_loss(s, t, 4), attention_relation_loss(scaled, t, 4)
    assert b.item() == pytest.approx(a.item(), rel=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_relation_loss_matches_loop_implementation(causal):
    s, t = _qkv(2, 2, 4, 4, 6), _qkv(2, 2, 4, 4, 7)
    got = attention_relation_loss(s, t, 2, temperature=0.5, causal=causal).item()
    assert got == pytest.approx(_loop_relation_loss(s, t, 2, 0.5, causal=causal), rel=1e-5)


def test_relation_loss_mask_matches_loop_and_ignores_padded_tokens():
    s, t = _qkv(2, 2, 5, 4, 8), _qkv(2, 2, 5, 4, 9)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    for causal in (True, False):
        got = attention_relation_loss(s, t, 4, mask=mask, causal=causal)
        assert got.item() == pytest.approx(_loop_relation_loss(s, t, 4, mask=mask, causal=causal), rel=1e-5)
        s2 = tuple(torch.where(mask[:, None, :, None], x, 7 * torch.randn_like(x)) for x in s)
        assert attention_relation_loss(s2, t, 4, mask=mask, causal=causal).item() == pytest.approx(got.item(),
                                                                                                    rel=1e-6)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_relation_loss_left_padding_keeps_backward_nan_free():
    # with a causal mask, a left-padded row has no valid key; its softmax must not go through NaN
    s, t = _qkv(2, 2, 5, 4, 16, requires_grad=True), _qkv(2, 2, 5, 4, 17)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    with torch.autograd.detect_anomaly():
        attention_relation_loss(s, t, 4, mask=mask).backward()
    assert all(torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0 for x in s)


def test_relation_loss_teacher_with_different_head_count():
    s, t = _qkv(2, 2, 5, 16, 10), _qkv(2, 4, 5, 8, 11)  # student H=2,d=16; teacher H=4,d=8; A_r=4
    got = attention_relation_loss(s, t, 4)
    assert got.item() > 0
    assert got.item() == pytest.approx(_loop_relation_loss(s, t, 4), rel=1e-5)
    t_wide = _qkv(2, 4, 5, 16, 12)  # teacher H*d = 64 vs student 32: relations are T x T either way
    assert attention_relation_loss(s, t_wide, 4).item() == pytest.approx(_loop_relation_loss(s, t_wide, 4),
                                                                         rel=1e-5)


def test_relation_and_other_width_hidden_losses_compute_in_fp32_under_autocast():
    """Stage 3 calls the losses inside the step's autocast (bf16 on a GPU; --dtype=bfloat16 on a CPU), which runs
    a matmul in bf16 whatever its inputs: the relation scores and the token similarities would be rounded to bf16
    before the softmax and the MSE. Under autocast each loss equals its value without it, bit for bit."""
    s, t = _qkv(2, 4, 16, 8, 11), _qkv(2, 4, 16, 8, 12)
    g = torch.Generator().manual_seed(13)
    hs, ht = torch.randn(2, 16, 8, generator=g), torch.randn(2, 16, 12, generator=g)
    want = attention_relation_loss(s, t, 4), hidden_state_loss([hs], [ht])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention_relation_loss(s, t, 4), hidden_state_loss([hs], [ht])
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(got, want)), (got, want)


def test_relation_loss_non_divisible_raises_with_sizes_and_suggestion():
    s, t = _qkv(1, 3, 4, 4, 13), _qkv(1, 4, 4, 8, 14)  # student H*d = 12, teacher 32
    with pytest.raises(ValueError) as e:
        attention_relation_loss(s, t, 8)
    msg = str(e.value)  # the argument and its bad value, the size it must divide, and a value that works
    assert "n_relation_heads=8" in msg and "12" in msg and "n_relation_heads=4" in msg, msg


# ----------------------------------------------------------------------------- hidden states

def test_hidden_state_loss_matches_manual_and_weights():
    g = torch.Generator().manual_seed(15)
    hs = [torch.randn(2, 3, 6, generator=g) for _ in range(3)]
    ht = [torch.randn(2, 3, 6, generator=g) for _ in range(3)]

    def manual(a, b):
        return ((a / a.norm(dim=-1, keepdim=True) - b / b.norm(dim=-1, keepdim=True)) ** 2).mean().item()
    per_layer = [manual(a, b) for a, b in zip(hs, ht)]
    assert hidden_state_loss(hs, ht).item() == pytest.approx(sum(per_layer) / 3, rel=1e-6)
    assert hidden_state_loss(hs, ht, [2.0, 0.0, 0.0]).item() == pytest.approx(per_layer[0], rel=1e-6)
    w = late_layer_weights(3)
    assert w == pytest.approx([1 / 6, 2 / 6, 3 / 6])
    assert hidden_state_loss(hs, ht, [1, 2, 3]).item() == pytest.approx(
        sum(wi * p for wi, p in zip(w, per_layer)), rel=1e-6)
    assert late_layer_weights(4) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert hidden_state_loss(hs, hs).item() == 0.0


def test_hidden_state_loss_rejects_mismatched_tokens():
    with pytest.raises(ValueError) as e:
        hidden_state_loss([torch.randn(1, 2, 4)], [torch.randn(1, 3, 8)])
    assert "(1, 2, 4)" in str(e.value) and "(1, 3, 8)" in str(e.value), e.value  # both shapes named


def test_hidden_state_loss_other_width_compares_token_similarities():
    g = torch.Generator().manual_seed(3)
    hs, other = torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 8, generator=g)
    # a wider teacher whose states are the student's through orthonormal rows (Q Q^T = I): every cosine
    # similarity between tokens is the same, so the loss is 0; anything else is not
    Q = torch.linalg.qr(torch.randn(8, 4, generator=g))[0].T  # (4, 8), orthonormal rows
    assert hidden_state_loss([hs], [hs @ Q]).item() == pytest.approx(0.0, abs=1e-6)
    a = hs / hs.norm(dim=-1, keepdim=True)
    b = other / other.norm(dim=-1, keepdim=True)
    manual = ((a @ a.transpose(1, 2) - b @ b.transpose(1, 2)) ** 2).mean().item()  # MSE of (B, T, T) matrices
    assert hidden_state_loss([hs], [other]).item() == pytest.approx(manual, rel=1e-6)
    assert manual > 0.01


def test_match_layers_is_tinyberts_uniform_map():
    assert match_layers(4, 4) == [0, 1, 2, 3]
    assert match_layers(4, 8) == [1, 3, 5, 7]  # student block m reads teacher block m * N / M (1-based)
    assert match_layers(4, 2) == [0, 0, 1, 1]
    assert match_layers(3, 12) == [3, 7, 11]  # the last student block always reads the last teacher block


# ----------------------------------------------------------------------------- several teachers

def test_mixture_target_equals_hand_computed_mixture():
    g = torch.Generator().manual_seed(7)
    zs, z1, z2 = (torch.randn(2, 3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    tau, w = 2.0, (0.7, 0.3)
    p1, p2, ps = ((z / tau).softmax(-1) for z in (z1, z2, zs))
    p = w[0] * p1 + w[1] * p2  # the mixture of the tempered distributions, by hand
    expected = tau ** 2 * (p * (p.log() - ps.log())).sum(-1).mean().item()
    got = logits_kd_loss(zs.float(), [z1.float(), z2.float()], temperature=tau, weights=w).item()
    assert got == pytest.approx(expected, rel=1e-5)
    # weights are normalised; a teacher of weight 0 is left out entirely
    assert logits_kd_loss(zs, [z1, z2], tau, weights=(7, 3)).item() == pytest.approx(expected, rel=1e-6)
    assert logits_kd_loss(zs, [z1, z2], tau, weights=(1, 0)).item() == logits_kd_loss(zs, z1, tau).item()


def test_two_identical_teachers_equal_one_teacher():
    g = torch.Generator().manual_seed(8)
    zs, zt = torch.randn(2, 4, 9, generator=g), torch.randn(2, 4, 9, generator=g)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]]).bool()
    one = logits_kd_loss(zs, zt, 5.0, mask=mask)
    assert logits_kd_loss(zs, [zt, zt.clone()], 5.0, mask=mask).item() == pytest.approx(one.item(), rel=1e-6)
    assert logits_kd_loss(zs, [zt], 5.0, mask=mask).item() == one.item()  # a list of one is exactly one teacher


def test_mixture_weights_must_fit_the_teachers():
    z = torch.randn(1, 2, 3)
    for w in ((1.0,), (1.0, -1.0), (0.0, 0.0)):
        with pytest.raises(ValueError):
            logits_kd_loss(z, [z, z], weights=w)


# ----------------------------------------------------------------------------- BitDistillLoss

def test_presets_and_overrides():
    assert PRESETS == {"classification": dict(kd_logits=10.0, kd_relation=1e5),
                       "summarization": dict(kd_logits=1.0, kd_relation=1e3),
                       "logits": dict(kd_logits=1.0, kd_relation=0.0)}
    c = BitDistillLoss("classification")
    assert (c.kd_logits, c.kd_relation) == (10.0, 1e5)
    s = BitDistillLoss("summarization")
    assert (s.kd_logits, s.kd_relation, s.kd_hidden, s.n_relation_heads, s.distill_layer) == (1.0, 1e3, 0.0, 32, -1)
    o = BitDistillLoss("classification", kd_logits=2.0, kd_relation=0.0)
    assert (o.kd_logits, o.kd_relation) == (2.0, 0.0)
    with pytest.raises(ValueError) as e:
        BitDistillLoss("translation")
    assert all(w in str(e.value) for w in ("translation", "classification", "summarization")), e.value


def test_layer_index_resolution():
    assert BitDistillLoss().layer_index(12) == 11
    assert BitDistillLoss(distill_layer=-3).layer_index(12) == 9
    assert BitDistillLoss(distill_layer=3).layer_index(12) == 3
    for bad in (12, -13):
        with pytest.raises(ValueError) as e:
            BitDistillLoss(distill_layer=bad).layer_index(12)
        msg = str(e.value)  # the argument, its bad value and the valid range for 12 layers
        assert f"distill_layer={bad}" in msg and "-12" in msg and "11" in msg, msg


def _batch(requires_grad=False):
    g = torch.Generator().manual_seed(20)
    B, T, V = 2, 4, 10
    zs = torch.randn(B, T, V, generator=g).requires_grad_(requires_grad)
    zt = torch.randn(B, T, V, generator=g).requires_grad_(requires_grad)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, -1] = targets[1, 0] = -1
    hs = [torch.randn(B, T, 6, generator=g).requires_grad_(requires_grad) for _ in range(2)]
    ht = [torch.randn(B, T, 6, generator=g).requires_grad_(requires_grad) for _ in range(2)]
    return zs, zt, targets, _qkv(B, 2, T, 4, 21, requires_grad), _qkv(B, 4, T, 2, 22, requires_grad), hs, ht


def test_total_equals_weighted_sum_recomputed_independently():
    zs, zt, targets, qs, qt, hs, ht = _batch()
    crit = BitDistillLoss("classification", kd_hidden=0.5, n_relation_heads=2, temperature=3.0)
    out = crit(zs, zt, targets, qs, qt, hs, ht)
    valid = targets != -1
    logp = zs.log_softmax(-1)
    ce = -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0][valid].mean()
    ld = 9.0 * F.kl_div((zs / 3).log_softmax(-1)[valid], (zt / 3).log_softmax(-1)[valid], log_target=True,
                        reduction="batchmean")
    ad = _loop_relation_loss(qs, qt, 2)
    w = late_layer_weights(2)
    hid = sum(wi * ((F.normalize(a, dim=-1) - F.normalize(b, dim=-1)) ** 2).mean() for wi, a, b in zip(w, hs, ht))
    for key, ref in (("ce", ce), ("kd_logits", ld), ("kd_relation", ad), ("kd_hidden", hid)):
        assert out[key].item() == pytest.approx(float(ref), rel=1e-5), key
    assert out["loss"].item() == pytest.approx(float(ce + 10 * ld + 1e5 * ad + 0.5 * hid), rel=1e-5)


def test_default_is_the_logits_preset_of_train_py():
    """BitDistillLoss() is what train.py runs by default (TrainConfig.distill_preset): logits KD, kd_logits 1,
    kd_relation 0, no hidden states; it needs only the logits and the targets."""
    from tools.config import TrainConfig
    d = BitDistillLoss()
    assert d.preset == TrainConfig.distill_preset == "logits"
    assert (d.kd_logits, d.kd_relation, d.kd_hidden, d.n_relation_heads, d.distill_layer) == (1.0, 0.0, 0.0, 32, -1)
    zs, zt, targets, *_ = _batch()
    out = d(zs, zt, targets)  # no q/k/v, no hidden states
    assert out["kd_relation"].item() == 0.0 and out["kd_hidden"].item() == 0.0
    assert torch.equal(out["loss"], out["ce"] + out["kd_logits"])


def test_kd_relation_zero_allows_missing_qkv_and_hidden_off_by_default():
    zs, zt, targets, *_ = _batch()
    out = BitDistillLoss("summarization", kd_relation=0.0)(zs, zt, targets, None, None)
    assert out["kd_relation"].item() == 0.0 and out["kd_hidden"].item() == 0.0
    assert out["loss"].item() == pytest.approx((out["ce"] + out["kd_logits"]).item(), rel=1e-6)
    with pytest.raises(ValueError) as e:
        BitDistillLoss("summarization")(zs, zt, targets)
    msg = str(e.value)  # what is missing, and the fix: pass it or switch the loss off
    assert "student_qkv" in msg and "kd_relation=0" in msg, msg


def test_gradients_reach_student_only():
    zs, zt, targets, qs, qt, hs, ht = _batch(requires_grad=True)
    out = BitDistillLoss("summarization", kd_hidden=1.0, n_relation_heads=2)(zs, zt, targets, qs, qt, hs, ht)
    out["loss"].backward()
    for t in (zt, *qt, *ht):
        assert t.grad is None
    for s in (zs, *qs, *hs):
        assert s.grad is not None and s.grad.abs().sum().item() > 0
        assert torch.isfinite(s.grad).all()


def test_teachers_run_without_targets_and_give_every_positions_logits():
    """A teacher's cross-entropy is never used, and over (B, T, V) in fp32 it is a large transient (~5 GB at Qwen3's
    vocabulary and 8 x 1024 tokens): teacher_student_loss calls each teacher without targets, asking for every
    position's logits, which equal those of a forward with targets; the loss is what it was."""
    from distill import teacher_student_loss
    from model import GPT, GPTConfig

    class Teacher(GPT):
        def forward_with_states(self, idx, targets=None, **kw):
            assert targets is None, "a teacher was given targets: its cross-entropy computed for nothing"
            return super().forward_with_states(idx, targets, **kw)
    conf = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    student, teachers = GPT(conf), [Teacher(dataclasses.replace(conf, quant=False)) for _ in range(2)]
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    crit = BitDistillLoss("summarization", n_relation_heads=2, kd_hidden=1.0)
    loss, parts = teacher_student_loss(student, teachers, crit, conf.n_layer)(x, y)
    logits, loss_none, _ = teachers[0].forward_with_states(x, all_logits=True)
    assert loss_none is None and torch.equal(logits, GPT.forward_with_states(teachers[0], x, y)[0])
    assert torch.isfinite(loss) and parts["kd_relation"] > 0


def test_logits_kd_is_over_the_tokenizers_ids_not_the_padding_rows(monkeypatch):
    """A --pad_vocab model has rows past its tokenizer's ids (no token); at tau = 5 an untrained teacher's padding
    rows held ~11 % of its mass, all of it distilled. BitDistillLoss(vocab=n) takes the logits KD over ids < n, for
    one teacher or several; vocab=None keeps every row; train.py gives it the tokenizer's size."""
    torch.manual_seed(0)
    zs, zt, zt2 = (torch.randn(2, 3, 8) for _ in range(3))
    zt[..., 5:] += 3.0  # the teacher's padding rows likely
    y = torch.randint(0, 5, (2, 3))
    got = BitDistillLoss(vocab=5)(zs, zt, y)["kd_logits"]
    assert torch.allclose(got, logits_kd_loss(zs[..., :5], zt[..., :5], 5.0)) and not torch.allclose(
        got, BitDistillLoss()(zs, zt, y)["kd_logits"])
    two = BitDistillLoss(vocab=5, teacher_weights=[0.3, 0.7])(zs, [zt, zt2], y)["kd_logits"]
    assert torch.allclose(two, logits_kd_loss(zs[..., :5], [zt[..., :5], zt2[..., :5]], 5.0, weights=[0.3, 0.7]))
    import train
    from tools import start
    seen = {}
    monkeypatch.setattr(start, "make_teachers", lambda *a: seen.update(vocab=a[4]) or ([], BitDistillLoss()))
    run = type("R", (), dict(lesson=None, vocab=257, cfg=type("C", (), {"stage": 3})(),
                             model=type("M", (), {"config": None})(), rt=type("T", (), {"device": "cpu", "log": lambda *a: None})(), train_model=None))()
    train.make_loss_fn(run, ["t.pt"])
    assert seen["vocab"] == 257
