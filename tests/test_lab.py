"""Tests for the lab (lab/tables.py, runner.py, report.py), the experiment runner: whole-val scoring
against an independent loop, the seed/row order, skipping finished runs, resuming a stopped one, and
the table's statistics.
Run: python -m pytest tests/test_lab.py"""
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import time

import numpy as np
import pytest
import torch

import data
from lab import report, runner, tables
from conftest import ENV, ROOT, TINY
from model import GPT, GPTConfig
from tools import atomic, metrics


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    # the runs lab starts: one thread (conftest)
    monkeypatch.setenv("OMP_NUM_THREADS", ENV["OMP_NUM_THREADS"])


def _shards(d, n_val, seed=0):
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    data.write_shard(os.path.join(d, "train_000.bin"), rng.integers(0, 257, 4000))
    data.write_shard(os.path.join(d, "val_000.bin"), rng.integers(0, 257, n_val))
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"tokenizer": "byte", "vocab_size": 257, "eot": 256}, f)


def test_full_val_loss_is_every_window_once(tmp_path):
    d = str(tmp_path / "shards")
    # 7 windows of 33 tokens (starting 0, 32, ..., 192), and a tail that is left out
    _shards(d, 32 * 7 + 5)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, block_size=32, n_layer=1, n_head=2, n_embd=32))
    path = str(tmp_path / "ckpt.pt")
    torch.save({"model": model.state_dict(), "model_args": dataclasses.asdict(model.config)}, path)
    loss, n = runner.full_val_loss(path, d, batch_size=3)  # batches of 3, 3, 1 windows
    # independently: one window at a time, the log-probability of each target read off log_softmax
    tokens = torch.from_numpy(data.read_shard(os.path.join(d, "val_000.bin")).astype(np.int64))
    total = 0.0
    with torch.no_grad():
        for j in range(7):
            w = tokens[j * 32: j * 32 + 33]
            logp = model(w[None, :-1].contiguous(), w[None, 1:].contiguous())[0][0].log_softmax(-1)
            total -= logp[torch.arange(32), w[1:]].sum().item()
    assert n == 7 * 32
    assert loss == pytest.approx(total / n, rel=1e-5)


def _table():
    tiny = " ".join(TINY) + " --max_iters=3 --eval_interval=3"
    return tables.Table(
        "t",
        "tiny",
        [
            tables.Row("a", "row a", f"--stage=1 {tiny}"),
            tables.Row(
                "b", "row b", f"--stage=2 {tiny} --init_from={{run}}/a/ckpt.pt", needs=("a",)
            ),
            tables.Row(
                "c",
                "row c, two teachers",
                f"--stage=3 {tiny} --init_from={{run}}/b/ckpt.pt "
                "--kd_relation=0 "
                f"--teacher={{run}}/a/ckpt.pt,{{next_run}}/a/ckpt.pt",
                needs=("b",),
                needs_next=("a",),
            ),
        ],
        baseline="b",
        reference="a",
    )


def test_order_puts_what_rows_need_first_and_reads_the_next_seeds_teacher():
    t = runner.Lab(_table(), seeds=(0, 1))
    order = t.order(["c"])
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("c", 0), ("c", 1)]
    assert "seed1/a/ckpt.pt" in " ".join(t.argv(t.rows["c"], 0, resume=False))
    assert "seed0/a/ckpt.pt" in " ".join(t.argv(t.rows["c"], 1, resume=False))  # wraps around


@pytest.mark.slow
def test_runs_every_row_and_seed_then_skips_them_and_rescores_a_lost_result(tmp_path, monkeypatch):
    _shards(str(tmp_path / "shards"), 1000)
    t = runner.Lab(_table(), seeds=(0, 1), root=str(tmp_path / "runs"), results=str(tmp_path / "results"))
    t.shipped = str(tmp_path / "shards")
    # every run is also scored on a second corpus's val split: "python", here shards of the test's own (the shipped
    # Python val split, 158k tokens, would take most of the test's time)
    code = str(tmp_path / "code")
    _shards(code, 700, seed=1)
    t.corpus_dir = {"python": code}.__getitem__
    t.table.extra_corpora = {"python": "Python val loss"}
    t.table.measures = {"optimizer_bytes": "optimizer state, bytes"}
    for r in t.table.rows:  # train on the tiny shards too
        r.args += f" --data={t.shipped}"
    logs = []
    t.run(["a", "b", "c"], log=logs.append)
    for row in "abc":
        for seed in (0, 1):
            res = t.result(row, seed)
            assert res["steps"] == 3 and math.isfinite(res["val_loss"]) and res["val_tokens"] == 31 * 32
    assert t.result("a", 0)["val_loss"] != t.result("a", 1)["val_loss"]  # the seed reaches the model's init
    progress = [line for line in logs if line.startswith("[lab] run ")]  # run i of n, what is left, the time left
    assert len(progress) == 6 and "run 1 of 6 (6 to train)" in progress[0] and "min left" not in progress[0]
    assert "run 6 of 6 (1 to train, about" in progress[-1] and "min left" in progress[-1]
    # everything done: a second call trains nothing
    logs.clear()
    t.run(["a", "b", "c"], log=logs.append)
    assert len(logs) == 6 and all("skipped" in line for line in logs)
    # a finished run that lost its result.json (lab stopped while scoring) is scored again, not trained again
    first = t.result("c", 1)
    os.remove(os.path.join(t.run_dir("c", 1), "result.json"))
    logs.clear()
    t.run(["c"], log=logs.append)
    assert not any("train.py" in line for line in logs) and t.result("c", 1)["val_loss"] == first["val_loss"]
    summ = t.report()
    assert summ["a"]["n"] == 2 and summ["a"]["mean"] == pytest.approx(
        statistics.mean([t.result("a", s)["val_loss"] for s in (0, 1)]))
    py = [t.result("a", s)["extra_val_loss"]["python"] for s in (0, 1)]
    assert summ["a"]["python"]["mean"] == pytest.approx(statistics.mean(py))
    assert py[0] == pytest.approx(runner.full_val_loss(os.path.join(t.run_dir("a", 0), "ckpt.pt"), code)[0])
    assert py[0] != t.result("a", 0)["val_loss"]  # another corpus's number, not the main one again
    assert "| Python val loss | vs b | optimizer state, bytes |" in open(tmp_path / "results" / "t.md").read()
    ck = torch.load(os.path.join(t.run_dir("b", 0), "ckpt.pt"), weights_only=True)["optimizer"]["state"]
    assert t.result("b", 0)["optimizer_bytes"] > sum(4 * s["momentum_buffer"].numel() for s in ck.values()
                                                     if "momentum_buffer" in s)
    assert os.path.exists(tmp_path / "results" / "t.md") and os.path.exists(tmp_path / "results" / "t.json")
    table = json.load(open(tmp_path / "results" / "t.json"))
    assert len(table["runs"]) == 6 and table["summary"]["c"]["std"] == pytest.approx(
        statistics.stdev(table["summary"]["c"]["values"]))


