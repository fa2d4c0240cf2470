"""
Three additions to Muon: NorMuon, 8-bit momentum, and QK-clip (MuonClip). muon.py is the optimizer they build
on (NS5, the momentum update, the lr adjustment); this file imports it and adds only what differs.

1. NorMuon (Li et al., arXiv 2510.05491, Algorithm 1; reference code zichongli5/NorMuon). Muon's
   orthogonalised update O = NS5(u) has very uneven row norms. NorMuon keeps, per row (output
   neuron) of the (out, in) weight, an EMA of that row's mean square and divides the row by its
   root, then rescales the whole update back to its Frobenius norm (defaults β2 = 0.95):
       v = β2·v + (1 - β2)·mean_j(O_ij²)        (rows, 1), zeros at start, no bias correction
       Ô = O / (sqrt(v) + 1e-10);   Ô = Ô · ||O||_F / (||Ô||_F + 1e-10)
       p = p·(1 - lr·wd) - lr·s·Ô    s: the group's adjust_lr_fn, sqrt(max(1, rows/cols)) for Muon's
   "original" (the reference code's; Algorithm 1 scales Ô to RMS 0.2), 0.2·sqrt(max(rows, cols)) for match_rms_adamw
2. 8-bit Muon (Gupta et al., arXiv 2509.23106): the momentum lives in 8 bits, quantised per block
   of B = 2048 values (bitsandbytes' blockwise scheme, arXiv 2110.02861), one fp32 absmax each:
       m = dequant(Z);  m = β·m + (1 - β)·g  (muon.muon_update);  O = NS5(u);  Z = quant(m)
   linear:   code = round(127·x / absmax) in int8, x ≈ code·absmax/127
   dynamic:  code = the uint8 index of the nearest of the 256 values of 8-bit Adam's "dynamic" map
             (dynamic_map), x ≈ map[code]·absmax: more codes near zero, where most values are.
   Bytes: numel (codes) + 4·ceil(numel/B) (absmax) against 4·numel in fp32: 74.95% less at 2048.
3. QK-clip (Kimi K2, arXiv 2507.20534, sec. 2.1). After the step, per attention head h whose largest
   pre-softmax logit S_max^h = max_ij q_i·k_j / sqrt(d) in the step exceeded tau (K2: 100):
       gamma_h = tau / S_max^h;   W_q[rows of h] *= sqrt(gamma_h);   W_k[rows of h] *= sqrt(gamma_h)
   so that head's logits on the same inputs shrink by exactly gamma_h. S_max: K2's over the whole
   batch, ours over each micro-batch's first `rows` sequences (1 by default, a sample; rows = batch_size
   takes all). With GQA a K head serves a group g of query heads: W_k[g] *= sqrt(min_g gamma), W_q[h]
   *= gamma_h / sqrt(min_g gamma) (ours; the same rule for groups of one). QKClip records S_max per
   head by a forward pre-hook on each block's attn.attend, attached from outside: model.py knows
   nothing of it. Exact for the latent weights, approximate for the ternary forward: see qk_clip.
1 and 2 are MuonVariant, a muon.Muon with its own muon_step for the groups configure_muon builds.

Run:  python -m pytest tests/test_muon_variants.py
Train, one process: train.py --normuon=True | --muon_state=linear8|dynamic8 | --qk_clip_tau=100
"""

import functools
import math

import torch

from muon import Muon, adjusted_lr, muon_update, zeropower_via_newtonschulz5

# ----------------------------------------------------------------------------- 1. NorMuon


def normuon_normalize(O, v, beta2=0.95, eps=1e-10):
    """O (rows, cols): the NS5 output. v (rows, 1): the per-row second moment, updated in place.
    Returns Ô."""
    v.lerp_(O.float().square().mean(dim=-1, keepdim=True), 1 - beta2)
    norm = O.float().norm()
    O_hat = O.float() / (v.sqrt() + eps)
    return O_hat * (norm / (O_hat.norm() + eps))

