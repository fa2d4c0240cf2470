"""
End-to-end check of the GGUF export in llama.cpp itself (through llama-cpp-python, which compiles
llama.cpp from source on install): export a checkpoint, load it in llama.cpp, score the shipped val
text with both, and sample.

    bash lab/check_llamacpp.sh --ckpt=out/stage2/ckpt.pt   # installs llama-cpp-python if missing
    python -m lab.check_llamacpp --ckpt=out/stage2/ckpt.pt --windows=16 \
        --out=lab/results/llamacpp.json

Both score the same tokens: the first `windows` windows of block_size + 1 tokens of the val split of
the shipped corpus in the checkpoint's tokenizer, each window a fresh context. Ours is model.py's
forward (activations quantised per token to int8); llama.cpp's is its bitnet graph (float
activations for F16 weights, 8-bit blocks of 256 for TQ2_0), so the two differ by about what
activation quantisation costs, and the point is to measure it. Not in CI: it needs llama-cpp-python,
whose install compiles llama.cpp (minutes on 2 cores).
"""

from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

import data
from tokenizer import get_tokenizer
from tools import atomic, export, loaders, outputs
from tools.flags import die, parse


@dataclass
class CheckFlags:
    ckpt: str = "out/stage2/ckpt.pt"  # the training checkpoint to export and compare
    gguf: str = ""               # where the GGUF goes; "" = model.gguf beside --ckpt
    windows: int = 16            # val windows of block_size + 1 tokens scored by both
    out: str = ""                # write the result as JSON here; "" = print only
    samples: int = 3             # samples drawn by llama.cpp from <|endoftext|>
    seed: int = 0                # seeds llama.cpp's sampler (sample i uses seed + i)
    gen_tokens: int = 64         # greedy batch-1 decoding timed in llama.cpp and ours; 0 = none
    overwrite: bool = False      # replace another checkpoint's GGUF at --gguf, or a result at --out
                                 # (a file of another kind, such as a checkpoint, never)


def main(argv):
    args = dataclasses.asdict(CheckFlags(**parse(argv, CheckFlags, __doc__)))
    ckpt, path = args["ckpt"], args["gguf"] or os.path.join(os.path.dirname(args["ckpt"]),
                                                            "model.gguf")
    if args["windows"] < 1:
        die(f"--windows={args['windows']}: expected an integer >= 1", 2)
    outputs.check_input("--ckpt", ckpt)  # and the outputs, before anything is read or written
    outputs.check_output("--gguf", path, "gguf", os.path.abspath(ckpt), args["overwrite"],
                         [("--ckpt", ckpt)], ckpt)
    if args["out"]:
        outputs.check_output("--out", args["out"], "text", overwrite=args["overwrite"],
                            inputs=[("--ckpt", ckpt), ("--gguf", path)], ckpt=ckpt)
    try:
        from llama_cpp import Llama
    except ImportError:
        die("needs llama-cpp-python (pip install llama-cpp-python; it compiles llama.cpp), "
                 "or run bash lab/check_llamacpp.sh, which installs it")
    model, tokenizer = export.load_training_checkpoint(ckpt)
    with atomic.stoppable("--gguf", path):
        export.export_gguf(ckpt, path, "--gguf")
    T, tok = model.config.block_size, get_tokenizer(tokenizer)
    shards = loaders.shipped_dir("shakespeare",
                                  SimpleNamespace(tokenizer=tokenizer, data_order="sequential"))
    # an imported model's ids too
    val = np.asarray(data.read_shard(os.path.join(shards, "val_000.bin")), np.int64)
    n = min(args["windows"], (len(val) - 1) // T)
    rows = torch.from_numpy(np.stack([val[i * T:i * T + T + 1] for i in range(n)]))  # (n, T+1)
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    with torch.no_grad():
        ours = F.cross_entropy(model(x, y)[0].float().flatten(0, 1), y.flatten(),
                               reduction="none").view(n, T)
    llm = Llama(model_path=path, n_ctx=T, logits_all=True, n_threads=os.cpu_count(), verbose=False,
                seed=args["seed"])
    theirs = torch.empty(n, T)
    t0 = time.time()
    for i in range(n):
        llm.reset()  # a fresh context per window, as ours
        llm.eval(x[i].tolist())
        logits = torch.from_numpy(np.array(llm.scores[:T],
                                           dtype=np.float32))[:, :model.config.vocab_size]
        theirs[i] = F.cross_entropy(logits, y[i], reduction="none")
    secs = time.time() - t0
    ours_l, theirs_l = ours.mean().item(), theirs.mean().item()
    agree = float((ours - theirs).abs().mean())
    result = {"ckpt": args["ckpt"], "gguf": path, "gguf_bytes": os.path.getsize(path),
              "tokenizer": tokenizer, "tokens": n * T, "val_loss_ours": ours_l,
              "val_loss_llamacpp": theirs_l, "relative_difference": (theirs_l - ours_l) / ours_l,
              "mean_abs_token_nll_difference": agree, "llamacpp_tokens_per_s": n * T / secs,
              "samples": []}
    print(f"{n * T} val tokens: our val loss {ours_l:.4f}, llama.cpp {theirs_l:.4f} "
          f"({100 * result['relative_difference']:+.2f} %); mean |per-token NLL difference| "
          f"{agree:.4f}; llama.cpp scored {result['llamacpp_tokens_per_s']:,.0f} tokens/s")
    if args["gen_tokens"] > 0:
        result.update(generation_speed(model, path, x[0, :16], args["gen_tokens"]))
    for s in range(args["samples"]):  # sampled by llama.cpp from its own logits, from <|endoftext|>
        out = llm.create_completion(prompt=[tok.eot], max_tokens=min(200, T - 1), temperature=0.8,
                                    top_k=200, seed=args["seed"] + s)
        result["samples"].append(out["choices"][0]["text"])
        print(f"--- llama.cpp sample {s}\n{result['samples'][-1]}")
    if args["out"]:
        with atomic.written(args["out"], "--out") as tmp, open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args['out']}")
    return 0 if math.isfinite(theirs_l) else 1


