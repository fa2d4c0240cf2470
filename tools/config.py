"""
Every flag of train.py on one page: one dataclass of defaults (each field's comment is its --help
line), the presets as small dicts of overrides, and the parser. `python train.py --help` prints this
page's flags.

  defaults (TrainConfig) -> device preset (cpu | cuda) -> stage preset (1 | 2 | 3 | dlm) -> command
  line

tools/checks.py applies the presets (build_config) and checks every value before anything is read or
written; train.py holds the schedules the fields describe (lr, lambda, continual QAT), where the
step uses them. This file reads no file: it imports the parser (tools/flags.py) and model.py's
GPTConfig only.
Test: python -m pytest tests/test_train.py tests/test_flags.py
"""

import math
import os
from dataclasses import dataclass

from model import GPTConfig
from tools.flags import die, parse, to_bool

DLM_STAGE = 4  # the stage number --stage=dlm stands for (cfg.stage, a checkpoint's config["stage"])


@dataclass
class TrainConfig:
    """Every flag of train.py, in six groups (recipe, model, optimizer, data, run, lessons); each
    field's comment is its --help line."""
    # recipe: which stage, where it starts, and how it goes ternary (train.py's schedules;
    # tools/start.py)
    stage: int = 2               # 1 = fp pre-training, 2 = ternary continued pre-training, 3 =
                                 # distillation, dlm = the stage-2 model converted to a
                                 # masked-diffusion LM (lessons/dlm.py)
    init_from: str = "auto"      # auto: stage 2 <- stage-1 ckpt if present, else scratch; stage 3
                                 # <- stage-2 ckpt; or a path (stage 1: an fp checkpoint, SubLN is
                                 # inserted if it has none); or "scratch"
    lambda_warmup_steps: int = 200  # stage 2: lambda goes 0 -> 1 linearly over this many steps
                                    # (cpu: 600)
    quant_start: float = 0.0     # stage 2: full precision until this step (>= 1) or fraction of
                                 # max_iters (< 1), then ternary, lambda ramping from there
                                 # (continual QAT, arXiv 2502.11895)
    # recipe, stage 3: BitDistill (distill.py), L = CE + kd_logits * logits KD + kd_relation *
    # relation KD + ...
    teacher: str = ""            # teacher checkpoint(s), "a.pt" or "a.pt,b.pt"; "" =
                                 # <out_dir>/stage1/ckpt.pt
    teacher_weights: str = ""    # several teachers: weights of their mixture (of tempered distributions), "0.7,0.3"; ""
                                 # = equal
    distill_preset: str = "logits"  # kd_logits 1, kd_relation 0 (measured best here); the paper's
                                    # summarization: kd_logits 1, kd_relation 1e3; classification:
                                    # kd_logits 10, kd_relation 1e5
    kd_logits: float = -1.0      # weight of the logits KD; -1 = the preset's
    kd_relation: float = -1.0    # weight of the attention-relation KD; -1 = the preset's
    kd_hidden: float = 0.0       # weight of the hidden-state KD (0 = off)
    distill_tau: float = 5.0     # logits-KD temperature
    distill_layer: int = -1      # layer whose Q/K/V relations are distilled; negative counts from
                                 # the end (in each model: a teacher of another depth at its own
                                 # last layer); 0 or more is that index in both models
    distill_relation_heads: int = 4  # A_r; the paper's 32 needs H*d >= 32*d_r, too many for a
                                     # 128-wide model
    # model
    n_layer: int = 4             # transformer blocks
    n_head: int = 4              # attention heads (head size = n_embd / n_head)
    n_embd: int = 128            # model width
    block_size: int = 256        # context length in tokens
    subln: bool = True           # SubLN: an RMSNorm before each attention output and FFN down
                                 # projection (BitDistill)
    doc_mask: bool = False       # attend within documents only (model.document_mask); stage 3's
                                 # teachers attend as the student does
    pad_vocab: bool = False      # round the vocabulary up to a multiple of 64 (faster matmuls on
                                 # GPU)
    # optimizer: lr schedule, weight decay, clipping
    optimizer: str = "muon"      # muon (Muon for hidden matrices, AdamW for the rest) or adamw
                                 # (AdamW for all)
    lr: float = 3e-3             # peak learning rate of AdamW (embeddings, head, norms; everything
                                 # with adamw); stage 2 on CPU: 2e-2 (the cpu-stage2 preset,
                                 # measured in lab/results/lr.md)
    muon_lr: float = 3e-3        # peak Muon lr; Moonlight's match_rms_adamw scaling makes it
                                 # comparable to AdamW's
    muon_adjust_lr: str = "match_rms_adamw"  # or "original" (Keller Jordan: lr * sqrt(max(1,
                                             # rows/cols)), lr ~0.02)
    schedule: str = "wsd"        # cosine (nanoGPT), wsd (warmup-stable-decay, MiniCPM), constant
                                 # (after warmup), or moderate: wsd to min_lr_frac 1/3 (Luo et al.'s
                                 # "moderate decay")
    warmup_steps: int = 50       # linear lr warmup steps
    decay_frac: float = 0.2      # wsd: decay over the last 20% of steps
    min_lr_frac: float = 0.1     # lr at step max_iters = min_lr_frac * lr (as nanoGPT's: the last
                                 # trained step, max_iters - 1, is one decay step above it)
    two_phase: bool = False      # BitNet recipe: at mid-training, lr x two_phase_lr_drop and weight
                                 # decay -> 0
    two_phase_lr_drop: float = 0.5  # --two_phase: lr multiplier of the second half
    weight_decay: float = 0.1    # decoupled weight decay of matrices and embeddings (not of norm
                                 # gains)
    beta1: float = 0.9           # AdamW beta1
    beta2: float = 0.95          # AdamW beta2
    zclip: bool = True           # ZClip adaptive clipping (zclip.py); False = clip_grad_norm_ at
                                 # grad_clip
    zclip_z_thresh: float = 2.5  # ZClip: a gradient norm this many std above its EMA mean is a
                                 # spike
    grad_clip: float = 1.0       # fixed max grad norm when zclip=False; 0 = no clipping at all
    # data
    tokenizer: str = "byte"      # byte (257 ids), gpt2 (50257 ids), or a pretrained model's
                                 # (default: --init_from's)
    data: str = ""               # shard dir or shipped corpus (shakespeare, python), or
                                 # "dirA:0.7,python:0.3" to mix; "" = shakespeare (with the GPT-2
                                 # tokenizer: FineWeb-Edu where docs/gpu-node.md prepared it)
    data_order: str = "shuffle"  # shuffle | sequential | curriculum (easy-to-hard over this run's
                                 # rows); shuffle beats sequential by 0.17 val loss on the quick
                                 # start (python -m lab order)
    batch_size: int = 16         # sequences per micro-batch
    grad_accum: int = 1          # micro-batches per optimizer step
    # run: length, evaluation, logs, checkpoints, where and how it runs
    max_iters: int = 600         # optimizer steps of the run
    seed: int = 1337             # seeds the weights, the data order and every random draw
    eval_interval: int = 200     # steps between evaluations (each also writes a checkpoint)
    eval_iters: int = 20         # batches per source at each evaluation
    eval_whole: bool = True      # the final evaluation reads every window of the val split once
    log_interval: int = 1        # steps between log lines
    wandb_project: str = ""      # also log every metrics.jsonl record to this Weights & Biases
                                 # project (rank 0)
    out_dir: str = "out"         # checkpoints and metrics go to <out_dir>/stage<N>/
    run_name: str = ""           # output subdirectory of out_dir; "" = stage<N>
    resume: bool = False         # continue from <out_dir>/stage<N>/ckpt.pt
    overwrite: bool = False      # start afresh in an out_dir that holds another run, deleting its
                                 # checkpoints
    checkpoint_interval: int = 0  # also checkpoint every N steps; 0 = at evals and at the end only
    keep_last: int = 1           # numbered checkpoints ckpt_<step>.pt kept; ckpt.pt always names
                                 # the newest
    max_bad_steps: int = 10      # this many non-finite steps in a row: save and stop (float16: the
                                 # loss scale's back-offs, a finite loss, are not counted)
    device: str = "auto"         # auto = cuda if available, else cpu; also picks the device preset
                                 # below
    dtype: str = "auto"          # auto = bfloat16 autocast on cuda (float16 on a GPU without bf16
                                 # units: T4, V100), float32 on cpu; or float32, bfloat16, float16
                                 # (its loss scaled, train.LossScale)
    compile: str = "auto"        # auto = on for cuda only; true / false (also 1/0, yes/no, on/off);
                                 # true on a CPU: the same bits every run, ~20 s to compile
    fsdp: bool = False           # under torchrun: FSDP2 shards params, grads and optimizer state
                                 # (else DDP)
    # lessons (tools/seams.py fills each seam): a stage of its own, --stage=dlm (lessons/dlm.py)
    dlm_mask_init: str = "mean"  # the new mask token's embedding: mean (of the vocabulary) or
                                 # random
    dlm_shift: bool = True       # Dream's shift: position i's prediction read from position i - 1's
                                 # output
    # lessons: train_step's callbacks, QK-clip and checkpoint averaging
    qk_clip_tau: float = 0.0     # QK-clip (MuonClip) threshold on the max attention logit; 0 = off
                                 # (Kimi K2: 100)
    log_max_logit: bool = False  # log each step's max attention logit (on whenever qk_clip_tau > 0)
    avg_checkpoints: int = 0     # checkpoint averaging (lessons/averaging.py): an EMA of the last k
                                 # snapshots, saved as <run>/avg.pt; k = 0: off (Luo et al.: 6)
    avg_interval: int = 0        # steps between snapshots; 0 = decay_frac * max_iters / k (a WSD
                                 # decay's window)
    avg_alpha: float = 0.2       # EMA coefficient over the snapshots; 0 = their plain mean
    # lessons: the Muon update
    normuon: bool = False        # NorMuon: per-neuron normalised Muon updates
                                 # (lessons/muon_variants.py)
    muon_state: str = "fp32"     # Muon momentum stored as fp32, linear8 or dynamic8 (8-bit
                                 # blockwise)
    # lessons: the SubLN gain
    subln_gain: str = "unit"     # inserted into a pretrained model (--init_from): unit (the paper)
                                 # or calibrated (each gain the mean rms of its input, so the fp
                                 # model's function barely changes)


