"""
The plumbing of train.py, fenced off from the lesson: what a run holds (Run, Start) and the --stage=dlm
conversion's start and loss, where the data comes from and its loaders, stage 3's frozen teachers, the optimizer
groups, the checkpoint average, the one host read of a step, saving, and evaluation with the log lines.

Evaluation: each val source's mean token loss and their mixing-weighted total, logged and written to
metrics.jsonl. Every evaluation reads the first eval_iters batches of each source, the same rows every time; the
final one (--eval_whole=True, the default) reads every window of every val split once (data.DataLoader.sweep),
the number the lab also scores. A masked-diffusion model (--stage=dlm) is scored by its own loss
(lessons/dlm.py) with masks drawn from a generator seeded the same at every evaluation.
Test: python -m pytest tests/test_train.py
"""

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

import data
from distill import BitDistillLoss
from lessons import dlm
from lessons.averaging import CheckpointAverage
from model import GPT, GPTConfig, precompute_rope
from muon import configure_muon
from tools import checkpoint
from tools.config import TrainConfig, avg_interval, check_teacher, parse_data, parse_teacher_weights
from tools.flags import die
from tools.runtime import Runtime
from zclip import ZClip

SHIPPED = ("shakespeare", "python")  # --data names of the corpora in data/ (prepare.CORPORA)

def shipped_dir(name, cfg):
    """data/<name>_<tokenizer>, the shards of a shipped corpus; tokenised (tools/prepare.py) the first time."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", f"{name}_{cfg.tokenizer}")
    scores = os.path.join(root, "train_000.difficulty.npy")  # prepared before difficulty scores existed?
    if not os.path.exists(os.path.join(root, "meta.json")) or (cfg.data_order == "curriculum" and
                                                                not os.path.exists(scores)):
        from tools import prepare  # ingestion: only the first run needs it
        print(f"no shards{' or no difficulty scores' if os.path.exists(root) else ''} in {root}; tokenising the "
              f"shipped corpus {name} (once)")
        prepare.prepare(tokenizer=cfg.tokenizer, out_dir=root, corpus=name)
    return root


# -----------------------------------------------------------------------------
# what train.py's set-up builds: where a run starts, the run itself, and the --stage=dlm conversion


@dataclass
class Start:
    step: int = 0              # > 0 when resuming
    ckpt: dict = None          # the checkpoint whose weights the model loads (None: from scratch)
    path: str = ""             # where that checkpoint is
    insert_subln: bool = False  # load fp weights without SubLN; the SubLN gains keep their unit init
    note: str = ""             # what the run says about it



@dataclass
class Run:
    """Everything the loop touches, built once by setup()."""
    cfg: TrainConfig
    rt: Runtime
    out_dir: str
    model: GPT = None            # the model itself: its weights are what checkpoints hold
    train_model: object = None   # what the step calls: model, compiled and/or wrapped in DDP
    optimizer: object = None
    clipper: ZClip = None
    loss_fn: object = None
    train_loader: data.DataLoader = None
    val_loaders: dict = None     # source name -> (its val DataLoader, its mixing weight)
    autocast: object = None
    accum: int = 1               # micro-batches per step on this rank
    start: Start = None
    average: CheckpointAverage = None  # --avg_checkpoints: the average of the last checkpoints
    unlock: object = None        # releases out_dir's lock (rank 0)

    @property
    def ckpt_path(self):
        return os.path.join(self.out_dir, checkpoint.LATEST)



def dlm_start(cfg, conf):
    """--stage=dlm: the stage-2 model (or --init_from) with the mask token added (dlm.add_mask_token)."""
    path = os.path.join(cfg.out_dir, "stage2", "ckpt.pt") if cfg.init_from == "auto" else cfg.init_from
    if cfg.init_from == "scratch" or not os.path.exists(path):
        die(f"--stage=dlm converts a trained ternary model; no checkpoint at {path}; make one with: python train.py "
            f"--stage=2, or pass --init_from=<its ckpt.pt>")
    ckpt = checkpoint.load(path)
    if not ckpt["model_args"].get("quant"):
        die(f"{path} is a full-precision model (quant=False); --stage=dlm converts the ternary stage-2 model: "
            f"python train.py --stage=2, then --stage=dlm", 2)
    checkpoint.check_fits(ckpt["model_args"], dataclasses.replace(conf, vocab_size=conf.vocab_size - 1,
                                                                  causal=True, doc_mask=ckpt["model_args"].get(
                                                                      "doc_mask", False)), path)
    ar = GPT(GPTConfig(**ckpt["model_args"]))
    checkpoint.load_weights(ar, ckpt["model"], path)
    model, mask_id = dlm.add_mask_token(ar, cfg.dlm_mask_init, seed=cfg.seed)
    return Start(0, {"model": model.state_dict(), "model_args": dataclasses.asdict(model.config)}, path,
                 note=f"stage dlm: the AR model in {path} with a mask token (id {mask_id}, {cfg.dlm_mask_init} init), "
                      f"bidirectional attention{', Dream shift' if cfg.dlm_shift else ''}")



def dlm_loss_fn(run):
    """--stage=dlm's loss: the masked-diffusion loss (lessons/dlm.py), with the outlier ratios of the mask token and
    of the other tokens at the quantisers' inputs logged beside it."""
    mask_id = run.model.config.vocab_size - 1

    def dlm_loss(x, y):
        loss, info = dlm.masked_diffusion_loss(run.model, x, mask_id, run.cfg.dlm_shift, diagnostics=True)
        return loss, {k: info[k] for k in ("ratio_mask", "ratio_other")}
    return dlm_loss


