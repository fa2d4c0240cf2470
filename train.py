"""
Train a ternary (BitNet b1.58) Llama-style model in three stages, nanoGPT-style.

  stage 1  full-precision pre-training of the SubLN model                  -> out/stage1/ckpt.pt
  stage 2  ternary continued pre-training from stage 1 (or from scratch), with
           lambda warming up linearly from 0 (fp) to 1 (ternary)           -> out/stage2/ckpt.pt
  stage 3  BitDistill: stage-2 student, frozen stage-1 teacher             -> out/stage3/ckpt.pt

Run on one machine (CPU preset: byte tokenizer, minutes; CUDA preset: GPT-2 tokenizer, a real run):
  python train.py --stage=2                              (python train.py --help: every flag)
  python train.py --stage=2 --max_iters=2000 --lr=3e-3   (any field of TrainConfig as --key=value)
  python train.py --stage=2 --resume=True                (continue a stopped run, bit for bit)
One node, 8 GPUs (DDP; NCCL on CUDA, gloo on CPU); add --fsdp=True to shard params, grads and
optimizer state:
  torchrun --standalone --nproc_per_node=8 train.py --stage=2
Two nodes of 8 GPUs: the same command on each, with --node_rank=0 / 1 and the address of node 0:
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \
      train.py --stage=2

Read top to bottom: the schedules (lr and lambda), train_step (one step of ternary QAT), the
training loop, each stage's loss (stage 3's: distill.py), the set-up (what the recipe adds to a
run: the wrapped model, the loss, the optimizer groups; what a run holds, its config, data and
starting model: tools/assemble.py), then the checks of the schedule flags. One step needs model.py, quant.py, muon.py, zclip.py and data.py
(stage 3 adds distill.py); the flags (tools/config.py), checkpoints, evaluation, logs and
distributed wrapping are in tools/. batch_size is one micro-batch on one rank; grad_accum counts the
micro-batches of a step over ALL ranks, so the global batch does not depend on the world size.
Test: python -m pytest tests/test_train.py tests/test_scale.py tests/test_fault.py
"""

from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import contextlib
import dataclasses
import math
import sys

import torch
import torch.distributed as dist

import data
from distill import teacher_student_loss
from muon import configure_muon, ns_dtype_for
from quant import cache_weight_quant, clear_weight_quant, set_lambda
from tools import assemble, atomic, checkpoint, metrics, seams, start
from tools.assemble import Run
from tools.flags import die
from tools.runtime import Runtime, StepTimer, leave_after_torchrun, lost_rank
from tools.sharded_muon import ShardedMuon
from zclip import ZClip

# -----------------------------------------------------------------------------
# the schedules: learning rate and lambda


def lr_mult(step, cfg):
    """Multiplier on every group's peak lr: warmup-cosine (nanoGPT) or warmup-stable-decay
    (MiniCPM), times two_phase_lr_drop in the second half with --two_phase=True (BitNet b1.58
    FAQ)."""
    drop = cfg.two_phase_lr_drop if cfg.two_phase and step >= cfg.max_iters // 2 else 1.0
    return drop * _schedule(step, cfg)


def _schedule(step, cfg):
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        progress = min((step - cfg.warmup_steps) / max(cfg.max_iters - cfg.warmup_steps, 1), 1.0)
        return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = int(round(cfg.max_iters * (1 - cfg.decay_frac), 9))  # 90 * (1 - 0.3) is 62.99999999999999
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / max(cfg.max_iters - decay_start, 1), 1.0)
    return 1.0 - (1 - cfg.min_lr_frac) * progress  # linear decay to min_lr (wsd, moderate)


def lambda_at(step, cfg):
    """lambda = clip((step - quant_start) / lambda_warmup_steps, 0, 1); 0 = full precision, 1 =
    ternary. Stage 3 starts from an already ternary student, so lambda is 1 throughout."""
    if cfg.stage == 3:
        return 1.0
    start = quant_start_step(cfg)
    if step < start:
        return 0.0  # the 16-bit phase of continual QAT
    if cfg.lambda_warmup_steps <= 0:
        return 1.0
    return min((step - start) / cfg.lambda_warmup_steps, 1.0)