def generation_speed(model, path, prompt, n):
    """Greedy batch-1 decoding of n tokens after the same prompt: llama.cpp (its own context, every
    CPU thread, one llama_decode per token) and ours (the checkpoint frozen to packed 2-bit layers,
    tools/decode.py's static KV cache, eager). Tokens/s of the n decoding steps each, the prompt
    excluded; and how many greedy tokens agree (they part where int8 activations, ours, and
    llama.cpp's float ones pick another argmax)."""
    import copy
    from llama_cpp import Llama
    from kernels.packed_linear import freeze_ternary
    from tools import decode
    llm = Llama(model_path=path, n_ctx=len(prompt) + n + 1, logits_all=True,
                n_threads=os.cpu_count(), verbose=False)
    llm.eval(prompt.tolist())
    theirs, t0 = [], time.perf_counter()
    for _ in range(n):
        theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([theirs[-1]])
    llama_s = time.perf_counter() - t0
    packed = freeze_ternary(copy.deepcopy(model)).eval()
    gen = decode.Decoder(packed, "eager").generate
    with torch.no_grad():
        gen(prompt[None], 2, top_k=1)  # warm-up: the codes unpacked once
        t0 = time.perf_counter()
        ours = gen(prompt[None], n, top_k=1)[0, len(prompt):].tolist()
        ours_s = time.perf_counter() - t0
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), n)
    r = {"gen_tokens": n, "llamacpp_gen_tokens_per_s": n / llama_s,
         "ours_packed_gen_tokens_per_s": n / ours_s, "greedy_tokens_agreeing_from_the_start": agree,
         "threads": os.cpu_count()}
    print(f"greedy generation, {n} tokens, batch 1, {os.cpu_count()} threads: llama.cpp "
          f"{r['llamacpp_gen_tokens_per_s']:.1f} tokens/s, ours packed "
          f"{r['ours_packed_gen_tokens_per_s']:.1f} tokens/s "
          f"({r['llamacpp_gen_tokens_per_s'] / r['ours_packed_gen_tokens_per_s']:.2f}x ours); the "
          f"first {agree} tokens agree")
    return r


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
