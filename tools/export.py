"""
Export a trained ternary checkpoint as packed 2-bit weights, and load such an export back
(tools/load.py builds it).

  python -m tools.export                                              (out/stage2/ckpt.pt -> out/stage2/packed.pt)
  python -m tools.export --ckpt=out/stage3/ckpt.pt --out=out/stage3/packed.pt
  python sample.py --ckpt=out/stage2/packed.pt                  (sample.py reads exports directly)
  python -m tools.export --format=gguf --out=out/stage2/model.gguf    (for llama.cpp: tools/export.py; pip install gguf)
  python -m tools.export --format=hf --out=out/stage2/hf              (a directory for transformers' BitNetForCausalLM)

The idea: a training checkpoint holds the fp32 latent hidden weights (and the optimizer state);
inference needs only W_q in {-1, 0, +1}, packed four to a byte, and gamma
(kernels/packed_linear.py). The export is a plain dict that loads with
torch.load(weights_only=True):

    {"format": "nanobitnet-packed-v2", "model_args": asdict(GPTConfig),
     "tokenizer": "byte" | "gpt2" | a pretrained model's source,
     "source": the checkpoint's path, "source_run": its run's id (None from an older checkpoint),
     "dlm_shift": a masked-diffusion model's only,
     "packed": {module name: {"w_packed": (N, ceil(K/4)) uint8 (quant.pack_ternary's bytes, which the kernels read),
                              "w_scale": 0-d fp32 gamma,
                              "in_features": K, "out_features": N}},
     "fp": {every other state-dict tensor: embedding, LM head, norms; no latent weights, no lambda_}}

Hidden-matrix bytes are exactly 1/8 of bf16 when every K is a multiple of 4 (2 bits against 16).
--format=gguf writes a GGUF file for llama.cpp's bitnet architecture instead (tools/export.py says
what goes where);
--format=hf a directory that transformers.AutoModelForCausalLM.from_pretrained loads
(tools/hf_format.py, docs/hf-format.md).
Test: python -m pytest tests/test_packed.py tests/test_gguf.py tests/test_hf.py
"""

from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import contextlib
import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass

import numpy as np

from quant import weight_quant
from tools import atomic, checkpoint, outputs
from tools.flags import die, parse
from tools.load import FORMAT, PACKED, load_gpt, packed_kernels
from tools.outputs import saved_tokenizer
# the HF format's names, also importable from here (tests/test_hf.py)
from tools.hf_format import (HF_FORMAT, HF_HIDDEN, HF_NORMS, _split, hf_config, hf_refusal,
                              hf_tensors, hf_tokenizer, pack_hf, write_hf)


@dataclass
class ExportConfig:
    ckpt: str = "out/stage2/ckpt.pt"  # the training checkpoint to export (a ternary model)
    out: str = ""                # the file to write; "" = packed.pt (or model.gguf, or the
                                 # directory hf) beside --ckpt
    format: str = "packed"       # packed (our 2-bit export, sample.py reads it), gguf (llama.cpp's
                                 # bitnet; the default for an --out named *.gguf) or hf
                                 # (a directory for transformers' BitNetForCausalLM)
    overwrite: bool = False      # replace what --out holds even if it is a checkpoint or another
                                 # run's file


def packed_state(model, tokenizer):
    """The export dict of a frozen model (every hidden projection a PackedBitLinear)."""
    PackedBitLinear = packed_kernels().PackedBitLinear
    packed = {name: {"w_packed": m.w_packed, "w_scale": m.w_scale, "in_features": m.in_features,
                     "out_features": m.out_features}
              for name, m in model.named_modules() if isinstance(m, PackedBitLinear)}
    if not packed:
        raise ValueError("the model has no PackedBitLinear layers; run "
                         "kernels.packed_linear.freeze_ternary first")
    fp = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in packed}
    return {"format": FORMAT, "model_args": dataclasses.asdict(model.config), "tokenizer": tokenizer, "packed": packed, "fp": fp}


