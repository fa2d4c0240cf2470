"""lessons/muon_variants.py: NorMuon against a hand-written reference, 8-bit momentum (both maps) against its error
bound and its byte formula, bit-exact resume with 8-bit state, and QK-clip capping the heads over tau exactly."""
import copy
import math

import pytest
import torch

from lessons import muon_variants as mv
from conftest import TINY, records, run
from model import GPT, GPTConfig
from muon import configure_muon, split_muon_params, zeropower_via_newtonschulz5


def _reference_normuon(W, grads, lr=0.02, beta=0.95, beta2=0.95, wd=0.1):
    """zichongli5/NorMuon's normuon_update written out again, in float64 outside NS5: momentum (EMA), Nesterov,
    NS5, per-row second moment, row scaling, Frobenius rescale, sqrt(max(1, rows/cols)), decoupled decay."""
    W, m, v = W.clone().double(), torch.zeros_like(W).double(), torch.zeros(W.shape[0], 1, dtype=torch.float64)
    for g in grads:
        g = g.double()
        m = beta * m + (1 - beta) * g
        u = (1 - beta) * g + beta * m
        O = zeropower_via_newtonschulz5(u.float(), dtype=torch.float32).double()
        v = beta2 * v + (1 - beta2) * (O * O).mean(dim=1, keepdim=True)
        O2 = O / (v.sqrt() + 1e-10)
        O2 = O2 * (O.norm() / (O2.norm() + 1e-10))
        W = W * (1 - lr * wd) - lr * max(1, W.shape[0] / W.shape[1]) ** 0.5 * O2
    return W


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_normuon_step_equals_a_hand_written_reference(shape):
    torch.manual_seed(0)
    W = torch.randn(shape)
    grads = [torch.randn(shape) * (1 + torch.arange(shape[0])[:, None]) for _ in range(4)]  # uneven rows
    p = torch.nn.Parameter(W.clone())
    opt = mv.MuonVariant([p], normuon=True, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert torch.allclose(p.detach().double(), _reference_normuon(W, grads), atol=1e-6, rtol=0)
    plain = torch.nn.Parameter(W.clone())
    muon = mv.MuonVariant([plain], lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    for g in grads:
        plain.grad = g.clone()
        muon.step()
    assert (plain.detach() - p.detach()).abs().max() > 1e-3  # the normalisation does something here


def test_dynamic_map_is_8bit_adams():
    m = mv.dynamic_map()
    assert m.numel() == 256 and torch.all(m[1:] > m[:-1])  # 256 distinct values, sorted
    assert m.max() == 1.0 and (m == 0).sum() == 1 and m.min() == pytest.approx(-(1 + (1 - 0.9 / 64)) / 2)
    assert m[m > 0].min() == pytest.approx(0.55e-6)  # exponent 10^-6, the one fraction value (0.1 + 1) / 2
    assert (m.abs() < 1e-3).sum() == 2 * (1 + 2 + 4 + 8) + 1  # 31 codes below 1e-3: exponents 1e-6..1e-3, and 0


@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_blockwise_round_trip_within_each_blocks_quantisation_error(kind):
    torch.manual_seed(1)
    x = torch.randn(3000) * torch.logspace(-3, 0, 3000)  # values over three decades, two blocks of 2048
    codes, absmax = mv.quantize_blockwise(x, kind)
    assert codes.dtype == (torch.int8 if kind == "linear" else torch.uint8) and absmax.shape == (2,)
    y = mv.dequantize_blockwise(codes, absmax, x.shape, kind)
    a = absmax.repeat_interleave(2048)[:3000]
    if kind == "linear":  # half a step of absmax/127
        assert torch.all((x - y).abs() <= a / 254 * (1 + 1e-6))
    else:  # half the gap between the two map values around x / absmax
        m = mv.dynamic_map()
        i = torch.searchsorted(m, (x / a).contiguous()).clamp(1, 255)
        assert torch.all((x - y).abs() <= (m[i] - m[i - 1]) / 2 * a * (1 + 1e-5) + 1e-12)
    grid = (mv.dynamic_map()[3::7] if kind == "dynamic" else torch.tensor([-127, -64, -1, 0, 5, 63, 127]) / 127) * 2.5
    codes, absmax = mv.quantize_blockwise(grid, kind)  # values on the grid come back exactly
    assert absmax.item() == 2.5
    assert torch.allclose(mv.dequantize_blockwise(codes, absmax, grid.shape, kind), grid, atol=1e-6, rtol=0)


@pytest.mark.parametrize("state", ["linear8", "dynamic8"])
def test_8bit_state_bytes_follow_the_formula_and_the_step_stays_close_to_fp32(state):
    torch.manual_seed(2)
    shapes = [(64, 100), (300, 20)]
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = mv.MuonVariant(ps, state=state, ns_dtype=torch.float32)
    fp = mv.MuonVariant(ref, ns_dtype=torch.float32)
    for _ in range(5):
        g = [torch.randn(s) for s in shapes]
        for p, q, gi in zip(ps, ref, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        opt.step()
        fp.step()
    assert opt.state_bytes() == sum(mv.state_bytes(math.prod(s), state) for s in shapes) == 6400 + 4 * 4 + 6000 + 4 * 3
    assert fp.state_bytes() == sum(mv.state_bytes(math.prod(s)) for s in shapes) == 4 * 12400
    for p, q in zip(ps, ref):
        assert 0 < (p - q).abs().max() < 2e-3  # 8-bit momentum: a slightly different, not another, step


def test_8bit_state_resumes_bit_exactly():
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(40, 24))
    opt = mv.MuonVariant([p], state="dynamic8", normuon=True, ns_dtype=torch.float32)
    grads = [torch.randn(40, 24) for _ in range(6)]
    for g in grads[:3]:
        p.grad = g.clone()
        opt.step()
    saved, p2 = copy.deepcopy(opt.state_dict()), torch.nn.Parameter(p.detach().clone())
    for g in grads[3:]:
        p.grad = g.clone()
        opt.step()
    opt2 = mv.MuonVariant([p2], state="dynamic8", normuon=True, ns_dtype=torch.float32)
    opt2.load_state_dict(saved)
    assert opt2.state[p2]["momentum_codes"].dtype == torch.uint8  # not the float32 torch would leave
    for g in grads[3:]:
        p2.grad = g.clone()
        opt2.step()
    assert torch.equal(p, p2)


def test_variant_steps_configure_muons_groups_and_adamw_stays_torchs():
    torch.manual_seed(5)
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=8))
    ref = copy.deepcopy(model)
    plain = configure_muon(model, adamw_lr=1e-2, muon_weight_decay=0.1, adamw_weight_decay=0.1)
    opt = mv.MuonVariant(plain.param_groups, normuon=True, state="linear8", ns_dtype=torch.float32)
    muon_params, adamw_params = split_muon_params(ref)
    ref_muon = mv.MuonVariant(muon_params, normuon=True, state="linear8", weight_decay=0.1, ns_dtype=torch.float32)
    ref_adamw = torch.optim.AdamW([{"params": [p for p in adamw_params if p.ndim == 2], "weight_decay": 0.1},
                                   {"params": [p for p in adamw_params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95))
    assert [g["kind"] for g in opt.param_groups] == ["muon", "adamw", "adamw"]
    for it in range(3):
        g = torch.Generator().manual_seed(it)
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{name} after step {it}"
    assert "momentum_codes" in opt.state[model.h[0].attn.q_proj.weight]
    assert opt.state_bytes() == ref_muon.state_bytes()  # the Muon groups' state only


def _attn_model(quant, **config):
    torch.manual_seed(4)
    m = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=4, n_embd=32, block_size=16, quant=quant, **config))
    with torch.no_grad():  # make the heads' logits differ widely: head h's query rows scaled by 3^h
        m.h[0].attn.q_proj.weight.mul_(torch.tensor([1.0, 3.0, 9.0, 27.0]).repeat_interleave(8)[:, None] * 20)
    return m.train()


