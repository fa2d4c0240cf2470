"""
Packed ternary generation against full precision on CPU, at SmolLM2-135M's shape (30 layers, width 576, 9 query /
3 KV heads, MLP 1536, vocabulary 49,152; random weights: speed does not depend on them). Greedy batch-1 decode
through tools/decode.py (static KV cache, eager; fp with its q/k/v and gate/up weights stacked once, freeze_fp),
fp and packed interleaved rep by rep on the same machine, so the
ratio packed/fp is read from pairs of runs made back to back.

    python -m lab.packed_decode [--tokens=32 --reps=5 --n_layer=30]

The target (issue 42): packed >= 1.0x fp on 2 cores. Packed layers on CPU keep int8 codes (unpacked once) and
multiply with torch._int_mm (kernels/packed_linear.py).
"""
from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import statistics
import sys
import time
from dataclasses import dataclass

import torch

from kernels.packed_linear import freeze_fp, freeze_ternary
from model import GPT, GPTConfig
from tools import decode
from tools.flags import die, parse

SMOLLM2 = dict(vocab_size=49152, block_size=256, n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp_hidden=1536,
               tie_embeddings=True)


@dataclass
class DecodeFlags:
    tokens: int = 32  # new tokens per generation
    reps: int = 5     # fp/packed pairs, interleaved
    n_layer: int = 30  # SmolLM2-135M's depth (fewer: a quick look at the same layer shapes)


def main(argv):
    args = DecodeFlags(**parse(argv, DecodeFlags, __doc__))
    for key in ("tokens", "reps", "n_layer"):
        if getattr(args, key) < 1:
            die(f"--{key}={getattr(args, key)}: expected an integer >= 1", 2)
    torch.manual_seed(0)
    shape = {**SMOLLM2, "n_layer": args.n_layer}
    fp = freeze_fp(GPT(GPTConfig(**shape, quant=False, subln=False)).eval())
    packed = freeze_ternary(GPT(GPTConfig(**shape, quant=True, subln=True)).eval())
    prompt = torch.randint(0, SMOLLM2["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    gens = {name: decode.Decoder(m, "eager").generate for name, m in (("fp", fp), ("packed", packed))}
    tps = {name: [] for name in gens}
    with torch.no_grad():
        for g in gens.values():
            g(prompt, 4, top_k=1)  # warm-up: caches, codes unpacked once
        for _ in range(args.reps):
            for name, g in gens.items():
                t0 = time.perf_counter()
                g(prompt, args.tokens, top_k=1)
                tps[name].append(args.tokens / (time.perf_counter() - t0))
    for name, v in tps.items():
        print(f"{name:7s} {statistics.median(v):7.2f} tokens/s median (min {min(v):.2f}, max {max(v):.2f}), {args.reps} reps")
    ratios = [p / f for p, f in zip(tps["packed"], tps["fp"])]
    print(f"packed/fp: {statistics.median(ratios):.2f}x median of the pairs (min {min(ratios):.2f}, max "
          f"{max(ratios):.2f}); {torch.get_num_threads()} threads, SmolLM2-135M's shape with {args.n_layer} layers, greedy, batch 1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
