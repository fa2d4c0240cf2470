"""
train.py with faults injected from outside, for tests/test_fault.py. train.py, tools/config.py and tools/checkpoint.py carry
no test hooks: this script patches the functions they call, then runs train.main.

    NANOBITNET_FAULTS="hang_at=16" python tests/faults.py --stage=2 ...      (any train.py flags)

Faults (separate several with ";"):
    nan_steps=3,5       the loss of these steps (numbered as logged, from 1) is multiplied by NaN
    nan_weights_after=2 after the update of step 2, one weight becomes NaN (as an overflowing update would)
    hang_at=16          after the checkpoint of step 16 is written, print "hanging until killed" and sleep
    hang_in_setup=1     before the data loaders are built, print "setting up" and sleep (a signal test)
    slow_write=0.3      every write() into a checkpoint's .tmp file flushes, then sleeps this many seconds
    die_rank=1@3        under torchrun, rank 1 exits at once (os._exit) when it starts step 3, as a lost node would
"""

import builtins
import os
import sys
import time

import torch

from tools import checkpoint  # the repository root is on PYTHONPATH (tests/conftest.py sets it)
import train
from tools import loaders


def parse(spec):
    faults = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        key, _, value = item.partition("=")
        if key not in ("nan_steps", "nan_weights_after", "hang_at", "hang_in_setup", "slow_write", "die_rank"):
            sys.exit(f"tests/faults.py: unknown fault {key!r} in NANOBITNET_FAULTS={spec!r}")
        faults[key] = value
    return faults


def inject_nan(steps):
    real_step = train.train_step

    def train_step(run, step, *args, **kwargs):
        if step + 1 not in steps:
            return real_step(run, step, *args, **kwargs)
        loss_fn = run.loss_fn
        run.loss_fn = lambda x, y: (lambda loss, parts: (loss * float("nan"), parts))(*loss_fn(x, y))
        try:
            return real_step(run, step, *args, **kwargs)
        finally:
            run.loss_fn = loss_fn
    train.train_step = train_step


def inject_nan_weights(after):
    real_step = train.train_step

    def train_step(run, step, *args, **kwargs):
        out = real_step(run, step, *args, **kwargs)
        if step + 1 == after:
            with torch.no_grad():
                next(run.model.parameters()).view(-1)[0] = float("nan")
        return out
    train.train_step = train_step


def inject_hang_in_setup():
    def make_loaders(*args, **kwargs):
        print("setting up", flush=True)
        while True:
            time.sleep(0.05)
    loaders.make_loaders = make_loaders


def inject_hang(at):
    real_save = checkpoint.save

    def save(obj, *args, **kwargs):
        path = real_save(obj, *args, **kwargs)
        if obj["step"] == at:
            print(f"hang_at={at}: checkpoint written; hanging until killed", flush=True)
            while True:
                time.sleep(0.05)
        return path
    checkpoint.save = save


class SlowFile:
    """A file whose every write is flushed and followed by a pause, so a test can kill the process mid-write."""

    def __init__(self, f, delay):
        self.f, self.delay = f, delay

    def write(self, b):
        n = self.f.write(b)
        self.f.flush()
        time.sleep(self.delay)
        return n

    def __getattr__(self, name):  # flush, fileno, close, ...
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


def inject_slow_write(delay):
    def slow_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return SlowFile(f, delay) if "w" in mode and str(path).endswith(".tmp") else f
    checkpoint.open = slow_open  # found before the builtin by checkpoint.atomic_save's `open`


def inject_die_rank(rank, at):
    real_step = train.train_step

    def train_step(run, step, *args, **kwargs):
        if run.rt.rank == rank and step + 1 == at:
            os._exit(1)
        return real_step(run, step, *args, **kwargs)
    train.train_step = train_step


if __name__ == "__main__":
    faults = parse(os.environ.get("NANOBITNET_FAULTS", ""))
    if "nan_steps" in faults:
        inject_nan({int(s) for s in faults["nan_steps"].split(",")})
    if "nan_weights_after" in faults:
        inject_nan_weights(int(faults["nan_weights_after"]))
    if "hang_in_setup" in faults:
        inject_hang_in_setup()
    if "hang_at" in faults:
        inject_hang(int(faults["hang_at"]))
    if "slow_write" in faults:
        inject_slow_write(float(faults["slow_write"]))
    if "die_rank" in faults:
        rank, _, at = faults["die_rank"].partition("@")
        inject_die_rank(int(rank), int(at))
    train.main(sys.argv[1:])
