"""
ZClip: z-score adaptive gradient clipping.

A fixed max-norm clip is too loose early in training and too tight later. ZClip keeps an exponential
moving average (EMA) of the global gradient norm and of its variance; a step whose norm is an outlier
(z-score above a threshold) is a spike, and its gradients are scaled down to a threshold derived from
those running statistics. Ordinary steps pass through untouched.

Source: "ZClip: Adaptive Spike Mitigation for LLM Pre-Training", arXiv 2504.02507; reference
implementation github.com/bluorion-com/ZClip (zclip/zclip.py). Formulas as pinned in REFERENCE.md §4:

    g = || all gradients ||_2                        global L2 norm, fp32
    warmup: the first N = warmup_steps norms are only collected (no z-clipping). At call N:
        mu = mean(norms), var = mean((norms - mu)^2)  (population variance); first decision at call N+1
    decision: sigma = sqrt(var), z = (g - mu) / (sigma + eps)
        mode="zscore":     spike if z > z_thresh
            clip_option="adaptive_scaling":  T = clip_factor * (mu + z_thresh^2 * sigma / z)
            clip_option="mean":              T = mu
        mode="percentile": spike if g > mu + z_thresh * sigma, T = mu + z_thresh * sigma
        effective = T on a spike, else g; if max_grad_norm is set, effective = min(effective, max_grad_norm)
        (the max_grad_norm hard clip also applies during warmup)
        if g > effective: every gradient *= effective / (g + 1e-6)
    update, after clipping, with x = T on a spike, else g:
        mu  <- alpha * mu  + (1 - alpha) * x
        var <- alpha * var + (1 - alpha) * (x - mu)^2     (mu is the already-updated mean)
    worked example: mu = 1, var = 0.25, z_thresh = 2, g = 3 gives z = 2 / 0.500001 ~ 3.999992,
        T = 1 + 4 * 0.5 / z ~ 1.500001, gradients rescaled to norm ~ 1.5; then mu = 1.015, var ~ 0.2495568.

Non-finite g (NaN/inf): gradients are left untouched and mu/var are not updated; the training loop is
expected to skip that optimizer step. A non-finite norm collected during warmup is left out of the
initial mean/variance.

Distributed: under DDP every rank holds the whole all-reduced gradients, so the local norm is the global one.
Under FSDP2 the gradients are DTensors sharded by rows: clip() works on the local shards, and g is
sqrt(all_reduce_sum(||local shards||^2)) over the mesh's process group, the same g on every rank.

No host synchronisation: mu and var are 0-d fp32 tensors on the gradients' device, every decision is a
torch.where, and the gradients are always multiplied by one 0-d factor in a single _foreach_mul_. When
nothing is clipped the factor is exactly 1.0, and x * 1.0 == x bitwise in IEEE arithmetic, so the
no-clip path needs no branch. The only Python state that changes is the warmup count, which depends on
the number of calls alone and stops changing after warmup (a compiled clip() does not recompile).
clip() returns a dict of 0-d tensors; reading them when logging (float(stats["raw_norm"])) is the one
host read per step.

Usage:
    zclip = ZClip()                     # or ZClip(**SEED_VARIANT), or ZClip(max_grad_norm=1.0)
    loss.backward()
    stats = zclip.clip(model)           # between backward() and optimizer.step()
    optimizer.step()
    ckpt["zclip"] = zclip.state_dict()  # resume: zclip.load_state_dict(ckpt["zclip"])

Test: python -m pytest tests/test_zclip.py        Demo: python zclip.py
"""
import torch

MODES = ("zscore", "percentile")
CLIP_OPTIONS = ("adaptive_scaling", "mean")
# what the EMA sees on a spike: "threshold" = T (paper, reference default), "raw" = g (the seed's
# variant), "skip" = no update (the reference's skip_update_on_spike=True)
SPIKE_UPDATES = ("threshold", "raw", "skip")
# The seed's variant (REFERENCE §4): EMA decay 0.99, clip to mu + 3 sigma, EMA fed with the raw norm.
# It had no warmup; warmup_steps=1 (mu = first norm, var = 0) is the closest form.
SEED_VARIANT = dict(alpha=0.99, z_thresh=3.0, warmup_steps=1, mode="percentile", spike_update="raw")
CONFIG_KEYS = ("alpha", "z_thresh", "warmup_steps", "eps", "mode", "clip_option", "clip_factor",
               "max_grad_norm", "spike_update")


