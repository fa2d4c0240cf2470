"""
Checkpoints for exact resume: everything the next training step depends on, written so that a crash
never leaves a half file, and a preemption signal that ends a run cleanly at a step boundary.

Exact resume means a run stopped at step k and resumed computes the same steps k+1, k+2, ... bit for
bit as a run that never stopped (nanochat stores the loader position beside the weights for the same
reason). So a checkpoint holds the weights AND every piece of state the next step reads:

    step        int: the LR-schedule position and lambda (both are functions of the step)
    config      dict: the TrainConfig of the run (resume takes it, command-line overrides on top), the
                tokenizer's fingerprint and the run's id (run_id: random at a fresh start, kept by a resume)
    model_args  dict: the GPTConfig (shape and vocabulary; checked before any weight is loaded)
    model       state dict, plain tensors, no "module." / "_orig_mod." prefixes (also under
                DDP/FSDP)
    optimizer   state dict (Muon momentum buffers, AdamW moments and step counts), whole tensors
    zclip       ZClip statistics (or None)
    loader      data.DataLoader.state_dict: its sources, split, windows and order, and per source the
                windows read (cursor), with the mixing RNG
    rng         torch (CPU and CUDA), numpy and python RNG states of rank 0
    val_loss    float: the val loss evaluated at this step, or None (a checkpoint saved between
                evaluations)

FSDP2 shards (DTensors) are gathered into whole tensors before saving, so a checkpoint loads at any
world size, with or without FSDP: shard_optimizer_state() cuts the loaded optimizer state back into
shards.

Layout of <dir>:  ckpt_<step>.pt for the last keep_last checkpoints, and ckpt.pt, the newest one (a
                  hard link
to it: no extra space; sample.py, tools/export.py and --resume read ckpt.pt). Rotation never deletes
the older checkpoint with the best finite val loss while the new one is not known to be as good (a
run that diverged, or a save between evaluations): that one stays beside the newest.

Atomic write (tools/atomic.py atomic_write): torch.save into <name>.<writer>.tmp, fsync, rename over
<name>, fsync the directory. A rename is atomic on POSIX, so <name> is always a complete old or a
complete new file; a process killed mid-write leaves only a stale .tmp, which the next save removes.

Preemption: atomic.StopSignal turns SIGTERM/SIGINT into a flag; the training loop finishes its step,
saves and exits with code 0. A second signal of the same kind stops at once (the last checkpoint is
kept).

Test:  python -m pytest tests/test_fault.py tests/test_scale.py
This file imports only torch, numpy, the standard library, tokenizer.py (save_run records the
tokenizer's fingerprint), tools/atomic.py and tools/flags.py.
"""

import atexit
import copy
import dataclasses
import errno
import math
import os
import random
import re
import time
import zipfile

import numpy as np
import torch
import torch.distributed as dist

from tokenizer import fingerprint, get_tokenizer
from zclip import CONFIG_KEYS as ZCLIP_CONFIG
from tools import atomic
from tools.flags import die

