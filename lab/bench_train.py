"""
python -m lab.bench --train (--train --model=M): what a training step costs.

--train times whole optimizer steps (every micro-batch's forward and backward, clipping, the
optimizer) at the device preset's shape and grad accumulation: on CUDA 8 micro-batches of 8 x 1024
tokens before one optimizer step (65,536 tokens, nanoGPT's config), bf16 autocast; on CPU the CPU
preset (1 x 16 x 256), fp32. The runs: the nanoGPT baseline (lab/nanogpt.py: AdamW, clip 1.0,
GPT-2's biases), ours fp (stage 1: Muon + ZClip), ours ternary QAT (stage 2; its weights quantised
once per step, as train.py does), eager and compiled (--runs= picks some). Then the work of one
eager step (aten ops and MB per phase, count_work: the same on any machine) and where each compiled
step's time goes (torch.profiler: GPU kernels on CUDA).
--profile (lab/bench_profile.py, built on this file's runs): where the CPU step's time goes.
--train --model=M: a pretrained model's shape against transformers' own training step and generate.

Results: lab/results/training-speed.md, lab/results/gpu.md, lab/results/smollm2-speed.md.
Test: python -m pytest tests/test_bench.py -k "train or work"
"""

import copy
import dataclasses
import time

import torch

from tools.flags import die
from tools.runtime import keep_freed_memory

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak, per GPU

RUNS = {  # key: (label, how to build and run it)
    "nanogpt": ("nanoGPT baseline (fp, AdamW)", dict(nanogpt=True)),
    "fp": ("ours fp (stage 1)", dict()),
    "qat": ("ours ternary QAT (stage 2)", dict(quant=True)),
    "qat_sep": ("ours ternary QAT, q/k/v gate/up unfused", dict(quant=True, fused=False)),
    "qat_bf16": ("ours ternary QAT, bf16 autocast", dict(quant=True, bf16=True)),  # CPU only
    "nanogpt_c": ("nanoGPT baseline, compiled", dict(nanogpt=True, compiled=True)),
    "fp_c": ("ours fp, compiled", dict(compiled=True)),
    "qat_c": ("ours ternary QAT, compiled", dict(quant=True, compiled=True)),
}


def check_runs(runs):
    """--runs: the keys of RUNS it names, in RUNS' order (all without it; qat_bf16 only on CPU)."""
    cuda = torch.cuda.is_available()
    if not runs:
        return [k for k in RUNS if not (cuda and k == "qat_bf16")]
    wanted = [r.strip() for r in runs.split(",") if r.strip()]
    valid = [k for k in RUNS if not (cuda and k == "qat_bf16")]
    if not wanted or any(r not in valid for r in wanted):
        die(f"--runs={runs}: expected some of {','.join(valid)} (comma-separated; qat_bf16 is "
            f"CPU-only: CUDA runs are all bf16)", 2)
    return [k for k in RUNS if k in wanted]


@dataclasses.dataclass
class Shape:
    """What every run of one --train benchmark shares: the device, the preset's config, the
    batches."""
    dev: str
    cfg: object  # tools.config.TrainConfig: the device preset's stage 1 with the shape overrides
    V: int
    x: torch.Tensor  # (accum, B, T) token ids, one row of micro-batches a step
    y: torch.Tensor

    @property
    def cuda(self):
        return self.dev == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def autocast(self, bf16=False):
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def train_shape(dev, shape):
    """The device preset's shape (shape: TrainConfig fields on top, e.g. a smaller model) and
    random batches."""
    from tools import checks
    cfg = checks.build_config({"device": dev, "stage": 1, **shape})
    V = 50304 if cfg.tokenizer == "gpt2" else 257
    g = torch.Generator(dev).manual_seed(0)
    size = (cfg.grad_accum, cfg.batch_size, cfg.block_size)
    x, y = (torch.randint(0, V, size, device=dev, generator=g) for _ in range(2))
    return Shape(dev, cfg, V, x, y)


