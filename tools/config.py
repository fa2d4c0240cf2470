"""
The training run's flags: one dataclass of defaults (each field's comment is its --help line), presets as small
dicts of overrides, and every check that needs only the flags.

  defaults (TrainConfig) -> device preset (cpu | cuda) -> stage preset (1 | 2 | 3 | dlm) -> command line

TrainConfig's fields, in order: CoreFlags' (recipe, model, optimizer, data, run) below, then the lessons'
(tools/seams.py's LessonFlags, beside the seams they fill). `python train.py --help` lists every field with its
default and comment. The schedules the fields describe (lr, lambda, continual QAT) are in train.py, where the
step uses them, with the check of --quant_start against the run's length.
Test: python -m pytest tests/test_train.py tests/test_flags.py
"""

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from model import GPTConfig
from tokenizer import TOKENIZERS
from tools import checkpoint, outputs
from tools.load import is_model_source
from tools.flags import die, parse, to_bool
from tools.seams import DLM_STAGE, LessonFlags

@dataclass
class CoreFlags:
    """train.py's own flags, in five groups; each field's comment is its --help line."""
    # recipe: which stage, where it starts, and how it goes ternary (train.py's schedules; tools/start.py)
    stage: int = 2               # 1 = fp pre-training, 2 = ternary continued pre-training, 3 = distillation,
                                 # dlm = the stage-2 model converted to a masked-diffusion LM (lessons/dlm.py)
    init_from: str = "auto"      # auto: stage 2 <- stage-1 ckpt if present, else scratch; stage 3 <- stage-2 ckpt;
                                 # or a path (stage 1: an fp checkpoint, SubLN is inserted if it has none); or "scratch"
    lambda_warmup_steps: int = 200  # stage 2: lambda goes 0 -> 1 linearly over this many steps (cpu: 600)
    quant_start: float = 0.0     # stage 2: full precision until this step (>= 1) or fraction of max_iters (< 1),
                                 # then ternary, lambda ramping from there (continual QAT, arXiv 2502.11895)
    # recipe, stage 3: BitDistill (distill.py), L = CE + kd_logits * logits KD + kd_relation * relation KD + ...
    teacher: str = ""            # teacher checkpoint(s), "a.pt" or "a.pt,b.pt"; "" = <out_dir>/stage1/ckpt.pt
    teacher_weights: str = ""    # several teachers: weights of their logits mixture, "0.7,0.3"; "" = equal
    distill_preset: str = "logits"  # kd_logits 1, kd_relation 0 (measured best here); the paper's summarization:
                                    # kd_logits 1, kd_relation 1e3; classification: kd_logits 10, kd_relation 1e5
    kd_logits: float = -1.0      # weight of the logits KD; -1 = the preset's
    kd_relation: float = -1.0    # weight of the attention-relation KD; -1 = the preset's
    kd_hidden: float = 0.0       # weight of the hidden-state KD (0 = off)
    distill_tau: float = 5.0     # logits-KD temperature
    distill_layer: int = -1      # layer whose Q/K/V relations are distilled; negative counts from the end
    distill_relation_heads: int = 4  # A_r; the paper's 32 needs H*d >= 32*d_r, too many for a 128-wide model
    # model
    n_layer: int = 4             # transformer blocks
    n_head: int = 4              # attention heads (head size = n_embd / n_head)
    n_embd: int = 128            # model width
    block_size: int = 256        # context length in tokens
    subln: bool = True           # SubLN: an RMSNorm before each attention output and FFN down projection (BitDistill)
    doc_mask: bool = False       # attend within documents only (model.document_mask)
    pad_vocab: bool = False      # round the vocabulary up to a multiple of 64 (faster matmuls on GPU)
    # optimizer: lr schedule, weight decay, clipping
    optimizer: str = "muon"      # muon (Muon for hidden matrices, AdamW for the rest) or adamw (AdamW for all)
    lr: float = 3e-3             # peak learning rate of AdamW (embeddings, head, norms; everything with adamw);
                                 # stage 2 on CPU: 2e-2 (the cpu-stage2 preset, measured in lab/results/lr.md)
    muon_lr: float = 3e-3        # peak Muon lr; Moonlight's match_rms_adamw scaling makes it comparable to AdamW's
    muon_adjust_lr: str = "match_rms_adamw"  # or "original" (Keller Jordan: lr * sqrt(max(1, rows/cols)), lr ~0.02)
    schedule: str = "wsd"        # cosine (nanoGPT), wsd (warmup-stable-decay, MiniCPM), constant (after warmup),
                                 # or moderate: wsd to min_lr_frac 1/3 (Luo et al.'s "moderate decay")
    warmup_steps: int = 50       # linear lr warmup steps
    decay_frac: float = 0.2      # wsd: decay over the last 20% of steps
    min_lr_frac: float = 0.1     # final lr = min_lr_frac * lr
    two_phase: bool = False      # BitNet recipe: at mid-training, lr x two_phase_lr_drop and weight decay -> 0
    two_phase_lr_drop: float = 0.5  # --two_phase: lr multiplier of the second half
    weight_decay: float = 0.1    # decoupled weight decay of matrices and embeddings (not of norm gains)
    beta1: float = 0.9           # AdamW beta1
    beta2: float = 0.95          # AdamW beta2
    zclip: bool = True           # ZClip adaptive clipping (zclip.py); False = clip_grad_norm_ at grad_clip
    zclip_z_thresh: float = 2.5  # ZClip: a gradient norm this many std above its EMA mean is a spike
    grad_clip: float = 1.0       # fixed max grad norm when zclip=False; 0 = no clipping at all
    # data
    tokenizer: str = "byte"      # byte (257 ids), gpt2 (50257 ids), or a pretrained model's (default: --init_from's)
    data: str = ""               # shard dir or shipped corpus (shakespeare, python), or "dirA:0.7,python:0.3" to mix;
                                 # "" = shakespeare
    data_order: str = "shuffle"  # shuffle | sequential | curriculum (easy-to-hard over this run's rows);
                                 # shuffle beats sequential by 0.17 val loss on the quick start (python -m lab order)
    batch_size: int = 16         # sequences per micro-batch
    grad_accum: int = 1          # micro-batches per optimizer step
    # run: length, evaluation, logs, checkpoints, where and how it runs
    max_iters: int = 600         # optimizer steps of the run
    seed: int = 1337             # seeds the weights, the data order and every random draw
    eval_interval: int = 200     # steps between evaluations (each also writes a checkpoint)
    eval_iters: int = 20         # batches per source at each evaluation
    eval_whole: bool = True      # the final evaluation reads every window of the val split once
    log_interval: int = 1        # steps between log lines
    wandb_project: str = ""      # also log every metrics.jsonl record to this Weights & Biases project (rank 0)
    out_dir: str = "out"         # checkpoints and metrics go to <out_dir>/stage<N>/
    run_name: str = ""           # output subdirectory of out_dir; "" = stage<N>
    resume: bool = False         # continue from <out_dir>/stage<N>/ckpt.pt
    overwrite: bool = False      # start afresh in an out_dir that holds another run, deleting its checkpoints
    checkpoint_interval: int = 0  # also checkpoint every N steps; 0 = at evals and at the end only
    keep_last: int = 1           # numbered checkpoints ckpt_<step>.pt kept; ckpt.pt always names the newest
    max_bad_steps: int = 10      # this many non-finite steps in a row: save and stop
    device: str = "auto"         # auto = cuda if available, else cpu; also picks the device preset below
    dtype: str = "auto"          # auto = bfloat16 autocast on cuda, float32 on cpu; or float32, bfloat16, float16
    compile: str = "auto"        # auto = on for cuda only; true / false (also 1/0, yes/no, on/off)
    fsdp: bool = False           # under torchrun: FSDP2 shards params, grads and optimizer state (else DDP)