LATEST = "ckpt.pt"
AVERAGED = "avg.pt"  # the checkpoint average (lessons/averaging.py), when a run keeps one
RUN_ID = "run_id"  # config's key for the run's id (random at its start, kept by a resume); exports record it
NUMBERED = re.compile(r"ckpt_(\d+)\.pt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not have the expected contents; the message names
    the file."""

# -----------------------------------------------------------------------------
# state in, state out


def seed_all(seed):
    """Seed python, numpy and torch (every device): the RNG states a checkpoint saves then start out
    the same."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state():
    """The RNG states of this process as plain types (they load with
    torch.load(weights_only=True))."""
    np_state = np.random.get_state(legacy=False)
    # ndarray -> list: weights_only-safe
    np_state["state"]["key"] = np_state["state"]["key"].tolist()
    return {"python": random.getstate(), "numpy": np_state, "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    random.setstate(state["python"])
    np_state = dict(state["numpy"])
    np_state["state"] = dict(np_state["state"], key=np.array(np_state["state"]["key"], dtype=np.uint32))
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def full_state(obj, keep=None, _memo=None):
    """A copy of a nested state dict with every tensor detached and on the CPU, and every DTensor
    (an FSDP2 shard) gathered into the whole tensor. Under FSDP this is a collective: every rank
    must call it; only rank 0 (keep=None) gets the tensors, the others get None in their place.
    Tensors that are the same object (the tied embedding and LM head) stay one tensor, so it is
    saved once."""
    keep = (not dist.is_initialized() or dist.get_rank() == 0) if keep is None else keep
    memo = {} if _memo is None else _memo
    if isinstance(obj, dict):
        return {k: full_state(v, keep, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_state(v, keep, memo) for v in obj)
    if not isinstance(obj, torch.Tensor):
        return obj
    # same object on every rank, so every rank gathers the same tensors in order
    if id(obj) not in memo:
        t = obj.full_tensor() if hasattr(obj, "full_tensor") else obj
        memo[id(obj)] = t.detach().cpu() if keep else None
    return memo[id(obj)]


def shard_optimizer_state(optimizer):
    """After optimizer.load_state_dict(whole tensors) with FSDP2 (DTensor) parameters: cut every
    state tensor shaped like its parameter into that parameter's local shard. No communication: each
    rank keeps its part."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    for p, st in optimizer.state.items():
        if isinstance(p, DTensor):
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == p.shape:
                    st[k] = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)


def training_state(step, config, model_args, model, optimizer, clipper=None, loader=None, val_loss=None):
    """The checkpoint dict of the format above. Collective under FSDP2 (every rank calls it)."""
    return {"step": step, "config": config, "model_args": model_args, "val_loss": val_loss,
            # keep_vars: tied weights stay one object
            "model": full_state(model.state_dict(keep_vars=True)),
            "optimizer": full_state(optimizer.state_dict()),
            "zclip": full_state(clipper.state_dict()) if clipper is not None else None,
            "loader": loader.state_dict() if loader is not None else None, "rng": rng_state()}

def averaged_state(state, model, average):
    """avg.pt: the training checkpoint `state`'s step, config and model_args, with the weights of
    the checkpoint average (averaging.CheckpointAverage) as its model, so every reader of ckpt.pt
    reads it too."""
    with average.swapped_in(model):
        # deepcopy: on the CPU full_state's tensors ARE the parameters, which get their own weights
        # back
        weights = copy.deepcopy(full_state(model.state_dict(keep_vars=True)))
    return {**{key: state[key] for key in ("step", "config", "model_args")}, "model": weights,
            "averaged": {"steps": average.steps()[:average.count], "alpha": average.alpha}}


def restore(ckpt, optimizer, clipper=None):
    """Load the optimizer (then cut it into FSDP2 shards where the parameters are DTensors), ZClip
    and RNG states of ckpt: their state (moments, momentum, ZClip's statistics) is the saved one,
    their settings this run's. torch's load_state_dict puts back the saved groups' settings and
    ZClip's its saved config; each group's settings (initial_lr, initial_wd, betas, Muon's lr
    adjustment, ...) and ZClip's config are then set to the ones this optimizer and clipper were
    built with, so a flag given on resume takes effect; without one they equal the saved ones."""
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointError("the saved optimizer state does not fit this optimizer "
                              f"({type(e).__name__}: {e})")
    for g, settings in zip(optimizer.param_groups, fresh):
        g.update(settings)
    shard_optimizer_state(optimizer)
    if clipper is not None and ckpt.get("zclip") is not None:
        built = {k: getattr(clipper, k) for k in ZCLIP_CONFIG}
        clipper.load_state_dict(ckpt["zclip"])
        for k, v in built.items():
            setattr(clipper, k, v)
    if ckpt.get("rng") is not None:
        set_rng_state(ckpt["rng"])  # rank 0's states, on every rank

# -----------------------------------------------------------------------------
# files


def check_writable(d):
    """Create d if needed and prove a file can be written in it; OSError otherwise. The directories made
    here are removed at exit if still empty (a run refused during set-up leaves no empty out/stage<N>)."""
    made, p = [], os.path.abspath(d)
    while not os.path.exists(p):
        made, p = made + [p], os.path.dirname(p)
    os.makedirs(d, exist_ok=True)
    if made:
        atexit.register(_remove_empty, made)
    probe = os.path.join(d, f".write_test.{os.getpid()}")
    open(probe, "w").close()
    os.remove(probe)


def _remove_empty(dirs):
    """Remove dirs, deepest first, while each is empty."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:  # not empty (the run wrote something), or gone
            return


def atomic_save(obj, path):
    """torch.save through atomic.atomic_write: path is the whole old file or the whole new one. A
    failed write raises OSError; torch.save's zip writer reports a full disk as RuntimeError, which
    becomes ENOSPC (else EIO), and the file-size limit (ulimit -f) as one, which becomes EFBIG. A
    signal that stopped the write (Ctrl-C, or StopSignal's Interrupted raised inside the writer,
    which torch turns into a RuntimeError) is raised as itself: a stop, not a disk failure."""
    try:
        with atomic.atomic_write(path) as tmp, open(tmp, "wb") as f:
            try:
                torch.save(obj, f)
            except RuntimeError as e:
                if atomic.past_size_limit(f):  # ulimit -f: EFBIG, whatever torch's message says
                    raise OSError(errno.EFBIG, os.strerror(errno.EFBIG)) from e
                raise
    except RuntimeError as e:
        cause = e.__context__
        while cause is not None and not isinstance(cause, (KeyboardInterrupt, atomic.Interrupted)):
            cause = cause.__context__
        if cause is not None:
            raise cause from None
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise OSError(errno.ENOSPC if "space" in why.lower() else errno.EIO, why) from e


def _atomic_link(src, dst):
    """Make dst name the file src (a hard link; a copy where the filesystem has none),
    atomically."""
    with atomic.atomic_write(dst) as tmp:
        atomic.link_or_copy(src, tmp)


def existing_run(d):
    """The files of an earlier run in d (checkpoints, metrics), which a fresh run must not mix with
    its own."""
    names = os.listdir(d) if os.path.isdir(d) else []
    return sorted(n for n in names if n in (LATEST, AVERAGED, "metrics.jsonl") or NUMBERED.fullmatch(n))


def before_first_save(d):
    """Whether d holds a run that ended before its first checkpoint: its metrics.jsonl, no
    checkpoint to resume."""
    names = existing_run(d)
    return "metrics.jsonl" in names and not (set(names) - {"metrics.jsonl"})


def remove_run(d):
    """Delete an earlier run's files from d (asked for with --overwrite=True)."""
    for n in existing_run(d):
        os.remove(os.path.join(d, n))


def _where():
    """This process's host and PID namespace (its inode; 0 without /proc): where its pids mean something."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{atomic._host()} {ns}"


def _quiet_for(d):
    """Seconds since anything in d last changed (its newest entry's mtime)."""
    newest = 0.0
    for n in os.listdir(d):
        try:
            newest = max(newest, os.stat(os.path.join(d, n)).st_mtime)
        except OSError:  # removed meanwhile
            pass
    return time.time() - newest


def lock(d):
    """Claim d for this process: d/.lock holds our pid, when this process started
    (atomic._start_time; 0 unknown), our host and PID namespace. Another live process's lock raises
    CheckpointError; a dead one's (a killed run, also when its pid now belongs to another process,
    this one included) is taken over. A lock written on another host, or in another PID namespace (a
    container), cannot be checked from here: it is refused, naming the file to remove if that run is
    gone, until nothing in d has changed for atomic.STALE_AFTER_S (a day: a live run logs far more
    often), as atomic treats another host's leftovers. Returns a function that releases the lock."""
    path = os.path.join(d, ".lock")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                # "<pid> <start> <host> <namespace>"; older locks "<pid> <start>" or "<pid>"
                pid, *rest = open(path).read().split()
                pid, start, where = int(pid), int(rest[0]) if rest else 0, " ".join(rest[1:3])
            except (ValueError, FileNotFoundError):
                pid, start, where = 0, 0, ""
            if pid > 0 and where and where != _where() and _quiet_for(d) <= atomic.STALE_AFTER_S:
                raise CheckpointError(f"{d}: a run on {where.split()[0]} (pid {pid}, in another host or "
                                      f"container: its lock file {path}) is writing here; wait for it, or "
                                      "pass another --out_dir or --run_name (if that run is gone, remove the "
                                      "lock file)") from None
            # stale: its run is gone
            if pid <= 0 or not atomic._running(pid, start or None):
                if os.path.exists(path):
                    os.remove(path)
                continue
            raise CheckpointError(f"{d}: another run (pid {pid}, in its lock file {path}) is "
                                  "writing here; wait for it, stop it, or pass another --out_dir "
                                  "or --run_name") from None
        start = atomic._start_time(os.getpid())
        try:
            os.write(fd, f"{os.getpid()} {start or 0} {_where()}".encode())
        except OSError as e:  # a full disk: no lock left behind, one line
            os.close(fd)
            os.remove(path)
            why, cause, fix = atomic.write_failed(e, path)
            raise CheckpointError(f"{d}: cannot write the lock file {path} ({why}; {cause}); {fix}, or "
                                  "pass another --out_dir") from None
        os.close(fd)
        return lambda: os.path.exists(path) and os.remove(path)
    raise CheckpointError(f"{d}: cannot take the lock file {path}; remove it if no run is using "
                          f"{d}")


def all_finite(model):
    """True when every parameter of model is finite: one fused reduction and one host read (at save
    time)."""
    params = [p for p in model.parameters()]
    norms = torch._foreach_norm([p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
                                 for p in params], 2.0)
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def numbered(d):
    """The ckpt_<step>.pt files in d, oldest first."""
    names = [n for n in (os.listdir(d) if os.path.isdir(d) else []) if NUMBERED.fullmatch(n)]
    return [os.path.join(d, n) for n in sorted(names, key=lambda n: int(NUMBERED.fullmatch(n).group(1)))]


def save(obj, d, keep_last=1):
    """Write obj as d/ckpt_<step>.pt, point d/ckpt.pt at it, then delete all but the newest
    keep_last numbered checkpoints, except the one with the best finite val loss when obj's is not
    known to be as good. Returns (d/ckpt.pt, None or (val loss, path) of the older checkpoint kept
    for its val loss)."""
    # killed writers'
    for n in {n.split(".pt.")[0] + ".pt" for n in os.listdir(d) if n.endswith(".tmp")}:
        if n == LATEST or NUMBERED.fullmatch(n):
            atomic.clear_stale(os.path.join(d, n))
    path = os.path.join(d, f"ckpt_{obj['step']:06d}.pt")
    atomic_save(obj, path)
    latest = os.path.join(d, LATEST)
    _atomic_link(path, latest)
    # never a later step: not this run's past
    older = [p for p in numbered(d) if step_of(p) < obj["step"]]
    best = min(((v, p) for p in older if (v := saved_val_loss(p)) is not None), default=None)
    new = obj.get("val_loss")
    kept = best if best is not None and not (new is not None and math.isfinite(new) and new <= best[0]) else None
    for old in older[:max(len(older) - (keep_last - 1), 0)]:
        if kept is None or old != kept[1]:
            os.remove(old)
    return latest, kept


def saved_val_loss(path):
    """The finite val loss saved in the checkpoint at path, or None (none evaluated, not finite,
    unreadable)."""
    try:
        v = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("val_loss")
    except Exception:
        return None
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def step_of(path):
    return int(NUMBERED.fullmatch(os.path.basename(path)).group(1))


# -----------------------------------------------------------------------------
# a training run's checkpoint: its state gathered, written by rank 0


def save_run(run, step, val_loss=None):
    """train.py's checkpoint of run at step: every rank calls it (FSDP2 gathers shards); rank 0 writes. A failed
    write keeps the previous checkpoint, and so do non-finite weights: they never replace a finite checkpoint.
    val_loss: this step's, when evaluated; an older checkpoint with a better one is kept beside the new (save),
    and a line says so."""
    if not all_finite(run.model):
        die(f"step {step}: the weights are not finite, so they were not saved; {run.ckpt_path} is kept; lower "
            f"--lr or --muon_lr and continue from it with --resume=True")
    tok = fingerprint(get_tokenizer(run.cfg.tokenizer))
    config = {**dataclasses.asdict(run.cfg), "tokenizer_fingerprint": tok, RUN_ID: run.run_id}
    state = training_state(step, config, dataclasses.asdict(run.model.config),
                           run.model, run.optimizer, run.clipper, run.train_loader, val_loss)
    if run.loss_scale is not None and run.loss_scale.enabled:  # float16's: resumed as it was
        state["loss_scale"] = run.loss_scale.state_dict()
    averaged = None
    if run.average is not None:
        state["average"] = run.average.state_dict()
        averaged = averaged_state(state, run.model, run.average) if run.average.count else None
    wrote = None
    try:
        if run.rt.master:
            wrote, kept = save(state, run.out_dir, run.cfg.keep_last)
            if kept is not None:
                now = f"val loss {val_loss:.4g}" if val_loss is not None else "no val loss (not evaluated)"
                run.rt.log(f"kept {kept[1]} (step {step_of(kept[1])}, val loss {kept[0]:.4f}) beside "
                           f"the new {run.ckpt_path} (step {step}, {now}): rotation never deletes a "
                           f"better checkpoint")
            if averaged is not None:
                atomic_save(averaged, os.path.join(run.out_dir, AVERAGED))
    except OSError as e:  # e.g. a full disk: the atomic write left the file it was writing as it was
        why, cause, fix = atomic.write_failed(e, run.ckpt_path)
        if wrote is None:
            die(f"cannot write a checkpoint to {run.out_dir}: {why}; {cause}; the previous one is kept; "
                f"{fix} and continue with --resume=True")
        die(f"cannot write {os.path.join(run.out_dir, AVERAGED)}: {why}; {cause}; the checkpoint of "
            f"step {step} was saved, the previous average is kept (it does not include step {step}); "
            f"{fix} and continue with --resume=True")
    run.rt.barrier()


def crc_failure(path):
    """The first record of a torch.save zip whose bytes fail their recorded CRC-32 (torch.load reads
    them unchecked), or None. A record written without a CRC (torch.serialization.set_crc32_options(
    False) records 0) is not checked."""
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.CRC == 0:
                continue
            try:
                with z.open(info) as f:  # zipfile compares the CRC once the record is read to its end
                    while f.read(1 << 24):
                        pass
            except zipfile.BadZipFile:
                return info.filename
    return None


def _older_beside(path):
    """"; older checkpoints beside it: ..." for an error line about the checkpoint at path ("" if none)."""
    older = [os.path.basename(p) for p in numbered(os.path.dirname(path) or ".") if not os.path.samefile(p, path)]
    return f"; older checkpoints beside it: {', '.join(older)}" if older else ""


def load(path, required=("model", "model_args"), mmap=False):
    """torch.load(weights_only=True) with one clear error for a missing, truncated, corrupt or
    foreign file. mmap=True maps the tensors instead of reading them (a look at model_args costs
    nothing)."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    # a truncated zip, random bytes, an unsafe pickle: one line, never a traceback
    except Exception as e:
        from tools.outputs import KINDS, file_kind
        kind = file_kind(path)[0]
        kind = "corrupt" if kind == "text" and path.endswith((".pt", ".pth")) else kind  # a damaged checkpoint
        if kind in ("metrics", "text", "png", "gzip", "directory", "safetensors"):  # whole, but not a checkpoint
            raise CheckpointError(f"{path}: {KINDS[kind]}, not a training checkpoint (a torch.save zip archive); "
                                  "pass a ckpt.pt that train.py wrote") from None
        why = (f"{type(e).__name__}: "
               f"{(str(e).splitlines() or [''])[0][:120]}" if zipfile.is_zipfile(path)
               else f"{os.path.getsize(path)} bytes, not a torch.save zip archive")
        raise CheckpointError(f"{path}: cannot load checkpoint, the file is corrupt or truncated "
                              f"({why}){_older_beside(path)}") from None
    bad = None if mmap else crc_failure(path)  # a peek (mmap) reads too little to check
    if bad:
        raise CheckpointError(f"{path}: the checkpoint is damaged: {bad} fails the CRC-32 torch.save recorded "
                              f"(a disk or copy error changed its bytes){_older_beside(path)}")
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a training checkpoint (missing {', '.join(missing)})")
    resume = [k for k in ("zclip", "rng") if "optimizer" in required and ckpt.get(k) is not None]
    for key in (*required, *resume):
        why = _damaged(key, ckpt[key])
        if why:
            fix = (f"start a new run from its weights with --init_from={path}" if key in RESUME_ONLY
                   and not _damaged("model", ckpt.get("model")) else "use a checkpoint written by "
                                                                     "train.py")
            raise CheckpointError(f"{path}: a damaged or older-layout checkpoint: its {key} {why}; "
                                  f"{fix}")
    return ckpt


# --resume's; the weights load without
RESUME_ONLY = ("step", "config", "optimizer", "loader", "zclip", "rng")


def _damaged(key, value):
    """Why value cannot be a training checkpoint's `key` of today's layout (the table in the
    docstring), or None."""
    want = {"step": int, "config": dict, "model_args": dict, "model": dict, "optimizer": dict,
            "loader": dict, "zclip": dict, "rng": dict}
    if key not in want:
        return None
    if not isinstance(value, want[key]) or isinstance(value, bool):
        article = "an" if want[key] is int else "a"
        return f"is {type(value).__name__}, not {article} {want[key].__name__}"
    keys = {"optimizer": ("state", "param_groups"), "loader": ("order", "cursor"),
            "rng": ("python", "numpy", "torch", "cuda")}.get(key, ())
    lacks = [k for k in keys if k not in value]
    if not lacks:
        return None
    have = ", ".join(map(str, sorted(value, key=str))) or "none"
    return f"has keys {have}, without {', '.join(lacks)}"

def saved_lambda(ckpt):
    """The lambda a checkpoint's BitLinear buffers hold (their smallest), or None for a
    full-precision model."""
    lams = [float(v.min()) for k, v in ckpt["model"].items() if k.endswith("lambda_")]
    return min(lams) if lams else None



def check_fits(saved_args, conf, path):
    """Refuse, before loading anything, a checkpoint whose weights have other shapes or another
    vocabulary than the model conf (a GPTConfig) builds."""
    keys = ("vocab_size", "n_layer", "n_head", "n_embd", "mlp_hidden", "tie_embeddings")
    diff = [k for k in keys if saved_args.get(k) != getattr(conf, k)]
    if diff:
        raise CheckpointError(
            f"{path}: checkpoint has {', '.join(f'{k}={saved_args.get(k)}' for k in diff)} but "
            f"this run builds {', '.join(f'{k}={getattr(conf, k)}' for k in diff)}; use the "
            "--n_layer/--n_head/--n_embd/--tokenizer/--pad_vocab of the run that wrote it (the "
            "vocabulary comes from --tokenizer)")


def load_weights(model, state, path, insert_subln=False):
    """Load a state dict; lambda_ buffers may be missing (an fp checkpoint into a ternary model),
    and with insert_subln the SubLN gains too: they keep their unit init (BitDistill, arXiv
    2510.13998, Stage 1)."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape mismatch that check_fits did not catch
        raise CheckpointError(f"{path}: checkpoint does not fit this model "
                              f"({str(e).splitlines()[-1].strip()[:200]})") from None
    missing = [k for k in missing if not k.endswith("lambda_") and not (insert_subln and ".subln." in k)]
    if missing and not unexpected and all(".subln." in k for k in missing):
        raise CheckpointError(f"{path}: its model was trained without SubLN (--subln=False) and "
                              "this run's has it; pass --subln=False, or start stage 1 from it "
                              "(stage 1 inserts SubLN)")
    if missing or unexpected:
        raise CheckpointError(f"{path}: checkpoint does not fit this model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}); check "
                              "n_layer/n_embd/n_head/subln/tokenizer")



if __name__ == "__main__":
    import tempfile
    d = tempfile.mkdtemp()
    for step in (10, 20, 30):
        save({"step": step, "model": {"w": torch.full((2,), float(step))}, "model_args": {}}, d, keep_last=2)
    print(sorted(os.listdir(d)), "-> ckpt.pt is "
                                 "step", load(os.path.join(d, LATEST))["step"], "(expect 30)")
    open(os.path.join(d, "bad.pt"), "wb").write(b"not a checkpoint")
    try:
        load(os.path.join(d, "bad.pt"))
    except CheckpointError as e:
        print("error:", e)
