"""
SubLN in a pretrained model: what its gain should be.

BitDistill (arXiv 2510.13998, section 3.1, stage 1) puts one more RMSNorm, SubLN, right before
o_proj and down_proj of a pretrained model, with a learnable gain initialised to 1, so that the
inputs of those two quantised matrices are well scaled. Unit gain rescales every token's input to
rms 1, so the converted model no longer computes what the published one did, even at lambda 0
(lab/results/convert.md: SmolLM2-135M 3.97 -> 15.60). A calibrated gain (our question, not the
paper's) keeps the function where it can:

    SubLN(y) = y / rms(y) * g,   g = c * 1,   c = mean over calibration tokens of rms(y)

so SubLN(y) = y * c / rms(y): the identity when rms(y) is the same for every token, close where it
varies little (measured on SmolLM2, whose first token carries massive activations:
lab/results/smollm2.md, row subln_cal). The rms is measured on the model as published: every
BitLinear at lambda 0 (the fp layer) and every SubLN the identity while measuring. train.py
--subln_gain=calibrated.
Test: python -m pytest tests/test_convert.py
"""

import torch


@torch.no_grad()
def calibrate_subln(model, batches):
    """--subln_gain=calibrated: each SubLN's gain becomes c = the mean over tokens of rms(y), y the
    norm's input in the model as published (every SubLN the identity while measuring), so that
    SubLN(y) = y * c / rms(y) is the identity wherever rms(y) is the same for every token, and close
    to it where it varies little. The model is measured at lambda 0 (a BitLinear then computes its
    fp layer); each lambda_ is put back as it was after. batches: [(x, y), ...], at least one with
    tokens (no tokens: no mean, a ValueError)."""
    batches = list(batches)
    if not any(x.numel() for x, _ in batches):
        raise ValueError("calibrate_subln needs at least one batch of tokens to measure the SubLN "
                         "inputs on")
    norms = [m for block in model.h for m in (block.attn.subln, block.mlp.subln)]
    sums = {m: torch.zeros(2) for m in norms}  # (sum of rms over tokens, tokens)

    def measure(module, inputs, output):
        y = inputs[0].float()
        rms = torch.sqrt(y.pow(2).mean(-1) + module.eps)  # (B, T), as the norm computes it
        sums[module] += torch.stack([rms.sum(), torch.tensor(float(rms.numel()))]).cpu()
        return inputs[0]  # the identity: the model as published
    lambdas = {name: buf.clone() for name, buf in model.named_buffers() if name.endswith("lambda_")}
    hooks = [m.register_forward_hook(measure) for m in norms]
    bufs = dict(model.named_buffers())
    try:
        for name in lambdas:  # the model as published: every BitLinear its fp layer (lambda 0)
            bufs[name].fill_(0.0)
        for x, _ in batches:
            model(x.to(model.wte.weight.device))
    finally:
        for h in hooks:
            h.remove()
        for name, lam in lambdas.items():
            bufs[name].copy_(lam)
    for m in norms:
        m.weight.fill_(float(sums[m][0] / sums[m][1]))