@dataclass
class TrainConfig(LessonFlags, CoreFlags):
    """Every flag of train.py: CoreFlags' above, then the lessons' (tools/seams.py, each beside the seam it fills).
    A dataclass orders the fields of its bases from the last base to the first: CoreFlags' come first."""


# Renamed flags, {old: new}: an old name on the command line stops with its new one (tools/flags.py), and a
# checkpoint's config saved under an old name resumes under the new one (build_config).
RENAMED = {"distill_lambda": "kd_logits", "distill_gamma": "kd_relation", "distill_hidden": "kd_hidden",
           "warmup_iters": "warmup_steps"}

DEVICE_PRESETS = {
    "cpu": dict(),  # the defaults above are the CPU quick start
    # 8 x 8 sequences of 1024 = 65,536 tokens a step on 1, 2, 4 or 8 GPUs alike (grad_accum counts all ranks)
    "cuda": dict(tokenizer="gpt2", n_layer=12, n_head=12, n_embd=768, block_size=1024, pad_vocab=True,
                 batch_size=8, grad_accum=8, max_iters=5000, eval_interval=500, eval_iters=50,
                 log_interval=10, warmup_steps=200, lambda_warmup_steps=1000, lr=1.5e-3),
}
SCHEDULE_PRESETS = {  # --schedule=moderate: WSD decaying only to 1/3 of the peak (Luo et al., arXiv 2511.18903:
    "moderate": dict(min_lr_frac=1 / 3),  # 3e-3 -> 1e-3), unless --min_lr_frac is also given
}
# the CPU quick start (stage 2): the lr the lr table chose over 2e-3..4e-2, and the lambda warm-up the warmup table
# chose over 0..600 steps at that lr (3 seeds each, lab/results/lr.md, warmup.md): lambda reaches 1 at step 600,
# the run's last; the other stages and the CUDA preset keep theirs (not swept)
DEVICE_STAGE_PRESETS = {("cpu", 2): dict(lr=2e-2, muon_lr=2e-2, lambda_warmup_steps=600)}
# a pretrained model (--init_from or --teacher a model, or stage 2/3 after a stage that began from one): AdamW at
# 1e-4, the SmolLM2 table's setting (lab/results/smollm2-notes.md; not swept). The from-scratch presets above undo
# a trained model within a few steps, and on CPU Muon doubles its step (lab/results/smollm2-speed.md).
PRETRAINED_PRESET = dict(optimizer="adamw", lr=1e-4)
STAGE_PRESETS = {
    1: dict(schedule="cosine"),
    2: dict(schedule="wsd"),
    3: dict(schedule="cosine"),
    DLM_STAGE: dict(schedule="wsd"),
}
STAGE_NAMES = {"dlm": DLM_STAGE}

