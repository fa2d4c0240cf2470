"""Tests for lab/bench.py --quality: the time-to-quality interpolation against its closed form, the fixed val
windows, and one tiny end-to-end run whose printed ratio is the quotient of the two printed times.
Run: python -m pytest tests/test_bench.py"""
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
from conftest import ENV, ROOT
from lab import bench


def test_time_to_interpolates_between_evaluations_at_the_first_crossing():
    points = [(0, 0.0, 5.0), (20, 10.0, 3.0), (40, 20.0, 2.0), (60, 30.0, 2.5), (80, 40.0, 1.5)]
    assert bench.time_to(points, 2.5) == (15.0, 30.0)  # 3.0 -> 2.0 from 10 s to 20 s: half way (not step 60)
    assert bench.time_to(points, 2.0) == (20.0, 40.0)
    assert bench.time_to(points, 5.0) == (0.0, 0.0)
    assert bench.time_to(points, 1.0) is None
    assert bench.time_to(points[2:], 2.5) == (20.0, 40.0)  # the first point (lambda reaching 1) already below


def test_val_windows_are_evenly_spread_and_the_same_each_time(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    tokens = np.arange(1000) % 257
    data.write_shard(str(d / "val_000.bin"), tokens)
    w = bench.val_windows(str(d), 32, 5)
    assert w.shape == (5, 33) and w.dtype == torch.int64
    assert w[:, 0].tolist() == [int(s) % 257 for s in np.linspace(0, 1000 - 33, 5).astype(int)]
    assert w[-1, -1] == tokens[-1]  # the last window ends at the split's last token
    assert torch.equal(w, bench.val_windows(str(d), 32, 5))


@pytest.mark.slow
def test_quality_prints_the_ratio_of_the_two_times_to_the_same_target():
    args = ("--max_iters=40 --n_layer=1 --n_head=2 --n_embd=32 --batch_size=4 --block_size=32 "
            "--lambda_warmup_steps=10 --warmup_steps=5")
    out = subprocess.run([sys.executable, "-m", "lab.bench", "--quality", f"--train_args={args}", "--target=5.3"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    times = dict(re.findall(r"^  (nanoGPT|ours)\s*: ([\d.]+) s, at step", out.stdout, re.M))
    ratio = float(re.search(r"ours / nanoGPT: ([\d.]+)", out.stdout).group(1))
    assert set(times) == {"nanoGPT", "ours"}, out.stdout
    assert abs(ratio - float(times["ours"]) / float(times["nanoGPT"])) < 0.002 + 0.01 * ratio  # times: 3 digits
    assert "target val loss 5.3000 (--target)" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "lab.bench", "--target=2"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --target is an option of --quality; add --quality"