@pytest.mark.slow
def test_a_failing_run_stops_the_table_with_its_log_tail(tmp_path):
    t = runner.Lab(tables.Table("t", "bad", [tables.Row("x", "x", "--stage=1 --lr=-1")]), seeds=(0,),
                   root=str(tmp_path))
    with pytest.raises(RuntimeError) as e:
        t.run(["x"], log=lambda s: None)
    assert "x seed 0 failed (exit 2)" in str(e.value) and "--lr=-1.0" in str(e.value)


def test_versus_and_gap_closed_follow_their_definitions():
    base = {"mean": 1.00, "std": 0.01}
    assert report.versus({"mean": 0.97, "std": 0.0}, base) == "-0.0300 (better)"
    assert report.versus({"mean": 1.03, "std": 0.0}, base) == "+0.0300 (worse)"
    # < 2 std
    assert report.versus({"mean": 0.985, "std": 0.0}, base) == "-0.0150 (no measurable difference)"
    assert report.versus({"mean": 0.90, "std": None, "n": 1},
                         base) == "-0.1000 (too few seeds for a verdict)"
    # its own noise
    assert report.versus({"mean": 1.03, "std": 0.02}, base) == "+0.0300 (no measurable difference)"
    ref = {"mean": 0.80, "std": 0.01}
    assert report.closed({"mean": 0.90, "std": 0.0}, base, ref) == "50%"
    assert report.fmt({"mean": 1.23456, "std": 0.00123}) == "1.2346 ± 0.0012"
    # two runs of a three-seed table (one lost, or --seeds=2): said on the page, and no verdict from them
    two = {"mean": 0.90, "std": 0.001, "n": 2}
    assert report.versus(two, {**base, "n": 3}) == "-0.1000 (too few seeds for a verdict)"
    assert report.fmt(two, 3) == "0.9000 ± 0.0010 (2 of 3 seeds)" and report.fmt({**two, "n": 3}, 3) == "0.9000 ± 0.0010"


def test_unknown_table_row_or_option_is_one_line_exit_2(capsys):
    assert runner.main(["nope"]) == 2
    assert runner.main(["distill", "--rows=nope"]) == 2
    with pytest.raises(SystemExit) as e:
        runner.main(["distill", "--jobs=2"])
    assert e.value.code == 2
    assert runner.main(["distill", "--seeds=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)


def test_a_root_inside_a_prepared_dataset_is_refused_before_anything_is_written(tmp_path, capsys):
    """--root=data/shakespeare_byte made seed0/<row>/train.log and argv.json among the shards before train.py
    refused its --out_dir, and tools.prepare then refused to re-make the dataset: one line, nothing written."""
    d = tmp_path / "shards"
    d.mkdir()
    (d / "meta.json").write_text('{"tokenizer": "byte"}')
    for root in (d, d / "a" / "b"):
        assert runner.main(["order", "--seeds=1", f"--root={root}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--root={root}" in err[0] and str(d) in err[0] and "meta.json" in err[0], err
    assert sorted(os.listdir(d)) == ["meta.json"]


@pytest.mark.slow
def test_a_dlm_table_scores_masked_val_losses_and_the_conversion_diagnostics(tmp_path):
    _shards(str(tmp_path / "shards"), 1000)
    tiny = " ".join(TINY) + " --max_iters=3 --eval_interval=3"
    table = tables.Table("d", "tiny dlm", [
        tables.Row("ar", "source", f"--stage=2 --init_from=scratch {tiny}", shown=False),
        tables.Row("mean", "mean init", f"--stage=dlm --init_from={{run}}/ar/ckpt.pt {tiny}", needs=("ar",))],
        baseline="mean", dlm_t=(0.15, 0.85), measures={"spikes": "spikes", "ratio_mask": "mask ratio"})
    t = runner.Lab(table, seeds=(0,), root=str(tmp_path / "runs"), results=str(tmp_path / "results"))
    t.shipped = str(tmp_path / "shards")
    for r in table.rows:
        r.args += f" --data={t.shipped}"
    t.run(["mean"], log=lambda line: None)
    res = t.result("mean", 0)
    want = [runner.dlm_val_loss(os.path.join(t.run_dir("mean", 0), "ckpt.pt"), t.shipped, p)[0] for p in (0.15, 0.85)]
    assert [res["masked_val_t0.15"], res["masked_val_t0.85"]] == want and res["val_loss"] == statistics.mean(want)
    assert res["clipped_frac"] == 0 and res["spikes"] == 0 and res["ratio_mask"] > 1
    assert list(t.summary()) == ["mean"]  # the AR source is run, not shown
    path = os.path.join(t.run_dir("mean", 0), "result.json")  # a result scored before the start columns: rebuilt
    old = {k: v for k, v in res.items() if not k.endswith("_start")}
    json.dump(old, open(path, "w"))
    assert t.result("mean", 0) == res


def test_dlm_ratios_average_all_steps_and_the_first_ten():
    steps = [{"step": s, "ratio_mask": float(s), "ratio_other": 2.0 * s} for s in range(1, 13)]
    assert runner.ratios(steps) == {"ratio_mask": 6.5, "ratio_other": 13.0,
                                     "ratio_mask_start": 5.5, "ratio_other_start": 11.0}

# -----------------------------------------------------------------------------
# nothing lost: committed tables, preempted runs, signals, damaged files


def _fake_result(t, row, seed, val_loss, steps=3):
    """A result.json as lab writes it, without training (the rows of _table() run 3 steps)."""
    os.makedirs(t.run_dir(row, seed), exist_ok=True)
    # the row's command, as t would run it (a seed t does not run: as a 3-seed lab would)
    lab = t if seed in t.seeds else runner.Lab(t.table, seeds=(0, 1, 2), root=t.root)
    argv = lab.argv(lab.rows[row], seed, resume=False)[1:] if t.rows[row].build is None else []
    res = {"row": row, "seed": seed, "val_loss": val_loss, "val_tokens": 992, "scored": "ckpt.pt",
           "argv": argv, "extra_val_loss": {}, "steps": steps, "ms_per_step_median": 1.0,
           "max_logit": None, "optimizer_bytes": 0, "wall_s": 0.0, "curve": [[steps, val_loss]],
           "logit_curve": []}
    with open(os.path.join(t.run_dir(row, seed), "result.json"), "w") as f:
        json.dump(res, f)
    return res


def _finished_ckpt(t, row, seed, step, records=None):
    """A real tiny checkpoint at `step` and its metrics.jsonl, as train.py leaves them, without
    training."""
    d = t.run_dir(row, seed)
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=257, block_size=32, n_layer=1, n_head=2, n_embd=32))
    torch.save({"model": model.state_dict(), "model_args": dataclasses.asdict(model.config),
                "step": step, "config": {"max_iters": 3},
                "optimizer": {}}, os.path.join(d, "ckpt.pt"))
    lines = (
        records
        if records is not None
        else [json.dumps({"step": s, "ms": 1.0}) + "\n" for s in range(1, step + 1)]
    )
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write("".join(lines))


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _snapshot(d):
    return {n: open(os.path.join(d, n),
                    "rb").read() for n in sorted(os.listdir(d))} if os.path.isdir(d) else {}


def _one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


_LAB_INIT = runner.Lab.__init__


def _results_in(monkeypatch, d):
    """Every Lab, runner.main's too, writes its table to d (never to the committed lab/results)."""
    monkeypatch.setattr(runner.Lab, "__init__", lambda self, *a,
                        **k: _LAB_INIT(self, *a, **{**k, "results": str(d)}))


@pytest.fixture
def tiny_main(tmp_path, monkeypatch):
    """runner.main on _table() (as table "t"), its results under tmp_path/results: returns the
    results dir."""
    monkeypatch.setattr(tables, "TABLES", {"t": _table})
    _results_in(monkeypatch, tmp_path / "results")
    return str(tmp_path / "results")


def test_a_report_never_replaces_committed_rows_with_fewer_runs(tmp_path, capsys):
    results = str(tmp_path / "results")
    full = runner.Lab(_table(), seeds=(0, 1, 2), root=str(tmp_path / "full"), results=results)
    for row in "abc":
        for s in (0, 1, 2):
            _fake_result(full, row, s, 1.0 + 0.1 * s)
    full.report()
    committed = _snapshot(results)
    assert json.loads(committed["t.json"])["summary"]["a"]["n"] == 3
    capsys.readouterr()
    # an empty root (a fresh clone), and one seed of every row: the 3-run rows stay, with one line
    # saying so
    empty = runner.Lab(_table(), seeds=(0, 1, 2), root=str(tmp_path / "empty"), results=results)
    one = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "one"), results=results)
    for row in "abc":
        _fake_result(one, row, 0, 2.0)
    for t in (empty, one):
        t.report()
        assert _snapshot(results) == committed
        kept = [line for line in capsys.readouterr().out.splitlines() if "kept" in line]
        assert len(kept) == 1 and all(row in kept[0] for row in "abc"), kept
    # a row with as many runs replaces its committed one; the others keep theirs
    for s in (0, 1, 2):
        _fake_result(one, "a", s, 3.0)
    runner.Lab(_table(), seeds=(0, 1, 2), root=str(tmp_path / "one"), results=results).report()
    table = json.load(open(os.path.join(results, "t.json")))
    assert table["summary"]["a"]["mean"] == 3.0 and table["summary"]["b"]["mean"] == pytest.approx(
        1.1
    )
    assert sorted(
        (r["row"], r["seed"], r["val_loss"]) for r in table["runs"] if r["row"] == "b"
    ) == [("b", 0, 1.0), ("b", 1, 1.1), ("b", 2, 1.2)]


