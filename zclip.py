"""
ZClip: z-score adaptive gradient clipping.

A fixed max-norm clip is too loose early in training and too tight later. ZClip keeps an exponential
moving average (EMA) of the global gradient norm and of its variance; a step whose norm is an outlier
(z-score above a threshold) is a spike, and its gradients are scaled down to a threshold derived from
those running statistics. Ordinary steps pass through untouched.

Source: Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM Pre-Training", arXiv 2504.02507, and its
reference implementation github.com/bluorion-com/ZClip (zclip/zclip.py). The default algorithm:

    g = || all gradients ||_2 (fp32);  mu, var = mean, population variance of the first warmup_steps norms
    z = (g - mu) / (sqrt(var) + eps);  a spike if z > z_thresh
    T = clip_factor * (mu + z_thresh^2 * sqrt(var) / z)          (the further out the spike, the closer to mu)
    on a spike, if g > T: every gradient *= T / (g + 1e-6)
    mu  <- alpha * mu  + (1 - alpha) * x;  var <- alpha * var + (1 - alpha) * (x - mu)^2   (x = T on a spike, else g)
    worked example: mu = 1, var = 0.25, z_thresh = 2, g = 3: z ~ 3.999992, T ~ 1.500001; then mu = 1.015,
        var ~ 0.2495568

The other modes and options, NaN/inf norms, dtypes, no host sync, FSDP2, and where we depart from the reference:
docs/zclip.md. Usage (save zclip.state_dict() in the checkpoint, or a resumed run starts a new warmup):
    zclip = ZClip()                     # or ZClip(**PERCENTILE_RAW_EMA), or ZClip(max_grad_norm=1.0)
    loss.backward()                     # with a torch.amp.GradScaler, scaler.unscale_(optimizer) next
    stats = zclip.clip(model)           # between backward() and optimizer.step()
    optimizer.step()

Test: python -m pytest tests/test_zclip.py        Demo: python zclip.py
"""
import torch

# -----------------------------------------------------------------------------
# the algorithm, one step per function: g, z, (spike, T), the EMA update, the in-place scaling (the reference's
# _compute_grad_norm, _compute_positive_zscore, _compute_clip_val, _update_ema, _apply_clipping)


def total_norm(grads):
    """g = || all gradients ||_2 as a 0-d fp32 tensor; one fused _foreach_norm per accumulation
    dtype."""
    norms = [n.float() for dtype, group in _by_compute_dtype(grads).items()
             for n in torch._foreach_norm(group, 2.0, dtype=dtype)]
    return torch.linalg.vector_norm(torch.stack(norms))


def z_score(g, mean, var, eps):
    """z = (g - mu) / (sigma + eps): how many standard deviations g lies above the running mean."""
    return (g - mean) / (var.sqrt() + eps)


def clip_threshold(g, z, mean, var, z_thresh, mode="zscore", clip_option="adaptive_scaling",
                   clip_factor=1.0):
    """(spike, T): whether g is a spike (0-d bool), and the norm T a spike is scaled down to."""
    std = var.sqrt()
    if mode == "percentile":  # a fixed number of standard deviations above the mean
        T = mean + z_thresh * std
        return g > T, T
    spike = z > z_thresh
    if clip_option == "mean":
        return spike, mean
    z = torch.where(spike, z, torch.ones_like(z))  # T is used only on a spike; elsewhere z may be 0
    # the further out the spike, the closer T gets to mu (the reference's mu + z_thresh * sigma / (z / z_thresh))
    return spike, clip_factor * (mean + z_thresh ** 2 * std / z)


def update_ema(mean, var, x, alpha):
    """One EMA step of the norm's mean and variance toward x (T on a spike, else g)."""
    mean = alpha * mean + (1 - alpha) * x
    var = alpha * var + (1 - alpha) * (x - mean) ** 2  # the updated mean, as the reference does
    return mean, var


