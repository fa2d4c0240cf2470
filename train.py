"""
Train a ternary (BitNet b1.58) Llama-style model in three stages, nanoGPT-style.

  stage 1  full-precision pre-training of the SubLN model                         -> out/stage1/ckpt.pt
  stage 2  ternary continued pre-training from stage 1 (or from scratch), with
           lambda warming up linearly from 0 (fp) to 1 (ternary)                  -> out/stage2/ckpt.pt
  stage 3  BitDistill: stage-2 student, frozen stage-1 teacher                    -> out/stage3/ckpt.pt

Run on one machine (CPU preset: byte tokenizer, minutes; CUDA preset: GPT-2 tokenizer, a real run):
  python train.py --stage=1
  python train.py --stage=2
  python train.py --stage=2 --max_iters=2000 --lr=3e-3      (any field of TrainConfig as --key=value)
  python train.py --stage=2 --resume=True                     (continue a stopped run)

The first run tokenises the shipped Shakespeare corpus into data/shakespeare_<tokenizer>/ (see data.py).
Every step logs loss, lr, lambda, grad norm, ms/step and tokens/s; metrics go to out/stage<N>/metrics.jsonl.
"""

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

import data
from distill import BitDistillLoss
from model import GPT, GPTConfig, precompute_rope
from muon import configure_muon
from quant import cache_weight_quant, clear_weight_quant, set_lambda
from zclip import ZClip


@dataclass
class TrainConfig:
    stage: int = 2               # 1 = fp pre-training, 2 = ternary continued pre-training, 3 = distillation
    device: str = "auto"         # auto = cuda if available, else cpu; also picks the device preset below
    out_dir: str = "out"         # checkpoints and metrics go to <out_dir>/stage<N>/
    resume: bool = False         # continue from <out_dir>/stage<N>/ckpt.pt
    run_name: str = ""           # output subdirectory of out_dir; "" = stage<N>
    init_from: str = "auto"      # auto: stage 2 <- stage-1 ckpt if present, else scratch; stage 3 <- stage-2 ckpt;
                                 # or a path (stage 1: an fp checkpoint, SubLN is inserted if it has none); or "scratch"
    seed: int = 1337
    # data
    tokenizer: str = "byte"      # byte (257 ids) or gpt2 (50257 ids)
    data: str = ""               # shard dir, or "dirA:0.7,dirB:0.3" to mix; "" = the shipped corpus
    # model
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256
    subln: bool = True
    doc_mask: bool = False       # attend within documents only (REFERENCE section 6)
    pad_vocab: bool = False      # round the vocabulary up to a multiple of 64 (faster matmuls on GPU)
    # batch and length
    batch_size: int = 16         # sequences per micro-batch
    grad_accum: int = 1          # micro-batches per optimizer step
    max_iters: int = 600
    eval_interval: int = 200
    eval_iters: int = 20
    log_interval: int = 1
    # optimizer and schedules
    optimizer: str = "muon"      # muon (Muon for hidden matrices, AdamW for the rest) or adamw (AdamW for all)
    lr: float = 3e-3             # peak learning rate of AdamW (embeddings, head, norms; everything with adamw)
    muon_lr: float = 3e-3        # peak Muon lr; Moonlight's match_rms_adamw scaling makes it comparable to AdamW's
    muon_adjust_lr: str = "match_rms_adamw"  # or "original" (Keller Jordan: lr * sqrt(max(1, rows/cols)), lr ~0.02)
    min_lr_frac: float = 0.1     # final lr = min_lr_frac * lr
    schedule: str = "wsd"        # cosine (nanoGPT) or wsd (warmup-stable-decay, MiniCPM)
    warmup_iters: int = 50
    decay_frac: float = 0.2      # wsd: decay over the last 20% of steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    zclip: bool = True           # ZClip adaptive clipping (REFERENCE section 4); False = clip_grad_norm_ at grad_clip
    zclip_z_thresh: float = 2.5
    grad_clip: float = 1.0       # fixed max grad norm when zclip=False; 0 = no clipping at all
    two_phase: bool = False      # BitNet recipe: at mid-training, lr x two_phase_lr_drop and weight decay -> 0
    two_phase_lr_drop: float = 0.5
    lambda_warmup_steps: int = 200  # stage 2: lambda goes 0 -> 1 linearly over this many steps
    # stage 3: BitDistill (distill.py), L = CE + lambda * logits KD + gamma * attention-relation KD (+ delta * hidden)
    teacher: str = ""            # teacher checkpoint; "" = <out_dir>/stage1/ckpt.pt
    distill_preset: str = "summarization"  # lambda 1, gamma 1e3; classification: lambda 10, gamma 1e5
    distill_lambda: float = -1.0  # logits-KD weight; -1 = the preset's
    distill_gamma: float = -1.0  # attention-relation weight; -1 = the preset's
    distill_tau: float = 5.0     # logits-KD temperature
    distill_layer: int = -1      # layer whose Q/K/V relations are distilled; negative counts from the end
    distill_relation_heads: int = 4  # A_r; the paper's 32 needs H*d >= 32*d_r, too many for a 128-wide model
    distill_hidden: float = 0.0  # delta: weight of hidden-state distillation (0 = off)
    # system
    compile: str = "auto"        # auto = on for cuda only
    dtype: str = "auto"          # auto = bfloat16 autocast on cuda, float32 on cpu


