"""Tests for zclip.py: the formulas and worked example of its docstring, warmup, options, dtypes, resume, and no
host synchronisation. Run: python -m pytest tests/test_zclip.py"""
import io
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zclip import CLIP_OPTIONS, MODES, PERCENTILE_RAW_EMA, SPIKE_UPDATES, ZClip, total_norm


def close(actual, expected, rel=1e-6):
    assert math.isclose(float(actual), expected, rel_tol=rel, abs_tol=0.0), (float(actual), expected)


def make_params(seed=0, dtypes=(torch.float32,) * 3):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 2, 4)]
    return [torch.nn.Parameter(torch.zeros(shape, dtype=d)) for shape, d in zip(shapes, dtypes)], gen


def set_grads(params, norm, gen):
    """Random gradients whose global L2 norm is exactly `norm` (up to fp32 rounding)."""
    grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    total = torch.cat([g.flatten() for g in grads]).norm()
    for p, g in zip(params, grads):
        p.grad = (g * (norm / total)).to(p.dtype)


def global_norm(params):
    return torch.cat([p.grad.double().flatten() for p in params if p.grad is not None]).norm().item()


def warmed_up(norms, **kw):
    """A ZClip that has seen `norms` as its warmup (warmup_steps = len(norms))."""
    zc = ZClip(warmup_steps=len(norms), **kw)
    params, gen = make_params()
    for n in norms:
        set_grads(params, n, gen)
        zc.clip(params)
    return zc, params, gen


def test_worked_example_of_the_docstring():
    # warmup norms [0.5, 1.5] give mu = 1, var = 0.25 exactly
    zc, params, gen = warmed_up([0.5, 1.5], z_thresh=2.0)
    close(zc.mean, 1.0)
    close(zc.var, 0.25)
    set_grads(params, 3.0, gen)
    s = zc.clip(params)
    z = 2.0 / (0.5 + 1e-6)
    T = 1.0 + 4.0 * 0.5 / z  # ~ 1.500001
    close(s["z_score"], 3.999992)
    close(s["z_score"], z)
    close(global_norm(params), T * 3.0 / (3.0 + 1e-6))  # the actual gradients, not the reported norm
    close(s["clipped_norm"], T * 3.0 / (3.0 + 1e-6))
    assert float(s["was_clipped"]) == 1.0
    mu = 0.97 * 1.0 + 0.03 * T
    close(s["ema_mean"], 1.015)
    close(s["ema_mean"], mu)
    close(s["ema_var"], 0.97 * 0.25 + 0.03 * (T - mu) ** 2)
    close(s["ema_var"], 0.2495568)


def test_worked_example_via_loaded_state():
    zc = ZClip(z_thresh=2.0, warmup_steps=1)
    sd = zc.state_dict()
    sd.update(mean=torch.tensor(1.0), var=torch.tensor(0.25), n_seen=1)
    zc.load_state_dict(sd)
    params, gen = make_params()
    set_grads(params, 3.0, gen)
    s = zc.clip(params)
    close(global_norm(params), 1.500001 * 3.0 / (3.0 + 1e-6))
    close(s["ema_mean"], 1.015)
    close(s["ema_var"], 0.2495568)


def test_warmup_initialises_population_stats_and_first_decision_is_call_n_plus_1():
    zc = ZClip(warmup_steps=3)
    params, gen = make_params()
    for n in [1.0, 2.0, 3.0]:
        assert not zc.initialized
        set_grads(params, n, gen)
        s = zc.clip(params)
        assert float(s["z_score"]) == 0.0 and float(s["was_clipped"]) == 0.0
    assert zc.initialized
    close(zc.mean, 2.0)
    close(zc.var, 2.0 / 3.0)
    set_grads(params, 100.0, gen)
    s = zc.clip(params)  # call N+1: the first decision
    close(s["z_score"], 98.0 / (math.sqrt(2.0 / 3.0) + 1e-6))
    assert float(s["was_clipped"]) == 1.0 and global_norm(params) < 3.0


def test_no_clipping_during_warmup_even_for_huge_norm():
    zc = ZClip(warmup_steps=3)
    params, gen = make_params()
    for n in [1.0, 1e6, 3.0]:
        set_grads(params, n, gen)
        before = [p.grad.clone() for p in params]
        s = zc.clip(params)
        assert float(s["was_clipped"]) == 0.0
        assert all(torch.equal(b, p.grad) for b, p in zip(before, params))
    close(zc.mean, (1.0 + 1e6 + 3.0) / 3, rel=1e-5)


