"""
Our quick start against real nanoGPT (Karpathy's train.py, not a copy), back to back on the same
byte shards, shape and tokens per step: 4 layers, 4 heads, width 128, 16 sequences of 256 bytes, 600
steps, CPU, float32, no compile.

    git clone https://github.com/karpathy/nanoGPT /path/to/nanoGPT
    python -m lab.against_nanogpt --nanogpt=/path/to/nanoGPT [--max_iters=600 --train_args="..." --rounds=3]

nanoGPT runs in a temporary directory holding links to its train.py, model.py and configurator.py
and our data/shakespeare_byte shards rewritten as its train.bin / val.bin (uint16) and meta.pkl
(vocab 257); nothing is written into its checkout. Then `python train.py --stage=2` (ours, into a
temporary out_dir). Printed: each run's wall time and median ms per step (steps after the 10th;
nanoGPT's evaluation steps are the outliers the median drops, ours excludes evaluation from its step
time), and ours / nanoGPT for both. Time it on an idle machine; on a shared one, whose neighbours
move both runs' times by 10 % and more, --rounds=3 runs three pairs, the first of each pair
alternating, and prints the median of their ratios. Ctrl-C stops the run in progress and removes
the temporary directory: one line, exit status 130.

This is the one place real nanoGPT runs; every other comparison with a nanoGPT shape uses its model
as lab/nanogpt.py holds it. Test: python -m pytest tests/test_bench.py -k against_nanogpt
"""
from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import os
import pickle
import re
import shlex
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

import data
from tools.atomic import ROOT
from tools.flags import die, parse
from tools.runtime import GLIBC_TUNABLES

SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=256, batch_size=16)  # our CPU preset's (tools/config.py)


@dataclass
class AgainstFlags:
    nanogpt: str = ""   # a checkout of https://github.com/karpathy/nanoGPT (its train.py, model.py, configurator.py)
    max_iters: int = 600  # steps of both runs (the quick start's)
    train_args: str = ""  # more flags for our run only, e.g. "--eval_whole=False" (a quick look; not the comparison)
    rounds: int = 1     # pairs of runs, the first of each pair alternating; the ratios' median is printed
    nanogpt_keep_memory: bool = False  # nanoGPT's run keeps freed memory as ours does (glibc tunables):
                                       # the same allocator for both; False: nanoGPT as its users run it


def timed(argv, cwd, pattern, name, env=None):
    """Run argv (env: more environment variables); return (wall seconds, the per-step ms its log
    prints, matched by pattern). A failed run, or one that logs too few steps for the median (past
    the first 10), is one error line."""
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        last = ((p.stderr or p.stdout).strip().splitlines() or ["(no output)"])[-1]
        die(f"{name} ({' '.join(argv[:2])} in {cwd}) failed with exit {p.returncode}: {last}")
    ms = [float(m) for m in re.findall(pattern, p.stdout)]
    if len(ms) < 11:
        die(f"{name} logged {len(ms)} step times, the median needs at least 11 (it leaves out the "
            f"first 10): check --max_iters, and that --train_args leaves --log_interval alone", 2)
    return wall, ms


def stopped(where):
    """Ctrl-C: the child running now is stopped (subprocess.run kills it on the interrupt), the
    temporary directory removed; one line and the signal's exit status, 128 + SIGINT, as a shell
    expects."""
    die(f"stopped by Ctrl-C while {where}; the run was stopped and its temporary directory "
        f"removed, nothing else was written", 128 + signal.SIGINT)