# Presets are plain overrides, applied in this order: defaults, device preset, stage preset, command line.
DEVICE_PRESETS = {
    "cpu": dict(),  # the defaults above are the CPU quick start
    "cuda": dict(tokenizer="gpt2", n_layer=12, n_head=12, n_embd=768, block_size=1024, pad_vocab=True,
                 batch_size=16, grad_accum=4, max_iters=5000, eval_interval=500, eval_iters=50,
                 log_interval=10, warmup_iters=200, lambda_warmup_steps=1000, lr=1.5e-3),
}
STAGE_PRESETS = {
    1: dict(schedule="cosine"),
    2: dict(schedule="wsd"),
    3: dict(schedule="cosine"),
}


def die(msg, code=1):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def parse_args(argv):
    """--key=value pairs, each checked against TrainConfig's field types."""
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    out = {}
    for arg in argv:
        key, eq, val = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not eq or key not in fields:
            die(f"unknown or malformed argument {arg!r}; use --key=value with key one of: {', '.join(fields)}", 2)
        typ = fields[key]
        try:
            if typ is bool:
                if val.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[key] = val.lower() in ("true", "1")
            else:
                out[key] = typ(val)
        except ValueError:
            die(f"--{key}={val}: expected {typ.__name__}; valid keys: {', '.join(fields)}", 2)
    return out


def build_config(overrides, base=None):
    cfg = dict(base) if base else {}
    if not base:
        device = overrides.get("device", "auto")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        stage = overrides.get("stage", TrainConfig.stage)
        if stage not in STAGE_PRESETS:
            die(f"--stage={stage}: expected one of {sorted(STAGE_PRESETS)}", 2)
        cfg.update(DEVICE_PRESETS.get(device.split(":")[0], {}))
        cfg.update(STAGE_PRESETS[stage])
        cfg["device"] = device
    cfg.update(overrides)
    cfg = TrainConfig(**cfg)
    if cfg.schedule not in ("cosine", "wsd"):
        die(f"--schedule={cfg.schedule}: expected cosine or wsd", 2)
    if cfg.optimizer not in ("muon", "adamw"):
        die(f"--optimizer={cfg.optimizer}: expected muon or adamw", 2)
    if cfg.muon_adjust_lr not in ("original", "match_rms_adamw"):
        die(f"--muon_adjust_lr={cfg.muon_adjust_lr}: expected original or match_rms_adamw", 2)
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        die(f"n_embd={cfg.n_embd} must split into n_head={cfg.n_head} heads of even size", 2)
    return cfg


def lr_mult(step, cfg):
    """Multiplier on every group's peak lr: warmup-cosine (nanoGPT) or warmup-stable-decay (MiniCPM),
    times two_phase_lr_drop in the second half with --two_phase=True (BitNet b1.58 FAQ)."""
    drop = cfg.two_phase_lr_drop if cfg.two_phase and step >= cfg.max_iters // 2 else 1.0
    return drop * _schedule(step, cfg)


def _schedule(step, cfg):
    if step < cfg.warmup_iters:
        return (step + 1) / (cfg.warmup_iters + 1)
    if cfg.schedule == "cosine":
        progress = min((step - cfg.warmup_iters) / max(cfg.max_iters - cfg.warmup_iters, 1), 1.0)
        return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = int(cfg.max_iters * (1 - cfg.decay_frac))
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / max(cfg.max_iters - decay_start, 1), 1.0)
    return 1.0 - (1 - cfg.min_lr_frac) * progress  # linear decay to min_lr


