"""
The plumbing of train.py, fenced off from the lesson: what a run holds (Run); where its data comes from (a shipped
corpus named or a directory of shards, checked against the run's tokenizer) and its loaders; stage 3's frozen
teachers and the BitDistill loss; the optimizer groups; saving a checkpoint (and the checkpoint average beside
it); the line a rank prints when another rank is lost; evaluation and the log lines of evaluations and steps.

Evaluation: each val source's mean token loss and their mixing-weighted total, logged and written to
metrics.jsonl. Every evaluation reads the first eval_iters batches of each source, the same rows every time; the
final one (--eval_whole=True, the default) reads every window of every val split once (data.DataLoader.sweep),
the number the lab also scores (whole_val_loss; token_loss_sums is the one sum behind train.py's, the lab's and the
benchmarks' val losses). A masked-diffusion model (--stage=dlm) is scored by its own loss (lessons/dlm.py) with
masks drawn from a generator seeded the same at every evaluation.
Test: python -m pytest tests/test_train.py
"""

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

import data
from distill import BitDistillLoss
from model import GPT, precompute_rope
from muon import configure_muon
from tokenizer import fingerprint, get_tokenizer
from tools import checkpoint, prepare
from tools.common import ROOT, write_failed
from tools.outputs import check_input
from tools.load import is_model_source, load_gpt, saved_tokenizer
from tools.prepare import same_source, source_slug
from tools.config import TrainConfig, check_teacher, parse_data, parse_teacher_weights
from tools.flags import die
from tools.runtime import Runtime, git_commit
from tools.start import Start, check_same_tokenizer, import_model
from zclip import ZClip

# -----------------------------------------------------------------------------
# the run, and where its data comes from


@dataclass
class Run:
    """Everything the loop touches, built once by setup()."""
    cfg: TrainConfig
    rt: Runtime
    out_dir: str
    given: dict = dataclasses.field(default_factory=dict)  # the flags given on the command line, {name: value}
    model: GPT = None            # the model itself: its weights are what checkpoints hold
    train_model: object = None   # what the step calls: model, compiled and/or wrapped in DDP
    optimizer: object = None
    clipper: ZClip = None
    loss_fn: object = None
    train_loader: data.DataLoader = None
    val_loaders: dict = None     # source name -> (its val DataLoader, its mixing weight)
    autocast: object = None
    accum: int = 1               # micro-batches per step on this rank
    device: str = "cpu"          # where the step runs (rt.device)
    start: Start = None
    callbacks: list = dataclasses.field(default_factory=list)  # the lessons' step callbacks (tools/seams.py)
    average: object = None       # --avg_checkpoints: the average of the last checkpoints (one of the callbacks)
    lesson: object = None        # a lesson's own stage (tools/seams.py: --stage=dlm), else None
    eval_loss: object = None     # a lesson's evaluation loss (eval_loss(run) -> loss(x, y)); None: the model's CE
    unlock: object = None        # releases out_dir's lock (rank 0)
    commit: str = dataclasses.field(default_factory=git_commit)  # the code's (log_record writes it once)
    records: int = 0             # metrics.jsonl records this process has written

    @property
    def ckpt_path(self):
        return os.path.join(self.out_dir, checkpoint.LATEST)


SHIPPED = ("shakespeare", "python")  # --data names of the corpora in data/ (prepare.CORPORA)


def shipped_dir(name, cfg):
    """data/<name>_<tokenizer>, the shards of a shipped corpus; tokenised (tools/prepare.py) the first time. A
    pretrained model's tokenizer is named by its source's last part (prepare.source_slug)."""
    root = os.path.join(ROOT, "data", f"{name}_{source_slug(cfg.tokenizer)}")
    scores = os.path.join(root, "train_000.difficulty.npy")  # the curriculum needs them
    if not os.path.exists(os.path.join(root, "meta.json")) or (cfg.data_order == "curriculum" and
                                                                not os.path.exists(scores)):
        print(f"no shards{' or no difficulty scores' if os.path.exists(root) else ''} in {root}; tokenising the "
              f"shipped corpus {name} (once)")
        prepare.prepare(tokenizer=cfg.tokenizer, out_dir=root, corpus=name)
    try:
        prepare.check_shipped(root, name)  # data of one's own prepared into it is not that corpus
    except ValueError as e:
        die(str(e), 2)
    return root


