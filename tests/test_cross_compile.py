"""kernels/cross_compile.py: every Triton kernel configuration compiles to a cubin for sm_80 and sm_90 on this
CPU-only machine (no launch), what the compiled code holds is checked (registers, MMA, dp4a, weight loads), and a
kernel that cannot compile for a GPU is caught, which the interpreter running tests/test_kernels.py would not do.
Subprocesses: the interpreter flag that test_kernels.py sets in this process must be unset for compiling."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1",
                                                                         "TRITON_DEFAULT_FP_FUSION": "1"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One run of python -m kernels.cross_compile: (the process, its per-kernel reports)."""
    path = tmp_path_factory.mktemp("cross") / "reports.json"
    p = subprocess.run([sys.executable, "-m", "kernels.cross_compile", f"--json={path}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=900)
    return p, json.loads(path.read_text()) if path.exists() else []


@pytest.mark.slow
def test_cross_compile_every_kernel_configuration_for_sm80_and_sm90(compiled):
    p, reports = compiled
    lines = [line for line in p.stdout.splitlines() if "bytes of cubin" in line]
    assert p.returncode == 0 and "all configurations compiled" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    n = len(reports) // 2  # every job on both targets, each one line
    assert n >= 16 and len(lines) == 2 * n and sum(line.startswith("sm_90 ") for line in lines) == n
    assert {r["target"] for r in reports} == {"sm_80", "sm_90"} and not any("error" in r for r in reports)


@pytest.mark.slow
def test_compiled_kernels_no_spills_integer_mma_only_in_prefill_and_decode_mma_each_weight_byte_loaded_once(compiled):
    """Read from the compiled code (kernels/cross_compile.py says how):
    - no kernel spills registers (no STL/LDL in the SASS, no stack frame);
    - the prefill kernel's and decode-mma's PTX hold integer MMA: mma.sync ... .s32.s8.s8 on sm_80, wgmma ...
      .s32.s8.s8 on sm_90;
    - the dp4a decode kernel holds no MMA at all, and dp4a where DP4A is set (none in its pure-Triton form);
    - weight loads: the global loads whose address register is computed from the weight pointer parameter
      (followed through the PTX's register arithmetic) are 16 bytes wide, and their widths summed over a K step's
      instructions times the threads equal the step's weight tile (BLOCK_N * BLOCK_G words of 4 bytes), times the
      pipeline stages where the loop is software-pipelined (cp.async; its prologue issues num_stages - 1 steps
      ahead): each packed byte is loaded once. (The kernel before plane order fails this: 1-byte loads, 4x the
      tile, each byte loaded once per code.)"""
    _, reports = compiled
    assert reports
    for r in reports:
        where = f"{r['target']} {r['name']}"
        # (the decode tile in the axis order the installed Triton does not want, compiled to show its cost, may spill:
        # with Triton 3.6, 4 bytes at M = 4 on sm_80)
        assert r["spills"] == 0 and r["stack"] == 0 or "other axis order" in r["name"], where
        if r["kind"] in ("prefill", "decode-mma"):
            want = "wgmma.mma_async" if r["target"] == "sm_90" else "mma.sync"
            assert r["mma"] and all(m.startswith(want) and ".s32.s8.s8" in m for m in r["mma"]), where
            assert r["n_mma"] > 0 and r["dp4a"] == 0, where
        elif r["kind"] == "decode":
            assert r["mma"] == [] and r["n_mma"] == 0, where
            assert (r["dp4a"] > 0) == ("pure-Triton" not in r["name"]), where
        if r["kind"] in ("decode", "decode-mma", "prefill", "unpack"):
            assert r["wload_widths"] == [16], where
            stages = r["num_stages"] if r["wload_pipelined"] else 1
            assert r["wload_bytes"] * r["threads"] == r["tile_bytes"] * stages, where
            assert r["wload_pipelined"] == (r["num_stages"] > 1), where  # prefill's K loop, unless one step
    names = {r["name"] for r in reports}
    assert any("pure-Triton" in n for n in names) and sum(r["kind"] == "prefill" for r in reports) >= 8
    assert sum(r["kind"] == "decode-mma" for r in reports) == 2  # M <= 16 on tensor cores, sm_80 and sm_90


@pytest.mark.slow
def test_compiled_k_loops_instructions_per_weight_word_and_bytes_in_flight(compiled):
    """What the K loops hold, read from the SASS (kernels/cross_compile.py: k_loop, the shortest
    backward branch around a global load), and the launches' weight bytes in flight per SM
    (occupancy calculator):
    - decode: no shuffles, no shared memory and no barriers in the K loop (x is loaded in the
      accumulator's own layout, the tile's axes in the order the installed Triton wants; the other
      order has them); M = 1 at most 25 instructions a weight word (16 weights; it was 14-32 with
      shuffles in the short configs); the rows form unpacks each word once for BLOCK_M rows: per row
      and word fewer instructions than M = 1's 14 (2 rows: at most 20 a row);
    - prefill: no one-byte shared-memory stores anywhere (STS.U8; the kernel that unpacked in its K
      loop had 128), at most 48 instructions per 16 weights in its K loop (15-43 now; it was
      75-122), the unpack kernel at most 32 a word (30);
    - the quantisers (rmsnorm+quantise included) round as torch does: IEEE div.rn and sqrt.rn, no
      approximate (r)sqrt, no FMA (the interpreter computes 1 / sqrt exactly whatever the kernel
      asks for: only here does tl.math.rsqrt's rsqrt.approx show), and their absmax keeps a NaN as
      torch's does (max.NaN.f32; the interpreter's NumPy keeps it whatever the kernel asks for);
    - M = 1 on an H100 (sm_90) for lab.bench's six shapes: weight bytes in flight per SM >= the
      smaller of 15.5 KiB (Little's law at the H100's copy bandwidth) and the whole matrix over 132
      SMs."""
    from kernels import cross_compile as cc
    _, reports = compiled
    for r in reports:
        where = f"{r['target']} {r['name']}"
        c = r["loop_counts"]
        if r["kind"] == "decode" and "other axis order" in r["name"]:
            # the tile's axes in the order this Triton does not want: threads over the rows of x, the unpacked
            # weight words through shared memory to them (why tm.DECODE_ROWS_FIRST follows the Triton version)
            assert c["sts"] > 0 and c["lds"] > 0 and c["bar"] > 0, (where, c)
        elif r["kind"] == "decode":
            assert (
                c["shfl"] == c["sts"] == c["lds"] == c["bar"] == 0 and r["loop_instructions"] > 0
            ), (where, c)
            if r["block_m"] == 1 and "pure-Triton" not in r["name"]:
                assert r["instr_per_word"] <= 25, (where, r["instr_per_word"])
            elif r["block_m"] > 1:
                assert r["instr_per_word"] / r["block_m"] <= 20, (where, r["instr_per_word"])
        if r["kind"] == "prefill":
            assert r["sts_u8"] == 0 and c["mma"] > 0 and r["instr_per_word"] <= 48, (
                where,
                r["instr_per_word"],
            )
        if r["kind"] == "unpack":
            assert r["sts_u8"] == 0 and r["instr_per_word"] <= 32, where
        if r["kind"] == "decode-mma":  # 16 rows a weight word, unpacked once in registers as whole words: at most
            # 64 instructions a word (53.5 on sm_90, 59.2 on sm_80; unpacked code by code it was 86-90, and the dp4a
            # rows form takes 175 for 16 rows); no one-byte shared stores
            assert c["mma"] > 0 and r["sts_u8"] == 0 and r["instr_per_word"] <= 64, (where, r["instr_per_word"])
    norms = [r for r in reports if r["name"].startswith("rmsnorm+quantize")]
    assert len(norms) == 8  # 4 shapes (K = 1 among them: a constant on a GPU), 2 targets
    # torch's IEEE roundings, no FMA; the absmax keeps a NaN (max.NaN.f32), as torch's amax, so a NaN row's scale
    # is NaN: the only plain max.f32 (which drops a NaN) is the clamp's, one for each of its min.f32
    for r in norms + [r for r in reports if r["name"].startswith("quantize")]:
        f = r["ptx_fp"]
        assert f["max.NaN.f32"] >= 1 and f["max.f32"] == f["min.f32"], (r["name"], f)
        assert (
            f["div.rn.f32"] >= 1
            and f["fma.rn.f32"] == f["rsqrt.approx.f32"] == f["sqrt.approx.f32"] == 0
        ), r
        # the norm's 1 / sqrt: IEEE sqrt, then IEEE division
        assert f["sqrt.rn.f32"] >= (r in norms), r
    for N, K in cc.SHAPES:
        f = cc.decode_flight(reports, N, K)
        assert f["in_flight"] >= f["need"], (N, K, f)
    big = cc.decode_flight(reports, 4096, 4096)
    assert big["in_flight"] >= 15.5 * 1024 and big["need"] == round(15.5 * 1024)


def test_occupancy_calculator_against_hand_counts():
    """Programs per SM from registers, threads and shared memory, by the CUDA occupancy rules
    (hand-computed)."""
    from kernels.occupancy import in_flight, occupancy
    assert occupancy(32, 128, 0, "sm_90") == 16  # threads: 2048 / 128
    assert occupancy(64, 64, 0, "sm_90") == 16  # registers: 65536 / (64 * 64)
    assert occupancy(100, 64, 0, "sm_90") == 9  # 100 -> 104 a thread: 65536 // (64 * 104) = 9
    # 32 blocks at most
    assert occupancy(255, 32, 0, "sm_80") == 8 and occupancy(16, 32, 0, "sm_90") == 32
    assert (
        occupancy(128, 256, 100 * 1024, "sm_90") == 2
        and occupancy(64, 128, 100 * 1024, "sm_80") == 1
    )
    r = dict(occupancy=9, target="sm_90", num_stages=1)
    # 512 programs over 132 SMs: 4 each, under the 9 that fit
    assert in_flight(r, 512, 8192) == 4 * 8192
    assert (
        in_flight(r, 5000, 8192) == 9 * 8192
        and in_flight(dict(r, num_stages=3), 5000, 100) == 9 * 200
    )


BAD = '''
import triton, triton.language as tl
from kernels import cross_compile as cc

@triton.jit
def bad(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs[:, None] * BLOCK + offs[None, :])  # (8, 8) int8
    tl.store(y_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(x, x, out_dtype=tl.int32))

# an int8 tl.dot with a K of 8: the interpreter multiplies it with NumPy, a GPU needs K >= 16 (32 for int8)
cc.compile_one(bad, dict(x_ptr="*i8", y_ptr="*i32", BLOCK="constexpr"), dict(BLOCK=8), {}, cc.TARGETS["sm_80"])
'''


@pytest.mark.slow
def test_a_kernel_that_cannot_compile_for_a_gpu_fails(tmp_path):
    script = tmp_path / "bad_kernel.py"  # triton.jit reads the kernel's source from its file
    script.write_text(BAD)
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=dict(ENV, PYTHONPATH=ROOT), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode != 0 and "K >= " in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_gpu_check_script_refuses_a_machine_without_cuda_in_one_line():
    import pytest
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run bash lab/gpu_check.sh itself")  # never on the CPU CI
    fake = os.path.join(ROOT, "out", "fake_python_bin")  # a `python` on PATH that is not the test interpreter
    os.makedirs(fake, exist_ok=True)
    with open(os.path.join(fake, "python"), "w") as f:
        f.write("#!/bin/sh\necho wrong interpreter >&2\nexit 9\n")
    os.chmod(os.path.join(fake, "python"), 0o755)
    env = dict(ENV, PATH=fake + os.pathsep + ENV.get("PATH", ""), PYTHON=sys.executable)
    p = subprocess.run(["bash", os.path.join(ROOT, "lab", "gpu_check.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1 and "no CUDA GPU" in p.stderr


def test_gpu_check_fits_one_6_minute_window_with_every_step_under_its_own_time_limit():
    """Every step of lab/gpu_check.sh runs through step(), which wraps it in `timeout` and gives
    it at most what is left of the window (330 s; the summary 20 more, each kill 5): a hang costs
    one step, not the check, and the script ends within 6 minutes. Run with a stand-in python that
    says CUDA is there: in a 22 s window, with a pytest of 3 s, the kernels step runs and the five
    after it are skipped (under 20 s left); in the whole window every step runs, exit 0, the bench
    step may use what the kernels step left of its budget, the results come back in COPY_TO's 8
    files (nothing is written to OUT, a lent machine's return folder), and the summary divides our
    train step's median ms (metrics.jsonl, the steps after the first fifth: 100 ms then 200 ms
    each) by the compiled nanoGPT-shaped step's (bench_train.log)."""
    import json
    import re
    import shutil
    script = open(os.path.join(ROOT, "lab", "gpu_check.sh")).read()
    assert re.search(r'timeout --signal=TERM --kill-after=5 "\$limit" "\$@"', script)
    steps = re.findall(r"^step (\S+) (\d+) ", script, flags=re.M)
    assert [n for n, _ in steps] == ["kernels", "bench", "decode", "decode_1b", "train", "bench_train"], steps
    assert sum(int(t) for _, t in steps) <= 330, steps  # the budgets themselves fit the window
    assert "WINDOW=${WINDOW:-330}" in script and "timeout 20 \"$PYTHON\" - \"$OUT\" <<'PY'" in script
    # every command inside step() or its own timeout, the CUDA probe (`if !`, `... ; then`) included
    runs = [l for l in script.splitlines()
            if re.search(r'"\$PYTHON"|(^|[\s(!])python3? ', l) and not re.match(r"\s*(#|PYTHON=)", l)]
    bare = [l for l in runs if not re.match(r"\s*step \S+ \d+ ", l) and "timeout" not in l]
    assert len(runs) >= 8 and bare == [], (runs, bare)
    fake = os.path.join(ROOT, "out", "fake_cuda_python")
    os.makedirs(fake, exist_ok=True)
    stand_in = os.path.join(fake, "python")
    records = "".join(f'{{"step": {i}, "ms": {100 if i < 2 else 200}, "tok_per_s": 1}}\\n'
                      for i in range(10))
    # "-c" (the CUDA check) passes; pytest sleeps; the summary is the real one; the timed run and
    # the baseline write what train.py and lab.bench --train would
    with open(stand_in, "w") as f:
        f.write(f'#!/bin/sh\ncase "$1 $2" in\n  "-m pytest") sleep $PYTEST_S;;\n'
                f'  "- "*) [ -n "$NO_SUMMARY" ] && exit 1; exec {sys.executable} "$@";;\n'
                f'  "-m lab.bench") case "$*" in *--runs=nanogpt_c*) '
                f'echo "nanoGPT baseline, compiled    124.44M     160.0";; esac;;\n'
                f'  "train.py --stage=2") mkdir -p "$OUT/run/stage2"; printf \'{records}\' > '
                f'"$OUT/run/stage2/metrics.jsonl";;\nesac\nexit 0\n')
    os.chmod(stand_in, 0o755)
    shutil.rmtree(os.path.join(fake, "not_here"), ignore_errors=True)
    for window, sleep, want in (("22", "3", ["0"] + ["skipped"] * 5), ("330", "0", ["0"] * 6)):
        out = os.path.join(fake, f"run{window}")
        shutil.rmtree(out, ignore_errors=True)
        # OUT is what a lent GPU machine's tooling sends back (8 small files): the script must not write there
        env = dict(ENV, PYTHON=stand_in, GPU_CHECK_OUT=out, WINDOW=window, PYTEST_S=sleep,
                   OUT=os.path.join(fake, "not_here"), COPY_TO=os.path.join(out, "back"))
        if window == "22":
            env["NO_SUMMARY"] = "1"  # this run checks the status file: no second torch import
        p = subprocess.run(["bash", os.path.join(ROOT, "lab", "gpu_check.sh")], env=env,
                           capture_output=True, text=True, timeout=120)
        status = [line.split()[:2] for line in open(os.path.join(out, "status"))]
        want = [list(s) for s in zip([n for n, _ in steps], want)]
        assert status == want, (status, p.stdout, p.stderr)
    assert "skipped" not in p.stdout and p.returncode == 0, (p.stdout, p.stderr)
    assert not os.path.exists(os.path.join(fake, "not_here"))
    assert sorted(os.listdir(os.path.join(out, "back"))) == sorted(
        ["summary.json", "train_metrics.jsonl"] + [f"{n}.log" for n, _ in steps]), p.stdout
    # the kernels step took ~0 s of its budget: the bench step may use the rest of it too
    limits = dict(re.findall(r"^== (\S+) \(at most (\d+)s\)", p.stdout, flags=re.M))
    budgets = {n: int(t) for n, t in steps}
    assert budgets["kernels"] + budgets["bench"] - 2 <= int(limits["bench"]) <= budgets["kernels"] + budgets["bench"], limits
    ratio = json.load(open(os.path.join(out, "summary.json")))["train_vs_nanogpt"]
    assert ratio == dict(ours_ms=200, nanogpt_ms=160.0, ratio=1.25, target=1.25), ratio
    assert "200.0 / 160.0 ms = 1.25x (target <= 1.25; ours the median" in p.stdout, p.stdout


def test_gpu_check_spreads_the_kernel_tests_over_its_workers_test_by_test():
    """pytest.ini's addopts hand out tests a file at a time (--dist loadfile): given to gpu_check.sh's
    kernels step as they are, all of test_kernels.py (most of the Triton compiles) would run on one of
    its 12 workers. The step's own pytest options, run from the repository root (so with pytest.ini)
    on one file of 4 tests with 2 workers, must put that file's tests on both workers."""
    import re
    import shlex
    import shutil
    script = open(os.path.join(ROOT, "lab", "gpu_check.sh")).read()
    opts = shlex.split(re.search(r'^step kernels \d+ "\$PYTHON" -m pytest (.*?) tests/', script, flags=re.M)[1])
    opts[opts.index("-n") + 1] = "2"
    where = os.path.join(ROOT, "out", "dist_check")
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(where)
    with open(os.path.join(where, "test_four.py"), "w") as f:
        f.write("import os, time\nimport pytest\n\n@pytest.mark.parametrize('i', range(4))\ndef test_one(i):\n"
                "    time.sleep(0.5)\n"
                "    open(os.path.join(os.path.dirname(__file__), f'ran_{i}'), 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n")
    p = subprocess.run([sys.executable, "-m", "pytest", *opts, os.path.join("out", "dist_check", "test_four.py")],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.count("PASSED ") == 4, p.stdout[-2000:] + p.stderr[-2000:]  # -rA
    workers = {open(os.path.join(where, f"ran_{i}")).read() for i in range(4)}
    shutil.rmtree(where, ignore_errors=True)
    assert len(workers) == 2, workers


def test_cross_compile_help_prints_its_usage_and_an_unknown_flag_is_refused_before_compiling(capsys, monkeypatch):
    """README: every tool takes --help. Here --help ran the whole sm_80/sm_90 compile and printed no usage, and a
    mistyped --json was ignored (no file written, no word said)."""
    from kernels import cross_compile

    def no_compile():
        raise AssertionError("compiled")
    monkeypatch.setattr(cross_compile, "run", no_compile)
    assert cross_compile.main(["--help"]) == 0
    assert "--json=PATH" in capsys.readouterr().out
    assert cross_compile.main(["--jsn=out.json"]) == 2
    assert capsys.readouterr().err.startswith("error: --jsn=out.json: expected --json=PATH")