def parse_args(argv):
    """--key=value pairs checked against TrainConfig's field types (tools/flags.py); --stage also takes dlm, and
    --compile auto or a boolean. --help prints every field with its default and comment, and exits 0."""
    def stage(v):
        if v in STAGE_NAMES or v in ("1", "2", "3"):
            return STAGE_NAMES.get(v) or int(v)
        raise ValueError("expected 1, 2, 3 or dlm")

    def compile_(v):
        if v.lower() == "auto":
            return "auto"
        try:
            return str(to_bool(v)).lower()
        except ValueError:
            raise ValueError("expected auto, true or false (also 1/0, yes/no, on/off)") from None
    return parse(argv, TrainConfig, USAGE, convert=dict(stage=stage, compile=compile_), renamed=RENAMED)


USAGE = """python train.py [--key=value ...]: train a ternary (BitNet b1.58) model; stage 1 fp, 2 ternary, 3 distill.
  python train.py --stage=2                         the CPU quick start (byte tokenizer, Shakespeare, ~4 min)
  python train.py --stage=2 --resume=True           continue a stopped run exactly
  torchrun --standalone --nproc_per_node=8 train.py --stage=2     (DDP; --fsdp=True shards)
Order of defaults: TrainConfig (shown below), then the device preset, the stage preset
(stage 1 and 3: --schedule=cosine; 2 and dlm: wsd; stage 2 on cpu: --lr=2e-2 --muon_lr=2e-2
--lambda_warmup_steps=600), a pretrained model's (--init_from or --teacher a model: --optimizer=adamw
--lr=1e-4), then the flags given. The cuda preset sets:
  """ + " ".join(f"--{k}={v}" for k, v in DEVICE_PRESETS["cuda"].items())


def pretrained_run(overrides):
    """Whether this run trains a pretrained model: --init_from or --teacher is one, or a stage 2/3 continuing a
    checkpoint in a model's tokenizer (--init_from=auto: train.py passes the previous stage's; or the checkpoint
    named, whose vocabulary check_fits holds to --tokenizer's). Stage 1 and --init_from=scratch keep their own."""
    named = (overrides.get("init_from"), overrides.get("teacher", "").split(",")[0])
    after = overrides.get("stage", TrainConfig.stage) in (2, 3) and overrides.get("init_from", "auto") != "scratch"
    return any(is_model_source(m or "") for m in named) or (after and is_model_source(overrides.get("tokenizer", "")))


