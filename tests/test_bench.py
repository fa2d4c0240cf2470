"""Tests for lab/bench*.py and lab/against_nanogpt.py: the time-to-quality interpolation against its
closed form, the fixed val windows and a tiny end-to-end run whose printed ratio is the quotient of
the two printed times; the kernel table's and the decode table's harness on CPU (plain-torch
stand-ins, tiny shapes); the training step's grad accumulation against one big batch; the work
counter against a closed form; real nanoGPT's stand-in; every bad flag and Ctrl-C as one error line.
Run: python -m pytest tests/test_bench.py"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
from conftest import ENV, ROOT, fails
from lab import bench, bench_decode, bench_profile, bench_quality, bench_train


def test_time_to_interpolates_between_evaluations_at_the_first_crossing():
    points = [(0, 0.0, 5.0), (20, 10.0, 3.0), (40, 20.0, 2.0), (60, 30.0, 2.5), (80, 40.0, 1.5)]
    # 3.0 -> 2.0 from 10 s to 20 s: half way (not step 60)
    assert bench_quality.time_to(points, 2.5) == (15.0, 30.0)
    assert bench_quality.time_to(points, 2.0) == (20.0, 40.0)
    assert bench_quality.time_to(points, 5.0) == (0.0, 0.0)
    assert bench_quality.time_to(points, 1.0) is None
    # the first point (lambda reaching 1) already below
    assert bench_quality.time_to(points[2:], 2.5) == (20.0, 40.0)


def test_val_windows_are_evenly_spread_and_the_same_each_time(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    tokens = np.arange(1000) % 257
    data.write_shard(str(d / "val_000.bin"), tokens)
    w = bench_quality.val_windows(str(d), 32, 5)
    assert w.shape == (5, 33) and w.dtype == torch.int64
    assert w[:, 0].tolist() == [int(s) % 257 for s in np.linspace(0, 1000 - 33, 5).astype(int)]
    assert w[-1, -1] == tokens[-1]  # the last window ends at the split's last token
    assert torch.equal(w, bench_quality.val_windows(str(d), 32, 5))


@pytest.mark.slow
def test_quality_prints_the_ratio_of_the_two_times_to_the_same_target():
    args = ("--max_iters=40 --n_layer=1 --n_head=2 --n_embd=32 --batch_size=4 --block_size=32 "
            "--lambda_warmup_steps=10 --warmup_steps=5")
    out = subprocess.run([sys.executable, "-m", "lab.bench", "--quality", f"--train_args={args}", "--target=5.3"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    times = dict(re.findall(r"^  (nanoGPT|ours)\s*: ([\d.]+) s, at step", out.stdout, re.M))
    ratio = float(re.search(r"ours / nanoGPT: ([\d.]+)", out.stdout).group(1))
    assert set(times) == {"nanoGPT", "ours"}, out.stdout
    assert abs(ratio - float(times["ours"]) / float(times["nanoGPT"])) < 0.002 + 0.01 * ratio  # times: 3 digits
    assert "target val loss 5.3000 (--target)" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "lab.bench", "--target=2"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --target is an option of --quality; add --quality"


@pytest.mark.parametrize("flag, facts", [("--target=nan", ["--target=nan", "> 0"]), ("--target=-1", ["--target=-1", "> 0"]),
                                         ("--target=inf", ["--target=inf"]),
                                         ('--train_args="x', ['--train_args="x', "No closing quotation"]),
                                         # with --overwrite=True it replaced that run, and saved nothing there
                                         ("--train_args=--out_dir=out --run_name=r --overwrite=True",
                                          ["--out_dir=out is set by this benchmark", "leave it out"])])
def test_quality_refuses_an_impossible_target_or_unsplittable_train_args_before_training(flag, facts, capsys,
                                                                                          monkeypatch):
    """--target=nan (or -1) and --train_args='"x' (shlex cannot split it) are one line, exit 2,
    before any run is set up (train.setup must not be reached): no benchmark runs only to report
    "not reached", no traceback."""
    import train

    def no_setup(argv):
        raise AssertionError("trained before checking --target and --train_args")
    monkeypatch.setattr(train, "setup", no_setup)
    err = fails(capsys, "--quality", flag, code=2, main=bench.main)
    assert all(f in err for f in facts), err


TINY_QUALITY = ("--max_iters=10 --n_layer=1 --n_head=2 --n_embd=32 --batch_size=4 --block_size=32 --warmup_steps=2 "
                "--lambda_warmup_steps=8")


@pytest.fixture(scope="module")
def quality():
    """bench_quality in this process on a tiny shape, evaluated every step, to a target of 100
    (above any start, so each run counts from its first evaluation that counts): (what it returns,
    its stdout, the batches each DataLoader handed out, in the order the loaders were first used).
    About 2 s."""
    import contextlib
    import io
    seen, real = {}, data.DataLoader.next_batch

    def recording(self):
        x, y = real(self)
        seen.setdefault(id(self), []).append(x.clone())
        return x, y
    out, threads = io.StringIO(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
            mp.setattr(data.DataLoader, "next_batch", recording)
            got = bench_quality.bench_quality(TINY_QUALITY, target=100.0, every=1, windows=4)
    finally:
        torch.set_num_threads(threads)
    return got, out.getvalue(), list(seen.values())


def test_quality_counts_ours_only_from_the_step_where_lambda_reaches_1(quality):
    """Evaluated at every step of an 8-step lambda warm-up, ours' first counted point is step 8
    (lambda 1), never a step at lambda < 1 although each was evaluated and already below the target;
    the baseline counts from step 0."""
    got, out, _ = quality
    assert got["ours"][1] == 8 and got["nanoGPT"] == (0.0, 0), (got, out)
    assert re.search(r"^ours    : val [\d.]+ at step 8 ", out, re.M), out


def test_quality_baseline_reads_a_copy_of_our_loader_so_both_see_the_same_batches(quality):
    """Two loaders hand out batches (the baseline's, used first, and ours): ours' 8 batches are the
    baseline's first 8, in order. A shared loader would give ours the batches after the baseline's
    10."""
    _, _, batches = quality
    assert len(batches) == 2, [len(b) for b in batches]
    base, ours = batches
    assert len(base) == 10 and len(ours) == 8 and all(torch.equal(a, b) for a, b in zip(base, ours))


def test_quality_with_a_target_the_baseline_starts_below_prints_no_ratio(quality):
    """The baseline reaches a target above its starting val loss at 0 s: no ratio (a ZeroDivisionError before)."""
    _, out, _ = quality
    assert "ours / nanoGPT: none: the baseline's val loss at step 0 is already at or below 100.0000" in out, out


def test_profile_names_each_models_top_ops_and_times_the_two_absmax_forms_on_equal_values(capsys):
    """python -m lab.bench --profile: the top ops of ours QAT, ours fp and nanoGPT, and the quantiser's
    absmax as quant.py computes it beside torch's inf-norm, on both shapes, with the values checked equal;
    RoPE and QuantRMSNorm forward+backward as formulas and as the eager step's Functions, the bits equal."""
    bench_profile.bench_profile(passes=1, rounds=1, compiled=False)
    out = capsys.readouterr().out
    assert all(f"{name}: " in out for name in ("ours QAT", "ours fp", "nanoGPT")), out
    lines = [line for line in out.splitlines() if "max(amax(x), -amin(x))" in line]
    assert len(lines) == 2 and all("the same values" in line for line in lines), out
    lines = [line for line in out.splitlines() if "model.RoPE" in line or "quant.RMSNormCPU" in line]
    assert len(lines) == 2 and all("the same bits" in line for line in lines), out


def test_blas_limit_is_where_the_ratio_reaches_the_target():
    """--profile's faster-BLAS line: ratio_at is (m1/k + e1) / (m0/k + e0); blas_limit the k where it reaches
    the target (a closed form), inf where the rests' ratio is within it, 0 where k = 1 is already over it."""
    ours, base = (160.0, 50.0), (150.0, 20.0)
    assert bench_profile.ratio_at(1, ours, base) == 210.0 / 170.0
    assert bench_profile.ratio_at(2, ours, base) == 130.0 / 95.0
    k = bench_profile.blas_limit(ours, base, 1.3)
    assert k == (1.3 * 150.0 - 160.0) / (50.0 - 1.3 * 20.0) and abs(bench_profile.ratio_at(k, ours, base) - 1.3) < 1e-12
    assert bench_profile.ratio_at(k * 0.99, ours, base) < 1.3 < bench_profile.ratio_at(k * 1.01, ours, base)
    assert bench_profile.blas_limit((160.0, 25.0), base, 1.3) == float("inf")  # the rest within 1.3x
    assert bench_profile.blas_limit((160.0, 80.0), base, 1.3) == 0.0  # 240 / 170 > 1.3 at k = 1


def test_blas_split_counts_every_matmul_the_step_runs_on_the_blas_side(capsys, monkeypatch):
    """The split's BLAS side holds every GEMM, GEMV, batched GEMM and attention kernel the steps of ours
    QAT and nanoGPT profile (a name missing would put its time into the rest); the split runs, its
    compiled row plumbed (torch.compile stubbed: this test times nothing)."""
    import re
    from torch.profiler import ProfilerActivity, profile
    s = bench_train.train_shape("cpu", {})
    for how in (dict(quant=True), dict(nanogpt=True)):
        step = bench_train.Step(s, *bench_train.build(s, **how))
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        names = {e.key for e in prof.key_averages()}
        matmuls = {n for n in names if re.fullmatch(r"aten::\w*(mm|mv)_?|aten::\w*flash_attention\w*", n)}
        assert {"aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= matmuls, names
        assert matmuls <= bench_profile.BLAS_OPS, matmuls - bench_profile.BLAS_OPS
    monkeypatch.setattr(bench_train.torch, "compile", lambda model, **kw: model)
    split = bench_profile.blas_split(rounds=1, steps=1, compiled=True)
    assert list(split) == ["ours QAT", "ours QAT, compiled", "nanoGPT-shaped"]
    assert all(blas > 0 for blas, _ in split.values()), split
    out = capsys.readouterr().out
    assert out.count("within 1.3x up to k = ") == 2 and "on any BLAS it takes the rest" in out, out


def test_muon_bench_times_ns5_both_ways_and_the_stacks_give_the_same_bits(capsys):
    """python -m lab.bench --muon: NS5 in bf16 and fp32, matrix by matrix and stacked by shape; on the
    CPU model's shapes the stacked results are the per-matrix ones bit for bit."""
    bench.bench_muon()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("NS5 on the 28")]
    assert len(lines) == 4 and sum("stacks by shape" in line for line in lines) == 2, lines
    assert all(line.endswith("; the same bits") for line in lines if "stacks" in line), lines


def test_technique_costs_takes_each_technique_out_of_the_step_and_times_each_run(capsys):
    """--profile's last table: each plain form takes work out of the QAT step (fewer aten ops, counted:
    a swap that missed its target would leave the count as it is), and every run gets a time."""
    s = bench_train.train_shape("cpu", {})
    step = bench_train.Step(s, *bench_train.build(s, quant=True))
    step()  # the optimizer's state made: each later step dispatches the same ops

    def ops():
        return sum(n for n, *_ in bench_train.count_work(step.phases()).values())
    full = ops()
    for name, swap in bench_profile.plain_forms().items():
        with swap():
            assert ops() < full, name
    assert ops() == full  # each swap undone
    rows = bench_profile.technique_costs(rounds=1, steps=1)
    names = [name.strip() for name, _ in rows]
    assert names == ["ours QAT, as it is", *(f"without {k}" for k in bench_profile.plain_forms()),
                     "nanoGPT-shaped"] and all(ms > 0 for _, ms in rows), rows
    assert "what each technique costs" in capsys.readouterr().out


@pytest.mark.slow
def test_train_with_a_pretrained_model_times_ours_against_transformers_and_generates(tmp_path, capsys):
    """python -m lab.bench --train --model=<a pretrained model> on tests/imported.py's tiny Llama
    (no download): transformers' step, ours fp, ours QAT (AdamW and Muon), the ratios, three
    generators and two profiles."""
    import re
    from imported import tiny_llama
    src = tiny_llama(str(tmp_path / "tiny_llama"))
    bench_train.bench_pretrained(src, steps=1, warmup=0, B=1, T=16, new_tokens=2)
    out = capsys.readouterr().out
    for label in ("transformers LlamaForCausalLM", "ours fp (AdamW)", "ours ternary QAT, SubLN, lambda 1 (AdamW)",
                  "(Muon + AdamW)", "transformers generate", "ours packed ternary", "one QAT forward+backward",
                  "the packed model generating"):
        assert label in out, label
    ratios = re.search(r"ours fp / transformers: ([0-9.]+); ours QAT / transformers: ([0-9.]+)", out)
    assert ratios and all(float(r) > 0 for r in ratios.groups()), out
    assert "--model is an option of --train" in fails(capsys, f"--model={src}", code=2, main=bench.main)
    gpt2 = tmp_path / "gpt2"  # a model we do not import: one line naming it, not a traceback
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}')
    msg = fails(capsys, "--train", f"--model={gpt2}", code=2, main=bench.main)
    assert f"--model={gpt2}" in msg and "gpt2" in msg, msg


