"""
Three additions to Muon: NorMuon, 8-bit momentum, and QK-clip (MuonClip). muon.py is the
optimizer they build on (NS5, the momentum update, the lr adjustment); this file imports it, as model.py imports
quant.py, and adds only what differs.

1. NorMuon (Li et al., arXiv 2510.05491, Algorithm 1; reference code zichongli5/NorMuon, normuon_update).
   Muon's orthogonalised update O = NS5(u) has very uneven row norms: some output neurons move much more than
   others. NorMuon keeps, per row (output neuron) of the (out, in) weight, an EMA of that row's mean square and
   divides the row by its root, then rescales the whole update back to its Frobenius norm:
       v = β2·v + (1 - β2)·mean_j(O_ij²)              (rows, 1), zeros at start, no bias correction
       Ô = O / (sqrt(v) + 1e-10);   Ô = Ô · ||O||_F / (||Ô||_F + 1e-10)
       p = p·(1 - lr·wd) - lr·sqrt(max(1, rows/cols))·Ô       (as Muon's "original" scale; defaults β2 = 0.95)
2. 8-bit Muon (Gupta et al., arXiv 2509.23106): the momentum buffer lives in 8 bits, quantised per block of
   B = 2048 values (bitsandbytes' blockwise scheme, Dettmers et al., arXiv 2110.02861) with one fp32 absmax each:
       m = dequant(Z);  m = β·m + (1 - β)·g  (muon.muon_update);  O = NS5(u);  Z = quant(m)
   linear:   code = round(127·x / absmax) in int8, x ≈ code·absmax/127
   dynamic:  code = the uint8 index of the nearest of the 256 values of 8-bit Adam's "dynamic" map (dynamic_map),
             x ≈ map[code]·absmax: it spends more codes near zero, where most momentum values are.
   Bytes per matrix: numel (codes) + 4·ceil(numel/B) (absmax) against 4·numel in fp32: 74.95% less at B = 2048.
3. QK-clip (Kimi K2, arXiv 2507.20534, sec. 2.1, MuonClip). After the optimizer step, per attention head h whose
   largest pre-softmax logit S_max^h = max_ij q_i·k_j / sqrt(d) in the step exceeded tau (K2: 100):
       gamma_h = tau / S_max^h;   W_q[rows of h] *= sqrt(gamma_h);   W_k[rows of h] *= sqrt(gamma_h)
   so that head's logits on the same inputs shrink by exactly gamma_h (to at most tau). model.py records S_max
   per head (GPTConfig.track_max_logit). Exact for the latent weights, approximate for the ternary forward pass:
   see qk_clip.

Run:  python -m pytest tests/test_muon_variants.py
Train with them (one process): python train.py --normuon=True | --muon_state=linear8|dynamic8 | --qk_clip_tau=100
"""

import math

import torch

from muon import Muon, adjusted_lr, muon_update, zeropower_via_newtonschulz5

# ----------------------------------------------------------------------------- 1. NorMuon


def normuon_normalize(O, v, beta2=0.95, eps=1e-10):
    """O (rows, cols): the NS5 output. v (rows, 1): the per-row second moment, updated in place. Returns Ô."""
    v.lerp_(O.float().square().mean(dim=-1, keepdim=True), 1 - beta2)
    norm = O.float().norm()
    O_hat = O.float() / (v.sqrt() + eps)
    return O_hat * (norm / (O_hat.norm() + eps))

# ----------------------------------------------------------------------------- 2. 8-bit momentum


def dynamic_map():
    """The 256 values of 8-bit Adam's signed dynamic map (bitsandbytes create_dynamic_map(True, 7, 8)), sorted:
    a sign, a decimal exponent 10^-6..10^0 written as leading zeros, and a linear fraction in the remaining bits."""
    data = []
    for i in range(7):  # exponent 10^(i-6); 2^i fraction values at it, each sign
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float64)
        means = (bounds[:-1] + bounds[1:]) / 2
        data += (10.0 ** (i - 6) * means).tolist() + (-(10.0 ** (i - 6)) * means).tolist()
    data += [0.0, 1.0]  # 254 + 2 = 256
    return torch.tensor(sorted(data), dtype=torch.float32)


def quantize_blockwise(x, kind="linear", block=2048):
    """x (any shape) -> (codes (numel,) int8 for linear / uint8 for dynamic, absmax (n_blocks,) fp32)."""
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
    """Bytes of one matrix's momentum state: 4·numel in fp32; numel + 4·ceil(numel/block) in 8 bits."""
    return 4 * numel if kind == "fp32" else numel + 4 * math.ceil(numel / block)

# ----------------------------------------------------------------------------- the optimizer


