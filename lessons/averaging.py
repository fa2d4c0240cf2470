"""
Checkpoint averaging: the final model is a weighted average of the last k checkpoints instead of (or
as well as) the weights the learning-rate decay ends on.

Luo et al., "How Learning Rate Decay Wastes Your Best Data in Curriculum-Based LLM Pretraining"
(arXiv 2511.18903, section 4): with an easy-to-hard curriculum the hardest (best) data arrives last,
exactly when a decaying LR gives it the least weight; keeping the LR constant (or decaying it only
moderately) and averaging the last checkpoints gives the late data its full step size and still
removes the noise that the decay would have removed. Their main method is an exponential moving
average over the last 6 checkpoints, alpha = 0.2 (they report simple and weighted moving averages
within noise of it). With snapshots theta_1 .. theta_k taken every `interval` steps up to the last
step (theta_k = the final weights):

    avg_1 = theta_1,  avg_i = alpha * theta_i + (1 - alpha) * avg_{i-1}   (alpha 0: the plain mean)

so theta_i weighs alpha (1 - alpha)^(k-i) for i >= 2 and theta_1 (1 - alpha)^(k-1): for k = 6,
alpha = 0.2, 0.33, 0.08, 0.10, 0.13, 0.16, 0.20. One buffer the size of the model holds the running
average, whatever k. A ternary model averages its latent (full-precision) weights; the forward pass
then quantises the average, as it quantises any weights (absmean per tensor), so the averaged model
is ternary too.

train.py: --avg_checkpoints=6 --avg_alpha=0.2 (--avg_interval=0: a snapshot every decay_frac *
max_iters / k steps, the k of them within the window a WSD decay would use); it evaluates the average beside the raw weights and saves it as
<run>/avg.pt, which sample.py and tools/export.py load like any checkpoint
(--ckpt=out/stage2/avg.pt).
Test: python -m pytest tests/test_averaging.py
"""

import contextlib

import torch


class CheckpointAverage:
    """The running average of snapshots taken at steps last - (k-1) * interval, ..., last -
    interval, last."""

    def __init__(self, k=6, interval=20, alpha=0.2, last_step=0, model=None):
        if k < 1 or interval < 1 or not 0 <= alpha <= 1:
            raise ValueError(f"need k >= 1, interval >= 1 and alpha in [0, 1]; got {k}, "
                             f"{interval}, {alpha}")
        self.k, self.interval, self.alpha, self.last_step = k, interval, alpha, last_step
        self.model = model  # the model train.py's callbacks snapshot (watch / after_step)
        self.avg = None   # {name: tensor}, fp32, on the model's device
        self.count = 0    # snapshots averaged so far

    def steps(self):
        """The steps whose weights are averaged (those >= 1)."""
        first = self.last_step - (self.k - 1) * self.interval
        return [s for s in range(first, self.last_step + 1, self.interval) if s >= 1]

    @torch.no_grad()
    def update(self, model, step):
        """Call after step `step` (the weights are those of `step` steps); a snapshot step joins the
        average."""
        if step not in self.steps():
            return
        params = {n: p.detach().float() for n, p in model.named_parameters()}
        if self.avg is None:
            self.avg = {n: p.clone() for n, p in params.items()}
        else:
            w = self.alpha if self.alpha > 0 else 1.0 / (self.count + 1)  # EMA, or the running mean
            for n, p in params.items():
                self.avg[n].lerp_(p, w)  # avg += w * (p - avg)
        self.count += 1

    # train.py's step callbacks (tools/seams.py attaches the average with its model)
    def watch(self):
        return {}  # nothing to log per step

    def after_step(self, step, ok):
        # a skipped step leaves the weights as they were: still a snapshot
        self.update(self.model, step)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self, model):
        """Within the block, the model holds the averaged weights; its own weights come back
        afterwards."""
        params = dict(model.named_parameters())
        saved = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.copy_(self.avg[n])
        try:
            yield model
        finally:
            for n, p in params.items():
                p.copy_(saved[n])

    def state_dict(self):
        avg = None if self.avg is None else {n: t.cpu() for n, t in self.avg.items()}
        return {"count": self.count, "avg": avg}

    def load_state_dict(self, sd, device="cpu"):
        self.count = int(sd["count"])
        self.avg = None if sd["avg"] is None else {n: t.to(device) for n, t in sd["avg"].items()}
