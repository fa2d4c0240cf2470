"""
From an autoregressive ternary model to a masked-diffusion language model (DLM).

A masked-diffusion LM (LLaDA, Nie et al., arXiv 2502.09992, sec. 2.1 and Algorithm 1) is trained to
fill in masked tokens with bidirectional attention; it generates by starting from an all-mask
continuation and unmasking it over a fixed number of steps. Dream-7B (Ye et al., arXiv 2508.15487,
sec. 2) adapts such a model from an AR one instead of training from scratch. Three pieces, each a
function below:

1. The mask token (add_mask_token). The trained model gets one more embedding row (the tied head
   gets it too), id = the old vocabulary size, initialised to the MEAN of the existing rows
   (init="mean") or at random (init="random", which converts no worse than the mean at our scale:
   see add_mask_token). The mask id is never a prediction: its logit is set to -inf in the loss and
   in the sampler.
2. The objective (masked_diffusion_loss), LLaDA's estimator of the negative ELBO:
       t ~ U(0, 1) per sequence,  p = (1 - eps)·t + eps  (eps = 1e-3),  each token masked with p
       loss = sum over masked positions i of CE(logits_i, x_i) / p,  divided by B·L
   with bidirectional attention (GPTConfig.causal = False); unmasked positions contribute nothing.
   shift=True is Dream's AR-to-diffusion shift: the prediction for position i is read from position
   i - 1's output, the alignment the AR head was trained for (position i - 1 predicts token i), so
   the converted model starts from a good predictor and needs only to learn to use the right-hand
   context; position 0 has no left neighbour and is never masked.
3. The sampler (generate): prompt + gen_len masks; at each of `steps` steps predict every masked
   position and commit k of the predictions (k = masked left / steps left), the k chosen at random
   (remasking="random", LLaDA sec. 2.4's reverse process) or the k most confident
   ("low_confidence"), leaving the others masked.

Convert and sample (stage "dlm" of train.py; sample.py --dlm=True):
    python train.py --stage=dlm --init_from=out/stage2/ckpt.pt
Test: python -m pytest tests/test_dlm.py
"""

import contextlib
import math

import torch
import torch.nn.functional as F

from model import GPT, GPTConfig

EPS = 1e-3  # LLaDA's floor on the mask probability


@torch.no_grad()
def add_mask_token(model, init="mean", seed=0, scale=0.02):
    """A copy of model (a trained AR GPT) with one more token, the mask, and bidirectional
    attention. Returns (dlm_model, mask_id). init: "mean" (mean of the existing embedding rows) or
    "random" (N(0, scale^2)).

    The source notes' finding: a mask row drawn at random (N(0, 0.02), the embedding's own init) is
    an activation outlier after RMSNorm, and BitNet's per-token absmax scale (127 / max|x|) then
    rounds the token's other channels to zero; initialised to the mean of the existing rows it looks
    like an average token. Measured at our scale (README, `python -m lab dlm`): the RMSNorm in front
    of every quantiser removes the random row's scale, it is no outlier, and it converts no worse
    than the mean row."""
    if init not in ("mean", "random"):
        raise ValueError(f"init must be 'mean' or 'random', got {init!r}")
    c = model.config
    conf = GPTConfig(**{**c.__dict__, "vocab_size": c.vocab_size + 1, "causal": False,
                        "doc_mask": False})
    new = GPT(conf).to(model.wte.weight.device)
    state = model.state_dict()
    old = state["wte.weight"]                                           # (V, C)
    if init == "mean":
        row = old.mean(dim=0, keepdim=True)                             # (1, C): the average token
    else:
        g = torch.Generator().manual_seed(seed)
        # 0.02: our embedding's init scale
        row = (torch.randn(1, c.n_embd, generator=g) * scale).to(old)
    state["wte.weight"] = torch.cat([old, row])                         # (V + 1, C); mask id = V
    if not c.tie_embeddings:
        state["lm_head.weight"] = torch.cat([state["lm_head.weight"], row])
    else:
        state["lm_head.weight"] = state["wte.weight"]
    new.load_state_dict(state)
    return new, c.vocab_size


def masked_diffusion_loss(model, x, mask_id, shift=False, generator=None, t=None, masked=None,
                          diagnostics=False):
    """LLaDA's 1/p-weighted CE on the masked positions of x (B, L). t (B, 1) and masked (B, L) bool
    may be given (tests); otherwise drawn with `generator` (None: torch's global RNG, which
    checkpoints save). Returns (loss, info): info["masked"], and with diagnostics the mean outlier
    ratio (see outlier_ratio) of mask tokens and of the others in this forward pass,
    info["ratio_mask"] and info["ratio_other"] (0-d tensors, no host sync)."""
    B, L = x.shape
    if t is None:
        t = torch.rand(B, 1, generator=generator, device=x.device)
    p = (1 - EPS) * t + EPS                                             # (B, 1)
    if masked is None:
        masked = torch.rand(B, L, generator=generator, device=x.device) < p
    if shift:
        masked = masked.clone()
        masked[:, 0] = False  # nothing left of position 0 to read it
    inp = torch.where(masked, mask_id, x)
    with _recording(model, diagnostics) as ratios:
        logits = predictions(model, inp, mask_id, shift)                # (B, L, V)
    ce = F.cross_entropy(logits.float().flatten(0, 1), x.flatten(), reduction="none").view(B, L)
    loss = (ce * masked / p).sum() / (B * L)  # unmasked positions: weight 0
    info = {"masked": masked}
    if diagnostics:
        r = torch.stack(ratios).mean(dim=0)  # (B, L): per token, over the norms
        is_mask = inp == mask_id
        info["ratio_mask"] = (r * is_mask).sum() / is_mask.sum().clamp(min=1)
        info["ratio_other"] = (r * ~is_mask).sum() / (~is_mask).sum().clamp(min=1)
    return loss, info


