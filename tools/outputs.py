"""
What a file on disk is, and what an output may replace: one `error:` line before a command reads or
writes anything.

    file_kind(path) -> (kind, source)     what is there, and which checkpoint or run it was made
                                          from
    check_input(flag, path)               the model file a command reads is not a directory, a GGUF
                                          or an HF export
    check_output(flag, path, kind, ...)   writing a `kind` file at path would lose nothing
    run_inputs(ckpt), config_inputs(cfg)  what the run behind a checkpoint, or of a config, reads
    check_not_input(flag, path, inputs)   an output is none of them, nor inside one
    why_not_a_checkpoint(path)            a GGUF or an HF export where a checkpoint is read: which
                                          program reads it
    saved_tokenizer(obj)                  the tokenizer a checkpoint's or an export's dict names

The output rules: an output never replaces what its command reads, nor what the run behind its
checkpoint reads again (its pretrained model, tokenizer, teachers, shards), nor lands inside such a
directory, not even with
--overwrite=True (ckpt.pt is a hard link to ckpt_<step>.pt, so files are compared, not names); never
a file of another kind (a training checkpoint, a packed export, a GGUF export, a published GGUF model,
an HF export directory, a metrics log, a PNG, ...), and another run's or checkpoint's file of its own kind only with
--overwrite=True. A file of its own kind made from the same source by the same run (a re-export; an export
records its checkpoint's run id) is replaced.
Test: python -m pytest tests/test_atomic.py tests/test_outputs.py
"""

import functools
import json
import os
import struct
from types import SimpleNamespace

from tools.flags import die

KINDS = {  # file_kind's names, in the words an error line uses
    "checkpoint": "a training checkpoint", "average": "a checkpoint average (avg.pt)",
    "packed": "a packed export (tools/export.py)", "gguf": "a GGUF file (tools/export.py "
                                                           "--format=gguf)",
    "gguf-model": "a GGUF model as published (no export of ours)",
    "hf": "an HF export directory (tools/export.py --format=hf)", "hf-file": "a file of an HF "
                                                                             "export directory",
    "safetensors": "a safetensors weights file", "metrics": "a run's metrics "
                                                            "log", "png": "a PNG image",
    "text": "a text file", "gzip": "a gzip file", "directory": "a directory",
    "other": "a file of another kind",
}
# in every HF export directory of ours: its format, source checkpoint and file names
HF_MARKER = "nanobitnet.json"
# the GGUF metadata key holding the checkpoint it was exported from
GGUF_SOURCE = "nanobitnet.source"
# and the id of the run that wrote that checkpoint (checkpoint.RUN_ID): another run at the same path is told apart
GGUF_SOURCE_RUN = "nanobitnet.source_run"
SOURCE_RUN = "source_run"  # the same in a packed export's dict and an HF export's marker
PNG_SOURCE = "Source"  # the PNG text chunk holding the metrics.jsonl a plot was drawn from