# ----------------------------------------------------------------------------- 2. 8-bit momentum


def dynamic_map():
    """The 256 values of 8-bit Adam's signed dynamic map (bitsandbytes create_dynamic_map(True, 7,
    8)), sorted: a sign, a decimal exponent 10^-6..10^0 written as leading zeros, and a linear
    fraction in the remaining bits."""
    data = []
    for i in range(7):  # exponent 10^(i-6); 2^i fraction values at it, each sign
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float64)
        means = (bounds[:-1] + bounds[1:]) / 2
        data += (10.0 ** (i - 6) * means).tolist() + (-(10.0 ** (i - 6)) * means).tolist()
    data += [0.0, 1.0]  # 254 + 2 = 256
    return torch.tensor(sorted(data), dtype=torch.float32)


def quantize_blockwise(x, kind="linear", block=2048):
    """x (any shape) -> (codes (numel,) int8 for linear / uint8 for dynamic, absmax (n_blocks,)
    fp32)."""
    flat = x.detach().float().reshape(-1)
    pad = (-flat.numel()) % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)  # (n_blocks, block)
    absmax = blocks.abs().amax(dim=1).clamp(min=1e-12)                 # (n_blocks,)
    y = blocks / absmax[:, None]                                        # in [-1, 1]
    if kind == "linear":
        codes = (y * 127).round().to(torch.int8)
    else:  # nearest value of the dynamic map
        table = _dynamic_table(x.device)
        i = torch.searchsorted(table, y.contiguous()).clamp(1, 255)
        lower_closer = (y - table[i - 1]) <= (table[i] - y)
        codes = torch.where(lower_closer, i - 1, i).to(torch.uint8)
    return codes.reshape(-1)[:flat.numel()], absmax


def dequantize_blockwise(codes, absmax, shape, kind="linear", block=2048):
    n = codes.numel()
    pad = (-n) % block
    c = torch.nn.functional.pad(codes, (0, pad)).view(-1, block)
    y = c.float() / 127 if kind == "linear" else _dynamic_table(codes.device)[c.long()]
    return (y * absmax[:, None]).reshape(-1)[:n].reshape(shape)


_TABLES = {}


def _dynamic_table(device):
    if device not in _TABLES:
        _TABLES[device] = dynamic_map().to(device)
    return _TABLES[device]


def state_bytes(numel, kind="fp32", block=2048):
    """Bytes of one matrix's momentum state: 4·numel in fp32; numel + 4·ceil(numel/block) in 8
    bits."""
    return 4 * numel if kind == "fp32" else numel + 4 * math.ceil(numel / block)

# ----------------------------------------------------------------------------- the optimizer