def quant_start_step(cfg):
    """--quant_start as a step: a fraction of max_iters when below 1, else the step itself."""
    q = cfg.quant_start
    return round(q * cfg.max_iters) if q < 1 else int(q)


# -----------------------------------------------------------------------------
# one training step of ternary QAT


def train_step(run, step, stop_requested):
    """Optimizer step `step` (counting from 0): set lambda, lr and weight decay for it; quantise the
    weights once; forward/backward the micro-batches; clip; then the one host read decides whether
    to step (a non-finite loss or gradient skips the update). Returns that read as a dict of floats.
    The seams a lesson plugs into: run.loss_fn(x, y) -> (loss, parts) and run.callbacks, each with
    watch() (0-d tensors to log, read with the rest) and after_step(step, ok) (after the update)."""
    model, opt, cfg = run.model, run.optimizer, run.cfg
    lam = set_step_lambda(run, step)  # 0 = full precision ... 1 = ternary, written into buffers
    mult = lr_mult(step, cfg)
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] * mult
        g["weight_decay"] = 0.0 if cfg.two_phase and step >= cfg.max_iters // 2 else g["initial_wd"]
    # FSDP2: whole weights exist only in forward
    if model.config.quant and run.accum > 1 and not cfg.fsdp:
        cache_weight_quant(model)  # W_q * gamma once per step, reused by every micro-batch
    loss_sum, parts_sum = torch.zeros((), device=run.device), {}
    scale = run.loss_scale.scale  # 1 but in float16 (LossScale)
    for micro in range(run.accum):
        # (B, T) each
        x, y = (t.to(run.device, non_blocking=True) for t in run.train_loader.next_batch())
        with grad_sync(run, last=micro == run.accum - 1), run.autocast:
            # plain CE, the distillation loss in stage 3, or a lesson's
            loss, parts = run.loss_fn(x, y)
            (loss * scale / run.accum).backward()  # loss * 1.0 is loss: the same bits as unscaled
        loss_sum += loss.detach().float()
        for k, v in (parts or {}).items():  # stage 3's terms, over the micro-batches as the loss
            if k != "loss":
                parts_sum[k] = parts_sum.get(k, 0) + v.detach().float()
    clear_weight_quant(model)  # the weights are about to change
    grads = [p for p in model.parameters() if p.grad is not None]
    if scale != 1.0:
        torch._foreach_mul_([p.grad for p in grads], 1.0 / scale)
    stats = clip_gradients(grads, run.clipper, cfg.grad_clip)
    for cb in run.callbacks:
        stats.update(cb.watch())  # e.g. QK-clip's max attention logit
    # stage 3: ce and the kd_* terms, each the mean over the micro-batches and the ranks (as the loss)
    parts = {k: v / run.accum for k, v in parts_sum.items()}
    out = read_step(loss_sum / run.accum, stop_requested, stats, parts)  # the one host read of the step
    out["ok"] = math.isfinite(out["loss"]) and math.isfinite(out["raw_norm"])
    if out["ok"]:
        opt.step()
    if run.loss_scale.enabled:
        out["loss_scale"] = scale
        # gradients overflowed at a finite loss: the scale's back-off, not a bad step (while halving can help)
        out["backoff"] = not out["ok"] and math.isfinite(out["loss"]) and scale > 1
        run.loss_scale.update(out["ok"])
    for cb in run.callbacks:
        # e.g. QK-clip rescales W_q, W_k; averaging takes a snapshot
        cb.after_step(step + 1, out["ok"])
    opt.zero_grad(set_to_none=True)
    out.update(lam=lam, lr=cfg.lr * mult)
    return out


