"""
Export a trained ternary checkpoint as packed 2-bit weights, and load such an export back.

  python export.py                                              (out/stage2/ckpt.pt -> out/stage2/packed.pt)
  python export.py --ckpt=out/stage3/ckpt.pt --out=out/stage3/packed.pt
  python sample.py --ckpt=out/stage2/packed.pt                  (sample.py reads exports directly)
  python export.py --format=gguf --out=out/stage2/model.gguf    (for llama.cpp: gguf_export.py; pip install gguf)

The idea: a training checkpoint holds the fp32 latent hidden weights (and the optimizer state); inference
needs only W_q in {-1, 0, +1}, packed four to a byte, and gamma (kernels/packed_linear.py). The export is
a plain dict that loads with torch.load(weights_only=True):

    {"format": "nanobitnet-packed-v1", "model_args": asdict(GPTConfig), "tokenizer": "byte" | "gpt2",
     "packed": {module name: {"w_packed": (N, ceil(K/4)) uint8, "w_scale": 0-d fp32 gamma,
                              "in_features": K, "out_features": N}},
     "fp": {every other state-dict tensor: embedding, LM head, norms; no latent weights, no lambda_}}

Hidden-matrix bytes are exactly 1/8 of bf16 when every K is a multiple of 4 (2 bits against 16).
--format=gguf writes a GGUF file for llama.cpp's bitnet architecture instead (gguf_export.py says what goes where).
Test: python -m pytest tests/test_packed.py tests/test_gguf.py
"""

import contextlib
import dataclasses
import os
import sys

import torch

import checkpoint
from kernels.packed_linear import PackedBitLinear, freeze_ternary
from model import GPT, GPTConfig

FORMAT = "nanobitnet-packed-v1"
DEFAULTS = dict(ckpt="out/stage2/ckpt.pt", out="", format="packed")  # out "" = packed.pt / model.gguf beside the checkpoint


def die(msg, code=1):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def packed_state(model, tokenizer):
    """The export dict of a frozen model (every hidden projection a PackedBitLinear)."""
    packed = {name: {"w_packed": m.w_packed, "w_scale": m.w_scale, "in_features": m.in_features,
                     "out_features": m.out_features}
              for name, m in model.named_modules() if isinstance(m, PackedBitLinear)}
    if not packed:
        raise ValueError("the model has no PackedBitLinear layers; run kernels.packed_linear.freeze_ternary first")
    fp = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in packed}
    return {"format": FORMAT, "model_args": dataclasses.asdict(model.config), "tokenizer": tokenizer, "packed": packed, "fp": fp}


def model_from_packed(obj, source="export"):
    """Rebuild a GPT whose hidden projections are PackedBitLinear from an export dict; ValueError if it does not fit."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{source}: not a packed export (format {found!r}, expected {FORMAT!r}); "
                         "make one with: python export.py --ckpt=<ckpt.pt>")
    model = freeze_ternary(GPT(GPTConfig(**obj["model_args"])))  # the packed structure; weights come below
    state = dict(obj["fp"])
    for name, p in obj["packed"].items():
        m = model.get_submodule(name)
        if not isinstance(m, PackedBitLinear) or (m.in_features, m.out_features) != (p["in_features"], p["out_features"]):
            raise ValueError(f"{source}: {name} ({p['in_features']} -> {p['out_features']}) does not fit the model "
                             f"that model_args describe ({m})")
        state[f"{name}.w_packed"], state[f"{name}.w_scale"] = p["w_packed"], p["w_scale"]
    model.load_state_dict(state)  # strict: every tensor of the model must come from the file
    return model.eval()


def load_packed(path):
    """(model, tokenizer name) from an export written by this script."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return model_from_packed(obj, path), obj["tokenizer"]


def load_training_checkpoint(ckpt_path):
    """(model, tokenizer name) of a training checkpoint; one error line for anything else."""
    try:
        ckpt = checkpoint.load(ckpt_path, required=())
    except checkpoint.CheckpointError as e:  # truncated, corrupt or foreign: one line naming the file
        die(str(e))
    if isinstance(ckpt, dict) and ckpt.get("format") == FORMAT:
        die(f"{ckpt_path} is already a packed export ({FORMAT}), not a training checkpoint; sample it as it is: "
            f"python sample.py --ckpt={ckpt_path}")
    try:
        model_args, tokenizer = ckpt["model_args"], ckpt["config"]["tokenizer"]
        model = GPT(GPTConfig(**model_args))
        model.load_state_dict(ckpt["model"])
    except Exception as e:  # a foreign or mismatched file: name it, no traceback
        die(f"{ckpt_path}: cannot load checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    return model, tokenizer


def export(ckpt_path, out_path):
    """Load a training checkpoint, freeze it to packed weights, write the export; returns it."""
    model, tokenizer = load_training_checkpoint(ckpt_path)
    try:
        obj = packed_state(freeze_ternary(model.eval()), tokenizer)
    except ValueError as e:
        die(f"{ckpt_path}: {e}")
    try:
        checkpoint.atomic_save(obj, out_path)  # never leave a half-written export under the final name
    except (OSError, RuntimeError) as e:  # a full disk: torch.save's zip writer raises RuntimeError, not OSError
        with contextlib.suppress(OSError):
            os.remove(out_path + ".tmp")
        why = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [""])[0][:200]
        die(f"--out={out_path}: cannot write the export ({why}); the file there, if any, is unchanged; "
            "free disk space or pass another --out")
    return obj