class MuonVariant(Muon):
    """muon.Muon with normuon=True (per-row normalisation, beta2) and/or 8-bit momentum (state="linear8" or
    "dynamic8", block values per fp32 absmax). Everything else (lr, momentum, nesterov, weight decay, the lr
    adjustment, ns_dtype) as Muon. State per matrix: "momentum_buffer" (fp32) or "momentum_codes" and
    "momentum_absmax"; and "v" (rows, 1) fp32 with NorMuon."""

    def __init__(self, params, normuon=False, beta2=0.95, state="fp32", block=2048, **kwargs):
        if state not in ("fp32", "linear8", "dynamic8"):
            raise ValueError(f"state must be fp32, linear8 or dynamic8, got {state!r}")
        if kwargs.get("process_group") is not None:
            raise ValueError("NorMuon and 8-bit Muon run in one process here; DDP/FSDP2 use plain Muon")
        self.normuon, self.beta2, self.state_kind, self.block = normuon, beta2, state, block
        super().__init__(params, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kind = self.state_kind.removesuffix("8")
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                if hasattr(p, "device_mesh"):
                    raise ValueError("NorMuon and 8-bit Muon run in one process here; FSDP2 uses plain Muon")
                state = self.state[p]
                if self.state_kind == "fp32":
                    buf = self._momentum_buffer(p)
                elif "momentum_codes" in state:
                    buf = dequantize_blockwise(state["momentum_codes"], state["momentum_absmax"], p.shape, kind,
                                               self.block)
                else:
                    buf = torch.zeros_like(p, dtype=torch.float32)
                u = muon_update(p.grad, buf, group["momentum"], group["nesterov"])
                if self.state_kind != "fp32":
                    state["momentum_codes"], state["momentum_absmax"] = quantize_blockwise(buf, kind, self.block)
                o = zeropower_via_newtonschulz5(u, steps=group["ns_steps"], dtype=self.ns_dtype)
                if self.normuon:
                    if "v" not in state:
                        state["v"] = torch.zeros(p.shape[0], 1, dtype=torch.float32, device=p.device)
                    o = normuon_normalize(o, state["v"], self.beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(o.to(p.dtype), alpha=-adjusted_lr(group["lr"], p.shape, group["adjust_lr_fn"]))
        return loss

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # torch casts every state tensor to the parameter's float dtype
        dtype = torch.int8 if self.state_kind == "linear8" else torch.uint8
        for s in self.state.values():
            if "momentum_codes" in s:
                s["momentum_codes"] = s["momentum_codes"].to(dtype)  # the codes back to 8 bits, values unchanged

    def state_bytes(self):
        """Bytes of the optimizer state tensors, as stored."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def __getstate__(self):
        return {**super().__getstate__(), "normuon": self.normuon, "beta2": self.beta2,
                "state_kind": self.state_kind, "block": self.block}

# ----------------------------------------------------------------------------- 3. QK-clip


def attention_modules(model):
    return [m for m in model.modules() if hasattr(m, "max_logit") and hasattr(m, "q_proj")]


def max_logit(model):
    """The largest recorded q.k/sqrt(d) over every head and layer (a 0-d tensor), or None if nothing records."""
    mods = attention_modules(model)
    return torch.stack([m.max_logit.max() for m in mods]).max() if mods else None


@torch.no_grad()
def reset_max_logit(model):
    for m in attention_modules(model):
        m.max_logit.zero_()


@torch.no_grad()
def qk_clip(model, tau=100.0):
    """After optimizer.step(): every attention head whose recorded max logit exceeds tau has its rows of q_proj
    and k_proj scaled by sqrt(tau / S_max); then the records are reset for the next step. No host sync.
    Returns the largest recorded logit before clipping (a 0-d tensor), for logging.

    The loss is untouched this step. S_max comes from each Attention's `max_logit` buffer (GPTConfig.track_max_logit:
    one extra q·kᵀ over `max_logit_rows` rows of the batch, 1/batch_size of the attention-score work by default).
    Ternary twist: a BitLinear's weight is quantised with gamma = mean|W| over the whole matrix, so shrinking the
    rows of one head also lowers gamma for every other head, and the rescaled head's rows are requantised
    against it: the clip is exact for the latent weights, approximate for the ternary forward pass (measured in
    tests/test_muon_variants.py). Single process only: DDP and FSDP2 use muon.Muon (train.py refuses them)."""
    top = None
    for attn in attention_modules(model):
        s = attn.max_logit  # (n_head,)
        scale = torch.where(s > tau, (tau / s.clamp(min=1e-30)).sqrt(), torch.ones_like(s))  # (n_head,)
        rows = scale.repeat_interleave(attn.q_proj.weight.shape[0] // s.numel())[:, None]  # (C, 1): per row
        attn.q_proj.weight.mul_(rows.to(attn.q_proj.weight.dtype))
        attn.k_proj.weight.mul_(rows.to(attn.k_proj.weight.dtype))
        top = s.max() if top is None else torch.maximum(top, s.max())
        s.zero_()
    return top
