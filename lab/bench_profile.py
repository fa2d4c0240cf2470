"""
python -m lab.bench --profile: where the eager CPU training step's time goes.

Three looks at the quick start's step (the CPU preset, fp32, eager), each from a different side:
  - torch.profiler over forward+backward passes of ours QAT, ours fp and the nanoGPT-shaped model:
    the top ops by self time;
  - forms of one computation side by side, the values or bits checked equal: the activation
    quantiser's row absmax as quant.py takes it against torch's inf-norm, and RoPE and QuantRMSNorm
    forward+backward as formulas through autograd against the eager step's model.RoPE and
    quant.RMSNormCPU;
  - what each technique costs the whole step (technique_costs): the step timed as it is and with
    Muon's update, RoPE, the activation quantiser or the weight quantiser swapped for its plain
    form, alternated in one process, the nanoGPT-shaped step beside;
  - whether the ratio to nanoGPT holds on a CPU with a faster BLAS (blas_split): each whole step's
    profiled time split into matmuls with attention (what a BLAS speeds up) and the rest, and the
    ratio if the first part ran k times faster, up to the k where it would pass 1.3x.

Results: lab/results/training-speed.md.
Test: python -m pytest tests/test_bench.py -k "profile or technique"
"""

import contextlib
import statistics
import time

import torch

from lab.bench_train import Step, build, train_shape
from tools.runtime import keep_freed_memory


def bench_profile(passes=2, rounds=6, compiled=True):
    """Where the CPU step time goes: torch.profiler over `passes` forward+backward passes of ours
    QAT (the quick start's model), ours fp and nanoGPT; then the activation quantiser's row absmax
    on the quick start's two shapes, as quant.py computes it against torch's inf-norm (the same
    values, checked here); then RoPE and QuantRMSNorm forward+backward, autograd through the
    formula against model.RoPE and quant.RMSNormCPU (the eager step's forms; the same bits,
    checked); then what each technique costs the step (technique_costs, `rounds` rounds); then the
    step split into what a faster BLAS speeds up and the rest (blas_split; ours compiled too with
    `compiled`). Freed memory is kept for the next step, as train.py keeps it (tools.runtime.keep_freed_memory)."""
    from torch.profiler import ProfilerActivity, profile
    keep_freed_memory()
    s = train_shape("cpu", {})
    x, y = s.x[0], s.y[0]
    for name, how in (("ours QAT", dict(quant=True)), ("ours fp", {}), ("nanoGPT", dict(nanogpt=True))):
        model = build(s, **how)[0]
        for _ in range(passes):
            model(x, y)[1].backward()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(passes):
                model(x, y)[1].backward()
        events = prof.key_averages(group_by_input_shape=True)
        total = sum(e.self_cpu_time_total for e in events)
        print(f"{name}: {total / 1e3:.0f} ms of CPU time for {passes} forward+backward passes; top ops:")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]:
            print(f"  {e.key:45s} x{e.count:<4d} {e.self_cpu_time_total / 1e3:8.0f} ms  "
                  f"{e.input_shapes}")
    print("the activation quantiser's row absmax, median us of 20 calls:")
    for shape in ((16, 256, 128), (16, 256, 384)):
        a = torch.randn(shape)
        forms = {"torch.linalg.vector_norm(x, inf)":
                 lambda: torch.linalg.vector_norm(a, float("inf"), dim=-1, keepdim=True),
                 "max(amax(x), -amin(x)) (quant.py)":
                 lambda: torch.maximum(a.amax(-1, keepdim=True), a.amin(-1, keepdim=True).neg_())}
        vals, us = [f() for f in forms.values()], [median_us(f) for f in forms.values()]
        same = "the same values" if torch.equal(*vals) else "DIFFERENT values"
        print(f"  {shape}: " + ", ".join(f"{k} {t:.0f} us" for k, t in zip(forms, us))
              + f" ({us[0] / us[1]:.1f}x; {same})")
    print("forward+backward on the quick start's shapes, median us of 20 calls:")
    for what, forms in eager_forms().items():
        outs, us = [f() for f in forms.values()], [median_us(f) for f in forms.values()]
        same = all(torch.equal(a, b) for a, b in zip(*outs))
        print(f"  {what}: " + ", ".join(f"{k} {t:.0f} us" for k, t in zip(forms, us))
              + f" ({us[0] / us[1]:.1f}x; {'the same bits' if same else 'DIFFERENT bits'})")
    technique_costs(rounds)
    blas_split(compiled=compiled)