# where docs/gpu-node.md prepares FineWeb-Edu for the CUDA preset
FINEWEB_EDU = os.path.join(ROOT, "data", "fineweb_edu_gpt2")


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
        try:
            prepare.check_not_mid_swap(path)  # a dataset left between the two renames of a re-run: say where it is
        except ValueError as e:
            die(str(e))
        if not os.path.exists(os.path.join(path, "meta.json")):
            die(f"{path}: no meta.json; make shards with: python -m tools.prepare --tokenizer={cfg.tokenizer} --out_dir={path} <files>")
        try:
            meta = data.read_meta(path)  # an empty or broken meta.json: one line naming it
        except ValueError as e:
            die(str(e))
        made_by = meta.get("tokenizer_fingerprint")  # the vocabulary itself: one model at two paths is one
        mine = fingerprint(get_tokenizer(cfg.tokenizer)) if made_by else None
        if mine != made_by or not (made_by or same_source(meta["tokenizer"], cfg.tokenizer)):
            die(f"{path} was tokenised with {meta['tokenizer']}" + (f" (fingerprint {made_by})" if made_by else "") +
                f", but --tokenizer={cfg.tokenizer}" + (f" (fingerprint {mine})" if made_by else "") +
                f"; pass --tokenizer={meta['tokenizer']} or re-run tools/prepare.py")
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
        crit = BitDistillLoss(cfg.distill_preset, kd_logits=None if cfg.kd_logits < 0 else cfg.kd_logits,
                              kd_relation=None if cfg.kd_relation < 0 else cfg.kd_relation,
                              kd_hidden=cfg.kd_hidden, temperature=cfg.distill_tau,
                              n_relation_heads=cfg.distill_relation_heads, distill_layer=cfg.distill_layer,
                              teacher_weights=parse_teacher_weights(cfg, len(paths)))
    except ValueError as e:
        die(str(e), 2)
    if crit.kd_logits == crit.kd_relation == crit.kd_hidden == 0:
        return [], crit
    return [_load_teacher(cfg, crit, p, student_conf, device, first=i == 0) for i, p in enumerate(paths)], crit


def _load_teacher(cfg, crit, path, student_conf, device, first):
    if is_model_source(path):  # the original model as published (BitDistill's teacher): full precision, no SubLN
        check_same_tokenizer("--tokenizer", cfg.tokenizer, "the tokenizer of the --teacher", path)
        teacher = import_model(path, cfg.block_size, "--teacher")
        check_teacher(cfg, crit, student_conf, teacher.config, path, first)
        return _frozen(teacher, device)
    check_input("--teacher", path)  # an HF export of ours: named as such
    if not checkpoint.load(path, ("model_args",), mmap=True)["model_args"].get("causal", True):
        die(f"{path}: a masked-diffusion model (--stage=dlm) cannot be a teacher: stage 3 distils next-token "
            f"predictions; pass a stage-1 (or any autoregressive) checkpoint as --teacher", 2)
    teacher, obj = load_gpt(path)
    if saved_tokenizer(obj):  # the teacher's ids are the student's: one vocabulary, not only one size
        check_same_tokenizer("--tokenizer", cfg.tokenizer, f"the tokenizer of the --teacher {path}",
                             saved_tokenizer(obj))
    tconf = teacher.config
    check_teacher(cfg, crit, student_conf, tconf, path, first)  # shapes that would only fail at the first step
    return _frozen(teacher, device)


def _frozen(teacher, device):
    tconf = teacher.config
    teacher.requires_grad_(False).eval().to(device)
    if device.startswith("cuda"):
        teacher.to(torch.bfloat16)  # weights in bf16; RoPE tables stay fp32
        cos, sin = precompute_rope(tconf.head_size(), tconf.block_size, tconf.rope_theta)
        teacher.rope_cos, teacher.rope_sin = cos.to(device), sin.to(device)
    return teacher


