"""tools/runtime.py in this process, no GPU and no torchrun: what a rank reads from torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE), which GPU it drives, and that only rank 0 opens a Weights & Biases run (a fake `wandb`
module stands in for the real one). The real multi-process runs are tests/test_scale.py's.
Run: python -m pytest tests/test_runtime.py"""

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, TINY, fails
from tools.runtime import GLIBC_TUNABLES, Runtime


def torchrun_env(monkeypatch, rank, local_rank, world):
    for k, v in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world)):
        monkeypatch.setenv(k, str(v))


def test_a_rank_on_the_second_node_drives_its_local_gpu(monkeypatch):
    """Two nodes of 8 GPUs: RANK=9 is LOCAL_RANK=1 of node 1, so it drives cuda:1 (there is no cuda:9 on a node of
    8), sets that device before joining NCCL, and DDP places its replica there. torch.cuda and the process group
    are stubbed: what the calls were given is what is checked."""
    torchrun_env(monkeypatch, rank=9, local_rank=1, world=16)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))

    class FakeDDP(torch.nn.Module):
        def __init__(self, module, device_ids=None, **kw):
            super().__init__()
            calls.append(("ddp", device_ids))
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", FakeDDP)

    rt = Runtime.from_env("cuda")
    assert (rt.rank, rt.local_rank, rt.world, rt.device, rt.master) == (9, 1, 16, "cuda:1", False)
    rt.start()
    rt.wrap(torch.nn.Linear(2, 2), fsdp=False, compile=False)
    assert calls == [("set_device", "cuda:1"), ("init", "nccl"), ("ddp", [1])]

    torchrun_env(monkeypatch, rank=8, local_rank=0, world=16)  # node 1's first process: cuda:0, and not rank 0
    rt = Runtime.from_env("cuda")
    assert (rt.device, rt.master) == ("cuda:0", False)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # plain `python train.py`: rank 0 of 1, the device as given
        monkeypatch.delenv(k)
    rt = Runtime.from_env("cuda")
    assert (rt.rank, rt.local_rank, rt.world, rt.device, rt.master) == (0, 0, 1, "cuda", True)


def fake_wandb(monkeypatch, init):
    """A `wandb` module in sys.modules (with a spec, so importlib.util.find_spec finds it) whose init is `init`,
    and wandb.errors as the real one arranges it: Error, UsageError(Error), CommError(Error),
    AuthenticationError(CommError)."""
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    errors = types.ModuleType("wandb.errors")
    errors.Error = type("Error", (Exception,), {})
    errors.UsageError = type("UsageError", (errors.Error,), {})
    errors.CommError = type("CommError", (errors.Error,), {})
    errors.AuthenticationError = type("AuthenticationError", (errors.CommError,), {})
    fake.errors, fake.init = errors, init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setitem(sys.modules, "wandb.errors", errors)
    return fake


def test_only_rank_0_opens_a_wandb_run_and_logs_to_it(monkeypatch, tmp_path):
    """Under torchrun every rank calls start_wandb: exactly one run is opened, by RANK 0, whatever LOCAL_RANK
    says (node 1's LOCAL_RANK=0 is rank 8), and only it logs records there and in metrics.jsonl."""
    opened, logged = [], []

    def init(project, name, config):
        opened.append(project)
        return types.SimpleNamespace(log=lambda rec, step: logged.append((step, rec)), finish=lambda: None)
    fake_wandb(monkeypatch, init)
    for rank, local_rank in ((1, 1), (8, 0), (15, 7), (0, 0)):
        torchrun_env(monkeypatch, rank, local_rank, world=16)
        rt = Runtime.from_env("cpu")
        rt.start_wandb("demo", "stage2", {"lr": 1.0})
        (tmp_path / str(rank)).mkdir()
        rt.log_json(str(tmp_path / str(rank)), {"step": 1, "loss": 2.0})
        assert (rt.wandb is not None) == (rank == 0), (rank, local_rank)
        assert (tmp_path / str(rank) / "metrics.jsonl").exists() == (rank == 0), rank
    assert opened == ["demo"] and logged == [(1, {"loss": 2.0})]


# what wandb.init raises without a login (no API key in the environment or ~/.netrc, and no terminal to ask on),
# as wandb/sdk/wandb_login.py words it; and a bad or revoked key
NOT_LOGGED_IN = ("UsageError", "api_key not configured (no-tty). call wandb.login(key=[your_api_key])")
BAD_KEY = ("AuthenticationError", "API key must be 40 characters long, yours was 3")


@pytest.mark.parametrize("kind, text", [NOT_LOGGED_IN, BAD_KEY, ("CommError", "Network error (ConnectTimeout)")])
def test_wandb_not_logged_in_is_one_line_saying_how_to_log_in(monkeypatch, capsys, kind, text):
    """--wandb_project with wandb installed but not usable: one error line naming the flag, wandb's reason, and
    the ways out (wandb login, WANDB_API_KEY, or dropping the flag), not wandb's traceback."""
    def init(project, name, config):
        raise getattr(sys.modules["wandb"].errors, kind)(text)
    fake_wandb(monkeypatch, init)
    msg = fails(capsys, code=1, main=lambda argv: Runtime().start_wandb("x", "stage2", {}))
    assert msg.startswith("error: --wandb_project=x: ") and f"{kind}: {text}" in msg, msg
    assert all(f in msg for f in ("wandb login", "WANDB_API_KEY", "drop --wandb_project")), msg


def test_train_py_with_wandb_not_logged_in_stops_in_one_line(monkeypatch, capsys, tmp_path):
    """The same through train.main, as a user runs it: the refusal is not caught and re-raised on the way."""
    def init(project, name, config):
        raise sys.modules["wandb"].errors.UsageError(NOT_LOGGED_IN[1])
    fake_wandb(monkeypatch, init)
    msg = fails(capsys, "--stage=2", "--init_from=scratch", *TINY, "--max_iters=1", f"--out_dir={tmp_path}",
                "--wandb_project=x")
    assert "--wandb_project=x" in msg and "wandb login" in msg, msg