# where docs/gpu-node.md prepares FineWeb-Edu for the CUDA preset
FINEWEB_EDU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "fineweb_edu_gpt2")


def default_data(cfg):
    """--data="": FineWeb-Edu when it has been prepared (docs/gpu-node.md) and the run uses the GPT-2 tokenizer
    (the CUDA preset), else the shipped Shakespeare corpus."""
    if cfg.tokenizer == "gpt2" and os.path.exists(os.path.join(FINEWEB_EDU, "meta.json")):
        return {FINEWEB_EDU: 1.0}
    return {"shakespeare": 1.0}


def resolve_data(cfg):
    """The shard directories and mixing weights. A shipped corpus may be named instead of a directory
    (--data=shakespeare:0.75,python:0.25) and is prepared the first time; "" = default_data(cfg)."""
    sources = {shipped_dir(p, cfg) if p in SHIPPED and not os.path.isdir(p) else p: w
               for p, w in (parse_data(cfg.data) or default_data(cfg)).items()}
    for path in sources:
        if not os.path.exists(os.path.join(path, "meta.json")):
            die(f"{path}: no meta.json; make shards with: python -m tools.prepare --tokenizer={cfg.tokenizer} --out_dir={path} <files>")
        try:
            meta = data.read_meta(path)  # an empty or broken meta.json: one line naming it
        except ValueError as e:
            die(str(e))
        if meta["tokenizer"] != cfg.tokenizer:
            die(f"{path} was tokenised with {meta['tokenizer']}, but --tokenizer={cfg.tokenizer}; "
                f"pass --tokenizer={meta['tokenizer']} or re-run tools/prepare.py")
    return sources


def make_loaders(cfg, rt, resume):
    """The train loader and {source name: (its val loader, mixing weight)} (rt: runtime.Runtime); local rank 0
    of each node prepares the shipped corpora first. resume: a checkpoint whose loader position the train loader continues from."""
    try:
        if rt.local_rank == 0:
            sources = resolve_data(cfg)
        rt.barrier()
        if rt.local_rank != 0:
            sources = resolve_data(cfg)
        span = cfg.max_iters * cfg.batch_size * cfg.grad_accum  # the rows this run reads: one curriculum block
        train_loader = data.DataLoader(sources, "train", cfg.batch_size, cfg.block_size, rt.rank, rt.world, cfg.seed,
                                       order=cfg.data_order, span=span)
        total = sum(sources.values())
        names = [os.path.basename(os.path.normpath(d)) for d in sources]
        names = names if len(set(names)) == len(names) else list(sources)  # two dirs of one name: their paths
        val_loaders = {name: (data.DataLoader(d, "val", cfg.batch_size, cfg.block_size, rt.rank, rt.world, cfg.seed,
                                              order="sequential"), w / total)
                       for name, (d, w) in zip(names, sources.items())}
        if resume is not None:
            train_loader.load_state_dict(resume["loader"])
    except ValueError as e:
        die(str(e))
    have = [data.read_meta(d).get("train_tokens") for d in sources]
    epochs = span * cfg.block_size / sum(have) if None not in have and sum(have) > 0 else 0
    if epochs > 10:  # a 124M model on Shakespeare: hundreds of passes over 1.5M tokens
        rt.log(f"note: this run reads its training data {epochs:.0f} times over ({span * cfg.block_size:,} tokens); "
               f"a model of this size will memorise it. For the CUDA preset prepare FineWeb-Edu (docs/gpu-node.md), "
               f"which --data='' then uses, or pass a larger --data")
    return train_loader, val_loaders