DEVICE_PRESETS = {
    "cpu": dict(),  # the defaults above are the CPU quick start
    # 8 x 8 sequences of 1024 = 65,536 tokens a step on 1, 2, 4 or 8 GPUs alike (grad_accum counts
    # all ranks)
    "cuda": dict(tokenizer="gpt2", n_layer=12, n_head=12, n_embd=768, block_size=1024,
                 pad_vocab=True, batch_size=8, grad_accum=8, max_iters=5000, eval_interval=500,
                 eval_iters=50, log_interval=10, warmup_steps=200, lambda_warmup_steps=1000,
                 lr=1.5e-3),
}
# --schedule=moderate: WSD decaying only to 1/3 of the peak (Luo et al., arXiv 2511.18903:
SCHEDULE_PRESETS = {
    "moderate": dict(min_lr_frac=1 / 3),  # 3e-3 -> 1e-3), unless --min_lr_frac is also given
}
# the CPU quick start (stage 2): the lr the lr table chose over 2e-3..4e-2, and the lambda warm-up
# the warmup table
# chose over 0..600 steps at that lr (3 seeds each, lab/results/lr.md, warmup.md): lambda reaches 1
# at step 600,
# the run's last; the other stages and the CUDA preset keep theirs (not swept)
DEVICE_STAGE_PRESETS = {("cpu", 2): dict(lr=2e-2, muon_lr=2e-2, lambda_warmup_steps=600)}
# a pretrained model (--init_from or --teacher a model, or stage 2/3 after a stage that began from
# one): AdamW at
# 1e-4, the SmolLM2 table's setting (lab/results/smollm2-notes.md; not swept). The from-scratch
# presets above undo
# a trained model within a few steps, and on CPU Muon doubles its step
# (lab/results/smollm2-speed.md).
PRETRAINED_PRESET = dict(optimizer="adamw", lr=1e-4)
STAGE_PRESETS = {
    1: dict(schedule="cosine"),
    2: dict(schedule="wsd"),
    3: dict(schedule="cosine"),
    DLM_STAGE: dict(schedule="wsd"),
}
STAGE_NAMES = {"dlm": DLM_STAGE}