def test_kernel_table_goes_on_past_a_shape_that_fails(capsys, monkeypatch, one_thread):
    """A shape whose kernel cannot run on the GPU at hand (a config it refuses) prints one failed line and
    the table goes on: the other shapes' rows are what a short GPU window is for."""
    real = bench.kernel_row

    def row(M, N, K, dev, budget):
        if M == 20:
            raise RuntimeError("out of resource: shared memory\nmore detail")
        return real(M, N, K, dev, budget)
    monkeypatch.setattr(bench, "kernel_row", row)
    rows = bench.bench_kernels(shapes=[(20, 48, 64), (1, 64, 64)], dev="cpu", budget=64 * 1024)
    out = capsys.readouterr().out
    assert [(r["M"], r["N"]) for r in rows] == [(1, 64)]
    assert "   20     48     64 failed: RuntimeError: out of resource: shared memory\n" in out, out


def test_gpu_time_counts_each_kernel_once():
    """torch.profiler's averaged events on CUDA hold each kernel's time three ways: the kernel itself, the CPU op
    that launched it (its self device time) and a user annotation's GPU span around compiled code. --train's GPU
    profile sums only the kernels (here 100 of the 300 us the three events say)."""
    from types import SimpleNamespace
    from torch.autograd import DeviceType
    events = [SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU, self_device_time_total=100.0),
              SimpleNamespace(key="sm90_xmma_gemm", device_type=DeviceType.CUDA, self_device_time_total=100.0,
                              is_user_annotation=False),
              SimpleNamespace(key="## Call CompiledFxGraph ##", device_type=DeviceType.CUDA,
                              self_device_time_total=100.0, is_user_annotation=True)]
    assert [e.key for e in bench_train.gpu_work(events)] == ["sm90_xmma_gemm"]


