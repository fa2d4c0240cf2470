"""
What a run measures and writes: evaluation (the val losses) and the log lines and metrics.jsonl
records of evaluations and steps, shared by train.py and the lab.

Evaluation: each val source's mean token loss and their mixing-weighted total, logged and written to
metrics.jsonl. Every evaluation reads the first eval_iters batches of each source, the same rows
every time; the final one (--eval_whole=True, the default) reads every window of every val split
once (data.DataLoader.sweep), the number the lab also scores (whole_val_loss; token_loss_sums is the
one sum behind train.py's, the lab's and the benchmarks' val losses). A masked-diffusion model
(--stage=dlm) is scored by its own loss (lessons/dlm.py) with masks drawn from a generator seeded
the same at every evaluation.
Test: python -m pytest tests/test_train.py
"""

import contextlib
import os
import time

import torch

import data
from tools import atomic
from tools.config import stage_dir
from tools.flags import die

EVAL_PROGRESS_S = 10.0  # a whole-split evaluation prints a progress line this often


def evaluate(run, step, lam, whole):
    """Evaluate, log the line and the metrics.jsonl record, and return the val loss (mixing-weighted
    over the sources). With --avg_checkpoints the average is evaluated beside the weights."""
    val_loss, by_source = estimate_val_loss(run, whole)
    rec = {"step": step, "val_loss": val_loss, "lambda": lam, "whole_val": whole}
    if len(by_source) > 1:
        rec["val_loss_by_source"] = by_source
    if run.average is not None and run.average.count:
        with run.average.swapped_in(run.model):
            rec["val_loss_avg"] = estimate_val_loss(run, whole)[0]
    log_eval(run, rec)
    return val_loss


