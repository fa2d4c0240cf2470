"""
Muon: MomentUm Orthogonalized by Newton-Schulz, for the 2-D hidden weight matrices of a network.

Muon keeps an SGD-momentum buffer per weight matrix and, instead of stepping along it, steps along its
nearest semi-orthogonal matrix U Vᵀ (where U S Vᵀ is its SVD), approximated cheaply in bf16 by five
Newton-Schulz iterations. Every direction of the update then moves by about the same amount, whatever the
gradient's spectrum. Embeddings, the LM head, norm gains and biases are not hidden matrices and go to AdamW.

Sources: KellerJordan/Muon (muon.py, https://kellerjordan.github.io/posts/muon/); torch.optim.Muon
(torch >= 2.9, whose single-tensor step this file reproduces bit for bit); Moonlight, "Muon is Scalable
for LLM Training" (arXiv 2502.16982) for the "match_rms_adamw" learning-rate scaling.

Formulas (momentum β = 0.95, (a, b, c) = (3.4445, -4.7750, 2.0315), all NS5 arithmetic in bf16):
    NS5(G):  X = G (transposed if rows > cols);  X = X / (||X||_F + eps)
             repeat 5 times:  A = X Xᵀ;  B = b·A + c·A²;  X = a·X + B·X
    buf    = β·buf + (1 - β)·g                      (an EMA, i.e. buf.lerp_(g, 1 - β))
    update = (1 - β)·g + β·buf  if nesterov else buf
    p      = p·(1 - lr·wd)                          (decoupled weight decay with the unscaled lr)
    p      = p - lr_adj·NS5(update)
    lr_adj = lr·sqrt(max(1, rows/cols))             "original" (Keller Jordan, the default)
    lr_adj = lr·0.2·sqrt(max(rows, cols))           "match_rms_adamw" (Moonlight: reuse AdamW's lr and wd)

Distributed (process_group=, or FSDP2 DTensor parameters): NS5 is the expensive part, so each of the W ranks
orthogonalises every W-th matrix (round-robin: matrix i belongs to rank i % W) and broadcasts the result to the
others. Momentum, cheap and elementwise, runs on every rank for every matrix, so each rank's optimizer state is
complete (DDP: replicated; FSDP2: each rank's shard) and the update equals the single-process one bit for bit.
With FSDP2 the matrices are sharded by rows, and NS5 needs whole matrices: every rank all-gathers each momentum
update (DTensor.full_tensor), the owner orthogonalises it, broadcasts it, and each rank applies its own rows.
This moves 2x the bytes of an ideal gather-to-owner / scatter-back, and is the simplest correct form.

Test:  python -m pytest tests/test_muon.py tests/test_scale.py        Demo:  python muon.py
This file imports only torch and the standard library, so it can be copied into another project.
"""
import math

import torch
import torch.distributed as dist
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: maximal slope at zero, 5 steps suffice


def zeropower_via_newtonschulz5(G, steps=5, eps=1e-7, dtype=torch.bfloat16):
    """
    Approximate the orthogonal factor U Vᵀ of G = U S Vᵀ with a quintic Newton-Schulz iteration.
    The coefficients push the slope at zero as high as possible, so the iteration does not converge to
    exactly 1: the result is U S' Vᵀ with S' roughly in [0.5, 1.5], which trains as well as U Vᵀ.
    G may be a batch of matrices (..., rows, cols); each matrix is processed independently.
    Returns a bf16 tensor of G's shape; callers cast or let `p.add_` promote it.
    dtype: bf16 as in the paper (fast on GPU tensor cores); float32 is ~18x faster on CPUs without bf16
    matrix units (`python bench.py --muon`), and at least as accurate.
    """
    if G.ndim < 2:
        raise ValueError(f"zeropower_via_newtonschulz5 expects (..., rows, cols), got shape {tuple(G.shape)}")
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    transposed = G.size(-2) > G.size(-1)
    if transposed:  # X Xᵀ is then the smaller Gram matrix, so each step costs less
        X = X.mT
    # The Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1].
    # (torch.optim.Muon divides by norm.clamp(min=eps); in bf16 both give the same bits unless ||X|| < ~1e-5.)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    batch_shape = X.shape[:-2]
    if X.ndim > 3:
        X = X.reshape(-1, *X.shape[-2:])
    # addmm computes beta*input + alpha*(m1 @ m2) with one bf16 rounding, exactly as torch.optim.Muon does;
    # KellerJordan's `b*A + c*A@A` rounds three times and differs in the last bits.
    mm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        A = X @ X.mT
        B = mm(A, A, A, beta=b, alpha=c)  # b·A + c·A²
        X = mm(X, B, X, beta=a)  # a·X + B·X
    X = X.reshape(*batch_shape, *X.shape[-2:])
    if transposed:
        X = X.mT
    return X