class MuonVariant(Muon):
    """muon.Muon with normuon=True (per-row normalisation, beta2) and/or 8-bit momentum
    (state="linear8" or "dynamic8", block values per fp32 absmax) for its Muon groups. Everything
    else (lr, momentum, nesterov, weight decay, the lr adjustment, ns_dtype, the AdamW groups) as
    Muon, so it takes the groups configure_muon built:
        opt = MuonVariant(configure_muon(model, ...).param_groups, normuon=True, state="dynamic8")
    State per matrix: "momentum_buffer" (fp32) or "momentum_codes" and "momentum_absmax"; and "v"
    (rows, 1) fp32 with NorMuon."""

    def __init__(self, params, normuon=False, beta2=0.95, state="fp32", block=2048, **kwargs):
        if state not in ("fp32", "linear8", "dynamic8"):
            raise ValueError(f"state must be fp32, linear8 or dynamic8, got {state!r}")
        self.normuon, self.beta2, self.state_kind, self.block = normuon, beta2, state, block
        super().__init__(params, **kwargs)
        muon_params = [p for g in self.param_groups if g["kind"] == "muon" for p in g["params"]]
        if any(hasattr(p, "device_mesh") for p in muon_params):
            raise ValueError("NorMuon and 8-bit Muon run in one process here; FSDP2 shards go to "
                             "plain Muon's update through tools/sharded_muon.ShardedMuon")

    def muon_step(self, p, group):
        state, kind = self.state[p], self.state_kind.removesuffix("8")
        if self.state_kind == "fp32":
            buf = self._momentum_buffer(p)
        elif "momentum_codes" in state:
            codes, absmax = state["momentum_codes"], state["momentum_absmax"]
            buf = dequantize_blockwise(codes, absmax, p.shape, kind, self.block)
        else:
            buf = torch.zeros_like(p, dtype=torch.float32)
        u = muon_update(p.grad, buf, group["momentum"], group["nesterov"])
        if self.state_kind != "fp32":
            codes, absmax = quantize_blockwise(buf, kind, self.block)
            state["momentum_codes"], state["momentum_absmax"] = codes, absmax
        o = zeropower_via_newtonschulz5(u, steps=group["ns_steps"], dtype=self.ns_dtype)
        if self.normuon:
            if "v" not in state:
                state["v"] = torch.zeros(p.shape[0], 1, dtype=torch.float32, device=p.device)
            o = normuon_normalize(o, state["v"], self.beta2)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(o.to(p.dtype), alpha=-adjusted_lr(group["lr"], p.shape, group["adjust_lr_fn"]))

    def load_state_dict(self, state_dict):
        # torch casts every state tensor to the parameter's float dtype
        super().load_state_dict(state_dict)
        dtype = torch.int8 if self.state_kind == "linear8" else torch.uint8
        for s in self.state.values():
            if "momentum_codes" in s:
                # the codes back to 8 bits, values unchanged
                s["momentum_codes"] = s["momentum_codes"].to(dtype)

    def state_bytes(self):
        """Bytes of the Muon groups' state tensors, as stored (the AdamW groups' are AdamW's)."""
        muon_params = [p for g in self.param_groups if g["kind"] == "muon" for p in g["params"]]
        return sum(t.numel() * t.element_size() for p in muon_params
                   for t in self.state.get(p, {}).values() if isinstance(t, torch.Tensor))

    def __getstate__(self):
        return {**super().__getstate__(), "normuon": self.normuon, "beta2": self.beta2,
                "state_kind": self.state_kind, "block": self.block}

# ----------------------------------------------------------------------------- 3. QK-clip


@torch.no_grad()
def max_logit_per_head(q, k, mask=None, is_causal=True, rows=1):
    """Each head's largest q_i.k_j / sqrt(hd) over the allowed positions of the first `rows` rows of
    the batch: (n_head,) fp32. q (B, nh, T, hd), k (B, nkv, T, hd): each K head serves nh / nkv
    query heads (GQA, as model.SDPA); mask: None (causal if is_causal, else every position) or bool
    with True = allowed, (B, 1, T, T) as model.document_mask makes it, or without the batch dim."""
    n = min(rows, q.size(0))
    # (B, nh, T, hd): every query head's keys
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    s = (q[:n].float() @ k[:n].float().transpose(-2, -1)) / math.sqrt(q.size(-1))  # (n, nh, T, T)
    if mask is not None:
        allowed = mask[:n] if mask.dim() == 4 else mask
    else:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device)
        allowed = allowed.tril() if is_causal else allowed
    return s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@torch.no_grad()