def test_decode_rows_on_cpu_each_ratio_the_quotient_and_the_prefill_cancelled(capsys, one_thread):
    """bench_decode on CPU: a tiny fp32 model and its packed twin, model.generate and the static
    cache, eager (CUDA adds the graphed rows and the replay/sync columns, '-' here). Every row's
    tokens are model.generate's (exact on CPU); each printed packed/fp ratio is the quotient of the
    printed tokens/s; ops per token is the same from lengths (2, 4) as from (4, 8): the prompt's
    prefill cancels in the difference."""
    rows = bench_decode.bench_decode(new_tokens=12, prompt_len=8)
    out = capsys.readouterr().out
    printed = {(m, mode): (float(t), s) for m, mode, t, s in re.findall(
        r"^(fp|packed) \w+: (model\.generate|static KV cache, eager)(?: \(static KV cache\))? "
        r"+([\d.]+) +[\d.]+ +- +[\d.]+ +- +(\d+/\d+)$",
        out, re.M)}
    assert len(printed) == 4 and all(t > 0 and s == "12/12" for t, s in printed.values()), out
    assert "CUDA graph" not in out and "float32; batch 1, greedy, 12 new tokens" in out
    ratios = dict(re.findall(r"(generate|eager) ([\d.]+)", re.search(r"^packed / fp tokens/s: (.*)$", out, re.M)[1]))
    for key, mode in (("generate", "model.generate"), ("eager", "static KV cache, eager")):
        want = printed["packed", mode][0] / printed["fp", mode][0]
        assert abs(float(ratios[key]) - want) < 0.006 + 0.002 * want, (key, out)
    assert all(r["ops"] == int(r["ops"]) > 0 and r["replay_us"] is None and r["syncs"] is None
               for r in rows.values()), rows
    from tools import decode
    model = bench_decode.make_models("preset", "cpu", torch.float32)["packed"]
    prompt = torch.arange(8).view(1, 8)
    gen = lambda n: decode.Decoder(model, "eager").generate(prompt, n, top_k=1)  # noqa: E731
    gen(1)  # the first CPU call of a packed layer unpacks its codes once
    per = [bench_decode.per_token(bench_decode.count_aten_ops, gen, k) for k in (2, 4)]
    assert per[0] == per[1] == rows["packed", "eager"]["ops"], per