def warmup_stats(norms):
    """(mu, var): mean and population variance of the finite warmup norms (a NaN/inf one would
    poison both)."""
    ok = torch.isfinite(norms)
    n = ok.sum().clamp(min=1)
    x = torch.where(ok, norms, torch.zeros_like(norms))
    mean = x.sum() / n
    return mean, torch.where(ok, (x - mean) ** 2, torch.zeros_like(x)).sum() / n


def scale_(grads, factor):
    """grads *= factor in place, the 0-d fp32 factor cast to each group's compute dtype (exactly,
    fp32 -> fp64)."""
    for dtype, group in _by_compute_dtype(grads).items():
        torch._foreach_mul_(group, factor.to(dtype))


def _by_compute_dtype(tensors):
    """{dtype: tensors}: grouped by the dtype their arithmetic runs in, the wider of fp32 and their own
    (bf16, fp16, fp32 -> fp32; fp64 -> fp64). torch refuses to accumulate an fp64 norm in fp32."""
    groups = {}
    for t in tensors:
        groups.setdefault(torch.promote_types(t.dtype, torch.float32), []).append(t)
    return groups


# -----------------------------------------------------------------------------
# ZClip: the statistics between calls, warmup, and the options

MODES = ("zscore", "percentile")
CLIP_OPTIONS = ("adaptive_scaling", "mean")
# what the EMA sees on a spike: "threshold" = T (paper, reference default), "raw" = g (as in
# PERCENTILE_RAW_EMA), "skip" = no update (the reference's skip_update_on_spike=True)
SPIKE_UPDATES = ("threshold", "raw", "skip")
# Not the paper's default: the variant an earlier codebase used (EMA decay 0.99, clip to mu + 3 sigma, EMA fed
# with the raw norm, no warmup; warmup_steps=1, i.e. mu = first norm and var = 0, is the closest form).
PERCENTILE_RAW_EMA = dict(alpha=0.99, z_thresh=3.0, warmup_steps=1, mode="percentile",
                          spike_update="raw")
CONFIG_KEYS = ("alpha", "z_thresh", "warmup_steps", "eps", "mode", "clip_option", "clip_factor",
               "max_grad_norm", "spike_update")


