"""
One helper per job that several commands share (as nanochat's common.py): the repository root, writing a file or
a directory so that an interruption leaves the old one whole, the rules of what an output may replace, stopping on
SIGTERM/SIGINT, building a GPT from any saved model, and the val loss.

    ROOT                                  the repository
    atomic_write(path) -> tmp             with-block: write tmp any way you like; renamed over path if it completes
    atomic_dir(path) -> tmp               the same for a whole directory, swapped in by two renames
    file_kind(path) -> (kind, source)     what is on disk there, and which checkpoint or run it was made from
    check_input / check_output            one `error:` line before anything is read or written
    StopSignal, Interrupted, stoppable    SIGTERM/SIGINT as a flag checked at a step boundary, or at once
    gpt_config, load_gpt(path) -> (model, the loaded dict)
    token_loss_sums, whole_val_loss       the val loss of train.py, the lab and the benchmarks

The output rules: an output never replaces what its command reads (ckpt.pt is a hard link to ckpt_<step>.pt, so
files are compared, not names), never a file of another kind (a training checkpoint, a packed export, a GGUF, an
HF export directory, a metrics log, a PNG, ...), and another run's or checkpoint's file of its own kind only with
--overwrite=True. A file of its own kind made from the same source (a re-export) is replaced.
Test: python -m pytest tests/test_common.py
"""

import contextlib
import json
import os
import shutil
import signal
import struct
import tempfile
import threading

from tools.flags import die

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

LEGACY_MODEL_ARGS = ("track_max_logit", "max_logit_rows")  # QK-clip's tracking is a hook now (lessons/muon_variants.py)

# -----------------------------------------------------------------------------
# writing: the old file (or directory) stays whole until the new one is complete


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)  # a file or a directory: fsync of any descriptor flushes it
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