def make_teachers(cfg, paths, student_conf, device):
    """Stage 3: the frozen full-precision teachers (eval mode, no grad, bf16 on CUDA) and the BitDistill loss.
    With every distillation weight 0 there is no teacher: ([], crit), plain CE, the control run."""
    try:
        crit = BitDistillLoss(cfg.distill_preset, lambda_ld=None if cfg.distill_lambda < 0 else cfg.distill_lambda,
                              gamma_ad=None if cfg.distill_gamma < 0 else cfg.distill_gamma,
                              delta_hidden=cfg.distill_hidden, temperature=cfg.distill_tau,
                              n_relation_heads=cfg.distill_relation_heads, distill_layer=cfg.distill_layer,
                              teacher_weights=parse_teacher_weights(cfg, len(paths)))
    except ValueError as e:
        die(str(e), 2)
    if crit.lambda_ld == crit.gamma_ad == crit.delta_hidden == 0:
        return [], crit
    return [_load_teacher(cfg, crit, p, student_conf, device, first=i == 0) for i, p in enumerate(paths)], crit


def _load_teacher(cfg, crit, path, student_conf, device, first):
    ckpt = checkpoint.load(path)
    if not ckpt["model_args"].get("causal", True):
        die(f"{path}: a masked-diffusion model (--stage=dlm) cannot be a teacher: stage 3 distils next-token "
            f"predictions; pass a stage-1 (or any autoregressive) checkpoint as --teacher", 2)
    tconf = GPTConfig(**ckpt["model_args"])
    check_teacher(cfg, crit, student_conf, tconf, path, first)  # shapes that would only fail at the first step
    teacher = GPT(tconf)
    checkpoint.load_weights(teacher, ckpt["model"], path)
    teacher.requires_grad_(False).eval().to(device)
    if device.startswith("cuda"):
        teacher.to(torch.bfloat16)  # weights in bf16; RoPE tables stay fp32
        cos, sin = precompute_rope(tconf.n_embd // tconf.n_head, tconf.block_size, tconf.rope_theta)
        teacher.rope_cos, teacher.rope_sin = cos.to(device), sin.to(device)
    return teacher


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
        if cfg.normuon or cfg.muon_state != "fp32":  # the same groups, stepped by NorMuon / 8-bit Muon
            from lessons.muon_variants import MuonVariant
            opt.muon = MuonVariant(opt.muon.param_groups, normuon=cfg.normuon, state=cfg.muon_state,
                                   ns_dtype=opt.muon.ns_dtype)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)
    for g in opt.param_groups:
        g["initial_lr"], g["initial_wd"] = g["lr"], g["weight_decay"]
    return opt


def make_average(cfg, rt, resume, out_dir):
    """--avg_checkpoints: the checkpoint average (lessons/averaging.py), restored from resume when it holds one."""
    if not cfg.avg_checkpoints:
        return None
    if cfg.fsdp and rt.world > 1:
        die("--avg_checkpoints with --fsdp=True: averaging sharded weights is not implemented; use DDP", 2)
    average = CheckpointAverage(cfg.avg_checkpoints, avg_interval(cfg), cfg.avg_alpha, cfg.max_iters)
    if resume is not None and resume.get("average"):
        average.load_state_dict(resume["average"], rt.device)
    rt.log(f"checkpoint averaging: EMA (alpha {cfg.avg_alpha}) of the weights at steps {average.steps()}, "
           f"saved as {os.path.join(out_dir, checkpoint.AVERAGED)}")
    return average



# -----------------------------------------------------------------------------
# the step's host read, the optimizer step, saving


