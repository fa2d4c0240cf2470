"""Tests for lab/tables.py, the experiment runner: whole-val scoring against an independent loop, the seed/row
order, skipping finished runs, resuming a stopped one, and the table's statistics.
Run: python -m pytest tests/test_lab.py"""
import dataclasses
import json
import math
import os
import statistics

import numpy as np
import pytest
import torch

import data
from lab import tables as lab
from conftest import ENV, TINY
from model import GPT, GPTConfig


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", ENV["OMP_NUM_THREADS"])  # the runs lab starts: one thread (conftest)


def _shards(d, n_val):
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    data.write_shard(os.path.join(d, "train_000.bin"), rng.integers(0, 257, 4000))
    data.write_shard(os.path.join(d, "val_000.bin"), rng.integers(0, 257, n_val))
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"tokenizer": "byte", "vocab_size": 257, "eot": 256}, f)


def test_full_val_loss_is_every_window_once(tmp_path):
    d = str(tmp_path / "shards")
    _shards(d, 32 * 7 + 5)  # 7 windows of 33 tokens (starting 0, 32, ..., 192), and a tail that is left out
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, block_size=32, n_layer=1, n_head=2, n_embd=32))
    path = str(tmp_path / "ckpt.pt")
    torch.save({"model": model.state_dict(), "model_args": dataclasses.asdict(model.config)}, path)
    loss, n = lab.full_val_loss(path, d, batch_size=3)  # batches of 3, 3, 1 windows
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
    return lab.Table("t", "tiny", [
        lab.Row("a", "row a", f"--stage=1 {tiny}"),
        lab.Row("b", "row b", f"--stage=2 {tiny} --init_from={{run}}/a/ckpt.pt", needs=("a",)),
        lab.Row("c", "row c, two teachers", f"--stage=3 {tiny} --init_from={{run}}/b/ckpt.pt --distill_gamma=0 "
                f"--teacher={{run}}/a/ckpt.pt,{{next_run}}/a/ckpt.pt", needs=("b",), needs_next=("a",)),
    ], baseline="b", reference="a")


def test_order_puts_what_rows_need_first_and_reads_the_next_seeds_teacher():
    t = lab.Lab(_table(), seeds=(0, 1))
    order = t.order(["c"])
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("c", 0), ("c", 1)]
    assert "seed1/a/ckpt.pt" in " ".join(t.argv(t.rows["c"], 0, resume=False))
    assert "seed0/a/ckpt.pt" in " ".join(t.argv(t.rows["c"], 1, resume=False))  # wraps around


def test_runs_every_row_and_seed_then_skips_them_and_resumes_a_stopped_one(tmp_path, monkeypatch):
    _shards(str(tmp_path / "shards"), 1000)
    t = lab.Lab(_table(), seeds=(0, 1), root=str(tmp_path / "runs"), results=str(tmp_path / "results"))
    t.shipped = str(tmp_path / "shards")
    t.table.also = {"python": "Python val loss"}  # every run is also scored on the shipped code corpus's val split
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
    # everything done: a second call trains nothing
    logs.clear()
    t.run(["a", "b", "c"], log=logs.append)
    assert len(logs) == 6 and all("skipped" in line for line in logs)
    # a stopped run (checkpoint, no result.json) is resumed, not restarted
    os.remove(os.path.join(t.run_dir("c", 1), "result.json"))
    logs.clear()
    t.run(["c"], log=logs.append)
    assert any("--resume=True" in line for line in logs)
    summ = t.report()
    assert summ["a"]["n"] == 2 and summ["a"]["mean"] == pytest.approx(
        statistics.mean([t.result("a", s)["val_loss"] for s in (0, 1)]))
    py = [t.result("a", s)["also"]["python"] for s in (0, 1)]
    assert summ["a"]["python"]["mean"] == pytest.approx(statistics.mean(py))
    assert py[0] == pytest.approx(lab.full_val_loss(os.path.join(t.run_dir("a", 0), "ckpt.pt"), lab._shipped_dir("python"))[0])
    assert "| Python val loss | vs b | optimizer state, bytes |" in open(tmp_path / "results" / "t.md").read()
    ck = torch.load(os.path.join(t.run_dir("b", 0), "ckpt.pt"), weights_only=True)["optimizer"]["muon"]["state"]
    assert t.result("b", 0)["optimizer_bytes"] > sum(4 * s["momentum_buffer"].numel() for s in ck.values())
    assert os.path.exists(tmp_path / "results" / "t.md") and os.path.exists(tmp_path / "results" / "t.json")
    table = json.load(open(tmp_path / "results" / "t.json"))
    assert len(table["runs"]) == 6 and table["summary"]["c"]["std"] == pytest.approx(
        statistics.stdev(table["summary"]["c"]["values"]))