class LossScale:
    """Dynamic loss scaling for --dtype=float16 (Micikevicius et al. 2018, "Mixed Precision Training",
    section 3.2; torch.amp.GradScaler's defaults). fp16's smallest subnormal is 6e-8: a backward in fp16
    flushes smaller gradients to zero, silently, unless the loss is scaled up first. The step multiplies
    the loss by `scale` and divides the gradients by it before clipping; its one host read says whether
    they overflowed: then the update is skipped (as any non-finite step) and the scale halves; after
    `interval` good steps in a row it doubles. bf16 and fp32 need none: scale 1, nothing changes."""

    INIT = 2.0 ** 16  # the first scale

    def __init__(self, enabled, scale=INIT, interval=2000):
        self.enabled, self.scale, self.interval, self.good = enabled, scale if enabled else 1.0, interval, 0

    def state_dict(self):  # what a checkpoint keeps, so a resume scales as the run that never stopped
        return {"scale": self.scale, "good": self.good}

    def load_state_dict(self, state):
        self.scale, self.good = state["scale"], state["good"]

    def update(self, ok):
        self.good = self.good + 1 if ok else 0
        if not ok:
            self.scale /= 2
        elif self.good % self.interval == 0:
            self.scale *= 2


def set_step_lambda(run, step):
    """lambda for this step into every BitLinear's and QuantRMSNorm's buffer: no recompile, no host
    sync."""
    lam = lambda_at(step, run.cfg) if run.model.config.quant else 0.0
    set_lambda(run.model, lam)
    return lam


def grad_sync(run, last):
    """Reduce gradients over the ranks on the last micro-batch of a step only: DDP's no_sync(),
    FSDP2's switch."""
    if hasattr(run.train_model, "no_sync"):
        return contextlib.nullcontext() if last else run.train_model.no_sync()
    if hasattr(run.model, "set_requires_gradient_sync"):
        run.model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def clip_gradients(params, clipper, grad_clip):
    """ZClip's statistics (raw_norm, clipped_norm, was_clipped, z_score), or with a fixed
    clip_grad_norm_ the norm before and after it; 0-d tensors, read once per step."""
    if clipper is not None:
        stats = clipper.clip(params)
        return {k: stats[k] for k in ("raw_norm", "clipped_norm", "was_clipped", "z_score")}
    raw = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    # FSDP2: a DTensor of the global norm
    raw = raw.full_tensor() if hasattr(raw, "full_tensor") else raw
    return {"raw_norm": raw, "clipped_norm": raw.clamp(max=grad_clip) if grad_clip > 0 else raw}


def read_step(loss, stop_requested, stats, parts=None):
    """The one host read per step: the loss and its parts averaged over ranks, whether any rank got a
    stop signal, and the step's statistics, in one tensor. Every rank gets the same loss and stop, so
    all take the same branch."""
    parts = parts or {}
    head = torch.stack([loss, *(v.detach().float() for v in parts.values()),
                        torch.tensor(float(stop_requested), device=loss.device)])
    if dist.is_initialized():
        dist.all_reduce(head)
        head[:-1] /= dist.get_world_size()
    values = torch.cat([head] + [v.detach().float().reshape(1) for v in stats.values()]).tolist()
    n = len(parts)
    return {"loss": values[0], **dict(zip(parts, values[1:n + 1])), "stop": values[n + 1] > 0,
            **dict(zip(stats, values[n + 2:]))}


# -----------------------------------------------------------------------------
# the training loop


