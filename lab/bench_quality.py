"""
python -m lab.bench --quality: time to quality. The wall time of the training steps (evaluation
excluded) that our quick start (python train.py --stage=2) and a nanoGPT-shaped fp baseline
(lab/nanogpt.py) take to reach the same val loss, as a ratio from one run: the same shards, the same
batches (a copy of our loader), the same shape and steps, both evaluated on the same fixed val
windows. The seconds to a target are interpolated linearly between evaluations (time_to). Results:
lab/results/training-speed.md ("Time to quality").

Test: python -m pytest tests/test_bench.py -k quality
"""

import copy
import math
import shlex
import tempfile
import time

import torch

from tools.flags import die


def val_windows(shard_dir, T, n):
    """n windows of T+1 tokens spread evenly over the val split (the same ones for every model):
    (n, T+1) int64."""
    import data
    import numpy as np
    tokens = np.concatenate([data.read_shard(p) for p in data.find_shards(shard_dir, "val")])
    starts = np.linspace(0, len(tokens) - T - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[i:i + T + 1].astype(np.int64) for i in starts]))


@torch.no_grad()
def window_loss(model, windows, batch=16):
    """Mean next-token cross-entropy over the windows (metrics.token_loss_sums), in eval mode (then
    train mode)."""
    from tools.metrics import token_loss_sums
    model.eval()
    batches = ((w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows.split(batch))
    total, n = token_loss_sums(lambda x, y: model(x, y)[1], batches, windows.device).tolist()
    model.train()
    return total / n


def time_to(points, target):
    """Seconds of training when the val loss first reaches target, linear between evaluations:
    points are (step, seconds, loss). Returns (seconds, step) as floats, or None if it never does. A
    first point already at the target counts at its own time (our points start where lambda reaches
    1: nothing to interpolate from)."""
    if points and points[0][2] <= target:
        return points[0][1], points[0][0]
    for (s0, t0, l0), (s1, t1, l1) in zip(points, points[1:]):
        if l1 <= target:
            f = (l0 - target) / (l0 - l1) if l0 > target else 0.0
            return t0 + f * (t1 - t0), s0 + f * (s1 - s0)
    return None


def check_quality(train_args, target):
    """--quality's options, checked before either run starts: --target must be a val loss a run can
    reach (finite, > 0; 0 = the baseline's final), and --train_args must split as a shell would and
    leave --out_dir to it. Returns the split flags."""
    if not math.isfinite(target) or target < 0:
        die(f"--target={target:g}: expected a val loss > 0 to reach (a cross-entropy is never "
            f"below 0), or 0 for the baseline's final val loss", 2)
    try:
        flags = shlex.split(train_args)
    except ValueError as e:  # an unclosed quote or a trailing backslash
        die(f"--train_args={train_args}: cannot split it into flags ({e}); close each quote, e.g. "
            f"--train_args='--lr=3e-3 --max_iters=100'", 2)
    # our run writes into a temporary directory: another --out_dir (with --overwrite) would replace a saved run
    clash = [a for a in flags if a.split("=")[0] == "--out_dir"]
    if clash:
        die(f"--train_args: {clash[0]} is set by this benchmark (its run goes to a temporary directory, deleted "
            f"after); leave it out", 2)
    return flags


def baseline(cfg, vocab_size, loader):
    """(the nanoGPT-shaped model, its step(step)): nanoGPT's recipe in fp32 (bias=False, dropout 0,
    AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on matrices, 100 warm-up steps, cosine to
    1e-4, clip 1.0: shakespeare_char's optimizer), cfg's shape, steps and grad accumulation, reading
    loader's batches."""
    from lab.nanogpt import GPT, GPTConfig
    torch.manual_seed(cfg.seed)
    base = GPT(GPTConfig(block_size=cfg.block_size, vocab_size=vocab_size, n_layer=cfg.n_layer,
                         n_head=cfg.n_head, n_embd=cfg.n_embd, bias=False))
    opt = base.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")

    def step(it):
        warm, total = 100, cfg.max_iters
        lr = 1e-3 * (it + 1) / (warm + 1) if it < warm else 1e-4 + 0.5 * (1e-3 - 1e-4) * (
            1 + math.cos(math.pi * min((it - warm) / max(total - warm, 1), 1.0)))
        for g in opt.param_groups:
            g["lr"] = lr
        for _ in range(cfg.grad_accum):
            x, y = loader.next_batch()
            (base(x, y)[1] / cfg.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(base.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return base, step


def race(step_fn, eval_fn, steps, every, goal=None, first_counted=lambda step: False):
    """Train steps steps with step_fn(step), timing only the steps; evaluate eval_fn(step) (a val
    loss, or None where the run does not count yet) at step 0, every `every` steps, at the end and
    where first_counted(step) says the run starts to count. Stops early once a counted loss <= goal.
    Returns [(step, seconds, loss)]."""
    first = eval_fn(0)
    points, t = ([(0, 0.0, first)] if first is not None else []), 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        step_fn(step)
        t += time.perf_counter() - t0
        if (step + 1) % every == 0 or step + 1 == steps or (not points and first_counted(step + 1)):
            loss = eval_fn(step + 1)
            if loss is not None:
                points.append((step + 1, t, loss))
            if goal is not None and points and points[-1][2] <= goal:
                break
    return points


def report(curves, target):
    """Print each run's time to the target (the baseline's final val loss unless target) and the
    ratio."""
    goal = target or curves["nanoGPT"][-1][2]
    got = {name: time_to(points, goal) for name, points in curves.items()}
    print(f"target val loss {goal:.4f} ({'--target' if target else 'the baseline’s final'}):")
    for name, g in got.items():
        print(f"  {name:8s}: " + (f"{g[0]:.3g} s, at step {g[1]:.0f}" if g else "not reached"))
    if got["nanoGPT"] and got["ours"] and got["nanoGPT"][0] == 0:  # no time to divide by
        print(f"time to quality, ours / nanoGPT: none: the baseline's val loss at step 0 is "
              f"already at or below {goal:.4f}; pass a lower --target")
    elif got["nanoGPT"] and got["ours"]:
        print(f"time to quality, ours / nanoGPT: {got['ours'][0] / got['nanoGPT'][0]:.3f}")
    return got


def bench_quality(train_args="", target=0.0, every=20, windows=64):
    """Time to quality on the CPU quick start's workload (this file's docstring). The target is the
    baseline's final val loss unless --target is given. Ours counts only as a ternary model: from
    the step where lambda reaches 1 (the end of --lambda_warmup_steps) on, since before that the run
    trains a blend of fp and ternary weights, which is not what it exports."""
    # checked before anything is set up: no run that could not end as asked
    extra = check_quality(train_args, target)
    import train
    from tools import loaders
    with tempfile.TemporaryDirectory() as tmp:
        run = train.setup(["--stage=2", "--device=cpu", f"--out_dir={tmp}"] + extra)
        try:
            cfg = run.cfg
            if train.lambda_at(cfg.max_iters, cfg) < 1:  # ours would have no point to time
                die(f"--train_args={train_args}: our run is never ternary (lambda "
                    f"{train.lambda_at(cfg.max_iters, cfg):.2f} at its last step, "
                    f"--max_iters={cfg.max_iters}); "
                    f"pass a larger --max_iters or a smaller --lambda_warmup_steps", 2)
            T = cfg.block_size
            val = val_windows(next(iter(loaders.resolve_data(cfg))), T, windows)
            B = cfg.batch_size * cfg.grad_accum
            print(f"time to quality: {cfg.max_iters} steps of {B} x {T} tokens, {cfg.n_layer} x "
                  f"{cfg.n_embd}, {cfg.n_head} heads, {torch.get_num_threads()} threads; val loss "
                  f"on {len(val)} fixed val windows every {every} steps (not timed)", flush=True)
            loader = copy.deepcopy(run.train_loader)  # the baseline reads exactly our batches
            base, base_step = baseline(cfg, run.model.config.vocab_size, loader)

            def ours_eval(step):  # None until lambda reaches 1: the model is not ternary before
                if train.lambda_at(step, cfg) < 1:
                    return None
                train.set_step_lambda(run, step)
                return window_loss(run.model, val)
            curves = {"nanoGPT": race(base_step, lambda s: window_loss(base, val), cfg.max_iters,
                                      every)}
            curves["ours"] = race(lambda s: train.train_step(run, s, False), ours_eval,
                                  cfg.max_iters, every,
                                  goal=target or curves["nanoGPT"][-1][2],
                                  first_counted=lambda s: train.lambda_at(s, cfg) >= 1)
            for name, points in curves.items():
                s, t, loss = points[-1]
                print(f"{name:8s}: val {loss:.4f} at step {s} after {t:.1f} s "
                      f"({1000 * t / max(s, 1):.0f} ms/step)", flush=True)
        finally:
            if run.unlock:
                run.unlock()
            run.rt.close()
    return report(curves, target)