def test_a_fresh_machine_takes_finished_runs_from_the_committed_table_not_retraining_them(tmp_path):
    """out/ does not survive a move to another machine, the committed <table>.json does: lab.run
    takes each run it holds with today's exact flags from there (train.py is never started for it),
    except a run whose checkpoint a row still to run starts from (the next seed's teacher too), a
    run with other flags, and one short of max_iters."""
    results, root = str(tmp_path / "results"), str(tmp_path / "runs")
    first = runner.Lab(_table(), seeds=(0, 1), root=root, results=results)
    for row in "abc":
        for s in (0, 1):
            res = _fake_result(first, row, s, 1.0 + s)
            # as lab ran it, resumed or not
            res["argv"] = first.argv(first.rows[row], s, resume=s == 1)[1:]
            _write(os.path.join(first.run_dir(row, s), "result.json"), json.dumps(res))
    first.report(log=lambda line: None)
    shutil.rmtree(root)  # another machine: the committed table only
    fresh = lambda: runner.Lab(_table(), seeds=(0, 1), root=root, results=results,
                               python="/nonexistent/python")
    t, logs = fresh(), []
    t.run(["a", "b", "c"], log=logs.append)  # a train.py start would fail loudly
    assert len([line for line in logs if "not trained again" in line]) == 6
    assert (
        t.report(log=lambda line: None)["c"]["values"] == [1.0, 2.0] and t.result("a", 1)["adopted"]
    )
    # c seed 0 not committed: what it starts from (b seed 0, a seed 0, and the next seed's teacher a
    # seed 1) is trained
    shutil.rmtree(root)
    table = json.load(open(os.path.join(results, "t.json")))
    table["runs"] = [r for r in table["runs"] if (r["row"], r["seed"]) != ("c", 0)]
    _write(os.path.join(results, "t.json"), json.dumps(table))
    t = fresh()
    assert sorted(t.adopt(t.order(["a", "b", "c"]), log=lambda line: None)) == [("b", 1), ("c", 1)]
    shutil.rmtree(root)
    # rows not asked for (c) do not hold their prerequisites back
    assert sorted(fresh().adopt([("a", 0), ("a", 1), ("b", 0)],
                                log=lambda line: None)) == [("a", 0), ("a", 1), ("b", 0)]
    # other flags than the committed run's, or fewer steps: trained again
    for r in table["runs"]:
        r["argv"] = [a.replace("--max_iters=3",
                               "--max_iters=4") for a in r["argv"]] if r["seed"] == 0 else r["argv"]
        r["steps"] = 2 if r["seed"] == 1 else r["steps"]
    _write(os.path.join(results, "t.json"), json.dumps(table))
    shutil.rmtree(root)
    assert fresh().adopt([("a", 0), ("a", 1)], log=lambda line: None) == []


