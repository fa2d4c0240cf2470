"""Fault tolerance of train.py and tools/checkpoint.py: exact resume after SIGKILL, preemption by SIGTERM/SIGINT,
atomic checkpoints (a kill in the middle of a write), non-finite steps, and one clear error line for each kind
of bad input, with nothing already saved lost.

Faults are injected from outside by tests/faults.py (a wrapper around train.main; see conftest.start(faults=)):
hang after a checkpoint, slow checkpoint writes, NaN losses. Bad-input cases that tests/test_train.py or
tests/test_data.py already cover are not repeated: unknown flag, wrong type, bad --stage, --resume without a
checkpoint, stage 3 without its teacher.
"""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from tools import atomic, checkpoint
import data
import train
from conftest import TINY, fails, records, run, start


def wait_for(cond, what, timeout=120):
    t = time.time()
    while not cond():
        assert time.time() - t < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)


def step_losses(out):
    """{step: loss} as logged; the last record of a step wins (a resumed run logs the steps after its checkpoint
    again, the killed run may have logged some of them already)."""
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def same(a, b):
    """Nested equality, tensors bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()

# -----------------------------------------------------------------------------
# exact resume, preemption, atomic writes, non-finite steps


SCHEDULE_FINDINGS = ["--data_order=curriculum", "--quant_start=12", "--schedule=constant", "--avg_checkpoints=3",
                     "--avg_interval=6"]  # the issue-12 options: the curriculum loader, continual QAT, averaging
MUON_FAMILY = ["--normuon=True", "--muon_state=dynamic8", "--qk_clip_tau=0.02"]  # NorMuon, 8-bit state, QK-clip


@pytest.mark.parametrize("extra", [[], SCHEDULE_FINDINGS, MUON_FAMILY],
                         ids=["default", "curriculum+quant_start+averaging", "normuon+8bit+qk_clip"])
@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, extra):
    """32 steps straight, against 16 steps + SIGKILL + resume to 32. Stage 2 with Muon, ZClip (its 25-step
    warmup ends after the resume point) and 2 micro-batches per step; the LR schedule (max_iters=32) and lambda
    depend on the step, so both runs use the same max_iters. Also with the curriculum order, a switch to
    ternary at step 12 and checkpoint averaging (snapshots at 20, 26, 32: the average straddles the resume), and
    with NorMuon, 8-bit momentum and QK-clip (their state and the clipped weights must carry over too)."""
    args = ["--stage=2", *TINY, "--grad_accum=2", "--max_iters=32", "--eval_interval=32", "--checkpoint_interval=16",
            *extra]
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    run(f"--out_dir={straight}", *args)
    log = str(tmp_path / "killed.log")
    p = start(f"--out_dir={killed}", *args, log=log, faults="hang_at=16")
    wait_for(lambda: "hanging until killed" in open(log).read() or p.poll() is not None, "the step-16 checkpoint")
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    assert torch.load(os.path.join(killed, "stage2", "ckpt.pt"), weights_only=True)["step"] == 16
    stdout = run(f"--out_dir={killed}", "--stage=2", "--resume=True").stdout  # the saved config, no fault
    assert "at step 16" in stdout
    a, b = step_losses(straight), step_losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, 33))
    assert [a[s] for s in a] == [b[s] for s in a]  # bit for bit: floats round-trip exactly through JSON
    val = [[r["val_loss"] for r in records(d) if "val_loss" in r] for d in (straight, killed)]
    assert val[0] == val[1] and len(val[0]) == 1
    assert a[32] < a[1] - 0.3
    # and the whole final state: ZClip statistics (they only change a loss once a step is clipped), optimizer
    # moments, weights, loader position and RNGs
    ends = [torch.load(os.path.join(d, "stage2", "ckpt.pt"), weights_only=True) for d in (straight, killed)]
    averaged = extra is SCHEDULE_FINDINGS
    for key in ("model", "optimizer", "zclip", "loader", "rng", "step") + (("average",) if averaged else ()):
        assert same(ends[0][key], ends[1][key]), key
    if averaged:
        assert ends[0]["loader"]["order"] == "curriculum" and ends[0]["average"]["count"] == 3
    if extra is MUON_FAMILY:  # the 8-bit codes and NorMuon's row moments are in the checkpoint, and were used
        state = ends[0]["optimizer"]["state"][0]  # the first hidden matrix
        assert state["momentum_codes"].dtype == torch.uint8 and state["v"].shape[1] == 1
        assert max(r["max_logit"] for r in records(straight) if "max_logit" in r) > 0.02  # QK-clip had work
    assert ends[0]["zclip"]["n_seen"] == 25  # ZClip left its warmup after the resume point


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_preemption_signal_finishes_the_step_saves_and_exits_0(tmp_path, sig):
    out = str(tmp_path)
    p = start(f"--out_dir={out}", "--stage=1", *TINY, "--max_iters=100000", "--eval_interval=100000")
    metrics = os.path.join(out, "stage1", "metrics.jsonl")
    wait_for(lambda: os.path.exists(metrics) and len(open(metrics).readlines()) >= 3, "3 logged steps")
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    last = json.loads(open(metrics).readlines()[-1])["step"]
    ck = torch.load(os.path.join(out, "stage1", "ckpt.pt"), weights_only=True)
    assert ck["step"] == last >= 3  # the step in progress was finished, logged and saved; nothing after it
    assert f"{sig.name}: finished step {last}, saved" in stdout and "--resume=True" in stdout
    assert "val loss" not in stdout  # it stopped promptly, without the end-of-run evaluation


@pytest.mark.slow
def test_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint(tmp_path):
    out, d = str(tmp_path), tmp_path / "stage1"
    run(f"--out_dir={out}", "--stage=1", *TINY, "--max_iters=2", "--eval_interval=2")
    before = digest(d / "ckpt.pt")
    p = start(f"--out_dir={out}", "--stage=1", "--resume=True", "--max_iters=4", faults="slow_write=0.3")
    def tmp():  # the writer's own ckpt_000004.pt.<host>_<pid>_<random>.tmp
        found = list(d.glob("ckpt_000004.pt.*.tmp"))
        return found[0] if found else d / "ckpt_000004.pt.tmp"
    wait_for(lambda: (tmp().exists() and tmp().stat().st_size > 0) or p.poll() is not None, "a half-written checkpoint")
    tmp = tmp()
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or truncated"):
        checkpoint.load(str(tmp))  # the kill did land in the middle of the write
    assert digest(d / "ckpt.pt") == before and checkpoint.load(str(d / "ckpt.pt"))["step"] == 2
    assert not (d / "ckpt_000004.pt").exists()
    stdout = run(f"--out_dir={out}", "--stage=1", "--resume=True", "--max_iters=4").stdout
    assert "at step 2" in stdout and checkpoint.load(str(d / "ckpt.pt"))["step"] == 4
    assert not tmp.exists()  # the next save removed the leftover


@pytest.mark.slow
def test_non_finite_steps_are_skipped_counted_and_stop_the_run_after_max_bad_steps(tmp_path):
    out, d = str(tmp_path), tmp_path / "stage2"
    stderr = run(f"--out_dir={out}", "--stage=2", *TINY, "--optimizer=adamw", "--max_iters=8",
                 "--checkpoint_interval=2", "--keep_last=3", "--max_bad_steps=2", rc=1, faults="nan_steps=3,5,6").stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "non-finite" in err[0], stderr
    assert "step 6" in err[0] and "--resume=True" in err[0]  # where it stopped, and how to go on
    recs = {r["step"]: r for r in records(out) if "loss" in r}
    assert sorted(recs) == [1, 2, 3, 4, 5, 6]
    assert [s for s, r in recs.items() if r.get("skipped")] == [3, 5, 6]
    assert recs[4]["loss"] < 10 and recs[6]["bad_steps"] == 3
    cks = {s: checkpoint.load(str(d / f"ckpt_{s:06d}.pt")) for s in (2, 4, 6)}
    assert checkpoint.load(str(d / "ckpt.pt"))["step"] == 6  # saved before stopping
    adam_steps = {s: float(ck["optimizer"]["state"][0]["step"]) for s, ck in cks.items()}
    assert adam_steps == {2: 2.0, 4: 3.0, 6: 3.0}  # steps 3, 5 and 6 did not update
    assert all(torch.equal(v, cks[6]["model"][k]) for k, v in cks[4]["model"].items())
    assert not all(torch.equal(v, cks[4]["model"][k]) for k, v in cks[2]["model"].items())
    assert all(torch.isfinite(v).all() for v in cks[6]["model"].values())

# -----------------------------------------------------------------------------
# tools/checkpoint.py on its own


def test_save_rotates_keep_last_and_ckpt_pt_names_the_newest(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint.save({"step": step, "model": {"w": torch.full((3,), float(step))}, "model_args": {}},
                        str(tmp_path), keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt_000030.pt", "ckpt_000040.pt"]
    assert checkpoint.load(str(tmp_path / "ckpt.pt"))["model"]["w"][0] == 40.0
    assert os.path.samefile(tmp_path / "ckpt.pt", tmp_path / "ckpt_000040.pt")  # a link, not a second copy


def test_rng_state_round_trips_python_numpy_and_torch(tmp_path):
    import random
    checkpoint.save({"step": 1, "model": {}, "model_args": {}, "rng": checkpoint.rng_state()}, str(tmp_path))
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(checkpoint.load(str(tmp_path / "ckpt.pt"))["rng"])  # weights_only load works
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_stop_signal_sets_a_flag_and_restores_the_previous_handler():
    before = signal.getsignal(signal.SIGTERM)
    with atomic.StopSignal() as stop:
        assert stop.requested is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.requested == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before

# -----------------------------------------------------------------------------
# bad input: one line "error: ...", a non-zero exit, nothing saved changed. train.main runs in this process:
# an uncaught exception (a traceback in a real run) fails the test as surely as a wrong message does.


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 1-step stage-1 checkpoint of the tiny model (byte tokenizer)."""
    out = str(tmp_path_factory.mktemp("saved"))
    run(f"--out_dir={out}", "--stage=1", *TINY, "--max_iters=1", "--eval_interval=1")
    return os.path.join(out, "stage1", "ckpt.pt")