class ZClip:
    """The statistics between calls (mu, var, the warmup norms) and the options. Not an optimizer: save
    state_dict() next to the optimizer's, or a resumed run starts a new warmup and z-clips no spike for
    warmup_steps steps."""

    def __init__(self, alpha=0.97, z_thresh=2.5, warmup_steps=25, eps=1e-6, mode="zscore",
                 clip_option="adaptive_scaling", clip_factor=1.0, max_grad_norm=None,
                 spike_update="threshold"):
        self.alpha = alpha                  # EMA decay of mu and var
        self.z_thresh = z_thresh            # z-score above which a norm is a spike
        self.warmup_steps = warmup_steps    # norms collected before mu, var are initialised
        self.eps = eps                      # keeps z finite when var = 0
        self.mode = mode                    # "zscore" or "percentile"
        self.clip_option = clip_option      # zscore: "adaptive_scaling" or "mean" (else unused)
        self.clip_factor = clip_factor      # scales T in adaptive_scaling (< 1 clips harder)
        # None = pure ZClip (the reference defaults to 1.0); a float also hard-clips every step,
        # warmup included
        self.max_grad_norm = max_grad_norm
        self.spike_update = spike_update    # what feeds the EMA on a spike, see SPIKE_UPDATES
        self._check_config()
        self.n_seen = 0                     # norms collected toward warmup; stops at warmup_steps
        self.mean = torch.zeros(())         # mu, 0-d fp32
        self.var = torch.zeros(())          # sigma^2, 0-d fp32
        self.warmup_norms = torch.zeros(warmup_steps)

    @property
    def initialized(self):
        return self.n_seen >= self.warmup_steps

    @torch.no_grad()
    def clip(self, params):
        """Clip the gradients of `params` (an nn.Module or an iterable of tensors) in place.
        Returns 0-d tensors: raw_norm, clipped_norm, was_clipped (0./1.), z_score, and ema_mean, ema_var
        after this call's update. A non-finite g (NaN/inf) leaves the gradients, mu and var untouched (ours,
        not the reference's): the training loop should skip that optimizer step. No host sync: every decision
        is a torch.where, and the factor is exactly 1.0 when nothing is clipped (x * 1.0 == x bitwise)."""
        params = params.parameters() if isinstance(params, torch.nn.Module) else params
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            raise ValueError("ZClip.clip: no parameter has a .grad; call it after loss.backward()")
        grads, group = _local_shards(grads)  # FSDP2 only: see the section at the bottom of the file
        g = _norm_over_ranks(total_norm(grads), group)  # ()
        if self.mean.device != g.device:
            self.to(g.device)  # e.g. after load_state_dict of a CPU checkpoint
        finite = torch.isfinite(g)
        decide = self.initialized  # depends on the call count only, never on data
        if decide:
            z = z_score(g, self.mean, self.var, self.eps)
            spike, T = clip_threshold(g, z, self.mean, self.var, self.z_thresh, self.mode,
                                      self.clip_option, self.clip_factor)
            spike = spike & finite
            target = torch.where(spike, T, g)
        else:
            z, target = self._collect_warmup(g)
        effective = (target if self.max_grad_norm is None
                     else torch.clamp(target, max=self.max_grad_norm))
        clipped = finite & (g > effective)
        factor = torch.where(clipped, effective / (g + 1e-6), torch.ones_like(g))
        scale_(grads, factor)  # factor == 1.0 exactly when not clipped: grads bitwise unchanged
        if decide:
            x = target if self.spike_update == "threshold" else g  # x = T on a spike, else g
            mean, var = update_ema(self.mean, self.var, x, self.alpha)
            keep = ~finite | spike if self.spike_update == "skip" else ~finite
            self.mean = torch.where(keep, self.mean, mean)
            self.var = torch.where(keep, self.var, var)
        return dict(raw_norm=g, clipped_norm=g * factor, was_clipped=clipped.float(), z_score=z,
                    ema_mean=self.mean, ema_var=self.var)

    def _collect_warmup(self, g):
        """Store g; at the last warmup call set mu, var. Returns (z, target) = (0, g): no z-clipping
        yet."""
        self.warmup_norms[self.n_seen] = g
        self.n_seen += 1
        if self.initialized:
            self.mean, self.var = warmup_stats(self.warmup_norms)
        return torch.zeros_like(g), g

    def to(self, device):
        self.mean, self.var, self.warmup_norms = (t.to(device=device, dtype=torch.float32)
                                                  for t in (self.mean, self.var, self.warmup_norms))
        return self

    def state_dict(self):
        sd = {k: getattr(self, k) for k in CONFIG_KEYS}
        sd.update(n_seen=self.n_seen, mean=self.mean.clone(), var=self.var.clone(),
                  warmup_norms=self.warmup_norms.clone())
        return sd

    def load_state_dict(self, sd):
        """Restores statistics, warmup progress and config (the saved config replaces the constructor's).
        Tensors stay where they were loaded and move to the gradients' device at the next clip()."""
        missing = [k for k in CONFIG_KEYS + ("n_seen", "mean", "var", "warmup_norms")
                   if k not in sd]
        if missing:
            raise KeyError(f"ZClip.load_state_dict: missing keys {missing}; "
                           "expected a ZClip.state_dict()")
        for k in CONFIG_KEYS:
            setattr(self, k, sd[k])
        self._check_config()
        self.n_seen = int(sd["n_seen"])
        self.mean, self.var = sd["mean"].float().clone(), sd["var"].float().clone()
        self.warmup_norms = sd["warmup_norms"].float().clone()

    def _check_config(self):
        for name, value, valid in (("mode", self.mode, MODES),
                                   ("clip_option", self.clip_option, CLIP_OPTIONS),
                                   ("spike_update", self.spike_update, SPIKE_UPDATES)):
            if value not in valid:
                raise ValueError(f"ZClip: {name}={value!r} is not valid; expected one of {valid}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 1):
            raise ValueError(f"ZClip: warmup_steps={self.warmup_steps!r}; expected an int >= 1")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"ZClip: alpha={self.alpha!r}; expected 0 <= alpha < 1")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"ZClip: max_grad_norm={self.max_grad_norm!r}; "
                             "expected None or a positive float")