def hf_marker(d):
    """The nanobitnet.json of an HF export of ours in directory d, or None."""
    try:
        with open(os.path.join(d, HF_MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and str(marker.get("format", "")).startswith("nanobitnet-hf") else None


def file_kind(path):
    """(kind, source) of what is at path: kind is a key of KINDS; source is the absolute path of
    what it was made from (the checkpoint of an export, the metrics.jsonl of a plot), or None. Reads
    only headers and metadata."""
    if os.path.isdir(path):
        marker = hf_marker(path)
        return ("hf", marker.get("source")) if marker else ("directory", None)
    marker = hf_marker(os.path.dirname(path) or ".")
    if marker and os.path.basename(path) in marker.get("files", ()):
        return "hf-file", os.path.dirname(os.path.abspath(path))
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return "other", None
    if head[:4] == b"GGUF":  # ours records its checkpoint; a published model (llama.cpp's, the hub's) does not
        source = _gguf_source(path)
        return ("gguf", source) if source else ("gguf-model", None)
    if head[:2] == b"\x1f\x8b":
        return "gzip", None
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png", _png_source(head)
    if head[:4] == b"PK\x03\x04":  # torch.save's zip format
        return _torch_kind(path)
    if len(head) > 8 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < 1 << 27:
        return "safetensors", None  # an 8-byte header length, then the JSON header
    if os.path.basename(path) == "metrics.jsonl":
        return "metrics", None
    try:
        head.decode("utf-8")
        return "text", None
    except UnicodeDecodeError:
        return "other", None


def _torch_kind(path):
    import torch
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return "other", None
    if isinstance(obj, dict) and str(obj.get("format", "")).startswith("nanobitnet-packed"):
        return "packed", obj.get("source")
    if isinstance(obj, dict) and "averaged" in obj:
        return "average", None
    return ("checkpoint", None) if isinstance(obj, dict) and "model" in obj else ("other", None)


def ours(path):
    """Whether path is a GGUF or an HF export directory that tools/export.py wrote (not a model as
    published)."""
    if os.path.isdir(path):
        return hf_marker(path) is not None
    st = os.stat(path) if os.path.isfile(path) else None
    if st is None:
        return False
    return _gguf_source_of(os.path.realpath(path), st.st_mtime_ns, st.st_size) is not None


@functools.lru_cache(maxsize=64)
def _gguf_source_of(path, mtime_ns, size):
    """_gguf_source, read once per version of the file; None at once for a GGUF whose first key,
    general.architecture, is not bitnet (ours always is): reading all of a published model's
    metadata with the gguf package takes seconds."""
    with open(path, "rb") as f:
        head = f.read(1 << 12)
    if head[:4] != b"GGUF":
        return None
    # magic, version u32, tensor count u64, key count u64; then the first key (u64 length) and its
    # type u32
    try:
        n = struct.unpack_from("<Q", head, 24)[0]
        key, kind = head[32:32 + n], struct.unpack_from("<I", head, 32 + n)[0]
        if key == b"general.architecture" and kind == 8:  # a string: u64 length, bytes
            m = struct.unpack_from("<Q", head, 36 + n)[0]
            if head[44 + n:44 + n + m] != b"bitnet":
                return None
    except struct.error:
        pass
    return _gguf_source(path)


def _gguf_source(path):
    try:
        import gguf
        field = gguf.GGUFReader(path).fields.get(GGUF_SOURCE)
        return field.contents() if field is not None else None
    except Exception:  # no gguf package, or a file it cannot read: the source is unknown
        return None


def _png_source(head):
    """The PNG_SOURCE text chunk among the chunks before the image data (PNG: length, type, data,
    CRC)."""
    i = 8
    while i + 8 <= len(head):
        n, kind = struct.unpack(">I4s", head[i:i + 8])
        if kind == b"IDAT":
            break
        key, _, value = head[i + 8:i + 8 + n].partition(b"\0")
        if kind == b"tEXt" and key == PNG_SOURCE.encode():
            return value.decode("latin-1")
        i += 12 + n
    return None


def why_not_a_checkpoint(path):
    """None, or a sentence saying that path is a model which load.load_gpt does not build (a
    pretrained model as published, a GGUF or an HF export of ours or one of its files) and which
    program reads it."""
    kind, source = file_kind(path) if os.path.exists(path) else (None, None)
    if kind == "gguf-model" or (kind == "directory" and any(
            os.path.exists(os.path.join(path, f)) for f in ("config.json", "tokenizer.json"))):
        what = "a GGUF file" if kind == "gguf-model" else "a Hugging Face model directory"
        return (f"is a pretrained model as published ({what}, not an export of ours), not a "
                "training checkpoint: train.py converts it (python train.py --stage=2 "
                f"--init_from={path}; stage 3 distils from it as --teacher={path}); pass the "
                "ckpt.pt of such a run")
    if kind == "hf-file" or (kind == "safetensors" and hf_marker(os.path.dirname(path) or ".")):
        kind, source = "hf", hf_marker(os.path.dirname(path) or ".").get("source")
        path = os.path.dirname(os.path.abspath(path))
        what = f"is a file of the HF export directory {path}"
    elif kind in ("gguf", "hf", "safetensors"):
        what = f"is {KINDS[kind]}"
    else:
        return None
    takes = {"gguf": f"llama.cpp reads it (llama-cli -m {path})",
             "hf": f"transformers reads it: AutoModelForCausalLM.from_pretrained({path!r})",
             "safetensors": "transformers or safetensors read it"}[kind]
    return (f"{what}, not a checkpoint: {takes}; pass the training checkpoint" +
            (f" it was exported from ({source})" if source else " (ckpt.pt)"))


def check_input(flag, path):
    """Stop (exit 2, one line naming the flag) when the model file a command reads is a directory, a
    GGUF or an HF export: say what it is and what to pass. A missing or corrupt file is load_gpt's
    to report."""
    why = why_not_a_checkpoint(path)
    if why:
        die(f"{flag}={path} {why}", 2)
    if os.path.isdir(path):
        die(f"{flag}={path} is a directory; pass the checkpoint file in it, e.g. "
            f"{flag}={os.path.join(path, 'ckpt.pt')}",
            2)


def run_inputs(ckpt_path):
    """[(what it is, path)] of what the run behind the checkpoint at ckpt_path reads again
    (sample.py, the exports and --resume read its tokenizer from the model it started from):
    config_inputs of its saved config. [] for a file that is not a training checkpoint (its reader
    says why)."""
    obj = _peek(ckpt_path)
    return config_inputs(obj.get("config") or {}, saved_tokenizer(obj)) if obj else []


def _peek(path):
    """The dict a torch.save file at path holds, memory-mapped (its tensors are not read), or {}: not
    one, or not readable."""
    import torch
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return {}
    return obj if isinstance(obj, dict) else {}


def checkpoint_run(ckpt_path):
    """The id of the run that wrote the training checkpoint (or average) at ckpt_path (its config's
    checkpoint.RUN_ID), or None: an older checkpoint, or not one."""
    from tools.checkpoint import RUN_ID
    return (_peek(ckpt_path).get("config") or {}).get(RUN_ID)


def export_run(path, kind):
    """The run id an export of ours at path (file_kind's kind: packed, gguf, hf) records for the
    checkpoint it was made from, or None (another kind, or an export made before they recorded it)."""
    if kind == "hf":
        return (hf_marker(path) or {}).get(SOURCE_RUN)
    if kind == "packed":
        return _peek(path).get(SOURCE_RUN)
    try:
        if kind == "gguf":
            import gguf
            field = gguf.GGUFReader(path).fields.get(GGUF_SOURCE_RUN)
            return field.contents() if field is not None else None
    except Exception:  # unreadable: nothing recorded
        return None
    return None


def same_run(path, kind, source):
    """Whether the export at path came from the run whose checkpoint is now at source (unknown on
    either side, a file written without run ids, counts as the same)."""
    made, now = export_run(path, kind), checkpoint_run(source)
    return made is None or now is None or made == now


def saved_tokenizer(obj):
    """The tokenizer name ("byte", "gpt2") a checkpoint's config or an export names, or None."""
    return obj.get("tokenizer") if "format" in obj else (obj.get("config") or {}).get("tokenizer")


def auto_init_from(out_dir, stage):
    """What --init_from=auto starts stage 2 or 3 from: the previous stage's <out_dir>/stage<N-1>/ckpt.pt;
    --stage=dlm (which converts the stage-2 model): <out_dir>/stage2/ckpt.pt."""
    from tools.config import DLM_STAGE
    return os.path.join(out_dir, "stage2" if stage == DLM_STAGE else f"stage{stage - 1}", "ckpt.pt")


def config_inputs(cfg, tokenizer):
    """[(what it is, path)] of the files and directories a run of config cfg (a dict of train.py's
    flags) reads: its tokenizer's model, --init_from (auto: the previous stage's checkpoint), each
    --teacher (stage 3) and its --data shard directories (a shipped corpus's data/<name>_<tokenizer>,
    "" the default's), where they exist."""
    from tools.checks import teacher_paths  # (both import what imports this module)
    from tools.config import DLM_STAGE
    from tools.loaders import data_dirs
    init_from, stage, out_dir = cfg.get("init_from") or "", cfg.get("stage"), cfg.get("out_dir") or "out"
    if init_from == "auto" and stage in (2, 3, DLM_STAGE):
        init_from = auto_init_from(out_dir, stage)
    found = [("the run's tokenizer (the model it was trained from, which sample.py, "
              "tools/export.py and --resume read)", tokenizer or "")]
    found += [("the run's --init_from model", init_from)]
    if stage == 3:
        found += [("the run's --teacher", t)
                  for t in teacher_paths(SimpleNamespace(teacher=str(cfg.get("teacher") or ""), out_dir=out_dir))]
    found += [("the run's --data shards", d) for d in data_dirs(cfg.get("data") or "", tokenizer)]
    return [(what, str(p)) for what, p in found if p not in ("", "byte", "gpt2", "auto", "scratch") and
            os.path.exists(str(p))]


def check_not_input(flag, path, inputs, contains=False):
    """Stop (exit 2, one line) when the output path is one of inputs ((what, path) pairs: a flag of
    this command or run_inputs' words), lies inside an input directory (a pretrained model, a shard
    directory), or, with contains (an output that replaces a whole directory, or whose command
    clears one), holds an input. Never allowed, not even with --overwrite=True."""
    out = os.path.realpath(path)
    for what, in_path in inputs:
        real = os.path.realpath(in_path)
        name = f"{what}={in_path}" if what.startswith("--") else f"{what}: {in_path}"
        if real == out or (os.path.exists(in_path) and os.path.exists(path) and os.path.samefile(in_path, path)):
            die(f"{flag}={path} is the same file as {name}: an output never replaces what a run "
                f"reads, not even with --overwrite=True; pass another {flag}", 2)
        if os.path.isdir(real) and out.startswith(os.path.join(real, "")):
            die(f"{flag}={path} is inside {name}; an output never goes into what a run reads, not "
                f"even with --overwrite=True; pass another {flag}", 2)
        if contains and real.startswith(os.path.join(out, "")):
            where = "is the directory of" if os.path.dirname(real) == out else "holds"
            die(f"{flag}={path} {where} {name}; the output needs a directory of its own, e.g. "
                f"{flag}={os.path.join(path, 'hf')}", 2)


def check_output(flag, path, kind, source=None, overwrite=False, inputs=(), ckpt=None):
    """Stop the command (one line via die: the flag, what is there, the fix) before it writes a
    `kind` file (a directory for "hf") made from `source` at path, when that would lose something
    (the rules in the docstring). inputs: (flag, path) pairs of what the command reads; ckpt: the
    training checkpoint it reads, whose run's own inputs (run_inputs) are protected too. Exit 2; 1
    for a directory that is missing or read-only."""
    check_not_input(flag, path, list(inputs) + (run_inputs(ckpt) if ckpt else []), contains=kind == "hf")
    if kind == "hf" and os.path.exists(path) and not os.path.isdir(path):
        die(f"{flag}={path} is a file; --format=hf writes a directory (config.json, "
            f"model.safetensors, ...): pass a new or empty directory", 2)
    if kind != "hf" and os.path.isdir(path):
        example = {"packed": "packed.pt", "gguf": "model.gguf", "png": "curves.png"}.get(kind, "<name>")
        die(f"{flag}={path} is a directory; pass a file name, e.g. "
            f"{flag}={os.path.join(path, example)}", 2)
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        d = os.path.dirname(path)
        die(f"{flag}={path}: directory {d} does not exist; create it (mkdir -p {d}) or pass "
            f"another {flag}")
    if not os.access(d, os.W_OK):
        die(f"{flag}={path}: directory {d} is not writable; pass another {flag}")
    if not os.path.exists(path):
        return
    have, have_source = file_kind(path)
    if kind == "hf" and have == "directory":  # our files beside theirs: nothing of theirs is lost
        found = sorted(os.listdir(path))
        if found and not overwrite:
            die(f"{flag}={path} is a directory with other files in it ({', '.join(found[:3])}"
                f"{', ...' * (len(found) > 3)}), not an HF export of ours; pass a new or empty "
                "directory, or --overwrite=True to write our files into it (files of other names "
                "stay)", 2)
        return
    if have != kind:
        die(f"{flag}={path} is {KINDS[have]}, not {KINDS[kind]}: an output never replaces a file "
            f"of another kind, not even with --overwrite=True; pass another {flag}, or move that "
            "file away first", 2)
    same_path = bool(source and have_source and os.path.abspath(have_source) == os.path.abspath(source))
    if overwrite or (same_path and same_run(path, have, source)):
        return
    made = f" made from another {'run' if kind == 'png' else 'checkpoint'} ({have_source})" if have_source else ""
    if same_path:  # a run replaced since (train.py --overwrite=True): this may be all that is left of it
        made = f" made from an earlier run's checkpoint at {have_source}, a run replaced since"
    die(f"{flag}={path} already exists ({KINDS[have]}{made}); pass another {flag}, or "
        "--overwrite=True to replace it",
        2)