def copy_run(saved, tmp_path):
    """A run directory holding a copy of the saved checkpoint as its ckpt.pt; returns (out_dir, ckpt path)."""
    (tmp_path / "stage1").mkdir()
    shutil.copy(saved, tmp_path / "stage1" / "ckpt.pt")
    return str(tmp_path), str(tmp_path / "stage1" / "ckpt.pt")


def test_a_resume_whose_ckpt_pt_link_was_deleted_continues_from_the_newest_checkpoint(saved, tmp_path, capsys):
    """ckpt.pt deleted (a link to the newest ckpt_<step>.pt): --resume=True said there was no checkpoint and, without
    it, that the directory holds a run to continue with --resume=True. It resumes from the newest numbered one, says
    so, and the next save links ckpt.pt again."""
    out, ck = copy_run(saved, tmp_path)
    step = checkpoint.load(ck)["step"]
    os.replace(ck, os.path.join(out, "stage1", f"ckpt_{step:06d}.pt"))
    train.main(["--stage=1", "--resume=True", f"--max_iters={step + 1}", f"--out_dir={out}"])
    printed = capsys.readouterr().out
    assert f"{ck} is missing; resuming from the newest checkpoint" in printed and f"ckpt_{step:06d}.pt" in printed
    assert checkpoint.load(ck)["step"] == step + 1


@pytest.mark.parametrize("how", [["--resume=True"], ["--overwrite=True", *TINY]])
def test_a_directory_where_the_run_keeps_metrics_jsonl_is_one_line(saved, tmp_path, capsys, how):
    """metrics.jsonl made a directory: an IsADirectoryError traceback after a step (resume) or from the removal of
    the earlier run (--overwrite=True): one line naming it, the checkpoint kept."""
    out, ck = copy_run(saved, tmp_path)
    os.mkdir(os.path.join(out, "stage1", "metrics.jsonl"))
    before = digest(ck)
    msg = fails(capsys, "--stage=1", *how, f"--out_dir={out}")
    assert os.path.join(out, "stage1", "metrics.jsonl") in msg and "is a directory" in msg, msg
    assert digest(ck) == before


def test_a_refused_resume_prints_its_error_line_without_the_resume_notes_before_it(saved, tmp_path, capsys):
    """A resume whose run directory is refused (metrics.jsonl a directory) printed the note on what it changes
    ("resuming with --beta2=...") before its error line: the notes come after the run's refusals; a resume that
    goes on still prints them."""
    out, ck = copy_run(saved, tmp_path)
    os.mkdir(os.path.join(out, "stage1", "metrics.jsonl"))
    with pytest.raises(SystemExit):
        train.main(["--stage=1", "--resume=True", "--beta2=0.9", f"--out_dir={out}"])
    printed = capsys.readouterr()
    assert "is a directory" in printed.err and "--beta2" not in printed.out, printed.out
    os.rmdir(os.path.join(out, "stage1", "metrics.jsonl"))
    step = checkpoint.load(ck)["step"]
    train.main(["--stage=1", "--resume=True", "--beta2=0.9", f"--max_iters={step + 1}", f"--out_dir={out}"])
    assert "--beta2=0.9" in capsys.readouterr().out


def test_a_resume_takes_the_optimizer_and_clipper_settings_it_is_given_with_the_saved_state():
    """--beta1, --beta2, --muon_adjust_lr and --zclip_z_thresh given on resume were logged as taking effect, but
    torch's load_state_dict put back the saved groups' betas and lr adjustment, and ZClip's its saved threshold: the
    run went on unchanged. restore keeps the state (moments, momentum, ZClip's statistics) and takes the settings of
    the optimizer and clipper built for this run."""
    import muon
    from zclip import ZClip
    torch.manual_seed(0)
    w, v = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))

    def built(betas, adjust, z):
        opt = muon.Muon([dict(params=[w], kind="muon", adjust_lr_fn=adjust),
                         dict(params=[v], kind="adamw", lr=3e-4, betas=betas)], lr=0.02)
        for g in opt.param_groups:
            g["initial_lr"], g["initial_wd"] = g["lr"], g["weight_decay"]
        return opt, ZClip(z_thresh=z)
    opt, clip = built((0.9, 0.95), "match_rms_adamw", 2.5)
    for _ in range(3):
        (w.sum() ** 2 + v.sum() ** 2).backward()
        clip.clip([w, v])
        opt.step()
        opt.zero_grad()
    saved = {"optimizer": opt.state_dict(), "zclip": clip.state_dict()}
    opt2, clip2 = built((0.5, 0.6), "original", 0.1)
    checkpoint.restore(saved, opt2, clip2)
    groups = {g["kind"]: g for g in opt2.param_groups}
    assert groups["adamw"]["betas"] == (0.5, 0.6) and groups["muon"]["adjust_lr_fn"] == "original"
    assert clip2.z_thresh == 0.1 and clip2.n_seen == clip.n_seen
    assert all(torch.equal(a, b) for k in opt.state[v] for a, b in [(opt.state[v][k], opt2.state[v][k])])
    assert torch.equal(opt.state[w]["momentum_buffer"], opt2.state[w]["momentum_buffer"])