def test_a_full_disk_while_writing_the_table_keeps_every_committed_page(tmp_path, monkeypatch):
    """The page, its JSON and its plots land together (atomic.atomic_write each), or none of them does."""
    import errno
    results = str(tmp_path / "results")
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"), results=results)
    for row in "abc":
        _fake_result(t, row, 0, 1.0)
    t.report()
    committed = _snapshot(results)
    assert sorted(committed) == ["t.json", "t.md", "t.png"]
    for row in "abc":
        _fake_result(t, row, 0, 2.0)  # new numbers; the page (t.md) is written before its JSON

    def full_disk(obj, f, **kwargs):
        f.write("{half")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(json, "dump", full_disk)
    with pytest.raises(tables.LabError, match="No space left"):
        t.report()
    assert _snapshot(results) == committed  # every page as it was, and no .tmp beside them


def test_report_in_a_fresh_clone_keeps_the_committed_muon_table(tmp_path, monkeypatch, capsys):
    # the committed pages
    assert runner.Lab(tables.TABLES["muon"]()).results == os.path.join(
        runner.ROOT, "lab", "results"
    )
    results = tmp_path / "results"
    results.mkdir()
    for ext in ("json", "md"):
        (results / f"muon.{ext}").write_bytes(
            open(os.path.join(runner.ROOT, "lab", "results", f"muon.{ext}"), "rb").read()
        )
    _results_in(monkeypatch, results)
    before = _snapshot(str(results))
    for extra in ([], ["--seeds=1"]):
        assert runner.main(["muon", "--report", f"--root={tmp_path / 'empty'}", *extra]) == 0
        assert _snapshot(str(results)) == before


@pytest.mark.slow
def test_a_run_refused_by_the_lock_writes_nothing_to_the_table(tmp_path, tiny_main, capsys):
    root = tmp_path / "runs"
    os.makedirs(root / "seed0" / "a")
    (root / "seed0" / "a" / ".lock").write_text(str(os.getpid()))  # a live process holds the run directory
    os.makedirs(tiny_main)
    (tmp_path / "results" / "t.md").write_text("committed page\n")
    assert runner.main(["t", "--seeds=1", "--rows=a", f"--root={root}"]) == 1
    line = _one_error_line(capsys)
    assert "a seed 0 failed" in line and "another run" in line
    assert _snapshot(tiny_main) == {"t.md": b"committed page\n"}


def test_a_run_that_stopped_before_max_iters_is_not_scored_and_is_resumed(tmp_path):
    # "train.py" exits 0 at once, as one sent SIGTERM does after saving
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"), results=str(tmp_path / "results"),
                   python=shutil.which("true"))
    good = [json.dumps({"step": s, "ms": 1.0}) + "\n" for s in (1, 2)]
    # 2 of the row's 3 steps, a torn line
    _finished_ckpt(t, "a", 0, step=2, records=good + ['{"step": 3, "ms'])
    logs = []
    with pytest.raises(tables.LabError) as e:
        t.run(["a"], log=logs.append)
    assert "step 2 of 3" in str(e.value) and any("--resume=True" in line for line in logs)
    # train.py appends after it
    assert open(os.path.join(t.run_dir("a", 0), "metrics.jsonl")).read() == "".join(good)
    assert not os.path.exists(os.path.join(t.run_dir("a", 0), "result.json"))
    # a result.json that an older lab wrote for a stopped run does not count: the run is resumed,
    # not skipped
    _fake_result(t, "a", 0, 1.0, steps=2)
    assert t.result("a", 0) is None
    logs.clear()
    with pytest.raises(tables.LabError):
        t.run(["a"], log=logs.append)
    assert not any("skipped" in line for line in logs) and any(
        "--resume=True" in line for line in logs
    )



def test_a_finished_run_whose_row_changed_is_not_counted_and_trains_again_from_the_start(tmp_path):
    """A result counts only for the flags its row has now: after a row's flags change (another --lr, a
    lowered --max_iters, a --seeds=1 look that gave a seed other teachers), its finished runs are not in the
    table, and the next run trains them again from the start (--overwrite=True, not --resume), with a line
    saying which flags differ. (Before: "done, skipped", and the page described runs that never happened.)"""
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"), results=str(tmp_path / "results"),
                   python=shutil.which("true"))  # "train.py" exits at once: the command is what is checked
    _finished_ckpt(t, "a", 0, step=3)
    _fake_result(t, "a", 0, 1.0)
    assert t.result("a", 0) is not None
    t.table.rows[0] = tables.Row("a", "row a", t.rows["a"].args + " --lr=5e-3")
    t.rows["a"] = t.table.rows[0]
    assert t.result("a", 0) is None and t.found()["a"] == []
    logs = []
    with pytest.raises(tables.LabError):  # the stand-in trains nothing: no checkpoint of the new run
        t.run(["a"], log=logs.append)
    assert any("made with other flags (the row has --lr=5e-3); trained again from the start" in line
               for line in logs), logs
    started = [line for line in logs if "--stage=1" in line]
    assert started and "--overwrite=True" in started[0] and "--resume=True" not in started[0], started
    assert not os.path.exists(os.path.join(t.run_dir("a", 0), "result.json"))

