"""
Train a ternary (BitNet b1.58) Llama-style model in three stages, nanoGPT-style.

  stage 1  full-precision pre-training of the SubLN model                         -> out/stage1/ckpt.pt
  stage 2  ternary continued pre-training from stage 1 (or from scratch), with
           lambda warming up linearly from 0 (fp) to 1 (ternary)                  -> out/stage2/ckpt.pt
  stage 3  BitDistill: stage-2 student, frozen stage-1 teacher                    -> out/stage3/ckpt.pt

Run on one machine (CPU preset: byte tokenizer, minutes; CUDA preset: GPT-2 tokenizer, a real run):
  python train.py --stage=1
  python train.py --stage=2 --max_iters=2000 --lr=3e-3      (any field of TrainConfig as --key=value)
  python train.py --stage=2 --resume=True                     (continue a stopped run, bit for bit)
One node, 8 GPUs (DDP; NCCL on CUDA, gloo on CPU); add --fsdp=True to shard params, grads and optimizer state:
  torchrun --standalone --nproc_per_node=8 train.py --stage=2
Two nodes of 8 GPUs: the same command on each, with --node_rank=0 / 1 and the address of node 0:
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 train.py --stage=2

Batch: batch_size is the sequences of one micro-batch on one rank; grad_accum counts the micro-batches of one
step over ALL ranks (each does grad_accum / world_size; it must divide), so the global batch, batch_size *
grad_accum sequences, and the loss curve do not depend on the world size. Each rank reads its own rows of every
global batch (data.DataLoader(rank=, world_size=)); only rank 0 prints and writes files.

Fault tolerance (checkpoint.py): checkpoints are atomic, whole (they load at any world size) and hold every state
the next step reads, so --resume=True continues exactly. SIGTERM/SIGINT: finish the step, save, exit 0. A step
with a non-finite loss or gradient norm is skipped (no update) and logged; max_bad_steps in a row save and stop.
Deciding that costs one host read per step (loss, norm and stop flag together, after one all-reduce).
Metrics go to out/stage<N>/metrics.jsonl; the first run tokenises the shipped corpus (see data.py).
Test: python -m pytest tests/test_train.py tests/test_scale.py tests/test_fault.py
"""

import contextlib
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import checkpoint
import data
from distill import BitDistillLoss
from model import GPT, GPTConfig, precompute_rope
from muon import configure_muon
from quant import cache_weight_quant, clear_weight_quant, set_lambda
from zclip import ZClip


from config import (DEVICE_PRESETS, STAGE_PRESETS, TrainConfig, build_config, die, lambda_at, lr_mult,  # noqa: F401
                    model_config, nan_steps, parse_args, resolve_data)


def configure_optimizer(model, cfg, device_type, process_group=None):
    """muon: Muon for the 2-D hidden matrices, AdamW for embeddings/head (decayed) and norm gains (not);
    adamw: AdamW for all, weight decay on matrices only. Every group records its initial lr and wd.
    process_group (DDP): the ranks that share out Muon's Newton-Schulz work (FSDP2 params bring their own)."""
    fused = device_type == "cuda" and not cfg.fsdp  # fused AdamW over DTensor shards: not tried, so not used
    if cfg.optimizer == "muon":  # NS5 in bf16 on GPU (the paper); fp32 on CPU, where bf16 NS5 is ~18x slower (bench.py --muon)
        opt = configure_muon(model, muon_lr=cfg.muon_lr, adamw_lr=cfg.lr, muon_weight_decay=cfg.weight_decay,
                             adamw_weight_decay=cfg.weight_decay, adjust_lr_fn=cfg.muon_adjust_lr,
                             adamw_betas=(cfg.beta1, cfg.beta2), fused=fused, process_group=process_group,
                             ns_dtype=torch.bfloat16 if device_type == "cuda" else torch.float32)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)
    for g in opt.param_groups:
        g["initial_lr"], g["initial_wd"] = g["lr"], g["weight_decay"]
    return opt


