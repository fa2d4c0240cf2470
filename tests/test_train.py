"""End-to-end tests of train.py on the shipped corpus (tiny models, CPU) and of its schedules and CLI."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train  # noqa: E402

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=8", "--eval_iters=4",
        "--warmup_iters=5", "--lambda_warmup_steps=10", "--device=cpu"]


def run(*args, check=True):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-2000:]
    return p


def records(path):
    return [json.loads(line) for line in open(path)]


def test_unknown_cli_key_fails_with_the_list_of_valid_keys():
    p = run("--stage=2", "--learning_rate=1e-3", check=False)
    assert p.returncode == 2
    line = p.stderr.strip().splitlines()[-1]
    assert "--learning_rate=1e-3" in line and "lr" in line and "max_iters" in line and "Traceback" not in p.stderr


def test_wrong_type_and_bad_stage_fail_clearly():
    p = run("--max_iters=ten", check=False)
    assert p.returncode == 2 and "expected int" in p.stderr and "Traceback" not in p.stderr
    p = run("--stage=7", check=False)
    assert p.returncode == 2 and "stage" in p.stderr and "Traceback" not in p.stderr


def test_resume_without_checkpoint_fails_clearly(tmp_path):
    p = run("--stage=1", "--resume=True", f"--out_dir={tmp_path}", *TINY, check=False)
    assert p.returncode == 1 and "no checkpoint" in p.stderr and "Traceback" not in p.stderr


def test_stage1_lowers_val_loss_then_stage2_starts_from_it(tmp_path):
    out = str(tmp_path)
    run("--stage=1", "--max_iters=60", "--eval_interval=30", "--lr=1e-2", f"--out_dir={out}", *TINY)
    recs = records(os.path.join(out, "stage1", "metrics.jsonl"))
    first_loss = recs[0]["loss"]  # the untrained model on its first batch, about ln(257) = 5.55
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert abs(first_loss - math.log(257)) < 0.5
    assert vals[-1] < first_loss - 1.5 and vals[-1] < vals[0]
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 60 and all(k in steps[0] for k in ("lr", "lambda", "grad_norm", "ms", "tok_per_s"))

    ckpt = torch.load(os.path.join(out, "stage1", "ckpt.pt"), weights_only=True)
    assert ckpt["step"] == 60 and not any(k.startswith("_orig_mod.") for k in ckpt["model"])
    assert set(ckpt) >= {"model", "optimizer", "step", "config", "loader"}

    p = run("--stage=2", "--max_iters=20", "--eval_interval=20", f"--out_dir={out}", *TINY)
    assert "starting from the stage-1 weights" in p.stdout
    recs2 = records(os.path.join(out, "stage2", "metrics.jsonl"))
    # lambda = 0 at step 0: the ternary model is exactly the stage-1 model, far below a fresh model's loss
    assert recs2[0]["lambda"] == 0.0 and recs2[0]["loss"] < first_loss - 1.0
    assert recs2[-1]["lambda"] == 1.0


def test_resume_continues_from_the_saved_step(tmp_path):
    out = str(tmp_path)
    run("--stage=1", "--max_iters=10", "--eval_interval=10", f"--out_dir={out}", *TINY)
    p = run("--stage=1", "--resume=True", "--max_iters=14", f"--out_dir={out}")
    assert "at step 10" in p.stdout
    recs = [r for r in records(os.path.join(out, "stage1", "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, 15))
    assert torch.load(os.path.join(out, "stage1", "ckpt.pt"), weights_only=True)["step"] == 14


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_lr_schedule_shapes(schedule):
    cfg = train.TrainConfig(schedule=schedule, max_iters=1000, warmup_iters=100, min_lr_frac=0.1, decay_frac=0.2)
    m = [train.lr_mult(s, cfg) for s in range(1001)]
    assert m[0] == pytest.approx(1 / 101) and m[99] == pytest.approx(100 / 101)  # linear warmup
    assert m[100] == pytest.approx(1.0) and m[1000] == pytest.approx(0.1)
    if schedule == "wsd":
        assert all(x == 1.0 for x in m[100:800]) and m[900] == pytest.approx(0.55)  # stable, then linear decay
    else:
        assert m[550] == pytest.approx(0.55) and all(a >= b for a, b in zip(m[100:], m[101:]))


def test_lambda_warmup_is_linear_then_one():
    cfg = train.TrainConfig(lambda_warmup_steps=200)
    assert [train.lambda_at(s, cfg) for s in (0, 50, 200, 999)] == [0.0, 0.25, 1.0, 1.0]