# another tokenizer is refused by its vocabulary (tokenizer.fingerprint, exit 2) before the shapes are compared
@pytest.mark.parametrize("flag,facts,code", [("--n_embd=64", ("n_embd=32", "n_embd=64"), 1),
                                             ("--tokenizer=gpt2", ("--tokenizer=gpt2", "(byte, fingerprint"), 2)])
@pytest.mark.slow
def test_resume_from_a_checkpoint_of_another_shape_or_vocabulary(saved, tmp_path, capsys, flag, facts, code):
    out, ck = copy_run(saved, tmp_path)
    before = digest(ck)
    msg = fails(capsys, "--stage=1", "--resume=True", f"--out_dir={out}", flag, code=code)
    assert ck in msg and all(f in msg for f in facts) and "--tokenizer" in msg  # the file, saved vs asked, the fix
    assert digest(ck) == before and os.listdir(os.path.dirname(ck)) == ["ckpt.pt"]


@pytest.mark.parametrize("flags,facts", [
    (["--seed=7"], ("--seed=7", "--seed=1337", "--run_name")),
    (["--muon_state=linear8"], ("--muon_state=linear8", "fp32")),
    (["--avg_checkpoints=2"], ("--avg_checkpoints=2", "=0")),
    (["--dlm_shift=False"], ("--dlm_shift=False", "True")),
    (["--dlm_mask_init=random"], ("--dlm_mask_init=random", "mean")),
    (["--block_size=16"], ("--block_size=16", "--block_size=32")),  # the loader's position counts its windows
    (["--batch_size=8"], ("--batch_size=8", "--batch_size=4")),
    (["--doc_mask=True"], ("--doc_mask=True", "False")),
    (["--init_from=scratch"], ("--init_from=scratch", "auto")),  # a resume starts from its checkpoint
    (["--subln_gain=calibrated"], ("--subln_gain=calibrated", "unit")),
    (["--overwrite=True"], ("--overwrite=True", "--resume=True", "one of them")),
    (["--stage=2", "--run_name=stage1"], ("stage 1", "--stage=2", "--stage=1")),  # a stage-1 run continued as 2
    (["--max_iters=0"], ("--max_iters=0", "below the step", "--max_iters=1")),  # would train nothing, save over it
])
def test_resume_refuses_what_it_cannot_honour_and_keeps_the_checkpoint(saved, tmp_path, capsys, flags, facts):
    out, ck = copy_run(saved, tmp_path)
    before = digest(ck)
    stage = [] if any(f.startswith("--stage=") for f in flags) else ["--stage=1"]
    msg = fails(capsys, *stage, "--resume=True", f"--out_dir={out}", *flags, code=2)
    assert all(f in msg for f in facts), msg
    assert digest(ck) == before and os.listdir(os.path.dirname(ck)) == ["ckpt.pt"]


@pytest.mark.parametrize("case", ["stage3_fp_student", "dlm_from_fp", "data_twice", "quant_start_past_the_end"])
def test_runs_that_would_silently_be_something_else_are_refused(saved, tmp_path, capsys, case):
    argv, facts = {
        "stage3_fp_student": (["--stage=3", f"--init_from={saved}", f"--teacher={saved}"], ["full-precision", "--stage=2"]),
        "dlm_from_fp": (["--stage=dlm", f"--init_from={saved}"], ["full-precision", "--stage=2"]),
        "data_twice": (["--data=shakespeare,shakespeare"], ["shakespeare is named twice"]),
        "quant_start_past_the_end": (["--quant_start=8", "--max_iters=8"], ["--quant_start=8", "never go ternary"]),
    }[case]
    before = digest(saved)
    msg = fails(capsys, *argv, *TINY, f"--out_dir={tmp_path}", code=2)
    assert all(f in msg for f in facts), msg
    assert digest(saved) == before and not [f for _, _, files in os.walk(tmp_path) for f in files]  # nothing written


def test_a_diffusion_checkpoint_as_teacher_is_named_as_such(saved, tmp_path, capsys):
    ckpt = torch.load(saved, weights_only=False)
    ckpt["model_args"] = dict(ckpt["model_args"], causal=False, vocab_size=ckpt["model_args"]["vocab_size"] + 1)
    teacher = str(tmp_path / "dlm_ckpt.pt")
    torch.save(ckpt, teacher)
    msg = fails(capsys, "--stage=3", "--init_from=scratch", f"--teacher={teacher}", *TINY,
                f"--out_dir={tmp_path / 'o'}", code=2)
    assert teacher in msg and "masked-diffusion" in msg and "--tokenizer" not in msg, msg


def test_a_full_disk_while_writing_the_average_says_the_checkpoint_was_saved(tmp_path, capsys, monkeypatch):
    real = checkpoint.atomic_save

    def full_disk_for_the_average(obj, path):
        if path.endswith(checkpoint.AVERAGED):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path)
    monkeypatch.setattr(checkpoint, "atomic_save", full_disk_for_the_average)
    msg = fails(capsys, "--stage=2", "--init_from=scratch", *TINY, "--max_iters=4", "--eval_interval=4",
                "--avg_checkpoints=2", "--avg_interval=1", f"--out_dir={tmp_path}")
    assert "avg.pt" in msg and "checkpoint of step 4 was saved" in msg and "No space left" in msg, msg
    assert checkpoint.load(str(tmp_path / "stage2" / "ckpt.pt"))["step"] == 4



def test_a_full_disk_at_the_lock_or_the_metrics_is_one_line_and_leaves_nothing_empty(tmp_path, capsys, monkeypatch):
    """A disk that fills before the lock file's few bytes are written, or at an append to metrics.jsonl: one
    error line naming the file and the disk, exit 1, no traceback; no empty .lock and no empty metrics.jsonl left
    behind (it made the next run ask for --overwrite=True over a run that saved nothing), the checkpoint of a
    run that fills the disk later kept."""
    from tools import runtime
    argv = ["--stage=2", "--init_from=scratch", *TINY, "--max_iters=4", "--eval_interval=2", f"--out_dir={tmp_path}"]
    real_write = os.write

    def no_space_for_the_lock(fd, b):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".lock"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, b)
    with monkeypatch.context() as m:
        m.setattr(checkpoint.os, "write", no_space_for_the_lock)
        msg = fails(capsys, *argv)
    assert ".lock" in msg and "No space left" in msg and "free disk space" in msg, msg
    assert os.listdir(tmp_path / "stage2") == []
    real_log = runtime.Runtime.log_json

    def fills_at_step(step):
        def log_json(self, out_dir, rec):
            if rec.get("step") == step:
                open(os.path.join(out_dir, "metrics.jsonl"), "a").close()  # what open(..., "a") leaves
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_log(self, out_dir, rec)
        return log_json
    monkeypatch.setattr(runtime.Runtime, "log_json", fills_at_step(1))
    msg = fails(capsys, *argv)
    assert "cannot append to" in msg and "metrics.jsonl" in msg and "No space left" in msg, msg
    assert not os.path.exists(tmp_path / "stage2" / "metrics.jsonl")
    assert not os.path.exists(tmp_path / "stage2" / ".lock")
    monkeypatch.setattr(runtime.Runtime, "log_json", fills_at_step(3))  # after the step-2 checkpoint
    msg = fails(capsys, *argv)
    assert "--resume=True" in msg, msg
    assert checkpoint.load(str(tmp_path / "stage2" / "ckpt.pt"))["step"] == 2