def clip_gradients(params, clipper, cfg):
    """ZClip, or a fixed clip_grad_norm_; both return the same 0-d tensor stats (read once per step)."""
    if clipper is not None:
        return clipper.clip(params)
    raw = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    raw = raw.full_tensor() if hasattr(raw, "full_tensor") else raw  # FSDP2: a DTensor of the global norm
    clipped = (raw > cfg.grad_clip) if cfg.grad_clip > 0 else torch.zeros((), dtype=torch.bool, device=raw.device)
    return {"raw_norm": raw, "clipped_norm": raw.clamp(max=cfg.grad_clip) if cfg.grad_clip > 0 else raw,
            "was_clipped": clipped.float(), "z_score": torch.zeros((), device=raw.device)}


def optimizer_step(optimizer, device_type, timed):
    """Step; with timed=True also return the milliseconds of Muon's part (synchronising on CUDA)."""
    if not timed or not hasattr(optimizer, "muon"):
        optimizer.step()
        return None
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    optimizer.muon.step()
    sync()
    muon_ms = 1000 * (time.perf_counter() - t)
    optimizer.adamw.step()
    return muon_ms


def load_checkpoint(path, required=("model", "model_args")):
    try:
        return checkpoint.load(path, required)
    except checkpoint.CheckpointError as e:
        die(str(e))


def check_fits(saved, conf, path):
    """Refuse, before loading anything, a checkpoint whose weights have other shapes or another vocabulary."""
    keys = ("vocab_size", "n_layer", "n_head", "n_embd", "mlp_hidden", "tie_embeddings")
    diff = [k for k in keys if saved.get(k) != getattr(conf, k)]
    if diff:
        die(f"{path}: checkpoint has {', '.join(f'{k}={saved.get(k)}' for k in diff)} but this run builds "
            f"{', '.join(f'{k}={getattr(conf, k)}' for k in diff)}; use the --n_layer/--n_head/--n_embd/--tokenizer/"
            f"--pad_vocab of the run that wrote it (the vocabulary comes from --tokenizer)")