def read_step(run, loss, stats, stop_requested, parts, top=None):
    """The one host read per step: the loss averaged over ranks, whether any rank got a stop signal, the
    clipping statistics and (stage 3) the loss terms, all in one tensor. Every rank gets the same numbers,
    so all take the same branch afterwards."""
    reduced = run.rt.all_reduce_(torch.stack([loss, torch.tensor(float(stop_requested), device=loss.device)]))
    names = [] if parts is None else [k for k in parts if k != "loss"]  # stage 3: ce ld ad hidden; dlm: ratios
    extra = [parts[k].detach().float().reshape(1) for k in names]
    values = torch.cat([reduced / torch.tensor([run.rt.world, 1.0], device=loss.device)] +
                       [stats[k].reshape(1).float() for k in ("raw_norm", "clipped_norm", "was_clipped", "z_score")]
                       + extra + ([] if top is None else [top.float().reshape(1)])).tolist()
    out = dict(zip(("loss", "stop", *STAT_KEYS), values))
    out["stop"] = bool(out["stop"])
    if parts is not None:
        out["parts"] = dict(zip(names, values[6:6 + len(names)]))
    if top is not None:
        out["max_logit"] = values[-1]
    return out


def optimizer_step(optimizer, rt, timed):
    """Step; with timed=True also return the milliseconds of Muon's part (synchronising on CUDA)."""
    if not timed or not hasattr(optimizer, "muon"):
        return optimizer.step()  # None
    sync = torch.cuda.synchronize if rt.device_type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    optimizer.muon.step()
    sync()
    muon_ms = 1000 * (time.perf_counter() - t)
    optimizer.adamw.step()
    return muon_ms


def save(run, step):
    """Every rank calls it (FSDP2 gathers shards); rank 0 writes. A failed write keeps the previous checkpoint,
    and so do non-finite weights: they never replace a finite checkpoint."""
    if not checkpoint.all_finite(run.model):
        die(f"step {step}: the weights are not finite, so they were not saved; {run.ckpt_path} is kept; lower "
            f"--lr or --muon_lr and continue from it with --resume=True")
    state = checkpoint.training_state(step, dataclasses.asdict(run.cfg), dataclasses.asdict(run.model.config),
                                      run.model, run.optimizer, run.clipper, run.train_loader)
    averaged = None
    if run.average is not None:
        state["average"] = run.average.state_dict()
        averaged = checkpoint.averaged_state(state, run.model, run.average) if run.average.count else None
    wrote = None
    try:
        if run.rt.master:
            wrote = checkpoint.save(state, run.out_dir, run.cfg.keep_last)
            if averaged is not None:
                checkpoint.atomic_save(averaged, os.path.join(run.out_dir, checkpoint.AVERAGED))
    except OSError as e:  # e.g. a full disk: the atomic write left the file it was writing as it was
        if wrote is None:
            die(f"cannot write a checkpoint to {run.out_dir}: {e.strerror}; the previous one is kept, free space "
                f"and continue with --resume=True")
        die(f"cannot write {os.path.join(run.out_dir, checkpoint.AVERAGED)}: {e.strerror}; the checkpoint of step "
            f"{step} was saved, the previous average is kept (it does not include step {step}); free space and "
            f"continue with --resume=True")
    run.rt.barrier()


def lost_rank(run, e):
    """A collective failed because another rank stopped: one line per rank instead of a traceback, naming the
    checkpoint the whole job resumes from (torchrun's own summary names the rank that exited first)."""
    why = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)[:160]
    step = checkpoint.load(run.ckpt_path, ("step",))["step"] if os.path.exists(run.ckpt_path) else None
    resume = (f"restart all {run.rt.world} ranks with the same torchrun command and --resume=True to continue from "
              f"{run.ckpt_path} (step {step})") if step is not None else "no checkpoint was written yet; start again"
    die(f"lost contact with another rank of this {run.rt.world}-process run ({why}); torchrun's summary names the "
        f"rank that stopped; {resume}")


# -----------------------------------------------------------------------------
# evaluation and the log lines

DLM_EVAL_SEED = 1234  # the masks of every DLM evaluation
EVAL_PROGRESS_S = 10.0  # a whole-split evaluation prints a progress line this often

STAT_KEYS = ("grad_norm_raw", "grad_norm", "clipped", "z")  # as logged, from ZClip's raw_norm, clipped_norm, ...



