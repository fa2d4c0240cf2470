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
from model import GPT, GPTConfig
from quant import set_lambda


@dataclass
class TrainConfig:
    stage: int = 2               # 1 = fp pre-training, 2 = ternary continued pre-training, 3 = distillation
    device: str = "auto"         # auto = cuda if available, else cpu; also picks the device preset below
    out_dir: str = "out"         # checkpoints and metrics go to <out_dir>/stage<N>/
    resume: bool = False         # continue from <out_dir>/stage<N>/ckpt.pt
    init_from: str = "auto"      # stage 2: auto = the stage-1 checkpoint if it exists, else scratch; or a path; or "scratch"
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
    optimizer: str = "adamw"
    lr: float = 3e-3             # peak learning rate
    min_lr_frac: float = 0.1     # final lr = min_lr_frac * lr
    schedule: str = "wsd"        # cosine (nanoGPT) or wsd (warmup-stable-decay, MiniCPM)
    warmup_iters: int = 50
    decay_frac: float = 0.2      # wsd: decay over the last 20% of steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0       # 0 = off
    lambda_warmup_steps: int = 200  # stage 2: lambda goes 0 -> 1 linearly over this many steps
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
    3: dict(),
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
    if cfg.optimizer not in ("adamw",):
        die(f"--optimizer={cfg.optimizer}: expected adamw", 2)
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        die(f"n_embd={cfg.n_embd} must split into n_head={cfg.n_head} heads of even size", 2)
    return cfg


def lr_mult(step, cfg):
    """Multiplier on every group's peak lr: warmup-cosine (nanoGPT) or warmup-stable-decay (MiniCPM)."""
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
    """REFERENCE section 1: lambda = min(step / warmup_steps, 1); 0 = full precision, 1 = ternary."""
    return 1.0 if cfg.lambda_warmup_steps <= 0 else min(step / cfg.lambda_warmup_steps, 1.0)


def configure_optimizer(model, cfg, device_type):
    """AdamW: weight decay on matrices (>= 2-D), none on norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device_type == "cuda")
    for g in opt.param_groups:
        g["initial_lr"] = cfg.lr
    return opt


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


def load_weights(model, state, path):
    """Load a state dict; lambda_ buffers may be missing (an fp checkpoint into a ternary model)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lambda_")]
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
    out_dir = os.path.join(cfg.out_dir, f"stage{cfg.stage}")
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    ckpt = None
    if cfg.resume:
        if not os.path.exists(ckpt_path):
            die(f"--resume=True but there is no checkpoint at {ckpt_path}; start without --resume")
        ckpt = load_checkpoint(ckpt_path)
        cfg = build_config(overrides, base=ckpt["config"])  # the saved run, with command-line overrides on top
    if cfg.stage == 3:
        die("stage 3 (distillation) is not implemented yet; run --stage=1 then --stage=2")
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
    elif cfg.stage == 2 and cfg.init_from != "scratch":
        init_path = os.path.join(cfg.out_dir, "stage1", "ckpt.pt") if cfg.init_from == "auto" else cfg.init_from
        if os.path.exists(init_path):
            load_weights(model, load_checkpoint(init_path)["model"], init_path)
            print(f"stage 2: starting from the stage-1 weights in {init_path}")
        elif cfg.init_from == "auto":
            print(f"stage 2: no stage-1 checkpoint at {init_path}; training the ternary model from scratch")
        else:
            die(f"--init_from={init_path}: no such checkpoint")
    else:
        print(f"stage {cfg.stage}: training from scratch")
    model.to(cfg.device)
    optimizer = configure_optimizer(model, cfg, device_type)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    print(f"{model.get_num_params() / 1e6:.2f}M non-embedding params, quant={gptconf.quant}, subln={gptconf.subln}, "
          f"vocab={gptconf.vocab_size}, device={cfg.device}, dtype={dtype}")
    use_compile = cfg.compile == "true" or (cfg.compile == "auto" and device_type == "cuda")
    train_model = torch.compile(model) if use_compile else model

    def checkpoint():
        save_checkpoint(ckpt_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                    "config": dataclasses.asdict(cfg), "model_args": dataclasses.asdict(gptconf),
                                    "loader": train_loader.state_dict()})

    metrics = open(os.path.join(out_dir, "metrics.jsonl"), "a")
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum
    val_loss = None
    t0 = time.time()
    while True:
        lam = lambda_at(step, cfg) if gptconf.quant else 0.0
        if gptconf.quant:
            set_lambda(model, lam)
        if step > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_iters):
            val_loss = estimate_val_loss(train_model, val_loader, cfg, ctx)
            print(f"step {step}: val loss {val_loss:.4f}")
            metrics.write(json.dumps({"step": step, "val_loss": val_loss, "lambda": lam}) + "\n")
            metrics.flush()
            checkpoint()
            t0 = time.time()  # do not count eval time in the next step's timing
        if step >= cfg.max_iters:
            break
        mult = lr_mult(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"] * mult
        for _ in range(cfg.grad_accum):
            x, y = train_loader.next_batch()
            x, y = x.to(cfg.device, non_blocking=True), y.to(cfg.device, non_blocking=True)
            with ctx:
                _, loss = train_model(x, y)
            (loss / cfg.grad_accum).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % cfg.log_interval == 0:
            loss_f, norm_f = loss.item(), grad_norm.item()  # the one host sync, after the step
            dt = (time.time() - t0) / cfg.log_interval
            rec = {"step": step, "loss": loss_f, "lr": cfg.lr * mult, "lambda": lam, "grad_norm": norm_f,
                   "ms": 1000 * dt, "tok_per_s": tokens_per_step / dt}
            print(f"step {step} | loss {loss_f:.4f} | lr {rec['lr']:.2e} | lambda {lam:.2f} | "
                  f"grad norm {norm_f:.3f} | {rec['ms']:.0f} ms | {rec['tok_per_s']:.0f} tok/s")
            metrics.write(json.dumps(rec) + "\n")
            t0 = time.time()
    metrics.close()
    print(f"final val loss {val_loss:.4f} (stage {cfg.stage}, {step} steps); checkpoint {ckpt_path}")
    return val_loss


if __name__ == "__main__":
    main(sys.argv[1:])
