"""
The run's configuration and its per-step schedules: one dataclass of defaults, presets as small dicts of
overrides, a --key=value parser checked against the field types, and the LR and lambda schedules.

  defaults (TrainConfig) -> device preset (cpu | cuda) -> stage preset (1 | 2 | 3) -> command line

Schedules: warmup-cosine (nanoGPT) or WSD, warmup-stable-decay (MiniCPM, arXiv 2404.06395, section 4):
linear warmup, constant, then a linear decay to min_lr over the last decay_frac of the steps; "moderate" is WSD
ending at 1/3 of the peak (Luo et al., arXiv 2511.18903: a curriculum's best data comes last, so do not
decay the lr to nothing), "constant" no decay at all (pair it with checkpoint averaging). Lambda-warmup
(HF blog "Fine-tuning LLMs to 1.58bit", 2024): lambda = min(step / lambda_warmup_steps, 1), blending the
full-precision forward (0) into the ternary one (1). Continual quantisation-aware pre-training (Nielsen et al.,
arXiv 2502.11895): one stage-2 run trains in 16-bit until quant_start, then goes ternary, lambda ramping
from there, lambda = clip((step - quant_start) / lambda_warmup_steps, 0, 1); the optimizer state carries over.

Also: where the data comes from (resolve_data, make_loaders), the model shape (model_config), and the checks
that need more than the config (check_run: world size, out_dir, teacher; check_teacher: stage-3 shapes),
stage 3's frozen teachers with their BitDistill loss (make_teachers), the optimizer groups
(configure_optimizer) and the checkpoint average (make_average).
Used by train.py; test: python -m pytest tests/test_train.py
"""

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

import checkpoint
import data
from averaging import CheckpointAverage
from distill import BitDistillLoss
from model import GPT, GPTConfig, precompute_rope
from muon import configure_muon
from runtime import die