def _recorded(m, qk, x):
    qk.after_step(0, ok=False)  # records from 0, no clip
    m(x)
    return qk.max_logits[0].clone()


def _probed(quant):
    """(model, input, a QKClip probe of 2 rows, each head's max logit before any clip, tau between the 2nd and the
    3rd head's max: two heads over it)."""
    m = _attn_model(quant=quant)
    x = torch.randint(0, 64, (2, 16))
    probe = mv.QKClip(m, rows=2)
    before = _recorded(m, probe, x)
    return m, x, probe, before, float(before.sort().values[1:3].mean())


@pytest.mark.parametrize("config", [{}, {"doc_mask": True, "eot": 0}, {"causal": False}],
                         ids=["causal", "doc_mask", "bidirectional"])
def test_recorded_max_logit_is_the_largest_allowed_qk_over_the_first_rows(config):
    m = _attn_model(quant=False, **config)
    qk = mv.QKClip(m, rows=2)
    x = torch.randint(1, 64, (3, 16))
    x[:, [0, 5, 11]] = 0  # documents start with eot (0): three per row
    got = _recorded(m, qk, x)
    q, k, _ = m.forward_with_states(x, qkv_layer=0)[2]["qkv"]  # (B, nh, T, hd) after RoPE
    s = (q[:2] @ k[:2].transpose(-2, -1)) / math.sqrt(8)  # (2, nh, T, T)
    allowed = torch.ones(2, 16, 16, dtype=torch.bool)
    if config.get("causal", True):
        allowed &= torch.ones(16, 16, dtype=torch.bool).tril()
    if config.get("doc_mask"):
        doc = (x[:2] == 0).cumsum(dim=1)  # (2, T): each token's document
        allowed &= doc[:, :, None] == doc[:, None, :]
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    assert torch.allclose(got, s.amax(dim=(0, 2, 3)), rtol=1e-5)
    assert torch.equal(qk.watch()["max_logit"], got.max())