def load_weights(model, state, path, insert_subln=False):
    """Load a state dict; lambda_ buffers may be missing (an fp checkpoint into a ternary model), and with
    insert_subln the SubLN gains too: they keep their unit init (BitDistill Stage 1, REFERENCE section 2)."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape mismatch that check_fits did not catch
        die(f"{path}: checkpoint does not fit this model ({str(e).splitlines()[-1].strip()[:200]})")
    missing = [k for k in missing if not k.endswith("lambda_") and not (insert_subln and ".subln." in k)]
    if missing or unexpected:
        die(f"{path}: checkpoint does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            f"check n_layer/n_embd/n_head/subln/tokenizer")


def make_teacher(cfg, path, student_conf, device):
    """Stage 3: the frozen full-precision teacher (eval mode, no grad, bf16 on CUDA) and the BitDistill loss.
    With every distillation weight 0 there is no teacher: plain CE, the control run."""
    try:
        crit = BitDistillLoss(cfg.distill_preset, lambda_ld=None if cfg.distill_lambda < 0 else cfg.distill_lambda,
                              gamma_ad=None if cfg.distill_gamma < 0 else cfg.distill_gamma,
                              delta_hidden=cfg.distill_hidden, temperature=cfg.distill_tau,
                              n_relation_heads=cfg.distill_relation_heads, distill_layer=cfg.distill_layer)
    except ValueError as e:
        die(str(e), 2)
    if crit.lambda_ld == crit.gamma_ad == crit.delta_hidden == 0:
        return None, crit
    ckpt = load_checkpoint(path)
    tconf = GPTConfig(**ckpt["model_args"])
    if tconf.vocab_size != student_conf.vocab_size:
        die(f"{path}: teacher vocabulary {tconf.vocab_size} != student {student_conf.vocab_size}; same tokenizer needed")
    try:
        crit.layer_index(student_conf.n_layer), crit.layer_index(tconf.n_layer)
    except ValueError as e:
        die(str(e), 2)
    teacher = GPT(tconf)
    load_weights(teacher, ckpt["model"], path)
    teacher.requires_grad_(False).eval().to(device)
    if device.startswith("cuda"):
        teacher.to(torch.bfloat16)  # weights in bf16; RoPE tables stay fp32
        cos, sin = precompute_rope(tconf.n_embd // tconf.n_head, tconf.block_size, tconf.rope_theta)
        teacher.rope_cos, teacher.rope_sin = cos.to(device), sin.to(device)
    return teacher, crit


def distill_losses(student, teacher, crit, x, y):
    """Student and frozen teacher on the same batch; returns the dict of loss terms (total in "loss")."""
    kw = dict(qkv_layer=crit.distill_layer if crit.gamma_ad != 0 else None, return_hiddens=crit.delta_hidden != 0)
    s_out = student(x, y, **kw)
    with torch.no_grad():
        t_out = teacher(x, y, **kw)
    s_st, t_st = (s_out[2], t_out[2]) if len(s_out) == 3 else ({}, {})
    return crit(s_out[0], t_out[0], y, s_st.get("qkv"), t_st.get("qkv"), s_st.get("hiddens") or None,
                t_st.get("hiddens") or None)


@torch.no_grad()
def estimate_val_loss(model, loader, cfg, ctx, device):
    """Mean loss over the first eval_iters * batch_size val rows. Each of W ranks reads its own rows of
    eval_iters / W global batches (rounded up), so when W divides eval_iters every world size reads the same rows."""
    model.eval()
    loader.reset()
    iters = -(-cfg.eval_iters // loader.world_size)
    losses = torch.zeros(iters, device=device)
    for k in range(iters):
        x, y = loader.next_batch()
        with ctx:
            losses[k] = model(x.to(device), y.to(device))[1].float()
    model.train()
    loss = losses.mean()
    if dist.is_initialized():
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss.item()


def parallelize(model, cfg, world, device_type, local_rank):
    """One process: the model (compiled on CUDA). DDP: replicas whose gradients are all-reduced. FSDP2:
    fully_shard each block, then the root (embedding, tied head, final norm). Returns the module to call."""
    if cfg.fsdp and world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device_type, (world,))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    use_compile = cfg.compile == "true" or (cfg.compile == "auto" and device_type == "cuda")
    train_model = torch.compile(model) if use_compile else model
    if world > 1 and not cfg.fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        # lambda buffers are set identically on every rank, so they need no broadcast each forward
        train_model = DDP(train_model, device_ids=[local_rank] if device_type == "cuda" else None,
                          broadcast_buffers=False)
    return train_model


def grad_sync(train_model, model, sync):
    """Reduce gradients on the last micro-batch of a step only: DDP's no_sync(), FSDP2's switch."""
    if hasattr(train_model, "no_sync"):
        return contextlib.nullcontext() if sync else train_model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def main(argv):
    overrides = parse_args(argv)
    cfg = build_config(overrides)
    # torchrun sets these; one process is rank 0 of 1
    rank, local_rank, world = (int(os.environ.get(k, 1 if k == "WORLD_SIZE" else 0))
                               for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    out_dir = os.path.join(cfg.out_dir, cfg.run_name or f"stage{cfg.stage}")
    ckpt_path = os.path.join(out_dir, checkpoint.LATEST)
    ckpt = None
    if cfg.resume:
        if not os.path.exists(ckpt_path):
            die(f"--resume=True but there is no checkpoint at {ckpt_path}; start without --resume")
        ckpt = load_checkpoint(ckpt_path, ("model", "model_args", "config", "step", "optimizer", "loader"))
        cfg = build_config(overrides, base=ckpt["config"])  # the saved run, with command-line overrides on top
    if cfg.grad_accum % world:
        die(f"--grad_accum={cfg.grad_accum} counts the micro-batches of one step over all {world} ranks, so it must "
            f"be a multiple of {world}; pass --grad_accum={world * max(1, cfg.grad_accum // world)}", 2)
    local_accum = cfg.grad_accum // world  # global batch = batch_size * grad_accum sequences at any world size
    teacher_path = cfg.teacher or os.path.join(cfg.out_dir, "stage1", "ckpt.pt")
    if cfg.stage == 3 and not os.path.exists(teacher_path):
        die(f"stage 3 needs the full-precision teacher at {teacher_path}; make it with: python train.py --stage=1")
    try:
        if master:
            checkpoint.check_writable(out_dir)
    except OSError as e:
        die(f"cannot write to {out_dir}: {e.strerror}; pass a writable --out_dir")

    tok = data.get_tokenizer(cfg.tokenizer)
    gptconf = model_config(cfg, tok.vocab_size, tok.eot)
    init, init_path = None, None  # the weights a new run starts from, checked before any data is touched
    if ckpt is not None:
        check_fits(ckpt["model_args"], gptconf, ckpt_path)
    elif cfg.init_from != "scratch" and (cfg.stage > 1 or cfg.init_from != "auto"):
        prev = os.path.join(cfg.out_dir, f"stage{cfg.stage - 1}", "ckpt.pt")
        init_path = prev if cfg.init_from == "auto" else cfg.init_from
        if os.path.exists(init_path):
            init = load_checkpoint(init_path)
            check_fits(init["model_args"], gptconf, init_path)
        elif not (cfg.init_from == "auto" and cfg.stage == 2):
            die(f"no checkpoint at {init_path} to start stage {cfg.stage} from; make it with: "
                f"python train.py --stage={max(cfg.stage - 1, 1)}")

    device_type = "cuda" if cfg.device.startswith("cuda") else "cpu"
    device = f"cuda:{local_rank}" if device_type == "cuda" and world > 1 else cfg.device
    if world > 1:
        if device_type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    if cfg.fsdp and world == 1:
        log("--fsdp=True in one process: nothing to shard, training unsharded")
    checkpoint.seed_all(cfg.seed)  # the same on every rank: identical initial weights
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = device_type == "cuda"
    dtype = ("bfloat16" if device_type == "cuda" else "float32") if cfg.dtype == "auto" else cfg.dtype
    ctx = torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=dtype != "float32")

    try:
        if local_rank == 0:  # first: it prepares the shipped corpus on its node if needed
            sources = resolve_data(cfg)
        if world > 1:
            dist.barrier()
        if local_rank != 0:
            sources = resolve_data(cfg)
        train_loader = data.DataLoader(sources, "train", cfg.batch_size, cfg.block_size, rank, world, cfg.seed)
        val_loader = data.DataLoader(sources, "val", cfg.batch_size, cfg.block_size, rank, world, cfg.seed)
        if ckpt is not None:
            train_loader.load_state_dict(ckpt["loader"])
    except ValueError as e:
        die(str(e))

    model = GPT(gptconf)
    step = 0
    if ckpt is not None:
        load_weights(model, ckpt["model"], ckpt_path)
        step = ckpt["step"]
        log(f"resuming stage {cfg.stage} from {ckpt_path} at step {step}")
    elif init is not None:
        insert = cfg.stage == 1 and not init["model_args"].get("subln", True) and gptconf.subln
        load_weights(model, init["model"], init_path, insert_subln=insert)
        src = f"stage-{cfg.stage - 1} weights" if cfg.init_from == "auto" else "weights"
        log(f"stage {cfg.stage}: starting from the {src} in {init_path}" +
            (" (SubLN inserted with unit gain)" if insert else ""))
    elif init_path is not None:
        log(f"stage 2: no stage-1 checkpoint at {init_path}; training the ternary model from scratch")
    else:
        log(f"stage {cfg.stage}: training from scratch")
    teacher, crit = None, None
    if cfg.stage == 3:
        teacher, crit = make_teacher(cfg, teacher_path, gptconf, device)
        log(f"stage 3: teacher {teacher_path}, {crit}" if teacher is not None else
            "stage 3: all distillation weights are 0, so this is plain CE (the control run)")
    model.to(device)
    train_model = parallelize(model, cfg, world, device_type, local_rank)
    optimizer = configure_optimizer(model, cfg, device_type, dist.group.WORLD if world > 1 and not cfg.fsdp else None)
    clipper = ZClip(z_thresh=cfg.zclip_z_thresh) if cfg.zclip else None
    try:  # optimizer, ZClip and RNG states last: nothing after this may draw a random number
        if ckpt is not None:
            checkpoint.restore(ckpt, optimizer, clipper)
    except checkpoint.CheckpointError as e:
        die(f"{ckpt_path}: {e}; resume with the --optimizer of the run that wrote it")
    log(f"{model.get_num_params() / 1e6:.2f}M non-embedding params, quant={gptconf.quant}, subln={gptconf.subln}, "
        f"vocab={gptconf.vocab_size}, device={device}, dtype={dtype}, world={world} "
        f"({'FSDP2' if cfg.fsdp and world > 1 else 'DDP' if world > 1 else 'one process'}), "
        f"global batch {cfg.batch_size} x {cfg.grad_accum} sequences")
    saved_cfg = {k: v for k, v in dataclasses.asdict(cfg).items() if not k.startswith("fault_")}

    def save():  # every rank calls it (FSDP2 gathers shards); rank 0 writes
        state = checkpoint.training_state(step, saved_cfg, dataclasses.asdict(gptconf), model, optimizer,
                                          clipper, train_loader)
        try:
            if master:
                checkpoint.save(state, out_dir, cfg.keep_last, cfg.fault_slow_write)
        except OSError as e:  # e.g. a full disk: the atomic write left the previous checkpoint as it was
            die(f"cannot write a checkpoint to {out_dir}: {e.strerror}; the previous one is kept, free space "
                f"and continue with --resume=True")
        if world > 1:
            dist.barrier()
        if step == cfg.fault_hang_at:
            log(f"fault_hang_at={step}: checkpoint written; hanging until killed", flush=True)
            while not stop.requested:
                time.sleep(0.05)

    def log_json(rec):
        if master:
            with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")

    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum
    poisoned = nan_steps(cfg)
    val_loss, start, n_bad, bad_run = None, step, 0, 0
    t0 = time.time()
    with checkpoint.StopSignal() as stop:
        while True:
            lam = lambda_at(step, cfg) if gptconf.quant else 0.0
            if gptconf.quant:
                set_lambda(model, lam)
            last = step >= cfg.max_iters
            if step > start or last:
                evaluate = last or step % cfg.eval_interval == 0
                if evaluate:
                    val_loss = estimate_val_loss(train_model, val_loader, cfg, ctx, device)
                    log(f"step {step}: val loss {val_loss:.4f}")
                    log_json({"step": step, "val_loss": val_loss, "lambda": lam})
                if evaluate or (cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0):
                    save()
                t0 = time.time()  # do not count eval or checkpoint time in the next step's timing
            if last:
                break
            mult = lr_mult(step, cfg)
            phase2 = cfg.two_phase and step >= cfg.max_iters // 2
            for g in optimizer.param_groups:
                g["lr"] = g["initial_lr"] * mult
                g["weight_decay"] = 0.0 if phase2 else g["initial_wd"]
            if gptconf.quant and local_accum > 1 and not cfg.fsdp:  # FSDP2: whole weights exist only in forward
                cache_weight_quant(model)  # quantise each weight once per step, not once per micro-batch
            loss_sum = torch.zeros((), device=device)
            for micro in range(local_accum):
                x, y = train_loader.next_batch()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with grad_sync(train_model, model, micro == local_accum - 1):
                    with ctx:
                        if teacher is None:
                            _, loss = train_model(x, y)
                        else:
                            parts = distill_losses(train_model, teacher, crit, x, y)
                            loss = parts["loss"]
                    if step + 1 in poisoned:
                        loss = loss * float("nan")  # fault-injection hook, see TrainConfig
                    (loss / local_accum).backward()
                loss_sum += loss.detach().float()
            clear_weight_quant(model)  # the optimizer step below changes the weights
            stats = clip_gradients([p for p in model.parameters() if p.grad is not None], clipper, cfg)
            stop_flag = torch.tensor(float(stop.requested is not None), device=device)
            reduced = torch.stack([loss_sum / local_accum, stop_flag])
            if world > 1:
                dist.all_reduce(reduced)  # mean loss over the global batch; did any rank get a stop signal?
            # the one host read per step: every rank gets the same numbers, so all take the same branch
            loss_f, stopping, raw, clipped_norm, was_clipped, z = torch.cat(
                [reduced / torch.tensor([world, 1.0], device=device)] +
                [stats[k].reshape(1).float() for k in ("raw_norm", "clipped_norm", "was_clipped", "z_score")]).tolist()
            bad = not (math.isfinite(loss_f) and math.isfinite(raw))
            log_now = (step + 1) % cfg.log_interval == 0
            muon_ms = None
            if bad:
                n_bad, bad_run = n_bad + 1, bad_run + 1
            else:
                bad_run = 0
                muon_ms = optimizer_step(optimizer, device_type, timed=log_now)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if bad:
                log(f"step {step} | skipped: loss {loss_f} grad norm {raw} not finite, no update "
                    f"({bad_run} in a row, {n_bad} in all; max_bad_steps={cfg.max_bad_steps})")
                log_json({"step": step, "skipped": 1, "loss": None, "lambda": lam, "bad_steps": n_bad})
            elif log_now:
                dt = (time.time() - t0) / cfg.log_interval
                rec = {"step": step, "loss": loss_f, "lr": cfg.lr * mult, "lambda": lam, "grad_norm_raw": raw,
                       "grad_norm": clipped_norm, "clipped": int(was_clipped), "z": z, "ms": 1000 * dt,
                       "tok_per_s": tokens_per_step / dt, "muon_ms": muon_ms, "bad_steps": n_bad}
                if teacher is not None:
                    rec.update({k: float(parts[k]) for k in ("ce", "ld", "ad", "hidden")})
                log(f"step {step} | loss {loss_f:.4f} | lr {rec['lr']:.2e} | lambda {lam:.2f} | "
                    f"grad norm {raw:.3f} -> {clipped_norm:.3f} (clipped {rec['clipped']}, z {z:.2f}) | "
                    f"{rec['ms']:.0f} ms | {rec['tok_per_s']:.0f} tok/s" +
                    (f" | ce {rec['ce']:.4f} ld {rec['ld']:.4f} ad {rec['ad']:.5f} hidden {rec['hidden']:.4f}"
                     if teacher is not None else ""))
                log_json(rec)
                t0 = time.time()
            if bad_run >= cfg.max_bad_steps:
                save()
                die(f"{bad_run} steps in a row with a non-finite loss or gradient, the last at step {step}; "
                    f"saved {ckpt_path} (weights as after step {step - bad_run}); lower --lr or check the data, "
                    f"then continue with --resume=True")
            if stopping:
                save()
                log(f"{stop.requested or 'stop signal on another rank'}: finished step {step}, saved {ckpt_path}; "
                    f"continue with --resume=True")
                break
    if val_loss is not None and step >= cfg.max_iters:
        log(f"final val loss {val_loss:.4f} (stage {cfg.stage}, {step} steps); checkpoint {ckpt_path}")
    if world > 1:
        dist.destroy_process_group()
    return val_loss


if __name__ == "__main__":
    main(sys.argv[1:])