def load_packed(path):
    """(model, tokenizer name) of an export written by this script (load.load_gpt reads every saved
    model)."""
    model, obj = load_gpt(path)
    return model, saved_tokenizer(obj)


def load_training_checkpoint(ckpt_path):
    """(model, tokenizer name) of a training checkpoint or an average; one error line for anything
    else."""
    try:
        model, obj = load_gpt(ckpt_path)
    # missing, truncated, corrupt or foreign: one line naming the file
    except checkpoint.CheckpointError as e:
        die(str(e))
    if str(obj.get("format", "")).startswith(PACKED):
        die(f"{ckpt_path} is already a packed export ({obj['format']}), not a training checkpoint; "
            f"sample it as it is: python sample.py --ckpt={ckpt_path}")
    if saved_tokenizer(obj) is None:
        die(f"{ckpt_path}: no tokenizer in its config; export a checkpoint that train.py wrote")
    return model, saved_tokenizer(obj)


def export(ckpt_path, out_path):
    """Load a training checkpoint, freeze it to packed weights, write the export; returns it."""
    model, tokenizer = load_training_checkpoint(ckpt_path)
    try:
        obj = packed_state(packed_kernels().freeze_ternary(model.eval()), tokenizer)
    except ValueError as e:
        die(f"{ckpt_path}: {e}")
    # which checkpoint it came from: a re-export may replace it
    obj["source"] = os.path.abspath(ckpt_path)
    obj[outputs.SOURCE_RUN] = outputs.checkpoint_run(ckpt_path)  # which run wrote it (check_output)
    if not model.config.causal:
        # how --stage=dlm trained it; sample.py --dlm=True needs it
        obj["dlm_shift"] = model.dlm_shift
    try:
        checkpoint.atomic_save(obj, out_path)  # never a half-written export under the final name
    except OSError as e:  # a full disk (torch.save's RuntimeError arrives as OSError)
        atomic.cannot_write("--out", out_path, "the export", e)
    return obj


def main(argv):
    given = parse(argv, ExportConfig, __doc__)
    if "format" not in given and given.get("out", "").endswith(".gguf"):  # the file's name says which
        given["format"] = "gguf"
    args = dataclasses.asdict(ExportConfig(**given))
    ckpt, fmt = args["ckpt"], args["format"]
    if fmt not in ("packed", "gguf", "hf"):
        die(f"--format={fmt}: expected packed (our 2-bit export), gguf (llama.cpp) or hf "
            "(transformers)", 2)
    out_path = args["out"] or os.path.join(os.path.dirname(ckpt), {"packed": "packed.pt", "gguf": "model.gguf",
                                                                   "hf": "hf"}[fmt])
    outputs.check_input("--ckpt", ckpt)
    if fmt == "hf":
        check_named(args["out"], fmt)
        # Ctrl-C while the checkpoint and its tokenizer load: one line
        with atomic.stoppable("--out", out_path):
            return export_hf(ckpt, out_path, args["overwrite"])
    outputs.check_output("--out", out_path, fmt, os.path.abspath(ckpt), args["overwrite"], [("--ckpt", ckpt)], ckpt)
    check_named(args["out"], fmt)  # after check_output: what a file there is comes first
    with atomic.stoppable("--out", out_path):
        if fmt == "gguf":
            return export_gguf(ckpt, out_path)
        obj = export(ckpt, out_path)
    packed = sum(p["w_packed"].numel() for p in obj["packed"].values())  # uint8: one byte each
    bf16 = sum(2 * p["in_features"] * p["out_features"] for p in obj["packed"].values())
    other = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in obj["fp"].values()}.values())
    print(f"wrote {out_path} ({os.path.getsize(out_path) / 1e6:.2f} MB on disk): "
          f"{len(obj['packed'])} packed matrices, hidden-matrix bytes {packed:,} vs {bf16:,} in "
          f"bf16 (1/{bf16 / packed:.3g}), plus {4 * len(obj['packed'])} bytes of fp32 gammas; "
          f"other weights (embedding, head, norms) {other:,} bytes")


