"""
Where a run runs: one process, or one of W processes started by torchrun; its device; how the model
is spread over the processes (DDP or FSDP2, and torch.compile); how a run stops on an error.

torchrun starts one process per GPU and tells each where it stands through three environment
variables: RANK (0 .. W-1 over all nodes), LOCAL_RANK (0 .. 7 on a node: which GPU it drives) and
WORLD_SIZE (W). A plain `python train.py` has none of them and is rank 0 of 1. Processes talk
through a process group: NCCL between GPUs, gloo between CPU processes. Only rank 0 prints and
writes files; every rank computes.

    rt = Runtime.from_env("cuda")   # reads RANK / LOCAL_RANK / WORLD_SIZE, picks cuda:<LOCAL_RANK>
    rt.start()                      # joins the process group (nothing to do for one process); on
                                    # CPU keeps freed memory for the next step (keep_freed_memory)
    rt.log("only rank 0 prints")    # rt.log_json(out_dir, record) appends to out_dir/metrics.jsonl
    rt.barrier()                    # wait for every rank
    # what the step calls:
    train_model = rt.wrap(model, fsdp=False, compile=False)
    rt.close()

DDP keeps a whole model per rank and all-reduces gradients; FSDP2 (fsdp=True) shards parameters,
gradients and optimizer state by rows and gathers each block's weights just before it runs. Both
reduce gradients only on the last micro-batch of a step (train.py's grad_sync).

Used by train.py; tested by tests/test_scale.py (2 gloo processes on CPU) and tests/test_runtime.py
(in this process: torchrun's environment on two nodes, cuda:<LOCAL_RANK>, wandb on rank 0 only,
wandb not logged in).
"""

import inspect
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tools import checkpoint
from tools.flags import die


