"""
Benchmarks. Every speed number in the results pages comes from one of these commands.

  python -m lab.bench            Triton ternary matmul (decode: dp4a, prefill: int8 MMA) vs bf16 F.linear (CUDA only;
                             prints a note and exits 0 without a GPU)
  python -m lab.bench --data     tokeniser throughput on the shipped corpus (target: gpt2 >= 2M tokens/s on 2 cores)
  python -m lab.bench --muon     Newton-Schulz (NS5) in bf16 vs fp32 on the hidden matrices of the CPU model
  python -m lab.bench --train    full training steps: nanoGPT baseline vs ours fp vs ours ternary QAT, eager and
                             compiled, with the QAT/dense ratio, Muon's share and MFU (GPU); CPU or CUDA preset;
                             then the top ops of each compiled step by self time (GPU kernels on CUDA)
  python -m lab.bench --profile  where the CPU step time goes (torch.profiler), ours fp vs the nanoGPT baseline
  python -m lab.bench --decode   batch-1 greedy decoding, tokens/s: fp bf16 vs packed ternary, model.generate and
                             tools/decode.py's static KV cache, eager and replayed as a CUDA graph (CUDA preset's
                             model; on CPU a tiny fp32 model, eager only), with the packed/fp ratio from one run
  python -m lab.bench --quality  time to quality: wall time for the quick start (python train.py --stage=2) and a
                             nanoGPT-shaped fp baseline to reach the same val loss, as a ratio from one run

Kernel timing: triton.testing.do_bench (median of many runs), with the weights rotated through enough
copies to exceed L2, so each call streams its weights from HBM as a real decode step does. Bandwidth is
reported against a measured device-to-device copy (read + write bytes / time).
"""

import signal
if __name__ == "__main__":  # Ctrl-C while the imports load: stop at once, no traceback (flags.parse restores it)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from tools.flags import die, parse


def bench_data():
    from tokenizer import TOKENIZERS
    from tools import prepare
    for name in TOKENIZERS:  # the built-in ones
        prepare.tokenize_throughput(name)  # warm-up: builds the encoder, reads the corpus
        rates = sorted(prepare.tokenize_throughput(name) for _ in range(3))
        print(f"{name:5s} tokeniser: {rates[1] / 1e6:7.2f} M tokens/s (median of 3, encode_batch on the "
              f"shipped corpus, {torch.get_num_threads()} threads)")


def bench_muon():
    from model import GPT, GPTConfig
    from muon import split_muon_params, zeropower_via_newtonschulz5
    model = GPT(GPTConfig())  # the CPU preset's shape
    mats = [p.detach() for p in split_muon_params(model)[0]]
    for dtype in (torch.bfloat16, torch.float32):
        for _ in range(2):
            [zeropower_via_newtonschulz5(m, dtype=dtype) for m in mats]
        t = time.perf_counter()
        for _ in range(5):
            [zeropower_via_newtonschulz5(m, dtype=dtype) for m in mats]
        ms = (time.perf_counter() - t) / 5 * 1000
        print(f"NS5 on the {len(mats)} hidden matrices of the CPU model, {str(dtype):15s}: {ms:8.1f} ms per step")


