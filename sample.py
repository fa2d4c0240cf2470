"""
Sample text from a trained checkpoint.

  python sample.py                                   (out/stage2/ckpt.pt, default prompt)
  python sample.py --ckpt=out/stage1/ckpt.pt --start="ROMEO:" --max_new_tokens=300 --temperature=0.8

The tokenizer and model shape come from the checkpoint, so any stage's ckpt.pt works.
"""

import os
import sys

import torch

import data
from model import GPT, GPTConfig

DEFAULTS = dict(ckpt="out/stage2/ckpt.pt", start="\n", num_samples=2, max_new_tokens=200, temperature=0.8,
                top_k=50, seed=1337, device="auto")


def die(msg, code=1):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def parse(argv):
    args = dict(DEFAULTS)
    for arg in argv:
        key, eq, val = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not eq or key not in args:
            die(f"unknown or malformed argument {arg!r}; use --key=value with key one of: {', '.join(args)}", 2)
        try:
            args[key] = type(DEFAULTS[key])(val)
        except ValueError:
            die(f"--{key}={val}: expected {type(DEFAULTS[key]).__name__}", 2)
    return args


def load_model(path, device):
    if not os.path.exists(path):
        die(f"no checkpoint at {path}; train one first: python train.py --stage=2")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model = GPT(GPTConfig(**ckpt["model_args"]))
        model.load_state_dict(ckpt["model"])
    except Exception as e:
        die(f"{path}: cannot load checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    return model.to(device).eval(), ckpt


def main(argv):
    args = parse(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args["device"] == "auto" else args["device"]
    torch.manual_seed(args["seed"])
    model, ckpt = load_model(args["ckpt"], device)
    tok = data.get_tokenizer(ckpt["config"]["tokenizer"])
    ids = [tok.eot] + tok.encode(args["start"])  # documents start with end-of-text in the shards
    x = torch.tensor(ids, dtype=torch.long, device=device)[None, ...]
    for _ in range(args["num_samples"]):
        y = model.generate(x, args["max_new_tokens"], temperature=args["temperature"], top_k=args["top_k"])
        print(tok.decode(y[0, 1:].tolist()))
        print("---------------")


if __name__ == "__main__":
    main(sys.argv[1:])