@pytest.mark.slow
def test_resume_with_a_new_max_iters_says_the_schedule_changed(saved, tmp_path):
    out, ck = copy_run(saved, tmp_path)
    p = run("--stage=1", "--resume=True", f"--out_dir={out}", "--max_iters=2")
    assert "--max_iters changed from 1 to 2" in p.stdout and "LR schedule" in p.stdout


@pytest.mark.slow
def test_resume_with_a_flag_that_makes_another_run_says_so(saved, tmp_path):
    """A flag a resumed run honours from its next step but that makes it another run than the one saved (here the
    lr and the global batch) is said in the log, with the value it replaces; one that only says how it logs is not."""
    out, ck = copy_run(saved, tmp_path)
    p = run("--stage=1", "--resume=True", f"--out_dir={out}", "--max_iters=2", "--lr=1e-3", "--grad_accum=2",
            "--log_interval=2")
    line = next(line for line in p.stdout.splitlines() if "resuming with" in line)
    assert "--lr=0.001 (was 0.003)" in line and "--grad_accum=2 (was 1)" in line and ck in line, line
    assert "log_interval" not in line and "max_iters" not in line.split("resuming with")[1]


@pytest.mark.parametrize("flags,facts", [
    (["--subln_gain=calibrated", "--subln=False"], ("--subln_gain=calibrated", "--subln=False")),
    (["--subln_gain=calibrated", "--stage=2", "--init_from=scratch"], ("--subln_gain=calibrated", "--init_from=scratch")),
    (["--subln_gain=calibrated", "--stage=1"], ("--subln_gain=calibrated", "--init_from=auto")),
])
def test_a_subln_gain_with_no_subln_to_calibrate_is_refused(tmp_path, capsys, flags, facts):
    """--subln_gain=calibrated measures the SubLN gains inserted into a pretrained model: with no SubLN, or no
    pretrained model to insert it into, the flag would do nothing, unsaid."""
    msg = fails(capsys, *TINY, *flags, f"--out_dir={tmp_path}", code=2)
    assert all(f in msg for f in facts), msg
    assert not os.path.exists(tmp_path / "stage1") and not os.path.exists(tmp_path / "stage2")


@pytest.mark.parametrize("flag,facts,code", [("--n_layer=2", ("n_layer=1", "n_layer=2"), 1),
                                             ("--tokenizer=gpt2", ("--tokenizer=gpt2", "(byte, fingerprint"), 2)])
def test_init_from_a_checkpoint_of_another_shape_or_vocabulary(saved, tmp_path, capsys, flag, facts, code):
    before = digest(saved)
    args = [a for a in TINY if not a.startswith(flag.split("=")[0] + "=")]
    msg = fails(capsys, "--stage=2", f"--init_from={saved}", f"--out_dir={tmp_path}", *args, flag, code=code)
    assert saved in msg and all(f in msg for f in facts)
    assert digest(saved) == before and not os.path.exists(tmp_path / "stage2" / "ckpt.pt")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