def check_named(out, fmt):
    """Refuse an --out whose extension names another format than fmt's (model.gguf written as a torch file)."""
    named = os.path.splitext(out)[1].lower()
    if (named == ".gguf") != (fmt == "gguf") and named in (".gguf", ".pt", ".pth", ".bin", ".safetensors"):
        die(f"--out={out} names a {'GGUF' if named == '.gguf' else named} file, but --format={fmt} "
            f"writes {'a GGUF file' if fmt == 'gguf' else 'a directory' if fmt == 'hf' else 'a torch file'}: "
            f"pass an --out that matches --format (or the --format it names)", 2)


def export_gguf(ckpt_path, out_path, flag="--out"):
    """--format=gguf: write, read back and compare (verify_gguf), then one line on what went out."""
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        die("--format=gguf needs the gguf package (pip install gguf, or pip install -r "
            "requirements.txt)")
    model, tokenizer = load_training_checkpoint(ckpt_path)
    try:
        # only a verified file lands under the final name
        with atomic.atomic_write(out_path) as tmp:
            counts = write_gguf(model.eval(), tokenizer, tmp, os.path.abspath(ckpt_path),
                                outputs.checkpoint_run(ckpt_path))
            bad = verify_gguf(tmp, model)
            if bad:
                raise ValueError(f"the file read back differs from the model: {'; '.join(bad[:3])}")
    except ValueError as e:
        die(f"{ckpt_path}: cannot export as GGUF: {e}; {flag}={out_path} is unchanged")
    except OSError as e:  # a full disk is the disk's fault, not the checkpoint's
        atomic.cannot_write(flag, out_path, "the GGUF", e)
    types = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    if not model.config.quant:  # a full-precision (stage-1) model: every tensor as it is, no gamma
        hidden = "F32 (a full-precision model: no ternary codes, no gamma)"
    else:
        hidden = ("TQ2_0 (2-bit ternary)" if "TQ2_0" in counts else "F16 ternary codes (rows not a "
                                                                    "multiple of 256, "
                  "TQ2_0's block)") + " with an F32 gamma each"
    print(f"wrote {out_path} ({os.path.getsize(out_path) / 1e6:.2f} MB), llama.cpp architecture "
          f"bitnet, tokenizer {tokenizer}: tensors {types}; hidden matrices as {hidden}; read back "
          "and verified tensor by tensor")
    if "TQ2_0" in counts and "F16" in counts:
        print("  some hidden matrices went out as F16: their rows are not a multiple of 256")


# -----------------------------------------------------------------------------
# GGUF for llama.cpp's bitnet architecture: what goes where is in docs/gguf-format.md