def main(argv):
    args = dict(DEFAULTS)
    for arg in argv:
        key, eq, val = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not eq or key not in args:
            die(f"unknown or malformed argument {arg!r}; use --key=value with key one of: {', '.join(args)}", 2)
        args[key] = val
    if args["format"] not in ("packed", "gguf"):
        die(f"--format={args['format']}: expected packed (our 2-bit export) or gguf (llama.cpp)", 2)
    out_path = args["out"] or os.path.join(os.path.dirname(args["ckpt"]), "packed.pt" if args["format"] == "packed"
                                           else "model.gguf")
    _check_paths(args["ckpt"], out_path, "packed.pt" if args["format"] == "packed" else "model.gguf")
    if args["format"] == "gguf":
        return export_gguf(args["ckpt"], out_path)
    obj = export(args["ckpt"], out_path)
    packed = sum(p["w_packed"].numel() for p in obj["packed"].values())  # uint8: one byte each
    bf16 = sum(2 * p["in_features"] * p["out_features"] for p in obj["packed"].values())
    other = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in obj["fp"].values()}.values())
    print(f"wrote {out_path} ({os.path.getsize(out_path) / 1e6:.2f} MB on disk): {len(obj['packed'])} packed matrices, "
          f"hidden-matrix bytes {packed:,} vs {bf16:,} in bf16 (1/{bf16 / packed:.3g}), plus {4 * len(obj['packed'])} "
          f"bytes of fp32 gammas; other weights (embedding, head, norms) {other:,} bytes")


def export_gguf(ckpt_path, out_path):
    """--format=gguf: write, read back and compare (gguf_export.verify_gguf), then one line on what went out."""
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        die("--format=gguf needs the gguf package (pip install gguf, or pip install -r requirements.txt)")
    import gguf_export
    model, tokenizer = load_training_checkpoint(ckpt_path)
    tmp = out_path + ".tmp"
    try:
        counts = gguf_export.write_gguf(model.eval(), tokenizer, tmp)
        bad = gguf_export.verify_gguf(tmp, model)
        if bad:
            raise ValueError(f"the file read back differs from the model: {'; '.join(bad[:3])}")
        os.replace(tmp, out_path)  # only a verified file lands under the final name
    except (ValueError, OSError) as e:
        die(f"{ckpt_path}: cannot export as GGUF: {getattr(e, 'strerror', None) or e}; {out_path} is unchanged")
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    types = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    hidden = "TQ2_0 (2-bit ternary)" if "TQ2_0" in counts else "F16 (rows not a multiple of 256, TQ2_0's block)"
    print(f"wrote {out_path} ({os.path.getsize(out_path) / 1e6:.2f} MB), llama.cpp architecture bitnet, tokenizer "
          f"{tokenizer}: tensors {types}; hidden matrices as {hidden} with an F32 gamma each; read back and "
          f"verified tensor by tensor")
    if "TQ2_0" in counts and "F16" in counts:
        print("  some hidden matrices went out as F16: their rows are not a multiple of 256")


# -----------------------------------------------------------------------------
# checks of --ckpt and --out, before anything is read: an export must never land on the checkpoint it is
# made from (ckpt.pt is a hard link to ckpt_<step>.pt, so compare files, not names), nor leave a .tmp behind


def _check_paths(ckpt, out, name="packed.pt"):
    if os.path.isdir(ckpt):
        die(f"--ckpt={ckpt} is a directory; pass the checkpoint file in it, e.g. "
            f"--ckpt={os.path.join(ckpt, checkpoint.LATEST)}", 2)
    if not os.path.exists(ckpt):
        die(f"no checkpoint at {ckpt}; train one first: python train.py --stage=2")
    if os.path.isdir(out):
        die(f"--out={out} is a directory; pass a file name, e.g. --out={os.path.join(out, name)}", 2)
    d = os.path.dirname(out) or "."
    if not os.path.isdir(d):
        die(f"--out={out}: directory {d} does not exist; create it (mkdir -p {d}) or pass another --out")
    if os.path.exists(out) and os.path.samefile(out, ckpt):
        die(f"--out={out} is the same file as --ckpt={ckpt}: the export would overwrite the checkpoint it is made "
            "from; pass another --out (the default is packed.pt beside --ckpt)", 2)


if __name__ == "__main__":
    main(sys.argv[1:])