@torch.no_grad()
def estimate_val_loss(run, whole=False, model=None):
    """(the mixing-weighted total, {source: val loss}): per source, the mean token loss over the
    first eval_iters * batch_size rows of its val split, or with whole=True over every window of it
    once (DataLoader.sweep). Each of W ranks reads its own rows of eval_iters / W global batches
    (rounded up), so when W divides eval_iters every world size reads the same rows. model: another
    model to score on the same rows. The model runs as it is, not compiled: a no_grad graph of the
    compiled train_model would be a second compile (~40 s on a CPU) for a few forward passes."""
    rt = run.rt
    loss_fn = (lambda x, y: model(x, y)[1]) if model is not None else \
        run.eval_loss(run) if run.eval_loss else (lambda x, y: run.model(x, y)[1])
    model = run.model if model is None else model
    model.eval()
    by_source = {}
    for name, (loader, _) in run.val_loaders.items():
        loader.reset()
        iters = -(-run.cfg.eval_iters // loader.world_size)
        batches = loader.sweep() if whole else (loader.next_batch() for _ in range(iters))
        total = -(-len(loader.windows[0][0]) // (loader.B * loader.world_size)) if whole else iters
        # a long whole-split evaluation shows progress
        progress = Progress(rt, name, total) if whole else None
        with run.autocast:
            sums = token_loss_sums(loss_fn, batches, rt.device, progress)
        rt.all_reduce_(sums)
        by_source[name] = (sums[0] / sums[1]).item()
    model.train()
    return sum(w * by_source[n] for n, (_, w) in run.val_loaders.items()), by_source


class Progress:
    """A line every EVAL_PROGRESS_S seconds of a whole-split evaluation: the batch, of how many,
    time left."""

    def __init__(self, rt, name, total):
        self.rt, self.name, self.total, self.t0 = rt, name, total, time.time()
        self.last = self.t0

    def __call__(self, i):
        if i and time.time() - self.last >= EVAL_PROGRESS_S:
            self.last = time.time()
            left = (self.last - self.t0) * (self.total - i) / i
            self.rt.log(f"  evaluating {self.name}: batch {i} of {self.total}, {left:.0f}s left")


def token_loss_sums(loss_fn, batches, device, every=None):
    """(sum over batches of loss * targets, targets) as a 2-element tensor, no host read: loss_fn(x,
    y) is the mean loss over the targets of y that are not -1 (a whole-split sweep pads its last
    rows with -1; an all-padding batch adds 0). every(i): called before batch i, e.g. to print
    progress. The caller divides (after summing the tensor over the ranks, if several share the
    batches)."""
    sums = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(batches):
        if every is not None:
            every(i)
        x, y = x.to(device), y.to(device)
        n = (y != -1).sum()
        loss = loss_fn(x, y).float()
        sums += torch.stack([torch.where(n > 0, loss * n, 0.0), n.float()])
    return sums


def whole_val_loss(model, shard_dir, batch_size=16, device="cpu"):
    """A model's mean next-token loss over every val window of shard_dir once
    (data.DataLoader.sweep), the number train.py's final evaluation prints and the lab scores.
    Returns (loss, tokens)."""
    loader = data.DataLoader(shard_dir, "val", batch_size, model.config.block_size,
                             order="sequential")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        sums = token_loss_sums(lambda x, y: model(x, y)[1], loader.sweep(), device)
    model.train(was_training)
    total, n = sums.tolist()
    if n == 0:
        raise ValueError(f"{shard_dir}: no val window of {model.config.block_size + 1} tokens")
    return total / n, int(n)


def log_eval(run, rec):
    parts = [f"step {rec['step']}: val loss {rec['val_loss']:.4f}"]
    if "val_loss_by_source" in rec:
        parts.append("(" + ", ".join(f"{n} {v:.4f}" for n,
                                     v in rec["val_loss_by_source"].items()) + ")")
    if rec["whole_val"]:
        parts.append("over the whole val split")
    if "val_loss_avg" in rec:
        parts.append(f"; average of {run.average.count} checkpoints {rec['val_loss_avg']:.4f}")
    run.rt.log(" ".join(parts).replace(" ;", ";"))
    log_record(run, rec)


def log_step(run, step, out, skipped_steps, skipped_in_a_row, timer):
    """The step's log line and metrics.jsonl record: the loss, lr, lambda, the clipping statistics
    under their names in zclip.py (raw_norm, clipped_norm, was_clipped, z_score), speed, and what
    the loss and the callbacks added (stage 3's loss terms, QK-clip's max_logit, the DLM's outlier
    ratios)."""
    lam = out["lam"]
    if not out["ok"]:
        scaled = f", float16 loss scale {out['loss_scale']:g} halved" if "loss_scale" in out else ""
        if out.get("backoff"):
            scaled += " (overflow at a finite loss: the scale backing off, not counted in a row)"
        run.rt.log(f"step {step} | skipped: loss {out['loss']} grad norm {out['raw_norm']} not "
                   f"finite, no update{scaled} ({skipped_in_a_row} in a row, {skipped_steps} in all; "
                   f"max_bad_steps={run.cfg.max_bad_steps})")
        log_record(run,
                   {"step": step, "skipped": 1, "loss": None, "lambda": lam,
                    "bad_steps": skipped_steps})
        return
    dt = timer.lap()
    tokens = run.cfg.batch_size * run.cfg.block_size * run.cfg.grad_accum
    extra = {k: v for k, v in out.items() if k not in ("loss", "stop", "ok", "lam", "lr", "backoff")}
    rec = {"step": step, "loss": out["loss"], "lr": out["lr"], "lambda": lam, **extra,
           "ms": 1000 * dt, "tok_per_s": tokens / dt, "bad_steps": skipped_steps}
    clip = {"raw_norm", "clipped_norm", "was_clipped", "z_score"}
    if "was_clipped" in rec:
        rec["was_clipped"] = int(rec["was_clipped"])
    line = f"grad norm {rec['raw_norm']:.3f} -> {rec['clipped_norm']:.3f}"
    if "z_score" in rec:
        line += f" (clipped {rec['was_clipped']}, z {rec['z_score']:.2f})"
    run.rt.log(f"step {step} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | lambda {lam:.2f} | "
               f"{line} | {rec['ms']:.0f} ms | {rec['tok_per_s']:.0f} tok/s" +
               "".join(f" | {k} {v:.4f}" for k, v in extra.items() if k not in clip))
    log_record(run, rec)


def log_final(run, step, val_loss, skipped_steps, lam, ternary_from):
    """The run's last line: its final val loss, and a warning when lambda (lam, at step) never
    reached 1 (it does at step ternary_from): the model is still part full precision, so it is not
    the ternary model it is meant to be, and stage 3 and the packed export cannot take it as it is."""
    skipped = f", {skipped_steps} of them skipped as non-finite" if skipped_steps else ""
    warn = "" if lam >= 1.0 else (
        f"; WARNING: lambda only reached {lam:.2f}, so the model is not ternary yet (lambda is 1 from "
        f"step {ternary_from}): continue with --resume=True --max_iters={ternary_from} or more, or start "
        "a new run with a shorter --lambda_warmup_steps; stage 3 and the packed export need lambda 1")
    run.rt.log(f"final val loss {val_loss:.4f} ({stage_dir(run.cfg.stage)}, {step} steps{skipped}); "
               f"checkpoint {run.ckpt_path}" + warn)


def drop_torn_line(path):
    """Cut a torn last line (a process killed mid-write leaves one) off a metrics.jsonl, so that the
    next record appended is a line of its own; whether there was one."""
    if not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        text = f.read()
    if not text or text.endswith(b"\n"):
        return False
    with open(path, "r+b") as f:
        f.truncate(text.rfind(b"\n") + 1)
    return True


def log_record(run, rec):
    """Append rec to <out_dir>/metrics.jsonl (rank 0). The first record this process writes also
    names the commit of the code that wrote it (runtime.git_commit: git rev-parse HEAD, -dirty
    after it when a tracked file differs, or "unknown"), a resumed run's too; before it, a torn last line a killed run left is cut off. An
    append that fails (a full disk) stops the run in one line; a metrics.jsonl it left empty is
    removed (it would hold nothing, yet make the next run ask for --overwrite=True)."""
    path = os.path.join(run.out_dir, "metrics.jsonl")
    if run.records == 0:
        rec = {**rec, "commit": run.commit}
        if run.rt.master and drop_torn_line(path):
            run.rt.log(f"cut the torn last line (a killed run's) off {path} before appending")
    run.records += 1
    try:
        run.rt.log_json(run.out_dir, rec)
    except OSError as e:
        with contextlib.suppress(OSError):
            if os.path.getsize(path) == 0:
                os.remove(path)
        why, cause, fix = atomic.write_failed(e, path)
        die(f"cannot append to {path}: {why}; {cause}; the checkpoints written so far are kept; {fix}, "
            f"then continue with --resume=True (or start again if none was written)")
