"""
BitDistill stage 3: distil a full-precision teacher into the ternary student.

The Stage-1 fp model (with SubLN) is the frozen teacher; the Stage-2 ternary model is the student. Besides
the usual next-token cross-entropy, the student matches the teacher's softened output distribution
(logits KD) and, with kd_relation > 0, on one late layer the teacher's Q-Q, K-K and V-V self-relations
(MiniLM-v2 style), which works even when teacher and student have different head counts. Not part of
BitDistill, off by default: hidden states pulled toward the teacher's (kd_hidden > 0), and several teachers.
Sources: BitDistill, arXiv 2510.13998 (Eqs. for L_LD, L_AD and the total) and its authors' trainer; MiniLM-v2,
arXiv 2012.15828 (relations); TinyBERT, arXiv 1909.10351, section 3.1 (hidden states); Hinton et al., arXiv
1503.02531, section 2 (an ensemble of teachers). Each function's docstring says where we depart from them.

    L        = L_CE + kd_logits * L_LD + kd_relation * L_AD + kd_hidden * L_hidden   (kd_hidden = 0: off)
               The paper writes lambda for kd_logits and gamma for kd_relation; here those two letters are BitNet's
               quantisation blend and weight scale (quant.py), so the distillation weights say what they weigh.
    L_LD     = tau^2 * mean_{valid tokens} sum_v p_t(v) (log p_t(v) - log p_s(v)),  p = softmax(z / tau), tau = 5
               v over the tokenizer's ids (BitDistillLoss(vocab=): not a --pad_vocab model's padding rows)
               K teachers: p_t = sum_k w_k softmax(z_k / tau), sum_k w_k = 1 (default w_k = 1/K)
    L_AD     = (1/A_r) * sum_{X in Q,K,V} mean_{b, a, i} KL(R_t[b,a,i,:] || R_s[b,a,i,:])
               R = softmax(X_hat X_hat^T / t) over keys, t = 1, where X (B, H, T, d) is concatenated to
               (B, T, H*d), re-split into A_r relation heads of d_r = H*d / A_r and L2-normalised (X_hat)
    L_hidden = sum_l w_l * MSE(normalize(h_s^l), normalize(h_t^g(l))),  w_l = l / (1 + ... + n), l = 1..n
               (widths differ: MSE(h_hat_s h_hat_s^T, h_hat_t h_hat_t^T); g(l) = ceil(l * n_t / n_s))

BitDistillLoss() is the "logits" preset, kd_logits = 1 and kd_relation = 0, train.py's default (measured: relation
KD never beat logits KD alone here, lab/results/distill.md); the paper's presets are in PRESETS.
The teacher is never differentiated: every teacher tensor is detached here.

Test: python -m pytest tests/test_distill.py      Demo: python distill.py
"""
import math

import torch
import torch.nn.functional as F

# On the shipped workload relation KD at kd_relation 1..1e3 never beat logits KD alone, and the paper's 1e3 lost to it
# (python -m lab distill, lab/results/distill.md): hence our "logits" preset, the default here and in train.py.
PRESETS = {
    "classification": dict(kd_logits=10.0, kd_relation=1e5),  # the paper's
    "summarization": dict(kd_logits=1.0, kd_relation=1e3),    # the paper's
    "logits": dict(kd_logits=1.0, kd_relation=0.0),           # ours, measured: the default
}