def training_loop(run):
    """The steps from run.start.step to max_iters, with evaluation, checkpoints, logs and the stop
    rules."""
    cfg, rt = run.cfg, run.rt
    step = start = run.start.step
    val_loss, skipped_steps, skipped_in_a_row = None, 0, 0
    timer = StepTimer()  # ms per step, averaged between log lines
    with atomic.StopSignal() as stop:
        while True:
            last = step >= cfg.max_iters
            if step > start or last:
                evaluate = last or step % cfg.eval_interval == 0
                if evaluate or (cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0):
                    lam = set_step_lambda(run, step)  # both see the model that step `step` trains
                    if evaluate:
                        # logged
                        val_loss = metrics.evaluate(run, step, lam, whole=last and cfg.eval_whole)
                    checkpoint.save_run(run, step, val_loss if evaluate else None)
                    timer.reset()  # evaluation and checkpoint time are not step time
            if last:
                break
            # ------------------------------------------------------------ TRAINING SECTION BEGIN
            out = train_step(run, step, stop.requested is not None)
            # ------------------------------------------------------------ TRAINING SECTION END
            step += 1
            timer.steps += 1
            skipped_steps, skipped_in_a_row = ((skipped_steps, 0) if out["ok"] else
                                               (skipped_steps + 1, skipped_in_a_row + (not out.get("backoff"))))
            if not out["ok"] or step % cfg.log_interval == 0:
                metrics.log_step(run, step, out, skipped_steps, skipped_in_a_row, timer)
            # skipping cannot mend broken weights
            if not out["ok"] and not checkpoint.all_finite(run.model):
                die(f"step {step}: the weights are no longer finite (the update of an earlier step "
                    "overflowed: is --lr or --muon_lr too high?); nothing was saved over "
                    f"{run.ckpt_path}; lower the lr and continue from it with --resume=True")
            if skipped_in_a_row >= cfg.max_bad_steps:
                checkpoint.save_run(run, step)
                die(f"{skipped_in_a_row} steps in a row with a non-finite loss or gradient, the "
                    f"last at step {step}; saved {run.ckpt_path} (weights as after step "
                    f"{step - skipped_in_a_row}); lower --lr or check the data, then continue with "
                    "--resume=True")
            if out["stop"]:
                checkpoint.save_run(run, step)
                rt.log(f"{stop.requested or 'stop signal on another rank'}: finished step {step}, "
                       f"saved {run.ckpt_path}; continue with --resume=True")
                break
    if step > start and skipped_steps == step - start:
        why = (f" (float16: the loss scale halves from {LossScale.INIT:g} at each overflow; a run this short may end "
               "before it fits)") if run.loss_scale.enabled else ""
        die(f"all {skipped_steps} steps of this run were skipped as non-finite, so nothing was "
            f"learned{why}; see the log above, lower --lr or check the data")
    if val_loss is not None and step >= cfg.max_iters:  # lambda short of 1: the line says so
        metrics.log_final(run, step, val_loss, skipped_steps,
                          lambda_at(step, cfg) if run.model.config.quant else 1.0,
                          quant_start_step(cfg) + cfg.lambda_warmup_steps)
    rt.close()
    return val_loss


# -----------------------------------------------------------------------------
# each stage's loss (where each run starts, the three-stage recipe: tools/start.py)


def make_loss_fn(run, teachers):
    """Stage 1 and 2: next-token cross-entropy. Stage 3: the BitDistill loss against the frozen
    teacher(s), or plain CE when every distillation weight is 0 (the control run). A lesson's own
    stage brings its own loss (--stage=dlm: the masked-diffusion loss). Picked once; returns
    loss_fn(x, y) -> (loss, parts)."""
    if run.lesson is not None:
        return run.lesson.loss_fn(run)
    if run.cfg.stage < 3:
        return lambda x, y: (run.train_model(x, y)[1], None)
    models, crit = start.make_teachers(run.cfg, teachers, run.model.config, run.rt.device, run.vocab)
    if not models:
        run.rt.log("stage 3: all distillation weights are 0, so this is plain CE (the control run)")
        return lambda x, y: (run.train_model(x, y)[1], None)
    run.rt.log(f"stage 3: teacher{'s' if len(models) > 1 else ''} {', '.join(teachers)}, {crit}")
    return teacher_student_loss(run.train_model, models, crit, run.model.config.n_layer)