def build(s, quant=False, nanogpt=False, fused=True, shape=None):
    """(model, optimizer, clipper or None) of one run: the nanoGPT baseline (its own AdamW at
    nanoGPT's defaults, clip_grad_norm_ 1.0) or ours (train.py's optimizer for the stage, ZClip)."""
    from model import GPT
    import train
    from tools import checks, config
    from zclip import ZClip
    torch.manual_seed(0)
    c = s.cfg
    if nanogpt:
        from lab import nanogpt as ng
        model = ng.GPT(ng.GPTConfig(block_size=c.block_size, vocab_size=s.V, n_layer=c.n_layer,
                                    n_head=c.n_head, n_embd=c.n_embd)).to(s.dev)
        return model, model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), s.dev), None
    cfg = checks.build_config({"device": s.dev, "stage": 2 if quant else 1, **(shape or {})})
    model = GPT(dataclasses.replace(config.model_config(cfg, s.V, s.V - 1), fused=fused)).to(s.dev)
    return model, train.configure_optimizer(model, cfg, s.dev), ZClip()


class Step:
    """One optimizer step of a run, in its phases: forward(i) and backward(loss) of micro-batch i,
    optimize()."""

    def __init__(self, s, model, opt, clipper, compiled=False, bf16=False):
        import quant
        self.s, self.model, self.opt, self.clipper, self.quant = s, model, opt, clipper, quant
        self.fwd = torch.compile(model) if compiled else model
        self.ctx = s.autocast(bf16)
        self.accum = s.x.size(0)
        # muon.Muon: its groups can be timed alone
        self.muon = any(g.get("kind") == "muon" for g in opt.param_groups)
        self.qat = getattr(getattr(model, "config", None), "quant", False)

    def forward(self, i):
        if i == 0 and self.qat and self.accum > 1:
            self.quant.cache_weight_quant(self.model)  # once per step, as train.train_step
        with self.ctx:
            return self.fwd(self.s.x[i], self.s.y[i])[1] / self.accum

    def backward(self, loss):
        loss.backward()

    def optimize(self, muon_ms=None):
        self.quant.clear_weight_quant(self.model)
        if self.clipper is None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        else:
            self.clipper.clip(self.model)
        if self.muon and muon_ms is not None:  # Muon's share: its groups timed alone, synchronised
            self.s.sync()
            t1 = time.perf_counter()
            self.opt.step(kinds=("muon",))
            self.s.sync()
            muon_ms.append(1000 * (time.perf_counter() - t1))
            self.opt.step(kinds=("adamw",))
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def __call__(self, muon_ms=None):
        for i in range(self.accum):
            self.backward(self.forward(i))
        self.optimize(muon_ms)

    def phases(self):
        """count_work's phases of one step, in the order they run."""
        loss = []
        micro = [(("forward", lambda i=i: loss.append(self.forward(i))),
                  ("backward", lambda: loss.pop().backward())) for i in range(self.accum)]
        return [p for pair in micro for p in pair] + [("optimizer", self.optimize)]


def time_steps(step, warmup, steps, sync):
    """(ms per step over the timed steps, seconds of the first step (compiles), Muon's ms of each
    step, the process's minor page faults per timed step (None where resource is missing))."""
    muon_ms, total, first, faults = [], 0.0, 0.0, 0
    for i in range(warmup + steps):
        sync()
        f0 = minor_faults()
        t0 = time.perf_counter()
        step(muon_ms)
        sync()
        if i == 0:
            first = time.perf_counter() - t0
        if i >= warmup:
            total += time.perf_counter() - t0
            faults = None if f0 is None else faults + minor_faults() - f0
    return 1000 * total / steps, first, muon_ms[warmup:], None if faults is None else faults / steps