class ZClip:
    def __init__(self, alpha=0.97, z_thresh=2.5, warmup_steps=25, eps=1e-6, mode="zscore",
                 clip_option="adaptive_scaling", clip_factor=1.0, max_grad_norm=None,
                 spike_update="threshold"):
        self.alpha = alpha                  # EMA decay of mu and var
        self.z_thresh = z_thresh            # z-score above which a norm is a spike
        self.warmup_steps = warmup_steps    # norms collected before mu, var are initialised
        self.eps = eps                      # keeps z finite when var = 0
        self.mode = mode                    # "zscore" or "percentile"
        self.clip_option = clip_option      # zscore mode: "adaptive_scaling" or "mean"; ignored in percentile
        self.clip_factor = clip_factor      # scales T in adaptive_scaling (< 1 clips harder)
        self.max_grad_norm = max_grad_norm  # None = pure ZClip; a float also hard-clips every step
        self.spike_update = spike_update    # what feeds the EMA on a spike, see SPIKE_UPDATES
        self._check_config()
        self.n_seen = 0                     # norms collected toward warmup; saturates at warmup_steps
        self.mean = torch.zeros(())         # mu, 0-d fp32
        self.var = torch.zeros(())          # sigma^2, 0-d fp32
        self.warmup_norms = torch.zeros(warmup_steps)

    def _check_config(self):
        for name, value, valid in (("mode", self.mode, MODES), ("clip_option", self.clip_option, CLIP_OPTIONS),
                                   ("spike_update", self.spike_update, SPIKE_UPDATES)):
            if value not in valid:
                raise ValueError(f"ZClip: {name}={value!r} is not valid; expected one of {valid}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 1):
            raise ValueError(f"ZClip: warmup_steps={self.warmup_steps!r}; expected an int >= 1")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"ZClip: alpha={self.alpha!r}; expected 0 <= alpha < 1")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"ZClip: max_grad_norm={self.max_grad_norm!r}; expected None or a positive float")

    @property
    def initialized(self):
        return self.n_seen >= self.warmup_steps

    def to(self, device):
        self.mean, self.var, self.warmup_norms = (t.to(device=device, dtype=torch.float32)
                                                  for t in (self.mean, self.var, self.warmup_norms))
        return self

    def _total_norm(self, grads, group=None):
        # Assumes all grads share one device (the state lives there). group: the process group over which
        # the grads are sharded (FSDP2); the global norm is then the root of the summed squared shard norms.
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)  # one fused kernel, fp32 accumulation
        total = torch.linalg.vector_norm(torch.stack(norms))
        if group is None:
            return total
        sq = total.square()
        torch.distributed.all_reduce(sq, group=group)
        return sq.sqrt()

    @staticmethod
    def _local_shards(grads):
        """(tensors to clip in place, process group or None): FSDP2 DTensor grads -> their local shards."""
        sharded = [g for g in grads if hasattr(g, "to_local")]
        if not sharded:
            return grads, None
        mesh = sharded[0].device_mesh
        if len(sharded) != len(grads) or mesh.ndim != 1 or not all(
                pl.is_shard() for g in sharded for pl in g.placements) or any(g.device_mesh != mesh for g in sharded):
            raise ValueError("ZClip: expected all gradients sharded (Shard placements) on one 1-D device mesh, "
                             "as FSDP2's fully_shard makes them")
        return [g.to_local() for g in grads], mesh.get_group()

    def _init_stats(self):
        x = self.warmup_norms
        ok = torch.isfinite(x)  # a NaN/inf warmup norm must not poison mu/var
        n = ok.sum().clamp(min=1)
        x = torch.where(ok, x, torch.zeros_like(x))
        self.mean = x.sum() / n
        self.var = torch.where(ok, (x - self.mean) ** 2, torch.zeros_like(x)).sum() / n

    @torch.no_grad()
    def clip(self, params):
        """Clip the gradients of `params` (an nn.Module or an iterable of tensors) in place.
        Returns 0-d tensors: raw_norm, clipped_norm, was_clipped (0./1.), z_score, and ema_mean, ema_var
        after this call's update."""
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            raise ValueError("ZClip.clip: no parameter has a .grad; call it after loss.backward()")
        grads, group = self._local_shards(grads)  # in-place ops on a shard change the DTensor gradient
        if self.mean.device != grads[0].device:
            self.to(grads[0].device)  # e.g. after load_state_dict of a CPU checkpoint
        g = self._total_norm(grads, group)  # ()
        finite = torch.isfinite(g)
        decide = self.initialized  # depends on the call count only, never on data
        if not decide:
            self.warmup_norms[self.n_seen] = g
            self.n_seen += 1
            if self.initialized:
                self._init_stats()
            z = torch.zeros_like(g)
            target = g  # no z-clipping during warmup; max_grad_norm still applies below
        else:
            mu, var = self.mean, self.var
            std = var.sqrt()
            z = (g - mu) / (std + self.eps)
            if self.mode == "zscore":
                spike = z > self.z_thresh
                if self.clip_option == "adaptive_scaling":
                    z_safe = torch.where(spike, z, torch.ones_like(z))  # the unused branch must not divide by 0
                    T = self.clip_factor * (mu + self.z_thresh ** 2 * std / z_safe)
                else:
                    T = mu
            else:
                T = mu + self.z_thresh * std
                spike = g > T
            spike = spike & finite
            target = torch.where(spike, T, g)
        effective = target if self.max_grad_norm is None else torch.clamp(target, max=self.max_grad_norm)
        clipped = finite & (g > effective)
        factor = torch.where(clipped, effective / (g + 1e-6), torch.ones_like(g))
        torch._foreach_mul_(grads, factor)  # factor == 1.0 exactly when not clipped: grads bitwise unchanged
        if decide:
            x = target if self.spike_update == "threshold" else g  # x = T on a spike, else g
            new_mean = self.alpha * mu + (1 - self.alpha) * x
            new_var = self.alpha * var + (1 - self.alpha) * (x - new_mean) ** 2  # uses the updated mean
            keep = ~finite | spike if self.spike_update == "skip" else ~finite
            self.mean = torch.where(keep, mu, new_mean)
            self.var = torch.where(keep, var, new_var)
        return dict(raw_norm=g, clipped_norm=g * factor, was_clipped=clipped.float(), z_score=z,
                    ema_mean=self.mean, ema_var=self.var)

    def state_dict(self):
        sd = {k: getattr(self, k) for k in CONFIG_KEYS}
        sd.update(n_seen=self.n_seen, mean=self.mean.clone(), var=self.var.clone(),
                  warmup_norms=self.warmup_norms.clone())
        return sd

    def load_state_dict(self, sd):
        """Restores statistics, warmup progress and config (the saved config replaces the constructor's).
        Tensors stay where they were loaded and move to the gradients' device at the next clip()."""
        missing = [k for k in CONFIG_KEYS + ("n_seen", "mean", "var", "warmup_norms") if k not in sd]
        if missing:
            raise KeyError(f"ZClip.load_state_dict: missing keys {missing}; expected a ZClip.state_dict()")
        for k in CONFIG_KEYS:
            setattr(self, k, sd[k])
        self._check_config()
        self.n_seen = int(sd["n_seen"])
        self.mean, self.var = sd["mean"].float().clone(), sd["var"].float().clone()
        self.warmup_norms = sd["warmup_norms"].float().clone()