# -----------------------------------------------------------------------------
# set-up: a run (tools/assemble.Run) built once; every input is checked before anything is written


def setup(argv):
    """Config, runtime, starting weights, data, model, optimizer, ZClip and loss: everything the
    loop needs. Every input is checked before anything is written, so a bad flag or file costs
    nothing already saved (tools/assemble.py: the config, the resume, the data and the starting
    model; here what the recipe decides: the lambda schedule's checks, the wrapped model, the loss,
    the optimizer, the clipper)."""
    overrides, out_dir, resume, cfg, notes = assemble.read_config(argv)
    check_quant_start(cfg)
    run = Run(cfg, Runtime.from_env(cfg.device), out_dir, given=overrides)
    run.device = run.rt.device
    if resume is not None and resume["model_args"].get("quant"):
        notes.append(check_lambda_on_resume(resume["step"], resume["config"], cfg, run.ckpt_path))
    teachers = assemble.open_run(run, notes)  # checks the run's inputs, then takes out_dir's lock
    try:
        build(run, resume, teachers)
    except BaseException:  # an error line, a signal: the lock goes with it
        if run.unlock:
            run.unlock()
        raise
    return run


def build(run, resume, teachers):
    cfg, rt = run.cfg, run.rt
    earlier, dtype = assemble.starting_model(run, resume)  # data, weights; out_dir's earlier run
    run.loss_scale = LossScale(dtype == "float16")
    if resume is not None and run.loss_scale.enabled and resume.get("loss_scale"):
        run.loss_scale.load_state_dict(resume["loss_scale"])
    if cfg.quant_start:
        q = quant_start_step(cfg)
        rt.log(f"continual QAT: full precision for steps 0..{q - 1}, then ternary, lambda reaching "
               f"1 at step {q + cfg.lambda_warmup_steps}; the optimizer state carries over")
    run.model.to(rt.device)
    use_compile = cfg.compile == "true" or (cfg.compile == "auto" and rt.device_type == "cuda")
    if use_compile and run.lesson is not None and not run.lesson.compiles:  # its loss calls run.model itself
        use_compile = False
        rt.log(f"{run.lesson.flag} runs eagerly: its loss calls the model with hooks (--compile={cfg.compile} "
               "applies to the other stages)")
    # compiled, DDP or FSDP2 as asked
    run.train_model = rt.wrap(run.model, cfg.fsdp, use_compile)
    run.loss_fn = make_loss_fn(run, teachers)
    run.optimizer = configure_optimizer(run.model, cfg, rt.device_type, rt.replica_group(cfg.fsdp),
                                        sharded=rt.world > 1)
    run.clipper = ZClip(z_thresh=cfg.zclip_z_thresh) if cfg.zclip else None
    seams.plug_in(run, resume)  # the lessons' callbacks: QK-clip, checkpoint averaging
    try:  # optimizer, ZClip and RNG states last: nothing after this may draw a random number
        if resume is not None:
            checkpoint.restore(resume, run.optimizer, run.clipper)
    except checkpoint.CheckpointError as e:
        die(f"{run.ckpt_path}: {e}; resume with the --optimizer of the run that wrote it")
    # global batch = batch_size * grad_accum sequences at any world size
    run.accum = cfg.grad_accum // rt.world
    assemble.finish(run, earlier, use_compile, dtype)  # --overwrite's removal, the report


