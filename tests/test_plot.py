"""tools/plot.py: a run's curves from metrics.jsonl. Run: python -m pytest tests/test_plot.py"""

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
    assert "metrics.jsonl:2" in msg
    assert "--out" in fails(capsys, str(d), "--out=x.jpg", code=2, main=plot.main)