def lambda_at(step, cfg):
    """REFERENCE section 1: lambda = min(step / warmup_steps, 1); 0 = full precision, 1 = ternary.
    Stage 3 starts from an already ternary student, so lambda is 1 throughout."""
    if cfg.stage >= 3 or cfg.lambda_warmup_steps <= 0:
        return 1.0
    return min(step / cfg.lambda_warmup_steps, 1.0)


def configure_optimizer(model, cfg, device_type):
    """muon: Muon for the 2-D hidden matrices, AdamW for embeddings/head (decayed) and norm gains (not);
    adamw: AdamW for all, weight decay on matrices only. Every group records its initial lr and wd."""
    fused = device_type == "cuda"
    if cfg.optimizer == "muon":  # NS5 in bf16 on GPU (the paper); fp32 on CPU, where bf16 matmuls are ~25x slower
        opt = configure_muon(model, muon_lr=cfg.muon_lr, adamw_lr=cfg.lr, muon_weight_decay=cfg.weight_decay,
                             adamw_weight_decay=cfg.weight_decay, adjust_lr_fn=cfg.muon_adjust_lr,
                             adamw_betas=(cfg.beta1, cfg.beta2), fused=fused,
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
    """ZClip, or a fixed clip_grad_norm_; both return the same 0-d tensor stats (read only when logging)."""
    if clipper is not None:
        return clipper.clip(params)
    raw = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    clipped = (raw > cfg.grad_clip) if cfg.grad_clip > 0 else torch.zeros((), dtype=torch.bool)
    return {"raw_norm": raw, "clipped_norm": raw.clamp(max=cfg.grad_clip) if cfg.grad_clip > 0 else raw,
            "was_clipped": clipped.float(), "z_score": torch.zeros(())}


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


def resolve_data(cfg):
    """The shard directories and mixing weights; prepares the shipped corpus the first time."""
    if not cfg.data:
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", f"shakespeare_{cfg.tokenizer}")
        if not os.path.exists(os.path.join(root, "meta.json")):
            print(f"no shards in {root}; tokenising the shipped corpus (once)")
            data.prepare(tokenizer=cfg.tokenizer, out_dir=root)
        return {root: 1.0}
    sources = {}
    for item in cfg.data.split(","):
        path, _, w = item.partition(":")
        sources[path] = float(w) if w else 1.0
    for path in sources:
        meta_path = os.path.join(path, "meta.json")
        if not os.path.exists(meta_path):
            die(f"{path}: no meta.json; make shards with: python data.py --tokenizer={cfg.tokenizer} --out_dir={path} <files>")
        meta = json.load(open(meta_path))
        if meta["tokenizer"] != cfg.tokenizer:
            die(f"{path} was tokenised with {meta['tokenizer']}, but --tokenizer={cfg.tokenizer}; "
                f"pass --tokenizer={meta['tokenizer']} or re-run data.py")
    return sources


def model_config(cfg, vocab_size, eot):
    if cfg.pad_vocab:
        vocab_size = 64 * math.ceil(vocab_size / 64)
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd, quant=cfg.stage >= 2, subln=cfg.subln, doc_mask=cfg.doc_mask, eot=eot)