class NanoGPTBlock(torch.nn.Module):
    """nanoGPT's block, written out here as the baseline: LayerNorm, fused qkv, GELU MLP 4x, biases (bias=True)."""

    def __init__(self, C, n_head, bias=True):
        super().__init__()
        nn = torch.nn
        self.ln_1, self.ln_2, self.n_head = nn.LayerNorm(C, bias=bias), nn.LayerNorm(C, bias=bias), n_head
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C, bias=bias), nn.Linear(C, C, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C, bias=bias), nn.GELU(), nn.Linear(4 * C, C, bias=bias))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(torch.nn.Module):
    """nanoGPT's GPT with its initialisation: N(0, 0.02), zero biases, residual projections 0.02 / sqrt(2 n_layer)."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, bias=True):
        super().__init__()
        nn = torch.nn
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([NanoGPTBlock(n_embd, n_head, bias) for _ in range(n_layer)])
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd, bias=bias), nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:  # Linear and Embedding weights
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("c_proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak, per GPU


def bench_train(steps=10, warmup=3, shape=None, profile_steps=2):
    """ms/step and tokens/s of full training steps (forward, backward, clipping, optimizer) for one shape: the
    device preset's (shape: TrainConfig fields on top, e.g. a smaller model), then where a compiled step's time
    goes, op by op (torch.profiler over profile_steps steps), for nanoGPT, ours fp and ours QAT."""
    from tools import config, plumbing
    from model import GPT
    from zclip import ZClip
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    shape = shape or {}
    base = config.build_config({"device": dev, "stage": 2, **shape})  # the device preset's model shape
    B, T, V = base.batch_size, base.block_size, 50304 if base.tokenizer == "gpt2" else 257
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"device: {name}, torch {torch.__version__}, {torch.get_num_threads()} threads; model "
          f"{base.n_layer}x{base.n_embd}, {base.n_head} heads, B={B}, T={T}, vocab {V}; "
          f"{'bf16 autocast' if cuda else 'fp32'}, Muon+ZClip unless noted")
    x = torch.randint(0, V, (B, T), device=dev)
    y = torch.randint(0, V, (B, T), device=dev)
    profiles, work = {}, {}

    def run(label, quant, compile_=False, nanogpt=False, autocast=None, fused=True, profile_=False):
        torch.manual_seed(0)
        cfg = config.build_config({"device": dev, "stage": 2 if quant else 1, **shape})
        if nanogpt:
            model = NanoGPT(V, T, cfg.n_layer, cfg.n_head, cfg.n_embd).to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=cuda)
        else:
            model = GPT(dataclasses.replace(config.model_config(cfg, V, V - 1), fused=fused)).to(dev)
            opt = plumbing.configure_optimizer(model, cfg, dev)
        clipper = None if nanogpt else ZClip()
        step_model = torch.compile(model) if compile_ else model
        c = ctx if autocast is None else autocast
        muon = any(g.get("kind") == "muon" for g in opt.param_groups)  # muon.Muon: time its Muon groups alone

        def forward():
            with c:
                return step_model(x, y)[1]

        def optimize():
            if clipper is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                clipper.clip(model)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def step(muon_ms=None):
            loss = forward()
            loss.backward()
            if clipper is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                clipper.clip(model)
            if muon and muon_ms is not None:
                sync()
                t1 = time.perf_counter()
                opt.step(kinds=("muon",))
                sync()
                muon_ms.append(1000 * (time.perf_counter() - t1))
                opt.step(kinds=("adamw",))
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)

        muon_ms, t_total, t_first = [], 0.0, 0.0
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            step(muon_ms)
            sync()
            if i == 0:
                t_first = time.perf_counter() - t0  # includes compilation for compiled runs
            if i >= warmup:
                t_total += time.perf_counter() - t0
        ms = 1000 * t_total / steps
        n_params = sum(p.numel() for p in model.parameters())
        flops = 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * T  # per token, PaLM appendix B
        mfu = ""
        for key, peak in PEAK_BF16_FLOPS.items():
            if cuda and key in name:
                mfu = f"{100 * flops * B * T / (ms / 1000) / peak:5.1f}%"
        muon_share = f"{100 * sum(muon_ms[warmup:]) / steps / ms:5.1f}%" if muon_ms else "    -"
        print(f"{label:34s} {n_params / 1e6:7.2f}M {ms:9.1f} {B * T / ms * 1000:10.0f} {muon_share:>7s} {mfu:>6s} "
              f"{t_first:8.1f}")
        if profile_:
            profiles[label] = (ms, profile_ops(step, cuda, profile_steps))
        if not compile_:  # one more step, its ops and bytes counted phase by phase (eager: every op dispatches)
            loss = []
            counted = count_work([("forward", lambda: loss.append(forward())), ("backward", lambda: loss[0].backward()),
                                  ("optimizer", optimize)])
            work[label] = counted
        return ms

    print(f"{'run':34s} {'params':>8s} {'ms/step':>9s} {'tokens/s':>10s} {'muon %':>7s} {'MFU':>6s} {'1st s':>8s}")
    r = {"nanogpt": run("nanoGPT baseline (fp, AdamW)", False, nanogpt=True),
         "dense": run("ours fp (stage 1)", False),
         "qat": run("ours ternary QAT (stage 2)", True),
         "qat_sep": run("ours ternary QAT, q/k/v gate/up unfused", True, fused=False)}
    if not cuda:
        r["qat_bf16"] = run("ours ternary QAT, bf16 autocast", True, autocast=torch.autocast("cpu", torch.bfloat16))
    r["nanogpt_c"] = run("nanoGPT baseline, compiled", False, nanogpt=True, compile_=True, profile_=True)
    r["dense_c"] = run("ours fp, compiled", False, compile_=True, profile_=True)
    r["qat_c"] = run("ours ternary QAT, compiled", True, compile_=True, profile_=True)
    print(f"QAT / dense step time: eager {r['qat'] / r['dense']:.3f}, compiled {r['qat_c'] / r['dense_c']:.3f}; "
          f"ours fp / nanoGPT step time {r['dense'] / r['nanogpt']:.3f}; QAT fused / unfused projections "
          f"{r['qat'] / r['qat_sep']:.3f}")
    print(f"compiled, against the compiled nanoGPT step: ours fp {r['dense_c'] / r['nanogpt_c']:.3f} (target <= 1.10), "
          f"ours QAT {r['qat_c'] / r['nanogpt_c']:.3f} (target <= 1.25)")
    print("the work of one eager step, the same on any machine (aten ops dispatched / MB their tensors hold):")
    for label, w in work.items():
        ops, mb = sum(o for o, _ in w.values()), sum(b for _, b in w.values())
        print(f"  {label:40s} " + "  ".join(f"{k} {o:5d} / {b:8.1f}" for k, (o, b) in w.items()) +
              f"  total {ops:5d} / {mb:8.1f}")
    base = work["nanoGPT baseline (fp, AdamW)"]
    summed = lambda w, i: sum(v[i] for v in w.values())  # noqa: E731
    for label in ("ours fp (stage 1)", "ours ternary QAT (stage 2)"):
        print(f"{label} / nanoGPT: {summed(work[label], 0) / summed(base, 0):.2f}x the ops, "
              f"{summed(work[label], 1) / summed(base, 1):.2f}x the bytes")
    for label, (ms, (unit, total, ops)) in profiles.items():
        print(f"where a step of {label} goes: {ms:.1f} ms/step timed, {total:.1f} ms of {unit} time per step "
              f"profiled; top ops by self {unit} time, ms per step:")
        for key, count, t in ops:
            print(f"  {key[:70]:70s} x{count:<5g} {t:8.2f} ms  {100 * t / total:5.1f}%")
    return r


def count_work(phases):
    """The work of one training step in counts that hold on any machine: {phase: (aten ops, MB they touch)} for
    phases, a list of (name, function) run in order (forward, backward, optimizer). An op touches the bytes of its
    tensor inputs and outputs (each read or written once: a lower bound of its memory traffic); a view op
    (reshape, transpose, ...) moves none but is counted as an op, as it costs a dispatch."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            if not func.is_view:
                self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                  if isinstance(t, torch.Tensor))
            return out

    work = {}
    for name, fn in phases:
        with Count() as c:
            c.ops, c.bytes = 0, 0
            fn()
        work[name] = (c.ops, c.bytes / 1e6)
    return work


