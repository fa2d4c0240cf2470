"""
Sample text from a trained checkpoint.

  python sample.py                                   (out/stage2/ckpt.pt, default prompt)
  python sample.py --ckpt=out/stage1/ckpt.pt --start="ROMEO:" --max_new_tokens=300 --temperature=0.8
  python sample.py --packed=True                     (ternary model run from 2-bit packed weights)
  python sample.py --ckpt=out/stage2/packed.pt       (a packed export from export.py)

The tokenizer and model shape come from the checkpoint, so any stage's ckpt.pt works. With --packed=True
every BitLinear is frozen to 2-bit codes plus gamma (kernels/packed_linear.py) before sampling: the fp
latent weights are dropped and the integer inference path runs (Triton on CUDA, torch on CPU).
"""

import os
import sys

import torch

import data
from export import FORMAT, model_from_packed
from kernels.packed_linear import bytes_line, freeze_ternary, weight_bytes
from model import GPT, GPTConfig

DEFAULTS = dict(ckpt="out/stage2/ckpt.pt", start="\n", num_samples=2, max_new_tokens=200, temperature=0.8,
                top_k=50, seed=1337, device="auto", packed=False)


def die(msg, code=1):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def parse(argv):
    args = dict(DEFAULTS)
    for arg in argv:
        key, eq, val = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not eq or key not in args:
            die(f"unknown or malformed argument {arg!r}; use --key=value with key one of: {', '.join(args)}", 2)
        typ = type(DEFAULTS[key])
        try:
            if typ is bool:  # bool("False") is True, so spell the values out
                if val.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                args[key] = val.lower() in ("true", "1")
            else:
                args[key] = typ(val)
        except ValueError:
            die(f"--{key}={val}: expected {typ.__name__}", 2)
    return args


def load_model(path, device, packed=False):
    """(model, tokenizer name) from a training checkpoint or a packed export; packed=True freezes the former."""
    if not os.path.exists(path):
        die(f"no checkpoint at {path}; train one first: python train.py --stage=2")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(ckpt, dict) and ckpt.get("format") == FORMAT:
            model, tokenizer = model_from_packed(ckpt, path), ckpt["tokenizer"]
            print(bytes_line(weight_bytes(model)) + " (packed export)")
            return model.to(device).eval(), tokenizer
        model = GPT(GPTConfig(**ckpt["model_args"]))
        model.load_state_dict(ckpt["model"])
        tokenizer = ckpt["config"]["tokenizer"]
    except Exception as e:
        die(f"{path}: cannot load checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if packed:
        latent = weight_bytes(model)
        try:
            freeze_ternary(model)
        except ValueError as e:
            die(f"{path}: --packed=True: {e}")
        print(bytes_line(weight_bytes(model), latent))
    return model.to(device).eval(), tokenizer


def main(argv):
    args = parse(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args["device"] == "auto" else args["device"]
    torch.manual_seed(args["seed"])
    model, tokenizer = load_model(args["ckpt"], device, args["packed"])
    tok = data.get_tokenizer(tokenizer)
    ids = [tok.eot] + tok.encode(args["start"])  # documents start with end-of-text in the shards
    x = torch.tensor(ids, dtype=torch.long, device=device)[None, ...]
    for _ in range(args["num_samples"]):
        y = model.generate(x, args["max_new_tokens"], temperature=args["temperature"], top_k=args["top_k"])
        print(tok.decode(y[0, 1:].tolist()))
        print("---------------")


if __name__ == "__main__":
    main(sys.argv[1:])