# -----------------------------------------------------------------------------
# FSDP2 plumbing, kept apart so the algorithm above reads as on one device: under FSDP2 each rank holds a
# row-shard of every gradient (a DTensor), so g needs the other ranks' shards and the scaling acts on our own.
# (Under DDP every rank holds the whole all-reduced gradients: the local norm is the global one, nothing to do.)


def _local_shards(grads):
    """(tensors to scale in place, process group or None): FSDP2 DTensor grads -> their local shards (scaling
    a local shard in place scales the DTensor gradient); any other grads -> themselves and None."""
    sharded = [g for g in grads if hasattr(g, "to_local")]
    if not sharded:
        return grads, None
    mesh = sharded[0].device_mesh
    all_shards = all(pl.is_shard() for g in sharded for pl in g.placements)
    one_mesh = all(g.device_mesh == mesh for g in sharded)
    if len(sharded) != len(grads) or mesh.ndim != 1 or not all_shards or not one_mesh:
        raise ValueError("ZClip: expected all gradients sharded (Shard placements) on one 1-D "
                         "device mesh, as FSDP2's fully_shard makes them")
    return [g.to_local() for g in grads], mesh.get_group()


def _norm_over_ranks(norm, group):
    """sqrt(sum over the ranks of norm^2), the norm of the whole gradient from each rank's local-shard norm;
    `norm` itself when group is None (every rank holds the whole gradient)."""
    if group is None:
        return norm
    sq = norm.square()
    torch.distributed.all_reduce(sq, group=group)
    return sq.sqrt()


if __name__ == "__main__":
    # a synthetic run: 30 steps of norm ~1.0 (warmup 25), then a spike of 10, then back to ~1.0
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(1000))
    norms = [1.0 + 0.05 * torch.randn(()).item() for _ in range(30)] + [10.0, 1.02, 0.98]
    zclip = ZClip()
    for step, n in enumerate(norms):
        mu, sigma = float(zclip.mean), float(zclip.var) ** 0.5  # what this step is judged by
        grad = torch.randn(1000)
        p.grad = grad * (n / grad.norm())
        s = zclip.clip([p])
        if step >= 24:
            print(f"step {step:2d}  raw {s['raw_norm']:.4f}  clipped {s['clipped_norm']:.4f}  "
                  f"z {s['z_score']:7.2f}  clipped? {bool(s['was_clipped'])}  "
                  f"mu {s['ema_mean']:.4f}  var {s['ema_var']:.6f}")
        if s["was_clipped"]:
            z = float(s["z_score"])
            print(f"  check: T = mu + z_thresh^2 * sigma / z = {mu:.4f} + 6.25 * {sigma:.4f} / "
                  f"{z:.2f} "
                  f"= {mu + 6.25 * sigma / z:.4f}")
    print("expected: only step 30 (raw norm 10) is clipped, to the T printed under it; "
          "warmup ends at step 24")

    # Resume: the statistics live in ZClip, not in the optimizer. Rebuilt without them, it is back in warmup.
    restored, forgotten = ZClip(), ZClip()
    restored.load_state_dict(zclip.state_dict())
    for name, z in (("restored with load_state_dict", restored),
                    ("rebuilt without its state", forgotten)):
        p.grad = grad * (10.0 / grad.norm())
        norm = float(z.clip([p])["clipped_norm"])
        print(f"after a resume, a norm-10 spike, ZClip {name}: norm {norm:.4f} after clip()")