if __name__ == "__main__":
    # a synthetic run: 30 steps of norm ~1.0 (warmup 25), then a spike of 10, then back to ~1.0
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(1000))
    norms = [1.0 + 0.05 * torch.randn(()).item() for _ in range(30)] + [10.0, 1.02, 0.98]
    zclip = ZClip()
    for step, n in enumerate(norms):
        mu, sigma = float(zclip.mean), float(zclip.var) ** 0.5  # the statistics this step is judged by
        grad = torch.randn(1000)
        p.grad = grad * (n / grad.norm())
        s = zclip.clip([p])
        if step >= 24:
            print(f"step {step:2d}  raw {s['raw_norm']:.4f}  clipped {s['clipped_norm']:.4f}  "
                  f"z {s['z_score']:7.2f}  clipped? {bool(s['was_clipped'])}  "
                  f"mu {s['ema_mean']:.4f}  var {s['ema_var']:.6f}")
        if s["was_clipped"]:
            z = float(s["z_score"])
            print(f"  check: T = mu + z_thresh^2 * sigma / z = {mu:.4f} + 6.25 * {sigma:.4f} / {z:.2f} "
                  f"= {mu + 6.25 * sigma / z:.4f}")
    print("expected: only step 30 (raw norm 10) is clipped, to the T printed under it; warmup ends at step 24")