@dataclass
class TrainConfig:
    stage: int = 2               # 1 = fp pre-training, 2 = ternary continued pre-training, 3 = distillation,
                                 # dlm (= 4) = conversion of the stage-2 model to a masked-diffusion LM (dlm.py)
    device: str = "auto"         # auto = cuda if available, else cpu; also picks the device preset below
    out_dir: str = "out"         # checkpoints and metrics go to <out_dir>/stage<N>/
    resume: bool = False         # continue from <out_dir>/stage<N>/ckpt.pt
    overwrite: bool = False      # start afresh in an out_dir that holds another run, deleting its checkpoints
    run_name: str = ""           # output subdirectory of out_dir; "" = stage<N>
    init_from: str = "auto"      # auto: stage 2 <- stage-1 ckpt if present, else scratch; stage 3 <- stage-2 ckpt;
                                 # or a path (stage 1: an fp checkpoint, SubLN is inserted if it has none); or "scratch"
    seed: int = 1337
    # data
    tokenizer: str = "byte"      # byte (257 ids) or gpt2 (50257 ids)
    data: str = ""               # shard dir or shipped corpus (shakespeare, python), or "dirA:0.7,python:0.3" to mix;
                                 # "" = shakespeare
    data_order: str = "shuffle"  # shuffle | sequential | curriculum (easy-to-hard over this run's rows);
                                 # shuffle beats sequential by 0.17 val loss on the quick start (lab.py order)
    # model
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256
    subln: bool = True
    doc_mask: bool = False       # attend within documents only (model.document_mask)
    pad_vocab: bool = False      # round the vocabulary up to a multiple of 64 (faster matmuls on GPU)
    # batch and length
    batch_size: int = 16         # sequences per micro-batch
    grad_accum: int = 1          # micro-batches per optimizer step
    max_iters: int = 600
    eval_interval: int = 200
    eval_iters: int = 20         # batches per source at each evaluation
    eval_whole: bool = True      # the final evaluation reads every window of the val split once
    log_interval: int = 1
    # optimizer and schedules
    optimizer: str = "muon"      # muon (Muon for hidden matrices, AdamW for the rest) or adamw (AdamW for all)
    normuon: bool = False        # NorMuon: per-neuron normalised Muon updates (muon_variants.py)
    muon_state: str = "fp32"     # Muon momentum stored as fp32, linear8 or dynamic8 (8-bit blockwise)
    qk_clip_tau: float = 0.0     # QK-clip (MuonClip) threshold on the max attention logit; 0 = off (Kimi K2: 100)
    log_max_logit: bool = False  # log each step's max attention logit (on whenever qk_clip_tau > 0)
    # --stage=dlm: the masked-diffusion conversion (dlm.py)
    dlm_mask_init: str = "mean"  # the new mask token's embedding: mean (of the vocabulary) or random
    dlm_shift: bool = True       # Dream's shift: position i's prediction read from position i - 1's output
    lr: float = 3e-3             # peak learning rate of AdamW (embeddings, head, norms; everything with adamw)
    muon_lr: float = 3e-3        # peak Muon lr; Moonlight's match_rms_adamw scaling makes it comparable to AdamW's
    muon_adjust_lr: str = "match_rms_adamw"  # or "original" (Keller Jordan: lr * sqrt(max(1, rows/cols)), lr ~0.02)
    min_lr_frac: float = 0.1     # final lr = min_lr_frac * lr
    schedule: str = "wsd"        # cosine (nanoGPT), wsd (warmup-stable-decay, MiniCPM), constant (after warmup),
                                 # or moderate: wsd to min_lr_frac 1/3 (Luo et al.'s "moderate decay")
    warmup_iters: int = 50
    decay_frac: float = 0.2      # wsd: decay over the last 20% of steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    zclip: bool = True           # ZClip adaptive clipping (zclip.py); False = clip_grad_norm_ at grad_clip
    zclip_z_thresh: float = 2.5
    grad_clip: float = 1.0       # fixed max grad norm when zclip=False; 0 = no clipping at all
    two_phase: bool = False      # BitNet recipe: at mid-training, lr x two_phase_lr_drop and weight decay -> 0
    two_phase_lr_drop: float = 0.5
    lambda_warmup_steps: int = 200  # stage 2: lambda goes 0 -> 1 linearly over this many steps
    quant_start: float = 0.0     # stage 2: full precision until this step (>= 1) or fraction of max_iters (< 1),
                                 # then ternary, lambda ramping from there (continual QAT, arXiv 2502.11895)
    # checkpoint averaging (averaging.py): an EMA over the last k snapshots, saved as <run>/avg.pt
    avg_checkpoints: int = 0     # k; 0 = off (Luo et al.: 6)
    avg_interval: int = 0        # steps between snapshots; 0 = decay_frac * max_iters / k (a WSD decay's window)
    avg_alpha: float = 0.2       # EMA coefficient over the snapshots; 0 = their plain mean
    # stage 3: BitDistill (distill.py), L = CE + lambda * logits KD + gamma * attention-relation KD (+ delta * hidden)
    teacher: str = ""            # teacher checkpoint(s), "a.pt" or "a.pt,b.pt"; "" = <out_dir>/stage1/ckpt.pt
    teacher_weights: str = ""    # several teachers: weights of their logits mixture, "0.7,0.3"; "" = equal
    distill_preset: str = "logits"  # lambda 1, gamma 0 (measured best here); the paper's summarization:
                                    # lambda 1, gamma 1e3; classification: lambda 10, gamma 1e5
    distill_lambda: float = -1.0  # logits-KD weight; -1 = the preset's
    distill_gamma: float = -1.0  # attention-relation weight; -1 = the preset's
    distill_tau: float = 5.0     # logits-KD temperature
    distill_layer: int = -1      # layer whose Q/K/V relations are distilled; negative counts from the end
    distill_relation_heads: int = 4  # A_r; the paper's 32 needs H*d >= 32*d_r, too many for a 128-wide model
    distill_hidden: float = 0.0  # delta: weight of hidden-state distillation (0 = off)
    # system
    compile: str = "auto"        # auto = on for cuda only; true / false (also 1/0, yes/no, on/off)
    dtype: str = "auto"          # auto = bfloat16 autocast on cuda, float32 on cpu; or float32, bfloat16, float16
    # scale-out and fault tolerance
    fsdp: bool = False           # under torchrun: FSDP2 shards params, grads and optimizer state (else DDP)
    checkpoint_interval: int = 0  # also checkpoint every N steps; 0 = at evals and at the end only
    keep_last: int = 1           # numbered checkpoints ckpt_<step>.pt kept; ckpt.pt always names the newest
    max_bad_steps: int = 10      # this many non-finite steps in a row: save and stop


