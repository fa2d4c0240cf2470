"""
Muon: MomentUm Orthogonalized by Newton-Schulz, an optimizer for the 2-D hidden weight matrices of a network.

Muon keeps SGD momentum per weight matrix but steps along the momentum's nearest semi-orthogonal matrix U Vᵀ
(U S Vᵀ being its SVD), approximated in bf16 by five Newton-Schulz iterations (NS5). Every direction of the update
then moves by about the same amount, whatever the gradient's spectrum. Embeddings, the LM head, norm gains and
biases are not hidden matrices and go to AdamW, in the same optimizer: each param group says its kind.

Sources: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (kellerjordan.github.io/posts/muon,
2024) and github.com/KellerJordan/Muon (NS5, the "original" lr scale); torch.optim.Muon (torch >= 2.9), whose step
the single-process step below equals bit for bit; Moonlight, "Muon is Scalable for LLM Training" (arXiv 2502.16982):
§2.1 eq. 1-2 (momentum, NS5), §2.2 eq. 3 (decoupled weight decay), Lemma 1 and eq. 4 ("match_rms_adamw").

Formulas (β = 0.95, (a, b, c) = (3.4445, -4.7750, 2.0315), NS5 arithmetic in bf16):
    muon_update:  buf = β·buf + (1 - β)·g                 (an EMA: buf.lerp_(g, 1 - β))
                  u   = (1 - β)·g + β·buf  if nesterov else buf
    NS5(u):       X = u / (||u||_F + eps)                 (transposed if rows > cols)
                  5 times:  A = X Xᵀ;  B = b·A + c·A²;  X = a·X + B·X
    step:         p = p·(1 - lr·wd) - lr_adj·NS5(u)       (decoupled weight decay, with the unscaled lr)
    adjusted_lr:  lr_adj = lr·sqrt(max(1, rows/cols))     "original" (Keller Jordan, the default)
                  lr_adj = lr·0.2·sqrt(max(rows, cols))   "match_rms_adamw" (Moonlight: AdamW's lr and wd carry over)
Schedules: Muon's lr (0.02) and AdamW's (3e-4) differ, so a schedule scales each group's own "initial_lr"
(g["lr"] = g["initial_lr"] * lr_mult(it)); nanoGPT's one lr for every group gives Muon AdamW's lr. See configure_muon.

Run:   python muon.py   (NS5 against the SVD, least squares, parity with torch.optim.Muon, a Muon + AdamW schedule)
Test:  python -m pytest tests/test_muon.py
Imports only torch and the standard library: copy it into another project. Under DDP or FSDP2 the NS5 work is shared
out over the processes by a subclass, tools/sharded_muon.py.
"""
import math

import torch
from torch import nn
from torch.optim.adamw import adamw as adamw_functional  # the function torch.optim.AdamW.step calls

# Keller Jordan's quintic: maximal slope at zero, 5 steps suffice
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def zeropower_via_newtonschulz5(G, steps=5, eps=1e-7, dtype=torch.bfloat16):
    """
    Approximate U Vᵀ, the orthogonal factor of G = U S Vᵀ, for G of shape (rows, cols) or (..., rows, cols).
    The coefficients maximise the slope at zero, so the result is U S' Vᵀ with S' roughly in [0.5, 1.5], which
    trains as well as U Vᵀ. dtype: bf16 as in the paper; ns_dtype_for(device) picks float32 on a device without
    bf16 matrix units (a GPU before Ampere; a CPU without AVX512-BF16 or AMX), where bf16 runs ~18x slower (`python -m lab.bench --muon`). Returns G's shape in dtype.
    """
    if G.ndim < 2:
        raise ValueError("zeropower_via_newtonschulz5 expects (..., rows, cols), "
                         f"got shape {tuple(G.shape)}")
    a, b, c = NS_COEFFICIENTS
    # (rows, cols) or (batch, rows, cols)
    X = G.to(dtype).flatten(0, -3) if G.ndim > 3 else G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:  # X Xᵀ is then the smaller Gram matrix
        X = X.mT
    # ||X||_2 <= ||X||_F, so singular values start in [0, 1]. "+ eps" as Keller Jordan; torch.optim.Muon clamps
    # the norm at eps instead, which gives the same bf16 bits unless ||X||_F < ~5e-5.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    # addmm(M, M1, M2, beta, alpha) = beta·M + alpha·M1@M2 rounded once, as torch.optim.Muon does, so the bits
    # match; written out, b*A + c*A@A rounds three times. baddbmm does the same for each matrix of a batch.
    addmm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        A = X @ X.mT                         # A = X Xᵀ
        B = addmm(A, A, A, beta=b, alpha=c)  # B = b·A + c·A²
        X = addmm(X, B, X, beta=a)           # X = a·X + B·X
    if tall:
        X = X.mT
    return X.reshape(G.shape)


