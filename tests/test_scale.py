"""Scale-out tests on CPU: train.py under torchrun with 2 gloo processes (DDP and FSDP2) against 1 process,
checkpoints written by 2 ranks resumed on 1, and distributed Muon and sharded ZClip against their
single-process forms.

Every process runs with OMP_NUM_THREADS=1 (torchrun sets it too): on 2 shared cores, 2 OpenMP threads per
process make these tiny steps ~100x slower.
"""

import json
import os
import shutil
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import TINY, fails, small_corpus
from conftest import run as run_train
from muon import Muon
from tools.sharded_muon import ShardedMuon
from zclip import ZClip

ARGS = ["--stage=2", *TINY, "--max_iters=6", "--eval_interval=6", "--checkpoint_interval=3", "--keep_last=2",
        "--grad_accum=2", "--eval_whole=True"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run(out, *args, nproc=1):
    launch = None if nproc == 1 else [*TORCHRUN, f"--nproc_per_node={nproc}"]
    # A multi-process launch gets one retry from a clean out_dir: on a loaded CI machine the rendezvous or a
    # gloo connection can fail transiently (seen once, in one of four clean-clone CI runs); a real bug fails both tries.
    for attempt in range(2 if nproc > 1 else 1):
        p = run_train(f"--out_dir={out}", *args, launch=launch, rc=None)
        if p.returncode == 0 or nproc == 1 or "--resume=True" in args:
            break
        warnings.warn(f"torchrun attempt {attempt + 1} failed, retrying once: {p.stderr[-1500:]}")
        shutil.rmtree(out, ignore_errors=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def losses(out):
    """Loss of each step as logged (the last record wins: a resumed run logs its steps again)."""
    recs = [json.loads(line) for line in open(os.path.join(out, "stage2", "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same flags, --batch_size=4 --grad_accum=2 (a global batch of 8 sequences), on 1 process (2 micro-
    batches of 4 per step) and on 2 ranks (1 micro-batch of 4 each: half the per-rank batch), DDP and FSDP2.
    Then the step-3 checkpoint of each 2-rank run is resumed to step 6 on 1 process."""
    base = tmp_path_factory.mktemp("scale")
    args = [*ARGS, f"--data={small_corpus(base / 'corpus')}"]  # a whole val split of 62 windows, not 6,821
    out = {name: str(base / name) for name in ("one", "ddp", "fsdp")}
    run(out["one"], *args)
    procs = {k: run(out[k], *args, f"--fsdp={k == 'fsdp'}", nproc=2) for k in ("ddp", "fsdp")}
    for k in ("ddp", "fsdp"):
        d = base / f"{k}_resumed1" / "stage2"
        d.mkdir(parents=True)
        shutil.copy(os.path.join(out[k], "stage2", "ckpt_000003.pt"), d / "ckpt.pt")
        out[f"{k}_resumed1"] = str(base / f"{k}_resumed1")
        procs[f"{k}_resumed1"] = run(out[f"{k}_resumed1"], "--stage=2", "--resume=True")
    return out, procs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_with_half_the_batch_match_one_rank(runs, mode):
    out, procs = runs
    one, two = losses(out["one"]), losses(out[mode])
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5, 6]
    for s in one:
        assert two[s] == pytest.approx(one[s], rel=1e-5, abs=0), (s, one[s], two[s])
    assert one[6] < one[1] - 0.1  # it trained: a run that updates nothing would also "match"
    val = [[r["val_loss"] for r in map(json.loads, open(os.path.join(o, "stage2", "metrics.jsonl"))) if "val_loss" in r]
           for o in (out["one"], out[mode])]
    assert val[1][0] == pytest.approx(val[0][0], rel=1e-5, abs=0)  # the ranks split the same val rows
    assert val[1][-1] == pytest.approx(val[0][-1], rel=1e-5, abs=0)  # and every window of the whole split once
    assert ("FSDP2" if mode == "fsdp" else "DDP") in procs[mode].stdout
    # no rank prints a deprecation (torch 2.13's DDP warned at broadcast_buffers=False, once per rank)
    assert "FutureWarning" not in procs[mode].stderr and "DeprecationWarning" not in procs[mode].stderr, \
        procs[mode].stderr[-2000:]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_only_rank_0_logs_and_checkpoints_are_whole_and_unprefixed(runs, mode):
    out, procs = runs
    steps = [json.loads(line)["step"] for line in open(os.path.join(out[mode], "stage2", "metrics.jsonl"))]
    assert steps == [1, 2, 3, 4, 5, 6, 6]  # one record per step and the final val loss: one writer
    assert procs[mode].stdout.count("step 1 |") == 1
    d = os.path.join(out[mode], "stage2")
    assert sorted(os.listdir(d)) == ["ckpt.pt", "ckpt_000003.pt", "ckpt_000006.pt", "metrics.jsonl"]
    ck = torch.load(os.path.join(d, "ckpt.pt"), weights_only=True)
    assert ck["step"] == 6 and not any(k.startswith(("module.", "_orig_mod.")) for k in ck["model"])
    ref = torch.load(os.path.join(out["one"], "stage2", "ckpt.pt"), weights_only=True)
    for k, v in ref["model"].items():  # whole tensors of the full shapes, not one rank's shard
        assert ck["model"][k].shape == v.shape, k
    for i, a in ck["optimizer"]["state"].items():
        if "momentum_buffer" in a:
            assert a["momentum_buffer"].shape == ref["optimizer"]["state"][i]["momentum_buffer"].shape


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_checkpoint_written_by_two_ranks_resumes_on_one(runs, mode):
    out, procs = runs
    assert "at step 3" in procs[f"{mode}_resumed1"].stdout and "world=1" in procs[f"{mode}_resumed1"].stdout
    resumed, two = losses(out[f"{mode}_resumed1"]), losses(out[mode])
    assert sorted(resumed) == [4, 5, 6]
    for s in resumed:  # 1 process does the 2 micro-batches that the 2 ranks did
        assert resumed[s] == pytest.approx(two[s], rel=1e-5, abs=0), (s, resumed[s], two[s])


def test_grad_accum_that_does_not_divide_the_world_size_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets; the check runs before any process group
    msg = fails(capsys, "--grad_accum=3", f"--out_dir={tmp_path}", "--device=cpu", code=2)
    assert "--grad_accum=3" in msg and "multiple of 2" in msg and "--grad_accum=2" in msg  # the flag, why, the fix
    assert "--batch_size=24 --grad_accum=2 for the same 48 sequences a step" in msg  # the step's size kept
    msg = fails(capsys, f"--out_dir={tmp_path}", "--device=cpu", code=2)  # the CPU preset under torchrun
    assert "--batch_size=8 --grad_accum=2 for the same 16 sequences a step" in msg, msg
    # resuming a one-process run of the CPU preset (16 x 1) on 2 ranks: no batch split to suggest, since a resumed
    # run keeps its own (the suggestion --batch_size=8 --grad_accum=2 was then refused by the resume)
    from tools import checks, config
    cfg = config.TrainConfig(resume=True, batch_size=16, grad_accum=1)
    msg = fails(capsys, code=2, main=lambda argv: checks.check_run(cfg, type("Rt", (), {"world": 2})(), str(tmp_path), []))
    assert "resume it on a number of processes that divides 1" in msg and "--batch_size=" not in msg, msg
    # each rank would log its own maximum (rank 0's was logged as the run's), as with --qk_clip_tau
    msg = fails(capsys, "--log_max_logit=True", "--grad_accum=2", f"--out_dir={tmp_path}", "--device=cpu", code=2)
    assert "--log_max_logit run in one process here" in msg, msg

# -----------------------------------------------------------------------------
# distributed Muon and sharded ZClip, 2 spawned gloo processes against the single-process result

# tall ones come back from NS5 transposed; (64, 32) twice: a stack of two where Muon batches by shape
SHAPES = [(64, 32), (32, 64), (7, 129), (129, 7), (48, 48), (64, 32)]


def _grads(steps):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(*s, generator=g) for s in SHAPES] for _ in range(steps)]


def _muon_run(make_param, grad_of, read, steps=3, batched=True, ns_dtype=torch.float32, opt=Muon, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(make_param(torch.randn(*s))) for s in SHAPES]
    opt = opt(ps, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, **kw)
    if not batched:  # NS5 matrix by matrix (a variant's muon_step), in one process and shared out alike
        opt.batched_devices = ()
    for gs in _grads(steps):
        for p, g in zip(ps, gs):
            p.grad = grad_of(g.clone())
        opt.step()
    return [read(p) for p in ps], [read(opt.state[p]["momentum_buffer"]) for p in ps]


def _zclip_run(sharded, mesh=None):
    """ZClip (warmup 3) on 5 steps of gradients, the last a 50x spike; returns the stats and clipped grads."""
    from torch.distributed.tensor import Shard, distribute_tensor
    z, out = ZClip(warmup_steps=3), []
    for k, gs in enumerate(_grads(5)):
        gs = [g * (50.0 if k == 4 else 1.0) for g in gs]
        ps = [torch.nn.Parameter(torch.zeros(g.shape)) for g in gs]
        for p, g in zip(ps, gs):
            p.grad = distribute_tensor(g, mesh, [Shard(0)]) if sharded else g.clone()
        st = z.clip(ps)
        out.append(({k: float(v) for k, v in st.items()},
                    [p.grad.full_tensor() if sharded else p.grad for p in ps]))
    return out


def _refusal(fn):
    """The ValueError's message fn() raised, or None."""
    try:
        fn()
    except ValueError as e:
        return str(e)


def _worker(rank, world, store, result_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    same = (lambda t: t, lambda g: g, lambda t: t.detach())
    sharded = (lambda t: distribute_tensor(t, mesh, [Shard(0)]), lambda g: distribute_tensor(g, mesh, [Shard(0)]),
               lambda t: t.full_tensor().detach())
    import tools.sharded_muon as sm
    ns5, calls = sm.zeropower_via_newtonschulz5, []  # which NS5 this rank runs in the replicated run
    sm.zeropower_via_newtonschulz5 = lambda G, **kw: (calls.append(tuple(G.shape)), ns5(G, **kw))[1]
    replicated = _muon_run(*same, opt=ShardedMuon, process_group=dist.group.WORLD)
    sm.zeropower_via_newtonschulz5 = ns5
    res = {"single": _muon_run(*same),  # same process, same threads
           "replicated": replicated, "ns5_calls": calls,
           "single_by_matrix": _muon_run(*same, batched=False),
           "replicated_by_matrix": _muon_run(*same, batched=False, opt=ShardedMuon,
                                             process_group=dist.group.WORLD),
           # bf16 NS5 (a GPU's, and a CPU's with bf16 units): the results broadcast in bf16
           "single_bf16": _muon_run(*same, ns_dtype=torch.bfloat16),
           "replicated_bf16": _muon_run(*same, ns_dtype=torch.bfloat16, opt=ShardedMuon,
                                        process_group=dist.group.WORLD),
           "fsdp": _muon_run(*sharded, opt=ShardedMuon),
           "plain_muon_on_shards": _refusal(lambda: _muon_run(*sharded)),
           "zclip": _zclip_run(True, mesh)}
    torch.save(res, os.path.join(result_dir, f"rank{rank}.pt"))
    # Both ranks have saved; leave without tearing gloo down: under load, one rank's teardown racing the other's
    # exit ended a rank in "terminate called without an active exception" (SIGABRT) after its results were saved
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    d = tmp_path_factory.mktemp("spawn")
    mp.spawn(_worker, args=(2, str(d / "store"), str(d)), nprocs=2)
    return [torch.load(d / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicated", "fsdp", "replicated_by_matrix", "replicated_bf16"])
def test_distributed_muon_equals_single_process_muon_bitwise(spawned, mode):
    """Each rank orthogonalises every other stack of one shape (every other matrix where Muon does not batch)
    and broadcasts it (replicated = DDP); with FSDP2 DTensor shards the update is all-gathered first. After 3
    steps, weights and momentum equal one process's (run in the same worker: fp32 matmuls may differ in the
    last bit between thread counts)."""
    single = "single" + mode.removeprefix("replicated").removeprefix("fsdp")
    for rank in range(2):
        ps, ms = spawned[rank][mode]
        ref_p, ref_m = spawned[rank][single]
        for s, a, b in zip(SHAPES, ps, ref_p):
            assert torch.equal(a, b), (mode, rank, s, (a - b).abs().max())
        for a, b in zip(ms, ref_m):
            assert torch.equal(a, b)
    torch.manual_seed(0)
    assert (ref_p[0] - torch.randn(*SHAPES[0])).abs().max() > 1e-3  # the steps moved the weights


@pytest.mark.slow
def test_each_rank_orthogonalises_its_own_stacks_only(spawned):
    """Under DDP the 5 stacks of SHAPES (one of two matrices) go round-robin: rank 0 runs NS5 on stacks 0, 2, 4 and
    rank 1 on 1, 3, in each of the 3 steps; no rank runs the whole step's NS5."""
    stacks = [(2, 64, 32), (1, 32, 64), (1, 7, 129), (1, 129, 7), (1, 48, 48)]
    for rank in range(2):
        assert spawned[rank]["ns5_calls"] == stacks[rank::2] * 3, spawned[rank]["ns5_calls"]


@pytest.mark.slow
def test_plain_muon_refuses_fsdp_shards_whose_ns5_would_see_rows_only(spawned):
    """NS5 of a row shard is not the shard of NS5: plain Muon (one process's) refuses DTensor parameters and names
    ShardedMuon, which gathers whole matrices."""
    for rank in range(2):
        msg = spawned[rank]["plain_muon_on_shards"]
        assert msg and "whole matrices" in msg and "ShardedMuon" in msg, msg


def test_zclip_on_fsdp_shards_uses_the_global_norm(spawned):
    ref = _zclip_run(False)
    for rank in range(2):
        for (st, grads), (ref_st, ref_grads) in zip(spawned[rank]["zclip"], ref):
            assert st["raw_norm"] == pytest.approx(ref_st["raw_norm"], rel=1e-6)
            assert st["was_clipped"] == ref_st["was_clipped"]
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert ref[-1][0]["was_clipped"] == 1.0 and ref[-1][0]["clipped_norm"] < ref[-1][0]["raw_norm"] / 10


def test_the_cuda_preset_global_batch_runs_unchanged_on_1_2_4_and_8_gpus(tmp_path, capsys):
    """grad_accum counts micro-batches over all ranks: the preset's must divide by 1, 2, 4 and 8 (what README's
    torchrun commands use); other world sizes are refused with a --grad_accum that fits."""
    import types
    from tools.checks import check_run
    from tools.config import DEVICE_PRESETS, TrainConfig
    cfg = TrainConfig(**DEVICE_PRESETS["cuda"], out_dir=str(tmp_path))
    assert cfg.batch_size * cfg.grad_accum * cfg.block_size == 65536
    for world in range(1, 9):
        rt = types.SimpleNamespace(world=world, master=True)
        if world in (1, 2, 4, 8):
            check_run(cfg, rt, str(tmp_path / "run"), [])
            assert cfg.grad_accum // world * world == cfg.grad_accum
        else:
            with pytest.raises(SystemExit) as e:
                check_run(cfg, rt, str(tmp_path / "run"), [])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"multiple of {world}" in err and "--grad_accum=" in err



@pytest.mark.slow
def test_a_bad_input_only_rank_0_checks_is_one_line_on_each_rank(tmp_path):
    """Rank 0 alone checks a shard directory's tokenizer and stops with its error line; rank 1, waiting for it at
    a barrier, says in one line that another rank stopped during set-up. (Before: rank 1's gloo traceback.)"""
    import json
    d = tmp_path / "gpt2_shards"
    small_corpus(d)
    (d / "meta.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257, "eot": 50256}))
    p = run_train(f"--out_dir={tmp_path / 'out'}", "--stage=2", *TINY, "--max_iters=2", "--grad_accum=2",
                  f"--data={d}", launch=[*TORCHRUN, "--nproc_per_node=2"], rc=None)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith(("error", "[rank0]", "[rank1]"))]
    assert len(ours) == 2, p.stderr[-3000:]
    assert any("was tokenised with gpt2" in line for line in ours), ours
    assert any("another rank of this run stopped during set-up" in line for line in ours), ours

@pytest.mark.slow
def test_a_lost_rank_is_one_line_on_rank_0_naming_the_checkpoint_to_resume(tmp_path):
    """Rank 1 exits at once at step 3 (tests/faults.py die_rank), as a lost node would: rank 0's collective fails,
    and it says so in one line with the checkpoint of step 2 to resume from, not a gloo traceback.
    torchrun checks its workers every --monitor_interval seconds and ends the others when one has failed: at its
    default of 0.1 s on a loaded machine, it could end rank 0 before rank 0 noticed. A lost node is not ended by
    the agent of another node, so the test gives rank 0 2 s to notice, as it would have there."""
    out = str(tmp_path)
    p = run_train(f"--out_dir={out}", "--stage=2", *TINY, "--max_iters=6", "--eval_interval=2", "--grad_accum=2",
                  faults="die_rank=1@3", launch=[*TORCHRUN, "--nproc_per_node=2", "--monitor_interval=2"], rc=None)
    assert p.returncode != 0
    rank0 = [line for line in p.stderr.splitlines() if line.startswith(("[rank0]", "error: "))]
    assert len(rank0) == 1 and rank0[0].startswith("error: lost contact with another rank"), p.stderr[-3000:]
    assert os.path.join(out, "stage2", "ckpt.pt") in rank0[0] and "(step 2)" in rank0[0] and "--resume=True" in rank0[0]
    assert torch.load(os.path.join(out, "stage2", "ckpt.pt"), weights_only=True)["step"] == 2