def logits_kd_loss(student_logits, teacher_logits, temperature=5.0, mask=None, weights=None):
    """tau^2 * KL(p_t || softmax(z_s/tau)), summed over V, averaged over valid tokens.
    teacher_logits: one (..., V) tensor, p_t = softmax(z_t/tau); or a list of them (several teachers), and
    then p_t = sum_k w_k softmax(z_k/tau), the weighted mixture of the tempered distributions (weights:
    one per teacher, >= 0, normalised; None = equal): Hinton et al.'s averaged predictions of an ensemble. With
    several teachers, relations and hidden states come from the first one."""
    teachers = list(teacher_logits) if isinstance(teacher_logits, (list, tuple)) else [teacher_logits]
    for z in teachers:
        if student_logits.shape != z.shape:
            raise ValueError(f"logits shapes differ: student {tuple(student_logits.shape)}, teacher "
                             f"{tuple(z.shape)}; both must be (..., V) over the same vocabulary")
    w = [1.0] * len(teachers) if weights is None else [float(x) for x in weights]
    if len(w) != len(teachers) or min(w) < 0 or sum(w) <= 0:
        raise ValueError(f"weights must be {len(teachers)} numbers >= 0 with a positive sum, got {w}")
    log_ps = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (..., V), fp32 even for bf16 inputs
    # log p_t = log sum_k w_k p_k = logsumexp_k(log w_k + log p_k); with one teacher exactly log p_1
    log_pt = torch.logsumexp(torch.stack([math.log(wk / sum(w)) + F.log_softmax(z.detach().float() / temperature, -1)
                                          for wk, z in zip(w, teachers) if wk > 0]), dim=0)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1)  # (...)
    if mask is None:
        return temperature ** 2 * kl.mean()
    if mask.shape != kl.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must be the logits shape without V, {tuple(kl.shape)}")
    mask = mask.bool()
    # where (not indexing) avoids a host sync; clamp makes an all-masked batch give 0 instead of 0/0
    return temperature ** 2 * torch.where(mask, kl, 0.0).sum() / mask.sum().clamp(min=1)


def _check_relation_sizes(sizes, n_relation_heads):
    """sizes: {name: H*d}. Raise, suggesting the largest common divisor <= n_relation_heads, if any is uneven."""
    bad = {k: v for k, v in sizes.items() if v % n_relation_heads}
    if bad:
        g = 0
        for v in sizes.values():
            g = math.gcd(g, v)
        ok = max(a for a in range(1, n_relation_heads + 1) if g % a == 0)
        found = ", ".join(f"{k} H*d={v}" for k, v in sizes.items())
        raise ValueError(f"n_relation_heads={n_relation_heads} must divide H*d of every Q/K/V tensor, but not "
                         f"{sorted(bad)}; found {found}. Try n_relation_heads={ok} (largest common divisor "
                         f"<= {n_relation_heads})")


def _gram(x):
    """x x^T over the last two dims, in fp32: autocast (bf16, or fp16 on an older GPU) would run the matmul in 16
    bits, rounding relation scores in [-1, 1] to steps of ~0.004 (bf16) before the softmax."""
    with torch.autocast(x.device.type, enabled=False):
        x = x.float()
        return x @ x.transpose(-2, -1)