def load_checkpoint(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which, never a bare traceback
        die(f"{path}: cannot load checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def load_weights(model, state, path, insert_subln=False):
    """Load a state dict; lambda_ buffers may be missing (an fp checkpoint into a ternary model), and with
    insert_subln the SubLN gains too: they keep their unit init (BitDistill Stage 1, REFERENCE section 2)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lambda_") and not (insert_subln and ".subln." in k)]
    if missing or unexpected:
        die(f"{path}: checkpoint does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            f"check n_layer/n_embd/n_head/subln/tokenizer")


def save_checkpoint(path, obj):
    """Atomic: write a temporary file, fsync, then rename, so a crash never leaves a half checkpoint."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def make_teacher(cfg, path, student_conf, device_type):
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
        print("stage 3: all distillation weights are 0, so this is plain CE (the control run)")
        return None, crit
    ckpt = load_checkpoint(path)
    tconf = GPTConfig(**ckpt["model_args"])
    if tconf.vocab_size != student_conf.vocab_size:
        die(f"{path}: teacher vocabulary {tconf.vocab_size} != student {student_conf.vocab_size}; same tokenizer needed")
    teacher = GPT(tconf)
    load_weights(teacher, ckpt["model"], path)
    teacher.requires_grad_(False).eval().to(cfg.device)
    if device_type == "cuda":
        teacher.to(torch.bfloat16)  # weights in bf16; RoPE tables stay fp32
        cos, sin = precompute_rope(tconf.n_embd // tconf.n_head, tconf.block_size, tconf.rope_theta)
        teacher.rope_cos, teacher.rope_sin = cos.to(cfg.device), sin.to(cfg.device)
    try:
        crit.layer_index(student_conf.n_layer), crit.layer_index(tconf.n_layer)
    except ValueError as e:
        die(str(e), 2)
    print(f"stage 3: teacher {path} (quant={tconf.quant}), {crit}")
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
def estimate_val_loss(model, loader, cfg, ctx):
    model.eval()
    loader.reset()
    losses = torch.zeros(cfg.eval_iters)
    for k in range(cfg.eval_iters):
        x, y = loader.next_batch()
        with ctx:
            losses[k] = model(x.to(cfg.device), y.to(cfg.device))[1].float()
    model.train()
    return losses.mean().item()


def main(argv):
    overrides = parse_args(argv)
    cfg = build_config(overrides)
    out_dir = os.path.join(cfg.out_dir, cfg.run_name or f"stage{cfg.stage}")
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    ckpt = None
    if cfg.resume:
        if not os.path.exists(ckpt_path):
            die(f"--resume=True but there is no checkpoint at {ckpt_path}; start without --resume")
        ckpt = load_checkpoint(ckpt_path)
        cfg = build_config(overrides, base=ckpt["config"])  # the saved run, with command-line overrides on top
    teacher_path = cfg.teacher or os.path.join(cfg.out_dir, "stage1", "ckpt.pt")
    if cfg.stage == 3 and not os.path.exists(teacher_path):
        die(f"stage 3 needs the full-precision teacher at {teacher_path}; make it with: python train.py --stage=1")
    try:
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, ".write_test"), "w").close()
        os.remove(os.path.join(out_dir, ".write_test"))
    except OSError as e:
        die(f"cannot write to {out_dir}: {e.strerror}; pass a writable --out_dir")

    torch.manual_seed(cfg.seed)
    device_type = "cuda" if cfg.device.startswith("cuda") else "cpu"
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = ("bfloat16" if device_type == "cuda" else "float32") if cfg.dtype == "auto" else cfg.dtype
    ctx = torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=dtype != "float32")

    tok = data.get_tokenizer(cfg.tokenizer)
    try:
        sources = resolve_data(cfg)
        train_loader = data.DataLoader(sources, "train", cfg.batch_size, cfg.block_size, seed=cfg.seed)
        val_loader = data.DataLoader(sources, "val", cfg.batch_size, cfg.block_size, seed=cfg.seed)
    except ValueError as e:
        die(str(e))

    gptconf = model_config(cfg, tok.vocab_size, tok.eot)
    model = GPT(gptconf)
    step = 0
    if ckpt is not None:
        load_weights(model, ckpt["model"], ckpt_path)
        step = ckpt["step"]
        train_loader.load_state_dict(ckpt["loader"])
        print(f"resuming stage {cfg.stage} from {ckpt_path} at step {step}")
    elif cfg.init_from != "scratch" and (cfg.stage > 1 or cfg.init_from != "auto"):
        prev = f"stage{cfg.stage - 1}"
        init_path = os.path.join(cfg.out_dir, prev, "ckpt.pt") if cfg.init_from == "auto" else cfg.init_from
        if os.path.exists(init_path):
            init = load_checkpoint(init_path)
            insert = cfg.stage == 1 and not init.get("model_args", {}).get("subln", True) and gptconf.subln
            load_weights(model, init["model"], init_path, insert_subln=insert)
            src = f"stage-{cfg.stage - 1} weights" if cfg.init_from == "auto" else "weights"
            print(f"stage {cfg.stage}: starting from the {src} in {init_path}" +
                  (" (SubLN inserted with unit gain)" if insert else ""))
        elif cfg.init_from == "auto" and cfg.stage == 2:
            print(f"stage 2: no stage-1 checkpoint at {init_path}; training the ternary model from scratch")
        else:
            die(f"no checkpoint at {init_path} to start stage {cfg.stage} from; make it with: "
                f"python train.py --stage={max(cfg.stage - 1, 1)}")
    else:
        print(f"stage {cfg.stage}: training from scratch")
    teacher, crit = None, None
    if cfg.stage == 3:
        teacher, crit = make_teacher(cfg, teacher_path, gptconf, device_type)
    model.to(cfg.device)
    optimizer = configure_optimizer(model, cfg, device_type)
    clipper = ZClip(z_thresh=cfg.zclip_z_thresh) if cfg.zclip else None
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        if clipper is not None and ckpt.get("zclip") is not None:
            clipper.load_state_dict(ckpt["zclip"])
    print(f"{model.get_num_params() / 1e6:.2f}M non-embedding params, quant={gptconf.quant}, subln={gptconf.subln}, "
          f"vocab={gptconf.vocab_size}, device={cfg.device}, dtype={dtype}")
    use_compile = cfg.compile == "true" or (cfg.compile == "auto" and device_type == "cuda")
    train_model = torch.compile(model) if use_compile else model

    def checkpoint():
        save_checkpoint(ckpt_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                    "config": dataclasses.asdict(cfg), "model_args": dataclasses.asdict(gptconf),
                                    "loader": train_loader.state_dict(),
                                    "zclip": clipper.state_dict() if clipper is not None else None})

    metrics = open(os.path.join(out_dir, "metrics.jsonl"), "a")
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum
    val_loss = None
    t0 = time.time()
    while True:
        lam = lambda_at(step, cfg) if gptconf.quant else 0.0
        if gptconf.quant:
            set_lambda(model, lam)
        if (step > 0 and step % cfg.eval_interval == 0) or step == cfg.max_iters:
            val_loss = estimate_val_loss(train_model, val_loader, cfg, ctx)
            print(f"step {step}: val loss {val_loss:.4f}")
            metrics.write(json.dumps({"step": step, "val_loss": val_loss, "lambda": lam}) + "\n")
            metrics.flush()
            checkpoint()
            t0 = time.time()  # do not count eval time in the next step's timing
        if step >= cfg.max_iters:
            break
        mult = lr_mult(step, cfg)
        phase2 = cfg.two_phase and step >= cfg.max_iters // 2
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"] * mult
            g["weight_decay"] = 0.0 if phase2 else g["initial_wd"]
        if gptconf.quant and cfg.grad_accum > 1:
            cache_weight_quant(model)  # quantise each weight once per step, not once per micro-batch
        for _ in range(cfg.grad_accum):
            x, y = train_loader.next_batch()
            x, y = x.to(cfg.device, non_blocking=True), y.to(cfg.device, non_blocking=True)
            with ctx:
                if teacher is None:
                    _, loss = train_model(x, y)
                else:
                    parts = distill_losses(train_model, teacher, crit, x, y)
                    loss = parts["loss"]
            (loss / cfg.grad_accum).backward()
        clear_weight_quant(model)  # the optimizer step below changes the weights
        params = [p for p in model.parameters() if p.grad is not None]
        stats = clip_gradients(params, clipper, cfg)
        log_now = (step + 1) % cfg.log_interval == 0
        muon_ms = optimizer_step(optimizer, device_type, timed=log_now)
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if log_now:
            # the one host read per logged step, after the optimizer step
            st = {k: float(stats[k]) for k in ("raw_norm", "clipped_norm", "was_clipped", "z_score")}
            loss_f = loss.item()
            dt = (time.time() - t0) / cfg.log_interval
            rec = {"step": step, "loss": loss_f, "lr": cfg.lr * mult, "lambda": lam,
                   "grad_norm_raw": st["raw_norm"], "grad_norm": st["clipped_norm"],
                   "clipped": int(st["was_clipped"]), "z": st["z_score"], "ms": 1000 * dt,
                   "tok_per_s": tokens_per_step / dt, "muon_ms": muon_ms}
            if teacher is not None:
                rec.update({k: float(parts[k]) for k in ("ce", "ld", "ad", "hidden")})
            print(f"step {step} | loss {loss_f:.4f} | lr {rec['lr']:.2e} | lambda {lam:.2f} | "
                  f"grad norm {st['raw_norm']:.3f} -> {st['clipped_norm']:.3f} (clipped {rec['clipped']}, "
                  f"z {st['z_score']:.2f}) | {rec['ms']:.0f} ms | {rec['tok_per_s']:.0f} tok/s" +
                  (f" | ce {rec['ce']:.4f} ld {rec['ld']:.4f} ad {rec['ad']:.5f} hidden {rec['hidden']:.4f}"
                   if teacher is not None else ""))
            metrics.write(json.dumps(rec) + "\n")
            t0 = time.time()
    metrics.close()
    print(f"final val loss {val_loss:.4f} (stage {cfg.stage}, {step} steps); checkpoint {ckpt_path}")
    return val_loss


if __name__ == "__main__":
    main(sys.argv[1:])