# what a faster BLAS (or oneDNN) speeds up: the GEMMs, GEMVs and their batched forms of forward, backward and
# Muon's Newton-Schulz (in place too), and attention's CPU kernels (blocked matmuls inside); all else is the rest
BLAS_OPS = {f"aten::{op}{inplace}" for op in ("mm", "addmm", "bmm", "baddbmm", "mv", "addmv")
            for inplace in ("", "_")} | {"aten::_scaled_dot_product_flash_attention_for_cpu",
                                          "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


def ratio_at(k, ours, base):
    """ours / base step time when each one's (blas, rest) ms has its blas part k times faster."""
    return (ours[0] / k + ours[1]) / (base[0] / k + base[1])


def blas_limit(ours, base, target=1.3):
    """The largest k with ratio_at(k', ours, base) <= target for every k' in [1, k]: 0 where the
    ratio is over target already at k = 1 (this machine), inf where it never passes target (it
    moves monotonically from the BLAS parts' ratio at k -> 0 to the rests' ratio at k -> inf)."""
    (m1, e1), (m0, e0) = ours, base
    if ratio_at(1, ours, base) > target:
        return 0.0
    if e1 <= target * e0:
        return float("inf")
    return (target * m0 - m1) / (e1 - target * e0)  # ratio_at(k) == target


def blas_split(rounds=5, steps=2, compiled=True, target=1.3):
    """Each whole eager step (forward, backward, clipping, optimizer) of ours QAT, with `compiled`
    ours QAT under torch.compile too, and the nanoGPT-shaped model (eager, as lab.against_nanogpt
    runs nanoGPT on the CPU), alternated for `rounds` rounds: `steps` steps timed unprofiled, then
    one under torch.profiler for its self time in BLAS_OPS. The median step minus the median BLAS
    time is the rest (elementwise ops, reductions, Python: what a faster BLAS does not speed up).
    Then ours / nanoGPT if the BLAS part ran k times faster and the rest did not (as on issue 49's
    Xeon), and the k up to which it stays within `target`. Returns {name: (blas ms, rest ms)}."""
    from torch.profiler import ProfilerActivity, profile
    keep_freed_memory()  # as train.py
    s = train_shape("cpu", {})
    runs = {"ours QAT": dict(quant=True), "ours QAT, compiled": dict(quant=True, compiled=True),
            "nanoGPT-shaped": dict(nanogpt=True)}
    if not compiled:
        del runs["ours QAT, compiled"]
    built, wall, blas = {}, {k: [] for k in runs}, {k: [] for k in runs}
    for name, how in runs.items():
        built[name] = Step(s, *build(s, **{k: v for k, v in how.items() if k != "compiled"}),
                           compiled=how.get("compiled", False))
        for _ in range(2):
            built[name]()  # the optimizer's state made (and a compiled step compiled)
    for _ in range(rounds):
        for name, step in built.items():
            wall[name] += [1000 * timed(step) for _ in range(steps)]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            blas[name].append(sum(e.self_cpu_time_total for e in prof.key_averages()
                                  if e.key in BLAS_OPS) / 1e3)
    split = {k: (statistics.median(blas[k]), statistics.median(wall[k]) - statistics.median(blas[k]))
             for k in runs}
    base = split["nanoGPT-shaped"]
    print(f"a faster BLAS: ms per whole step ({rounds} x {steps} steps each, alternated), matmuls and "
          f"attention (profiled) + the rest; nanoGPT-shaped {base[0]:.1f} + {base[1]:.1f}")
    for name, ours in split.items():
        if name == "nanoGPT-shaped":
            continue
        print(f"  {name} {ours[0]:.1f} + {ours[1]:.1f} (ratios {ours[0] / base[0]:.2f}x and "
              f"{ours[1] / base[1]:.2f}x); ours / nanoGPT with the matmuls and attention k times "
              "faster: " + ", ".join(f"k={k:g} {ratio_at(k, ours, base):.2f}x" for k in (1, 1.42, 2, 4))
              + f", k->inf {ours[1] / base[1]:.2f}x; within {target}x up to k = "
              f"{blas_limit(ours, base, target):.2f}")
    print(f"  on any BLAS it takes the rest within {target}x of nanoGPT's: <= {target * base[1]:.1f} ms here")
    return split


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def plain_forms():
    """{technique: a context manager that swaps it for its plain form in the QAT step}, for
    technique_costs: the step then computes something else; only its time means anything."""
    from unittest import mock
    import model
    import muon
    import quant
    return {"Muon's update (not applied)": lambda: mock.patch.multiple(  # by matrix, and stacked
                muon.Muon, muon_step=lambda self, p, group: None,
                muon_steps=lambda self, params, group: None),
            "RoPE (not applied)": lambda: mock.patch.object(
                model, "apply_rope", lambda x, cos, sin: x),
            "activation quantiser (plain norms)": lambda: mock.patch.object(
                quant.QuantRMSNorm, "forward", quant.RMSNorm.forward),
            "weight quantiser (latent weights)": lambda: mock.patch.object(
                quant.BitLinear, "quantized_weight", lambda self: self.weight)}


def technique_costs(rounds=6, steps=4):
    """What each technique costs the eager CPU QAT step here: the step as it is, and with one
    technique at a time swapped for its plain form (plain_forms), alternated in one process
    (rounds x steps steps each, the median); the nanoGPT-shaped step beside. [(name, ms)]."""
    s = train_shape("cpu", {})
    ours, nanogpt = Step(s, *build(s, quant=True)), Step(s, *build(s, nanogpt=True))
    runs = {"ours QAT, as it is": (ours, contextlib.nullcontext),
            **{f"  without {k}": (ours, v) for k, v in plain_forms().items()},
            "nanoGPT-shaped": (nanogpt, contextlib.nullcontext)}
    ms = {k: [] for k in runs}
    for _ in range(rounds):
        for k, (step, swap) in runs.items():
            warmup = 0 if ms[k] else 1  # one untimed step the first time
            with swap():
                for i in range(warmup + steps):
                    t0 = time.perf_counter()
                    step()
                    if i >= warmup:
                        ms[k].append(1000 * (time.perf_counter() - t0))
    rows = [(k, statistics.median(v)) for k, v in ms.items()]
    print(f"what each technique costs the eager CPU QAT step, median ms of {rounds} x {steps} "
          "steps each, alternated:")
    for k, t in rows:
        print(f"  {k:50s} {t:7.1f} ms  {t - rows[0][1]:+6.1f}")
    return rows


def median_us(fn, n=20):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t0))
    return sorted(times)[n // 2]


def eager_forms():
    """{what: {form: fn}}, each fn a forward+backward returning (output, input gradients): the
    formula through autograd first, then the form the eager CPU step runs."""
    import model
    import quant

    def run(f, *xs):
        xs = [x.detach().requires_grad_() for x in xs]
        y = f(*xs)
        y.backward(torch.ones_like(y))
        return (y.detach(), *(x.grad for x in xs))

    q = torch.randn(16, 256, 4, 32).transpose(1, 2)  # (B, nh, T, hd), as Attention's q
    cos, sin = model.precompute_rope(32, 256, 10000.0)

    def rope_formula(x):
        xs = x.unflatten(-1, (2, -1))
        return (xs * cos + xs.flip(-2) * sin).flatten(-2)

    h = torch.randn(16, 256, 384)
    norm = quant.QuantRMSNorm(384)

    def norm_unfused(x):
        y = quant.RMSNorm.forward(norm, x)
        return quant.ste(y, quant.activation_fake_quant(y), norm.lambda_)

    return {"RoPE on q (16, 4, 256, 32)": {
                "x * cos + flip(x) * sin": lambda: run(rope_formula, q),
                "model.RoPE": lambda: run(lambda x: model.apply_rope(x, cos, sin), q)},
            "QuantRMSNorm on (16, 256, 384)": {
                "norm, quantiser, STE as ops": lambda: run(norm_unfused, h),
                "quant.RMSNormCPU": lambda: run(norm, h)}}
