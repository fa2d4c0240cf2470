"""Tests for muon.py: NS5 against an independent fp32 loop and the SVD, the momentum update against its closed
form, bitwise parity with torch.optim.Muon (Muon groups) and torch.optim.AdamW (AdamW groups), the lr formulas by
hand, parameter routing, exact resume, standard torch.optim.lr_scheduler schedules, and that Muon+AdamW actually lowers a loss. Distributed Muon (DDP, FSDP2) is tested in tests/test_scale.py."""
import copy
import io
import math
import re
import warnings

import pytest
import torch
from torch import nn

from muon import (Muon, adjusted_lr, configure_muon, muon_update, split_muon_params,
                  zeropower_via_newtonschulz5)

RECT_SHAPES = [(64, 32), (32, 64), (7, 129), (129, 7)]
PARITY_SHAPES = [(64, 32), (32, 64), (48, 48), (7, 129)]


def newtonschulz5_fp32(G, steps=5, eps=1e-7):
    """Independent, straightforward NS5 in fp32 for one 2-D matrix, as written in Keller Jordan's Muon post
    (kellerjordan.github.io/posts/muon) and Moonlight (arXiv 2502.16982) §2.1 eq. 2."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = G.shape[0] > G.shape[1]
    X = (G.T if tall else G).float()
    X = X / (torch.linalg.matrix_norm(X) + eps)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.T if tall else X


# ----------------------------------------------------------------------------- Newton-Schulz


@pytest.mark.parametrize("shape", RECT_SHAPES)
def test_ns5_close_to_independent_fp32_loop(shape):
    # bf16 vs fp32 over 5 steps: observed relative Frobenius error ~0.01-0.02; we allow 0.03.
    torch.manual_seed(0)
    G = torch.randn(*shape)
    out = zeropower_via_newtonschulz5(G)
    assert out.dtype == torch.bfloat16 and out.shape == G.shape
    ref = newtonschulz5_fp32(G)
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 0.03, f"relative error {rel:.4f}"


@pytest.mark.parametrize("shape", RECT_SHAPES)
def test_ns5_singular_values_in_0p5_1p5_and_direction_matches_svd(shape):
    # For rectangular Gaussian matrices (well conditioned), the singular values of NS5(G) must lie in
    # [0.5, 1.5] and NS5(G) must point along U Vᵀ (cosine > 0.97; observed >= 0.984).
    torch.manual_seed(1)
    G = torch.randn(*shape)
    out = zeropower_via_newtonschulz5(G).float()
    S = torch.linalg.svdvals(out)
    assert S.min() >= 0.5 and S.max() <= 1.5, f"singular values in [{S.min():.3f}, {S.max():.3f}]"
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    cos = nn.functional.cosine_similarity(out.flatten(), (U @ Vh).flatten(), dim=0)
    assert cos > 0.97, f"cosine with U Vᵀ {cos:.4f}"


@pytest.mark.parametrize("shape", [(64, 32), (7, 129)])
def test_ns5_transpose_rule_gives_transposed_result_exactly(shape):
    G = torch.randn(*shape)
    assert torch.equal(zeropower_via_newtonschulz5(G.T), zeropower_via_newtonschulz5(G).T)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_ns5_batch_equals_separate_calls_exactly(shape):
    torch.manual_seed(2)
    G = torch.randn(3, *shape)
    batched = zeropower_via_newtonschulz5(G)
    for i in range(3):
        assert torch.equal(batched[i], zeropower_via_newtonschulz5(G[i]))
    G4 = G.reshape(1, 3, *shape).expand(2, 3, *shape)  # two leading dims
    assert torch.equal(zeropower_via_newtonschulz5(G4)[1, 2], batched[2])


def test_ns5_refuses_1d_input():
    with pytest.raises(ValueError, match=r"\(5,\)"):
        zeropower_via_newtonschulz5(torch.randn(5))


# ----------------------------------------------------------------------------- momentum (muon_update)


def test_muon_update_matches_hand_computed_ema_and_nesterov():
    # β = 0.9, buf starts at 0, g1 = (1, 2), g2 = (3, -1):
    #   buf1 = 0.1·g1 = (0.1, 0.2)                 u1 = 0.1·g1 + 0.9·buf1 = (0.19, 0.38)
    #   buf2 = 0.9·buf1 + 0.1·g2 = (0.39, 0.08)    u2 = 0.1·g2 + 0.9·buf2 = (0.651, -0.028)
    f64 = dict(dtype=torch.float64)
    buf = torch.zeros(1, 2, **f64)
    u1 = muon_update(torch.tensor([[1.0, 2.0]], **f64), buf, beta=0.9, nesterov=True)
    torch.testing.assert_close(buf, torch.tensor([[0.1, 0.2]], **f64))
    torch.testing.assert_close(u1, torch.tensor([[0.19, 0.38]], **f64))
    u2 = muon_update(torch.tensor([[3.0, -1.0]], **f64), buf, beta=0.9, nesterov=True)
    torch.testing.assert_close(buf, torch.tensor([[0.39, 0.08]], **f64))
    torch.testing.assert_close(u2, torch.tensor([[0.651, -0.028]], **f64))


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_update_equals_unrolled_ema_over_5_steps(nesterov):
    # The EMA unrolled: buf_t = (1-β)·Σ_{k<=t} β^(t-k)·g_k; u_t = (1-β)·g_t + β·buf_t (Nesterov), else buf_t.
    beta = 0.8
    gs = torch.randn(5, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    buf = torch.zeros(3, 4, dtype=torch.float64)
    for t in range(5):
        g = gs[t].clone()
        u = muon_update(g, buf, beta, nesterov)
        expected_buf = (1 - beta) * sum(beta ** (t - k) * gs[k] for k in range(t + 1))
        torch.testing.assert_close(buf, expected_buf)  # updated in place
        torch.testing.assert_close(u, (1 - beta) * gs[t] + beta * expected_buf if nesterov else expected_buf)
        assert torch.equal(g, gs[t])  # the gradient is left unchanged


# ----------------------------------------------------------------------------- Muon optimizer


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("shape", PARITY_SHAPES)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_muon_matches_torch_muon_bitwise_over_3_steps(shape, nesterov, adjust_lr_fn):
    # Exact equality (torch.equal), not a tolerance: the bf16 op order (addmm form) is the same as torch's.
    torch.manual_seed(3)
    p_ours = nn.Parameter(torch.randn(*shape))
    p_ref = nn.Parameter(p_ours.detach().clone())
    cfg = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5, adjust_lr_fn=adjust_lr_fn)
    ours, ref = Muon([p_ours], **cfg), torch.optim.Muon([p_ref], **cfg)
    for _ in range(3):
        g = torch.randn(*shape)
        p_ours.grad, p_ref.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert torch.equal(p_ours, p_ref), f"max diff {(p_ours - p_ref).abs().max().item()}"
    assert torch.equal(ours.state[p_ours]["momentum_buffer"], ref.state[p_ref]["momentum_buffer"])


def test_adjusted_lr_hand_computed():
    assert adjusted_lr(0.02, (64, 16)) == pytest.approx(0.04)  # sqrt(64/16) = 2
    assert adjusted_lr(0.02, (64, 16), "original") == pytest.approx(0.04)
    assert adjusted_lr(0.02, (16, 64)) == pytest.approx(0.02)  # max(1, 1/4) = 1
    assert adjusted_lr(0.02, (64, 16), "match_rms_adamw") == pytest.approx(0.032)  # 0.2 * sqrt(64) = 1.6
    assert adjusted_lr(0.02, (16, 100), "match_rms_adamw") == pytest.approx(0.04)  # 0.2 * sqrt(100) = 2
    with pytest.raises(ValueError, match="match_rms_adamw"):
        adjusted_lr(0.02, (4, 4), "rms")


@pytest.mark.parametrize("adjust_lr_fn,expected_lr", [("original", 0.02 * 3), ("match_rms_adamw", 0.02 * 0.2 * 9)])
def test_muon_step_applies_hand_computed_lr(adjust_lr_fn, expected_lr):
    # momentum 0 makes the update the raw gradient: p1 = p0 - lr_adj * NS5(g), with lr_adj computed by hand.
    torch.manual_seed(4)
    p = nn.Parameter(torch.randn(81, 9))
    p0, g = p.detach().clone(), torch.randn(81, 9)
    p.grad = g.clone()
    Muon([p], lr=0.02, momentum=0.0, adjust_lr_fn=adjust_lr_fn).step()
    assert torch.equal(p.detach(), p0.add(zeropower_via_newtonschulz5(g), alpha=-expected_lr))


def test_weight_decay_uses_unscaled_lr():
    # A zero gradient gives a zero update, so only decay acts: p1 = p0 * (1 - lr * wd), not lr_adj.
    p = nn.Parameter(torch.randn(64, 4))
    p0 = p.detach().clone()
    p.grad = torch.zeros_like(p)
    Muon([p], lr=0.05, weight_decay=0.5, adjust_lr_fn="match_rms_adamw").step()
    assert torch.equal(p.detach(), p0 * (1 - 0.05 * 0.5))


@pytest.mark.parametrize("shape", [(16,), (2, 3, 4)])
def test_muon_refuses_non_2d_param_naming_shape(shape):
    with pytest.raises(ValueError, match=re.escape(str(shape))) as info:
        Muon([nn.Parameter(torch.zeros(*shape))])
    assert "AdamW" in str(info.value)


def test_refused_param_group_leaves_optimizer_unchanged():
    opt = Muon([nn.Parameter(torch.zeros(4, 4))])
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))]})
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4))], "adjust_lr_fn": "bogus"})
    assert len(opt.param_groups) == 1


def test_unknown_adjust_lr_fn_raises():
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([nn.Parameter(torch.zeros(4, 4))], adjust_lr_fn="moonlight")


def test_param_without_grad_is_skipped():
    a, b = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(8, 4))
    b0 = b.detach().clone()
    a.grad = torch.randn(8, 4)
    opt = Muon([a, b], weight_decay=0.1)
    opt.step()
    assert torch.equal(b.detach(), b0) and b not in opt.state and "momentum_buffer" in opt.state[a]


# ----------------------------------------------------------------------------- parameter split and combination


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class TinyLM(nn.Module):
    def __init__(self, vocab=32, dim=16, tied=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.proj = nn.Linear(2 * dim, dim, bias=True)
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):  # (B, T) -> (B, T, vocab)
        x = self.wte(idx)
        x = x + self.proj(torch.relu(self.up(self.q(x))))
        return self.lm_head(self.norm(x))


@pytest.mark.parametrize("tied", [True, False])
def test_split_muon_params_routes_each_tensor_once(tied):
    model = TinyLM(tied=tied)
    model.frozen = nn.Linear(4, 4, bias=False).requires_grad_(False)
    muon_params, adamw_params = split_muon_params(model)
    ids = lambda ps: [id(p) for p in ps]  # noqa: E731
    assert ids(muon_params) == ids([model.q.weight, model.up.weight, model.proj.weight])
    expected_adamw = [model.wte.weight, model.proj.bias, model.norm.weight]
    if not tied:
        expected_adamw.append(model.lm_head.weight)
    assert sorted(ids(adamw_params)) == sorted(ids(expected_adamw))
    all_ids = ids(muon_params) + ids(adamw_params)
    assert len(all_ids) == len(set(all_ids))  # the tied tensor appears once
    assert id(model.frozen.weight) not in all_ids


def test_muon_with_adamw_groups_and_schedule_via_param_groups():
    model = TinyLM(tied=False)
    opt = configure_muon(model, muon_lr=0.03, adamw_lr=1e-3, muon_weight_decay=0.1, adamw_weight_decay=0.2)
    assert [g["kind"] for g in opt.param_groups] == ["muon", "adamw", "adamw"]  # AdamW 2-D decayed, 1-D not
    muon_group, decayed, not_decayed = opt.param_groups
    assert muon_group["weight_decay"] == 0.1 and muon_group["params"] == split_muon_params(model)[0]
    assert decayed["weight_decay"] == 0.2 and all(p.ndim == 2 for p in decayed["params"])
    assert not_decayed["weight_decay"] == 0.0 and all(p.ndim == 1 for p in not_decayed["params"])
    assert decayed["betas"] == not_decayed["betas"] == (0.9, 0.95)
    assert not any(k in decayed for k in ("momentum", "nesterov", "ns_steps", "adjust_lr_fn"))  # Muon's only
    assert [g["initial_lr"] for g in opt.param_groups] == [0.03, 1e-3, 1e-3]
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] * 0.5
    assert [g["lr"] for g in opt.param_groups] == [0.015, 5e-4, 5e-4]
    model(torch.randint(0, 32, (2, 5))).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def _train_steps(model, opt, batches):
    for idx, tgt in batches:
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def test_state_dict_round_trip_resumes_bitwise():
    torch.manual_seed(5)
    batches = [(torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))) for _ in range(3)]
    kw = dict(muon_weight_decay=0.1, adamw_weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    model = TinyLM()
    init = copy.deepcopy(model.state_dict())
    opt = configure_muon(model, **kw)
    _train_steps(model, opt, batches[:2])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train_steps(model, opt, batches[2:])  # uninterrupted run

    torch.manual_seed(123)  # the fresh copy starts from other weights; loading must overwrite everything
    resumed = TinyLM()
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed.load_state_dict(ckpt["model"])
    opt2 = configure_muon(resumed, **kw)
    opt2.load_state_dict(ckpt["opt"])
    _train_steps(resumed, opt2, batches[2:])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(model.q.weight, init["q.weight"])


@pytest.mark.parametrize("fused", [None, True])
def test_adamw_groups_equal_torch_adamw_bitwise_and_resume(fused):
    torch.manual_seed(13)
    model = TinyLM(tied=False)
    ref_model = copy.deepcopy(model)
    opt = configure_muon(model, adamw_lr=1e-2, adamw_weight_decay=0.1, fused=fused)
    _, ref_params = split_muon_params(ref_model)
    ref = torch.optim.AdamW([{"params": [p for p in ref_params if p.ndim == 2], "weight_decay": 0.1},
                             {"params": [p for p in ref_params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    for it in range(4):
        if it == 2:  # resume half-way from the saved state
            saved, model = opt.state_dict(), copy.deepcopy(model)
            opt = configure_muon(model, adamw_lr=1e-2, adamw_weight_decay=0.1, fused=fused)
            opt.load_state_dict(saved)
        for m in (model, ref_model):
            for p, grad in zip(m.parameters(), _grads_for(m, it)):
                p.grad = grad
        opt.step(kinds=("adamw",))
        ref.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            if name in ("wte.weight", "proj.bias", "norm.weight", "lm_head.weight"):  # the AdamW ones
                assert torch.equal(p, q), f"{name} after step {it}"
                assert all(torch.equal(opt.state[p][k], ref.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


# ----------------------------------------------------------------------------- torch.optim.lr_scheduler


def _grads_for(model, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_lambda_lr_sets_every_group_and_the_next_step_uses_it_bitwise():
    # LambdaLR on the one optimizer against torch.optim.Muon and torch.optim.AdamW, the lr of each set by hand to
    # initial_lr * mult: the same lrs, and parameters equal bit for bit after every step.
    mults = [0.1, 0.55, 1.0, 0.4]  # warmup then decay
    torch.manual_seed(9)
    model = TinyLM(tied=False)
    ref_model = copy.deepcopy(model)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn=None)
    opt = configure_muon(model, muon_lr=0.02, adamw_lr=1e-3, muon_weight_decay=0.1, adamw_weight_decay=0.1)
    ref_muon_params, ref_adamw_params = split_muon_params(ref_model)
    ref_muon = torch.optim.Muon(ref_muon_params, **kw)
    ref_adamw = torch.optim.AdamW([{"params": [p for p in ref_adamw_params if p.ndim == 2], "weight_decay": 0.1},
                                   {"params": [p for p in ref_adamw_params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    ref_groups = ref_muon.param_groups + ref_adamw.param_groups
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "optimizer.step() has been overridden": the scheduler lost track
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: mults[it])
        for it, mult in enumerate(mults):
            expected = [0.02 * mult, 1e-3 * mult, 1e-3 * mult]
            assert [g["lr"] for g in opt.param_groups] == pytest.approx(expected, rel=1e-12)
            assert opt.param_groups[0]["kind"] == "muon"
            for g, ref_g in zip(opt.param_groups, ref_groups):
                ref_g["lr"] = g["lr"]
            for m, grads in ((model, _grads_for(model, it)), (ref_model, _grads_for(ref_model, it))):
                for p, grad in zip(m.parameters(), grads):
                    p.grad = grad
            opt.step()
            ref_muon.step()
            ref_adamw.step()
            for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
                assert torch.equal(a, b), f"{name} after step {it}"
            if it + 1 < len(mults):
                sched.step()


def test_sequential_warmup_then_cosine_gives_each_group_what_it_gives_sgd():
    # The same schedule on torch.optim.SGD with the same initial lrs is the independent reference.
    def schedule(o):
        warmup = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=0.0)
        return torch.optim.lr_scheduler.SequentialLR(o, [warmup, cosine], milestones=[3])

    model = TinyLM(tied=False)
    opt = configure_muon(model, muon_lr=0.02, adamw_lr=3e-4)
    sgd = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in (0.02, 3e-4, 3e-4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched, ref = schedule(opt), schedule(sgd)
        for _ in range(8):
            assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in sgd.param_groups]
            model(torch.randint(0, 32, (2, 5))).sum().backward()
            opt.step()
            opt.zero_grad()
            sgd.step()
            sched.step()
            ref.step()
    assert opt.param_groups[0]["lr"] < 0.02 * 0.5 and sched.get_last_lr() == ref.get_last_lr()


def test_one_torch_optimizer_whose_state_dict_is_torchs_own_form():
    model = TinyLM(tied=False)
    opt = configure_muon(model)
    assert isinstance(opt, torch.optim.Optimizer)
    model(torch.randint(0, 32, (2, 5))).sum().backward()
    opt.step()
    assert set(opt.state[model.q.weight]) == {"momentum_buffer"}
    assert set(opt.state[model.wte.weight]) == {"step", "exp_avg", "exp_avg_sq"} and opt.state[model.wte.weight]["step"] == 1
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"} and [g["kind"] for g in sd["param_groups"]] == ["muon", "adamw", "adamw"]
    assert set(sd["state"]) == set(range(len(list(model.parameters()))))  # one numbering over the three groups
    opt.load_state_dict(sd)
    assert [g["kind"] for g in opt.param_groups] == ["muon", "adamw", "adamw"]
    extra = nn.Parameter(torch.zeros(4))
    opt.add_param_group({"params": [extra], "kind": "adamw", "lr": 1e-3})  # a new group says its kind
    assert opt.param_groups[-1]["betas"] == (0.9, 0.95) and "momentum" not in opt.param_groups[-1]


def test_bad_groups_are_refused_before_anything_is_registered():
    opt = configure_muon(TinyLM(tied=False))
    with pytest.raises(ValueError, match="lr"):  # AdamW would silently get Muon's 0.02
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))], "kind": "adamw"})
    with pytest.raises(ValueError, match="'sgd'"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4))], "kind": "sgd"})
    with pytest.raises(ValueError, match=r"\(4,\)"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))]})  # kind "muon" by default: 2-D only
    assert len(opt.param_groups) == 3


def test_state_dict_of_other_groups_is_refused_with_the_kinds():
    model = TinyLM(tied=False)
    adamw = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim == 2]},
                               {"params": [p for p in model.parameters() if p.ndim < 2]}])
    with pytest.raises(ValueError, match=r"\['muon', 'muon'\].*\['muon', 'adamw', 'adamw'\]"):
        configure_muon(model).load_state_dict(adamw.state_dict())


def test_stepping_muon_then_adamw_separately_equals_step():
    # lab/bench.py times Muon's part with step(kinds=("muon",)), then steps the rest with kinds=("adamw",).
    torch.manual_seed(10)
    a = TinyLM(tied=False)
    b = copy.deepcopy(a)
    opt_a, opt_b = configure_muon(a, muon_weight_decay=0.1), configure_muon(b, muon_weight_decay=0.1)
    for it in range(2):
        for m in (a, b):
            for p, grad in zip(m.parameters(), _grads_for(m, it)):
                p.grad = grad
        opt_a.step()
        q0, wte0 = b.q.weight.detach().clone(), b.wte.weight.detach().clone()
        opt_b.step(kinds=("muon",))
        assert not torch.equal(b.q.weight, q0) and torch.equal(b.wte.weight, wte0)  # Muon's groups only
        opt_b.step(kinds=("adamw",))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_deepcopy_of_muon_with_adamw_steps_like_the_original():
    torch.manual_seed(11)
    model = TinyLM(tied=False)
    opt = configure_muon(model)
    model(torch.randint(0, 32, (2, 5))).sum().backward()
    opt.step()
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2.param_groups[0]["params"][0] is model2.q.weight
    for m, o in ((model, opt), (model2, opt2)):
        for p, grad in zip(m.parameters(), _grads_for(m, 0)):
            p.grad = grad
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_muon_lowers_least_squares_loss_50x_in_100_steps():
    # Observed: ~1.0 -> ~0.006 (over 150x); a broken update direction or lr would not reach 50x.
    torch.manual_seed(6)
    X, W_true = torch.randn(512, 64), torch.randn(64, 32) / 8
    Y = X @ W_true
    W = nn.Parameter(torch.zeros(64, 32))
    opt = Muon([W], lr=0.02)
    first = None
    for _ in range(100):
        loss = ((X @ W - Y) ** 2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert ((X @ W - Y) ** 2).mean().item() < first / 50


def test_muon_with_adamw_lowers_tiny_lm_loss():
    # Memorise a fixed next-token mapping: cross-entropy from ~ln(32) = 3.47 must fall below 0.6 in 30 steps
    # (observed ~0.27).
    torch.manual_seed(7)
    model = TinyLM(tied=False)
    idx = torch.randint(0, 32, (8, 16))
    tgt = (idx * 7 + 3) % 32
    opt = configure_muon(model, muon_lr=0.02, adamw_lr=1e-2)
    start = nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).item()
    _train_steps(model, opt, [(idx, tgt)] * 30)
    end = nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).item()
    assert start > 0.8 * math.log(32) and end < 0.6, f"loss {start:.3f} -> {end:.3f}"


@pytest.mark.parametrize("shape", RECT_SHAPES)
def test_ns5_float32_option_matches_independent_fp32_loop(shape):
    torch.manual_seed(1)
    G = torch.randn(*shape)
    out = zeropower_via_newtonschulz5(G, dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = newtonschulz5_fp32(G)
    assert (out - ref).norm() / ref.norm() < 1e-5  # same arithmetic in fp32, only the op grouping differs


def test_muon_ns_dtype_float32_is_used_and_close_to_bf16_step():
    torch.manual_seed(2)
    p32 = nn.Parameter(torch.randn(48, 32))
    p16 = nn.Parameter(p32.detach().clone())
    o32, o16 = Muon([p32], lr=0.02, ns_dtype=torch.float32), Muon([p16], lr=0.02)
    g = torch.randn(48, 32)
    p32.grad, p16.grad = g.clone(), g.clone()
    p0 = p32.detach().clone()
    o32.step()
    o16.step()
    ref = p0 - adjusted_lr(0.02, (48, 32)) * newtonschulz5_fp32(g)  # momentum 0.95 from zero: update ∝ g
    assert (p32 - ref).abs().max() < 1e-6 < (p16 - ref).abs().max()


@pytest.mark.parametrize("ns_dtype,adjust", [(torch.bfloat16, None), (torch.float32, None),
                                             (torch.bfloat16, "match_rms_adamw")])
@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_step_one_ns5_per_shape_equals_the_per_matrix_step_exactly(ns_dtype, adjust, nesterov, monkeypatch):
    """muon_steps (the default step: same-shape matrices stacked, one batched NS5 per shape, foreach
    momentum and update) gives every matrix what muon_step gives it, bit for bit on CPU, over 3
    steps with weight decay; a variant's own muon_step is never bypassed."""
    import muon
    torch.manual_seed(0)
    shapes = [(64, 32)] * 3 + [(32, 64)] * 2 + [(48, 48)]
    one = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    batched = [torch.nn.Parameter(p.detach().clone()) for p in one]
    opts = [Muon(ps, lr=0.02, weight_decay=0.1, nesterov=nesterov, ns_dtype=ns_dtype, adjust_lr_fn=adjust)
            for ps in (one, batched)]
    opts[0].batched_devices = ()  # matrix by matrix; opts[1] batches, as on every device by default
    calls, ns5 = [], muon.zeropower_via_newtonschulz5
    monkeypatch.setattr(muon, "zeropower_via_newtonschulz5", lambda G, **kw: (calls.append(G.shape), ns5(G, **kw))[1])
    for _ in range(3):
        for p, q in zip(one, batched):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        calls.clear()
        opts[0].step()
        assert len(calls) == 6
        calls.clear()
        opts[1].step()
        assert set(calls) == {(3, 64, 32), (2, 32, 64), (1, 48, 48)}
    for p, q in zip(one, batched):
        assert torch.equal(p, q) and not torch.equal(p, torch.zeros_like(p))
        assert torch.equal(opts[0].state[p]["momentum_buffer"], opts[1].state[q]["momentum_buffer"])

    class Variant(Muon):
        def muon_step(self, p, group):
            p.zero_()
    v = Variant([one[0]], lr=0.02)
    v.batched_devices = ("cpu",)
    one[0].grad = torch.ones_like(one[0])
    v.step()
    assert torch.equal(one[0], torch.zeros_like(one[0]))


@pytest.mark.parametrize("avx512_bf16,amx,want", [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                                 (False, False, torch.float32), (None, None, torch.float32)])
def test_ns_dtype_is_the_papers_bf16_where_matmuls_have_bf16_units_else_float32(avx512_bf16, amx, want, monkeypatch):
    """A CPU with AVX512-BF16 or AMX runs NS5 in bf16, any other CPU (or a torch without the checks: None) in
    float32; a GPU with bf16 units (Ampere on) in bf16, an older one (a T4: bf16 emulated) in float32. train.py
    builds its Muon with it."""
    import train
    from muon import ns_dtype_for
    from tools import config
    for name, has in (("_is_avx512_bf16_supported", avx512_bf16), ("_is_amx_tile_supported", amx)):
        if has is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda has=has: has)
    assert ns_dtype_for("cpu") == want
    for native, gpu_want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n or (
            including_emulation and pytest.fail("asked whether bf16 is emulated")))
        assert ns_dtype_for("cuda") == gpu_want
    model = nn.Sequential(nn.Linear(8, 8))
    assert train.configure_optimizer(model, config.TrainConfig(device="cpu"), "cpu").ns_dtype == want