def compare(args, files, shards, ours_extra, tmp, where):
    """Both runs in tmp, args.rounds times: nanoGPT's train.py on our shards in its format, and ours;
    the first of each pair alternates (nanoGPT first in round 1), so a load that drifts over the
    rounds weighs on both alike. [{name: (wall s, [ms])}] a round; where[0] says what runs now."""
    os.makedirs(os.path.join(tmp, "data", "nanobitnet_byte"))
    for f in files:
        os.symlink(os.path.abspath(f), os.path.join(tmp, os.path.basename(f)))
    for split in ("train", "val"):
        ids = np.concatenate([np.asarray(data.read_shard(f))
                              for f in data.find_shards(shards, split)])
        ids.astype(np.uint16).tofile(os.path.join(tmp, "data", "nanobitnet_byte", f"{split}.bin"))
    with open(os.path.join(tmp, "data", "nanobitnet_byte", "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": 257}, f)
    shape = [f"--{k}={v}" for k, v in SHAPE.items()]
    n = args.max_iters

    def nanogpt(r):
        where[0] = f"nanoGPT's train.py ran (round {r + 1})"
        return timed([sys.executable, "train.py", "--dataset=nanobitnet_byte", *shape,
                      "--bias=False", "--dropout=0.0", f"--max_iters={n}",
                      f"--lr_decay_iters={n}", "--eval_interval=200", "--eval_iters=20",
                      "--log_interval=1", "--warmup_iters=50",
                      "--gradient_accumulation_steps=1", "--device=cpu", "--compile=False",
                      "--dtype=float32", f"--out_dir={os.path.join(tmp, f'nanogpt_out{r}')}"],
                     tmp, r"iter \d+: loss [\d.]+, time ([\d.]+)ms", "nanoGPT",
                     dict(GLIBC_TUNABLES=GLIBC_TUNABLES) if args.nanogpt_keep_memory else None)

    def ours(r):
        where[0] = f"our train.py ran (round {r + 1})"
        return timed([sys.executable, os.path.join(ROOT, "train.py"), "--stage=2", *shape,
                      f"--max_iters={n}", f"--out_dir={os.path.join(tmp, f'ours_out{r}')}",
                      *ours_extra], ROOT, r"\| ([\d.]+) ms \| [\d.]+ tok/s", "ours")

    rounds = []
    for r in range(args.rounds):
        first, second = (("nanoGPT", nanogpt), ("ours", ours))[::1 if r % 2 == 0 else -1]
        rounds.append({first[0]: first[1](r)})
        rounds[-1][second[0]] = second[1](r)
    return rounds


def main(argv):
    args = AgainstFlags(**parse(argv, AgainstFlags, __doc__))
    if args.rounds < 1:
        die(f"--rounds={args.rounds}: expected at least 1 (pairs of runs)", 2)
    if args.max_iters < 11:  # the median is taken past the first 10 steps (warm-up)
        die(f"--max_iters={args.max_iters}: expected at least 11 (the median step leaves out the first 10)", 2)
    files = [os.path.join(args.nanogpt, f) for f in ("train.py", "model.py", "configurator.py")]
    if not args.nanogpt or not all(os.path.isfile(f) for f in files):
        die(f"--nanogpt={args.nanogpt!r}: expected a checkout of https://github.com/karpathy/nanoGPT holding "
            f"train.py, model.py and configurator.py; clone it and pass its path", 2)
    try:
        ours_extra = shlex.split(args.train_args)
    except ValueError as e:  # an unclosed quote
        die(f"--train_args={args.train_args}: cannot split it into flags ({e}); close each quote",
            2)
    clash = [a for a in ours_extra if a.split("=")[0] in ("--max_iters", "--out_dir", "--stage")]
    if clash:
        die(f"--train_args: {' '.join(clash)} is set by this comparison (--max_iters is its own "
            f"flag); leave it out", 2)
    shards = os.path.join(ROOT, "data", "shakespeare_byte")
    if not os.path.exists(os.path.join(shards, "meta.json")):
        die(f"no byte shards in {shards}; run `python train.py --stage=2` once (it makes them)", 2)
    where = ["the shards were written in nanoGPT's format"]  # what runs now, for a Ctrl-C's line
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rounds = compare(args, files, shards, ours_extra, tmp, where)
    except KeyboardInterrupt:
        stopped(where[0])
    walls, steps = [], []
    for r, runs in enumerate(rounds):
        if args.rounds > 1:
            print(f"round {r + 1} ({next(iter(runs))} first):")
        med = {k: statistics.median(ms[10:]) for k, (_, ms) in runs.items()}
        for k in ("nanoGPT", "ours"):
            wall, ms = runs[k]
            print(f"{k:8s} {args.max_iters} steps in {wall:6.1f} s, median {med[k]:6.1f} ms/step "
                  f"({len(ms)} steps logged)")
        walls.append(runs["ours"][0] / runs["nanoGPT"][0])
        steps.append(med["ours"] / med["nanoGPT"])
    of = "" if args.rounds == 1 else f"the median of {args.rounds} rounds' ratios "
    print(f"ours / nanoGPT: {of}{statistics.median(walls):.2f}x wall, {statistics.median(steps):.2f}x "
          f"median step (targets: at most 1.40x wall, 1.30x median step); {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