@pytest.mark.parametrize("use", ["resume", "init_from"])
def test_corrupt_checkpoint_is_refused_and_left_as_it_was(saved, tmp_path, capsys, damage, use):
    out, ck = copy_run(saved, tmp_path)
    raw = open(ck, "rb").read()
    open(ck, "wb").write(b"\x00 not a checkpoint" if damage == "garbage" else raw[:len(raw) // 2])
    before = digest(ck)
    args = ["--stage=1", "--resume=True"] if use == "resume" else ["--stage=2", f"--init_from={ck}", *TINY]
    msg = fails(capsys, *args, f"--out_dir={out}")
    assert ck in msg and "corrupt or truncated" in msg
    assert digest(ck) == before


def test_a_file_of_another_kind_given_as_a_checkpoint_is_named_as_such(tmp_path):
    """A metrics log, a meta.json or a PNG given where a checkpoint is read was "corrupt or truncated (N bytes, not
    a torch.save zip archive)": it is named for what it is; a damaged checkpoint (text where ckpt.pt was) is still
    called damaged."""
    cases = {"metrics.jsonl": (b'{"step": 1}\n', "a run's metrics log"), "meta.json": (b'{"tokenizer": "byte"}',
             "a text file"), "curves.png": (b"\x89PNG\r\n\x1a\n" + bytes(40), "a PNG image"),
             "ckpt.pt": (b"\x00 not a checkpoint", "corrupt or truncated")}
    for name, (raw, what) in cases.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(checkpoint.CheckpointError) as e:
            checkpoint.load(str(tmp_path / name))
        assert str(tmp_path / name) in str(e.value) and what in str(e.value), str(e.value)


@pytest.mark.parametrize("use", ["resume", "init_from", "sample", "export"])
def test_a_checkpoint_whose_bytes_changed_inside_is_refused_not_trained_on(saved, tmp_path, capsys, use):
    """Eight floats of the first weight overwritten in place (a disk or copy error: the zip still reads, torch.load
    does not check CRCs, and the run trained on the damage and saved over it): refused with one line naming the
    file and the record that fails its CRC-32; the file left as it was. A record written without a CRC is not
    checked, so checkpoints saved with torch's CRCs off still load."""
    import struct
    import zipfile
    import sample
    from tools import export
    out, ck = copy_run(saved, tmp_path)
    with zipfile.ZipFile(ck) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size >= 64)
    with open(ck, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(struct.pack("8f", *[1.0] * 8))
    before = digest(ck)
    argv, main = {"resume": (["--stage=1", "--resume=True", f"--out_dir={out}"], None),
                  "init_from": (["--stage=2", f"--init_from={ck}", *TINY, f"--out_dir={out}/b"], None),
                  "sample": ([f"--ckpt={ck}", "--max_new_tokens=2", "--num_samples=1"], sample.main),
                  "export": ([f"--ckpt={ck}", f"--out={tmp_path}/p.pt"], export.main)}[use]
    msg = fails(capsys, *argv, main=main)
    assert ck in msg and info.filename in msg and "CRC-32" in msg, msg
    assert digest(ck) == before
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(checkpoint.load(str(saved)), tmp_path / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert checkpoint.load(str(tmp_path / "nocrc.pt"))["step"] == checkpoint.load(str(saved))["step"]


def make_shards(d, tokenizer="byte", n=2000):
    """A small prepared-looking dataset: train and val shards of random byte tokens and a meta.json."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        data.write_shard(os.path.join(d, f"{split}_000.bin"), rng.integers(0, 256, n))
    json.dump({"tokenizer": tokenizer}, open(os.path.join(d, "meta.json"), "w"))
    return d


def test_training_on_a_small_valid_shard_directory_works(tmp_path):
    # the control for the damaged directories below: the same kind of directory, undamaged, trains
    d = make_shards(str(tmp_path / "shards"))
    train.main(["--stage=1", *TINY, f"--data={d}", "--max_iters=1", f"--out_dir={tmp_path / 'o'}"])
    assert os.path.exists(tmp_path / "o" / "stage1" / "ckpt.pt")


@pytest.mark.parametrize("case,facts", [  # the file, what is wrong with it, the fix
    ("bad_magic", ("train_000.bin", "magic 0", "20240520", "tools.prepare")),
    ("truncated", ("train_000.bin", "2024 bytes", "2000 tokens", "tools.prepare")),
    ("empty_dir", ("meta.json", "python -m tools.prepare")),
    ("empty_meta", ("meta.json", "tools.prepare")),
    ("meta_without_tokenizer", ("meta.json", "tokenizer", "tools.prepare")),
    ("other_tokenizer", ("gpt2", "--tokenizer=byte")),
    ("block_size_over_a_shard", ("train_000.bin", "block_size 4000", "2000 tokens", "--block_size")),
])
def test_bad_data_directory_is_refused_with_one_line(tmp_path, capsys, case, facts):
    d = str(tmp_path / "shards")
    if case == "empty_dir":
        os.makedirs(d)
    else:
        make_shards(d, tokenizer="gpt2" if case == "other_tokenizer" else "byte")
    if case in ("empty_meta", "meta_without_tokenizer"):
        open(os.path.join(d, "meta.json"), "w").write("" if case == "empty_meta" else "{}")
    train_shard = os.path.join(d, "train_000.bin")
    if case == "bad_magic":
        raw = bytearray(open(train_shard, "rb").read())
        raw[:4] = bytes(4)
        open(train_shard, "wb").write(raw)
    if case == "truncated":
        raw = open(train_shard, "rb").read()
        open(train_shard, "wb").write(raw[:-3000])
    block = ["--block_size=4000"] if case == "block_size_over_a_shard" else []
    msg = fails(capsys, "--stage=1", *TINY, *block, f"--data={d}", f"--out_dir={tmp_path / 'o'}")
    assert all(f in msg for f in facts), msg


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_token_id_past_the_recorded_vocabulary_stops_the_run_in_one_line(tmp_path, capsys, split):
    """A shard whose ids were overwritten past the vocabulary its meta.json records (its header and size intact)
    was an IndexError traceback at the first step (train) or at the first evaluation (val), a device-side assert
    on a GPU: the loader checks every row it reads and names the shard, the id and where it is. The loader alone:
    next_batch and sweep, and shards without a meta.json (no vocabulary recorded) unchecked."""
    d = make_shards(str(tmp_path / "shards"))
    meta = json.load(open(os.path.join(d, "meta.json")))
    json.dump({**meta, "vocab_size": 257}, open(os.path.join(d, "meta.json"), "w"))
    shard = os.path.join(d, f"{split}_000.bin")
    tokens = data.read_shard(shard).copy()
    tokens[40] = 300  # in the first batch either split reads
    data.write_shard(shard, tokens)
    msg = fails(capsys, "--stage=1", *TINY, f"--data={d}", "--max_iters=2", "--eval_interval=1",
                "--eval_whole=True", "--data_order=sequential", f"--out_dir={tmp_path / 'o'}")
    assert shard in msg and "token id 300 at token 40" in msg and "257" in msg and "tools.prepare" in msg, msg
    loader = data.DataLoader(d, split, 4, 16, order="sequential")
    with pytest.raises(data.BadTokens, match="token 40"):
        for _ in range(100):
            loader.next_batch()
    with pytest.raises(data.BadTokens, match="token 40"):
        list(loader.sweep())
    os.remove(os.path.join(d, "meta.json"))
    assert len(list(data.DataLoader(d, split, 4, 16).sweep())) > 0


def test_a_run_refused_during_set_up_leaves_no_empty_directories(tmp_path):
    """A refusal after the run directory was made (a --data that does not exist) left an empty out/stage<N>: the
    directories the run made are removed at exit while empty; one that was there before stays."""
    p = run("--stage=1", *TINY, "--data=/nonexistent", f"--out_dir={tmp_path / 'new' / 'deep'}", rc=1)
    assert "does not exist" in p.stderr and os.listdir(tmp_path) == []
    (tmp_path / "mine").mkdir()
    run("--stage=1", *TINY, "--data=/nonexistent", f"--out_dir={tmp_path / 'mine'}", rc=1)
    assert os.listdir(tmp_path) == ["mine"] and os.listdir(tmp_path / "mine") == []


def test_a_data_path_that_is_not_a_directory_is_named_as_such(tmp_path, capsys):
    """--data=shakespear (a typo) said "no meta.json; make shards with ... --out_dir=shakespear", and a shard file
    given as --data was offered as the --out_dir of a new dataset: it does not exist, or is a file, and the
    shipped corpora are named."""
    d = make_shards(str(tmp_path / "shards"))
    for path, what in ((str(tmp_path / "shakespear"), "does not exist"),
                       (os.path.join(d, "train_000.bin"), "is a file, not a directory")):
        msg = fails(capsys, "--stage=1", *TINY, f"--data={path}", f"--out_dir={tmp_path / 'o'}")
        assert f"--data={path}" in msg and what in msg and "shakespeare, python" in msg and "--out_dir" not in msg, msg


def test_block_size_larger_than_the_val_split_names_the_val_shard(tmp_path, capsys):
    # the shipped val split is 218,305 tokens (2 plays); the train split is 4.8M
    msg = fails(capsys, "--stage=1", *TINY, "--block_size=300000", f"--out_dir={tmp_path}")
    assert all(f in msg for f in ("val_000.bin", "block_size 300000", "218305 tokens", "--block_size")), msg


def test_out_dir_that_cannot_be_created_is_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("a regular file, not a directory")  # even root cannot mkdir under it
    msg = fails(capsys, "--stage=1", *TINY, f"--out_dir={tmp_path / 'afile' / 'sub'}")
    assert str(tmp_path / "afile" / "sub" / "stage1") in msg and "Not a directory" in msg and "--out_dir" in msg
    assert (tmp_path / "afile").read_text() == "a regular file, not a directory"


@pytest.mark.parametrize("flag", ["--keep_last=0", "--max_bad_steps=0"])
def test_invalid_fault_tolerance_settings_are_refused(tmp_path, capsys, flag):
    msg = fails(capsys, flag, f"--out_dir={tmp_path}", "--device=cpu", code=2)
    assert flag in msg and ">= 1" in msg

# -----------------------------------------------------------------------------
# round 2: runs that must not lose or hide anything


@pytest.mark.slow
def test_a_fresh_run_refuses_an_out_dir_holding_another_run_unless_told(tmp_path, capsys):
    out, d = str(tmp_path), tmp_path / "stage1"
    run(f"--out_dir={out}", "--stage=1", *TINY, "--max_iters=4", "--eval_interval=4")
    before = digest(d / "ckpt.pt")
    msg = fails(capsys, f"--out_dir={out}", "--stage=1", *TINY, "--max_iters=0")  # would replace ckpt.pt
    assert str(d) in msg and "--resume=True" in msg and "--overwrite=True" in msg and "--run_name" in msg
    assert digest(d / "ckpt.pt") == before and not (d / ".lock").exists()
    train.main([f"--out_dir={out}", "--stage=1", *TINY, "--max_iters=2", "--eval_interval=2", "--overwrite=True"])
    assert sorted(os.listdir(d)) == ["ckpt.pt", "ckpt_000002.pt", "metrics.jsonl"]  # the old run's files are gone
    assert [r["step"] for r in records(out, stage=1) if "loss" in r] == [1, 2]  # one run's metrics, not two


def test_rotation_never_deletes_a_later_step(tmp_path):
    checkpoint.save({"step": 20, "model": {}, "model_args": {}}, str(tmp_path), keep_last=1)
    for step in (3, 4, 5):
        checkpoint.save({"step": step, "model": {}, "model_args": {}}, str(tmp_path), keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt_000004.pt", "ckpt_000005.pt", "ckpt_000020.pt"]
    assert checkpoint.load(str(tmp_path / "ckpt.pt"))["step"] == 5


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/stat"), reason="no /proc: a lock holds the pid alone")
def test_a_lock_whose_pid_now_belongs_to_another_process_is_taken_over(tmp_path):
    """The lock holds its run's pid and start time (field 22 of /proc/<pid>/stat): a killed run's pid that now
    names another process (this one, a sleeping child), started at another time, is not that run, so its lock is
    taken over; the same pid with its real start time is a live run's, and refused. A lock with the pid alone (an
    older one) is judged by the pid."""
    started = lambda pid: int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
    other = subprocess.Popen(["sleep", "60"])
    try:
        for holder in (f"{os.getpid()} {started(os.getpid()) - 1}", f"{other.pid} {started(other.pid) + 3}", ""):
            (tmp_path / ".lock").write_text(holder)
            release = checkpoint.lock(str(tmp_path))
            ns = os.stat("/proc/self/ns/pid").st_ino
            assert (tmp_path / ".lock").read_text() == \
                f"{os.getpid()} {started(os.getpid())} {atomic._host()} {ns}", holder
            release()
        for holder in (f"{other.pid} {started(other.pid)}", str(other.pid)):
            (tmp_path / ".lock").write_text(holder)
            with pytest.raises(checkpoint.CheckpointError, match=f"pid {other.pid}"):
                checkpoint.lock(str(tmp_path))
            assert (tmp_path / ".lock").read_text() == holder
        # another host's or another PID namespace's (a container) run: its pid means nothing here, so its lock
        # is never taken over (it was when that pid ran nothing here, and the live run lost its checkpoints)
        ns = os.stat("/proc/self/ns/pid").st_ino
        for holder in (f"999999 5 node7 {ns}", f"999999 5 {atomic._host()} {ns + 1}"):
            (tmp_path / ".lock").write_text(holder)
            with pytest.raises(checkpoint.CheckpointError, match="in another host or container"):
                checkpoint.lock(str(tmp_path))
            assert (tmp_path / ".lock").read_text() == holder
        # ...until nothing in the directory has changed for a day (a live run logs far more often): then it is gone
        two_days = time.time() - 2 * 86400
        os.utime(tmp_path / ".lock", (two_days, two_days))
        checkpoint.lock(str(tmp_path))()
    finally:
        other.kill()
        other.wait()


def test_a_second_run_into_the_same_out_dir_is_refused_while_the_first_lives(tmp_path, capsys):
    d = tmp_path / "stage1"
    d.mkdir()
    other = subprocess.Popen(["sleep", "60"])
    try:
        (d / ".lock").write_text(str(other.pid))
        msg = fails(capsys, f"--out_dir={tmp_path}", "--stage=1", *TINY, "--max_iters=1")
        assert str(d) in msg and f"pid {other.pid}" in msg and "--out_dir" in msg and str(d / ".lock") in msg
        assert (d / ".lock").read_text() == str(other.pid)  # the live run's lock is left alone
    finally:
        other.kill()
        other.wait()
    # the same lock file of a run that is gone (killed) is taken over
    train.main([f"--out_dir={tmp_path}", "--stage=1", *TINY, "--max_iters=1"])
    assert (d / "ckpt.pt").exists() and not (d / ".lock").exists()


@pytest.mark.slow
def test_weights_that_became_non_finite_stop_the_run_and_are_never_saved(tmp_path):
    out, d = str(tmp_path), tmp_path / "stage2"
    stderr = run(f"--out_dir={out}", "--stage=2", *TINY, "--max_iters=8", "--checkpoint_interval=1",
                 "--keep_last=3", rc=1, faults="nan_weights_after=3").stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and "not finite" in err[0] and "--lr" in err[0] and "--resume=True" in err[0], stderr
    assert checkpoint.load(str(d / "ckpt.pt"))["step"] == 2  # step 3's weights were refused, step 2's kept
    assert not (d / "ckpt_000003.pt").exists()
    assert all(torch.isfinite(v).all() for v in checkpoint.load(str(d / "ckpt.pt"))["model"].values())


@pytest.mark.slow
def test_non_finite_weights_are_caught_at_the_next_step_without_a_checkpoint_in_between(tmp_path):
    out, d = str(tmp_path), tmp_path / "stage2"
    stderr = run(f"--out_dir={out}", "--stage=2", *TINY, "--max_iters=8", "--checkpoint_interval=2",
                 rc=1, faults="nan_weights_after=3").stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and "step 4" in err[0] and "no longer finite" in err[0], stderr  # not after max_bad_steps
    assert checkpoint.load(str(d / "ckpt.pt"))["step"] == 2


@pytest.mark.slow
def test_a_run_whose_every_step_was_skipped_fails_and_a_partly_skipped_one_says_so(tmp_path):
    out = str(tmp_path / "a")
    stderr = run(f"--out_dir={out}", "--stage=2", *TINY, "--max_iters=4", "--eval_interval=4", rc=1,
                 faults="nan_steps=1,2,3,4").stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and "all 4 steps" in err[0] and "skipped" in err[0], stderr
    stdout = run(f"--out_dir={tmp_path / 'b'}", "--stage=2", *TINY, "--max_iters=4", "--eval_interval=4",
                 faults="nan_steps=2").stdout
    assert "final val loss" in stdout and "1 of them skipped" in stdout


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint_and_leaves_no_tmp(tmp_path, capsys,
                                                                                      monkeypatch):
    out, d = str(tmp_path), tmp_path / "stage1"
    run(f"--out_dir={out}", "--stage=1", *TINY, "--max_iters=2", "--eval_interval=2")
    before = digest(d / "ckpt.pt")

    def full_disk(obj, f):  # what torch.save raises when the disk fills: a RuntimeError, not an OSError
        f.write(b"x" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 1000 vs 768")
    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    msg = fails(capsys, f"--out_dir={out}", "--stage=1", "--resume=True", "--max_iters=4")
    assert str(d) in msg and "checkpoint" in msg and "--resume=True" in msg
    assert digest(d / "ckpt.pt") == before and not [n for n in os.listdir(d) if n.endswith(".tmp")]


@pytest.mark.slow
def test_a_signal_before_training_starts_ends_with_one_line_and_no_lock(tmp_path):
    log = str(tmp_path / "log")
    p = start(f"--out_dir={tmp_path}", "--stage=1", *TINY, log=log, faults="hang_in_setup=1")
    wait_for(lambda: "setting up" in open(log).read() or p.poll() is not None, "the set-up")
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=60)
    err = stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1 and "SIGTERM" in err[0] and "before training" in err[0], stderr
    assert not os.path.exists(tmp_path / "stage1" / ".lock")


def test_shards_replaced_under_a_running_loader_stop_the_run_with_one_line(tmp_path, capsys, monkeypatch):
    d = make_shards(str(tmp_path / "shards"))
    real_step = train.train_step

    def step_then_re_prepare(run, step, *args, **kwargs):
        out = real_step(run, step, *args, **kwargs)
        if step + 1 == 2:  # as if tools/prepare.py re-ran into the directory: a new val shard under the same name
            data.write_shard(os.path.join(d, "val_000.bin"), np.arange(3000) % 256)
        return out
    monkeypatch.setattr(train, "train_step", step_then_re_prepare)
    msg = fails(capsys, "--stage=1", *TINY, f"--data={d}", "--max_iters=6", "--eval_interval=3",
                f"--out_dir={tmp_path / 'o'}")
    assert d in msg and "changed" in msg and "--resume=True" in msg  # the evaluation at step 3 noticed


@pytest.mark.parametrize("flags,facts", [
    (["--distill_relation_heads=3", "--kd_relation=1"], ("--distill_relation_heads=3", "32", "--distill_relation_heads=2")),
    (["--teacher_weights=1,2"], ("--teacher_weights=1,2", "expected 1 ", "one per --teacher")),
    (["--block_size=64"], ("--block_size=64", "32", "ckpt.pt")),
])
def test_stage3_settings_that_fail_only_at_step_1_are_refused_before_training(saved, tmp_path, capsys, flags, facts):
    msg = fails(capsys, "--stage=3", f"--teacher={saved}", "--init_from=scratch", *TINY, *flags,
                f"--out_dir={tmp_path}", code=2)
    assert all(f in msg for f in facts), msg
    assert not os.path.exists(tmp_path / "stage3" / "metrics.jsonl")  # no step was taken


# the lambda schedule on resume: a resumed run continues it; flags that would move lambda are refused


@pytest.fixture(scope="module")
def mid_warmup(tmp_path_factory):
    """A finished 2-step stage-2 run of the tiny model, its lambda warm-up (4 steps) half done: lambda 0.5 next."""
    out = str(tmp_path_factory.mktemp("mid_warmup"))
    run(f"--out_dir={out}", "--stage=2", "--init_from=scratch", *TINY, "--max_iters=2", "--eval_interval=2")
    return os.path.join(out, "stage2", "ckpt.pt")


@pytest.mark.parametrize("flags,facts", [
    (["--lambda_warmup_steps=100"], ("--lambda_warmup_steps=100", "from 0.5 to 0.02")),  # 0 steps left: was re-saved
    (["--lambda_warmup_steps=2", "--max_iters=3"], ("--lambda_warmup_steps=2", "from 0.5 to 1")),  # the old advice
    (["--quant_start=0.5", "--max_iters=4"], ("--quant_start=0.5", "--max_iters=4", "from 0.5 to 0")),
])
def test_a_resume_that_would_move_lambda_is_refused_and_keeps_the_checkpoint(mid_warmup, tmp_path, capsys, flags,
                                                                              facts):
    out = str(tmp_path)
    shutil.copytree(os.path.dirname(mid_warmup), tmp_path / "stage2")
    before = digest(str(tmp_path / "stage2" / "ckpt.pt"))
    msg = fails(capsys, "--stage=2", "--resume=True", f"--out_dir={out}", *flags, code=2)
    assert all(f in msg for f in facts) and "step 2" in msg and "new run" in msg, msg
    assert digest(str(tmp_path / "stage2" / "ckpt.pt")) == before


@pytest.mark.slow
def test_a_resume_that_keeps_lambda_continues_the_warm_up(mid_warmup, tmp_path):
    shutil.copytree(os.path.dirname(mid_warmup), tmp_path / "stage2")
    p = run("--stage=2", "--resume=True", f"--out_dir={tmp_path}", "--max_iters=3")  # the end-of-run advice
    assert [r["lambda"] for r in records(str(tmp_path)) if r.get("step") == 2][-1] == 0.5  # the resumed step 2
    assert "lambda only reached" in p.stdout and "a new run with a shorter" in p.stdout


@pytest.mark.parametrize("use", ["init_from", "resume"])
def test_a_checkpoint_without_subln_is_not_loaded_into_a_subln_model_after_stage_1(saved, tmp_path, capsys, use):
    """Only stage 1 inserts SubLN into weights trained without it (BitDistill's refinement step); stage 2 from such
    weights, or a resume with --subln=True, would leave every gain at its init unsaid: refused, one line."""
    ckpt = torch.load(saved, weights_only=False)
    ckpt["model"] = {k: v for k, v in ckpt["model"].items() if ".subln." not in k}
    ckpt["model_args"] = dict(ckpt["model_args"], subln=False)
    ckpt["config"] = dict(ckpt["config"], subln=False)
    os.makedirs(tmp_path / "stage1")
    path = str(tmp_path / "stage1" / "ckpt.pt")
    torch.save(ckpt, path)
    before = digest(path)
    argv = ([f"--stage=2", f"--init_from={path}", *TINY, f"--out_dir={tmp_path / 'o'}"] if use == "init_from" else
            ["--stage=1", "--resume=True", "--subln=True", f"--out_dir={tmp_path}"])
    msg = fails(capsys, *argv)
    assert path in msg and "subln" in msg, msg
    assert digest(path) == before


def test_a_shipped_corpus_directory_holding_other_data_stops_the_run(tmp_path, capsys, monkeypatch):
    """train.py --data=<shipped corpus> asks tools/prepare.check_shipped (tested in test_prepare.py) about the
    directory it reads: what it says ends the run in one line, before anything is written."""
    from tools import prepare
    seen = []

    def holds_other_data(d, corpus):
        seen.append((os.path.basename(d), corpus))
        raise ValueError(f"{d}: its meta.json lists mine.txt, not the shipped corpus {corpus}")
    monkeypatch.setattr(prepare, "check_shipped", holds_other_data)
    msg = fails(capsys, "--stage=1", *TINY, "--data=shakespeare", f"--out_dir={tmp_path}", code=2)
    assert seen == [("shakespeare_byte", "shakespeare")] and "mine.txt" in msg, msg
    assert not [f for _, _, files in os.walk(tmp_path) for f in files]  # nothing written

# -----------------------------------------------------------------------------
# damaged checkpoints, and those of an older layout: one line naming the part and the fix, before anything loads

DAMAGED = [  # (key, value) put into an otherwise whole resume checkpoint, and the words its line must hold
    ("optimizer", {"muon": {"state": {}, "param_groups": []}, "adamw": None}, "without state, param_groups"),
    ("optimizer", None, "optimizer is NoneType, not a dict"),
    ("loader", None, "loader is NoneType, not a dict"),
    ("loader", {"pos": [[0, 8]], "dirs": ["shakespeare_byte"], "split": "train"}, "without order, cursor"),
    ("rng", {"python": None}, "without numpy, torch, cuda"),
    ("step", "2", "step is str, not an int"),
]


@pytest.mark.parametrize("key,value,words", DAMAGED)
def test_a_damaged_or_older_layout_checkpoint_is_one_line_naming_the_part(tmp_path, capsys, key, value, words):
    """--resume=True from a checkpoint whose optimizer, loader, RNG or step state is damaged or of an older
    layout (Muon's and AdamW's states apart, a (shard, offset) loader state): one line naming that part and
    --init_from=<it> (its weights are whole), the file unchanged. Its weights alone still start a run."""
    d = tmp_path / "stage2"
    d.mkdir()
    ckpt = {"step": 2, "config": {}, "model_args": {}, "model": {}, "val_loss": None,
            "optimizer": {"state": {}, "param_groups": []}, "zclip": None, "rng": checkpoint.rng_state(),
            "loader": {"order": "sequential", "cursor": [0]}}
    path = str(d / "ckpt.pt")
    torch.save({**ckpt, key: value}, path)
    before = open(path, "rb").read()
    line = fails(capsys, "--stage=2", "--resume=True", f"--out_dir={tmp_path}", *TINY)
    assert words in line and f"--init_from={path}" in line and path in line, line
    assert open(path, "rb").read() == before
    assert checkpoint.load(path)["model_args"] == {}  # the weights alone load, as --init_from reads them


def test_rotation_keeps_the_best_evaluated_checkpoint_until_one_as_good_replaces_it(tmp_path):
    """checkpoint.save deletes an older checkpoint only when the new one's val loss is finite and no worse than the
    best finite one among them; a save without a val loss (between evaluations, a stop) keeps the best too."""
    d = str(tmp_path)
    save = lambda step, loss: checkpoint.save({"step": step, "model": {}, "model_args": {}, "val_loss": loss}, d)
    names = lambda: sorted(n for n in os.listdir(d) if n != "ckpt.pt")
    assert save(2, 5.5)[1] is None
    assert save(4, 2e16)[1] == (5.5, os.path.join(d, "ckpt_000002.pt"))  # diverged: the good one stays
    assert names() == ["ckpt_000002.pt", "ckpt_000004.pt"]
    assert save(6, float("nan"))[1][0] == 5.5 and save(8, None)[1][0] == 5.5
    assert names() == ["ckpt_000002.pt", "ckpt_000008.pt"]  # the worse and the unknown ones rotate away
    assert save(10, 5.5)[1] is None and names() == ["ckpt_000010.pt"]  # as good: rotation as before
    assert checkpoint.load(os.path.join(d, "ckpt.pt"))["step"] == 10


def test_a_resume_that_diverges_keeps_the_last_good_checkpoint(tmp_path):
    """--resume at an lr of 1e9: the weights explode but stay finite, the later steps are skipped as non-finite,
    and the final save (val loss ~1e16) does not rotate away the good checkpoint: a line names it."""
    out = str(tmp_path)
    run("--stage=2", "--max_iters=2", f"--out_dir={out}", *TINY)
    good = os.path.join(out, "stage2", "ckpt_000002.pt")
    loss = checkpoint.load(good)["val_loss"]
    p = run("--stage=2", "--resume=True", "--lr=1e9", "--muon_lr=1e9", "--max_iters=8", f"--out_dir={out}", *TINY)
    assert os.path.exists(good) and checkpoint.load(good)["val_loss"] == loss < 10
    final = checkpoint.load(os.path.join(out, "stage2", "ckpt.pt"))
    assert final["step"] == 8 and not final["val_loss"] < 10, final["val_loss"]
    assert f"kept {good} (step 2, val loss {loss:.4f})" in p.stdout, p.stdout


def test_a_resume_refuses_other_shards_under_the_same_name_and_says_when_the_data_flag_changes(tmp_path):
    """The loader's state records how many windows each source holds: a resume whose directory of the same name now
    holds another dataset is refused in one line; a resume with another --data string (the mix, or the same shards
    elsewhere) is said in the log."""
    from conftest import ROOT
    shards, out = tmp_path / "corpus", str(tmp_path / "out")
    shutil.copytree(os.path.join(ROOT, "data", "shakespeare_byte"), shards)
    run("--stage=2", "--max_iters=2", f"--data={shards}", f"--out_dir={out}", *TINY)
    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(shards, moved)  # the same shards in another place: resumes, and says --data changed
    p = run("--stage=2", "--resume=True", "--max_iters=3", f"--data={moved}", f"--out_dir={out}", *TINY)
    assert f"--data={moved} (was {shards})" in p.stdout, p.stdout
    shutil.rmtree(shards)
    shutil.copytree(os.path.join(ROOT, "data", "python_byte"), shards)  # another corpus under the same name
    p = run("--stage=2", "--resume=True", "--max_iters=4", f"--data={shards}", f"--out_dir={out}", *TINY, rc=1)
    assert p.stderr.count("error:") == 1 and "other shards under the same directory name" in p.stderr, p.stderr


def test_a_mistyped_init_from_says_the_path_is_not_there(tmp_path, capsys):
    """--init_from=<a path that does not exist>: one line saying so and what is in its directory, not how to make
    the stage before; --init_from=auto without a stage-1 checkpoint for stage 3 still says how to make it."""
    (tmp_path / "stage2").mkdir()
    (tmp_path / "stage2" / "ckpt_000004.pt").write_bytes(b"x")
    typo = str(tmp_path / "stage2" / "ckpt_00004.pt")
    msg = fails(capsys, "--stage=2", f"--init_from={typo}", f"--out_dir={tmp_path / 'o'}", *TINY, code=2)
    assert f"--init_from={typo}: no such file or directory" in msg and "ckpt_000004.pt" in msg, msg
    msg = fails(capsys, "--stage=3", f"--out_dir={tmp_path / 'none'}", *TINY)
    assert "make it with: python train.py --stage=" in msg, msg


def test_a_signal_during_torch_save_is_a_stop_not_a_disk_failure(tmp_path, monkeypatch):
    """StopSignal's Interrupted raised inside torch.save's writer comes back from torch as a RuntimeError ("unexpected
    pos ..."): atomic_save raises the Interrupted itself (stoppable and the training loop then say "stopped by
    SIGTERM", exit 143), never an OSError that would blame the disk; the old file stays whole and no .tmp is left."""
    import io
    path = str(tmp_path / "ckpt.pt")
    checkpoint.atomic_save({"step": 1}, path)
    real = torch.save

    class Cut(io.RawIOBase):
        def __init__(self, f):
            self.f, self.n = f, 0

        def writable(self):
            return True

        def write(self, b):
            self.n += 1
            if self.n == 3:
                raise atomic.Interrupted(signal.SIGTERM, "SIGTERM: stopped")
            return self.f.write(b)

    monkeypatch.setattr(torch, "save", lambda obj, f: real(obj, Cut(f)))
    with pytest.raises(atomic.Interrupted) as e:
        checkpoint.atomic_save({"step": 2, "w": torch.randn(1000, 100)}, path)
    assert e.value.signum == signal.SIGTERM
    assert torch.load(path, weights_only=True) == {"step": 1} and os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.fixture
def size_limit():
    """lower(n): this process may write files of at most n bytes (RLIMIT_FSIZE, `ulimit -f`; Python ignores
    SIGXFSZ, so a write past it fails with EFBIG) until the test ends."""
    import resource
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    yield lambda n: resource.setrlimit(resource.RLIMIT_FSIZE, (n, old[1]))
    resource.setrlimit(resource.RLIMIT_FSIZE, old)


def test_the_file_size_limit_is_named_as_such_not_as_a_full_disk(tmp_path, capsys, size_limit):
    """`ulimit -f` stopping a write (torch.save says only "unexpected pos ...") is EFBIG and its line names the
    limit and how to raise it, not the disk's free space; the file there stays whole and no .tmp is left."""
    from model import GPT, GPTConfig
    from tools import export
    ckpt, out = str(tmp_path / "ckpt.pt"), str(tmp_path / "packed.pt")
    m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32, vocab_size=257))
    torch.save({"model_args": vars(m.config), "config": {"tokenizer": "byte"}, "model": m.state_dict()}, ckpt)
    export.main([f"--ckpt={ckpt}", f"--out={out}"])
    before = digest(out)
    size_limit(8 * 1024)  # the export of 64-wide matrices is larger
    with pytest.raises(OSError) as e:
        checkpoint.atomic_save({"step": 2, "w": torch.zeros(10_000)}, str(tmp_path / "other.pt"))
    assert e.value.errno == errno.EFBIG
    capsys.readouterr()
    err = fails(capsys, f"--ckpt={ckpt}", f"--out={out}", "--overwrite=True", code=1, main=export.main)
    assert "file-size limit (8,192 bytes)" in err and "ulimit -f unlimited" in err, err
    assert "free disk space" not in err and "GB free" not in err, err
    assert digest(out) == before and sorted(os.listdir(tmp_path)) == ["ckpt.pt", "packed.pt"]


def test_a_run_that_ended_before_its_first_checkpoint_is_not_sent_round_in_a_circle(tmp_path, capsys):
    """A directory holding only a run's metrics.jsonl (stopped before its first save): a fresh run is told to
    replace it or pass another --run_name, never to --resume it; --resume=True is told there is nothing to
    resume and to start again with --overwrite=True, never to drop --resume (which would send it back)."""
    d = tmp_path / "stage2"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    fresh = fails(capsys, "--stage=2", f"--out_dir={tmp_path}", *TINY)
    assert "before its first checkpoint" in fresh and "--overwrite=True" in fresh and "--resume" not in fresh, fresh
    again = fails(capsys, "--stage=2", "--resume=True", f"--out_dir={tmp_path}", *TINY)
    assert "nothing to resume" in again and "--overwrite=True" in again and "without --resume" not in again, again
    assert os.listdir(d) == ["metrics.jsonl"]
