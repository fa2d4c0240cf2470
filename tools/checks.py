"""
A run's config from the flags given, and every check of it before anything is loaded or written: a
bad flag or file costs nothing already saved.

    build_config(overrides, base)        tools/config.py's defaults and presets, then the flags
                                         given; on resume, the saved config, then the flags given
    check_config(cfg)                    every value's range, and the flags against each other
    check_resume(cfg, overrides, ...)    what a resumed run cannot change (nor a --max_iters below
                                         its step); a note for what it changes on purpose
    check_run(cfg, rt, out_dir, ...)     the batch split over the ranks, stage 3's teachers, an
                                         out_dir that can be written and that holds none of the
                                         run's inputs
Test: python -m pytest tests/test_train.py tests/test_flags.py
"""

import dataclasses
import math
import os

import torch

from tokenizer import TOKENIZERS
from tools import checkpoint, outputs
from tools.config import (DEVICE_PRESETS, DEVICE_STAGE_PRESETS, DLM_STAGE, PRETRAINED_PRESET,
                          SCHEDULE_PRESETS, STAGE_PRESETS, TrainConfig, parse_data)
from tools.flags import die
from tools.pretrained import is_model_source
from tools.runtime import check_device


def build_config(overrides, base=None):
    """Defaults + device preset + stage preset + overrides; or, on resume, the saved config +
    overrides."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = {k: v for k, v in (base or {}).items() if k in known}
    if not base:
        device = overrides.get("device", "auto")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        stage = overrides.get("stage", TrainConfig.stage)
        if stage not in STAGE_PRESETS:
            die(f"--stage={stage}: expected 1, 2, 3 or dlm", 2)
        cfg.update(DEVICE_PRESETS.get(device.split(":")[0], {}))
        cfg.update(STAGE_PRESETS[stage])
        cfg.update(DEVICE_STAGE_PRESETS.get((device.split(":")[0], stage), {}))
        cfg.update(SCHEDULE_PRESETS.get(overrides.get("schedule"), {}))
        if pretrained_run(overrides):
            cfg.update(PRETRAINED_PRESET)
        cfg["device"] = device
    cfg.update(overrides)
    if cfg.get("device") == "auto":  # a resumed run given --device=auto
        cfg["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if not base and "tokenizer" not in overrides:  # a pretrained model brings its own tokenizer
        model = next((m for m in (overrides.get("init_from"),
                                  overrides.get("teacher", "").split(",")[0])
                      if is_model_source(m)), None)
        cfg["tokenizer"] = model or cfg.get("tokenizer", TrainConfig.tokenizer)
    if cfg.get("tokenizer") not in TOKENIZERS and os.path.exists(cfg.get("tokenizer", "")):
        # what a checkpoint records: readable from anywhere
        cfg["tokenizer"] = os.path.abspath(cfg["tokenizer"])
    cfg = TrainConfig(**cfg)
    check_config(cfg)
    if not base:  # a resume's flags meet check_resume, which names the saved value
        check_applies(cfg, overrides)
    return cfg


# flags that only act under another flag: (what they need, whether cfg has it, how to get it)
DISTILL_FLAGS = ("teacher", "teacher_weights", "distill_preset", "kd_logits", "kd_relation", "kd_hidden",
                 "distill_tau", "distill_layer", "distill_relation_heads")
NEEDS = {**{k: ("stage 3 (distillation)", lambda c: c.stage == 3, "pass --stage=3") for k in DISTILL_FLAGS},
         "zclip_z_thresh": ("ZClip", lambda c: c.zclip, "drop --zclip=False"),
         "grad_clip": ("the fixed clipping of --zclip=False", lambda c: not c.zclip, "pass --zclip=False"),
         "two_phase_lr_drop": ("the two-phase schedule", lambda c: c.two_phase, "pass --two_phase=True"),
         "avg_interval": ("checkpoint averaging", lambda c: c.avg_checkpoints > 0, "pass --avg_checkpoints=k"),
         "avg_alpha": ("checkpoint averaging", lambda c: c.avg_checkpoints > 0, "pass --avg_checkpoints=k"),
         "dlm_mask_init": ("--stage=dlm", lambda c: c.stage == DLM_STAGE, "pass --stage=dlm"),
         "dlm_shift": ("--stage=dlm", lambda c: c.stage == DLM_STAGE, "pass --stage=dlm")}


def check_applies(cfg, overrides):
    """A flag given for something this run does not do (--kd_logits in stage 2: no distillation
    happens) is refused, not ignored: one line naming the flag and what it needs."""
    for key, (what, on, fix) in NEEDS.items():
        if key in overrides and not on(cfg):
            die(f"--{key}={overrides[key]} acts only under {what}, which this run does not use: "
                f"{fix}, or drop --{key}", 2)


def pretrained_run(overrides):
    """Whether this run trains a pretrained model: --init_from or --teacher is one, or a stage 2/3
    continuing a checkpoint in a model's tokenizer (--init_from=auto: train.py passes the previous
    stage's; or the checkpoint named, whose vocabulary check_fits holds to --tokenizer's). Stage 1
    and --init_from=scratch keep their own."""
    named = (overrides.get("init_from"), overrides.get("teacher", "").split(",")[0])
    after = overrides.get("stage", TrainConfig.stage) in (2, 3) and \
        overrides.get("init_from", "auto") != "scratch"
    return any(is_model_source(m or "") for m in named) or \
        (after and is_model_source(overrides.get("tokenizer", "")))


def check_config(cfg):
    """Every field's range in one place, checked before any data is tokenised or any model built: a
    value that would train nonsense (a negative lr, no layers, a NaN) stops here with one line
    naming the flag."""
    if cfg.tokenizer not in TOKENIZERS and not is_model_source(cfg.tokenizer):
        die(f"--tokenizer={cfg.tokenizer}: expected byte, gpt2, or a pretrained model's (a Hugging "
            "Face directory, a hub id or a .gguf file; by default --init_from's)", 2)
    choices = dict(stage=(1, 2, 3, DLM_STAGE),
                   distill_preset=("logits", "summarization", "classification"),
                   optimizer=("muon", "adamw"), muon_adjust_lr=("original", "match_rms_adamw"),
                   schedule=("cosine", "wsd", "moderate", "constant"),
                   data_order=("sequential", "shuffle", "curriculum"),
                   dtype=("auto", "float32", "bfloat16", "float16"),
                   compile=("auto", "true", "false"), dlm_mask_init=("mean", "random"),
                   muon_state=("fp32", "linear8", "dynamic8"), subln_gain=("unit", "calibrated"))
    for key, valid in choices.items():
        if getattr(cfg, key) not in valid:
            die(f"--{key}={getattr(cfg, key)}: expected one of {', '.join(map(str, valid))}", 2)
    at_least = dict(n_layer=1, n_head=1, n_embd=1, block_size=1, batch_size=1, grad_accum=1,
                    max_iters=0, eval_interval=1, eval_iters=1, log_interval=1, warmup_steps=0,
                    lambda_warmup_steps=0, checkpoint_interval=0, keep_last=1, max_bad_steps=1,
                    seed=0, distill_relation_heads=1, avg_checkpoints=0, avg_interval=0)
    for key, low in at_least.items():
        if getattr(cfg, key) < low:
            die(f"--{key}={getattr(cfg, key)}: expected an integer >= {low}", 2)
    if cfg.seed >= 2**32:
        die(f"--seed={cfg.seed}: expected an integer below 2**32 (numpy's limit)", 2)
    ranges = dict(lr=("> 0", lambda v: v > 0), muon_lr=("> 0", lambda v: v > 0),
                  min_lr_frac=("in [0, 1]", lambda v: 0 <= v <= 1),
                  decay_frac=("in [0, 1]", lambda v: 0 <= v <= 1),
                  weight_decay=(">= 0", lambda v: v >= 0),
                  beta1=("in [0, 1)", lambda v: 0 <= v < 1),
                  beta2=("in [0, 1)", lambda v: 0 <= v < 1),
                  zclip_z_thresh=("> 0", lambda v: v > 0), grad_clip=(">= 0", lambda v: v >= 0),
                  two_phase_lr_drop=("in (0, 1]", lambda v: 0 < v <= 1),
                  kd_logits=(">= 0, or -1 for the preset's", lambda v: v >= 0 or v == -1),
                  kd_relation=(">= 0, or -1 for the preset's", lambda v: v >= 0 or v == -1),
                  distill_tau=("> 0", lambda v: v > 0), kd_hidden=(">= 0", lambda v: v >= 0),
                  avg_alpha=("in [0, 1]", lambda v: 0 <= v <= 1),
                  qk_clip_tau=(">= 0", lambda v: v >= 0))
    for key, (what, ok) in ranges.items():
        v = getattr(cfg, key)
        if not (math.isfinite(v) and ok(v)):
            die(f"--{key}={v}: expected a finite number {what}", 2)
    q = cfg.quant_start
    if not (math.isfinite(q) and q >= 0 and (q < 1 or q.is_integer())):
        die(f"--quant_start={cfg.quant_start}: expected a fraction of max_iters in [0, 1) or a "
            "whole step >= 1", 2)
    # the step it stands for, and that it comes before max_iters: train.py (quant_start_step,
    # check_quant_start)
    if cfg.quant_start and cfg.stage != 2:
        die(f"--quant_start={cfg.quant_start} switches a stage-2 run from 16-bit to ternary; stage "
            f"{cfg.stage} has no such switch (stage 1 is full precision throughout, stage 3 "
            "ternary throughout)", 2)
    if cfg.subln_gain == "calibrated" and not cfg.resume and not cfg.subln:
        die("--subln_gain=calibrated sets the gains of the SubLN norms, and --subln=False has "
            "none; drop one of the two", 2)
    if cfg.subln_gain == "calibrated" and not cfg.resume and not is_model_source(cfg.init_from):
        die("--subln_gain=calibrated measures the SubLN gains inserted into a pretrained model "
            f"(--init_from=<a model>); --init_from={cfg.init_from} inserts none to measure (a "
            "checkpoint's SubLN keeps its gains, one inserted into a checkpoint starts at 1); "
            "drop --subln_gain", 2)
    if (cfg.normuon or cfg.muon_state != "fp32") and cfg.optimizer != "muon":
        die(f"--normuon / --muon_state change Muon; --optimizer={cfg.optimizer} has no Muon", 2)
    # one directory inside --out_dir: a path (a/b/../../..) would put the run, and its --overwrite, elsewhere
    if cfg.run_name and (cfg.run_name in (".", "..") or any(s in cfg.run_name for s in ("/", os.sep, "\0"))):
        die(f"--run_name={cfg.run_name}: expected a name, one directory inside --out_dir (no '/', not . or ..); "
            "to write elsewhere, pass --out_dir", 2)
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        die(f"--n_embd={cfg.n_embd} must split into --n_head={cfg.n_head} heads of even size (RoPE "
            "rotates pairs)", 2)
    check_device(cfg.device)
    parse_data(cfg.data)


def teacher_paths(cfg):
    """Stage 3's teacher checkpoints: --teacher split at commas; "" = the stage-1 run of this
    out_dir."""
    return [p for p in cfg.teacher.split(",") if p] or [os.path.join(cfg.out_dir, "stage1",
                                                                     "ckpt.pt")]


def check_run(cfg, rt, out_dir, teachers):
    """Refuse, before anything is loaded or written, a batch split that does not divide, a stage 3
    without its teachers, or an out_dir that cannot be written."""
    world = rt.world
    if cfg.grad_accum % world and cfg.resume:  # the checkpoint's batch split: another would be refused
        die(f"--grad_accum={cfg.grad_accum} (the resumed run's) counts the micro-batches of one step over "
            f"all ranks, and {world} ranks do not divide it; a resumed run keeps its --batch_size and "
            f"--grad_accum, so resume it on a number of processes that divides {cfg.grad_accum} (1 does)", 2)
    if cfg.grad_accum % world:
        seqs = cfg.batch_size * cfg.grad_accum  # a step's sequences, kept by a smaller micro-batch
        k = next((k for k in range(world, seqs + 1, world) if seqs % k == 0), None)
        same = f", or --batch_size={seqs // k} --grad_accum={k} for the same {seqs} sequences a " \
            f"step" if k else ""
        die(f"--grad_accum={cfg.grad_accum} counts the micro-batches of one step over all {world} "
            f"ranks, so it must be a multiple of {world}; pass "
            f"--grad_accum={world * max(1, cfg.grad_accum // world)}{same}", 2)
    if world > 1 and cfg.stage == DLM_STAGE:
        die("--stage=dlm runs in one process here (its loss calls the model directly, not the DDP "
            "wrapper)", 2)
    if world > 1 and (cfg.normuon or cfg.muon_state != "fp32" or cfg.qk_clip_tau > 0 or cfg.log_max_logit):
        die("--normuon, --muon_state, --qk_clip_tau and --log_max_logit run in one process here (each "
            "rank would record its own max logits, and the variants' step is not shared out); use plain "
            "Muon with torchrun",
            2)
    for path in teachers if cfg.stage == 3 else []:
        if not os.path.exists(path) and not is_model_source(path):
            die(f"stage 3 needs the full-precision teacher at {path}; make it with: python "
                "train.py --stage=1")
    if cfg.stage == 3:
        parse_teacher_weights(cfg, len(teachers))
    check_inputs_kept(cfg, out_dir)
    try:
        if rt.master:
            checkpoint.check_writable(out_dir)
    except OSError as e:
        die(f"cannot write to {out_dir}: {e.strerror}; pass a writable --out_dir")


def parse_teacher_weights(cfg, n):
    """--teacher_weights as n floats >= 0 with a positive sum, or None (equal weights)."""
    if not cfg.teacher_weights:
        return None
    try:
        w = [float(x) for x in cfg.teacher_weights.split(",")]
    except ValueError:
        w = []
    if len(w) != n or not all(math.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        die(f"--teacher_weights={cfg.teacher_weights}: expected {n} comma-separated numbers >= 0 "
            "with a positive sum, one per --teacher", 2)
    return w


def check_inputs_kept(cfg, out_dir):
    """A run writes nothing into what it reads (its pretrained model, shards, teachers), and
    --overwrite=True never deletes one of its inputs (a checkpoint of the earlier run in out_dir
    given as --init_from or --teacher)."""
    inputs = outputs.config_inputs(dataclasses.asdict(cfg), cfg.tokenizer)  # stage 3's teachers too
    outputs.check_not_input("--out_dir", out_dir, inputs)
    for name in checkpoint.existing_run(out_dir) if cfg.overwrite and not cfg.resume else []:
        path = os.path.join(out_dir, name)
        for what, p in inputs:
            if os.path.isfile(p) and os.path.samefile(p, path):
                die(f"{what.replace('the run', 'this run', 1)}: {p} is {path}, a file of the "
                    f"earlier run in {out_dir}, which --overwrite=True would delete; copy it "
                    "elsewhere and start from the copy, or pass another --out_dir or --run_name", 2)


# What a resumed run cannot change: the state it saved was made under these, and continuing under
# others would
# silently be another run (the seed orders the data; the 8-bit codes need their own map; the average
# holds
# snapshots taken at its own steps; the diffusion objective is fixed by its mask token and shift).
FIXED_ON_RESUME = ("seed", "muon_state", "normuon", "avg_checkpoints", "avg_interval", "avg_alpha",
                   "dlm_mask_init", "dlm_shift",
                   # the loader's position counts windows of block_size + 1 tokens, and
                   "block_size", "batch_size",
                   # draws the source of batch_size rows a batch: under others it would not continue
                   # where it stopped
                   "doc_mask",  # the attention the saved weights were trained with
                   # where the run started: a resumed run starts from its checkpoint
                   "init_from", "subln_gain")


# the tokenizer and the model shape: checkpoint.check_fits (a model's architecture:
# start.adopt_architecture); the
# data and its order: the loader's state (data.DataLoader.load_state_dict); --subln:
# checkpoint.load_weights.
# Flags a resumed run honours from its next step but that make it another run than the one saved:
# said in the log
# (every flag not listed here or below); flags that only say where and how it runs, logs and saves:
# not said.
NOT_SAID_ON_RESUME = ("resume", "out_dir", "run_name", "device", "compile", "log_interval",
                      "wandb_project", "eval_interval", "eval_iters", "eval_whole",
                      "checkpoint_interval", "keep_last", "max_bad_steps", "log_max_logit",
                      "tokenizer", "n_layer", "n_head", "n_embd", "pad_vocab", "subln",
                      # refused where they differ: see above (the optimizer: checkpoint.restore)
                      "data_order", "optimizer",
                      # their own notes: here, check_lambda_on_resume
                      "max_iters", "lambda_warmup_steps", "quant_start")


def check_resume(cfg, overrides, saved, path, step):
    """Refuse (one line) a resume that cannot be honoured; return a note for what it changes on
    purpose. cfg: the flags given on this command line alone (its stage names the directory it
    resumes); step: the checkpoint's."""
    if cfg.overwrite:
        die("--resume=True continues the run in its directory and --overwrite=True would delete "
            "it; pass one of them", 2)
    if overrides.get("max_iters", step) < step:  # it would train nothing and save over ckpt.pt
        die(f"--max_iters={overrides['max_iters']} is below the step of {path}, {step}: a resumed run "
            f"only goes on; pass --max_iters={step} or more (or start a new run)", 2)
    if saved.get("stage") != cfg.stage:
        was, now = (("dlm" if st == DLM_STAGE else st) for st in (saved.get("stage"), cfg.stage))
        die(f"{path} is a checkpoint of stage {was}, but this is --stage={now}; resume it with "
            f"--stage={was} (and its --run_name), or start stage {now} without --resume", 2)
    tok = saved.get("tokenizer", TrainConfig.tokenizer)
    if "tokenizer" not in overrides and tok not in TOKENIZERS and not is_model_source(tok):
        die(f"{path} was trained with the tokenizer of {tok}, which is not there; put that file "
            "back, or pass --tokenizer=<where that model is now> (the same model: its fingerprint "
            "is checked)",
            2)
    for key in FIXED_ON_RESUME:
        if key in overrides and overrides[key] != saved.get(key, getattr(TrainConfig, key)):
            die(f"--{key}={overrides[key]} differs from the run's --{key}={saved.get(key)} saved "
                f"in {path}, and a resumed run cannot change it; drop the flag to continue the "
                "run, or start a new run with --run_name=<name>", 2)
    notes = []
    if "max_iters" in overrides and overrides["max_iters"] != saved.get("max_iters"):
        notes.append(f"--max_iters changed from {saved.get('max_iters')} to "
                     f"{overrides['max_iters']}: the LR schedule (and a fractional --quant_start) "
                     "now follow the new length, so this is not the run it would have been")
    was = {k: saved.get(k, getattr(TrainConfig, k)) for k in overrides}
    changed = [f"--{k}={v} (was {was[k]})" for k, v in overrides.items()
               if k not in FIXED_ON_RESUME + NOT_SAID_ON_RESUME and v != was[k]]
    if changed:
        notes.append(f"resuming with {', '.join(changed)}: the run continues under the new "
                     f"value(s) from its next step, so it is no longer the run saved in {path}")
    return "; ".join(notes)