@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_to_lab_reaches_train_py_which_saves_and_nothing_is_written(tmp_path, sig):
    """SIGTERM to the lab process alone; SIGINT to its whole process group, as Ctrl-C in a terminal sends it."""
    import signal
    import subprocess
    import sys
    _shards(str(tmp_path / "shards"), 1000)
    root, results = tmp_path / "runs", tmp_path / "results"
    args = " ".join(TINY) + f" --max_iters=100000 --eval_interval=100000 --data={tmp_path / 'shards'}"
    driver = (f"import sys\nfrom lab import runner, tables\n"
              f"tables.TABLES = {{'t': lambda: tables.Table('t', 'tiny', [tables.Row('a', 'row a', '--stage=1 {args}')])}}\n"
              f"init = runner.Lab.__init__\nrunner.Lab.__init__ = lambda self, *a, **k: init(self, *a, **{{**k, 'results': {str(results)!r}}})\n"
              f"sys.exit(runner.main(['t', '--seeds=1', '--root={root}']))\n")
    p = subprocess.Popen([sys.executable, "-c", driver], cwd=runner.ROOT, env=dict(ENV, PYTHONPATH=runner.ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = root / "seed0" / "a" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.05)
    if sig == "SIGTERM":
        p.send_signal(signal.SIGTERM)
    else:
        os.killpg(p.pid, signal.SIGINT)
    try:
        out, err = p.communicate(timeout=120)
    finally:  # a train.py that lab left behind would train on for minutes: its pid is in its lock file
        lock = root / "seed0" / "a" / ".lock"
        if lock.exists():
            os.kill(int(lock.read_text().split()[0]), signal.SIGKILL)  # "<pid> <start>"
    lines = err.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and sig in lines[0], err
    assert "python -m lab t --seeds=1" in lines[0]  # how to resume: the same command
    step = torch.load(root / "seed0" / "a" / "ckpt.pt", weights_only=True)["step"]
    assert 2 <= step < 100000
    assert not (root / "seed0" / "a" / ".lock").exists()  # train.py ended (not orphaned, not killed)
    assert not (root / "seed0" / "a" / "result.json").exists() and _snapshot(str(results)) == {}


def test_a_corrupt_or_foreign_result_json_is_one_line_naming_it(tmp_path, tiny_main, capsys):
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"))
    _fake_result(t, "a", 0, 1.0)
    path = os.path.join(t.run_dir("a", 0), "result.json")
    for text in ('{"row": "a", "val_lo', "[1, 2, 3]", '{"hello": "world"}',
                 '{"row": "b", "seed": 0, "val_loss": 1.0}'):
        with open(path, "w") as f:
            f.write(text)
        assert runner.main(["t", "--seeds=1", "--report", f"--root={t.root}"]) == 1
        assert path in _one_error_line(capsys)
        assert open(path).read() == text and _snapshot(tiny_main) == {}


def test_a_torn_last_metrics_line_is_tolerated_and_a_corrupt_one_is_named(tmp_path):
    _shards(str(tmp_path / "shards"), 1000)
    # the run is finished: scored without starting train.py
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"), results=str(tmp_path / "results"),
                   python=shutil.which("false"))
    t.shipped = str(tmp_path / "shards")
    good = [json.dumps({"step": s, "ms": 1.0}) + "\n" for s in (1, 2, 3)]
    # killed while writing a line
    _finished_ckpt(t, "a", 0, step=3, records=good + ['{"step": 4, "ms'])
    t.run(["a"], log=lambda line: None)
    assert t.result("a", 0)["steps"] == 3
    os.remove(os.path.join(t.run_dir("a", 0), "result.json"))
    metrics = os.path.join(t.run_dir("a", 0), "metrics.jsonl")
    with open(metrics, "w") as f:
        f.write(good[0] + '{"step": 2, "ms\n' + good[2])
    with pytest.raises(tables.LabError) as e:
        t.run(["a"], log=lambda line: None)
    assert metrics in str(e.value) and "line 2" in str(e.value)
    assert not os.path.exists(os.path.join(t.run_dir("a", 0), "result.json"))


def test_every_result_records_the_commit_lab_ran_at(tmp_path, monkeypatch):
    """result.json, and each run in the table's JSON, hold `git rev-parse HEAD` of the checkout lab
    runs from (-dirty after it when a tracked file differs), and the page names it; "unknown" outside a git
    checkout, or without git."""
    import subprocess
    _shards(str(tmp_path / "shards"), 1000)
    # the run is finished: scored without starting train.py
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"), results=str(tmp_path / "results"),
                   python=shutil.which("false"))
    t.shipped = str(tmp_path / "shards")
    _finished_ckpt(t, "a", 0, step=3)
    t.run(["a"], log=lambda line: None)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=runner.ROOT, capture_output=True,
                          text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=runner.ROOT,
                             capture_output=True, text=True).stdout.strip()
    head += "-dirty" if changed else ""  # a tracked file differs from the commit: not the commit's code
    assert len(head) >= 40 and t.result("a", 0)["commit"] == head
    t.report(log=lambda line: None)
    assert [r["commit"] for r in json.load(open(tmp_path / "results" / "t.json"))["runs"]] == [head]
    assert f"Code: one commit, {head[:7]}{head[40:]} (1 run)." in open(tmp_path / "results" / "t.md").read()
    with monkeypatch.context() as m:
        m.setattr(runner, "ROOT", str(tmp_path))  # not a git checkout
        assert runner._commit() == "unknown"
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on PATH
    assert runner._commit() == "unknown"


def _committed_table(tmp_path, seeds=(0,), **change):
    """A committed t.json holding a finished run of every row and seed (flags as lab runs them); the
    run of row r, seed s then edited in the JSON: change["rs"] = {key: value, or DELETE to drop the
    key}; returns (results dir, root, a Lab of a fresh machine that cannot start train.py)."""
    results, root = str(tmp_path / "results"), str(tmp_path / "runs")
    first = runner.Lab(_table(), seeds=seeds, root=root, results=results)
    for row in "abc":
        for s in seeds:
            res = _fake_result(first, row, s, 1.0 + s)
            res["argv"] = first.argv(first.rows[row], s, resume=False)[1:]
            _write(os.path.join(first.run_dir(row, s), "result.json"), json.dumps(res))
    first.report(log=lambda line: None)
    shutil.rmtree(root)  # another machine: the committed table only
    if change:
        table = json.load(open(os.path.join(results, "t.json")))
        for r in table["runs"]:
            for k, v in change.get(f"{r['row']}{r['seed']}", {}).items():
                r.pop(k) if v is DELETE else r.update({k: v})
        _write(os.path.join(results, "t.json"), json.dumps(table))
    return results, root, runner.Lab(_table(), seeds=seeds, root=root, results=results,
                                     python="/nonexistent/python")


DELETE = object()


def test_adopting_every_run_leaves_the_committed_table_byte_identical(tmp_path):
    """A fresh clone: lab takes every run from the committed table and trains nothing, so it writes
    nothing (no "adopted" mark lands in the committed JSON); once one run is scored anew, the table
    is written and the adopted runs in it are exactly as committed."""
    results, root, t = _committed_table(tmp_path, seeds=(0, 1))
    committed, logs = _snapshot(results), []
    t.run(["a", "b", "c"], log=logs.append)
    assert len([line for line in logs if "not trained again" in line]) == 6
    t.report(log=logs.append)
    assert _snapshot(results) == committed and "nothing was written" in logs[-1], logs[-1]
    before = {(r["row"],
               r["seed"]): r for r in json.load(open(os.path.join(results, "t.json")))["runs"]}
    res = _fake_result(t, "c", 1, 5.0)  # c seed 1 scored again here
    t.report(log=logs.append)
    runs = json.load(open(os.path.join(results, "t.json")))["runs"]
    assert not any("adopted" in r for r in runs)
    assert {(r["row"], r["seed"]): r for r in runs} == {**before, ("c", 1): res}


