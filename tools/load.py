"""
A GPT from any file we write: a training checkpoint, a checkpoint average, a packed export.

    load_gpt(path) -> (model, the loaded dict)   a training checkpoint, a checkpoint average
                                                 (avg.pt), a packed export
    model_from_packed(obj)                       a packed export's dict (tools/export.py writes it)
                                                 as a GPT
    packed_kernels()                             kernels.packed_linear, or one ValueError where Triton
                                                 is not installed
    gpt_config(model_args)                       the model's shape

A GGUF or an HF export of ours passed where a checkpoint is read is named as such
(outputs.why_not_a_checkpoint).
Test: python -m pytest tests/test_atomic.py tests/test_packed.py tests/test_sample.py
"""

import math
import os

from model import GPT, GPTConfig
from tokenizer import TOKENIZERS, fingerprint, get_tokenizer
from tools import checkpoint
from tools.outputs import saved_tokenizer, why_not_a_checkpoint
from tools.pretrained import is_model_source

# every packed export's "format" starts so (tools/export.py's docstring shows the dict)
PACKED = "nanobitnet-packed-v"
FORMAT = PACKED + "2"  # quant.pack_ternary's bytes as they are


def gpt_config(model_args):
    """The GPTConfig of a checkpoint's or an export's model_args."""
    return GPTConfig(**model_args)


def load_gpt(path, device="cpu"):
    """Build the GPT saved at path: a training checkpoint, a checkpoint average (avg.pt) or a packed
    export (whose hidden matrices come back as PackedBitLinear). Returns (model in eval mode on
    device, the loaded dict: model_args, and the config of a checkpoint or the format of an export;
    saved_tokenizer(obj) names its tokenizer). model.dlm_shift says how a masked-diffusion model
    reads its predictions. Raises checkpoint.CheckpointError, one line naming the file: missing,
    corrupt, a tokenizer that does not fit the vocabulary, or no checkpoint at all (a GGUF, an HF
    export directory, its model.safetensors or nanobitnet.json: what it is and which command takes
    it)."""
    why = why_not_a_checkpoint(path)
    if why:
        raise checkpoint.CheckpointError(f"{path} {why}")
    if not os.path.exists(path):
        raise checkpoint.CheckpointError(f"no checkpoint at {path}; train one first: python "
                                         "train.py --stage=2")
    if os.path.isdir(path):
        raise checkpoint.CheckpointError(f"{path} is a directory; pass the checkpoint file in it, "
                                         f"e.g. {os.path.join(path, checkpoint.LATEST)}")
    obj = checkpoint.load(path, required=("model_args",))
    if not isinstance(obj["model_args"], dict):
        raise checkpoint.CheckpointError(f"{path}: not a checkpoint of ours (model_args is not a "
                                         "dict)")
    packed = str(obj.get("format", "")).startswith(PACKED)
    name, causal = saved_tokenizer(obj), obj["model_args"].get("causal", True)
    # the tokenizer against the vocabulary, before any weight is read: a mismatch means the file
    # mixes two runs
    if name is not None and "vocab_size" in obj["model_args"]:
        path_like = name.endswith(".gguf") or os.path.isabs(name) or name.startswith(".") or name.count("/") > 1
        # the model it was trained from
        if name not in TOKENIZERS and path_like and not is_model_source(name):
            raise checkpoint.CheckpointError(
                f"{path}: its tokenizer is the model {name}, which is not there (moved or "
                f"deleted); put that model back at {name}")
        try:
            tok = get_tokenizer(name)
        except ValueError as e:
            raise checkpoint.CheckpointError(f"{path}: {e}; the file was not written by train.py "
                                             "or tools/export.py")
        recorded = (obj.get("config") or {}).get("tokenizer_fingerprint")
        if recorded and fingerprint(tok) != recorded:  # another model now at that path
            raise checkpoint.CheckpointError(
                f"{path}: its tokenizer {name} is not the one it was trained with (fingerprint "
                f"{fingerprint(tok)}, recorded {recorded}): another model is at that path now; put "
                "the model it was trained from back")
        # a masked-diffusion model has one extra token
        vocab = obj["model_args"]["vocab_size"] - (not causal)
        # --pad_vocab rounds up to 64
        if not tok.vocab_size <= vocab <= 64 * math.ceil(tok.vocab_size / 64):
            raise checkpoint.CheckpointError(
                f"{path}: tokenizer {name!r} has {tok.vocab_size} tokens but the model's "
                f"vocabulary is {vocab}; the file mixes two runs: re-export it from its training "
                "checkpoint: python -m tools.export --ckpt=<ckpt.pt>")
    try:
        if packed:
            model = model_from_packed(obj, path)
        else:
            model = GPT(gpt_config(obj["model_args"]))
            model.load_state_dict(obj["model"])
            model.dlm_shift = (obj.get("config") or {}).get("dlm_shift", True)
    except Exception as e:  # a foreign or mismatched file: one line naming it, no traceback
        why = str(e) if packed and isinstance(e, ValueError) else \
            f"{path}: cannot load checkpoint ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
        raise checkpoint.CheckpointError(why) from None
    return model.to(device).eval(), obj


def packed_kernels():
    """kernels.packed_linear (PackedBitLinear, freeze_ternary), imported here, when packed weights are asked for: it
    imports Triton, which takes seconds and has wheels for Linux only (requirements.txt installs it there). Without
    Triton a ValueError naming the fix; training and sampling unpacked checkpoints never need it."""
    try:
        import kernels.packed_linear as packed_linear
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise ValueError("packed 2-bit weights need Triton, which is not installed here (it has wheels for Linux "
                         "only: pip install triton there); training and sampling unpacked checkpoints need none") \
            from None
    return packed_linear


def model_from_packed(obj, source="export"):
    """Rebuild a GPT whose hidden projections are PackedBitLinear from an export dict; ValueError if
    it does not fit."""
    packed_linear = packed_kernels()
    PackedBitLinear, freeze_ternary = packed_linear.PackedBitLinear, packed_linear.freeze_ternary
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{source}: not a packed export (format {found!r}, expected {FORMAT!r}); "
                         "make one with: python -m tools.export --ckpt=<ckpt.pt>")
    # the packed structure; weights come below
    model = freeze_ternary(GPT(gpt_config(obj["model_args"])))
    state = dict(obj["fp"])
    for name, p in obj["packed"].items():
        m = model.get_submodule(name)
        if not isinstance(m, PackedBitLinear) or (m.in_features, m.out_features) != (p["in_features"], p["out_features"]):
            raise ValueError(f"{source}: {name} ({p['in_features']} -> {p['out_features']}) does "
                             f"not fit the model that model_args describe ({m})")
        state[f"{name}.w_packed"], state[f"{name}.w_scale"] = p["w_packed"], p["w_scale"]
    model.load_state_dict(state)  # strict: every tensor of the model must come from the file
    # a masked-diffusion export: how it reads its predictions
    model.dlm_shift = obj.get("dlm_shift", True)
    return model.eval()