def adjusted_lr(lr, shape, adjust_lr_fn=None):
    """The lr actually applied to NS5(update) for a matrix of `shape` = (rows, cols)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        # NS5 output has RMS ~ 1/sqrt(max(rows, cols)); this keeps tall matrices' per-entry step comparable.
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        # Moonlight: an update RMS of ~0.2 matches AdamW's, so AdamW's lr and weight decay carry over.
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
    return lr * ratio  # same association as torch.optim.Muon, so the float is identical


class Muon(torch.optim.Optimizer):
    """
    Muon for 2-D weight matrices. Defaults follow KellerJordan/Muon (lr 0.02, no weight decay); note that
    torch.optim.Muon defaults to lr 1e-3 and weight_decay 0.1. Any parameter that is not 2-D is refused.
    The momentum buffer is state[p]["momentum_buffer"], so state_dict() round-trips like any optimizer.
    process_group: None = one process; a group (e.g. torch.distributed.group.WORLD) = the parameters are
    replicated with identical gradients on its ranks (DDP), which share out NS5. DTensor (FSDP2) parameters
    always use their mesh's group.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
                 adjust_lr_fn=None, ns_dtype=torch.bfloat16, process_group=None):
        if lr < 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self.ns_dtype = ns_dtype  # bf16 (paper); float32 on CPUs, where bf16 matmuls are slow
        self.process_group = process_group
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        # Validate before registering, so a refused group leaves the optimizer unchanged.
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if p.ndim != 2:
                raise ValueError(
                    f"Muon only takes 2-D weight matrices, got a parameter of shape {tuple(p.shape)}; "
                    "biases, norm gains and other non-2-D parameters belong to AdamW "
                    "(split_muon_params does this split for you)")
        adjusted_lr(1.0, (1, 1), param_group.get("adjust_lr_fn", self.defaults["adjust_lr_fn"]))  # raises if unknown
        super().add_param_group({**param_group, "params": params})

    def _orthogonalized_update(self, p, group):
        """Momentum then NS5 for one parameter: the unit of work of Muon."""
        return zeropower_via_newtonschulz5(self._momentum_update(p, group), steps=group["ns_steps"],
                                           dtype=self.ns_dtype)

    def _momentum_update(self, p, group):
        g = p.grad
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(g, 1 - group["momentum"])  # buf = β·buf + (1-β)·g
        return g.lerp(buf, group["momentum"]) if group["nesterov"] else buf  # (1-β)·g + β·buf

    def _distributed_step(self, params, group, pg):
        """Round-robin NS5 over the ranks of pg, see the module docstring. Every rank must call it."""
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        outs, works = [], []
        for i, p in enumerate(params):
            update = self._momentum_update(p, group)
            if hasattr(update, "full_tensor"):  # an FSDP2 shard: all-gather the whole matrix
                update = update.full_tensor()
            if i % world == rank:
                # contiguous: a tall matrix comes back as a transposed view, and broadcast sends raw storage
                o = zeropower_via_newtonschulz5(update, steps=group["ns_steps"], dtype=self.ns_dtype).contiguous()
            else:
                o = torch.empty(update.shape, dtype=self.ns_dtype, device=update.device)
            works.append(dist.broadcast(o, src=dist.get_global_rank(pg, i % world), group=pg, async_op=True))
            outs.append(o)
        for p, o, work in zip(params, outs, works):
            work.wait()
            if hasattr(p, "device_mesh"):  # keep this rank's rows of the whole result (no communication)
                from torch.distributed.tensor import distribute_tensor
                o = distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(o, alpha=-adjusted_lr(group["lr"], p.shape, group["adjust_lr_fn"]))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = group["lr"]
            params = [p for p in group["params"] if p.grad is not None]
            meshes = [p.device_mesh for p in params if hasattr(p, "device_mesh")]
            pg = meshes[0].get_group() if meshes else self.process_group
            if pg is not None and dist.get_world_size(pg) > 1:
                self._distributed_step(params, group, pg)
                continue
            for p in params:
                update = self._orthogonalized_update(p, group)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-adjusted_lr(lr, p.shape, group["adjust_lr_fn"]))
        return loss


