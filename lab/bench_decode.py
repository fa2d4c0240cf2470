"""
python -m lab.bench --decode [--shape=1b] [--modes=graph,compile]: batch-1 greedy decoding, fp vs packed ternary, measured
in parts.

Two models of one shape, random weights: fp (bf16 on CUDA) and packed ternary
(kernels/packed_linear.py), each decoded by model.generate (static KV cache) and by
tools/decode.py's Decoder(model, mode).generate (static KV cache: eager; on CUDA also graph, one
captured CUDA graph a token, and compile, torch.compile then captured). Shapes: preset, the device
preset's model (CUDA: 12 x 768, GPT-2 vocabulary; CPU: a tiny fp32 model), and 1b, a 1B-class Llama
shape (16 x 2048, FFN 8192, GQA 32/8 heads, vocab 128,256), at which the weights, not the launches,
should set the time of a token (2.5 GB in bf16 against ~0.8 GB packed, the bf16 embedding/head
included). Columns, per (model, mode):
  tok/s      new_tokens / the wall time of one generate call (its prompt's prefill included): the
             earlier column
  loop us    wall us per token of the decode loop alone: (t(N) - t(N/2)) / (N/2), so the prefill
             cancels
  replay us  CUDA graph modes: the decoder's captured step (the CUDA graph it holds) replayed alone,
             us per replay (CUDA events): the GPU time of a token with no host loop around it
  ops/token  CUDA: GPU activities (kernels, copies) per token in torch.profiler, inside graphs too;
             CPU: aten ops dispatched per token. Both from two generate lengths, (n(2k) - n(k)) / k,
             so the prefill cancels
  syncs      CUDA: host syncs per token (torch.cuda.set_sync_debug_mode("warn") warnings), the same
             difference
  same       the leading tokens equal to model.generate's, up to the first that differs (random
             weights: near-ties, so float rounding can differ)
The eager mode is model.generate's own loop (tools/decode.py), so its row and generate's time the same code.
Each row prints once timed ('-' under ops/token and syncs), and again in a second table once every row
is timed and then counted: the profiler never runs before a timed call, and if it fails or hangs on a
GPU, the timed rows are already out.
Every measurement runs on CPU too (tests), where the CUDA-only ones print "-"; each torch.cuda call
sits in a small function named cuda_*. Test: python -m pytest tests/test_bench.py -k decode
"""

import time
import warnings

import torch

from tools.flags import die

SHAPES = ("preset", "1b")


def check_shape(shape):
    if shape not in SHAPES:
        die(f"--shape={shape}: expected one of {', '.join(SHAPES)} (preset: the device preset's "
            f"model; 1b: 16 x 2048, GQA 32/8 heads, vocab 128,256)", 2)
    return shape


def decode_config(shape, cuda, quant):
    """The GPTConfig of a shape: on CUDA the real one; on CPU a tiny model of the same kind (GQA for
    1b)."""
    from model import GPTConfig
    from tools import checks, config
    if shape == "1b":
        if cuda:
            return GPTConfig(vocab_size=128256, block_size=512, n_layer=16, n_head=32, n_kv_head=8,
                             n_embd=2048, mlp_hidden=8192, quant=quant, subln=False,
                             rope_theta=500000.0)
        return GPTConfig(vocab_size=1000, block_size=128, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=64, mlp_hidden=256, quant=quant, subln=False)
    if cuda:
        cfg = checks.build_config({"device": "cuda", "stage": 2 if quant else 1})
        return config.model_config(cfg, 50257, 50256)
    return GPTConfig(vocab_size=257, block_size=256, n_layer=2, n_head=2, n_embd=64, quant=quant)


def make_models(shape, dev, dtype):
    """{"fp": the fp model with its q/k/v and gate/up weights stacked once (freeze_fp), "packed":
    the ternary one frozen to packed weights}, random weights, built on dev."""
    from kernels.packed_linear import freeze_fp, freeze_ternary
    from model import GPT
    torch.manual_seed(0)
    with torch.device(dev):  # initialised on the device: a 1B model in seconds, not minutes
        fp = freeze_fp(GPT(decode_config(shape, dev == "cuda", False)).to(dtype).eval())
        packed = freeze_ternary(GPT(decode_config(shape, dev == "cuda", True)).to(dtype).eval())
    return {"fp": fp, "packed": packed}