# Presets are plain overrides, applied in this order: defaults, device preset, stage preset, command line.
DEVICE_PRESETS = {
    "cpu": dict(),  # the defaults above are the CPU quick start
    "cuda": dict(tokenizer="gpt2", n_layer=12, n_head=12, n_embd=768, block_size=1024, pad_vocab=True,
                 batch_size=16, grad_accum=4, max_iters=5000, eval_interval=500, eval_iters=50,
                 log_interval=10, warmup_iters=200, lambda_warmup_steps=1000, lr=1.5e-3),
}
SCHEDULE_PRESETS = {  # --schedule=moderate: WSD decaying only to 1/3 of the peak (Luo et al., arXiv 2511.18903:
    "moderate": dict(min_lr_frac=1 / 3),  # 3e-3 -> 1e-3), unless --min_lr_frac is also given
}
STAGE_PRESETS = {
    1: dict(schedule="cosine"),
    2: dict(schedule="wsd"),
    3: dict(schedule="cosine"),
    4: dict(schedule="wsd"),  # --stage=dlm
}
DLM = 4
STAGE_NAMES = {"dlm": DLM}



BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def parse_args(argv):
    """--key=value pairs, each checked against TrainConfig's field types. Booleans, and the tri-state
    --compile, take true/false, 1/0, yes/no, on/off in any case."""
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    out = {}
    for arg in argv:
        key, eq, val = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not eq or key not in fields:
            die(f"unknown or malformed argument {arg!r}; use --key=value with key one of: {', '.join(fields)}", 2)
        typ = fields[key]
        if key == "stage" and val in STAGE_NAMES:
            out[key] = STAGE_NAMES[val]
            continue
        try:
            if typ is bool or key == "compile":
                if key == "compile" and val.lower() == "auto":
                    out[key] = "auto"
                    continue
                out[key] = BOOLEANS[val.lower()] if typ is bool else str(BOOLEANS[val.lower()]).lower()
            else:
                out[key] = typ(val)
        except (ValueError, KeyError):
            what = "true or false" if typ is bool else "auto, true or false" if key == "compile" else typ.__name__
            die(f"--{key}={val}: expected {what}; valid keys: {', '.join(fields)}", 2)
    return out


def build_config(overrides, base=None):
    """Defaults + device preset + stage preset + overrides; or, on resume, the saved config + overrides."""
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
        cfg.update(SCHEDULE_PRESETS.get(overrides.get("schedule"), {}))
        cfg["device"] = device
    cfg.update(overrides)
    cfg = TrainConfig(**cfg)
    check_config(cfg)
    return cfg


