"""README's install leaves Triton out where it has no wheels (macOS, Windows). Without it the quick start, sampling
and the GGUF export run, and asking for packed weights says what is missing in one line: checked here, on Linux,
with Triton hidden from imports (no macOS or Windows machine runs this suite).
Run: python -m pytest tests/test_platforms.py"""

import os
import re
import subprocess
import sys

from packaging.requirements import Requirement

from conftest import ENV, ROOT, TINY

# python -c: Triton hidden from imports (a meta-path finder that refuses it, as a machine without it would), then
# each command's main in turn, its exit code and the last line of what it printed after a marker
WITHOUT_TRITON = r"""
import importlib.machinery, io, contextlib, sys, traceback
class NoTriton(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
        return None
sys.meta_path.insert(0, NoTriton)
sys.path.insert(0, ".")
import json, runpy
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__") if argv[0].endswith(".py") else \
                runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        code, _ = "traceback", out.write(traceback.format_exc())
    print("@@", code, json.dumps((out.getvalue().strip().splitlines() or [""])[-1]))
print("@@ triton imported:", "triton" in sys.modules)
"""


def test_triton_is_a_requirement_on_linux_only():
    """Triton publishes Linux wheels only: a requirement on macOS or Windows would stop the whole install there."""
    line = next(l for l in open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8")
                if l.startswith("triton"))
    triton = Requirement(line.strip())
    assert triton.marker is not None
    assert triton.marker.evaluate({"sys_platform": "linux"})
    assert not triton.marker.evaluate({"sys_platform": "darwin"}) and not triton.marker.evaluate({"sys_platform": "win32"})


def test_without_triton_train_sample_and_gguf_run_and_packed_weights_say_what_is_missing(tmp_path):
    import json
    out = str(tmp_path / "run")
    ckpt = os.path.join(out, "stage2", "ckpt.pt")
    commands = [
        ["train.py", *TINY, "--max_iters=4", "--eval_interval=4", f"--out_dir={out}"],
        ["sample.py", f"--ckpt={ckpt}", "--max_new_tokens=4", "--num_samples=1", "--device=cpu"],
        ["tools.export", f"--ckpt={ckpt}", "--format=gguf"],
        ["sample.py", f"--ckpt={ckpt}", "--packed=True", "--max_new_tokens=4", "--device=cpu"],
        ["tools.export", f"--ckpt={ckpt}"],
    ]
    p = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, json.dumps(commands)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    results = [line.split(" ", 2)[1:] for line in p.stdout.splitlines() if line.startswith("@@ ")]
    assert len(results) == len(commands) + 1, p.stdout[-3000:] + p.stderr[-3000:]
    (train, sample, gguf, packed_sample, packed_export), imported = results[:-1], results[-1]
    assert train[0] == "0" and "final val loss" in json.loads(train[1]), train
    assert sample[0] == "0", sample
    assert gguf[0] == "0" and os.path.exists(os.path.join(out, "stage2", "model.gguf")), gguf
    for code, last in (packed_sample, packed_export):
        assert code == "1", (code, last)
        assert re.match(r'"error: .*packed 2-bit weights need Triton', last), last
    assert not os.path.exists(os.path.join(out, "stage2", "packed.pt"))
    assert imported == ["triton", "imported: False"]