def modes(shape, cuda):
    """{mode: its label}: the ways of decoding the benchmark times at a shape."""
    out = {"generate": "model.generate (static KV cache)", "eager": "static KV cache, eager"}
    if cuda:
        out |= {"graph": "static KV cache, CUDA graph",
                "compile": "static KV cache, torch.compile + CUDA graph"}
        if shape == "1b":  # two 1B compiles do not fit gpu_check's window; generate is eager's loop
            out = {k: v for k, v in out.items() if k in ("eager", "graph")}
    return out


def count_aten_ops(fn):
    """aten ops dispatched while fn() runs (the CPU's count of the work of a call)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.n


def cuda_gpu_ops(fn):
    """CUDA only: GPU activities (kernels, memcpy, memset) torch.profiler records while fn() runs,
    graphs included."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == DeviceType.CUDA for e in prof.events())


def cuda_profiler_before_graphs():
    """CUDA only: start and stop torch.profiler once before any CUDA graph is captured, torch's own workaround
    for CUPTI with graphs (torch.profiler._utils._init_for_cuda_graphs; pytorch#75504): a graph captured
    before the profiler's first use can hide its kernels from the later counts, or make profiling fail."""
    from torch.profiler._utils import _init_for_cuda_graphs
    _init_for_cuda_graphs()