@dataclass
class Runtime:
    rank: int = 0          # this process among all processes
    local_rank: int = 0    # this process on its node: which GPU
    world: int = 1         # number of processes
    device: str = "cpu"    # e.g. "cuda:3" under torchrun, "cuda" or "cpu" alone
    wandb: object = None   # a wandb run (--wandb_project) that gets every metrics.jsonl record too,
                           # rank 0 only

    @classmethod
    def from_env(cls, device):
        rank, local_rank, world = (int(os.environ.get(k, 1 if k == "WORLD_SIZE" else 0))
                                   for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        if device.startswith("cuda") and world > 1:
            device = f"cuda:{local_rank}"
        return cls(rank, local_rank, world, device)

    @property
    def device_type(self):
        return "cuda" if self.device.startswith("cuda") else "cpu"

    @property
    def master(self):
        return self.rank == 0

    def start(self):
        if self.device_type == "cpu":
            keep_freed_memory()
        if self.world > 1:
            if self.device_type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend="nccl" if self.device_type == "cuda" else "gloo")

    def log(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs)

    def log_json(self, out_dir, rec):
        """Append rec as one JSON line to out_dir/metrics.jsonl (rank 0 only)."""
        if self.master:
            with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            if self.wandb is not None:  # numbers only (the commit goes to the wandb run's config)
                self.wandb.log({k: v for k, v in rec.items() if k != "step" and v is not None
                                and not isinstance(v, str)}, step=rec["step"])

    def start_wandb(self, project, name, config):
        """--wandb_project: log to Weights & Biases on rank 0 only (one run per job, never one per
        rank) when wandb is installed; say so when it is not. wandb's own errors from init (not
        logged in: UsageError; a bad key or no network: CommError) end in one line saying how to log
        in, not a traceback."""
        if not project or not self.master:
            return
        import importlib.util
        if importlib.util.find_spec("wandb") is None:
            self.log(f"--wandb_project={project}: wandb is not installed (pip install wandb), so "
                     "this run logs to metrics.jsonl only")
            return
        import wandb
        # UsageError, CommError, AuthenticationError
        errors = getattr(getattr(wandb, "errors", None), "Error", ())
        try:
            self.wandb = wandb.init(project=project, name=name, config=config)
        # not logged in (no API key, no tty to ask for one), a bad key, no network
        except errors as e:
            why = (str(e).strip().splitlines() or [""])[0]
            die(f"--wandb_project={project}: wandb could not start a run ({type(e).__name__}: "
                f"{why}); log in with `wandb login` or set WANDB_API_KEY (WANDB_MODE=offline logs "
                "locally), or drop --wandb_project")

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def all_reduce_(self, t):
        """Sum t over the ranks, in place (nothing to do for one process)."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()
        if self.world > 1:
            # every rank done (rank 0's checkpoint written) before any tears gloo/NCCL down: a rank
            # whose teardown raced another's exit once ended in SIGABRT after a finished CPU run
            dist.barrier()
            dist.destroy_process_group()

    def wrap(self, model, fsdp, compile):
        """The module the training step calls: model (a GPT: its forward gives the states too),
        compiled if asked, in DDP (world > 1) or with model sharded by FSDP2 (fsdp=True: fully_shard
        each block, then the root)."""
        if fsdp and self.world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
            mesh = init_device_mesh(self.device_type, (self.world,))
            for block in model.h:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            # gathers the weights for it too
            register_fsdp_forward_method(model, "forward_with_states")
        elif fsdp:
            self.log("--fsdp=True in one process: nothing to shard, training unsharded")
        train_model = model
        if compile and self.device_type == "cpu":
            deterministic_cpu_compile()
        train_model = torch.compile(train_model) if compile else train_model
        if self.world > 1 and not fsdp:
            from torch.nn.parallel import DistributedDataParallel as DDP
            # lambda buffers are set identically on every rank, so they need no broadcast each
            # forward (torch 2.13 calls that forward_sync_buffers and warns at broadcast_buffers;
            # older torch knows only broadcast_buffers)
            no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                       else "broadcast_buffers")
            train_model = DDP(train_model,
                              device_ids=[self.local_rank] if self.device_type == "cuda" else None,
                              **{no_sync: False})
        return train_model

    def replica_group(self, fsdp):
        """DDP's process group (Muon shares out its Newton-Schulz work over it); None for one
        process or FSDP2, whose parameters bring their own mesh."""
        return dist.group.WORLD if self.world > 1 and not fsdp else None


def leave_after_torchrun():
    """End a process started by torchrun (WORLD_SIZE > 1) at once, exit status 0, once its run has
    finished (Runtime.close passed the last barrier; the script has nothing left to do): its output
    flushed, Python's teardown skipped (C++ destructors included, gloo's threads among them), where a
    rank of a finished CPU run could end in "terminate called without an active exception" (SIGABRT)
    and fail the run. tests/test_scale.py's workers leave the same way. Nothing to do in a single
    process."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def deterministic_cpu_compile():
    """Make torch.compile's CPU kernels give the same bits on every run. Inductor adds the embedding's
    gradient rows into place with atomic adds from all threads, so their order, and the last bits of
    every step after the first, changed from run to run; torch's deterministic mode makes it call
    aten's ordered index_put instead (tests/test_train.py: 6 compiled steps, one set of bits). Memory
    that torch.empty hands out is left as it is (deterministic mode would fill it with NaN first:
    a pass over every buffer, for nothing here: the step writes before it reads)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


# keep_freed_memory's setting: glibc's mmap threshold fixed at 32 MiB, a trim threshold never reached;
# GLIBC_TUNABLES gives another program (real nanoGPT in lab/against_nanogpt.py) the same through its environment
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 2**31 - 1
GLIBC_TUNABLES = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"


def keep_freed_memory():
    """Let a CPU run's next step reuse the memory its last step freed (Linux with glibc; elsewhere
    nothing changes). glibc gives large freed blocks back to the kernel (blocks past its mmap
    threshold, and the top of the heap past its trim threshold), and the next step's tensors then
    touch fresh pages: a page fault and a zeroed 4 KiB page each, thousands a step in the quick
    start's eager step (python -m lab.bench --train --keep_memory=False prints them per step).
    Here the mmap threshold is fixed at 32 MiB (the ceiling glibc's own moving threshold stops at)
    and the heap is never trimmed: tensors up to 32 MiB come from pages the process already has,
    and the process keeps its peak memory until it ends. The trim threshold is set only once the
    mmap one was taken (setting either fixes both, and a fixed 128 KiB mmap threshold would fault
    far more). Returns whether glibc took both."""
    import ctypes
    import platform
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def git_commit(d=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
    """`git rev-parse HEAD` of the checkout holding d (by default this code's), with "-dirty" after it
    when a tracked file differs from that commit (the code that ran is not the commit's), or
    "unknown" where there is no checkout (a copy outside git, or no git installed)."""
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=d, capture_output=True, text=True,
                           timeout=30)
        if p.returncode != 0 or not p.stdout.strip():
            return "unknown"
        s = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=d,
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return p.stdout.strip() + ("-dirty" if s.returncode == 0 and s.stdout.strip() else "")


# -----------------------------------------------------------------------------
# the device flag, and the line a rank prints when another rank is lost


def check_device(device, flag="--device"):
    """auto, cpu, cuda or cuda:<index> that this machine has: train.py's and sample.py's one rule,
    refused in one line naming the flag before anything is read."""
    dev = device.split(":")
    if device != "auto" and (dev[0] not in ("cpu", "cuda") or len(dev) > 2 or
                             (len(dev) == 2 and not dev[1].isdigit())):
        die(f"{flag}={device}: expected auto, cpu, cuda or cuda:<index>", 2)
    if dev[0] == "cuda" and not torch.cuda.is_available():
        die(f"{flag}={device}: no CUDA device here; use {flag}=cpu", 2)
    if dev[0] == "cuda" and len(dev) == 2 and int(dev[1]) >= torch.cuda.device_count():
        die(f"{flag}={device}: this machine has {torch.cuda.device_count()} CUDA device(s)", 2)


def lost_rank_error(rt, e):
    """Whether e, a RuntimeError under torchrun, is a failed collective (another rank stopped)
    rather than a bug of this rank's own."""
    return rt.world > 1 and (isinstance(e, getattr(torch.distributed, "DistError", ())) or any(
        w in str(e) for w in ("gloo", "NCCL", "Connection", "connection")))


def lost_rank(run, e):
    """e, a RuntimeError of train.py's set-up (run None) or loop: re-raised unless a collective failed
    because another rank stopped (lost_rank_error); then one line per rank instead of a traceback:
    in set-up, that another rank stopped there (its own line says why); in the loop, the checkpoint
    the whole job resumes from (torchrun's own summary names the rank that exited first)."""
    if not lost_rank_error(run.rt if run is not None else Runtime.from_env("cpu"), e):
        raise e
    if run is None:
        die("another rank of this run stopped during set-up; its own error line says why")
    why = next((line.strip() for line in str(e).splitlines() if line.strip()),
               type(e).__name__)[:160]
    step = checkpoint.load(run.ckpt_path,
                           ("step",))["step"] if os.path.exists(run.ckpt_path) else None
    resume = (f"restart all {run.rt.world} ranks with the same torchrun command and --resume=True "
              f"to continue from {run.ckpt_path} (step {step})") if step is not None else \
        "no checkpoint was written yet; start again: the same torchrun command with --overwrite=True"
    die(f"lost contact with another rank of this {run.rt.world}-process run ({why}); torchrun's "
        f"summary names the rank that stopped; {resume}")


class StepTimer:
    """Wall time per step, averaged over the steps since the last lap (a log line) or reset (after
    an eval or a checkpoint, whose time is not step time). The loop counts steps with timer.steps +=
    1."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.t0, self.steps = time.time(), 0

    def lap(self):
        dt = (time.time() - self.t0) / max(self.steps, 1)
        self.reset()
        return dt


def read_metrics(path):
    """The records of a metrics.jsonl as log_json writes them. A torn last line (a run killed while
    writing it) is left out; an earlier line that is not a JSON object, or whose step is not an
    integer, raises ValueError naming the file and the line. A step logged again replaces what was logged from that step on: a run killed
    between checkpoints logged steps that its resume (from the last checkpoint) runs and logs again,
    and only the resumed run's records of them describe the weights it went on with. The file itself
    keeps them all."""
    with open(path, errors="replace") as f:
        lines = f.read().split("\n")  # a complete file ends with "\n": its last item is ""
    recs, last = [], None  # last: the step of the latest step record
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            rec = e
        if isinstance(rec, dict) and "step" in rec and (isinstance(rec["step"], bool)
                                                       or not isinstance(rec["step"], int)):
            raise ValueError(f"{path}, line {i}: step {rec['step']!r} is not an integer; repair or delete that "
                             "line")
        if isinstance(rec, dict):
            if "step" in rec and "val_loss" not in rec:  # a step record: earlier ones from its step on go
                if last is not None and rec["step"] <= last:
                    recs = [r for r in recs if r.get("step", -1) < rec["step"]]
                last = rec["step"]
            recs.append(rec)
        elif i < len(lines):
            raise ValueError(f"{path}, line {i}: not a JSON object ({rec}); repair or delete that "
                             "line")
    return recs
