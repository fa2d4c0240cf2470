"""
Scoring a finished lab run, the same way for every row whatever it logged itself: its final checkpoint's
loss over the WHOLE validation split (every window of T+1 tokens once, no sampling: metrics.whole_val_loss,
the number train.py's final evaluation prints), a masked-diffusion checkpoint's masked-token loss at a mask
rate t, and what its records measure (optimizer state bytes, the DLM outlier ratios). lab/runner.py calls
these on each run; a failure is one LabError line.
Test: python -m pytest tests/test_lab.py -k "full_val_loss or dlm"
"""

import statistics

import numpy as np
import torch
import torch.nn.functional as F

import data
from lab.tables import LabError
from tools import checkpoint, load, metrics


def full_val_loss(ckpt_path, shard_dir, batch_size=16, device="cpu"):
    """Mean next-token loss of a checkpoint over every val window of shard_dir once
    (metrics.whole_val_loss, the number train.py's final evaluation prints). Returns (loss,
    n_tokens)."""
    try:
        return metrics.whole_val_loss(_load(ckpt_path, device), shard_dir, batch_size, device)
    except ValueError as e:
        raise LabError(str(e)) from None


@torch.no_grad()
def dlm_val_loss(ckpt_path, shard_dir, t, batch_size=16, seed=0):
    """A masked-diffusion checkpoint's mean CE over the masked tokens of every val window of T
    tokens, each token masked with probability t (position 0 never, with Dream's shift), the masks
    drawn from a generator seeded the same for every checkpoint. Returns (loss, masked tokens)."""
    from lessons import dlm
    model = _load(ckpt_path)
    mask_id, shift, T = model.config.vocab_size - 1, model.dlm_shift, model.config.block_size
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    for path in data.find_shards(shard_dir, "val"):
        tokens = data.read_shard(path)
        n = len(tokens) // T
        for i in range(0, n, batch_size):
            x = torch.from_numpy(np.stack([np.asarray(tokens[j * T:(j + 1) * T], dtype=np.int64)
                                           for j in range(i, min(i + batch_size, n))]))  # (b, T)
            masked = torch.rand(x.shape, generator=gen) < t
            if shift:
                masked[:, 0] = False
            logits = dlm.predictions(model, torch.where(masked, mask_id, x), mask_id, shift)
            ce = F.cross_entropy(logits.float().flatten(0, 1), x.flatten(),
                                 reduction="none").view(x.shape)
            total, count = total + ce[masked].sum().item(), count + int(masked.sum())
    return total / count, count


def _load(path, device="cpu"):
    """The GPT of a run's checkpoint (load.load_gpt); its one-line error as a LabError."""
    try:
        return load.load_gpt(path, device)[0]
    except checkpoint.CheckpointError as e:
        raise LabError(str(e)) from None



def state_bytes(obj):
    """Bytes of every tensor in a (nested) optimizer state dict, as saved."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def ratios(steps, start=10):
    """A DLM run's outlier ratios (mask tokens, the others): mean over all steps and over the first
    `start`."""
    first = [r for r in steps if r["step"] <= start]
    return {f"ratio_{k}{suffix}": statistics.mean(r[f"ratio_{k}"] for r in rs)
            for suffix, rs in (("", steps), ("_start", first)) for k in ("mask", "other")}