def test_per_token_differences_cancel_a_fixed_cost():
    """per_token against a closed form: a count of 7 + 3 n for n tokens is 3 per token at any k."""
    assert bench_decode.per_token(lambda fn: fn(), lambda n: 7 + 3 * n, 2) == 3
    assert bench_decode.per_token(lambda fn: fn(), lambda n: 7 + 3 * n, 5) == 3


def test_decode_1b_shape_is_a_1b_llama_on_cuda_and_its_tiny_twin_runs_on_cpu(capsys, one_thread):
    """--shape=1b: on CUDA 16 x 2048, FFN 8192, 32 query / 8 kv heads, vocab 128,256 (~1.24B
    parameters, counted from the config as a closed form); on CPU a tiny GQA twin through the same
    code."""
    c = bench_decode.decode_config("1b", True, False)
    hd, kv = c.head_size(), c.kv_heads()
    per_layer = (c.n_embd * (c.n_head * hd + 2 * kv * hd) + c.n_head * hd * c.n_embd
                 + 3 * c.n_embd * c.hidden_dim())
    got = (c.n_layer, c.n_embd, c.hidden_dim(), c.n_head, kv, c.vocab_size)
    assert got == (16, 2048, 8192, 32, 8, 128256)
    assert 1.2e9 < c.n_layer * per_layer + c.vocab_size * c.n_embd < 1.3e9
    rows = bench_decode.bench_decode(shape="1b", new_tokens=4, prompt_len=4)
    assert set(rows) == {(m, mode) for m in ("fp", "packed") for mode in ("generate", "eager")}
    assert "4/2 heads" in capsys.readouterr().out