ARCH = "bitnet"
QK_K = 256  # TQ2_0's block: a row is quantised in whole blocks
HIDDEN = {"attn.q_proj": "attn_q", "attn.k_proj": "attn_k", "attn.v_proj": "attn_v", "attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
NORMS = {"attn_norm": "attn_norm", "attn.subln": "attn_sub_norm", "mlp_norm": "ffn_norm", "mlp.subln": "ffn_sub_norm"}


def gguf_tensors(model):
    """[(GGUF name, float32 array (out, in) or (n,), GGML type name)] of a ternary GPT, in file
    order. Hidden matrices: the codes W_q and a `.scale` of gamma (see the docstring); the rest as
    they are."""
    c = model.config
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = [("token_embd.weight", sd["wte.weight"].numpy(), "F32")]
    for i in range(c.n_layer):
        for ours, theirs in HIDDEN.items():
            w = sd[f"h.{i}.{ours}.weight"]  # (out, in)
            if c.quant:
                w_q, gamma = weight_quant(w)
                kind = "TQ2_0" if w.shape[1] % QK_K == 0 else "F16"
                out += [(f"blk.{i}.{theirs}.weight", w_q.float().numpy(), kind),
                        (f"blk.{i}.{theirs}.scale", gamma.reshape(1).numpy(), "F32")]
            else:  # a full-precision (stage 1) model: the weights themselves, no scale
                out.append((f"blk.{i}.{theirs}.weight", w.numpy(), "F32"))
        for ours, theirs in NORMS.items():
            out.append((f"blk.{i}.{theirs}.weight", sd[f"h.{i}.{ours}.weight"].numpy(), "F32"))
    out.append(("output_norm.weight", sd["norm_f.weight"].numpy(), "F32"))
    return out


def write_gguf(model, tokenizer, path, source=None, source_run=None):
    """Write model (a GPT of model.py) and its tokenizer ("byte" | "gpt2") as a GGUF file for
    llama.cpp's bitnet architecture; source: the checkpoint it came from, and source_run the id of
    the run that wrote it, kept as metadata (outputs.file_kind and check_output read them). Returns {GGML type name: number of tensors}. ValueError if
    llama.cpp cannot hold it."""
    import gguf  # here: only this export needs the package
    c = model.config
    if not c.subln:
        raise ValueError("llama.cpp's bitnet architecture has sub-norms before attn_output and "
                         "ffn_down; this model was trained without SubLN (--subln=False), so it "
                         "has nothing to put there")
    if not c.tie_embeddings:
        raise ValueError("llama.cpp's bitnet architecture uses the embedding as the LM head; this "
                         "model's head is its own")
    if c.qk_norm:
        raise ValueError("it has q/k norms (qk_norm, Qwen3's q_norm and k_norm before RoPE), which "
                         "llama.cpp's bitnet architecture does not have; export it as packed "
                         "(python -m tools.export) instead")
    if not c.causal:
        raise ValueError("it is a masked-diffusion model (--stage=dlm): bidirectional attention "
                         "and a mask token, which llama.cpp's bitnet architecture would run as a "
                         "causal next-token model; export its stage-2 checkpoint instead, or the "
                         "packed format (python -m tools.export)")
    if c.quant and any(float(m.lambda_) != 1.0 for n, m in model.named_modules() if hasattr(m, "lambda_")):
        raise ValueError("the checkpoint is mid lambda warm-up (lambda < 1): it is not yet a "
                         "ternary model; train past --lambda_warmup_steps first")
    w = gguf.GGUFWriter(path, ARCH)
    w.add_context_length(c.block_size)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(c.hidden_dim())
    w.add_head_count(c.n_head)
    # bitnet.attention.head_count_kv: GQA when fewer than head_count
    w.add_head_count_kv(c.kv_heads())
    w.add_key_length(c.head_size())
    w.add_value_length(c.head_size())
    w.add_rope_dimension_count(c.head_size())
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_TQ2_0 if c.quant else gguf.LlamaFileType.ALL_F32)
    _add_vocab(w, tokenizer, c.vocab_size)
    if source:
        w.add_string(outputs.GGUF_SOURCE, source)  # llama.cpp ignores keys it does not know
    if source_run:
        w.add_string(outputs.GGUF_SOURCE_RUN, source_run)
    counts = {}
    for name, arr, kind in gguf_tensors(model):
        t = getattr(gguf.GGMLQuantizationType, kind)
        data = gguf.quants.quantize(arr, t) if kind == "TQ2_0" else arr.astype(np.float16 if kind == "F16" else np.float32)
        w.add_tensor(name, data, raw_dtype=t if kind == "TQ2_0" else None)
        counts[kind] = counts.get(kind, 0) + 1
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    # a full disk: close the file too, or its handle keeps the removed partial file's blocks
    except BaseException:
        # its buffer cannot be flushed there; the file is closed all the same
        with contextlib.suppress(OSError):
            w.close()
        raise
    w.close()
    return counts