def check_config(cfg):
    """Every field's range in one place, checked before any data is tokenised or any model built: a value
    that would train nonsense (a negative lr, no layers, a NaN) stops here with one line naming the flag."""
    choices = dict(stage=(1, 2, 3, DLM), dlm_mask_init=("mean", "random"), tokenizer=("byte", "gpt2"), schedule=("cosine", "wsd", "moderate", "constant"),
                   data_order=("sequential", "shuffle", "curriculum"), optimizer=("muon", "adamw"),
                   muon_state=("fp32", "linear8", "dynamic8"),
                   muon_adjust_lr=("original", "match_rms_adamw"), distill_preset=("logits", "summarization", "classification"),
                   dtype=("auto", "float32", "bfloat16", "float16"), compile=("auto", "true", "false"))
    for key, valid in choices.items():
        if getattr(cfg, key) not in valid:
            die(f"--{key}={getattr(cfg, key)}: expected one of {', '.join(map(str, valid))}", 2)
    at_least = dict(n_layer=1, n_head=1, n_embd=1, block_size=1, batch_size=1, grad_accum=1, max_iters=0,
                    eval_interval=1, eval_iters=1, log_interval=1, warmup_iters=0, lambda_warmup_steps=0,
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
                  distill_lambda=(">= 0, or -1 for the preset's", lambda v: v >= 0 or v == -1),
                  distill_gamma=(">= 0, or -1 for the preset's", lambda v: v >= 0 or v == -1),
                  distill_tau=("> 0", lambda v: v > 0), distill_hidden=(">= 0", lambda v: v >= 0),
                  avg_alpha=("in [0, 1]", lambda v: 0 <= v <= 1), qk_clip_tau=(">= 0", lambda v: v >= 0))
    for key, (what, ok) in ranges.items():
        v = getattr(cfg, key)
        if not (math.isfinite(v) and ok(v)):
            die(f"--{key}={v}: expected a finite number {what}", 2)
    if not (math.isfinite(cfg.quant_start) and cfg.quant_start >= 0 and (cfg.quant_start < 1 or cfg.quant_start.is_integer())):
        die(f"--quant_start={cfg.quant_start}: expected a fraction of max_iters in [0, 1) or a whole step >= 1", 2)
    if cfg.quant_start and cfg.stage != 2:
        die(f"--quant_start={cfg.quant_start} switches a stage-2 run from 16-bit to ternary; stage {cfg.stage} has "
            f"no such switch (stage 1 is full precision throughout, stage 3 ternary throughout)", 2)
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
        sources[path] = weight
    return sources

def lr_mult(step, cfg):
    """Multiplier on every group's peak lr: warmup-cosine (nanoGPT) or warmup-stable-decay (MiniCPM),
    times two_phase_lr_drop in the second half with --two_phase=True (BitNet b1.58 FAQ)."""
    drop = cfg.two_phase_lr_drop if cfg.two_phase and step >= cfg.max_iters // 2 else 1.0
    return drop * _schedule(step, cfg)


def _schedule(step, cfg):
    if step < cfg.warmup_iters:
        return (step + 1) / (cfg.warmup_iters + 1)
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        progress = min((step - cfg.warmup_iters) / max(cfg.max_iters - cfg.warmup_iters, 1), 1.0)
        return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = int(cfg.max_iters * (1 - cfg.decay_frac))
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / max(cfg.max_iters - decay_start, 1), 1.0)
    return 1.0 - (1 - cfg.min_lr_frac) * progress  # linear decay to min_lr (wsd, moderate)


def avg_interval(cfg):
    """Steps between the snapshots checkpoint averaging takes: --avg_interval, or by default the last decay_frac
    of the run split into avg_checkpoints intervals (averaging stands in for a WSD decay over that window)."""
    return cfg.avg_interval or max(1, round(cfg.decay_frac * cfg.max_iters / max(cfg.avg_checkpoints, 1)))


def lambda_at(step, cfg):
    """lambda = clip((step - quant_start) / lambda_warmup_steps, 0, 1); 0 = full precision, 1 = ternary.
    Stage 3 starts from an already ternary student, so lambda is 1 throughout."""
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


SHIPPED = ("shakespeare", "python")  # --data names of the corpora in data/ (prepare.CORPORA)