def ns_dtype_for(device_type):
    """NS5's precision on a device: bf16, the paper's, wherever matmuls have bf16 units (a GPU from Ampere on;
    a CPU with AVX512-BF16 or AMX); float32 elsewhere (older GPUs, other CPUs), where torch emulates bf16
    matmuls and NS5 runs ~18x slower (measured on a CPU)."""
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32
    if device_type != "cpu":
        return torch.bfloat16
    units = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's checks (torch >= 2.3)
    return torch.bfloat16 if any(getattr(torch.cpu, f, bool)() for f in units) else torch.float32


def muon_update(grad, momentum, beta=0.95, nesterov=True):
    """Update `momentum` (the buffer) in place; return the matrix to orthogonalise, u. grad is left unchanged.
    Moonlight writes the momentum as a sum, M = β·M + g. The EMA here is (1 - β) times that sum, and so is u;
    NS5 divides the scale away."""
    momentum.lerp_(grad, 1 - beta)  # buf = β·buf + (1 - β)·g
    return grad.lerp(momentum, beta) if nesterov else momentum  # u = (1 - β)·g + β·buf


def adjusted_lr(lr, shape, adjust_lr_fn=None):
    """The lr actually applied to NS5(u) for a matrix of `shape` = (rows, cols)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        # Keller Jordan: a tall matrix's NS5 output has smaller entries; this keeps its per-entry step comparable.
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        # Moonlight Lemma 1: NS5 output has RMS ~ sqrt(1/max(rows, cols)); this sets it to 0.2, about AdamW's.
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError("adjust_lr_fn must be None, 'original' or 'match_rms_adamw', "
                         f"got {adjust_lr_fn!r}")
    return lr * ratio  # lr times the ratio, as torch.optim.Muon associates it: the same float


class Muon(torch.optim.Optimizer):
    """
    Muon for 2-D weight matrices; a param group tagged kind="adamw" gets AdamW instead, so one optimizer does the
    usual split (configure_muon builds it), as KellerJordan/Muon's `use_muon` groups and nanochat's MuonAdamW do.
    Defaults follow KellerJordan/Muon: lr 0.02, no weight decay (torch.optim.Muon: 1e-3 and 0.1). An AdamW group
    brings its own lr; betas (0.9, 0.95), eps 1e-8 and fused None unless it gives them. Its step is
    torch.optim.AdamW's own function on torch.optim.AdamW's state, so the bits are AdamW's.
    State: state[p]["momentum_buffer"] (Muon); "step", "exp_avg", "exp_avg_sq" (AdamW); state_dict() is torch's.
    One process: under DDP or FSDP2, tools/sharded_muon.ShardedMuon shares NS5 out over the ranks.
    A variant changes the update of one matrix by overriding muon_step (lessons/muon_variants.py).
    """

    # where step() runs muon_steps (NS5 batched per shape); elsewhere muon_step, matrix by matrix. A
    # batch may round differently from its matrices one by one (odd shapes, 7 x 129, on a CPU).
    # python -m lab.bench --muon times NS5 both ways.
    batched_devices = ("cuda", "cpu")

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
                 adjust_lr_fn=None, ns_dtype=torch.bfloat16):
        _check_hyperparameters(lr, momentum, weight_decay)
        defaults = dict(kind="muon", lr=lr, momentum=momentum, nesterov=nesterov,
                        weight_decay=weight_decay, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self.ns_dtype = ns_dtype  # bf16 (paper); ns_dtype_for(device) says where float32 is faster
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        # raises before anything is registered
        group = _checked_param_group(param_group, self.defaults)
        super().add_param_group(group)
        if group["kind"] == "adamw":  # Optimizer filled in Muon's defaults too; AdamW needs none
            for key in MUON_ONLY_KEYS:
                del group[key]

    def __getstate__(self):
        """copy.deepcopy and pickle: Optimizer's own keeps only defaults, state and param_groups."""
        return {**super().__getstate__(), "ns_dtype": self.ns_dtype}

    def _momentum_buffer(self, p):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    @torch.no_grad()
    def step(self, closure=None, kinds=("muon", "adamw")):
        """One step of every group whose kind is in kinds (lab/bench.py times Muon's groups alone
        this way)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["kind"] not in kinds or not params:
                continue
            if group["kind"] == "adamw":
                _adamw_step(self, params, group)  # torch.optim.AdamW's arithmetic (bottom of file)
                continue
            # a variant's own muon_step runs matrix by matrix
            batched = (params[0].device.type in self.batched_devices
                       and type(self).muon_step is Muon.muon_step)
            self.update_matrices(params, group, batched)
        return loss

    def update_matrices(self, params, group, batched):
        """One Muon group's update: stacked by shape (muon_steps) or matrix by matrix (muon_step).
        NS5 needs whole matrices: FSDP2's row shards (DTensor) go to tools/sharded_muon.ShardedMuon."""
        if hasattr(params[0], "device_mesh"):
            raise ValueError("Muon got FSDP2-sharded (DTensor) parameters, and NS5 needs whole matrices; "
                             "use tools/sharded_muon.ShardedMuon, which gathers them")
        if batched:
            self.muon_steps(params, group)
        else:
            for p in params:
                self.muon_step(p, group)

    def muon_step(self, p, group):
        """Muon's update of one matrix: momentum, NS5, decoupled weight decay, the adjusted lr."""
        u = muon_update(p.grad, self._momentum_buffer(p), group["momentum"], group["nesterov"])
        o = zeropower_via_newtonschulz5(u, steps=group["ns_steps"], dtype=self.ns_dtype)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(o, alpha=-adjusted_lr(group["lr"], p.shape, group["adjust_lr_fn"]))

    def muon_steps(self, params, group):
        """muon_step for every matrix of `params`, with one NS5 per shape: the matrices of one shape (q, k, v, o of
        every layer; gate and up) stacked, so each product is one batched matmul (baddbmm) instead of one small
        matmul per matrix, and the momentum and the update one foreach kernel per shape instead of one per matrix.
        Per matrix the same arithmetic as muon_step (tests/test_muon.py: equal on CPU)."""
        beta, lr = group["momentum"], group["lr"]
        for shape, ps in by_shape(params).items():
            grads, bufs = [p.grad for p in ps], [self._momentum_buffer(p) for p in ps]
            torch._foreach_lerp_(bufs, grads, 1 - beta)  # as muon_update
            us = torch._foreach_lerp(grads, bufs, beta) if group["nesterov"] else bufs
            o = zeropower_via_newtonschulz5(torch.stack(us), steps=group["ns_steps"],
                                            dtype=self.ns_dtype)
            torch._foreach_mul_(ps, 1 - lr * group["weight_decay"])
            # exact (bf16 -> fp32), and one dtype keeps the foreach kernel fused on CUDA
            o = o.to(ps[0].dtype)
            torch._foreach_add_(ps, list(o.unbind(0)),
                                alpha=-adjusted_lr(lr, shape, group["adjust_lr_fn"]))

    def load_state_dict(self, state_dict):
        # no kind: Muon's, as add_param_group
        saved = [g.get("kind", "muon") for g in state_dict["param_groups"]]
        kinds = [g["kind"] for g in self.param_groups]
        if saved != kinds:
            raise ValueError(f"the saved param groups are of kinds {saved}, this optimizer's of "
                             f"kinds {kinds}; build the optimizer with the groups it was saved "
                             "with (configure_muon: "
                             "muon, adamw, adamw)")
        super().load_state_dict(state_dict)
        for group, kind in zip(self.param_groups, kinds):
            group.setdefault("kind", kind)