def test_mean_option_clips_to_mu():
    zc, params, gen = warmed_up([0.5, 1.5], z_thresh=2.0, clip_option="mean")
    set_grads(params, 3.0, gen)
    s = zc.clip(params)
    close(global_norm(params), 1.0 * 3.0 / (3.0 + 1e-6))
    close(s["ema_mean"], 1.0)
    close(s["ema_var"], 0.97 * 0.25)  # x = T = mu, so (x - mu')^2 = 0


def test_adaptive_scaling_clip_factor():
    zc, params, gen = warmed_up([0.5, 1.5], z_thresh=2.0, clip_factor=0.5)
    set_grads(params, 3.0, gen)
    zc.clip(params)
    close(global_norm(params), 0.5 * 1.500001 * 3.0 / (3.0 + 1e-6))


def test_percentile_mode_threshold_is_mu_plus_z_sigma():
    zc, params, gen = warmed_up([0.5, 1.5], z_thresh=2.0, mode="percentile")
    set_grads(params, 1.9, gen)  # below mu + 2 sigma = 2: untouched
    before = [p.grad.clone() for p in params]
    s = zc.clip(params)
    assert float(s["was_clipped"]) == 0.0 and all(torch.equal(b, p.grad) for b, p in zip(before, params))
    mu, var = 0.97 + 0.03 * 1.9, 0.97 * 0.25 + 0.03 * (1.9 - (0.97 + 0.03 * 1.9)) ** 2
    close(s["ema_mean"], mu)
    close(s["ema_var"], var)
    set_grads(params, 5.0, gen)
    s = zc.clip(params)
    T = mu + 2.0 * math.sqrt(var)
    close(global_norm(params), T * 5.0 / (5.0 + 1e-6))
    mu2 = 0.97 * mu + 0.03 * T
    close(s["ema_mean"], mu2)
    close(s["ema_var"], 0.97 * var + 0.03 * (T - mu2) ** 2)


def test_non_spike_leaves_grads_bitwise_unchanged_and_ema_uses_g():
    zc = ZClip(warmup_steps=2, z_thresh=2.0)
    params, gen = make_params()
    params.append(torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16)))  # mixed dtypes in one call
    for n in [0.5, 1.5, 1.2]:
        set_grads(params, n, gen)
        mu0, var0 = float(zc.mean), float(zc.var)  # the bf16 grad makes these only roughly 1 and 0.25
        before = [p.grad.clone() for p in params]
        s = zc.clip(params)
        assert float(s["was_clipped"]) == 0.0
        assert all(torch.equal(b, p.grad) for b, p in zip(before, params))
    g = float(s["raw_norm"])
    close(g, global_norm(params), rel=1e-6)
    mu = 0.97 * mu0 + 0.03 * g
    close(s["ema_mean"], mu)
    close(s["ema_var"], 0.97 * var0 + 0.03 * (g - mu) ** 2)


def test_max_grad_norm_caps_and_ema_still_uses_g_or_T():
    zc, params, gen = warmed_up([0.5, 1.5], z_thresh=2.0, max_grad_norm=1.1)
    set_grads(params, 1.2, gen)  # not a spike, but above max_grad_norm
    s = zc.clip(params)
    close(global_norm(params), 1.1 * 1.2 / (1.2 + 1e-6))
    assert float(s["was_clipped"]) == 1.0
    close(s["ema_mean"], 0.97 + 0.03 * 1.2)  # the EMA sees g, not the capped norm
    zc, params, gen = warmed_up([0.5, 1.5], z_thresh=2.0, max_grad_norm=1.2)
    set_grads(params, 3.0, gen)  # a spike: effective = min(T = 1.500001, 1.2)
    s = zc.clip(params)
    close(global_norm(params), 1.2 * 3.0 / (3.0 + 1e-6))
    close(s["ema_mean"], 1.015)  # the EMA sees T, as in the reference


def test_max_grad_norm_hard_clips_during_warmup():
    zc = ZClip(warmup_steps=3, max_grad_norm=2.0)
    params, gen = make_params()
    set_grads(params, 5.0, gen)
    s = zc.clip(params)
    assert float(s["was_clipped"]) == 1.0 and float(s["z_score"]) == 0.0
    close(global_norm(params), 2.0 * 5.0 / (5.0 + 1e-6))
    close(zc.warmup_norms[0], 5.0)  # warmup collects the raw norm


@pytest.mark.parametrize("spike_update,mean,var", [("raw", 0.97 + 0.03 * 3.0, None), ("skip", 1.0, 0.25)])
def test_spike_update_variants(spike_update, mean, var):
    zc, params, gen = warmed_up([0.5, 1.5], z_thresh=2.0, spike_update=spike_update)
    set_grads(params, 3.0, gen)
    s = zc.clip(params)
    close(global_norm(params), 1.500001 * 3.0 / (3.0 + 1e-6))  # clipping is the same
    close(s["ema_mean"], mean)
    close(s["ema_var"], var if var is not None else 0.97 * 0.25 + 0.03 * (3.0 - mean) ** 2)