@contextlib.contextmanager
def atomic_write(path):
    """with atomic_write(path) as tmp: write the new file at tmp, any way (open, torch.save, a library's writer).
    When the block completes, tmp is synced to disk and renamed over path (atomic on POSIX), then the directory is
    synced: path is always the whole old file or the whole new one. On any exception (an OSError such as a full
    disk, errno ENOSPC; torch.save's RuntimeError; Ctrl-C; SystemExit) tmp is removed and path is left as it was.
    tmp is path + ".tmp", in the same directory (a rename cannot cross filesystems); a stale one is removed first."""
    tmp = path + ".tmp"
    _remove(tmp)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    _fsync(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_dir(path):
    """with atomic_dir(path) as tmp: write a whole directory at tmp (a new hidden directory beside path). When the
    block completes, it takes path's place by two renames (path -> .<name>.old-<pid>, tmp -> path) during which
    SIGTERM and SIGINT wait, then the old directory is deleted: path is the whole old directory or the whole new one.
    On any exception tmp is deleted and path is left as it was. What a killed earlier write left beside path is
    cleared first: .<name>.tmp-* deleted, a .<name>.old-* moved back if path is missing (else deleted); each name
    carries its writer's pid, and what a writer still running on this machine has there is left alone."""
    parent, name = os.path.split(os.path.abspath(path))
    for n in sorted(os.listdir(parent)):
        left = os.path.join(parent, n)
        kind = next((k for k in ("tmp", "old") if n.startswith(f".{name}.{k}-")), None)
        if kind is None or _writer_alive(n[len(f".{name}.{kind}-"):].split("-")[0]):
            continue
        if kind == "old" and not os.path.lexists(path):
            os.rename(left, path)
        else:
            shutil.rmtree(left, ignore_errors=True)
    pid = os.getpid()
    tmp, old = tempfile.mkdtemp(prefix=f".{name}.tmp-{pid}-", dir=parent), os.path.join(parent, f".{name}.old-{pid}")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, (os.stat(path).st_mode & 0o7777) if os.path.isdir(path) else 0o777 & ~umask)  # mkdtemp's is 0700
    try:
        yield tmp
        for n in os.listdir(tmp):
            if not os.path.islink(os.path.join(tmp, n)):
                _fsync(os.path.join(tmp, n))
        _fsync(tmp)
        with _signals_deferred():
            if os.path.lexists(path):
                os.rename(path, old)
            os.rename(tmp, path)
        _fsync(parent)
    except BaseException:
        if os.path.lexists(old) and not os.path.lexists(path):  # the second rename failed: the old one goes back
            os.rename(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _writer_alive(pid):
    """Whether pid (a string from a leftover's name) is another process running here: its directory is in use."""
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    return True


@contextlib.contextmanager
def _signals_deferred():
    """SIGTERM and SIGINT received in the block are raised again after it, so its steps are never cut in half."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets Python's handlers
        yield
        return
    got = []
    handlers = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        for s in got:
            signal.raise_signal(s)


def link_or_copy(src, dst):
    """dst names the file src: a hard link (no extra space), or a copy where the filesystem has none."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)

# -----------------------------------------------------------------------------
# what is on disk, and what an output may replace

KINDS = {  # file_kind's names, in the words an error line uses
    "checkpoint": "a training checkpoint", "average": "a checkpoint average (avg.pt)",
    "packed": "a packed export (tools/export.py)", "gguf": "a GGUF file (tools/export.py --format=gguf)",
    "hf": "an HF export directory (tools/export.py --format=hf)", "hf-file": "a file of an HF export directory",
    "safetensors": "a safetensors weights file", "metrics": "a run's metrics log", "png": "a PNG image",
    "text": "a text file", "directory": "a directory", "other": "a file of another kind",
}
HF_MARKER = "nanobitnet.json"  # in every HF export directory of ours: its format, source checkpoint and file names
GGUF_SOURCE = "nanobitnet.source"  # the GGUF metadata key holding the checkpoint it was exported from
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
    """(kind, source) of what is at path: kind is a key of KINDS; source is the absolute path of what it was made
    from (the checkpoint of an export, the metrics.jsonl of a plot), or None. Reads only headers and metadata."""
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
    if head[:4] == b"GGUF":
        return "gguf", _gguf_source(path)
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


def _gguf_source(path):
    try:
        import gguf
        field = gguf.GGUFReader(path).fields.get(GGUF_SOURCE)
        return field.contents() if field is not None else None
    except Exception:  # no gguf package, or a file it cannot read: the source is unknown
        return None


def _png_source(head):
    """The PNG_SOURCE text chunk among the chunks before the image data (PNG: length, type, data, CRC)."""
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


def _what(path):
    """A sentence saying what path is and which command takes it, when it is a model that load_gpt does not build
    (a GGUF, an HF export or one of its files); else None."""
    kind, source = file_kind(path) if os.path.exists(path) else (None, None)
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
    """Stop (exit 2, one line naming the flag) when the model file a command reads is a directory, a GGUF or an HF
    export: say what it is and what to pass. A missing or corrupt file is load_gpt's to report."""
    why = _what(path)
    if why:
        die(f"{flag}={path} {why}", 2)
    if os.path.isdir(path):
        die(f"{flag}={path} is a directory; pass the checkpoint file in it, e.g. {flag}={os.path.join(path, 'ckpt.pt')}",
            2)


def check_output(flag, path, kind, source=None, overwrite=False, inputs=()):
    """Stop the command (one line via die: the flag, what is there, the fix) before it writes a `kind` file (a
    directory for "hf") made from `source` at path, when that would lose something (the rules in the docstring).
    inputs: (flag, path) pairs of what the command reads. Exit 2; 1 for a directory that is missing or read-only."""
    for in_flag, in_path in inputs:
        same = os.path.abspath(in_path) == os.path.abspath(path) or (
            os.path.exists(in_path) and os.path.exists(path) and os.path.samefile(in_path, path))
        if same:
            die(f"{flag}={path} is the same file as {in_flag}={in_path}: writing there would destroy what this command "
                f"reads; pass another {flag}", 2)
        if kind == "hf" and os.path.isdir(path) and os.path.exists(in_path) and os.path.realpath(in_path).startswith(
                os.path.join(os.path.realpath(path), "")):
            where = "is the directory of" if os.path.samefile(os.path.dirname(in_path) or ".", path) else "holds"
            die(f"{flag}={path} {where} {in_flag}={in_path}; the export needs a directory of its own, e.g. "
                f"{flag}={os.path.join(path, 'hf')}", 2)
    if kind == "hf" and os.path.exists(path) and not os.path.isdir(path):
        die(f"{flag}={path} is a file; --format=hf writes a directory (config.json, model.safetensors, ...): pass a new "
            f"or empty directory", 2)
    if kind != "hf" and os.path.isdir(path):
        example = {"packed": "packed.pt", "gguf": "model.gguf", "png": "curves.png"}.get(kind, "<name>")
        die(f"{flag}={path} is a directory; pass a file name, e.g. {flag}={os.path.join(path, example)}", 2)
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        d = os.path.dirname(path)
        die(f"{flag}={path}: directory {d} does not exist; create it (mkdir -p {d}) or pass another {flag}")
    if not os.access(d, os.W_OK):
        die(f"{flag}={path}: directory {d} is not writable; pass another {flag}")
    if not os.path.exists(path):
        return
    have, have_source = file_kind(path)
    if kind == "hf" and have == "directory":  # our files beside theirs: nothing of theirs is lost
        found = sorted(os.listdir(path))
        if found and not overwrite:
            die(f"{flag}={path} is a directory with other files in it ({', '.join(found[:3])}"
                f"{', ...' * (len(found) > 3)}), not an HF export of ours; pass a new or empty directory, or "
                f"--overwrite=True to write our files into it (files of other names stay)", 2)
        return
    if have != kind:
        die(f"{flag}={path} is {KINDS[have]}, not {KINDS[kind]}: an output never replaces a file of another kind, not "
            f"even with --overwrite=True; pass another {flag}, or move that file away first", 2)
    if overwrite or (source and have_source and os.path.abspath(have_source) == os.path.abspath(source)):
        return
    made = f" made from another {'run' if kind == 'png' else 'checkpoint'} ({have_source})" if have_source else ""
    die(f"{flag}={path} already exists ({KINDS[have]}{made}); pass another {flag}, or --overwrite=True to replace it",
        2)

# -----------------------------------------------------------------------------
# stopping: SIGTERM (a scheduler's preemption, torchrun) and SIGINT (Ctrl-C)


class Interrupted(SystemExit):
    """SIGTERM or SIGINT as an exception, raised by StopSignal where a signal stops the command at once. Uncaught,
    it ends the command with its one line `error: ...` and exit code 1; a command that has to say what it kept
    catches it (.signum)."""

    def __init__(self, signum, line):
        super().__init__(f"error: {line}")
        self.signum = signum


class StopSignal:
    """with StopSignal() as stop: ... `stop.requested` is the name of the first SIGTERM/SIGINT received, else None;
    a training loop checks it once per step. A second signal of the same kind raises Interrupted at once (torchrun
    follows a Ctrl-C with SIGTERM to its workers: that second, different signal is not an abort).
    StopSignal(at_once="why"): the first signal raises Interrupted, "error: SIGTERM: why".
    StopSignal(forward=fn): fn(signum) is called first; when it returns True (it passed the signal on, e.g. to a
    child process that decides for itself), the signal only sets `requested`."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), at_once=None, forward=None):
        self.signals, self.at_once, self.forward = signals, at_once, forward
        self.requested, self.old = None, {}

    def __enter__(self):
        self.old = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.at_once:
            raise Interrupted(signum, f"{name}: {self.at_once}")
        passed_on = self.forward is not None and self.forward(signum)
        if self.requested == name and not passed_on:
            raise Interrupted(signum, f"second {name}: stopping now, without a checkpoint; the last one is kept")
        self.requested = self.requested or name


@contextlib.contextmanager
def stoppable(flag, path):
    """with stoppable("--out", out): a command writing its output (with atomic_write or atomic_dir) is stopped by
    SIGTERM or Ctrl-C at once, with one line saying whether path is as it was or already the whole new output, and
    exit code 128 + the signal (the shell's convention)."""
    def identity(p):
        return (os.lstat(p).st_dev, os.lstat(p).st_ino) if os.path.lexists(p) else None
    before = identity(path)
    try:
        with StopSignal(at_once="stopped"):
            yield
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        now = identity(path)
        state = ("was already written whole" if now != before else
                 "is unchanged" if now is not None else "was not written")
        die(f"stopped by {how}: {flag}={path} {state}; run the same command again", 128 + signum)

# -----------------------------------------------------------------------------
# loading a model


def gpt_config(model_args):
    """The GPTConfig of a checkpoint's or an export's model_args; keys of older versions that no longer shape the
    model are dropped."""
    from model import GPTConfig
    return GPTConfig(**{k: v for k, v in model_args.items() if k not in LEGACY_MODEL_ARGS})


def saved_tokenizer(obj):
    """The tokenizer name ("byte", "gpt2") a checkpoint's config or an export names, or None."""
    return obj.get("tokenizer") if "format" in obj else (obj.get("config") or {}).get("tokenizer")


def load_gpt(path, device="cpu"):
    """Build the GPT saved at path: a training checkpoint, a checkpoint average (avg.pt) or a packed export (whose
    hidden matrices come back as PackedBitLinear). Returns (model in eval mode on device, the loaded dict:
    model_args, and the config of a checkpoint or the format of an export; saved_tokenizer(obj) names its
    tokenizer). model.dlm_shift says how a masked-diffusion model reads its predictions.
    Raises checkpoint.CheckpointError, one line naming the file: missing, corrupt, a tokenizer that does not fit
    the vocabulary, or no checkpoint at all (a GGUF, an HF export directory, its model.safetensors or
    nanobitnet.json: what it is and which command takes it)."""
    import math
    from model import GPT
    from tokenizer import get_tokenizer
    from tools import checkpoint
    why = _what(path)
    if why:
        raise checkpoint.CheckpointError(f"{path} {why}")
    if not os.path.exists(path):
        raise checkpoint.CheckpointError(f"no checkpoint at {path}; train one first: python train.py --stage=2")
    if os.path.isdir(path):
        raise checkpoint.CheckpointError(f"{path} is a directory; pass the checkpoint file in it, e.g. "
                                         f"{os.path.join(path, checkpoint.LATEST)}")
    obj = checkpoint.load(path, required=("model_args",))
    if not isinstance(obj["model_args"], dict):
        raise checkpoint.CheckpointError(f"{path}: not a checkpoint of ours (model_args is not a dict)")
    packed = str(obj.get("format", "")).startswith("nanobitnet-packed")
    name, causal = saved_tokenizer(obj), obj["model_args"].get("causal", True)
    # the tokenizer against the vocabulary, before any weight is read: a mismatch means the file mixes two runs
    if name is not None and "vocab_size" in obj["model_args"]:
        try:
            tok = get_tokenizer(name)
        except ValueError as e:
            raise checkpoint.CheckpointError(f"{path}: {e}; the file was not written by train.py or tools/export.py")
        vocab = obj["model_args"]["vocab_size"] - (not causal)  # a masked-diffusion model has one extra token
        if not tok.vocab_size <= vocab <= 64 * math.ceil(tok.vocab_size / 64):  # --pad_vocab rounds up to 64
            raise checkpoint.CheckpointError(
                f"{path}: tokenizer {name!r} has {tok.vocab_size} tokens but the model's vocabulary is {vocab}; the "
                "file mixes two runs: re-export it from its training checkpoint: python -m tools.export --ckpt=<ckpt.pt>")
    try:
        if packed:
            from tools.export import model_from_packed
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


# -----------------------------------------------------------------------------
# the val loss: one definition for train.py's evaluations, the lab's scores and the benchmarks


def token_loss_sums(loss_fn, batches, device, every=None):
    """(sum over batches of loss * targets, targets) as a 2-element tensor, no host read: loss_fn(x, y) is the mean
    loss over the targets of y that are not -1 (a whole-split sweep pads its last rows with -1; an all-padding
    batch adds 0). every(i): called before batch i, e.g. to print progress. The caller divides (after summing the
    tensor over the ranks, if several share the batches)."""
    import torch
    sums = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(batches):
        if every is not None:
            every(i)
        x, y = x.to(device), y.to(device)
        n = (y != -1).sum()
        loss = loss_fn(x, y).float()
        sums += torch.stack([torch.where(n > 0, loss * n, 0.0), n.float()])
    return sums


def whole_val_loss(model, shard_dir, batch_size=16, device="cpu"):
    """A model's mean next-token loss over every val window of shard_dir once (data.DataLoader.sweep), the number
    train.py's final evaluation prints and the lab scores. Returns (loss, tokens)."""
    import torch
    import data
    loader = data.DataLoader(shard_dir, "val", batch_size, model.config.block_size, order="sequential")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        sums = token_loss_sums(lambda x, y: model(x, y)[1], loader.sweep(), device)
    model.train(was_training)
    total, n = sums.tolist()
    if n == 0:
        raise ValueError(f"{shard_dir}: no val window of {model.config.block_size + 1} tokens")
    return total / n, int(n)


# -----------------------------------------------------------------------------
# pretrained models: where --init_from, --teacher and --tokenizer name one instead of a checkpoint of ours


def is_model_source(name):
    """True when name is a pretrained model as published (GPT.from_pretrained takes it): a GGUF file, a Hugging
    Face model directory (config.json), or a hub id ("org/name", not a path on this machine)."""
    if not name or name in ("auto", "scratch", "byte", "gpt2"):
        return False
    if os.path.isfile(name):
        return name.endswith(".gguf")
    if os.path.isdir(name):  # a model (config.json) or a tokenizer alone (for --tokenizer)
        return any(os.path.exists(os.path.join(name, f)) for f in ("config.json", "tokenizer.json",
                                                                    "tokenizer_config.json")) and not hf_marker(name)
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.endswith((".pt", ".gguf", ".bin")) and not name.startswith(".")


def same_source(a, b):
    """Whether two tokenizer or model names are the same one: equal names, or two paths to the same file or folder."""
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


def source_slug(name):
    """A file-name-safe short name of a tokenizer or model source: byte and gpt2 as they are, a model by its last
    part without the extension and a hash of where it is (two models of one name do not share shards):
    data/models/SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct.Q4_1-<8 hex digits>."""
    import hashlib
    import re
    if name in ("byte", "gpt2"):
        return name
    base = os.path.basename(os.path.normpath(name))
    base = base[:-len(".gguf")] if base.endswith(".gguf") else base
    where = os.path.realpath(name) if os.path.exists(name) else name
    return (re.sub(r"[^A-Za-z0-9._-]+", "-", base) or "model") + "-" + hashlib.sha1(where.encode()).hexdigest()[:8]