def parse_args(argv):
    """--key=value pairs checked against TrainConfig's field types (tools/flags.py); --stage also
    takes dlm, and
    --compile auto or a boolean. --help prints every field with its default and comment, and exits
    0."""
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
    return parse(argv, TrainConfig, USAGE, convert=dict(stage=stage, compile=compile_))


USAGE = """python train.py [--key=value ...]: train a ternary (BitNet b1.58) model; stage 1 fp,
2 ternary, 3 distill.
  python train.py --stage=2                the CPU quick start (byte tokenizer, Shakespeare, ~2.5 min)
  python train.py --stage=2 --resume=True  continue a stopped run exactly
  torchrun --standalone --nproc_per_node=8 train.py --stage=2     (DDP; --fsdp=True shards)
Order of defaults: TrainConfig (shown below), then the device preset, the stage preset
(stage 1 and 3: --schedule=cosine; 2 and dlm: wsd; stage 2 on cpu: --lr=2e-2 --muon_lr=2e-2
--lambda_warmup_steps=600), a pretrained model's (--init_from or --teacher a model:
--optimizer=adamw --lr=1e-4), then the flags given. The cuda preset sets:
  """ + " ".join(f"--{k}={v}" for k, v in DEVICE_PRESETS["cuda"].items())


def parse_data(spec):
    """--data: "" (the shipped corpus), a shard directory, or "dirA:0.7,dirB:0.3" to mix by weight.
    Returns {directory: weight}; every source has a finite weight > 0, or none has one (equal
    weights)."""
    if not spec:
        return {}
    items = [item.rpartition(":") if ":" in item else ("", "", item) for item in spec.split(",")]
    if any(not sep for _, sep, _ in items) and any(sep for _, sep, _ in items):
        die(f"--data={spec}: give every source a weight (dirA:0.7,dirB:0.3) or none (equal "
            "weights)", 2)
    sources = {}
    for path, sep, w in items:
        path, w = (path, w) if sep else (w, "1")
        try:
            weight = float(w)
        except ValueError:
            weight = float("nan")
        if not path or not (math.isfinite(weight) and weight > 0):
            die(f"--data={spec}: {path or '(empty)'}:{w} needs a directory and a finite weight > 0",
                2)
        if path in sources:
            die(f"--data={spec}: {path} is named twice; give each source once, with its whole "
                "weight", 2)
        sources[path] = weight
    return sources


def model_config(cfg, vocab_size, eot):
    if cfg.pad_vocab:
        vocab_size = 64 * math.ceil(vocab_size / 64)
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd, quant=cfg.stage >= 2, subln=cfg.subln,
                     doc_mask=cfg.doc_mask, eot=eot)


def stage_dir(stage):
    """out_dir's subdirectory of a stage: stage1, stage2, stage3, dlm."""
    return "dlm" if stage == DLM_STAGE else f"stage{stage}"