def test_close_waits_for_every_rank_before_tearing_the_process_group_down(monkeypatch):
    """Rank 1 of 2 reaches close() while rank 0 still writes its checkpoint; tearing gloo down then raced rank
    0's exit (a rank ended in SIGABRT after a finished run). close() passes a barrier first. The process group
    is stubbed: the order of the calls is what is checked."""
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    Runtime(rank=1, local_rank=1, world=2).close()
    assert calls == ["barrier", "destroy"]
    Runtime().close()  # one process: nothing to wait for or tear down
    assert calls == ["barrier", "destroy"]


LEAVE_SCRIPT = """
import atexit, sys
from tools.runtime import leave_after_torchrun
atexit.register(lambda: print("teardown ran"))
print("finished", end="")  # no newline: still in the buffer of a pipe
leave_after_torchrun()
print(" and went on")
"""


@pytest.mark.parametrize("world", [None, "1", "2"])
def test_leave_after_torchrun_ends_a_torchrun_process_at_once_its_output_flushed(world):
    """Under torchrun (WORLD_SIZE 2) the process ends with status 0 right there: what it printed is out, Python's
    teardown (an atexit handler here) never runs. A single process (no WORLD_SIZE, or 1) goes on as usual."""
    import os
    import subprocess
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "PYTHONUNBUFFERED")}  # stdout buffered
    env |= {"WORLD_SIZE": world} if world else {}
    p = subprocess.run([sys.executable, "-c", LEAVE_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    if world == "2":
        assert p.stdout == "finished", p.stdout
    else:
        assert p.stdout == "finished and went on\nteardown ran\n", p.stdout


FAULTS_SCRIPT = """
import resource, sys, torch
from tools.runtime import Runtime, keep_freed_memory
def round_():  # twelve 8 MB tensors written, then freed: a step's temporaries
    ts = [torch.empty(2 << 20).fill_(1.0) for _ in range(12)]
    del ts
def faults():  # minor page faults per round, after 3 rounds to settle
    for _ in range(3):
        round_()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        round_()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10
before = faults()  # glibc's default
took = (keep_freed_memory() if sys.argv[1] == "keep" else Runtime.from_env("cpu").start()
        if sys.argv[1] == "runtime" else None)
print(before, took, faults())
"""


def test_a_cpu_run_keeps_freed_memory_for_its_next_step():
    """By default glibc gives memory a round of twelve 8 MB tensors frees back to the kernel when it lies
    at the top of the heap, past the trim threshold (twice its moving mmap threshold, at most 64 MB),
    and the next round's writes fault in fresh zeroed pages, ~24,000. keep_freed_memory, and a CPU
    Runtime's start, which calls it, leave those pages with the process: the next round reuses them.
    Measured in one process before and after (the setting is process-wide). Whether glibc's default
    gives the pages back depends on where the rounds land in the heap, which varies with the hash seed
    (it did with 1 and 2, not with 0 and 3): the first of a few seeds where the default faults is used,
    so the test fails if no seed faults (nothing left to show) as well as if the setting does not work.
    The same setting given to another program through its environment (GLIBC_TUNABLES, as
    lab/against_nanogpt.py gives it to real nanoGPT) holds from its start."""
    import os
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(mode, seed, **env):
        p = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, mode], cwd=root, capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, PYTHONHASHSEED=str(seed), **env))
        assert p.returncode == 0, p.stderr
        before, took, after = p.stdout.split()
        return float(before), took, float(after)

    def measured(mode):
        for seed in range(1, 7):
            before, took, after = run(mode, seed)
            if before > 12000:  # at least 48 MB of 4 KiB pages faulted back in every round
                return seed, before, took, after
        raise AssertionError(f"{mode}: glibc's default faulted in no round with hash seeds 1-6")

    seed, before, took, after = measured("keep")
    assert took == "True" and after < before / 20, (before, took, after)
    assert run("env", seed, GLIBC_TUNABLES=GLIBC_TUNABLES)[0] < before / 20
    _, before, took, after = measured("runtime")
    assert after < before / 20, (before, took, after)


def test_a_rank_lost_before_the_first_checkpoint_says_to_start_again_with_overwrite(tmp_path, capsys):
    """The run's directory then holds a run that ended before its first checkpoint (its metrics.jsonl), which the
    same command refuses without --overwrite=True: the lost-rank line says so. (Before: "start again", which the
    same command then refused.)"""
    from types import SimpleNamespace
    from tools import runtime
    run = SimpleNamespace(ckpt_path=str(tmp_path / "ckpt.pt"), rt=SimpleNamespace(world=2))
    with pytest.raises(SystemExit):
        runtime.lost_rank(run, RuntimeError("[gloo] Connection closed by peer"))
    err = capsys.readouterr().err
    assert "no checkpoint was written yet" in err and "the same torchrun command with --overwrite=True" in err, err


def test_git_commit_marks_a_checkout_whose_tracked_files_differ_from_its_commit(tmp_path):
    """runtime.git_commit (metrics.jsonl's and the lab's commit): HEAD in a clean checkout, HEAD-dirty once a
    tracked file is changed (the code that ran is not the commit's), clean again when it is committed; a file
    git does not track changes nothing."""
    import subprocess
    from tools import runtime

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert runtime.git_commit(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert runtime.git_commit(str(tmp_path)) == head + "-dirty"
    git("commit", "-qam", "two")
    assert runtime.git_commit(str(tmp_path)) == git("rev-parse", "HEAD")