def test_a_committed_run_made_in_another_checkout_is_adopted(tmp_path):
    """The committed argv begins with the train.py of the checkout it ran in: only the flags must
    match."""
    results, root, t = _committed_table(tmp_path)
    table = json.load(open(os.path.join(results, "t.json")))
    for r in table["runs"]:
        assert r["argv"][0] == os.path.join(runner.ROOT, "train.py")
        r["argv"][0] = "/another/checkout/nanoBitNet/train.py"
    _write(os.path.join(results, "t.json"), json.dumps(table))
    assert sorted(t.adopt(t.order(["c"]), log=lambda line: None)) == [("a", 0), ("b", 0), ("c", 0)]


@pytest.mark.parametrize("change, why", [(dict(val_loss=float("nan")), "val_loss is nan"),
                                         (dict(val_loss=float("inf")), "val_loss is inf"),
                                         (dict(steps="3"), "steps '3'"),
                                         (dict(steps=None), "steps None"),
                                         (dict(steps=DELETE), "steps None"),
                                         (dict(argv=None), "argv None"),
                                         (dict(argv="train.py --stage=2"), "argv 'train.py"),
                                         (dict(argv=DELETE), "no argv"),
                                         (dict(seed="0"), "seed is '0', a string")])
def test_a_committed_run_that_is_nan_or_malformed_is_not_adopted_and_says_why(
    tmp_path, change, why
):
    """Row c seed 0's committed run is unusable: it is not adopted (it is trained again), with one
    line saying why; the rows it starts from are not adopted either (c still has to run), and
    nothing raises."""
    results, root, t = _committed_table(tmp_path, c0=change)
    logs = []
    assert t.adopt(t.order(["c"]), log=logs.append) == []
    said = [line for line in logs if "not taken" in line]
    assert (
        len(said) == 1 and "c seed 0" in said[0] and why in said[0] and "trained again" in said[0]
    ), logs
    assert t.result("c", 0) is None and not os.path.exists(root)


def test_runs_stored_with_the_old_extra_corpus_key_still_load_and_adopt(tmp_path):
    """The committed tables' runs (and older result.json files) hold the other corpora's val loss
    under "also": lab reads them as extra_val_loss, so the committed Python columns still load and
    their runs are still adopted."""
    for name, row in (("mix", "prose"), ("smollm2", "stage2")):
        path = os.path.join(runner.ROOT, "lab", "results", f"{name}.json")
        runs = report._committed_runs(path)[row]
        assert [r["extra_val_loss"]["python"] for r in runs] == json.load(open(path))["summary"][
            row
        ]["python"]["values"]
        assert not any("also" in r for r in runs)
    results, root = str(tmp_path / "results"), str(tmp_path / "runs")
    t = runner.Lab(_table(), seeds=(0,), root=root, results=results, python="/nonexistent/python")
    t.table.extra_corpora = {"python": "Python val loss"}
    old = []
    for row in "abc":
        res = _fake_result(t, row, 0, 1.0)
        del res["extra_val_loss"]
        old.append({**res, "also": {"python": 2.5},
                    "argv": t.argv(t.rows[row], 0, resume=False)[1:]})
    # an older result.json
    _write(os.path.join(t.run_dir("a", 0), "result.json"), json.dumps(old[0]))
    assert t.result("a", 0)["extra_val_loss"] == {"python": 2.5}
    os.makedirs(results)
    _write(os.path.join(results, "t.json"),
           json.dumps({"table": "t", "seeds": [0], "summary": {}, "runs": old}))
    shutil.rmtree(root)  # another machine: the committed table only
    assert sorted(t.adopt(t.order(["c"]), log=lambda line: None)) == [("a", 0), ("b", 0), ("c", 0)]
    assert t.summary()["c"]["python"]["mean"] == 2.5 and "also" not in t.result("c", 0)


def test_an_unwritable_results_dir_is_one_line_and_changes_nothing(
    tmp_path, tiny_main, monkeypatch, capsys
):
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"))
    for row in "abc":
        _fake_result(t, row, 0, 1.0)
    (tmp_path / "afile").write_text("not a directory\n")
    # root may write anywhere: a file in the path stops everyone
    bad = str(tmp_path / "afile" / "results")
    _results_in(monkeypatch, bad)
    assert runner.main(["t", "--seeds=1", "--report", f"--root={t.root}"]) == 1
    line = _one_error_line(capsys)
    assert bad in line and "nothing was changed" in line
    assert (tmp_path / "afile").read_text() == "not a directory\n"
    assert runner.main(["t", "--seeds=1", f"--root={t.root}"]) == 1  # checked before any training
    assert bad in _one_error_line(capsys)


def test_ctrl_c_while_scoring_is_one_line_and_loses_nothing(tmp_path, tiny_main, monkeypatch,
                                                            capsys):
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"))
    _finished_ckpt(t, "a", 0, step=3)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(runner, "full_val_loss", interrupted)
    assert runner.main(["t", "--seeds=1", "--rows=a", f"--root={t.root}"]) == 1
    line = _one_error_line(capsys)
    assert "python -m lab t" in line
    assert os.path.exists(os.path.join(t.run_dir("a", 0), "ckpt.pt"))
    assert not os.path.exists(os.path.join(t.run_dir("a", 0),
                                           "result.json")) and _snapshot(tiny_main) == {}


def test_tables_measured_before_the_lr_table_pin_its_old_defaults():
    """The CPU stage-2 preset changed (lr 2e-2, lambda warm-up 600); earlier tables must still run
    at 3e-3 / 200."""
    for r in tables.TABLES["order"]().rows + tables.TABLES["muon"]().rows:
        assert "--lambda_warmup_steps=200" in r.args and "--muon_lr=" in r.args
    assert (
        tables.TABLES["order"]()
        .rows[0]
        .args.endswith("--lr=3e-3 --muon_lr=3e-3 --lambda_warmup_steps=200")
    )
    assert ("--lr=1e-2" in tables.TABLES["muon"]().rows[-1].args
            and "--lr=3e-3" not in tables.TABLES["muon"]().rows[-1].args)
    assert all(
        "--lr=3e-3 --muon_lr=3e-3 --lambda" not in r.args for r in tables.TABLES["warmup"]().rows
    )