def configure_optimizer(model, cfg, device_type, process_group=None, sharded=False):
    """muon: one muon.Muon whose groups are tagged muon (the 2-D hidden matrices) or adamw
    (embeddings and head, decayed; norm gains, not);
    adamw: AdamW for all, weight decay on matrices only. Every group records its initial lr and wd.
    sharded (under torchrun): Muon's Newton-Schulz work shared out over the ranks of process_group
    (DDP; FSDP2 params bring their own), tools/sharded_muon.py."""
    # fused AdamW over DTensor shards: not tried, so not used
    fused = device_type == "cuda" and not cfg.fsdp
    # NS5 in bf16 (the paper) wherever matmuls have bf16 units; fp32 elsewhere (ns_dtype_for)
    if cfg.optimizer == "muon":
        opt = configure_muon(model, muon_lr=cfg.muon_lr, adamw_lr=cfg.lr,
                             muon_weight_decay=cfg.weight_decay,
                             adamw_weight_decay=cfg.weight_decay, adjust_lr_fn=cfg.muon_adjust_lr,
                             adamw_betas=(cfg.beta1, cfg.beta2), fused=fused,
                             ns_dtype=ns_dtype_for(device_type))
        if sharded:
            opt = ShardedMuon(opt.param_groups, process_group=process_group, ns_dtype=opt.ns_dtype)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)
    for g in opt.param_groups:
        g["initial_lr"], g["initial_wd"] = g["lr"], g["weight_decay"]
    return opt


# -----------------------------------------------------------------------------
# checks of the schedule flags against the run (the other flags: tools/checks.py)


def check_quant_start(cfg):
    """A --quant_start at or past the run's last step would leave its stage-2 checkpoint full
    precision: refused. (Its range, and that only stage 2 takes it, are checked with every other
    flag in tools/config.py.)"""
    q = quant_start_step(cfg)
    if cfg.quant_start and q >= cfg.max_iters:
        die(f"--quant_start={cfg.quant_start} is step {q}, not before --max_iters={cfg.max_iters}: "
            "the run would never go ternary and its stage-2 checkpoint would be full precision; "
            "pass a smaller --quant_start", 2)


def check_lambda_on_resume(step, saved, new, path):
    """A resumed run continues its lambda schedule (saved: the checkpoint's config, a dict): flags
    given now (--lambda_warmup_steps, --quant_start, or --max_iters with a fractional --quant_start)
    that would move lambda at the next step are refused in one line; a change that only moves steps
    still ahead of the warm-up is allowed and said."""
    schedule = ("lambda_warmup_steps", "quant_start", "max_iters")
    old = dataclasses.replace(new, **{k: saved.get(k, getattr(type(new), k)) for k in schedule})
    keys = [k for k in schedule if getattr(old, k) != getattr(new, k)]
    was, now = lambda_at(step, old), lambda_at(step, new)
    flags = " ".join(f"--{k}={getattr(new, k)}" for k in keys)
    if was != now:
        die(f"{flags} would move lambda at step {step} from {was:.3g} to {now:.3g}, but the run in "
            f"{path} continues its lambda schedule "
            f"(--lambda_warmup_steps={old.lambda_warmup_steps}, --quant_start={old.quant_start}); "
            f"drop the flag, or start a new run with it (--run_name=<name>)", 2)
    ends = [quant_start_step(c) + c.lambda_warmup_steps for c in (old, new)]
    if ends[0] == ends[1] or now >= 1:
        return ""
    return f"lambda now reaches 1 at step {ends[1]} (was {ends[0]})"


def main(argv):
    try:
        with atomic.StopSignal(at_once="stopped before training began; no checkpoint was written"):
            run = setup(argv)
    # missing, corrupt, not fitting this model, locked: one line
    except checkpoint.CheckpointError as e:
        die(str(e))
    # under torchrun: another rank stopped during set-up (a bad input it checked alone)
    except RuntimeError as e:
        lost_rank(None, e)
    try:
        return training_loop(run)
    # tools/prepare.py re-ran under us: stop; the last checkpoint resumes exactly
    except data.DataChanged as e:
        die(str(e))
    # under torchrun: another rank died (a lost node), so a collective failed here
    except RuntimeError as e:
        lost_rank(run, e)
    finally:
        if run.unlock:
            run.unlock()


if __name__ == "__main__":
    main(sys.argv[1:])
    leave_after_torchrun()  # under torchrun: done, without gloo's teardown (tools/runtime.py)
