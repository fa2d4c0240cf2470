"""tools/plot.py: a run's curves from metrics.jsonl; --wandb_project logs the same records.
Run: python -m pytest tests/test_plot.py"""

import json
import os

import pytest

from conftest import TINY, fails, run, small_corpus
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
    # the log itself named (it was read as a directory: ".../metrics.jsonl/metrics.jsonl: no such file")
    os.remove(os.path.join(d, "curves.png"))
    plot.main([os.path.join(d, "metrics.jsonl")])
    assert "6 steps, 2 evaluations" in capsys.readouterr().out and os.path.exists(os.path.join(d, "curves.png"))


def test_steps_a_resume_ran_again_are_read_as_the_resume_logged_them(tmp_path):
    """A run killed at step 6 after its checkpoint at step 4 logged steps 5 and 6 (and the evaluation at 6); resumed,
    it runs and logs 5 and 6 again. runtime.read_metrics (what tools.plot and lab read) keeps one record a step and
    evaluation, the resumed run's; the file keeps them all."""
    from tools import runtime
    d = tmp_path / "stage2"
    d.mkdir()
    killed = [{"step": s, "loss": 10.0 - s} for s in range(1, 7)] + [{"step": 6, "val_loss": 9.0}]
    resumed = [{"step": s, "loss": 20.0 - s} for s in range(5, 9)] + [{"step": 8, "val_loss": 8.0}]
    lines = [json.dumps(r) for r in killed[:4] + [{"step": 4, "val_loss": 9.5}] + killed[4:] + resumed]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    recs = runtime.read_metrics(str(d / "metrics.jsonl"))
    assert [(r["step"], r.get("loss", r.get("val_loss"))) for r in recs] == [
        (1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (4, 9.5), (5, 15.0), (6, 14.0), (7, 13.0), (8, 12.0), (8, 8.0)]
    steps, evals = plot.read_metrics(str(d))
    assert [r["step"] for r in steps] == list(range(1, 9)) and [r["val_loss"] for r in evals] == [9.5, 8.0]
    assert len((d / "metrics.jsonl").read_text().splitlines()) == len(lines)


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
    """Every batch counts as long (EVAL_PROGRESS_S = 0): one line per batch after the first, naming its number of
    the whole split's. A val split of 2,000 tokens (conftest.small_corpus) is 62 windows of T+1 = 33 tokens."""
    import train
    from tools import metrics
    monkeypatch.setattr(metrics, "EVAL_PROGRESS_S", 0.0)  # every batch counts as long
    corpus = small_corpus(tmp_path / "corpus")
    args = [a for a in TINY if a != "--eval_whole=False"]
    train.main(["--stage=1", *args, "--max_iters=1", "--eval_interval=1", f"--out_dir={tmp_path}",
                f"--data={corpus}"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "evaluating corpus" in line]
    n = -(-((2000 - 1) // 32) // 4)  # batches of 4 windows
    assert n == 16 and len(lines) == n - 1, lines
    assert lines[-1].startswith(f"  evaluating corpus: batch {n - 1} of {n}"), lines


def _fake_run(d, steps=3):
    """A run directory with a metrics.jsonl of `steps` logged steps, as train.py writes them (no training)."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "loss": 5.0 / s, "lambda": 1.0, "lr": 1e-3, "raw_norm": 2.0,
                                "clipped_norm": 1.0, "was_clipped": s == 2}) + "\n")
    return str(d)


def test_plot_replaces_its_own_png_but_another_png_only_with_overwrite(tmp_path, capsys):
    """--out replaces only this run's plot: another PNG (even a committed lab/results figure) needs --overwrite."""
    from tools import outputs
    a, b = _fake_run(tmp_path / "a"), _fake_run(tmp_path / "b")
    plot.main([a])
    plot.main([a])  # the same run again: its own curves.png is replaced
    assert outputs.file_kind(os.path.join(a, "curves.png")) == ("png", os.path.join(a, "metrics.jsonl"))
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
    assert outputs.file_kind(str(figure)) == ("png", os.path.join(a, "metrics.jsonl"))


def test_plot_on_a_full_disk_keeps_the_previous_png_and_leaves_no_tmp(tmp_path, capsys, monkeypatch):
    """A full disk leaves the existing curves.png whole (a temp file, then a rename)."""
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


def _write_run(d, recs):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return str(d)


def _step(s, **drop):
    rec = {"step": s, "loss": 5.0 / s, "lambda": 1.0, "lr": 1e-3, "raw_norm": 2.0, "clipped_norm": 1.0,
           "was_clipped": s == 2}
    return {k: v for k, v in rec.items() if k not in drop}


@pytest.mark.parametrize("case, recs, notes", [
    ("no-lambda", [_step(s, **{"lambda": 0}) for s in (1, 2, 3)], ["no lambda in any of its step records"]),
    ("no-gradient-norm", [_step(s, raw_norm=0, clipped_norm=0) for s in (1, 2, 3)],
     ["no raw_norm in any of its step records", "no clipped_norm in any"]),
    ("norm-in-some-records", [_step(1), _step(2, raw_norm=0), _step(3)], ["no raw_norm in 1 of its 3 step records"]),
    ("clipped", [{"step": s, "loss": 1.0, "lambda": 1.0, "lr": 1e-3, "raw_norm": 2.0, "clipped_norm": 1.0,
                  "was_clipped": s == 2} for s in (1, 2, 3)], []),
])
def test_plot_draws_the_series_a_record_holds_and_notes_a_missing_one(case, recs, notes, tmp_path, capsys):
    """Records without lambda or the gradient norm (a log of fewer series) plot what they hold, no KeyError."""
    d = _write_run(tmp_path / case, recs)
    plot.main([d])
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"wrote {d}/curves.png: 3 steps, 0 evaluations") and out[:-1] == [
        line for line in out[:-1] if line.startswith("note: ")], out
    assert all(any(n in line for line in out[:-1]) for n in notes) and len(out) - 1 == len(notes), out
    if case == "clipped":
        assert out[-1].endswith("1 clipped steps"), out
    with open(os.path.join(d, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_marks_and_counts_the_steps_skipped_as_non_finite(tmp_path, capsys):
    """A run with skipped non-finite steps. train.py logs a skipped step as {"skipped": 1, "loss": null,
    "lambda", "bad_steps"} (no lr, no norms); a NaN loss is skipped too. Both are counted, not drawn as losses; a run
    whose every step was skipped is one error line."""
    skip = {"skipped": 1, "loss": None, "lambda": 0.5, "bad_steps": 1}
    d = _write_run(tmp_path / "r", [_step(1), {"step": 2, **skip}, {"step": 3, "loss": float("nan"), "lambda": 0.5},
                                    _step(4), {"step": 4, "val_loss": 2.0}])
    steps, evals = plot.read_metrics(d)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [plot.skipped(r) for r in steps] == [0, 1, 1, 0]
    plot.main([d])
    out = capsys.readouterr().out
    assert out == f"wrote {d}/curves.png: 2 steps (2 more skipped as non-finite, marked in red), 1 evaluations, " \
                  f"0 clipped steps\n", out
    d = _write_run(tmp_path / "all", [{"step": 1, **skip}, {"step": 2, **skip}])
    msg = fails(capsys, d, main=plot.main)
    assert "metrics.jsonl: all 2 logged steps were skipped as non-finite" in msg and "--out" not in msg, msg


def _binary(path):
    path.write_bytes(bytes(range(256)) * 4)


def _binary_one_line(path):  # no NUL, no newline: read as text it is one torn last line, i.e. "nothing logged"
    path.write_bytes(b"\xff\xfe\x89garbage" * 50)


def _directory(path):
    path.mkdir()


def _string_step(path):  # hand-edited: a step that is not a number (it was a TypeError traceback)
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": "x", "loss": 1.0}\n{"step": 3, "loss": 1.0}\n')


@pytest.mark.parametrize("spoil, facts", [(_binary, ["binary data"]), (_binary_one_line, ["binary data"]),
                                          (_directory, ["is a directory", "out/stage2"]), (None, ["Permission denied"]),
                                          (_string_step, ["line 2", "step 'x' is not an integer"])])
def test_an_unreadable_metrics_file_is_blamed_not_the_out_png(spoil, facts, tmp_path, capsys, monkeypatch):
    """An unreadable metrics.jsonl (no permission, a directory, binary) is one line naming it, never "cannot write
    --out" or a traceback. Tests run as root here, where chmod 000 still reads: permission is denied by open."""
    import builtins
    import errno
    d = tmp_path / "r"
    d.mkdir()
    path = d / "metrics.jsonl"
    if spoil:
        spoil(path)
    else:
        _write_run(d, [_step(1)])
        real = builtins.open

        def denied(file, *args, **kwargs):
            if str(file) == str(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
            return real(file, *args, **kwargs)
        monkeypatch.setattr(builtins, "open", denied)
    msg = fails(capsys, str(d), main=plot.main)
    assert msg.startswith(f"error: {path}") and all(f in msg for f in facts) and "--out" not in msg, msg
    assert not os.path.exists(d / "curves.png")