def by_shape(params):
    """{shape: the params of that shape}, shapes and params in the order of params."""
    groups = {}
    for p in params:
        groups.setdefault(tuple(p.shape), []).append(p)
    return groups


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


def configure_muon(model, head_names=("lm_head",), muon_lr=0.02, adamw_lr=3e-4,
                   muon_weight_decay=0.0, adamw_weight_decay=0.0, momentum=0.95, nesterov=True,
                   ns_steps=5, adjust_lr_fn=None, adamw_betas=(0.9, 0.95), adamw_eps=1e-8,
                   fused=None, ns_dtype=torch.bfloat16):
    """
    The usual split as one Muon with three groups: kind "muon" for the hidden matrices (split_muon_params), kind
    "adamw" for the 2-D rest (embeddings, head: adamw_weight_decay) and for the 1-D rest (norm gains, biases: no
    decay). Each group records its own "initial_lr" (0.02 and 3e-4 by default), so a schedule scales it:

        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * lr_mult(it)      # not g["lr"] = lr, which gives Muon AdamW's lr

    torch.optim.lr_scheduler does the same (LambdaLR(opt, lr_mult), CosineAnnealingLR, SequentialLR, ...).
    With adjust_lr_fn="match_rms_adamw" and muon_lr = adamw_lr, one lr serves both (Moonlight §2.2), and a loop
    that sets one lr for every group is then right.
    """
    muon_params, adamw_params = split_muon_params(model, head_names)
    adamw = dict(kind="adamw", lr=adamw_lr, initial_lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                 fused=fused)
    # Groups are dicts so that an empty list (e.g. a model with no hidden matrix or no norm) is allowed.
    groups = [dict(kind="muon", params=muon_params, lr=muon_lr, initial_lr=muon_lr,
                   weight_decay=muon_weight_decay),
              dict(adamw, params=[p for p in adamw_params if p.ndim >= 2],
                   weight_decay=adamw_weight_decay),
              dict(adamw, params=[p for p in adamw_params if p.ndim < 2], weight_decay=0.0)]
    return Muon(groups, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype)