def test_a_row_scored_as_built_runs_once_with_no_training_and_counts_in_the_table(tmp_path):
    """Row.build (the SmolLM2 table's untrained rows: a model as published, naive ternary, SubLN
    inserted): lab scores the model it builds over the whole val split, once (Row.once: the first
    seed only), and never starts train.py."""
    d = str(tmp_path / "shards")
    _shards(d, 32 * 5 + 1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, block_size=32, n_layer=1, n_head=2, n_embd=32))
    built = []
    table = tables.Table("t", "tiny", [tables.Row("fp", "built", "",
                                                  build=lambda lb: built.append(lb) or model,
                                                  once=True)])
    t = runner.Lab(
        table,
        seeds=(0, 1, 2),
        root=str(tmp_path / "runs"),
        results=str(tmp_path / "results"),
        python="/nonexistent/python",
    )  # a train.py start would fail loudly
    t.shipped = d
    t.run(["fp"], log=lambda line: None)
    assert len(built) == 1 and t.max_iters("fp") == 0 and t.result("fp", 1) is None
    res = t.result("fp", 0)
    assert res["steps"] == 0 and res["val_tokens"] == 5 * 32
    assert res["commit"] == runner._commit() != "unknown"
    assert res["val_loss"] == pytest.approx(metrics.whole_val_loss(model, d)[0])
    t.run(["fp"], log=lambda line: None)  # done: not built again
    assert len(built) == 1 and t.summary()["fp"]["n"] == 1
    t.report(log=lambda line: None)
    shutil.rmtree(t.root)  # another machine: taken from the committed table, not built again
    t.run(["fp"], log=lambda line: None)
    assert len(built) == 1 and t.result("fp", 0)["val_loss"] == res["val_loss"]


def test_the_smollm2_table_is_the_issues_rows_at_equal_tokens():
    """Every trained row of the SmolLM2 table at the same batch and tokens per step; stage 3 and its
    control from the same seed's stage 2, for the same steps; the four untrained rows once; train.py
    accepts every row's flags."""
    table = tables.TABLES["smollm2"]()
    t = runner.Lab(table)
    rows = {r.name: r for r in table.rows}
    assert list(rows) == ["fp", "ptq", "subln", "subln_cal", "stage2", "stage2_now", "control",
                          "stage3"]
    assert all(rows[n].once and rows[n].build for n in ("fp", "ptq", "subln", "subln_cal"))
    for name in ("stage2", "stage2_now", "control", "stage3"):
        assert tables.SMOL_COMMON in rows[name].args and not rows[name].once
    assert t.max_iters("stage2") == t.max_iters("stage2_now") == tables.SMOL_STEPS
    assert t.max_iters("stage3") == t.max_iters("control") == tables.SMOL_STAGE3
    assert rows["stage3"].needs == rows["control"].needs == ("stage2",)
    assert rows["stage3"].args.replace("--kd_logits=1", "--kd_logits=0") == rows["control"].args
    assert "--lambda_warmup_steps=0" in rows["stage2_now"].args.split()
    # the issue's two comparisons
    assert table.pairs[:2] == (("stage2", "stage2_now"), ("stage3", "control"))


def test_pairs_are_compared_beneath_the_table_by_the_same_rule(tmp_path):
    """Table.pairs (stage 3 against its control, the warm-up against none): each pair's difference
    and verdict, for the val loss and every other corpus, under the 2-std rule of the table's own
    "vs" column."""
    t = runner.Lab(_table(), seeds=(0, 1, 2), root=str(tmp_path / "runs"),
                   results=str(tmp_path / "results"))
    t.table.pairs, t.table.extra_corpora = (("c", "b"), ("b", "a")), {"python": "Python val loss"}
    for s in (0, 1, 2):
        for row, v in (("a", 2.0), ("b", 2.0 + 0.01 * s), ("c", 1.9 + 0.01 * s)):
            res = _fake_result(t, row, s, v)
            res["extra_val_loss"] = {"python": v + (0.95 if row == "c" else 1.0)}
            _write(os.path.join(t.run_dir(row, s), "result.json"), json.dumps(res))
    lines = t.markdown(t.found()).splitlines()
    assert lines[-4:] == [
        "| comparison | val loss: difference | Python val loss: difference | ",
        "|---|---|---|",
        "| c vs b | -0.1000 (better) | -0.1500 (better) | ",
        "| b vs a | +0.0100 (no measurable difference) | +0.0100 (no measurable difference) | ",
    ]
    assert tables.Table("t", "",
                        []).pairs == () and "comparison" not in runner.Lab(_table()).markdown({})


def test_rows_run_once_compare_exactly_and_seeded_rows_by_their_own_noise():
    """A row no seed changes (Row.once) has no std: against another such row the difference is
    exact; against a seeded row, only the seeded row's noise decides; a seeded row of one seed still
    gets no verdict."""
    once = {"mean": 16.0, "std": None, "n": 1, "once": True}
    assert report.versus({"mean": 3.0, "std": None, "n": 1, "once": True},
                         once) == "-13.0000 (better, exact: no seed involved)"
    assert report.versus({"mean": 7.0, "std": 0.1, "n": 3}, once) == "-9.0000 (better)"
    assert report.versus({"mean": 15.9, "std": 0.1, "n": 3},
                         once) == "-0.1000 (no measurable difference)"
    assert "too few seeds" in report.versus({"mean": 7.0, "std": None, "n": 1}, once)
    assert (
        report.fmt(once) == "16.0000 (one run: no seed involved)"
        and report.fmt({"mean": 7.0, "std": None}) == "7.0000 (1 seed)"
    )


def test_every_committed_table_holds_its_runs_as_run_never_marked_adopted_and_each_adoptable():
    """The committed tables are what lab wrote when it ran or scored runs: no run in them carries
    lab's "adopted" mark (that is for result.json under out/), and every one is whole (finite
    val_loss, a step count, its argv)."""
    import glob
    for path in sorted(glob.glob(os.path.join(runner.ROOT, "lab", "results", "*.json"))):
        table = json.load(open(path))
        if not isinstance(table, dict) or "runs" not in table:
            continue
        for r in table["runs"]:
            assert "adopted" not in r, (path, r["row"], r["seed"])
            assert runner._not_adoptable(r) == "", (path, r["row"], r["seed"],
                                                    runner._not_adoptable(r))


def test_the_dlm_score_averages_the_masked_tokens_only(monkeypatch):
    """score.dlm_val_loss against a closed form: predictions uniform on every masked token (CE = ln
    V) and confidently wrong on every unmasked one (CE ~100) score exactly ln V: only the masked
    tokens count, in the sum and in the mean."""
    import math
    from types import SimpleNamespace

    import torch.nn.functional as F
    from lessons import dlm
    V, T = 258, 64  # the byte vocabulary and the mask token
    stub = SimpleNamespace(config=SimpleNamespace(vocab_size=V, block_size=T), dlm_shift=False)
    from lab import score
    monkeypatch.setattr(score, "_load", lambda path, device="cpu": stub)

    def wrong_unless_masked(model, x, mask_id, shift):
        # certain of the next id, never the token itself
        wrong = 100.0 * F.one_hot((x + 1) % (V - 1), V).float()
        return torch.where((x == mask_id)[..., None], torch.zeros_like(wrong), wrong)
    monkeypatch.setattr(dlm, "predictions", wrong_unless_masked)
    loss, count = score.dlm_val_loss("unused.pt", os.path.join(ROOT, "data", "shakespeare_byte"),
                                      0.15)
    assert abs(loss - math.log(V)) < 1e-5 and count > 0, (loss, math.log(V))