def test_percentile_raw_ema_preset_is_three_sigma_on_raw_norm():
    zc = ZClip(**PERCENTILE_RAW_EMA)
    params, gen = make_params()
    for n in [1.0, 1.5]:
        set_grads(params, n, gen)
        s = zc.clip(params)
    close(global_norm(params), 1.0 * 1.5 / (1.5 + 1e-6))  # var = 0 after one norm, so T = mu = 1
    close(s["ema_mean"], 0.99 + 0.01 * 1.5)


def test_global_norm_is_norm_of_all_grads_concatenated():
    params, gen = make_params(seed=3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    params.insert(1, torch.nn.Parameter(torch.ones(4)))  # grad None: ignored
    model = torch.nn.Module()
    for i, p in enumerate(params):
        model.register_parameter(f"p{i}", p)
    expected = global_norm(params)
    close(total_norm([p.grad for p in params if p.grad is not None]), expected)
    close(ZClip().clip(model)["raw_norm"], expected)
    close(ZClip().clip(iter(params))["raw_norm"], expected)


@pytest.mark.parametrize("max_grad_norm", [None, 1.1])
@pytest.mark.parametrize("spike_update", ["threshold", "skip"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_norm_leaves_stats_and_grads_alone(bad, spike_update, max_grad_norm):
    """With or without a max_grad_norm cap: an inf norm is above every cap, but scaling by cap / inf would turn
    the gradients to 0 and NaN; a non-finite norm is never clipped."""
    zc, params, gen = warmed_up([0.5, 1.5], z_thresh=2.0, spike_update=spike_update, max_grad_norm=max_grad_norm)
    set_grads(params, 1.0, gen)
    params[0].grad[0, 0] = bad
    before = [p.grad.clone() for p in params]
    s = zc.clip(params)
    assert float(s["was_clipped"]) == 0.0
    for b, p in zip(before, params):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)
    assert float(zc.mean) == 1.0 and float(zc.var) == 0.25


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_norm_during_warmup_with_max_grad_norm_leaves_grads_alone(bad):
    zc = ZClip(warmup_steps=3, max_grad_norm=2.0)
    params, gen = make_params()
    set_grads(params, 5.0, gen)
    params[0].grad[0, 0] = bad
    before = [p.grad.clone() for p in params]
    assert float(zc.clip(params)["was_clipped"]) == 0.0
    for b, p in zip(before, params):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)


def test_non_finite_norm_during_warmup_is_left_out_of_init():
    zc = ZClip(warmup_steps=3)
    params, gen = make_params()
    for n in [1.0, float("nan"), 3.0]:
        set_grads(params, n, gen)
        zc.clip(params)
    close(zc.mean, 2.0)
    close(zc.var, 1.0)


@pytest.mark.parametrize("dtypes,tol", [((torch.float64,) * 3, 1e-5), ((torch.bfloat16,) * 3, 1e-2),
                                        ((torch.float32, torch.bfloat16, torch.float64), 1e-2)],
                         ids=["fp64", "bf16", "mixed"])
def test_fp64_bf16_and_mixed_grads_give_the_fp32_decisions(dtypes, tol):
    def run(dtypes):
        zc = ZClip(warmup_steps=3, z_thresh=2.0)
        params, gen = make_params(dtypes=dtypes)
        steps = []
        for n in [1.0, 1.3, 0.8, 1.1, 9.0, 1.0, 0.9, 20.0]:  # warmup 3, no spike (z ~ 0.3), spike, ..., spike
            set_grads(params, n, gen)
            s = zc.clip(params)
            steps.append((float(s["was_clipped"]), float(s["z_score"]), float(s["clipped_norm"]), global_norm(params)))
        return steps, zc, params

    ref, _, _ = run((torch.float32,) * 3)
    got, zc, params = run(dtypes)
    assert [r[0] for r in ref] == [0, 0, 0, 0, 1, 0, 0, 1]
    assert [g[0] for g in got] == [r[0] for r in ref]
    for step, (g, r) in enumerate(zip(got, ref)):
        assert math.isclose(g[1], r[1], rel_tol=tol, abs_tol=tol), (step, g[1], r[1])
        assert math.isclose(g[3], g[2], rel_tol=tol / 10), (step, g[3], g[2])  # the grads were scaled as reported
    assert [p.grad.dtype for p in params] == list(dtypes)
    assert zc.mean.dtype == zc.var.dtype == zc.warmup_norms.dtype == torch.float32


@pytest.mark.parametrize("resume_at", [1, 4])  # during warmup (3 steps) and after
def test_state_dict_round_trip_resumes_identically(resume_at):
    norms = [1.0, 1.3, 0.8, 1.1, 9.0, 1.0, 0.9, 20.0]
    a = ZClip(warmup_steps=3, z_thresh=2.0)
    pa, ga = make_params()
    pb, gb = make_params()  # same seed: identical gradient stream
    b = None
    for i, n in enumerate(norms):
        if i == resume_at:
            buf = io.BytesIO()
            torch.save(a.state_dict(), buf)
            buf.seek(0)
            b = ZClip()  # default config; the loaded one (warmup 3, z 2.0) replaces it
            b.load_state_dict(torch.load(buf, weights_only=True))
        set_grads(pa, n, ga)
        set_grads(pb, n, gb)
        sa = a.clip(pa)
        if b is not None:
            sb = b.clip(pb)
            assert sa.keys() == sb.keys()
            assert all(torch.equal(sa[k], sb[k]) for k in sa), i
            assert all(torch.equal(x.grad, y.grad) for x, y in zip(pa, pb))
    assert float(sa["was_clipped"]) == 1.0  # the run did exercise clipping after the resume


@pytest.mark.parametrize("kw,valid", [(dict(mode="median"), MODES), (dict(clip_option="max"), CLIP_OPTIONS),
                                      (dict(spike_update="ema"), SPIKE_UPDATES), (dict(warmup_steps=0), ()),
                                      (dict(warmup_steps=2.5), ()), (dict(alpha=1.0), ()),
                                      (dict(max_grad_norm=0.0), ())],
                         ids=["mode", "clip_option", "spike_update", "warmup_steps_0", "warmup_steps_float", "alpha",
                              "max_grad_norm"])
def test_invalid_config_names_the_parameter_its_value_and_the_valid_options(kw, valid):
    (name, value), = kw.items()
    with pytest.raises(ValueError) as e:
        ZClip(**kw)
    msg = str(e.value)
    assert name in msg and repr(value) in msg and all(v in msg for v in valid), msg


def test_clip_without_any_grad_says_to_call_it_after_backward():
    with pytest.raises(ValueError, match=r"\.grad.*backward\(\)"):
        ZClip().clip([torch.nn.Parameter(torch.zeros(3))])


def test_state_dict_keys_are_stable_and_a_missing_key_is_named():
    sd = ZClip().state_dict()  # checkpoints written before this key set must keep loading
    assert set(sd) == {"alpha", "z_thresh", "warmup_steps", "eps", "mode", "clip_option", "clip_factor",
                       "max_grad_norm", "spike_update", "n_seen", "mean", "var", "warmup_norms"}
    del sd["var"]
    with pytest.raises(KeyError, match="'var'"):
        ZClip().load_state_dict(sd)


class ScalarReads(TorchDispatchMode):
    """Records every tensor-to-Python-scalar read (.item(), float(t), bool(t), `if t:`): on a GPU each
    one is a host synchronisation. They all dispatch to aten._local_scalar_dense."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kw", [{}, dict(mode="percentile", max_grad_norm=1.0), dict(clip_option="mean")])
def test_clip_never_reads_a_tensor_back_to_the_host(kw):
    zc = ZClip(warmup_steps=2, z_thresh=2.0, **kw)
    params, gen = make_params()
    with ScalarReads() as reads:
        for n in [0.5, 1.5, 3.0, 1.0, float("inf")]:  # warmup, init, spike, no spike, non-finite
            set_grads(params, n, gen)
            zc.clip(params)
    assert reads.count == 0
    with ScalarReads() as reads:
        float(zc.mean)  # the detector does see a host read
    assert reads.count == 1


def test_post_warmup_clip_compiles_fullgraph_without_recompiles():
    # fullgraph=True turns any host sync (.item(), float(t), `if tensor:`) into an error, and a
    # data-dependent Python branch would show up as a recompile between spike and non-spike steps.
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    eager, params_e, gen_e = warmed_up([0.5, 1.5], z_thresh=2.0)
    compiled, params_c, gen_c = warmed_up([0.5, 1.5], z_thresh=2.0)
    counter = CompileCounter()
    step = torch.compile(lambda ps: compiled.clip(ps), backend=counter, fullgraph=True)
    for n in [3.0, 1.1, 0.9, 40.0]:
        set_grads(params_e, n, gen_e)
        set_grads(params_c, n, gen_c)
        se, sc = eager.clip(params_e), step(params_c)
        assert all(torch.equal(se[k], sc[k]) for k in se), n
        assert all(torch.equal(x.grad, y.grad) for x, y in zip(params_e, params_c))
    assert counter.frame_count == 1
    assert float(se["was_clipped"]) == 1.0