def build_config(overrides, base=None):
    """Defaults + device preset + stage preset + overrides; or, on resume, the saved config + overrides."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = {RENAMED.get(k, k): v for k, v in (base or {}).items() if RENAMED.get(k, k) in known}  # old names: new
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
    if not base and "tokenizer" not in overrides:  # a pretrained model brings its own tokenizer
        model = next((m for m in (overrides.get("init_from"), overrides.get("teacher", "").split(",")[0])
                      if is_model_source(m)), None)
        cfg["tokenizer"] = model or cfg.get("tokenizer", TrainConfig.tokenizer)
    if cfg.get("tokenizer") not in TOKENIZERS and os.path.exists(cfg.get("tokenizer", "")):
        cfg["tokenizer"] = os.path.abspath(cfg["tokenizer"])  # what a checkpoint records: readable from anywhere
    cfg = TrainConfig(**cfg)
    check_config(cfg)
    return cfg


def check_config(cfg):
    """Every field's range in one place, checked before any data is tokenised or any model built: a value
    that would train nonsense (a negative lr, no layers, a NaN) stops here with one line naming the flag."""
    if cfg.tokenizer not in TOKENIZERS and not is_model_source(cfg.tokenizer):
        die(f"--tokenizer={cfg.tokenizer}: expected byte, gpt2, or a pretrained model's (a Hugging Face directory, "
            f"a hub id or a .gguf file; by default --init_from's)", 2)
    choices = dict(stage=(1, 2, 3, DLM_STAGE), distill_preset=("logits", "summarization", "classification"),
                   optimizer=("muon", "adamw"), muon_adjust_lr=("original", "match_rms_adamw"),
                   schedule=("cosine", "wsd", "moderate", "constant"), data_order=("sequential", "shuffle", "curriculum"),
                   dtype=("auto", "float32", "bfloat16", "float16"), compile=("auto", "true", "false"),
                   dlm_mask_init=("mean", "random"), muon_state=("fp32", "linear8", "dynamic8"),
                   subln_gain=("unit", "calibrated"))
    for key, valid in choices.items():
        if getattr(cfg, key) not in valid:
            die(f"--{key}={getattr(cfg, key)}: expected one of {', '.join(map(str, valid))}", 2)
    at_least = dict(n_layer=1, n_head=1, n_embd=1, block_size=1, batch_size=1, grad_accum=1, max_iters=0,
                    eval_interval=1, eval_iters=1, log_interval=1, warmup_steps=0, lambda_warmup_steps=0,
                    checkpoint_interval=0, keep_last=1, max_bad_steps=1, seed=0, distill_relation_heads=1,
                    avg_checkpoints=0, avg_interval=0)
    for key, low in at_least.items():
        if getattr(cfg, key) < low:
            die(f"--{key}={getattr(cfg, key)}: expected an integer >= {low}", 2)
    if cfg.seed >= 2**32:
        die(f"--seed={cfg.seed}: expected an integer below 2**32 (numpy's limit)", 2)
    ranges = dict(lr=("> 0", lambda v: v > 0), muon_lr=("> 0", lambda v: v > 0),
                  min_lr_frac=("in [0, 1]", lambda v: 0 <= v <= 1), decay_frac=("in [0, 1]", lambda v: 0 <= v <= 1),
                  weight_decay=(">= 0", lambda v: v >= 0), beta1=("in [0, 1)", lambda v: 0 <= v < 1),
                  beta2=("in [0, 1)", lambda v: 0 <= v < 1), zclip_z_thresh=("> 0", lambda v: v > 0),
                  grad_clip=(">= 0", lambda v: v >= 0), two_phase_lr_drop=("in (0, 1]", lambda v: 0 < v <= 1),
                  kd_logits=(">= 0, or -1 for the preset's", lambda v: v >= 0 or v == -1),
                  kd_relation=(">= 0, or -1 for the preset's", lambda v: v >= 0 or v == -1),
                  distill_tau=("> 0", lambda v: v > 0), kd_hidden=(">= 0", lambda v: v >= 0),
                  avg_alpha=("in [0, 1]", lambda v: 0 <= v <= 1), qk_clip_tau=(">= 0", lambda v: v >= 0))
    for key, (what, ok) in ranges.items():
        v = getattr(cfg, key)
        if not (math.isfinite(v) and ok(v)):
            die(f"--{key}={v}: expected a finite number {what}", 2)
    if not (math.isfinite(cfg.quant_start) and cfg.quant_start >= 0 and (cfg.quant_start < 1 or cfg.quant_start.is_integer())):
        die(f"--quant_start={cfg.quant_start}: expected a fraction of max_iters in [0, 1) or a whole step >= 1", 2)
    # the step it stands for, and that it comes before max_iters: train.py (quant_start_step, check_quant_start)
    if cfg.quant_start and cfg.stage != 2:
        die(f"--quant_start={cfg.quant_start} switches a stage-2 run from 16-bit to ternary; stage {cfg.stage} has "
            f"no such switch (stage 1 is full precision throughout, stage 3 ternary throughout)", 2)
    if cfg.subln_gain == "calibrated" and not cfg.resume and not cfg.subln:
        die("--subln_gain=calibrated sets the gains of the SubLN norms, and --subln=False has none; drop one of the "
            "two", 2)
    if cfg.subln_gain == "calibrated" and not cfg.resume and not is_model_source(cfg.init_from):
        die(f"--subln_gain=calibrated measures the SubLN gains inserted into a pretrained model (--init_from=<a "
            f"model>); --init_from={cfg.init_from} inserts none to measure (a checkpoint's SubLN keeps its gains, one "
            f"inserted into a checkpoint starts at 1); drop --subln_gain", 2)
    if (cfg.normuon or cfg.muon_state != "fp32") and cfg.optimizer != "muon":
        die(f"--normuon / --muon_state change Muon; --optimizer={cfg.optimizer} has no Muon", 2)
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        die(f"--n_embd={cfg.n_embd} must split into --n_head={cfg.n_head} heads of even size (RoPE rotates pairs)", 2)
    dev = cfg.device.split(":")
    if dev[0] not in ("cpu", "cuda") or len(dev) > 2 or (len(dev) == 2 and not dev[1].isdigit()):
        die(f"--device={cfg.device}: expected auto, cpu, cuda or cuda:<index>", 2)
    if dev[0] == "cuda" and not torch.cuda.is_available():
        die(f"--device={cfg.device}: no CUDA device here; use --device=cpu", 2)
    if len(dev) == 2 and int(dev[1]) >= torch.cuda.device_count():
        die(f"--device={cfg.device}: this machine has {torch.cuda.device_count()} CUDA device(s)", 2)
    parse_data(cfg.data)


def parse_data(spec):
    """--data: "" (the shipped corpus), a shard directory, or "dirA:0.7,dirB:0.3" to mix by weight.
    Returns {directory: weight}; every source has a finite weight > 0, or none has one (equal weights)."""
    if not spec:
        return {}
    items = [item.rpartition(":") if ":" in item else ("", "", item) for item in spec.split(",")]
    if any(not sep for _, sep, _ in items) and any(sep for _, sep, _ in items):
        die(f"--data={spec}: give every source a weight (dirA:0.7,dirB:0.3) or none (equal weights)", 2)
    sources = {}
    for path, sep, w in items:
        path, w = (path, w) if sep else (w, "1")
        try:
            weight = float(w)
        except ValueError:
            weight = float("nan")
        if not path or not (math.isfinite(weight) and weight > 0):
            die(f"--data={spec}: {path or '(empty)'}:{w} needs a directory and a finite weight > 0", 2)
        if path in sources:
            die(f"--data={spec}: {path} is named twice; give each source once, with its whole weight", 2)
        sources[path] = weight
    return sources


def model_config(cfg, vocab_size, eot):
    if cfg.pad_vocab:
        vocab_size = 64 * math.ceil(vocab_size / 64)
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd, quant=cfg.stage >= 2, subln=cfg.subln, doc_mask=cfg.doc_mask, eot=eot)


def stage_dir(stage):
    """out_dir's subdirectory of a stage: stage1, stage2, stage3, dlm."""
    return "dlm" if stage == DLM_STAGE else f"stage{stage}"