def test_a_failing_run_stops_the_table_with_its_log_tail(tmp_path):
    t = lab.Lab(lab.Table("t", "bad", [lab.Row("x", "x", "--stage=1 --lr=-1")]), seeds=(0,), root=str(tmp_path))
    with pytest.raises(RuntimeError) as e:
        t.run(["x"], log=lambda s: None)
    assert "x seed 0 failed (exit 2)" in str(e.value) and "--lr=-1.0" in str(e.value)


def test_versus_and_gap_closed_follow_their_definitions():
    base = {"mean": 1.00, "std": 0.01}
    assert lab.versus({"mean": 0.97, "std": 0.0}, base) == "-0.0300 (better)"
    assert lab.versus({"mean": 1.03, "std": 0.0}, base) == "+0.0300 (worse)"
    assert lab.versus({"mean": 0.985, "std": 0.0}, base) == "-0.0150 (no measurable difference)"  # < 2 std
    assert lab.versus({"mean": 0.90, "std": None, "n": 1}, base) == "-0.1000 (too few seeds for a verdict)"
    assert lab.versus({"mean": 1.03, "std": 0.02}, base) == "+0.0300 (no measurable difference)"  # its own noise
    ref = {"mean": 0.80, "std": 0.01}
    assert lab.closed({"mean": 0.90, "std": 0.0}, base, ref) == "50%"
    assert lab.fmt({"mean": 1.23456, "std": 0.00123}) == "1.2346 ± 0.0012"


def test_unknown_table_row_or_option_is_one_line_exit_2(capsys):
    assert lab.main(["nope"]) == 2
    assert lab.main(["distill", "--rows=nope"]) == 2
    with pytest.raises(SystemExit) as e:
        lab.main(["distill", "--jobs=2"])
    assert e.value.code == 2
    assert lab.main(["distill", "--seeds=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)


def test_a_dlm_table_scores_masked_val_losses_and_the_conversion_diagnostics(tmp_path):
    _shards(str(tmp_path / "shards"), 1000)
    tiny = " ".join(TINY) + " --max_iters=3 --eval_interval=3"
    table = lab.Table("d", "tiny dlm", [
        lab.Row("ar", "source", f"--stage=2 --init_from=scratch {tiny}", shown=False),
        lab.Row("mean", "mean init", f"--stage=dlm --init_from={{run}}/ar/ckpt.pt {tiny}", needs=("ar",))],
        baseline="mean", dlm_t=(0.15, 0.85), measures={"spikes": "spikes", "ratio_mask": "mask ratio"})
    t = lab.Lab(table, seeds=(0,), root=str(tmp_path / "runs"), results=str(tmp_path / "results"))
    t.shipped = str(tmp_path / "shards")
    for r in table.rows:
        r.args += f" --data={t.shipped}"
    t.run(["mean"], log=lambda line: None)
    res = t.result("mean", 0)
    want = [lab.dlm_val_loss(os.path.join(t.run_dir("mean", 0), "ckpt.pt"), t.shipped, p)[0] for p in (0.15, 0.85)]
    assert [res["masked_val_t0.15"], res["masked_val_t0.85"]] == want and res["val_loss"] == statistics.mean(want)
    assert res["clipped_frac"] == 0 and res["spikes"] == 0 and res["ratio_mask"] > 1
    assert list(t.summary()) == ["mean"]  # the AR source is run, not shown
    path = os.path.join(t.run_dir("mean", 0), "result.json")  # a result scored before the start columns: rebuilt
    old = {k: v for k, v in res.items() if not k.endswith("_start")}
    json.dump(old, open(path, "w"))
    assert t.result("mean", 0) == res


def test_dlm_ratios_average_all_steps_and_the_first_ten():
    steps = [{"step": s, "ratio_mask": float(s), "ratio_other": 2.0 * s} for s in range(1, 13)]
    assert lab._ratios(steps) == {"ratio_mask": 6.5, "ratio_other": 13.0, "ratio_mask_start": 5.5,
                                  "ratio_other_start": 11.0}
