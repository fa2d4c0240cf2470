"""
Where a run runs: one process, or one of W processes started by torchrun; its device; how it stops on an error.

torchrun starts one process per GPU and tells each where it stands through three environment variables:
RANK (0 .. W-1 over all nodes), LOCAL_RANK (0 .. 7 on a node: which GPU it drives) and WORLD_SIZE (W). A plain
`python train.py` has none of them and is rank 0 of 1. Processes talk through a process group: NCCL between
GPUs, gloo between CPU processes. Only rank 0 prints and writes files; every rank computes.

    rt = Runtime.from_env("cuda")   # reads RANK / LOCAL_RANK / WORLD_SIZE, picks cuda:<LOCAL_RANK>
    rt.start()                      # joins the process group (nothing to do for one process)
    rt.log("only rank 0 prints")
    rt.barrier()                    # wait for every rank
    rt.close()

die(msg) prints one line "error: msg" on stderr (with the rank when it is not 0) and exits non-zero: the way
every bad input ends, without a traceback.
Used by train.py; tested by tests/test_scale.py (2 gloo processes on CPU).
"""

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


def die(msg, code=1):
    rank = int(os.environ.get("RANK", 0))  # under torchrun every rank may fail; say which one this is
    print(f"error: {msg}" if rank == 0 else f"error: [rank {rank}] {msg}", file=sys.stderr)
    sys.exit(code)


@dataclass
class Runtime:
    rank: int = 0          # this process among all processes
    local_rank: int = 0    # this process on its node: which GPU
    world: int = 1         # number of processes
    device: str = "cpu"    # e.g. "cuda:3" under torchrun, "cuda" or "cpu" alone

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
        if self.world > 1:
            if self.device_type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend="nccl" if self.device_type == "cuda" else "gloo")

    def log(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs)

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def all_reduce_(self, t):
        """Sum t over the ranks, in place (nothing to do for one process)."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def close(self):
        if self.world > 1:
            dist.destroy_process_group()