def cuda_syncs(fn):
    """CUDA only: the host syncs fn() makes (torch.cuda.set_sync_debug_mode's warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in seen)


def cuda_replay_us(decoder, n):
    """CUDA only: us per replay of the one CUDA graph the decoder holds after a generate call (None
    if it holds no single one), replayed n times alone; each replay steps on by one position (n
    below what is left)."""
    graphs = [v for v in vars(decoder).values() if isinstance(v, torch.cuda.CUDAGraph)]
    if len(graphs) != 1 or n < 1:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs[0].replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        graphs[0].replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / n


def per_token(count, gen, k):
    """count(lambda: gen(n)) per token from two lengths: (count at 2k - count at k) / k (the prefill
    cancels)."""
    return (count(lambda: gen(2 * k)) - count(lambda: gen(k))) / k


def timed(gen, n, sync):
    """Seconds of one gen(n) call, synchronised."""
    sync()
    t0 = time.perf_counter()
    out = gen(n)
    sync()
    return time.perf_counter() - t0, out


def measure(model, mode, prompt, new_tokens, want, cuda, sync):
    """One row's timed numbers (this file's docstring): tok/s, loop us, replay us, same; ops/token and
    syncs come later (count), after every row is timed. Returns (row, gen: n -> gen's n tokens)."""
    from tools import decode
    decoder = None if mode == "generate" else decode.Decoder(model, mode)
    gen = (lambda n: model.generate(prompt, n, top_k=1)) if decoder is None else (
        lambda n: decoder.generate(prompt, n, top_k=1))
    gen(8)  # warm-up: captures the graph, compiles
    t_full, out = timed(gen, new_tokens, sync)
    half = new_tokens // 2
    t_half = timed(gen, half, sync)[0]
    room = model.config.block_size - prompt.size(1) - new_tokens - 1
    loop_us = 1e6 * max(t_full - t_half, 0.0) / (new_tokens - half)
    row = dict(tps=new_tokens / t_full, loop_us=loop_us, replay_us=None, ops=None, syncs=None,
               same=int((out[0, prompt.size(1):] == want[0, prompt.size(1):]).cumprod(0).sum()))
    if cuda and decoder is not None and mode in ("graph", "compile"):
        gen(new_tokens)  # the graph's position back where a full call leaves it
        row["replay_us"] = cuda_replay_us(decoder, min(64, room))
    return row, gen


def count(row, gen, cuda, k=2):
    """A timed row's ops/token (CUDA: GPU activities in torch.profiler; CPU: aten ops) and host syncs
    per token (CUDA), from gen's calls."""
    row["ops"] = per_token(cuda_gpu_ops if cuda else count_aten_ops, gen, k)
    row["syncs"] = per_token(cuda_syncs, gen, k) if cuda else None


def line(label, r, new_tokens):
    """One printed row; '-' where a column is CUDA-only."""
    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"
    same = f"{r['same']}/{new_tokens}"
    return (f"{label:58s} {r['tps']:9.1f} {r['loop_us']:9.1f} {f(r['replay_us'], '.1f'):>9s} "
            f"{f(r['ops'], '9.1f'):>9s} {f(r['syncs'], '.2f'):>6s} {same:>9s}")


def pick_modes(shape, cuda, picked=""):
    """{mode: label} of the shape's modes, all (picked empty) or those picked (comma-separated), in
    the order given; one not run at this shape is refused in one line."""
    have = modes(shape, cuda)
    names = [m for m in picked.split(",") if m] or list(have)
    for m in names:
        if m not in have:
            die(f"--modes={picked}: {m} is not a mode of --shape={shape} here; expected some of "
                f"{', '.join(have)}", 2)
    return {m: have[m] for m in names}


def bench_decode(shape="preset", new_tokens=128, prompt_len=16, picked=""):
    """Batch-1 greedy decoding of new_tokens after a prompt_len-token prompt, each mode of the shape
    (or those picked, in their order) by both models, fp then packed, so each pair's rows come
    together (this file's docstring). Returns {(model, mode): row dict}."""
    cuda = torch.cuda.is_available()
    mode_names = pick_modes(shape, cuda, picked)
    if cuda:
        cuda_profiler_before_graphs()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    dname = str(dtype).removeprefix("torch.")
    models = make_models(shape, dev, dtype)
    c = models["fp"].config
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; model {c.n_layer}x{c.n_embd}, "
          f"{c.n_head}/{c.kv_heads()} heads, FFN {c.hidden_dim()}, vocab {c.vocab_size}, "
          f"block_size {c.block_size}; {dname}; "
          f"batch 1, greedy, {new_tokens} new tokens after a {prompt_len}-token prompt")
    from kernels.packed_linear import weight_bytes
    for name, m in models.items():
        b = weight_bytes(m)
        print(f"{name} weights: {(b['hidden'] + b['other']) / 1e9:.3f} GB read per token (hidden "
              f"matrices {b['hidden'] / 1e9:.3f} GB as stored, the rest {b['other'] / 1e9:.3f} GB)")
    g = torch.Generator(dev).manual_seed(0)
    prompt = torch.randint(0, c.vocab_size, (1, prompt_len), device=dev, generator=g)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    header = (f"{'run':58s} {'tok/s':>9s} {'loop us':>9s} {'replay us':>9s} {'ops/tok':>9s} "
              f"{'syncs':>6s} {'same':>9s}")
    print(header)
    rows, gens, labels = {}, {}, {}
    want = {name: model.generate(prompt, new_tokens, top_k=1) for name, model in models.items()}
    for mode, label in mode_names.items():
        for name, model in models.items():
            labels[name, mode] = f"{name} {'ternary' if name == 'packed' else dname}: {label}"
            try:
                rows[name, mode], gens[name, mode] = measure(model, mode, prompt, new_tokens, want[name],
                                                             cuda, sync)
            except Exception as e:  # a step that cannot be captured or compiled: say why, go on
                why = (str(e).strip().splitlines() or [""])[0][:200]
                print(f"{labels[name, mode]:58s} failed: {type(e).__name__}: {why}", flush=True)
                continue
            print(line(labels[name, mode], rows[name, mode], new_tokens), flush=True)
    # the counts after every timing: the profiler (CUDA) never runs before a timed call, and if it fails or
    # hangs, the timed rows above are already out
    print("ops and syncs per token, counted after the timings:\n" + header, flush=True)
    for key, row in rows.items():
        count(row, gens[key], cuda)
        print(line(labels[key], row, new_tokens), flush=True)
    print_ratios(rows, mode_names, models)
    return rows


def print_ratios(rows, mode_names, models):
    def ratio(a, b, key="tps"):
        if a in rows and b in rows and rows[b][key]:
            return f"{rows[a][key] / rows[b][key]:.2f}"
        return "-"
    print("packed / fp tokens/s: " + ", ".join(
        f"{m} {ratio(('packed', m), ('fp', m))}" for m in mode_names))
    print("fp / packed loop us per token: " + ", ".join(
        f"{m} {ratio(('fp', m), ('packed', m), 'loop_us')}" for m in mode_names))
    if any(r["replay_us"] for r in rows.values()):
        print("fp / packed replay us per token: " + ", ".join(
            f"{m} {ratio(('fp', m), ('packed', m), 'replay_us')}" for m in mode_names
            if m in ("graph", "compile")))
    graphed = [m for m in mode_names if m in ("graph", "compile")]  # eager is model.generate's own loop
    if "generate" in mode_names and graphed:
        print("graphed / model.generate tokens/s: " + "; ".join(
            f"{n}: " + ", ".join(f"{m} {ratio((n, m), (n, 'generate'))}" for m in graphed) for n in models))
