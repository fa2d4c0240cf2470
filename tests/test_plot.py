"""tools/plot.py: a run's curves from metrics.jsonl; --wandb_project logs the same records.
Run: python -m pytest tests/test_plot.py"""

import json
import os

import pytest

from conftest import TINY, fails, run
from tools import plot


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_long_whole_split_evaluation_shows_its_progress(tmp_path, monkeypatch, capsys):
    import train
    from tools import plumbing
    monkeypatch.setattr(plumbing, "EVAL_PROGRESS_S", 0.0)  # every batch counts as long
    args = [a for a in TINY if a != "--eval_whole=False"]
    train.main(["--stage=1", *args, "--max_iters=1", "--eval_interval=1", f"--out_dir={tmp_path}"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "evaluating shakespeare_byte" in line]
    n = int(lines[0].split(" of ")[1].split(",")[0])
    assert n == -(-((218305 - 1) // 32) // 4) and len(lines) == n - 1  # windows of T+1 = 33 tokens, 4 a batch and lines[-1].startswith(f"  evaluating shakespeare_byte: batch {n - 1} of {n}")


def _fake_run(d, steps=3):
    """A run directory with a metrics.jsonl of `steps` logged steps, as train.py writes them (no training)."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "loss": 5.0 / s, "lambda": 1.0, "lr": 1e-3, "raw_norm": 2.0,
                                "clipped_norm": 1.0, "was_clipped": s == 2}) + "\n")
    return str(d)


def test_plot_replaces_its_own_png_but_another_png_only_with_overwrite(tmp_path, capsys):
    """Issue 35: --out overwrote any PNG (even a committed lab/results figure) without --overwrite."""
    from tools import common
    a, b = _fake_run(tmp_path / "a"), _fake_run(tmp_path / "b")
    plot.main([a])
    plot.main([a])  # the same run again: its own curves.png is replaced
    assert common.file_kind(os.path.join(a, "curves.png")) == ("png", os.path.join(a, "metrics.jsonl"))
    figure = tmp_path / "figure.png"  # a PNG that tools.plot did not draw from run a (a committed figure)
    figure.write_bytes(open(os.path.join(a, "curves.png"), "rb").read()[:8] + b"not drawn from run a")
    other = os.path.join(b, "curves.png")
    plot.main([b])
    before = {p: open(p, "rb").read() for p in (str(figure), other)}
    msg = fails(capsys, a, f"--out={figure}", code=2, main=plot.main)
    assert f"--out={figure}" in msg and "PNG" in msg and "--overwrite=True" in msg, msg
    msg = fails(capsys, a, f"--out={other}", code=2, main=plot.main)
    assert "another run" in msg and os.path.join(b, "metrics.jsonl") in msg, msg
    notes = tmp_path / "notes.png"
    notes.write_text("my notes, not an image\n")
    msg = fails(capsys, a, f"--out={notes}", "--overwrite=True", code=2, main=plot.main)  # another kind: never
    assert "text file" in msg and notes.read_text() == "my notes, not an image\n", msg
    assert {p: open(p, "rb").read() for p in (str(figure), other)} == before
    plot.main([a, f"--out={figure}", "--overwrite=True"])  # asked for: replaced
    assert common.file_kind(str(figure)) == ("png", os.path.join(a, "metrics.jsonl"))


def test_plot_on_a_full_disk_keeps_the_previous_png_and_leaves_no_tmp(tmp_path, capsys, monkeypatch):
    """Issue 35: a full disk truncated the existing curves.png (no temp file and rename)."""
    import errno
    import matplotlib.figure
    a = _fake_run(tmp_path / "a")
    plot.main([a])
    png = os.path.join(a, "curves.png")
    before = open(png, "rb").read()

    def full_disk(self, fname, *args, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    msg = fails(capsys, a, main=plot.main)
    assert f"--out={png}" in msg and "No space left" in msg and "unchanged" in msg, msg
    assert open(png, "rb").read() == before and sorted(os.listdir(a)) == ["curves.png", "metrics.jsonl"]