def profile_ops(step, cuda, n, top=12):
    """(unit, total ms per step, [(op, calls per step, self ms per step)] of the top ops): torch.profiler over n
    calls of step(), by self time on the GPU (kernels) on CUDA, on the CPU elsewhere."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    self_time = (lambda e: getattr(e, "self_device_time_total", 0)) if cuda else (lambda e: e.self_cpu_time_total)
    events = [e for e in events if self_time(e) > 0]
    total = sum(self_time(e) for e in events) / 1e3 / n
    ops = [(e.key, e.count / n, self_time(e) / 1e3 / n) for e in sorted(events, key=lambda e: -self_time(e))[:top]]
    return ("GPU" if cuda else "CPU"), total, ops


def bench_pretrained(source, steps=3, warmup=1, B=4, T=256, new_tokens=64):
    """A pretrained model's real shape (lab/results/smollm2-speed.md: SmolLM2-135M): training steps of
    transformers' own model, ours fp and ours ternary QAT on one batch (fp32, this process's threads, AdamW for all,
    so the models are what differs), then greedy generation of new_tokens after the same prompt: transformers'
    generate, ours fp, and our packed ternary model (kernels/: int8 activations, 2-bit weights); finally where a
    QAT step's time goes (torch.profiler)."""
    import copy
    import quant
    from kernels.packed_linear import freeze_ternary
    from model import GPT
    from tools import pretrained
    from tools.load import is_model_source
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM
    if not is_model_source(source):
        die(f"--model={source}: not a pretrained model (a Hugging Face directory, a hub id or a .gguf file); "
            f"python -m tools.get_model smollm2 fetches SmolLM2-135M", 2)
    try:  # ours first: a model we do not import (GPT-2, a damaged file) is one ValueError line naming it
        T = min(T, pretrained.hf_config_of(source)[2].max_position_embeddings)  # a short-context model: its own
        fp = pretrained.from_pretrained(source, block_size=T)
        path, kw, _ = pretrained.hf_config_of(source)
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except ValueError as e:
        die(f"--model={source}: {e}", 2)
    qat = GPT(dataclasses.replace(fp.config, quant=True, subln=True))
    qat.load_state_dict(fp.state_dict(), strict=False)
    quant.set_lambda(qat, 1.0)
    c = fp.config
    print(f"{source}: {c.n_layer} layers, width {c.n_embd}, {c.n_head} heads / {c.kv_heads()} kv heads, vocab "
          f"{c.vocab_size}; batch {B} x {T} tokens, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, c.vocab_size, (B, T), generator=g) for _ in range(2))

    def train_ms(label, model, loss_fn, optimizer="adamw"):
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        else:
            from tools import config, plumbing
            opt = plumbing.configure_optimizer(model, config.build_config({"device": "cpu", "stage": 2}), "cpu")
        times = []
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            loss_fn(model).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(1000 * (time.perf_counter() - t0))
        ms = sorted(times[warmup:])[len(times[warmup:]) // 2]
        print(f"  {label:52s} {ms:9.0f} ms/step  {B * T / ms * 1000:7.0f} tokens/s")
        return ms

    ours_loss = lambda m: m(x, y)[1]  # noqa: E731
    print("training step (forward, backward, clip, optimizer; median of", steps, "after", warmup, "warm-up):")
    hf_loss = lambda m: torch.nn.functional.cross_entropy(m(x).logits.flatten(0, 1), y.flatten())  # noqa: E731
    r = {"hf": train_ms("transformers LlamaForCausalLM (fp, AdamW)", theirs.train(), hf_loss),
         "fp": train_ms("ours fp (AdamW)", fp.train(), ours_loss),
         "qat": train_ms("ours ternary QAT, SubLN, lambda 1 (AdamW)", qat.train(), ours_loss),
         "qat_muon": train_ms("ours ternary QAT, SubLN, lambda 1 (Muon + AdamW)", qat, ours_loss, "muon")}
    print(f"ours fp / transformers: {r['fp'] / r['hf']:.3f}; ours QAT / transformers: {r['qat'] / r['hf']:.3f}; "
          f"QAT / ours fp: {r['qat'] / r['fp']:.3f}; Muon's optimizer step costs {r['qat_muon'] - r['qat']:.0f} ms "
          f"more than AdamW's")

    prompt = x[:1, :16]
    packed = freeze_ternary(copy.deepcopy(qat).eval())  # what the packed export holds, built in place

    def gen_tps(label, fn):
        fn(4)  # warm-up
        t0 = time.perf_counter()
        fn(new_tokens)
        tps = new_tokens / (time.perf_counter() - t0)
        print(f"  {label:52s} {tps:7.1f} tokens/s")
        return tps
    print(f"greedy generation, {new_tokens} new tokens after a 16-token prompt, batch 1:")
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = {"hf": gen_tps("transformers generate (fp, KV cache)", lambda n: theirs.eval().generate(
                   prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(prompt))),
               "fp": gen_tps("ours fp (KV cache)", lambda n: fp.eval().generate(prompt, n, top_k=1)),
               "packed": gen_tps("ours packed ternary (int8 x 2-bit kernels, KV cache)",
                                 lambda n: packed.generate(prompt, n, top_k=1))}
    print(f"packed / transformers tokens/s: {gen['packed'] / gen['hf']:.2f}; ours fp / transformers: "
          f"{gen['fp'] / gen['hf']:.2f}")

    def top_ops(what, fn):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        print(f"where {what} spends its {total / 1e3:.0f} ms of CPU time (top ops):")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]:
            print(f"  {e.key:45s} x{e.count:<5d} {e.self_cpu_time_total / 1e3:8.0f} ms  "
                  f"{100 * e.self_cpu_time_total / total:5.1f}%")
    top_ops("one QAT forward+backward", lambda: ours_loss(qat.train()).backward())
    with torch.no_grad():
        top_ops("the packed model generating 8 tokens", lambda: packed.generate(prompt, 8, top_k=1))


def val_windows(shard_dir, T, n):
    """n windows of T+1 tokens spread evenly over the val split (the same ones for every model): (n, T+1) int64."""
    import data
    import numpy as np
    tokens = np.concatenate([data.read_shard(p) for p in data.find_shards(shard_dir, "val")])
    starts = np.linspace(0, len(tokens) - T - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[i:i + T + 1].astype(np.int64) for i in starts]))


