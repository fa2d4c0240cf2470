"""
The DLM note's claim on a real trained vocabulary: a mask-token embedding row drawn at random makes
that token an activation outlier, so BitNet's per-token int8 scale 127 / max|x| rounds its other
channels to zero; a row set to the mean of the vocabulary looks like an average token
(lessons/dlm.py, add_mask_token). Our 0.86M toy could not show it (lab/results/dlm.md); this
measures it on a pretrained model, no training.

    python -m lab.mask_outliers --model=data/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out=lab/results/mask-outliers.json

The model as published (every hidden linear a BitLinear at lambda 0, no SubLN: its own function),
its vocabulary plus one mask row, bidirectional attention (add_mask_token). The first `windows`
windows of the shipped Shakespeare val split in its tokenizer, each token masked with probability
--t (seeded). The statistic is the toy table's (lessons/dlm.outlier_ratio): per token, max|y| /
mean|y| of what each activation quantiser sees, averaged over the quantisers; reported for the mask
tokens and for the others, per mask row.
"""
from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

import data
import quant
from lessons import dlm
from model import GPT
from tools import atomic, loaders, outputs, start
from tools.flags import die, parse
from tools.pretrained import is_model_source


@dataclass
class OutlierFlags:
    model: str = "data/models/SmolLM2-135M-Instruct.Q4_1.gguf"  # python -m tools.get_model smollm2
    windows: int = 8             # val windows scored
    block_size: int = 256        # tokens per window
    t: float = 0.5               # probability that a token is masked
    seed: int = 0                # the masked positions and the random rows
    out: str = ""                # write the result as JSON here; "" = print only
    overwrite: bool = False      # replace an earlier result at --out


def measure(fp, val, windows, T, t, seed):
    """{row name: (ratio over mask tokens, ratio over the others)} for fp (our GPT, quant=False)
    with each mask row."""
    conv = GPT(dataclasses.replace(fp.config, quant=True, subln=False))
    conv.load_state_dict(fp.state_dict(), strict=False)  # + lambda buffers
    quant.set_lambda(conv, 0.0)  # the published function; the quantisers' inputs recorded
    emb = fp.wte.weight.detach()
    rows = {
        "mean": ("mean", 0.02),
        f"random at the embedding's scale (std {emb.std().item():.4f})": (
            "random",
            emb.std().item(),
        ),
        "random at 0.02 (our init scale, the toy's row)": ("random", 0.02),
    }
    g = torch.Generator().manual_seed(seed)
    x = torch.from_numpy(
        np.stack([val[i * T : (i + 1) * T] for i in range(windows)]).astype(np.int64)
    )
    masked = torch.rand(x.shape, generator=g) < t
    out = {}
    for name, (init, scale) in rows.items():
        model, mask_id = dlm.add_mask_token(conv, init, seed=seed, scale=scale)
        with torch.no_grad():
            out[name] = dlm.outlier_ratio(model.eval(), torch.where(masked, mask_id, x), mask_id)
    return out


def main(argv):
    args = OutlierFlags(**parse(argv, OutlierFlags, __doc__))
    if args.windows < 1 or not 0 < args.t < 1:
        die(f"--windows={args.windows} --t={args.t}: expected windows >= 1 and 0 < t < 1", 2)
    if not is_model_source(args.model):
        die(f"--model={args.model}: not a pretrained model (a Hugging Face directory, a hub id or "
            "a .gguf file); python -m tools.get_model smollm2 fetches SmolLM2-135M", 2)
    if args.out:
        outputs.check_output("--out", args.out, "text", overwrite=args.overwrite,
                             inputs=[("--model", args.model)])
    fp = start.import_model(args.model, args.block_size, "--model")
    shards = loaders.shipped_dir("shakespeare",
                                  SimpleNamespace(tokenizer=args.model, data_order="sequential"))
    val = np.asarray(data.read_shard(os.path.join(shards, "val_000.bin")))
    windows = min(args.windows, len(val) // args.block_size)
    res = measure(fp, val, windows, args.block_size, args.t, args.seed)
    print(f"{args.model}: {windows} val windows of {args.block_size} tokens, t={args.t}; per-token "
          "max|y| / mean|y| at the activation quantisers (mean over them)")
    for name, (m, o) in res.items():
        print(f"  mask row {name}: mask tokens {m:.2f}, other tokens {o:.2f} ({m / o:.2f}x)")
    if args.out:
        with atomic.written(args.out, "--out") as tmp, open(tmp, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "windows": windows,
                    "block_size": args.block_size,
                    "t": args.t,
                    "seed": args.seed,
                    "ratios": {k: {"mask": m, "other": o} for k, (m, o) in res.items()},
                },
                f,
                indent=1,
            )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