def split_muon_params(model, head_names=("lm_head",)):
    """
    Split model's trainable parameters into (muon_params, adamw_params).
    Muon: 2-D hidden matrices. AdamW: nn.Embedding weights, the parameters of any module whose qualified name
    is or ends with ".<h>" for h in head_names (the LM head), any parameter tied to an embedding, norm gains,
    biases and everything else that is not 2-D. Each tensor appears once, in the order of model.parameters().
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head_ids = set()
    for name, module in model.named_modules():
        if any(name == h or name.endswith("." + h) for h in head_names):
            head_ids.update(id(p) for p in module.parameters())
    muon_params, adamw_params, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_hidden_matrix = p.ndim == 2 and id(p) not in embedding_ids and id(p) not in head_ids
        (muon_params if is_hidden_matrix else adamw_params).append(p)
    return muon_params, adamw_params


class MuonWithAdamW:
    """
    One optimizer object for the usual split: Muon for hidden matrices, AdamW for the rest. 2-D AdamW
    parameters (embeddings, head) get adamw_weight_decay; 1-D ones (norm gains, biases) get none.
    `param_groups` lists Muon's groups then AdamW's (the same dicts), each with an "initial_lr", so a
    schedule can do `for g in opt.param_groups: g["lr"] = g["initial_lr"] * mult`.
    `.muon` and `.adamw` are the two underlying optimizers.
    """

    def __init__(self, muon_params, adamw_params, muon_lr=0.02, adamw_lr=3e-4, muon_weight_decay=0.0,
                 adamw_weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn=None,
                 adamw_betas=(0.9, 0.95), adamw_eps=1e-8, fused=None, ns_dtype=torch.bfloat16, process_group=None):
        adamw_params = list(adamw_params)
        # Groups are passed as dicts so that an empty list (e.g. a model with no hidden matrix) is allowed.
        self.muon = Muon([{"params": list(muon_params)}], lr=muon_lr, momentum=momentum, nesterov=nesterov,
                         weight_decay=muon_weight_decay, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                         ns_dtype=ns_dtype, process_group=process_group)
        self.adamw = torch.optim.AdamW(
            [{"params": [p for p in adamw_params if p.ndim >= 2], "weight_decay": adamw_weight_decay},
             {"params": [p for p in adamw_params if p.ndim < 2], "weight_decay": 0.0}],
            lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, fused=fused)
        for group in self.param_groups:
            group.setdefault("initial_lr", group["lr"])

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self):
        """parameter -> its state dict, as torch.optim.Optimizer.state (the inner dicts are the live ones)."""
        return {**self.muon.state, **self.adamw.state}

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict):
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def configure_muon(model, head_names=("lm_head",), **kwargs):
    """split_muon_params(model, head_names), then MuonWithAdamW(muon_params, adamw_params, **kwargs)."""
    muon_params, adamw_params = split_muon_params(model, head_names)
    return MuonWithAdamW(muon_params, adamw_params, **kwargs)


if __name__ == "__main__":
    torch.manual_seed(0)
    G = torch.randn(256, 128)
    O = zeropower_via_newtonschulz5(G).float()
    S = torch.linalg.svdvals(O)
    print(f"NS5 of a 256x128 Gaussian: singular values in [{S.min():.3f}, {S.max():.3f}] (expect ~[0.5, 1.5])")
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    cos = torch.nn.functional.cosine_similarity(O.flatten(), (U @ Vh).flatten(), dim=0)
    print(f"cosine(NS5(G), U Vᵀ) = {cos:.4f} (1.0 would be the exact orthogonal factor)")

    # Muon on least squares: find W (64x32) with X W ≈ Y.
    X, W_true = torch.randn(512, 64), torch.randn(64, 32) / 8
    Y = X @ W_true
    W = nn.Parameter(torch.zeros(64, 32))
    opt = Muon([W], lr=0.02)
    losses = []
    for _ in range(100):
        loss = ((X @ W - Y) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"least squares with Muon: loss {losses[0]:.4f} -> {losses[-1]:.4f} in 100 steps")

    if hasattr(torch.optim, "Muon"):
        p1 = nn.Parameter(torch.randn(48, 32))
        p2 = nn.Parameter(p1.detach().clone())
        ours = Muon([p1], lr=0.02, weight_decay=0.1)
        ref = torch.optim.Muon([p2], lr=0.02, weight_decay=0.1)
        for _ in range(3):
            g = torch.randn(48, 32)
            p1.grad, p2.grad = g.clone(), g.clone()
            ours.step()
            ref.step()
        print(f"max |ours - torch.optim.Muon| after 3 steps: {(p1 - p2).abs().max().item()} (0.0 = bitwise equal)")