@torch.no_grad()
def window_loss(model, windows, batch=16):
    """Mean next-token cross-entropy over the windows (plumbing.token_loss_sums), in eval mode (then train mode)."""
    from tools.plumbing import token_loss_sums
    model.eval()
    batches = ((w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows.split(batch))
    total, n = token_loss_sums(lambda x, y: model(x, y)[1], batches, windows.device).tolist()
    model.train()
    return total / n


def time_to(points, target):
    """Seconds of training when the val loss first reaches target, linear between evaluations: points are
    (step, seconds, loss). Returns (seconds, step) as floats, or None if it never does. A first point already at
    the target counts at its own time (our points start where lambda reaches 1: nothing to interpolate from)."""
    if points and points[0][2] <= target:
        return points[0][1], points[0][0]
    for (s0, t0, l0), (s1, t1, l1) in zip(points, points[1:]):
        if l1 <= target:
            f = (l0 - target) / (l0 - l1) if l0 > target else 0.0
            return t0 + f * (t1 - t0), s0 + f * (s1 - s0)
    return None


def bench_quality(train_args="", target=0.0, every=20, windows=64):
    """Time to quality on the CPU quick start's workload. Both runs read the same batches of the same shards
    (one copy of our train loader), with the same shape (n_layer, n_head, n_embd, B, T) and steps, and are
    evaluated on the same val windows every `every` steps; only the training steps are timed. The baseline is
    nanoGPT's recipe in fp32 (no bias, AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on matrices, 100
    warm-up steps, cosine to 1e-4, clip 1.0; shakespeare_char's optimizer with train.py's bias=False and
    dropout 0). The target is the baseline's final val loss unless --target is given. Ours counts only as a
    ternary model: from the step where lambda reaches 1 (the end of --lambda_warmup_steps) on, since before that
    the run trains a blend of fp and ternary weights, which is not what it exports."""
    extra = check_quality(train_args, target)  # before anything is set up: a run that could not end as asked
    import copy
    import tempfile
    import train
    from tools import plumbing
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--stage=2", "--device=cpu", f"--out_dir={tmp}"] + extra
        run = train.setup(argv)
        try:
            cfg = run.cfg
            B, T, V = cfg.batch_size * cfg.grad_accum, cfg.block_size, run.model.config.vocab_size
            val = val_windows(next(iter(plumbing.resolve_data(cfg))), T, windows)
            print(f"time to quality: {cfg.max_iters} steps of {B} x {T} tokens, {cfg.n_layer} x {cfg.n_embd}, "
                  f"{cfg.n_head} heads, {torch.get_num_threads()} threads; val loss on {len(val)} fixed val windows "
                  f"every {every} steps (not timed)", flush=True)
            loader = copy.deepcopy(run.train_loader)  # the baseline reads exactly our batches
            torch.manual_seed(cfg.seed)
            base = NanoGPT(V, T, cfg.n_layer, cfg.n_head, cfg.n_embd, bias=False)
            decay = [p for p in base.parameters() if p.dim() >= 2]
            other = [p for p in base.parameters() if p.dim() < 2]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                    lr=1e-3, betas=(0.9, 0.99))

            def base_step(step):
                warm, total = 100, cfg.max_iters
                lr = 1e-3 * (step + 1) / (warm + 1) if step < warm else 1e-4 + 0.5 * (1e-3 - 1e-4) * (
                    1 + math.cos(math.pi * min((step - warm) / max(total - warm, 1), 1.0)))
                for g in opt.param_groups:
                    g["lr"] = lr
                for _ in range(cfg.grad_accum):
                    x, y = loader.next_batch()
                    (base(x, y)[1] / cfg.grad_accum).backward()
                torch.nn.utils.clip_grad_norm_(base.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            def ours_step(step):
                train.train_step(run, step, False)

            def ours_eval(step):  # None until lambda reaches 1: before that the model is not ternary yet
                if train.lambda_at(step, cfg) < 1:
                    return None
                train.set_step_lambda(run, step)
                return window_loss(run.model, val)

            curves = {}
            for name, step_fn, eval_fn, stop_at in (("nanoGPT", base_step, lambda s: window_loss(base, val), None),
                                                    ("ours", ours_step, ours_eval, "target")):
                points, t = [(0, 0.0, eval_fn(0))], 0.0
                points = [p for p in points if p[2] is not None]
                goal = target or curves.get("nanoGPT", [(0, 0, 0.0)])[-1][2]
                for step in range(cfg.max_iters):
                    t0 = time.perf_counter()
                    step_fn(step)
                    t += time.perf_counter() - t0
                    if (step + 1) % every == 0 or step + 1 == cfg.max_iters or (
                            name == "ours" and not points and train.lambda_at(step + 1, cfg) >= 1):
                        loss = eval_fn(step + 1)  # ours: from the first step at lambda 1 on
                        if loss is not None:
                            points.append((step + 1, t, loss))
                        if stop_at and points and points[-1][2] <= goal:
                            break
                curves[name] = points
                s, _, loss = points[-1]
                print(f"{name:8s}: val {loss:.4f} at step {s} after {points[-1][1]:.1f} s "
                      f"({1000 * points[-1][1] / s:.0f} ms/step)", flush=True)
        finally:
            if run.unlock:
                run.unlock()
            run.rt.close()
    goal = target or curves["nanoGPT"][-1][2]
    got = {name: time_to(points, goal) for name, points in curves.items()}
    print(f"target val loss {goal:.4f} ({'--target' if target else 'the baseline’s final'}):")
    for name, g in got.items():
        print(f"  {name:8s}: " + (f"{g[0]:.3g} s, at step {g[1]:.0f}" if g else "not reached"))
    if got["nanoGPT"] and got["ours"] and got["nanoGPT"][0] == 0:  # no time to divide by
        print(f"time to quality, ours / nanoGPT: none: the baseline's val loss at step 0 is already at or below "
              f"{goal:.4f}; pass a lower --target")
    elif got["nanoGPT"] and got["ours"]:
        print(f"time to quality, ours / nanoGPT: {got['ours'][0] / got['nanoGPT'][0]:.3f}")
    return got


def check_quality(train_args, target):
    """--quality's options, checked before either run starts: --target must be a val loss a run can reach (finite,
    > 0; 0 = the baseline's final), and --train_args must split as a shell would. Returns the split flags."""
    import shlex
    if not math.isfinite(target) or target < 0:
        die(f"--target={target:g}: expected a val loss > 0 to reach (a cross-entropy is never below 0), or 0 for the "
            f"baseline's final val loss", 2)
    try:
        return shlex.split(train_args)
    except ValueError as e:  # an unclosed quote or a trailing backslash
        die(f"--train_args={train_args}: cannot split it into flags ({e}); close each quote, e.g. "
            f"--train_args='--lr=3e-3 --max_iters=100'", 2)


def bench_profile():
    """Where the CPU step time goes: torch.profiler over 2 forward+backward passes, ours fp vs nanoGPT."""
    from tools import config
    from model import GPT
    from torch.profiler import ProfilerActivity, profile
    cfg = config.build_config({"device": "cpu", "stage": 1})
    B, T = cfg.batch_size, cfg.block_size
    x, y = torch.randint(0, 257, (B, T)), torch.randint(0, 257, (B, T))
    for name, model in (("ours fp", GPT(config.model_config(cfg, 257, 256))),
                        ("nanoGPT", NanoGPT(257, T, cfg.n_layer, cfg.n_head, cfg.n_embd))):
        for _ in range(2):
            model(x, y)[1].backward()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(2):
                model(x, y)[1].backward()
        events = prof.key_averages(group_by_input_shape=True)
        total = sum(e.self_cpu_time_total for e in events)
        print(f"{name}: {total / 1e3:.0f} ms of CPU time for 2 forward+backward passes; top ops:")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]:
            print(f"  {e.key:45s} x{e.count:<4d} {e.self_cpu_time_total / 1e3:8.0f} ms  {e.input_shapes}")