def teacher_paths(cfg):
    """Stage 3's teacher checkpoints: --teacher split at commas; "" = the stage-1 run of this out_dir."""
    return [p for p in cfg.teacher.split(",") if p] or [os.path.join(cfg.out_dir, "stage1", "ckpt.pt")]


def parse_teacher_weights(cfg, n):
    """--teacher_weights as n floats >= 0 with a positive sum, or None (equal weights)."""
    if not cfg.teacher_weights:
        return None
    try:
        w = [float(x) for x in cfg.teacher_weights.split(",")]
    except ValueError:
        w = []
    if len(w) != n or not all(math.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        die(f"--teacher_weights={cfg.teacher_weights}: expected {n} comma-separated numbers >= 0 with a positive "
            f"sum, one per --teacher", 2)
    return w


def check_run(cfg, rt, out_dir, teachers):
    """Refuse, before anything is loaded or written, a batch split that does not divide, a stage 3 without its
    teachers, or an out_dir that cannot be written."""
    world = rt.world
    if cfg.grad_accum % world:
        seqs = cfg.batch_size * cfg.grad_accum  # a step's sequences, kept by a smaller micro-batch
        k = next((k for k in range(world, seqs + 1, world) if seqs % k == 0), None)
        same = f", or --batch_size={seqs // k} --grad_accum={k} for the same {seqs} sequences a " \
            f"step" if k else ""
        die(f"--grad_accum={cfg.grad_accum} counts the micro-batches of one step over all {world} "
            f"ranks, so it must be a multiple of {world}; pass "
            f"--grad_accum={world * max(1, cfg.grad_accum // world)}{same}", 2)
    if world > 1 and cfg.stage == DLM_STAGE:
        die("--stage=dlm runs in one process here (its loss calls the model directly, not the DDP wrapper)", 2)
    if world > 1 and (cfg.normuon or cfg.muon_state != "fp32" or cfg.qk_clip_tau > 0):
        die("--normuon, --muon_state and --qk_clip_tau run in one process here (each rank would record its own "
            "max logits, and the variants' step is not shared out); use plain Muon with torchrun", 2)
    for path in teachers if cfg.stage == 3 else []:
        if not os.path.exists(path) and not is_model_source(path):
            die(f"stage 3 needs the full-precision teacher at {path}; make it with: python train.py --stage=1")
    if cfg.stage == 3:
        parse_teacher_weights(cfg, len(teachers))
    check_inputs_kept(cfg, out_dir, teachers)
    try:
        if rt.master:
            checkpoint.check_writable(out_dir)
    except OSError as e:
        die(f"cannot write to {out_dir}: {e.strerror}; pass a writable --out_dir")


def check_inputs_kept(cfg, out_dir, teachers):
    """A run writes nothing into what it reads (its pretrained model, shards, teachers), and --overwrite=True
    never deletes one of its inputs (a checkpoint of the earlier run in out_dir given as --init_from or --teacher)."""
    inputs = outputs.config_inputs(dataclasses.asdict(cfg), cfg.tokenizer)
    inputs += [("this run's --teacher", t) for t in teachers if os.path.exists(t) and cfg.stage == 3]
    outputs.check_not_input("--out_dir", out_dir, inputs)
    for name in checkpoint.existing_run(out_dir) if cfg.overwrite and not cfg.resume else []:
        path = os.path.join(out_dir, name)
        for what, p in inputs:
            if os.path.isfile(p) and os.path.samefile(p, path):
                die(f"{what.replace('the run', 'this run', 1)}: {p} is {path}, a file of the earlier run in "
                    f"{out_dir}, which --overwrite=True would delete; copy it elsewhere and start from the copy, or "
                    f"pass another --out_dir or --run_name", 2)


def check_teacher(cfg, crit, s, t, path, first=True):
    """Stage 3 settings that only fail at the first step, refused before training: another vocabulary, a
    --distill_layer outside either model, relation heads that do not divide both widths, a context longer
    than the teacher's. Only the first teacher gives relations and hidden states (first=False: the others)."""
    if t.vocab_size != s.vocab_size:
        die(f"{path}: teacher vocabulary {t.vocab_size} != student {s.vocab_size}; the same --tokenizer is needed")
    try:
        crit.layer_index(s.n_layer), crit.layer_index(t.n_layer) if first else None
    except ValueError as e:  # --distill_layer outside one of the models
        die(str(e), 2)
    heads = crit.n_relation_heads
    widths = sorted({c.n_head * c.head_size() for c in (s, t)} | {c.kv_heads() * c.head_size() for c in (s, t)})
    if first and crit.kd_relation and any(w % heads for w in widths):  # q's width, and k's and v's under GQA
        fits = max(a for a in range(1, heads + 1) if all(w % a == 0 for w in widths))
        die(f"--distill_relation_heads={heads} must divide the widths of the student's and the teacher's q, k and v "
            f"({', '.join(map(str, widths))}); try --distill_relation_heads={fits}", 2)
    if cfg.block_size > t.block_size:
        die(f"--block_size={cfg.block_size} is longer than the teacher's context ({t.block_size} in {path}); pass "
            f"--block_size={t.block_size} or less", 2)


# What a resumed run cannot change: the state it saved was made under these, and continuing under others would
# silently be another run (the seed orders the data; the 8-bit codes need their own map; the average holds
# snapshots taken at its own steps; the diffusion objective is fixed by its mask token and shift).
FIXED_ON_RESUME = ("seed", "muon_state", "normuon", "avg_checkpoints", "avg_interval", "avg_alpha", "dlm_mask_init",
                   "dlm_shift",
                   "block_size", "batch_size",  # the loader's position counts windows of block_size + 1 tokens, and
                   # draws the source of batch_size rows a batch: under others it would not continue where it stopped
                   "doc_mask",  # the attention the saved weights were trained with
                   "init_from", "subln_gain")  # where the run started: a resumed run starts from its checkpoint
# the tokenizer and the model shape: checkpoint.check_fits (a model's architecture: start.adopt_architecture); the
# data and its order: the loader's state (data.DataLoader.load_state_dict); --subln: checkpoint.load_weights.
# Flags a resumed run honours from its next step but that make it another run than the one saved: said in the log
# (every flag not listed here or below); flags that only say where and how it runs, logs and saves: not said.
NOT_SAID_ON_RESUME = ("resume", "out_dir", "run_name", "device", "compile", "log_interval", "wandb_project",
                      "eval_interval", "eval_iters", "eval_whole", "checkpoint_interval", "keep_last", "max_bad_steps",
                      "log_max_logit",
                      "tokenizer", "n_layer", "n_head", "n_embd", "pad_vocab", "subln", "data_order",
                      "optimizer",  # refused where they differ: see above (the optimizer: checkpoint.restore)
                      "max_iters", "lambda_warmup_steps", "quant_start")  # their own notes: here, check_lambda_on_resume


def check_resume(cfg, overrides, saved, path):
    """Refuse (one line) a resume that cannot be honoured; return a note for what it changes on purpose.
    cfg: the flags given on this command line alone (its stage names the directory it resumes)."""
    if cfg.overwrite:
        die("--resume=True continues the run in its directory and --overwrite=True would delete it; pass one of "
            "them", 2)
    if saved.get("stage") != cfg.stage:
        was, now = (("dlm" if st == DLM_STAGE else st) for st in (saved.get("stage"), cfg.stage))
        die(f"{path} is a checkpoint of stage {was}, but this is --stage={now}; resume it with --stage={was} (and "
            f"its --run_name), or start stage {now} without --resume", 2)
    tok = saved.get("tokenizer", TrainConfig.tokenizer)
    if "tokenizer" not in overrides and tok not in TOKENIZERS and not is_model_source(tok):
        die(f"{path} was trained with the tokenizer of {tok}, which is not there; put that file back, or pass "
            f"--tokenizer=<where that model is now> (the same model: its fingerprint is checked)", 2)
    for key in FIXED_ON_RESUME:
        if key in overrides and overrides[key] != saved.get(key, getattr(TrainConfig, key)):
            die(f"--{key}={overrides[key]} differs from the run's --{key}={saved.get(key)} saved in {path}, and a "
                f"resumed run cannot change it; drop the flag to continue the run, or start a new run with "
                f"--run_name=<name>", 2)
    notes = []
    if "max_iters" in overrides and overrides["max_iters"] != saved.get("max_iters"):
        notes.append(f"--max_iters changed from {saved.get('max_iters')} to {overrides['max_iters']}: the LR schedule "
                     f"(and a fractional --quant_start) now follow the new length, so this is not the run it would "
                     f"have been")
    changed = [f"--{k}={v} (was {saved.get(k, getattr(TrainConfig, k))})" for k, v in overrides.items()
               if k not in FIXED_ON_RESUME + NOT_SAID_ON_RESUME and v != saved.get(k, getattr(TrainConfig, k))]
    if changed:
        notes.append(f"resuming with {', '.join(changed)}: the run continues under the new value(s) from its next "
                     f"step, so it is no longer the run saved in {path}")
    return "; ".join(notes)