def qk_clip(attn, s_max, tau):
    """Scale the rows of attn.q_proj and attn.k_proj that belong to each head h with s_max[h] > tau
    by sqrt(tau / s_max[h]), in place: that head's logits on the same inputs shrink by tau /
    s_max[h]. s_max (n_head,).

    Ternary twist: a BitLinear's weight is quantised with gamma = mean|W| over the whole matrix, so
    shrinking the rows of one head also lowers gamma for every other head, and the rescaled head's
    rows are requantised against it: the clip is exact for the latent weights, approximate for the
    ternary forward pass (measured in tests/test_muon_variants.py). Grouped-query attention
    (attn.n_kv_head < n_head): the K head of a group takes the square root of the group's smallest
    gamma, and each query head the rest of its own gamma."""
    # (n_head,)
    gamma = torch.where(s_max > tau, tau / s_max.clamp(min=1e-30), torch.ones_like(s_max))
    g = gamma.view(attn.n_kv_head, -1)  # (nkv, nh / nkv): query heads by the K head they share
    k_scale = g.amin(dim=1).sqrt()                       # (nkv,)
    q_scale = (g / k_scale[:, None]).reshape(-1)  # (nh,): q_scale[h] * k_scale[g(h)] = gamma_h
    for w, scale in ((attn.q_proj.weight, q_scale), (attn.k_proj.weight, k_scale)):
        # per row of a head
        w.mul_(scale.repeat_interleave(w.shape[0] // scale.numel())[:, None].to(w.dtype))


class QKClip:
    """
    QK-clip attached to a GPT from outside: qk = QKClip(model, tau, rows=1) puts a forward pre-hook
    on every block's attn.attend (q, k after RoPE), which keeps each head's running max logit
    (max_logit_per_head) in qk.max_logits, one (n_head,) tensor per layer, on the model's device
    (attach after moving it there), with no host sync. It records in training mode with gradients on
    only: not in evaluation, nor in generation (no_grad).
    Each training step then calls:
        qk.watch()              -> {"max_logit": 0-d tensor}, the largest over every head and
                                layer, for the log
        qk.after_step(step, ok) after optimizer.step(): if tau > 0 and the step was taken (ok),
                                qk_clip every layer's heads over tau; then the records start
                                again from 0 for the next step
    tau = 0 logs the max without clipping (--log_max_logit). qk.remove() takes the hooks off. One
    process only: DDP and FSDP2 would record each rank's own maximum (train.py refuses them).
    """

    def __init__(self, model, tau=0.0, rows=1):
        if tau < 0 or rows < 1:
            raise ValueError(f"QKClip needs tau >= 0 (0 = log only) and rows >= 1, got tau={tau}, "
                             f"rows={rows}")
        if tau > 0 and model.config.qk_norm:
            raise ValueError("QK-clip rescales rows of W_q and W_k, which the q/k norms of this "
                             "model (qk_norm=True, Qwen3) normalise away: it would clip nothing; "
                             "log the max logit only (tau 0)")
        self.tau, self.rows = tau, rows
        self.attns = [block.attn for block in model.h]
        self.max_logits = [torch.zeros(a.n_head, device=a.q_proj.weight.device) for a in self.attns]
        self.handles = [a.attend.register_forward_pre_hook(functools.partial(self._record, m),
                                                           with_kwargs=True)
                        for a, m in zip(self.attns, self.max_logits)]

    def _record(self, max_logit, attend, args, kwargs):
        # evaluation, or generation (under no_grad)
        if not (attend.training and torch.is_grad_enabled()):
            return
        # SDPA.forward's arguments
        a = dict(zip(("q", "k", "v", "mask", "is_causal"), args), **kwargs)
        s = max_logit_per_head(a["q"], a["k"], a.get("mask"), a.get("is_causal", True), self.rows)
        with torch.no_grad():
            max_logit.copy_(torch.maximum(max_logit, s))

    def watch(self):
        return {"max_logit": torch.stack([m.max() for m in self.max_logits]).max()}

    @torch.no_grad()
    def after_step(self, step, ok):
        """step: the step just taken (unused here; the after-step callbacks' common signature)."""
        for attn, max_logit in zip(self.attns, self.max_logits):
            if self.tau > 0 and ok:
                qk_clip(attn, max_logit, self.tau)
            max_logit.zero_()

    def remove(self):
        for h in self.handles:
            h.remove()