def bench_kernels():
    if not torch.cuda.is_available():
        print("bench.py: no CUDA device here; the kernel benchmark needs a GPU (the kernels are tested on CPU "
              "under TRITON_INTERPRET=1: python -m pytest tests/test_kernels.py)")
        return
    import torch.nn.functional as F
    from triton.testing import do_bench
    from kernels.ternary_matmul import DECODE_MAX_M, quantize_activations, ternary_matmul
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    buf = torch.empty(2**30, dtype=torch.uint8, device=dev)  # 1 GiB device-to-device copy
    out = torch.empty_like(buf)
    copy_s = do_bench(lambda: out.copy_(buf)) / 1e3
    copy_bw = 2 * buf.numel() / copy_s
    print(f"measured device-to-device copy: {copy_bw / 1e9:.0f} GB/s")

    def rotated(make, nbytes):
        n = max(2, math.ceil(256 * 2**20 / nbytes))  # > 256 MiB in all: never resident in L2
        return [make() for _ in range(n)]

    # ternary us: the matmul kernel alone (decode: CUDA-core dp4a, M <= 16; prefill: int8 tensor cores); linear us: a
    # whole PackedBitLinear's two launches, quantize_activations then ternary_matmul, from the bf16 input
    print(f"{'M':>5} {'N':>6} {'K':>6} {'kernel':>7} | {'bf16 us':>9} {'ternary us':>10} {'speedup':>7} | "
          f"{'ternary GB/s':>12} {'% copy':>6} | {'linear us':>9}")
    shapes = [(m, n, k) for m in (1, 16, 2048) for n, k in ((4096, 4096), (11008, 4096), (4096, 11008))]
    shapes += [(1, 576, 576), (1, 1536, 576), (1, 576, 1536), (4, 4096, 4096)]  # SmolLM2-135M's layers; a batch of 4
    for M, N, K in shapes:
        ws = rotated(lambda: torch.randn(N, K, device=dev, dtype=torch.bfloat16), N * K * 2)
        wp = rotated(lambda: torch.randint(0, 256, (N, (K + 3) // 4), device=dev, dtype=torch.uint8),
                     N * ((K + 3) // 4))
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        x_q, x_scale = quantize_activations(x)
        gamma = torch.tensor(0.02, device=dev)
        i, j = [0], [0]

        def run_bf16():
            i[0] = (i[0] + 1) % len(ws)
            return F.linear(x, ws[i[0]])

        def run_ternary():
            j[0] = (j[0] + 1) % len(wp)
            return ternary_matmul(x_q, x_scale, wp[j[0]], gamma, out_dtype=torch.bfloat16)
        def run_linear():
            j[0] = (j[0] + 1) % len(wp)
            xq, xs = quantize_activations(x)
            return ternary_matmul(xq, xs, wp[j[0]], gamma, out_dtype=torch.bfloat16)
        t_bf16, t_tern, t_lin = do_bench(run_bf16), do_bench(run_ternary), do_bench(run_linear)  # ms, median
        moved = N * ((K + 3) // 4) + M * K + M * N * 2 + M * 4  # packed weights, int8 x, bf16 y, scales
        gbs = moved / (t_tern / 1e3) / 1e9
        kind = "decode" if M <= DECODE_MAX_M else "prefill"
        print(f"{M:5d} {N:6d} {K:6d} {kind:>7} | {t_bf16 * 1e3:9.1f} {t_tern * 1e3:10.1f} {t_bf16 / t_tern:7.2f} | "
              f"{gbs:12.0f} {100 * gbs * 1e9 / copy_bw:6.1f} | {t_lin * 1e3:9.1f}")
    for M, K in ((1, 4096), (16, 4096), (2048, 4096), (2048, 11008)):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        t = do_bench(lambda: quantize_activations(x))
        print(f"quantize_activations M={M:5d} K={K:6d}: {t * 1e3:8.1f} us, "
              f"{(M * K * 3 + M * 4) / (t / 1e3) / 1e9:6.0f} GB/s")


def bench_decode(new_tokens=128, prompt_len=16):
    """Batch-1 greedy decoding of new_tokens after a prompt_len-token prompt (its prefill timed
    too), tokens/s: the fp model and the packed ternary one (kernels/packed_linear.py), each by
    model.generate (static KV cache) and by tools/decode.py (eager: model.generate's path; on CUDA
    its step also captured as one CUDA graph, plain and torch.compiled). CUDA: the CUDA preset's
    shape in bf16; CPU: a tiny model in fp32. Each decoder decodes 8 tokens first (capture,
    compile). "same" counts the tokens equal to model.generate's (random weights: near-ties, so
    float rounding can differ)."""
    from kernels.packed_linear import freeze_ternary
    from model import GPT, GPTConfig
    from tools import config, decode
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if cuda:
        shape = {s: config.model_config(config.build_config({"device": dev, "stage": s}), 50257, 50256) for s in (1, 2)}
    else:
        tiny = dict(vocab_size=257, block_size=256, n_layer=2, n_head=2, n_embd=64)
        shape = {1: GPTConfig(**tiny, quant=False), 2: GPTConfig(**tiny, quant=True)}
    torch.manual_seed(0)
    models = {"fp": GPT(shape[1]).to(dev, dtype).eval(), "packed": freeze_ternary(GPT(shape[2]).to(dev, dtype).eval())}
    c = shape[1]
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; model {c.n_layer}x{c.n_embd}, {c.n_head} heads, vocab {c.vocab_size}, "
          f"block_size {c.block_size}; {str(dtype).removeprefix('torch.')}; batch 1, greedy, {new_tokens} new tokens "
          f"after a {prompt_len}-token prompt")
    prompt = torch.randint(0, c.vocab_size, (1, prompt_len), device=dev, generator=torch.Generator(dev).manual_seed(0))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    modes = {"generate": "model.generate (static KV cache)", "eager": "static KV cache, eager"}
    if cuda:
        modes |= {"graph": "static KV cache, CUDA graph", "compile": "static KV cache, torch.compile + CUDA graph"}
    print(f"{'run':54s} {'tokens/s':>9s} {'same':>9s}")
    tps = {}
    for name, model in models.items():
        want = model.generate(prompt, new_tokens, top_k=1)
        for mode, label in modes.items():
            row = f"{name + (' ' + str(dtype).removeprefix('torch.') if name == 'fp' else ' ternary')}: {label}"
            try:
                gen = model.generate if mode == "generate" else decode.Decoder(model, mode).generate
                gen(prompt, 8, top_k=1)  # warm-up: captures the graph, compiles
                sync()
                t0 = time.perf_counter()
                out = gen(prompt, new_tokens, top_k=1)
                sync()
                tps[name, mode] = new_tokens / (time.perf_counter() - t0)
            except Exception as e:  # a step that cannot be captured or compiled: say why, time the others
                print(f"{row:54s} failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
                continue
            same = int((out[0, prompt_len:] == want[0, prompt_len:]).cumprod(0).sum())
            print(f"{row:54s} {tps[name, mode]:9.1f} {f'{same}/{new_tokens}':>9s}")
    ratio = lambda a, b: f"{tps[a] / tps[b]:.2f}" if a in tps and b in tps else "-"  # noqa: E731
    print("packed / fp tokens/s: " + ", ".join(f"{m} {ratio(('packed', m), ('fp', m))}" for m in modes))
    print("static cache / model.generate tokens/s: " + "; ".join(
        f"{n}: " + ", ".join(f"{m} {ratio((n, m), (n, 'generate'))}" for m in modes if m != "generate") for n in models))
    return tps


@dataclass
class BenchFlags:
    data: bool = False           # tokeniser throughput on the shipped corpus
    muon: bool = False           # Newton-Schulz in bf16 vs fp32 on the CPU model's hidden matrices
    train: bool = False          # full training steps: nanoGPT baseline vs ours fp vs ours ternary QAT
    profile: bool = False        # where the CPU step time goes (torch.profiler)
    decode: bool = False         # batch-1 greedy decoding tokens/s: fp vs packed, eager vs one CUDA graph a step
    quality: bool = False        # time to quality: ours vs a nanoGPT-shaped fp baseline, to the same val loss
    target: float = 0.0          # --quality: the val loss to reach (finite, > 0); 0 = the baseline's final val loss
    train_args: str = ""         # --quality: more train.py flags for our run and the shape of both, e.g. "--lr=3e-3"
    model: str = ""              # --train: a pretrained model's real shape against transformers' own training step
                                 # and generate (e.g. data/models/SmolLM2-135M-Instruct.Q4_1.gguf)


def main(argv):
    """One benchmark per run: the one flag given, or with none the ternary kernel (CUDA)."""
    given = parse(argv, BenchFlags, __doc__)
    opts = {k: given.pop(k) for k in ("target", "train_args") if k in given}
    model = given.pop("model", "")
    flags = {k: v for k, v in given.items() if v}
    if len(flags) > 1:
        die(f"give one benchmark at a time, not {' '.join('--' + k for k in flags)}", 2)
    if opts and "quality" not in flags:
        die(f"--{next(iter(opts))} is an option of --quality; add --quality", 2)
    if model and "train" not in flags:
        die("--model is an option of --train; add --train", 2)
    run = dict(data=bench_data, muon=bench_muon, train=lambda: bench_pretrained(model) if model else bench_train(),
               profile=bench_profile, decode=bench_decode,
               quality=lambda: bench_quality(**opts))
    (run[next(iter(flags))] if flags else bench_kernels)()


if __name__ == "__main__":
    main(sys.argv[1:])
