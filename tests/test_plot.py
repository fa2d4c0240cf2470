"""tools/plot.py: a run's curves from metrics.jsonl; --wandb_project logs the same records.
Run: python -m pytest tests/test_plot.py"""

import json
import os

from conftest import TINY, fails, run
from tools import plot


def test_plot_draws_a_run_and_reads_what_it_logged(tmp_path, capsys):
    run("--stage=2", *TINY, "--max_iters=6", "--eval_interval=3", f"--out_dir={tmp_path}")
    d = str(tmp_path / "stage2")
    steps, evals = plot.read_metrics(d)
    assert [r["step"] for r in steps] == list(range(1, 7)) and [r["step"] for r in evals] == [3, 6]
    with open(os.path.join(d, "metrics.jsonl"), "a") as f:
        f.write('{"step": 7, "loss"')  # a torn last line, as a killed run leaves it
    plot.main([d])
    out = capsys.readouterr().out
    assert "6 steps, 2 evaluations" in out
    with open(os.path.join(d, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_refuses_a_missing_run_and_a_torn_middle_line_in_one_line(tmp_path, capsys):
    msg = fails(capsys, str(tmp_path / "nope"), main=plot.main)
    assert "metrics.jsonl" in msg and "out/stage2" in msg
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n{torn\n" + json.dumps({"step": 2}) + "\n")
    msg = fails(capsys, str(d), main=plot.main)
    assert "metrics.jsonl, line 2" in msg
    assert "--out" in fails(capsys, str(d), "--out=x.jpg", code=2, main=plot.main)


def test_wandb_gets_every_logged_record_and_a_missing_wandb_is_said(tmp_path, monkeypatch, capsys):
    import importlib.machinery
    import importlib.util
    import sys
    import types
    import train
    logged, finished = [], []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda project, name, config: types.SimpleNamespace(
        log=lambda rec, step: logged.append((step, rec)), finish=lambda: finished.append(project))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    train.main(["--stage=2", *TINY, "--max_iters=3", "--eval_interval=3", f"--out_dir={tmp_path / 'a'}",
                "--wandb_project=demo"])
    steps, evals = plot.read_metrics(str(tmp_path / "a" / "stage2"))
    assert [s for s, r in logged if "loss" in r] == [1, 2, 3] and [s for s, r in logged if "val_loss" in r] == [3]
    assert logged[0][1]["loss"] == steps[0]["loss"] and finished == ["demo"]
    monkeypatch.delitem(sys.modules, "wandb")
    assert importlib.util.find_spec("wandb") is None  # requirements.txt does not install it
    p = run("--stage=2", *TINY, "--max_iters=1", "--eval_interval=1", f"--out_dir={tmp_path / 'b'}",
            "--wandb_project=demo")
    assert "wandb is not installed" in p.stdout and "metrics.jsonl only" in p.stdout


def test_a_long_whole_split_evaluation_shows_its_progress(tmp_path, monkeypatch, capsys):
    import train
    from tools import plumbing
    monkeypatch.setattr(plumbing, "EVAL_PROGRESS_S", 0.0)  # every batch counts as long
    args = [a for a in TINY if a != "--eval_whole=False"]
    train.main(["--stage=1", *args, "--max_iters=1", "--eval_interval=1", f"--out_dir={tmp_path}"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "evaluating shakespeare_byte" in line]
    n = int(lines[0].split(" of ")[1].split(",")[0])
    assert n == -(-((218305 - 1) // 32) // 4) and len(lines) == n - 1  # windows of T+1 = 33 tokens, 4 a batch and lines[-1].startswith(f"  evaluating shakespeare_byte: batch {n - 1} of {n}")