def predictions(model, idx, mask_id, shift=False, vocab=None):
    """Logits for every position of idx (B, L), the mask id excluded (and with vocab, the padding rows
    from vocab on: ids no tokenizer decodes); with shift, position i reads i - 1."""
    logits = model.forward_with_states(idx, all_logits=True)[0]         # (B, L, V), bidirectional
    ids = torch.arange(logits.size(-1), device=idx.device)
    logits = logits.masked_fill((ids == mask_id) | (ids >= (vocab or logits.size(-1))), float("-inf"))
    if shift:  # position 0 keeps its own (it is never masked); i >= 1 takes i - 1's
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return logits


@torch.no_grad()
def generate(model, prompt, gen_len, steps, mask_id, shift=False, temperature=0.0, top_k=None,
             remasking="low_confidence", generator=None, vocab=None):
    """prompt (1, P) -> (1, P + gen_len): the continuation filled in `steps` steps, k tokens a step,
    the k chosen by remasking ("low_confidence": the most confident; "random": uniformly).
    temperature 0 is greedy; vocab: the tokenizer's size, the model's rows past it (--pad_vocab) never drawn.

    Which k (LLaDA sec. 2.4): uniformly at random is the reverse process itself; the k most
    confident is LLaDA's annealing-like heuristic. Low-confidence remasking needs a model whose
    guesses far from any context are unsure; a small one is surest of the commonest token (a space,
    for Shakespeare bytes) everywhere, commits those first, and the spaces then feed themselves:
    sample.py uses random remasking by default for that reason (README's "Diffusion LM" shows
    both)."""
    if prompt.size(1) + gen_len > model.config.block_size:
        raise ValueError(f"prompt {prompt.size(1)} + gen_len {gen_len} > block_size "
                         f"{model.config.block_size}")
    if remasking not in ("low_confidence", "random"):
        raise ValueError(f"remasking must be 'low_confidence' or 'random', got {remasking!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got "
                         f"{temperature!r}")
    masks = torch.full((1, gen_len), mask_id, dtype=prompt.dtype, device=prompt.device)
    x = torch.cat([prompt, masks], dim=1)
    for s in range(steps):
        masked = x == mask_id
        left = int(masked.sum())
        if left == 0:
            break
        logits = predictions(model, x, mask_id, shift, vocab).float()   # (1, L, V)
        if top_k is not None and top_k < logits.size(-1):
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        # the max subtracted first: a tiny temperature sharpens to the argmax, never inf - inf
        if temperature > 0:
            tiny = torch.finfo(logits.dtype).tiny
            z = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, tiny)
            probs = F.softmax(z, dim=-1)
            pred = torch.multinomial(probs[0], 1, generator=generator).T  # (1, L)
        else:
            probs = F.softmax(logits, dim=-1)
            pred = probs.argmax(dim=-1)                                 # (1, L)
        if remasking == "low_confidence":
            # (1, L): the chosen token's probability under the logits themselves (LLaDA's generate.py: the
            # temperature only draws the token)
            conf = probs if temperature == 0 else F.softmax(logits, dim=-1)
            score = conf.gather(-1, pred.unsqueeze(-1)).squeeze(-1)
        else:
            where = generator.device if generator else None
            score = torch.rand(x.shape, generator=generator, device=where)
            score = score.to(x.device)
        score = score.masked_fill(~masked, -1.0)  # only masked positions compete
        k = math.ceil(left / (steps - s))  # commit k now, the rest later
        commit = score[0].topk(k).indices
        x[0, commit] = pred[0, commit]
    return x

# --------------------------------------------------------------- the diagnostic the claim is about


@torch.no_grad()
def outlier_ratio(model, idx, mask_id):
    """max|y| / mean|y| per token, y being what each quantised layer's activation quantiser sees
    (the output of the RMSNorm before it, before quantisation), averaged over those norms: (mean
    over mask tokens, mean over the others). A large ratio means the per-token int8 scale 127 /
    max|y| leaves the token's typical channel only a few levels, or rounds it to zero."""
    with _recording(model) as ratios:
        model.forward_with_states(idx, all_logits=True)
    r = torch.stack(ratios).mean(dim=0)                                  # (B, L)
    is_mask = idx == mask_id
    return (r[is_mask].mean().item() if is_mask.any() else float("nan"),
            r[~is_mask].mean().item() if (~is_mask).any() else float("nan"))


@contextlib.contextmanager
def _recording(model, on=True):
    """Collects, during a forward pass, each QuantRMSNorm's per-token max|y| / mean|y| (B, L) into a
    list."""
    from model import QuantRMSNorm  # quant.py's, as model.py uses it
    ratios = []

    def hook(mod, inputs, out):
        with torch.no_grad():
            y = F.rms_norm(inputs[0].float(), mod.normalized_shape, mod.weight.float(), mod.eps)
            ratios.append(y.abs().amax(dim=-1) / y.abs().mean(dim=-1).clamp(min=1e-12))

    norms = [m for m in model.modules() if isinstance(m, QuantRMSNorm)] if on else []
    if on and not norms:
        raise ValueError("no QuantRMSNorm in the model: it is not a ternary (quant=True) model")
    handles = [m.register_forward_hook(hook) for m in norms]
    try:
        yield ratios
    finally:
        for h in handles:
            h.remove()