def test_decode_modes_picked_run_in_their_order_each_mode_for_both_models(capsys, one_thread):
    """--modes: gpu_check runs the graphed rows first (its targets), so a window that runs out loses
    the eager ones; each mode's fp and packed rows come together, printed as timed and again once
    counted, after every timing (the profiler never runs before a timed call). A mode not run at the
    shape here (graph without CUDA) is refused in one line, exit 2, before any model is built."""
    assert list(bench_decode.pick_modes("preset", True, "graph,compile,eager")) == ["graph", "compile", "eager"]
    assert list(bench_decode.pick_modes("1b", True)) == ["eager", "graph"]
    bench_decode.bench_decode(new_tokens=4, prompt_len=4, picked="eager,generate")
    out = capsys.readouterr().out
    timed, counted = out.split("counted after the timings")
    for table in (timed, counted):  # the rows as timed ('-' for the counts), then counted
        assert re.findall(r"^(fp|packed) \w+: (model\.generate|static KV cache, eager)", table, re.M) == [
            ("fp", "static KV cache, eager"), ("packed", "static KV cache, eager"),
            ("fp", "model.generate"), ("packed", "model.generate")], out
    assert len(re.findall(r" +- +- +4/4$", timed, re.M)) == 4 and len(re.findall(r" +[\d.]+ +- +4/4$", counted, re.M)) == 4
    p = subprocess.run([sys.executable, "-m", "lab.bench", "--decode", "--modes=eager,graph"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --modes=eager,graph: graph is not a mode of --shape=preset here; expected some of generate, eager"]
    assert "tok/s" not in p.stdout, p.stdout


def test_decode_preset_shape_on_cuda_is_the_cuda_presets_model_fp_and_ternary(monkeypatch):
    """--decode's default shape on CUDA (its config built here, with the device check told that CUDA
    is there): the CUDA preset's model, 12 x 768, 12 heads, 1024 positions, GPT-2's vocabulary padded
    to 50,304, SubLN; quant only for the packed one."""
    from tools import checks
    monkeypatch.setattr(checks, "check_device", lambda device: None)
    for quant in (False, True):
        c = bench_decode.decode_config("preset", True, quant)
        assert (c.n_layer, c.n_embd, c.n_head, c.block_size, c.vocab_size) == (12, 768, 12, 1024, 50304)
        assert (c.quant, c.subln) == (quant, True)


def test_kernel_table_on_cpu_rotates_past_the_budget_and_leaves_graph_columns_empty(capsys,
                                                                                    one_thread):
    """bench_kernels with the plain-torch stand-ins on CPU: one row per shape (decode at M <= 16,
    prefill above), the weight copies just past the budget (a closed form), '-' in the CUDA-graph
    and bandwidth columns, every measured column > 0; the per-call median of a graph's replays."""
    rows = bench.bench_kernels(shapes=[(1, 64, 64), (20, 48, 64)], dev="cpu", budget=64 * 1024)
    out = capsys.readouterr().out
    # ceil(65536 / (N K 2)), ceil(65536 / (N K / 4))
    assert [r["copies"] for r in rows] == [(8, 64), (11, 86)]
    # bytes a call moves: packed W, int8 x, bf16 y, x's scales; prefill also W's int8 codes, written then read
    assert [r["moved"] for r in rows] == [64 * 16 + 64 + 64 * 2 + 4, 48 * 16 + 20 * 64 + 20 * 48 * 2 + 20 * 4 + 2 * 48 * 64]
    lines = re.findall(r"^ +(\d+) +(\d+) +(\d+) +(decode|prefill) \| +- +- +- +- \| +- +- \|(.*)$",
                       out, re.M)
    assert [(m, k) for m, _, _, k, _ in lines] == [("1", "decode"), ("20", "prefill")], out
    assert all(float(v) > 0 for *_, rest in lines for v in rest.replace("|", " ").split())
    assert bench.per_call_median_us([3.0, 1.0, 2.0], 4) == 500.0
    assert bench.copies_for(300 * 2**20) == 2 and bench.copies_for(2**20) == 256


def test_train_step_accumulates_micro_batches_as_one_big_batch(one_thread):
    """A --train step at grad_accum=2: two forward/backward phases then one optimizer phase, and the
    gradients it accumulates equal the gradients of the mean loss over both micro-batches in one
    batch (nanoGPT baseline and ours QAT, whose weights are quantised once for the step)."""
    s = bench_train.train_shape("cpu", dict(n_layer=1, n_head=2, n_embd=32, block_size=16,
                                            batch_size=2, grad_accum=2))
    assert tuple(s.x.shape) == (2, 2, 16)
    for how in (dict(nanogpt=True), dict(quant=True)):
        model, opt, clipper = bench_train.build(s, **how, shape=dict(n_layer=1, n_head=2, n_embd=32,
                                                                     block_size=16))
        step = bench_train.Step(s, model, opt, clipper)
        assert [n for n, _ in step.phases()] == ["forward", "backward"] * 2 + ["optimizer"]
        for i in range(2):
            step.backward(step.forward(i))
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        import quant
        quant.clear_weight_quant(model)
        model(s.x.flatten(0, 1), s.y.flatten(0, 1))[1].backward()
        for n, p in model.named_parameters():
            assert torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-6), (how, n)


@pytest.mark.parametrize("argv, facts", [
    (["--decode", "--shape=7b"], ["--shape=7b", "preset", "1b"]),
    (["--shape=1b"], ["--shape is an option of --decode"]),
    (["--train", "--runs=fp,warp"], ["--runs=fp,warp", "nanogpt_c"]),
    (["--runs=fp"], ["--runs is an option of --train"]),
    (["--train", "--runs=fp", "--model=x"], ["--runs", "--model"])])
def test_bench_refuses_bad_options_in_one_line(argv, facts, capsys):
    err = fails(capsys, *argv, code=2, main=bench.main)
    assert all(f in err for f in facts), err


@pytest.mark.slow
def test_train_times_every_run_and_says_where_each_compiled_steps_time_goes(capsys, monkeypatch):
    """bench_train on a tiny shape (CPU: fp32): one row per run, the compiled ratios against the
    compiled nanoGPT step as the quotients of the returned times, and for nanoGPT, ours fp and ours
    QAT (compiled) the top ops by self time, each a share of that step's profiled total. The
    compiled runs go through aot_eager (dynamo and AOT autograd, no codegen): what is checked here
    is the report; inductor's own compile of the model is tests/test_model.py's (~40 s cold, once)."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compile_(m, backend="aot_eager", **kw))
    shape = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=2)
    runs = ["nanogpt", "fp", "qat", "nanogpt_c", "fp_c", "qat_c"]  # not the unfused and bf16 runs
    r = bench_train.bench_train(steps=1, warmup=1, shape=shape, runs=runs)
    out = capsys.readouterr().out
    assert {"nanogpt", "fp", "qat", "nanogpt_c", "fp_c", "qat_c"} <= set(r)
    # freed memory kept as train.py keeps it, and each run's page faults per timed step in the last column
    assert "freed memory kept" in out and re.search(r"1st s +faults$", out, re.M), out
    rows = re.findall(r"^(?:nanoGPT|ours).* ([\d.]+) +(\d+)$", out, re.M)
    assert len(rows) == len(runs), out
    assert all(v["ms"] > 0 for v in r.values())
    fp, qat = re.search(r"compiled nanoGPT step: ours fp ([\d.]+) .*, ours QAT ([\d.]+)", out).groups()
    assert float(fp) == pytest.approx(r["fp_c"]["ms"] / r["nanogpt_c"]["ms"], abs=6e-4)
    assert float(qat) == pytest.approx(r["qat_c"]["ms"] / r["nanogpt_c"]["ms"], abs=6e-4)
    sections = re.findall(r"^where a step of (.+?) goes: [\d.]+ ms/step timed, ([\d.]+) ms of CPU time per step "
                          r"profiled.*\n((?:  .*\n)+)", out, re.M)
    assert [s[0] for s in sections] == ["nanoGPT baseline, compiled", "ours fp, compiled", "ours ternary QAT, compiled"]
    for _, total, rows in sections:
        ms = [float(m) for m in re.findall(r" ([\d.]+) ms +[\d.]+%$", rows, re.M)]
        assert 5 <= len(ms) <= 12 and ms == sorted(ms, reverse=True) and sum(ms) <= float(total) + 0.01 * len(ms)
    # the machine-independent work of one eager step: ops and MB by phase, and ours over nanoGPT's
    work = {label.strip(): [(int(o), float(b)) for o, b in re.findall(r"(\d+) / +([\d.]+)", rest)]
            for label, rest in re.findall(r"^  (.{40}) (forward .*)$", out, re.M)}
    assert {"nanoGPT baseline (fp, AdamW)", "ours fp (stage 1)", "ours ternary QAT (stage 2)"} <= set(work), work
    for label, phases in work.items():
        assert len(phases) == 4 and all(o > 0 and b > 0 for o, b in phases), (label, phases)
        assert phases[3] == (sum(o for o, _ in phases[:3]), pytest.approx(sum(b for _, b in phases[:3]), abs=0.3))
    ratio = float(re.search(r"ours ternary QAT \(stage 2\) / nanoGPT: ([\d.]+)x the ops", out).group(1))
    assert ratio == pytest.approx(work["ours ternary QAT (stage 2)"][3][0] / work["nanoGPT baseline (fp, AdamW)"][3][0],
                                  abs=0.006)
    # the bytes outside matmuls and attention: what count_work returned, less its matmul share
    rest = {k: sum(b - m for _, b, m in r[k]["work"].values()) for k in ("nanogpt", "qat")}
    assert 0 < rest["qat"] < work["ours ternary QAT (stage 2)"][3][1]
    assert f"attention {rest['qat']:8.1f}" in out
    ratio = float(re.search(r"ours ternary QAT \(stage 2\) / nanoGPT: .* ([\d.]+)x the bytes outside", out).group(1))
    assert ratio == pytest.approx(rest["qat"] / rest["nanogpt"], abs=0.006)


def test_count_work_counts_ops_and_the_bytes_of_their_tensors():
    """count_work against a closed form: a (64, 32) @ (32, 16) fp32 mm touches 4 (64*32 + 32*16 +
    64*16) bytes, all of them a matmul's; a view, an allocation and a relabelling are ops that move
    nothing; an out= write counts its output once (a * a into c: two reads, one write), an in-place
    op its tensor twice."""
    a, b, c = torch.randn(64, 32), torch.randn(32, 16), torch.empty(64, 32)
    w = bench_train.count_work([("mm", lambda: a @ b), ("view", lambda: a.view(32, 64)),
                                ("alloc", lambda: (torch.empty_like(a), a.new_empty(8))),
                                ("relabel", lambda: torch.ops.aten._unsafe_view(a, (32, 64))),
                                ("out", lambda: torch.mul(a, a, out=c)), ("in place", lambda: c.mul_(2))])
    n = 4 * 64 * 32 / 1e6  # one (64, 32) fp32 tensor
    mm = 4 * (64 * 32 + 32 * 16 + 64 * 16) / 1e6
    assert w["mm"] == (1, mm, mm) and w["view"] == (1, 0.0, 0.0)  # the third: bytes in matmuls and attention
    assert w["alloc"] == (2, 0.0, 0.0) and w["relabel"] == (1, 0.0, 0.0)
    assert w["out"] == (1, 3 * n, 0.0) and w["in place"] == (1, 2 * n, 0.0)


FAKE_NANOGPT = '''import os, sys, numpy as np, pickle
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
d = os.path.join("data", args["dataset"])
train = np.fromfile(os.path.join(d, "train.bin"), dtype=np.uint16)
val = np.fromfile(os.path.join(d, "val.bin"), dtype=np.uint16)
with open(os.environ["SEEN"], "w") as f:
    f.write(repr((len(train), int(train[:1000].sum()), len(val), pickle.load(open(os.path.join(d, "meta.pkl"), "rb")),
                  args)))
for i in range(int(args["max_iters"]) + 1):
    print(f"iter {i}: loss 2.0, time {100 + i * i}.00ms, mfu 0.04%")
'''


@pytest.mark.slow
def test_against_nanogpt_feeds_it_our_byte_shards_in_its_format_and_prints_both_ratios(tmp_path, monkeypatch, capsys):
    """lab.against_nanogpt: nanoGPT's train.py (here a stand-in that records what it was given)
    reads our byte shards as its uint16 train.bin/val.bin with vocab 257 at our shape, from a
    directory of its own; the ratio is ours over its median step; a path that is not a nanoGPT
    checkout is one error line."""
    from lab import against_nanogpt
    ng = tmp_path / "nanoGPT"
    ng.mkdir()
    (ng / "train.py").write_text(FAKE_NANOGPT)
    (ng / "model.py").write_text("")
    (ng / "configurator.py").write_text("")
    monkeypatch.setenv("SEEN", str(tmp_path / "seen"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    against_nanogpt.main([f"--nanogpt={ng}", "--max_iters=12", "--train_args=--eval_whole=False --eval_iters=1 --batch_size=2"])
    shards = os.path.join(ROOT, "data", "shakespeare_byte")
    train = np.concatenate([np.asarray(data.read_shard(f)) for f in data.find_shards(shards, "train")])
    n_val = sum(len(data.read_shard(f)) for f in data.find_shards(shards, "val"))
    n, head, nv, meta, given = eval(open(tmp_path / "seen").read())
    assert (n, head, nv, meta) == (len(train), int(train[:1000].astype(np.int64).sum()), n_val, {"vocab_size": 257})
    assert {"n_layer", "n_head", "n_embd", "block_size", "batch_size", "device", "dtype", "compile"} <= set(given)
    # one micro-batch a step (nanoGPT's default is 40), no dropout, no bias, fp32 on the CPU: our
    # quick start's step
    assert {k: given[k] for k in ("gradient_accumulation_steps", "dropout", "bias", "dtype", "device", "compile")} == \
        dict(gradient_accumulation_steps="1", dropout="0.0", bias="False", dtype="float32", device="cpu", compile="False")
    assert sorted(os.listdir(ng)) == ["configurator.py", "model.py", "train.py"]  # nothing written into it
    out = capsys.readouterr().out
    ours = float(re.search(r"ours +12 steps in .*median +([\d.]+) ms/step", out).group(1))
    assert "nanoGPT  12 steps" in out and "median  221.0 ms/step" in out  # steps 10-12: 200, 221, 244 ms
    assert f"{ours / 221.0:.2f}x median step" in out
    msg = fails(capsys, f"--nanogpt={tmp_path}", main=against_nanogpt.main, code=2)
    assert "--nanogpt=" in msg and "karpathy/nanoGPT" in msg


def test_against_nanogpt_rounds_alternate_the_first_run_and_print_the_ratios_median(tmp_path, monkeypatch, capsys):
    """--rounds=3: three pairs, nanoGPT first in rounds 1 and 3, ours first in round 2; the last line gives
    the median of the rounds' ratios (wall 1.3, 1.5, 1.2 -> 1.30x; median steps 120/100, 160/100, 125/100 ->
    1.25x), not the ratio of medians or of sums; --nanogpt_keep_memory gives glibc's tunables to nanoGPT's
    run only; --rounds=0 is one error line. The runs are stand-ins (timed replaced): what is checked is the
    order and the arithmetic."""
    from lab import against_nanogpt
    from tools.runtime import GLIBC_TUNABLES
    ng = fake_nanogpt(tmp_path / "nanoGPT", "")
    calls, ours_wall, ours_ms = [], iter([130.0, 150.0, 120.0]), iter([120.0, 160.0, 125.0])

    def timed(argv, cwd, pattern, name, env=None):
        calls.append((name, (env or {}).get("GLIBC_TUNABLES")))
        if name == "nanoGPT":
            return 100.0, [500.0] * 10 + [100.0] * 11
        return next(ours_wall), [500.0] * 10 + [next(ours_ms)] * 11
    monkeypatch.setattr(against_nanogpt, "timed", timed)
    assert against_nanogpt.main([f"--nanogpt={ng}", "--rounds=3", "--nanogpt_keep_memory=True"]) == 0
    assert calls == [("nanoGPT", GLIBC_TUNABLES), ("ours", None), ("ours", None), ("nanoGPT", GLIBC_TUNABLES),
                     ("nanoGPT", GLIBC_TUNABLES), ("ours", None)]
    out = capsys.readouterr().out
    assert "round 2 (ours first):" in out and "round 3 (nanoGPT first):" in out
    assert "ours / nanoGPT: the median of 3 rounds' ratios 1.30x wall, 1.25x median step" in out, out
    msg = fails(capsys, f"--nanogpt={ng}", "--rounds=0", main=against_nanogpt.main, code=2)
    assert "--rounds=0" in msg and "at least 1" in msg, msg


def test_against_nanogpt_refuses_too_few_steps_for_its_median(capsys):
    """The median step leaves out the first 10 (warm-up): --max_iters below 11 is one line before anything runs."""
    from lab import against_nanogpt
    msg = fails(capsys, "--max_iters=5", main=against_nanogpt.main, code=2)
    assert "--max_iters=5" in msg and "at least 11" in msg, msg


def fake_nanogpt(root, body):
    """A directory that passes for a nanoGPT checkout, whose train.py is body."""
    root.mkdir()
    (root / "train.py").write_text(body)
    (root / "model.py").write_text("")
    (root / "configurator.py").write_text("")
    return root


@pytest.mark.slow
def test_against_nanogpt_ctrl_c_stops_the_child_in_one_line_with_the_signal_status(tmp_path):
    """Ctrl-C (SIGINT to our process only) while nanoGPT's train.py runs: one error line, exit 130
    (128 + SIGINT), no traceback; the child is stopped and the temporary directory it ran in
    removed."""
    import signal
    import time
    ng = fake_nanogpt(tmp_path / "nanoGPT", "import os, time\nopen(os.environ['SEEN'], 'w').write("
                      "f'{os.getpid()} {os.getcwd()}')\ntime.sleep(120)\n")
    seen = tmp_path / "seen"
    p = subprocess.Popen([sys.executable, "-m", "lab.against_nanogpt", f"--nanogpt={ng}",
                          "--max_iters=12"], cwd=ROOT, env=dict(ENV, SEEN=str(seen)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (seen.exists() and seen.read_text()) and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    pid, cwd = seen.read_text().split()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert p.returncode == 128 + signal.SIGINT and len(lines) == 1, (p.returncode, err)
    assert lines[0].startswith("error: stopped by Ctrl-C while nanoGPT's train.py ran"), err
    deadline = time.time() + 10  # a killed process's /proc entry outlives it until it is reaped (busy cores)
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") and not os.path.exists(cwd)


def test_against_nanogpt_says_in_one_line_when_a_log_is_short_or_train_args_clash(tmp_path, capsys):
    """A nanoGPT whose log holds fewer step times than the median needs is one line naming it (a
    StatisticsError before); --train_args that set what the comparison sets, or do not split, are
    refused."""
    from lab import against_nanogpt
    ng = fake_nanogpt(tmp_path / "nanoGPT",
                      "for i in range(5):\n    print(f'iter {i}: loss 2.0, time 100.00ms')\n")
    msg = fails(capsys, f"--nanogpt={ng}", "--max_iters=12", code=2, main=against_nanogpt.main)
    assert "nanoGPT logged 5 step times" in msg and "at least 11" in msg, msg
    for args, fact in (("--max_iters=5", "--max_iters=5 is set by this comparison"),
                       ('"x', "cannot split")):
        msg = fails(capsys, f"--nanogpt={ng}", f"--train_args={args}", code=2,
                    main=against_nanogpt.main)
        assert fact in msg, msg


def test_bench_ctrl_c_is_one_line_with_the_signal_status(capsys, monkeypatch):
    """Ctrl-C during a benchmark (here --data's, made to raise it): one error line, exit 130."""
    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "bench_data", interrupted)
    assert "stopped by Ctrl-C during --data" in fails(capsys, "--data", code=130, main=bench.main)