def shipped_dir(name, cfg):
    """data/<name>_<tokenizer>, the shards of a shipped corpus; tokenised (prepare.py) the first time."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", f"{name}_{cfg.tokenizer}")
    scores = os.path.join(root, "train_000.difficulty.npy")  # prepared before difficulty scores existed?
    if not os.path.exists(os.path.join(root, "meta.json")) or (cfg.data_order == "curriculum" and
                                                                not os.path.exists(scores)):
        import prepare  # ingestion: only the first run needs it
        print(f"no shards{' or no difficulty scores' if os.path.exists(root) else ''} in {root}; tokenising the "
              f"shipped corpus {name} (once)")
        prepare.prepare(tokenizer=cfg.tokenizer, out_dir=root, corpus=name)
    return root


def resolve_data(cfg):
    """The shard directories and mixing weights. A shipped corpus may be named instead of a directory
    (--data=shakespeare:0.75,python:0.25) and is prepared the first time; "" = shakespeare."""
    sources = {shipped_dir(p, cfg) if p in SHIPPED and not os.path.isdir(p) else p: w
               for p, w in (parse_data(cfg.data) or {"shakespeare": 1.0}).items()}
    for path in sources:
        if not os.path.exists(os.path.join(path, "meta.json")):
            die(f"{path}: no meta.json; make shards with: python prepare.py --tokenizer={cfg.tokenizer} --out_dir={path} <files>")
        try:
            meta = data.read_meta(path)  # an empty or broken meta.json: one line naming it
        except ValueError as e:
            die(str(e))
        if meta["tokenizer"] != cfg.tokenizer:
            die(f"{path} was tokenised with {meta['tokenizer']}, but --tokenizer={cfg.tokenizer}; "
                f"pass --tokenizer={meta['tokenizer']} or re-run prepare.py")
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
        val_loaders = {name: (data.DataLoader(d, "val", cfg.batch_size, cfg.block_size, rt.rank, rt.world, cfg.seed),
                              w / total) for name, (d, w) in zip(names, sources.items())}
        if resume is not None:
            train_loader.load_state_dict(resume["loader"])
    except ValueError as e:
        die(str(e))
    return train_loader, val_loaders


def model_config(cfg, vocab_size, eot):
    if cfg.pad_vocab:
        vocab_size = 64 * math.ceil(vocab_size / 64)
    dlm = cfg.stage == DLM  # one more token (the mask, id = the AR vocabulary size) and bidirectional attention
    return GPTConfig(vocab_size=vocab_size + dlm, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd, quant=cfg.stage >= 2, subln=cfg.subln, doc_mask=cfg.doc_mask and not dlm,
                     eot=eot, causal=not dlm, track_max_logit=cfg.qk_clip_tau > 0 or cfg.log_max_logit)


def stage_dir(stage):
    """out_dir's subdirectory of a stage: stage1, stage2, stage3, dlm."""
    return "dlm" if stage == DLM else f"stage{stage}"


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
        die(f"--grad_accum={cfg.grad_accum} counts the micro-batches of one step over all {world} ranks, so it must "
            f"be a multiple of {world}; pass --grad_accum={world * max(1, cfg.grad_accum // world)}", 2)
    if world > 1 and cfg.stage == DLM:
        die("--stage=dlm runs in one process here (its loss calls the model directly, not the DDP wrapper)", 2)
    if world > 1 and (cfg.normuon or cfg.muon_state != "fp32" or cfg.qk_clip_tau > 0):
        die("--normuon, --muon_state and --qk_clip_tau run in one process here (each rank would record its own "
            "max logits, and the variants' step is not shared out); use plain Muon with torchrun", 2)
    for path in teachers if cfg.stage == 3 else []:
        if not os.path.exists(path):
            die(f"stage 3 needs the full-precision teacher at {path}; make it with: python train.py --stage=1")
    if cfg.stage == 3:
        parse_teacher_weights(cfg, len(teachers))
    try:
        if rt.master:
            checkpoint.check_writable(out_dir)
    except OSError as e:
        die(f"cannot write to {out_dir}: {e.strerror}; pass a writable --out_dir")


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
    if first and crit.gamma_ad and (s.n_embd % heads or t.n_embd % heads):
        fits = max(a for a in range(1, heads + 1) if s.n_embd % a == 0 and t.n_embd % a == 0)
        die(f"--distill_relation_heads={heads} must divide the width of the student ({s.n_embd}) and of the "
            f"teacher ({t.n_embd}); try --distill_relation_heads={fits}", 2)
    if cfg.block_size > t.block_size:
        die(f"--block_size={cfg.block_size} is longer than the teacher's context ({t.block_size} in {path}); pass "
            f"--block_size={t.block_size} or less", 2)


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
            from muon_variants import MuonVariant
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
    """--avg_checkpoints: the checkpoint average (averaging.py), restored from resume when it holds one."""
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