def _relation_heads(x, n_relation_heads):
    """(B, H, T, d) -> concat heads -> re-split -> L2-normalise: (B, A_r, T, d_r), fp32."""
    B, H, T, d = x.shape
    x = x.float().transpose(1, 2).reshape(B, T, n_relation_heads, H * d // n_relation_heads)  # (B, T, A_r, d_r)
    return F.normalize(x.transpose(1, 2), dim=-1)


def _log_relation(x_hat, allowed, temperature):
    """log R = log_softmax(x_hat x_hat^T / t) over allowed keys; disallowed entries are set to 0."""
    scores = _gram(x_hat) / temperature  # (B, A_r, T, T)
    return scores.masked_fill(~allowed, float("-inf")).log_softmax(-1).masked_fill(~allowed, 0.0)


def attention_relation_loss(student_qkv, teacher_qkv, n_relation_heads, temperature=1.0, mask=None,
                            causal=True):
    """MiniLM-v2 relation KD summed over Q, K, V and divided by A_r. *_qkv: (q, k, v), each (B, H, T, d).
    mask: (B, T), True = valid token; invalid tokens are excluded as queries (rows) and as keys.
    Departure from MiniLM-v2 and the paper's printed L_AD (softmax(X X^T / sqrt(d_r)) of the vectors as they are):
    each relation head is L2-normalised and t = 1, as the authors' trainer computes it: another scale than the
    printed form's, and kd_relation's weights (the presets' 1e3, 1e5) are on the trainer's."""
    if len(student_qkv) != 3 or len(teacher_qkv) != 3:
        raise ValueError("student_qkv and teacher_qkv must each be a (q, k, v) tuple of (B, H, T, d) tensors")
    sizes = {}
    for name, xs, xt in zip("QKV", student_qkv, teacher_qkv):
        if xs.dim() != 4 or xt.dim() != 4 or xs.shape[0] != xt.shape[0] or xs.shape[2] != xt.shape[2]:
            raise ValueError(f"{name}: expected (B, H, T, d) with equal B and T, got student "
                             f"{tuple(xs.shape)}, teacher {tuple(xt.shape)}")
        sizes[f"student {name}"] = xs.shape[1] * xs.shape[3]
        sizes[f"teacher {name}"] = xt.shape[1] * xt.shape[3]
    _check_relation_sizes(sizes, n_relation_heads)
    B, _, T, _ = student_qkv[0].shape
    device = student_qkv[0].device
    # Departure from the authors' trainer (softmax over all T keys, as in bidirectional MiniLM-v2): by default
    # token i relates only to keys j <= i, because a decoder's attention at i never sees the future, so
    # future-key relations train structure the student never uses (and cross into the next packed document;
    # keys of earlier documents in the row stay related, even where --doc_mask keeps the model's attention off
    # them); the masked entries are excluded from both softmaxes, so identical inputs still give exactly 0.
    # causal=False reproduces the authors' relation exactly.
    allowed = torch.ones(T, T, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed.tril()
    weight = torch.ones(B, 1, T, device=device)  # (B, 1, T) row weights, broadcast over A_r
    if mask is not None:
        if mask.shape != (B, T):
            raise ValueError(f"mask shape {tuple(mask.shape)} must be (B, T) = {(B, T)}")
        valid = mask.bool()
        # every row keeps its diagonal so no softmax is over an empty set; invalid rows get weight 0 anyway
        allowed = (allowed & valid[:, None, None, :]) | torch.eye(T, dtype=torch.bool, device=device)
        weight = valid.float()[:, None, :]
    n_rows = weight.sum().clamp(min=1) * n_relation_heads
    loss = torch.zeros((), device=device)
    for xs, xt in zip(student_qkv, teacher_qkv):
        log_rs = _log_relation(_relation_heads(xs, n_relation_heads), allowed, temperature)
        log_rt = _log_relation(_relation_heads(xt.detach(), n_relation_heads), allowed, temperature)
        kl = (log_rt.exp() * (log_rt - log_rs)).sum(-1)  # (B, A_r, T); masked entries contribute 1 * (0 - 0)
        loss = loss + (kl * weight).sum() / n_rows
    return loss / n_relation_heads  # the authors also divide by A_r after the row mean


def late_layer_weights(n):
    """Linearly increasing weights 1..n, normalised to sum 1: later layers count more."""
    return [(i + 1) / (n * (n + 1) / 2) for i in range(n)]


def match_layers(n_student, n_teacher):
    """Teacher block for each student block when depths differ (TinyBERT's uniform map g(m) = m * N / M):
    student block m (1-based) reads teacher block ceil(m * N / M); equal depths map one to one."""
    return [math.ceil((m + 1) * n_teacher / n_student) - 1 for m in range(n_student)]


def hidden_state_loss(student_hiddens, teacher_hiddens, layer_weights=None):
    """Weighted MSE between L2-normalised hidden states of matched layers, each (B, T, C).
    Equal widths: the states themselves. Different widths C_s != C_t: the token-by-token cosine-similarity
    matrices S = h_hat h_hat^T (B, T, T), which have the same size whatever the width (no projection to learn).
    Departure from TinyBERT (section 3.1), which compares the raw states through a learned projection: here both
    states are L2-normalised, so only their directions count, and another width needs nothing to learn."""
    if len(student_hiddens) != len(teacher_hiddens) or not student_hiddens:
        raise ValueError(f"need the same non-zero number of matched layers, got {len(student_hiddens)} student "
                         f"and {len(teacher_hiddens)} teacher hidden states")
    w = [1.0] * len(student_hiddens) if layer_weights is None else [float(x) for x in layer_weights]
    if len(w) != len(student_hiddens) or min(w) < 0 or sum(w) <= 0:
        raise ValueError(f"layer_weights must be {len(student_hiddens)} non-negative numbers with a positive "
                         f"sum, got {w}")
    loss = 0.0
    for wl, hs, ht in zip(w, student_hiddens, teacher_hiddens):
        if hs.shape[:-1] != ht.shape[:-1] or hs.dim() != 3:
            raise ValueError(f"hidden shapes differ: student {tuple(hs.shape)}, teacher {tuple(ht.shape)}; "
                             f"(B, T, C) with equal B and T required")
        hs_n, ht_n = F.normalize(hs.float(), dim=-1), F.normalize(ht.detach().float(), dim=-1)
        if hs.shape[-1] != ht.shape[-1]:  # another width: compare how tokens relate, not the vectors
            hs_n, ht_n = _gram(hs_n), _gram(ht_n)  # (B, T, T) each
        loss = loss + wl / sum(w) * F.mse_loss(hs_n, ht_n)
    return loss


class BitDistillLoss:
    """L = CE + kd_logits * LD + kd_relation * AD + kd_hidden * hidden. Overrides beat the preset; the default
    preset is "logits" (kd_logits 1, kd_relation 0), so q/k/v and hidden states are needed only when asked for.
    A call returns {loss, ce, kd_logits: L_LD, kd_relation: L_AD, kd_hidden: L_hidden}: each term unweighted,
    under the name of the weight that scales it (the names train.py logs them under in metrics.jsonl)."""

    def __init__(self, preset="logits", kd_logits=None, kd_relation=None, kd_hidden=0.0,
                 temperature=5.0, relation_temperature=1.0, n_relation_heads=32, distill_layer=-1,
                 relation_causal=True, teacher_weights=None, vocab=None):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
        self.kd_logits = float(PRESETS[preset]["kd_logits"] if kd_logits is None else kd_logits)
        self.kd_relation = float(PRESETS[preset]["kd_relation"] if kd_relation is None else kd_relation)
        self.kd_hidden = float(kd_hidden)
        self.temperature = temperature              # tau of the logits KD
        self.relation_temperature = relation_temperature  # t of the relation softmax
        self.n_relation_heads = n_relation_heads    # A_r; must divide H*d of teacher and student Q, K, V
        self.distill_layer = distill_layer          # attention layer for AD; negative counts from the end
        self.relation_causal = relation_causal      # see attention_relation_loss
        self.preset = preset
        self.teacher_weights = teacher_weights      # several teachers: weights of their tempered distributions' mixture
        self.vocab = vocab                          # the tokenizer's ids: logits KD over them (a --pad_vocab model's
                                                    # rows past them are no token); None = every row

    def layer_index(self, n_layer):
        """Resolve distill_layer for a model with n_layer blocks (call once per model if depths differ)."""
        i = self.distill_layer + n_layer if self.distill_layer < 0 else self.distill_layer
        if not 0 <= i < n_layer:
            raise ValueError(f"distill_layer={self.distill_layer} is out of range for a {n_layer}-layer model; "
                             f"use {-n_layer}..{n_layer - 1}")
        return i

    def __call__(self, student_logits, teacher_logits, targets, student_qkv=None, teacher_qkv=None,
                 student_hiddens=None, teacher_hiddens=None, ignore_index=-1, relation_mask=None):
        V = student_logits.size(-1)
        zero = torch.zeros((), device=student_logits.device)
        ce = F.cross_entropy(student_logits.float().view(-1, V), targets.view(-1), ignore_index=ignore_index)
        tokens = slice(0, self.vocab)  # None: all V
        ld = logits_kd_loss(student_logits[..., tokens], [z[..., tokens] for z in teacher_logits]
                            if isinstance(teacher_logits, (list, tuple)) else teacher_logits[..., tokens],
                            self.temperature, mask=targets != ignore_index, weights=self.teacher_weights)
        ad = hidden = zero
        if self.kd_relation != 0:
            if student_qkv is None or teacher_qkv is None:
                raise ValueError(f"kd_relation={self.kd_relation} needs student_qkv and teacher_qkv (layer "
                                 f"distill_layer={self.distill_layer}); pass them or set kd_relation=0")
            ad = attention_relation_loss(student_qkv, teacher_qkv, self.n_relation_heads,
                                         self.relation_temperature, relation_mask, self.relation_causal)
        if self.kd_hidden != 0:
            if student_hiddens is None or teacher_hiddens is None:
                raise ValueError(f"kd_hidden={self.kd_hidden} needs student_hiddens and teacher_hiddens; "
                                 f"pass them or set kd_hidden=0")
            hidden = hidden_state_loss(student_hiddens, teacher_hiddens, late_layer_weights(len(student_hiddens)))
        loss = ce + self.kd_logits * ld + self.kd_relation * ad + self.kd_hidden * hidden
        return dict(loss=loss, ce=ce, kd_logits=ld, kd_relation=ad, kd_hidden=hidden)

    def __repr__(self):
        return (f"BitDistillLoss(preset={self.preset!r}, kd_logits={self.kd_logits}, kd_relation={self.kd_relation}, "
                f"kd_hidden={self.kd_hidden}, temperature={self.temperature}, relation_temperature="
                f"{self.relation_temperature}, n_relation_heads={self.n_relation_heads}, distill_layer="
                f"{self.distill_layer}, relation_causal={self.relation_causal}" +
                (f", teacher_weights={self.teacher_weights})" if self.teacher_weights else ")"))


def teacher_student_loss(student, teachers, crit, n_student_layers):
    """loss(x, y) -> (loss, parts): crit (a BitDistillLoss) of the student against frozen teachers.
    student(x, y, **kw) returns (logits, loss, states) and the first teacher's forward_with_states(x,
    all_logits=True, **kw) (logits, None, states); the first teacher also gives the relations (crit.distill_layer) and hidden states
    (student block -> teacher block by match_layers) as crit weighs them, the others their logits;
    no teacher is differentiated."""
    kw = dict(qkv_layer=crit.distill_layer if crit.kd_relation != 0 else None,
              hiddens=crit.kd_hidden != 0)
    first, others = teachers[0], teachers[1:]
    layers = match_layers(n_student_layers, first.config.n_layer)

    def loss(x, y):
        s_logits, _, s = student(x, y, **kw)
        with torch.no_grad():  # every position's logits, no cross-entropy: a teacher's loss is never used
            t_logits, _, t = first.forward_with_states(x, all_logits=True, **kw)
            t_logits = [t_logits] + [m.forward_with_states(x, all_logits=True)[0] for m in others]
        t_hiddens = [t["hiddens"][i] for i in layers] if t["hiddens"] else None
        parts = crit(s_logits, t_logits, y, s["qkv"], t["qkv"], s["hiddens"] or None, t_hiddens)
        return parts["loss"], parts
    return loss


if __name__ == "__main__":
    torch.manual_seed(0)
    # closed form: V=2, tau=2, z_t=(2,0), z_s=(0,0): tau^2 * KL(softmax(1,0) || (1/2,1/2))
    p = 1 / (1 + math.exp(-1))
    expected = 4 * (p * math.log(2 * p) + (1 - p) * math.log(2 * (1 - p)))
    got = logits_kd_loss(torch.zeros(1, 2), torch.tensor([[2.0, 0.0]]), temperature=2.0).item()
    print(f"LD closed form: expected {expected:.6f}, got {got:.6f}")
    B, T, V = 2, 16, 64
    qkv_t = tuple(torch.randn(B, 4, T, 8) for _ in range(3))   # teacher: 4 heads of 8
    qkv_s = tuple(torch.randn(B, 2, T, 16, requires_grad=True) for _ in range(3))  # student: 2 heads of 16
    z_t, targets = torch.randn(B, T, V), torch.randint(0, V, (B, T))
    z_s = torch.randn(B, T, V, requires_grad=True)
    crit = BitDistillLoss("summarization", n_relation_heads=4)
    print(crit, "| distill layer of a 12-layer model:", crit.layer_index(12))
    print("identical teacher/student: ld =", logits_kd_loss(z_t, z_t).item(),
          "ad =", attention_relation_loss(qkv_t, qkv_t, 4).item())
    opt = torch.optim.Adam([z_s, *qkv_s], lr=0.1)
    for step in range(101):
        out = crit(z_s, z_t, targets, qkv_s, qkv_t)
        if step % 25 == 0:
            print(f"step {step:3d} " + " ".join(f"{k} {v.item():.4f}" for k, v in out.items()))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