def minor_faults():
    """Page faults this process took so far that the kernel served without I/O: a fresh page
    mapped and zeroed, as when a tensor lands in memory the allocator just got from the kernel."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def mfu(s, n_params, ms):
    """Model FLOPs utilisation against the GPU's bf16 peak ('' off the GPUs PEAK_BF16_FLOPS
    knows)."""
    c = s.cfg
    name = torch.cuda.get_device_name() if s.cuda else ""
    flops = 6 * n_params + 12 * c.n_layer * c.n_embd * c.block_size  # per token, PaLM appendix B
    tokens = s.x.numel()
    return next((f"{100 * flops * tokens / (ms / 1000) / peak:5.1f}%"
                 for key, peak in PEAK_BF16_FLOPS.items() if key in name), "")


def time_run(s, key, steps, warmup, profile_steps, shape=None):
    """One run of RUNS: its timing row printed; returns dict(ms, work (eager runs), profile
    (compiled runs))."""
    label, how = RUNS[key]
    model, opt, clipper = build(s, how.get("quant", False), how.get("nanogpt", False),
                                how.get("fused", True), shape)
    step = Step(s, model, opt, clipper, how.get("compiled", False), how.get("bf16", False))
    ms, first, muon_ms, faults = time_steps(step, warmup, steps, s.sync)
    n_params = sum(p.numel() for p in model.parameters())
    muon = f"{100 * sum(muon_ms) / steps / ms:5.1f}%" if muon_ms else "    -"
    print(f"{label:40s} {n_params / 1e6:7.2f}M {ms:9.1f} {s.x.numel() / ms * 1000:10.0f} "
          f"{muon:>7s} {mfu(s, n_params, ms):>6s} {first:8.1f} "
          f"{'-' if faults is None else f'{faults:.0f}':>7s}", flush=True)
    out = dict(ms=ms)
    if how.get("compiled"):
        out["profile"] = profile_ops(step, s.cuda, profile_steps)
    else:  # one more step, its ops and bytes counted phase by phase (eager: every op dispatches)
        out["work"] = count_work(step.phases())
    return out


def print_ratios(r):
    """The ratios between the timed runs that are there."""
    ms = {k: v["ms"] for k, v in r.items()}

    def ratio(a, b):
        return f"{ms[a] / ms[b]:.3f}" if a in ms and b in ms else "-"
    print(f"QAT / fp step time: eager {ratio('qat', 'fp')}, compiled {ratio('qat_c', 'fp_c')}; "
          f"ours fp / nanoGPT step time {ratio('fp', 'nanogpt')}; QAT fused / unfused projections "
          f"{ratio('qat', 'qat_sep')}")
    print(f"compiled, against the compiled nanoGPT step: ours fp {ratio('fp_c', 'nanogpt_c')} "
          f"(target <= 1.10), ours QAT {ratio('qat_c', 'nanogpt_c')} (target <= 1.25)")


def print_work(r):
    """The aten ops and MB of one eager step of each eager run, phase by phase, and ours over
    nanoGPT's: all bytes, and those outside the matmuls and attention (what a faster BLAS leaves as
    it is)."""
    work = {RUNS[k][0]: v["work"] for k, v in r.items() if "work" in v}
    if not work:
        return
    print("the work of one eager step, the same on any machine (aten ops dispatched / MB their "
          "tensors hold):")

    def total(w, i):
        return sum(v[i] for v in w.values())
    for label, w in work.items():
        print(f"  {label:40s} " + "  ".join(f"{k} {o:5d} / {b:8.1f}" for k, (o, b, _) in w.items()) +
              f"  total {total(w, 0):5d} / {total(w, 1):8.1f}, outside matmuls and attention "
              f"{total(w, 1) - total(w, 2):8.1f}")
    base = work.get(RUNS["nanogpt"][0])
    for key in ("fp", "qat"):
        if base and RUNS[key][0] in work:
            w = work[RUNS[key][0]]
            rest = (total(w, 1) - total(w, 2)) / (total(base, 1) - total(base, 2))
            print(f"{RUNS[key][0]} / nanoGPT: {total(w, 0) / total(base, 0):.2f}x the ops, "
                  f"{total(w, 1) / total(base, 1):.2f}x the bytes, {rest:.2f}x the bytes outside "
                  f"matmuls and attention")


def print_profiles(r):
    for key, v in r.items():
        if "profile" not in v:
            continue
        unit, total, ops = v["profile"]
        print(f"where a step of {RUNS[key][0]} goes: {v['ms']:.1f} ms/step timed, {total:.1f} ms "
              f"of {unit} time per step profiled; top ops by self {unit} time, ms per step:")
        for name, count, t in ops:
            print(f"  {name[:70]:70s} x{count:<5g} {t:8.2f} ms  {100 * t / total:5.1f}%")


def bench_train(steps=10, warmup=3, shape=None, profile_steps=2, runs=None, keep_memory=True):
    """ms/step, tokens/s and page faults per step of whole optimizer steps at the device preset's
    shape and grad accumulation (shape: TrainConfig fields on top), for each run of RUNS named in
    runs (default: all); then the ratios, the work of each eager step and where each compiled
    step's time goes. On CPU freed memory is kept for the next step as train.py keeps it
    (tools.runtime.keep_freed_memory), unless keep_memory=False (glibc's default). Returns {run:
    dict(ms, work or profile)}."""
    cuda = torch.cuda.is_available()
    kept = not cuda and keep_memory and keep_freed_memory()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    s = train_shape("cuda" if cuda else "cpu", shape or {})
    c, (accum, B, T) = s.cfg, s.x.shape
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; model {c.n_layer}x{c.n_embd}, {c.n_head} heads, "
          f"vocab {s.V}; "
          f"{accum} micro-batch(es) of {B} x {T} a step ({s.x.numel():,} tokens); "
          f"{'bf16 autocast' if cuda else 'fp32'}, Muon+ZClip unless noted"
          + ("" if cuda else f"; freed memory {'kept' if kept else 'given back (glibc default)'}"))
    print(f"{'run':40s} {'params':>8s} {'ms/step':>9s} {'tokens/s':>10s} {'muon %':>7s} "
          f"{'MFU':>6s} {'1st s':>8s} {'faults':>7s}")
    r = {key: time_run(s, key, steps, warmup, profile_steps, shape)
         for key in (runs or check_runs(""))}
    print_ratios(r)
    print_work(r)
    print_profiles(r)
    return r


def count_work(phases):
    """The work of one training step in counts that hold on any machine: {phase: (aten ops, MB they
    touch, MB of those in matmuls and attention)} for phases, a list of (name, function) run in
    order (forward, backward, optimizer; a name repeated, as each micro-batch's forward, adds up).
    An op touches the bytes of its tensor inputs and outputs (each read or written once: a lower
    bound of its memory traffic); an out=
    argument is its output, counted once, and an in-place op's tensor twice (read, then written).
    A view op (reshape, transpose, ...) and an op that only allocates (empty_like, new_empty) or
    only relabels (_unsafe_view) move none but are counted as ops, as each costs a dispatch."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    aten = torch.ops.aten
    moves_none = {aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided,
                  aten.new_empty_strided, aten._unsafe_view}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            if not func.is_view and func.overloadpacket not in moves_none:
                outs = {a.name for a in func._schema.arguments if a.is_out}  # written: the result
                inputs = (args, {k: v for k, v in (kwargs or {}).items() if k not in outs})
                b = sum(t.numel() * t.element_size() for t in tree_leaves((inputs, out))
                        if isinstance(t, torch.Tensor))
                self.bytes += b
                name = func.overloadpacket.__name__
                if name in ("mm", "addmm", "bmm", "baddbmm") or "scaled_dot_product" in name:
                    self.blas_bytes += b
            return out

    work = {}
    for name, fn in phases:
        with Count() as c:
            c.ops, c.bytes, c.blas_bytes = 0, 0, 0
            fn()
        ops, mb, blas = work.get(name, (0, 0.0, 0.0))
        work[name] = (ops + c.ops, mb + c.bytes / 1e6, blas + c.blas_bytes / 1e6)
    return work


def profile_ops(step, cuda, n, top=12):
    """(unit, total ms per step, [(op, calls per step, self ms per step)] of the top ops):
    torch.profiler over n calls of step(), by self time on the GPU (kernels) on CUDA, on the CPU
    elsewhere."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        def self_time(e):
            return getattr(e, "self_device_time_total", 0)
        events = gpu_work(prof.key_averages())
    else:
        def self_time(e):
            return e.self_cpu_time_total
        events = prof.key_averages()
    events = [e for e in events if self_time(e) > 0]
    total = sum(self_time(e) for e in events) / 1e3 / n
    events = sorted(events, key=lambda e: -self_time(e))[:top]
    ops = [(e.key, e.count / n, self_time(e) / 1e3 / n) for e in events]
    return ("GPU" if cuda else "CPU"), total, ops


def gpu_work(events):
    """The profiler's events that are GPU work, each once: kernels, copies, memsets (device CUDA). Not the CPU ops
    that launched them, whose self device time repeats their kernels', nor the GPU spans of user annotations
    (inductor's "## Call CompiledFxGraph ##"), which repeat the kernels inside them."""
    from torch.autograd import DeviceType
    return [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


# -----------------------------------------------------------------------------
# --train --model=M: a pretrained model's real shape


def load_pretrained(source, T):
    """(ours fp, ours QAT at lambda 1 with SubLN, transformers' model, T capped at the model's
    context) from a pretrained model; a model we do not import (GPT-2, a damaged file) is one error
    line naming it."""
    import quant
    from model import GPT
    from tools import pretrained
    from tools.pretrained import is_model_source
    if not is_model_source(source):
        die(f"--model={source}: not a pretrained model (a Hugging Face directory, a hub id or a "
            f".gguf file); python -m tools.get_model smollm2 fetches SmolLM2-135M", 2)
    try:  # ours first: a model we do not import is one ValueError line naming it
        from transformers import AutoModelForCausalLM
        # a short-context model: its own context
        T = min(T, pretrained.hf_config_of(source)[2].max_position_embeddings)
        fp = pretrained.from_pretrained(source, block_size=T)
        path, kw, _ = pretrained.hf_config_of(source)
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except (ValueError, OSError, KeyError, EOFError) as e:  # also a truncated or unreadable file
        die(f"--model={source}: {type(e).__name__ + ': ' if not isinstance(e, ValueError) else ''}"
            f"{str(e).strip().splitlines()[0] if str(e).strip() else 'cannot be read'}", 2)
    qat = GPT(dataclasses.replace(fp.config, quant=True, subln=True))
    qat.load_state_dict(fp.state_dict(), strict=False)
    quant.set_lambda(qat, 1.0)
    return fp, qat, theirs, T


def pretrained_train_ms(label, model, loss_fn, steps, warmup, tokens, optimizer="adamw"):
    """The median ms of `steps` optimizer steps (after warmup) of model on loss_fn(model): AdamW for
    all, or train.py's Muon + AdamW; printed as a row."""
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    else:
        import train
        from tools import checks
        cfg = checks.build_config({"device": "cpu", "stage": 2})
        opt = train.configure_optimizer(model, cfg, "cpu")
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        loss_fn(model).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(1000 * (time.perf_counter() - t0))
    ms = sorted(times[warmup:])[len(times[warmup:]) // 2]
    print(f"  {label:52s} {ms:9.0f} ms/step  {tokens / ms * 1000:7.0f} tokens/s")
    return ms


def generate_tps(label, fn, new_tokens):
    """tokens/s of fn(new_tokens) after a fn(4) warm-up, printed as a row."""
    fn(4)
    t0 = time.perf_counter()
    fn(new_tokens)
    tps = new_tokens / (time.perf_counter() - t0)
    print(f"  {label:52s} {tps:7.1f} tokens/s")
    return tps


def top_cpu_ops(what, fn, top=8):
    """Print where fn() spends its CPU time, by op (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"where {what} spends its {total / 1e3:.0f} ms of CPU time (top ops):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.key:45s} x{e.count:<5d} {e.self_cpu_time_total / 1e3:8.0f} ms  "
              f"{100 * e.self_cpu_time_total / total:5.1f}%")


def bench_pretrained(source, steps=3, warmup=1, B=4, T=256, new_tokens=64):
    """A pretrained model's real shape (lab/results/smollm2-speed.md: SmolLM2-135M): training steps
    of transformers' own model, ours fp and ours ternary QAT on one batch (fp32, this process's
    threads, AdamW for all, so the models are what differs), then greedy generation of new_tokens
    after the same prompt: transformers' generate, ours fp, and our packed ternary model (kernels/:
    int8 activations, 2-bit weights); finally where a QAT step's time goes (torch.profiler)."""
    from kernels.packed_linear import freeze_ternary
    fp, qat, theirs, T = load_pretrained(source, T)
    c = fp.config
    print(f"{source}: {c.n_layer} layers, width {c.n_embd}, {c.n_head} heads / {c.kv_heads()} kv "
          f"heads, vocab {c.vocab_size}; batch {B} x {T} tokens, fp32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, c.vocab_size, (B, T), generator=g) for _ in range(2))
    ours_loss = lambda m: m(x, y)[1]  # noqa: E731
    def hf_loss(m):
        return torch.nn.functional.cross_entropy(m(x).logits.flatten(0, 1), y.flatten())
    print("training step (forward, backward, clip, optimizer; median of", steps, "after", warmup,
          "warm-up):")
    r = {key: pretrained_train_ms(label, model, loss, steps, warmup, B * T, opt)
         for key, label, model, loss, opt in (
        ("hf", "transformers LlamaForCausalLM (fp, AdamW)", theirs.train(), hf_loss, "adamw"),
        ("fp", "ours fp (AdamW)", fp.train(), ours_loss, "adamw"),
        ("qat", "ours ternary QAT, SubLN, lambda 1 (AdamW)", qat.train(), ours_loss, "adamw"),
        ("qat_muon", "ours ternary QAT, SubLN, lambda 1 (Muon + AdamW)", qat, ours_loss, "muon"))}
    print(f"ours fp / transformers: {r['fp'] / r['hf']:.3f}; ours QAT / transformers: "
          f"{r['qat'] / r['hf']:.3f}; QAT / ours fp: {r['qat'] / r['fp']:.3f}; Muon's optimizer "
          f"step costs {r['qat_muon'] - r['qat']:.0f} ms more than AdamW's")
    prompt = x[:1, :16]
    packed = freeze_ternary(copy.deepcopy(qat).eval())  # what the packed export holds
    print(f"greedy generation, {new_tokens} new tokens after a 16-token prompt, batch 1:")
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = {"hf": generate_tps("transformers generate (fp, KV cache)",
                                  lambda n: theirs.eval().generate(
                                      prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      attention_mask=torch.ones_like(prompt)), new_tokens),
               "fp": generate_tps("ours fp (KV cache)",
                                  lambda n: fp.eval().generate(prompt, n, top_k=1), new_tokens),
               "packed": generate_tps("ours packed ternary (int8 x 2-bit kernels, KV cache)",
                                      lambda n: packed.generate(prompt, n, top_k=1), new_tokens)}
    print(f"packed / transformers tokens/s: {gen['packed'] / gen['hf']:.2f}; ours fp / "
          f"transformers: {gen['fp'] / gen['hf']:.2f}")
    top_cpu_ops("one QAT forward+backward", lambda: ours_loss(qat.train()).backward())
    with torch.no_grad():
        top_cpu_ops("the packed model generating 8 tokens",
                    lambda: packed.generate(prompt, 8, top_k=1))