# ----------------------------------------------------------------------------- argument checks
# Kept out of Muon so that the class reads as the algorithm; they refuse bad input before anything is registered.

MUON_ONLY_KEYS = ("momentum", "nesterov", "ns_steps", "adjust_lr_fn")
ADAMW_DEFAULTS = dict(betas=(0.9, 0.95), eps=1e-8, fused=None)  # an AdamW group's unless it says


def _check_hyperparameters(lr, momentum, weight_decay):
    if lr < 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def _checked_param_group(param_group, defaults):
    """param_group with its params as a list (and an AdamW group with AdamW's defaults), or ValueError: an unknown
    kind, an AdamW group without its lr, a non-2-D parameter for Muon, an unknown adjust_lr_fn."""
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    group = {**param_group, "params": params}
    kind = group.setdefault("kind", defaults["kind"])
    if kind == "adamw":
        if "lr" not in group:
            raise ValueError("an AdamW group needs its own lr (Muon's default 0.02 is far too high "
                             "for AdamW), "
                             "e.g. {'params': [...], 'kind': 'adamw', 'lr': 3e-4}")
        _check_hyperparameters(group["lr"], 0.0, group.get("weight_decay", 0.0))
        return {**ADAMW_DEFAULTS, **group}
    if kind != "muon":
        raise ValueError(f"a param group's kind must be 'muon' or 'adamw', got {kind!r}")
    _check_hyperparameters(group.get("lr", 0.0), group.get("momentum", 0.0),
                           group.get("weight_decay", 0.0))
    for p in params:
        if p.ndim != 2:
            raise ValueError(
                f"Muon only takes 2-D weight matrices, got a parameter of shape {tuple(p.shape)}; "
                "biases, norm gains and other non-2-D parameters belong to AdamW "
                "(a group with kind='adamw'; configure_muon does this split for you)")
    adjusted_lr(1.0, (1, 1), group.get("adjust_lr_fn", defaults["adjust_lr_fn"]))  # unknown: raises
    return group


# ----------------------------------------------------------------------------- AdamW groups
# torch.optim.AdamW's step is the function torch.optim.adamw.adamw over the state it creates here; calling the
# same function on the same state gives the same bits on every device, foreach or fused, as torch.optim.AdamW.


def _adamw_step(opt, params, group):
    """torch.optim.AdamW.step for one group (amsgrad and maximize off)."""
    states = []
    for p in params:
        state = opt.state[p]
        if not state:  # as torch.optim.AdamW: the step count stays on the CPU unless fused
            state["step"] = torch.zeros((), dtype=torch.float32,
                                        device=p.device if group["fused"] else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states.append(state)
    beta1, beta2 = group["betas"]
    # foreach: each arithmetic step one op for the whole group; torch.optim.AdamW's default on CUDA,
    # and on the CPU the same bits as its per-tensor loop (tests/test_muon.py). FSDP2 keeps torch's.
    foreach = None if group["fused"] or any(hasattr(p, "device_mesh") for p in params) else True
    adamw_functional(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                     [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                     foreach=foreach,
                     fused=group["fused"], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


if __name__ == "__main__":
    torch.manual_seed(0)
    G = torch.randn(256, 128)
    O = zeropower_via_newtonschulz5(G).float()
    S = torch.linalg.svdvals(O)
    print(f"NS5 of a 256x128 Gaussian: singular values in [{S.min():.3f}, {S.max():.3f}] "
          "(expect ~[0.5, 1.5])")
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
        print(f"max |ours - torch.optim.Muon| after 3 steps: {(p1 - p2).abs().max().item()} "
              "(0.0 = bitwise equal)")

    # A schedule for Muon + AdamW: each group scales its own initial lr (here a 4-step linear warmup).
    # weights -> Muon, biases -> AdamW
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = configure_muon(model, muon_lr=0.02, adamw_lr=3e-4)
    lr_mult = lambda it: min(1.0, (it + 1) / 4)  # noqa: E731
    for it in range(5):
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * lr_mult(it)
        lrs = [g["lr"] for g in opt.param_groups]
        print(f"step {it}: lr per group (Muon, AdamW 2-D, AdamW 1-D) = {lrs}")
    opt = configure_muon(model, muon_lr=0.02, adamw_lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_mult)  # the same schedule
    for _ in range(4):
        opt.step()  # (no gradients here: nothing moves)
        sched.step()
    print(f"LambdaLR after 4 steps: {sched.get_last_lr()} (expect the step 4 line above)")
