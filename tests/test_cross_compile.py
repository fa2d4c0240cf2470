"""kernels/cross_compile.py: every Triton kernel configuration compiles to a cubin for sm_80 and sm_90 on this
CPU-only machine (no launch), and a kernel that cannot compile for a GPU is caught, which the interpreter
running tests/test_kernels.py would not do. Subprocesses: the interpreter flag that test_kernels.py sets in
this process must be unset for compiling."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1",
                                                                         "TRITON_DEFAULT_FP_FUSION": "1"}


@pytest.mark.slow
def test_cross_compile_every_kernel_configuration_for_sm80_and_sm90():
    p = subprocess.run([sys.executable, "-m", "kernels.cross_compile"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=900)
    lines = [line for line in p.stdout.splitlines() if "bytes of cubin" in line]
    assert p.returncode == 0 and "all configurations compiled" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert len(lines) == 2 * 19 and sum(line.startswith("sm_90 ") for line in lines) == 19


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


def test_gpu_check_fits_one_8_minute_window_with_every_step_under_its_own_time_limit():
    """Every step of lab/gpu_check.sh runs through step(), which wraps it in `timeout`, and the limits add up to
    under 8 minutes (a lent GPU gives 15 minutes in all, its start included): a hang costs one step, not the check."""
    import re
    script = open(os.path.join(ROOT, "lab", "gpu_check.sh")).read()
    assert re.search(r'timeout --signal=TERM --kill-after=5 "\$limit" "\$@"', script)
    steps = re.findall(r"^step (\S+) (\d+) ", script, flags=re.M)
    assert len(steps) >= 5 and {"bench", "bench_train", "train"} <= {n for n, _ in steps}, steps
    assert sum(int(s) for _, s in steps) + 5 * len(steps) + 30 <= 480, steps  # + each kill-after + the summary
    bare = [l for l in script.splitlines() if re.match(r'\s*("\$PYTHON"|python) ', l)]
    assert bare == [] and "timeout 30 \"$PYTHON\" - \"$OUT\" <<'PY'" in script, bare  # the summary has its limit too