def test_rerun_takes_nothing_from_the_committed_table_and_trains_again_what_was_taken(
    tmp_path, monkeypatch
):
    """A fresh clone takes every committed run (nothing trained); --rerun=True takes none and trains
    every run, those taken in an earlier sitting too (their result.json says "adopted"), in the
    runner's order."""
    results, root, t = _committed_table(tmp_path)
    t.run(["a", "b", "c"], log=lambda line: None)  # the earlier sitting: all three taken
    assert all(t.result(r, 0)["adopted"] for r in "abc")
    trained = []
    monkeypatch.setattr(runner.Lab, "run_one", lambda self, row, seed,
                        log: trained.append((row.name, seed)))
    again = runner.Lab(_table(), seeds=(0,), root=root, results=results,
                       python="/nonexistent/python", rerun=True)
    logs = []
    again.run(["a", "b", "c"], log=logs.append)
    assert trained == [("a", 0), ("b", 0),
                       ("c", 0)] and not [x for x in logs if "not trained again" in x]
    seen = []  # the command line passes the flag on
    monkeypatch.setattr(tables, "TABLES", {"t": _table})
    monkeypatch.setattr(runner.Lab, "run", lambda self, wanted: seen.append(self.rerun))
    monkeypatch.setattr(runner.Lab, "report", lambda self: None)
    monkeypatch.setattr(runner.Lab, "check_writable", lambda self: None)
    assert runner.main(["t", "--rerun=True", f"--root={root}"]) == 0 and runner.main(["t"]) == 0
    assert seen == [True, False]



def test_a_run_trained_over_two_commits_records_both_and_the_page_says_so(tmp_path):
    """A run stopped and resumed after a commit was trained by two codes: result.json's trained_at lists both
    (each train.py process's first metrics record names its commit), the JSON keeps them, and the page's Code
    sentence counts the runs of each. (Before: only the commit that scored it, and the page named none.)"""
    _shards(str(tmp_path / "shards"), 1000)
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"), results=str(tmp_path / "results"),
                   python=shutil.which("false"))
    t.shipped = str(tmp_path / "shards")
    a, b = "a" * 40, "b" * 40 + "-dirty"
    recs = [{"step": 1, "ms": 1.0, "commit": a}, {"step": 2, "ms": 1.0}, {"step": 3, "ms": 1.0, "commit": b}]
    _finished_ckpt(t, "a", 0, step=3, records=[json.dumps(r) + "\n" for r in recs])
    t.run(["a"], log=lambda line: None)
    assert t.result("a", 0)["trained_at"] == [a, b]
    t.report(log=lambda line: None)
    assert "Code: 2 commits, aaaaaaa (1 run), bbbbbbb-dirty (1 run)." in open(tmp_path / "results" / "t.md").read()

def test_a_committed_run_of_other_flags_is_not_taken_and_the_line_says_which(tmp_path):
    """A fresh machine re-trains a committed run whose recorded flags are not the row's now (the pinned --lr of
    a table whose runs predate the pin): one line names the flags that differ, where nothing was said."""
    results, root, t = _committed_table(tmp_path)
    table = json.load(open(os.path.join(results, "t.json")))
    for r in table["runs"]:
        if r["row"] == "a":
            r["argv"] = [a for a in r["argv"] if not a.startswith("--max_iters=")] + ["--lr=3e-3"]
    _write(os.path.join(results, "t.json"), json.dumps(table))
    logs = []
    assert t.adopt(t.order(["a"]), log=logs.append) == []
    said = [line for line in logs if "a seed 0: its run in t.json is not taken" in line]
    assert len(said) == 1 and "it had --lr=3e-3; the row has --max_iters=3" in said[0], logs


def _stand_in(path, body):
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, 0o755)
    return str(path)


def test_a_failed_run_is_named_by_this_attempts_error_line_not_the_logs_last_line(tmp_path):
    """train.py refusing to start (another run holds the lock) prints its error line, and a stray train.py of an
    earlier sitting may go on appending step lines to the same log: the failure names this attempt's error line.
    (Before: the log's last line, a stray step line.)"""
    python = _stand_in(tmp_path / "python", 'echo "error: another run (pid 5032) is writing here"\n'
                                            'echo "step 5143 | loss 3.6144"\nexit 1\n')
    t = runner.Lab(_table(), seeds=(0,), root=str(tmp_path / "runs"), python=python)
    os.makedirs(t.run_dir("a", 0))
    _write(os.path.join(t.run_dir("a", 0), "train.log"), "error: an older attempt's refusal\n")
    with pytest.raises(tables.LabError) as e:
        t.run(["a"], log=lambda line: None)
    assert "a seed 0 failed (exit 1): another run (pid 5032) is writing here" in str(e.value), str(e.value)


def test_train_py_gets_sigterm_when_lab_is_killed(tmp_path):
    """(Linux: PR_SET_PDEATHSIG.) lab killed with SIGKILL (or its terminal closed) while train.py runs: train.py is sent SIGTERM (on which
    it saves and exits) instead of training on alone, holding the run's lock for the next sitting."""
    import signal
    import subprocess
    mark = tmp_path / "got_term"
    python = _stand_in(tmp_path / "python", f'trap \'echo term > "{mark}"; exit 0\' TERM\n'
                                            f'touch "{tmp_path / "started"}"\nwhile true; do sleep 0.05; done\n')
    lab = subprocess.Popen([sys.executable, "-c",
                            "import sys; sys.path.insert(0, 'tests'); import test_lab, lab.runner as r; "
                            f"r.Lab(test_lab._table(), seeds=(0,), root={str(tmp_path / 'runs')!r}, "
                            f"python={python!r}).run(['a'], log=lambda line: None)"], cwd=runner.ROOT)
    deadline = time.time() + 60
    while not (tmp_path / "started").exists():
        assert time.time() < deadline and lab.poll() is None, "the stand-in train.py never started"
        time.sleep(0.05)
    lab.send_signal(signal.SIGKILL)
    lab.wait()
    while not mark.exists():
        assert time.time() < deadline, "train.py kept running after lab was killed"
        time.sleep(0.05)