def test_qk_clip_caps_heads_over_tau_exactly_and_leaves_the_others():
    m, x, probe, before, tau = _probed(quant=False)
    probe.remove()
    probe.after_step(0, ok=False)  # tau 0: no clip, only the reset
    over = before > tau
    assert over.sum() == 2
    w_q, w_k = m.h[0].attn.q_proj.weight.clone(), m.h[0].attn.k_proj.weight.clone()
    qk = mv.QKClip(m, tau, rows=2)
    m(x)  # record, as a training step would, then clip
    top = qk.watch()["max_logit"]
    qk.after_step(1, ok=True)
    assert top == before.max() and torch.all(qk.max_logits[0] == 0)  # read for the log, then reset
    assert torch.all(probe.max_logits[0] == 0)  # the removed hook recorded nothing
    after = _recorded(m, qk, x)
    assert torch.allclose(after[over], torch.full((2,), tau), rtol=1e-5)  # capped to exactly tau
    assert torch.equal(after[~over], before[~over])  # untouched heads: the same logits, bit for bit
    rows = (~over).repeat_interleave(8)
    assert torch.equal(m.h[0].attn.q_proj.weight[rows], w_q[rows]) and torch.equal(m.h[0].attn.k_proj.weight[rows], w_k[rows])


def test_qk_clip_on_a_ternary_model_moves_the_other_heads_too():
    """The ternary twist (muon_variants docstring): gamma = mean|W| is per matrix, so scaling two heads' rows
    changes every head's quantised weights; the capped heads land near, not exactly on, tau."""
    m, x, qk, before, tau = _probed(quant=True)
    qk.tau = tau
    over = before > tau
    qk.after_step(1, ok=True)  # the records of `before` are still there: clip on them
    after = _recorded(m, qk, x)
    assert not torch.equal(after[~over], before[~over])  # heads under tau moved as well
    assert not torch.allclose(after[over], torch.full((2,), tau), rtol=1e-5)  # and the cap is not exact
    assert torch.all(after[over] < before[over])  # but the clipped heads did come down


def test_qk_clip_clips_only_taken_steps_with_tau_and_records_only_training_forwards():
    m = _attn_model(quant=False)
    x = torch.randint(0, 64, (2, 16))
    w_q = m.h[0].attn.q_proj.weight.clone()
    log_only, skipped = mv.QKClip(m, tau=0.0), mv.QKClip(m, tau=1e-3)
    m(x)
    assert torch.equal(log_only.max_logits[0], skipped.max_logits[0]) and log_only.watch()["max_logit"] > 1e-3
    log_only.after_step(1, ok=True)  # tau 0: --log_max_logit, no clip
    skipped.after_step(1, ok=False)  # a step that was not taken (non-finite loss): no clip either
    assert torch.equal(m.h[0].attn.q_proj.weight, w_q)
    assert torch.all(log_only.max_logits[0] == 0) and torch.all(skipped.max_logits[0] == 0)  # reset all the same
    m.eval()
    m(x)  # evaluation
    m.train()
    m.generate(x[:, :4], 3)  # generation, KV cache and all (no_grad)
    assert torch.all(log_only.max_logits[0] == 0)
    for qk in (log_only, skipped):
        qk.remove()
    m(x)
    assert torch.all(log_only.max_logits[0] == 0) and torch.all(skipped.max_logits[0] == 0)


@pytest.mark.parametrize("flags", [["--normuon=True", "--muon_state=linear8"], ["--qk_clip_tau=1"],
                                   ["--log_max_logit=True"]])  # NorMuon's update on 8-bit momentum: one run
@pytest.mark.slow
def test_train_py_runs_the_variants_and_logs_the_max_logit(tmp_path, flags):
    out = str(tmp_path / "o")
    run(f"--out_dir={out}", "--stage=2", "--init_from=scratch", *TINY, "--max_iters=4", "--eval_interval=4", *flags)
    steps = [r for r in records(out) if "loss" in r]
    assert len(steps) == 4 and all(math.isfinite(r["loss"]) for r in steps)
    tracked = any(f.startswith(("--qk_clip", "--log_max")) for f in flags)
    assert all(("max_logit" in r) == tracked for r in steps)