def _add_vocab(w, tokenizer, n_vocab):
    """GPT-2-style vocabulary metadata: tokens in GPT-2's byte-to-unicode spelling, types, merges,
    BOS/EOS."""
    import gguf
    from tokenizer import get_tokenizer  # tiktoken only for gpt2
    spell = gguf.vocab.bytes_to_unicode()  # byte -> printable character, e.g. 0x20 -> "Ġ"
    tok = get_tokenizer(tokenizer)
    if tokenizer not in ("byte", "gpt2"):
        return _add_model_vocab(w, tok, n_vocab)
    if tokenizer == "byte":
        tokens = [spell[b] for b in range(256)]
        # never fires: no merge makes "ĠĠ"; llama.cpp needs a non-empty merges key
        merges = ["ĠĠ ĠĠ"]
    else:
        ranks = tok.enc._mergeable_ranks  # token bytes -> rank = id
        by_id = sorted(ranks, key=ranks.get)
        tokens = ["".join(spell[b] for b in t) for t in by_id]
        merges = [" ".join("".join(spell[b] for b in p) for p in _split(ranks, t)) for t in by_id if len(t) > 1]
    tokens.append("<|endoftext|>")  # id tok.eot = len(tokens) - 1
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    for i in range(len(tokens), n_vocab):  # --pad_vocab rows: never produced by the tokenizer
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.eot)
    w.add_eos_token_id(tok.eot)
    w.add_add_bos_token(True)


# tokenizer.json's pre-tokenizer -> llama.cpp's name for it (tokenizer.ggml.pre); llama.cpp's
# convert_hf_to_gguf
# finds it by a hash of encoded test text, here by its shape: the byte-level BPE families this
# repository imports
PRE_TOKENIZERS = {"ByteLevel": "gpt-2", "Digits+ByteLevel": "smollm"}


def _pre_name(tj):
    """llama.cpp's tokenizer.ggml.pre for a tokenizer.json dict, or None when it is none we know."""
    pre = tj.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return PRE_TOKENIZERS.get("+".join(p.get("type", "?") for p in parts))


def _source_pre(name):
    """tokenizer.ggml.pre of a source .gguf file, or None."""
    if not name.endswith(".gguf"):
        return None
    import gguf
    f = gguf.GGUFReader(name).fields.get("tokenizer.ggml.pre")
    return bytes(f.parts[f.data[0]]).decode() if f else None


def _add_model_vocab(w, tok, n_vocab):
    """An imported model's byte-level BPE vocabulary as gguf-py writes a "gpt2"-type one
    (convert_hf_to_gguf's _set_vocab_gpt2): tokens in their byte-to-unicode spelling, types (CONTROL
    for special added tokens, USER_DEFINED for other added ones), merges "a b", the pre-tokenizer,
    BOS/EOS. A source .gguf names its own pre-tokenizer (tokenizer.ggml.pre): that name is kept."""
    import gguf
    hf = tok.hf
    tj = json.loads(hf.backend_tokenizer.to_str())
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError(f"the tokenizer of {tok.name} is not a byte-level BPE (model "
                         f"{model.get('type')}{', byte_fallback' if model.get('byte_fallback') else ''}); the GGUF export writes only those")
    pre = _source_pre(tok.name) or _pre_name(tj)
    if pre is None:
        raise ValueError(f"the pre-tokenizer of {tok.name} "
                         f"({json.dumps(tj.get('pre_tokenizer'))[:120]}) is none whose llama.cpp "
                         f"name we know ({', '.join(PRE_TOKENIZERS.values())})")
    vocab, added = hf.get_vocab(), {t.content: t for t in hf.added_tokens_decoder.values()}
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        t = by_id.get(i)
        if t is None:  # rows the tokenizer never produces
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(t)
            types.append(gguf.TokenType.NORMAL if t not in added else
                         gguf.TokenType.CONTROL if added[t].special else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges or ["ĠĠ ĠĠ"])
    w.add_bos_token_id(hf.bos_token_id if hf.bos_token_id is not None else tok.eot)
    w.add_eos_token_id(hf.eos_token_id if hf.eos_token_id is not None else tok.eot)
    # tokenizer.py encodes without BOS; documents start with eot in the shards
    w.add_add_bos_token(False)