def configure_optimizer(model, cfg, device_type, process_group=None):
    """muon: one muon.Muon whose groups are tagged muon (the 2-D hidden matrices) or adamw (embeddings and head,
    decayed; norm gains, not);
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


# -----------------------------------------------------------------------------
# saving


def save(run, step, val_loss=None):
    """Every rank calls it (FSDP2 gathers shards); rank 0 writes. A failed write keeps the previous checkpoint,
    and so do non-finite weights: they never replace a finite checkpoint. val_loss: this step's, when evaluated;
    an older checkpoint with a better one is kept beside the new (checkpoint.save), and a line says so."""
    if not checkpoint.all_finite(run.model):
        die(f"step {step}: the weights are not finite, so they were not saved; {run.ckpt_path} is kept; lower "
            f"--lr or --muon_lr and continue from it with --resume=True")
    config = {**dataclasses.asdict(run.cfg), "tokenizer_fingerprint": fingerprint(get_tokenizer(run.cfg.tokenizer))}
    state = checkpoint.training_state(step, config, dataclasses.asdict(run.model.config),
                                      run.model, run.optimizer, run.clipper, run.train_loader, val_loss)
    averaged = None
    if run.average is not None:
        state["average"] = run.average.state_dict()
        averaged = checkpoint.averaged_state(state, run.model, run.average) if run.average.count else None
    wrote = None
    try:
        if run.rt.master:
            wrote, kept = checkpoint.save(state, run.out_dir, run.cfg.keep_last)
            if kept is not None:
                now = f"val loss {val_loss:.4g}" if val_loss is not None else "no val loss (not evaluated)"
                run.rt.log(f"kept {kept[1]} (step {checkpoint.step_of(kept[1])}, val loss {kept[0]:.4f}) beside the "
                           f"new {run.ckpt_path} (step {step}, {now}): rotation never deletes a better checkpoint")
            if averaged is not None:
                checkpoint.atomic_save(averaged, os.path.join(run.out_dir, checkpoint.AVERAGED))
    except OSError as e:  # e.g. a full disk: the atomic write left the file it was writing as it was
        why, cause, fix = write_failed(e, run.ckpt_path)
        if wrote is None:
            die(f"cannot write a checkpoint to {run.out_dir}: {why}; {cause}; the previous one is kept; {fix} "
                f"and continue with --resume=True")
        die(f"cannot write {os.path.join(run.out_dir, checkpoint.AVERAGED)}: {why}; {cause}; the checkpoint "
            f"of step {step} was saved, the previous average is kept (it does not include step {step}); {fix} "
            f"and continue with --resume=True")
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

EVAL_PROGRESS_S = 10.0  # a whole-split evaluation prints a progress line this often


def evaluate(run, step, lam, whole):
    """Evaluate, log the line and the metrics.jsonl record, and return the val loss (mixing-weighted over the
    sources). With --avg_checkpoints the average is evaluated beside the weights."""
    val_loss, by_source = estimate_val_loss(run, whole)
    rec = {"step": step, "val_loss": val_loss, "lambda": lam, "whole_val": whole}
    if len(by_source) > 1:
        rec["val_loss_by_source"] = by_source
    if run.average is not None and run.average.count:
        with run.average.swapped_in(run.model):
            rec["val_loss_avg"] = estimate_val_loss(run, whole)[0]
    log_eval(run, rec)
    return val_loss


@torch.no_grad()
def estimate_val_loss(run, whole=False, model=None):
    """(the mixing-weighted total, {source: val loss}): per source, the mean token loss over the first
    eval_iters * batch_size rows of its val split, or with whole=True over every window of it once
    (DataLoader.sweep). Each of W ranks reads its own rows of eval_iters / W global batches (rounded up), so when
    W divides eval_iters every world size reads the same rows. model: another model to score on the same rows."""
    rt = run.rt
    loss_fn = (lambda x, y: model(x, y)[1]) if model is not None else \
        run.eval_loss(run) if run.eval_loss else (lambda x, y: run.train_model(x, y)[1])
    model = run.model if model is None else model
    model.eval()
    by_source = {}
    for name, (loader, _) in run.val_loaders.items():
        loader.reset()
        iters = -(-run.cfg.eval_iters // loader.world_size)
        batches = loader.sweep() if whole else (loader.next_batch() for _ in range(iters))
        total = -(-len(loader.windows[0][0]) // (loader.B * loader.world_size)) if whole else iters
        progress = Progress(rt, name, total) if whole else None  # a long whole-split evaluation shows progress
        with run.autocast:
            sums = token_loss_sums(loss_fn, batches, rt.device, progress)
        rt.all_reduce_(sums)
        by_source[name] = (sums[0] / sums[1]).item()
    model.train()
    return sum(w * by_source[n] for n, (_, w) in run.val_loaders.items()), by_source


class Progress:
    """A line every EVAL_PROGRESS_S seconds of a whole-split evaluation: the batch, of how many, time left."""

    def __init__(self, rt, name, total):
        self.rt, self.name, self.total, self.t0 = rt, name, total, time.time()
        self.last = self.t0

    def __call__(self, i):
        if i and time.time() - self.last >= EVAL_PROGRESS_S:
            self.last = time.time()
            left = (self.last - self.t0) * (self.total - i) / i
            self.rt.log(f"  evaluating {self.name}: batch {i} of {self.total}, {left:.0f}s left")


def token_loss_sums(loss_fn, batches, device, every=None):
    """(sum over batches of loss * targets, targets) as a 2-element tensor, no host read: loss_fn(x, y) is the mean
    loss over the targets of y that are not -1 (a whole-split sweep pads its last rows with -1; an all-padding
    batch adds 0). every(i): called before batch i, e.g. to print progress. The caller divides (after summing the
    tensor over the ranks, if several share the batches)."""
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


def log_eval(run, rec):
    parts = [f"step {rec['step']}: val loss {rec['val_loss']:.4f}"]
    if "val_loss_by_source" in rec:
        parts.append("(" + ", ".join(f"{n} {v:.4f}" for n, v in rec["val_loss_by_source"].items()) + ")")
    if rec["whole_val"]:
        parts.append("over the whole val split")
    if "val_loss_avg" in rec:
        parts.append(f"; average of {run.average.count} checkpoints {rec['val_loss_avg']:.4f}")
    run.rt.log(" ".join(parts).replace(" ;", ";"))
    log_record(run, rec)


def log_step(run, step, out, skipped_steps, skipped_in_a_row, timer):
    """The step's log line and metrics.jsonl record: the loss, lr, lambda, the clipping statistics under their
    names in zclip.py (raw_norm, clipped_norm, was_clipped, z_score), speed, and what the loss and the callbacks
    added (stage 3's loss terms, QK-clip's max_logit, the DLM's outlier ratios)."""
    lam = out["lam"]
    if not out["ok"]:
        run.rt.log(f"step {step} | skipped: loss {out['loss']} grad norm {out['raw_norm']} not finite, no update "
                   f"({skipped_in_a_row} in a row, {skipped_steps} in all; max_bad_steps={run.cfg.max_bad_steps})")
        log_record(run, {"step": step, "skipped": 1, "loss": None, "lambda": lam, "bad_steps": skipped_steps})
        return
    dt = timer.lap()
    tokens = run.cfg.batch_size * run.cfg.block_size * run.cfg.grad_accum
    extra = {k: v for k, v in out.items() if k not in ("loss", "stop", "ok", "lam", "lr")}
    rec = {"step": step, "loss": out["loss"], "lr": out["lr"], "lambda": lam, **extra, "ms": 1000 * dt,
           "tok_per_s": tokens / dt, "bad_steps": skipped_steps}
    clip = {"raw_norm", "clipped_norm", "was_clipped", "z_score"}
    if "was_clipped" in rec:
        rec["was_clipped"] = int(rec["was_clipped"])
    line = f"grad norm {rec['raw_norm']:.3f} -> {rec['clipped_norm']:.3f}"
    if "z_score" in rec:
        line += f" (clipped {rec['was_clipped']}, z {rec['z_score']:.2f})"
    run.rt.log(f"step {step} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | lambda {lam:.2f} | {line} | "
               f"{rec['ms']:.0f} ms | {rec['tok_per_s']:.0f} tok/s" +
               "".join(f" | {k} {v:.4f}" for k, v in extra.items() if k not in clip))
    log_record(run, rec)


def log_record(run, rec):
    """Append rec to <out_dir>/metrics.jsonl (rank 0). The first record this process writes also names the commit
    of the code that wrote it (runtime.git_commit: git rev-parse HEAD, or "unknown"), a resumed run's too."""
    if run.records == 0:
        rec = {**rec, "commit": run.commit}
    run.records += 1
    run.rt.log_json(run.out_dir, rec)
