"""
Muon under DDP or FSDP2: the same update as muon.Muon in one process, bit for bit, with NS5 shared out over the ranks.

NS5 is Muon's expensive part, so each of the W ranks orthogonalises every W-th unit (round-robin: unit i belongs to
rank i % W) and broadcasts the result to the others. A unit is one matrix, or where the single-process step batches
(Muon.batched_devices), the stack of one shape's matrices, so that NS5 sees exactly what it sees in one process (a
batch may round differently from its matrices one by one). Momentum, cheap and elementwise, runs on every rank for
every matrix, so each rank's optimizer state is complete (DDP: replicated; FSDP2: each rank's shard). FSDP2 shards
matrices by rows, and NS5 needs whole ones: every rank all-gathers each momentum update (DTensor.full_tensor), the
owner orthogonalises and broadcasts it, and each rank applies its own rows. That moves 2x the bytes of an ideal
gather-to-owner / scatter-back, and is the simplest correct form.

    opt = ShardedMuon(configure_muon(model, ...).param_groups, ns_dtype=..., process_group=dist.group.WORLD)

process_group: DDP's replicated parameters share out over it; FSDP2 (DTensor) parameters use their mesh's group;
with neither, or one rank, the step is Muon's own. Used by train.py under torchrun.
Test: python -m pytest tests/test_scale.py -k muon  (2 gloo processes against one)
"""

import torch
import torch.distributed as dist

from muon import Muon, adjusted_lr, by_shape, muon_update, zeropower_via_newtonschulz5


class ShardedMuon(Muon):
    def __init__(self, params, process_group=None, **kwargs):
        self.process_group = process_group
        super().__init__(params, **kwargs)

    def __getstate__(self):
        return {**super().__getstate__(), "process_group": self.process_group}

    def update_matrices(self, params, group, batched):
        pg = sharing_group(params, self.process_group)
        if pg is None:
            return super().update_matrices(params, group, batched)
        shared_step(self, params, group, pg, batched)


def sharing_group(params, process_group):
    """The group whose ranks share out NS5 for these params, or None for the single-process step."""
    meshes = [p.device_mesh for p in params if hasattr(p, "device_mesh")]
    pg = meshes[0].get_group() if meshes else process_group  # FSDP2 parameters: their mesh's group
    return pg if pg is not None and dist.get_world_size(pg) > 1 else None


def shared_step(opt, params, group, pg, batched):
    """Muon.step for one param group, NS5 round-robin over the ranks of pg (by stacks of one shape if
    batched, else by matrices). Every rank must call it."""
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    units = list(by_shape(params).values()) if batched else [[p] for p in params]
    outs, works = [], []
    for i, ps in enumerate(units):
        us = [muon_update(p.grad, opt._momentum_buffer(p), group["momentum"], group["nesterov"])
              for p in ps]
        # an FSDP2 shard: all-gather the whole matrix
        us = [u.full_tensor() if hasattr(u, "full_tensor") else u for u in us]
        u = torch.stack(us) if batched else us[0]
        if i % world == rank:
            # contiguous: a tall matrix comes back as a transposed view, and broadcast sends raw storage
            o = zeropower_via_newtonschulz5(u, steps=group["ns_steps"], dtype=opt.ns_dtype)
            o = o.contiguous()
        else:
            o = torch.empty(u.shape, dtype=opt.ns_dtype, device=u.device)
        works.append(dist.broadcast(o, src=dist.get_global_rank(pg, i % world), group=pg,
                                    async_op=True))
        outs.append(o.unbind(0) if batched else [o])
    for ps, results, work in zip(units, outs, works):
        work.wait()
        for p, o in zip(ps, results):
            if hasattr(p, "device_mesh"):  # keep this rank's rows of the whole result (no traffic)
                from torch.distributed.tensor import distribute_tensor
                o = distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(o, alpha=-adjusted_lr(group["lr"], p.shape, group["adjust_lr_fn"]))