def verify_gguf(path, model):
    """Read the file back with gguf's reader and compare every tensor with what gguf_tensors(model)
    says it must hold (dequantised; exact, since codes, gamma and the fp tensors are all stored
    exactly). Returns the list of mismatches, empty when the file is right."""
    import gguf
    want = {name: arr for name, arr, _ in gguf_tensors(model)}
    got = {t.name: t for t in gguf.GGUFReader(path).tensors}
    bad = [f"{n}: missing" for n in want if n not in got] + [f"{n}: not "
                                                             "ours" for n in got if n not in want]
    for name, arr in want.items():
        if name in got:
            t = got[name]
            x = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(arr.shape)
            if not np.array_equal(x, arr):
                bad.append(f"{name}: {int((x != arr).sum())} of {arr.size} values differ")
    return bad


def export_hf(ckpt_path, out_dir, overwrite=False):
    """--format=hf: write the whole directory beside out_dir, then swap it in (atomic.atomic_dir),
    so out_dir is the old directory or the new one whatever stops the export. Files in out_dir that
    are not ours (no name an export of ours writes or wrote) are carried into the new directory as
    hard links."""
    import importlib.util
    missing = [p for p in ("transformers", "safetensors", "tokenizers") if importlib.util.find_spec(p) is None]
    if missing:
        die(f"--format=hf needs {', '.join(missing)} (pip install -r requirements.txt)")
    from safetensors import SafetensorError
    outputs.check_output("--out", out_dir, "hf", os.path.abspath(ckpt_path), overwrite, [("--ckpt", ckpt_path)],
                         ckpt_path)
    model, tokenizer = load_training_checkpoint(ckpt_path)
    why = hf_refusal(model)
    if why:
        die(f"{ckpt_path}: cannot export for transformers' bitnet: {why}")
    earlier = outputs.hf_marker(out_dir) or {}
    with atomic.stoppable("--out", out_dir):
        try:
            with atomic.atomic_dir(out_dir) as tmp:
                names = write_hf(model.eval(), tokenizer, tmp, os.path.abspath(ckpt_path),
                                 outputs.checkpoint_run(ckpt_path))
                # an earlier export's names that this one drops go
                ours = set(names) | set(earlier.get("files", ()))
                for n in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else ():
                    # files of other names stay (--overwrite=True into a directory of theirs)
                    if n not in ours:
                        _carry(os.path.join(out_dir, n), os.path.join(tmp, n))
        # a full disk: safetensors says so with its own error
        except (OSError, SafetensorError) as e:
            atomic.cannot_write("--out", out_dir, "the export", e, kept="it is unchanged")
    c = model.config
    size = os.path.getsize(os.path.join(out_dir, "model.safetensors"))
    print(f"wrote {out_dir}/ ({', '.join(names)}; model.safetensors {size / 1e6:.2f} MB): "
          f"transformers' bitnet architecture, {7 * c.n_layer} hidden matrices packed 4 to a byte "
          f"with weight_scale = 1/gamma, tokenizer {tokenizer}" + (" (token ids: no tokenizer "
                                                                   "files)" if tokenizer == "byte" else " (tokenizer.json)"))
    if c.kv_heads() != c.n_head:
        print(f"  grouped-query attention: {c.n_head} heads, {c.kv_heads()} key/value heads of "
              f"{c.head_size()}")
    print(f"  load: transformers.AutoModelForCausalLM.from_pretrained({out_dir!r})  (needs "
          "accelerate)")


def _carry(src, dst):
    """src (a file or a folder of them) also at dst, as hard links: no copy of the data."""
    if os.path.isdir(src) and not os.path.islink(src):
        shutil.copytree(src, dst, symlinks=True, copy_function=atomic.link_or_copy)
    else:
        atomic.link_or_copy(src, dst)


if __name__ == "__main__":
    main(sys.argv[1:])