@torch.no_grad()
def estimate_val_loss(run, whole=False):
    """(the mixing-weighted total, {source: val loss}): per source, the mean token loss over the first
    eval_iters * batch_size rows of its val split, or with whole=True over every window of it once
    (DataLoader.sweep). Each of W ranks reads its own rows of eval_iters / W global batches (rounded up), so when
    W divides eval_iters every world size reads the same rows."""
    model, rt = run.model, run.rt
    model.eval()
    by_source = {}
    gen = None if model.config.causal else torch.Generator(device=rt.device).manual_seed(DLM_EVAL_SEED)
    for name, (loader, _) in run.val_loaders.items():
        loader.reset()
        iters = -(-run.cfg.eval_iters // loader.world_size)
        batches = loader.sweep() if whole else (loader.next_batch() for _ in range(iters))
        sums = torch.zeros(2, device=rt.device)  # (sum of token losses, tokens)
        total = -(-len(loader.windows[0][0]) // (loader.B * loader.world_size)) if whole else iters
        t0 = last = time.time()
        for i, (x, y) in enumerate(batches):
            if whole and i and time.time() - last >= EVAL_PROGRESS_S:  # a long whole-split evaluation shows progress
                last = time.time()
                rt.log(f"  evaluating {name}: batch {i} of {total}, {(last - t0) * (total - i) / i:.0f}s left")
            x, y = x.to(rt.device), y.to(rt.device)
            n = (y != -1).sum()
            with run.autocast:
                loss = run.train_model(x, y)[1].float() if gen is None else _dlm_loss(run, x, y, gen)
            sums += torch.stack([torch.where(n > 0, loss * n, 0.0), n.float()])  # an all-padding batch adds 0
        rt.all_reduce_(sums)
        by_source[name] = (sums[0] / sums[1]).item()
    model.train()
    return sum(w * by_source[n] for n, (_, w) in run.val_loaders.items()), by_source


def _dlm_loss(run, x, y, gen):
    """The masked-diffusion loss of the rows of x that are real windows (a sweep pads with rows of targets -1)."""
    rows = (y != -1).all(dim=1)
    if not rows.any():
        return torch.zeros((), device=x.device)
    mask_id = run.model.config.vocab_size - 1
    return dlm.masked_diffusion_loss(run.model, x[rows], mask_id, run.cfg.dlm_shift, generator=gen)[0].float()


def log_eval(run, rec):
    parts = [f"step {rec['step']}: val loss {rec['val_loss']:.4f}"]
    if "val_loss_by_source" in rec:
        parts.append("(" + ", ".join(f"{n} {v:.4f}" for n, v in rec["val_loss_by_source"].items()) + ")")
    if rec["whole_val"]:
        parts.append("over the whole val split")
    if "val_loss_avg" in rec:
        parts.append(f"; average of {run.average.count} checkpoints {rec['val_loss_avg']:.4f}")
    run.rt.log(" ".join(parts).replace(" ;", ";"))
    run.rt.log_json(run.out_dir, rec)


def log_step(run, step, out, n_bad, bad_run, timer):
    lam = out["lam"]
    if not out["ok"]:
        run.rt.log(f"step {step} | skipped: loss {out['loss']} grad norm {out['grad_norm_raw']} not finite, no "
                   f"update ({bad_run} in a row, {n_bad} in all; max_bad_steps={run.cfg.max_bad_steps})")
        run.rt.log_json(run.out_dir, {"step": step, "skipped": 1, "loss": None, "lambda": lam, "bad_steps": n_bad})
        return
    dt = timer.lap()
    tokens = run.cfg.batch_size * run.cfg.block_size * run.cfg.grad_accum
    rec = {"step": step, "loss": out["loss"], "lr": out["lr"], "lambda": lam,
           **{k: out[k] for k in STAT_KEYS}, "ms": 1000 * dt, "tok_per_s": tokens / dt,
           "muon_ms": out["muon_ms"], "bad_steps": n_bad, **out.get("parts", {}),
           **({"max_logit": out["max_logit"]} if "max_logit" in out else {})}
    rec["clipped"] = int(rec["clipped"])
    parts = out.get("parts")
    run.rt.log(f"step {step} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | lambda {lam:.2f} | grad norm "
               f"{rec['grad_norm_raw']:.3f} -> {rec['grad_norm']:.3f} (clipped {rec['clipped']}, z {rec['z']:.2f}) | "
               f"{rec['ms']:.0f} ms | {rec['tok_per_s']:.0f} tok/s" +
               (f" | max logit {rec['max_logit']:.1f}" if "max_logit" in rec else "") +
               (" | " + " ".join(f"{k} {v:.4f}" for k, v in parts.items()) if parts else ""))
    run.rt.log_json(run.out_dir, rec)
