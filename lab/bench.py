"""
Benchmarks. Every speed number in the results pages comes from one of these commands.

  python -m lab.bench            the Triton ternary matmul (decode: dp4a, prefill: int8 MMA) vs bf16
                                 F.linear, here (CUDA only; prints a note and exits 0 without a GPU)
  python -m lab.bench --data     tokeniser throughput on the shipped corpus (target: gpt2 >= 2M
                                 tokens/s on 2 cores)
  python -m lab.bench --muon     Newton-Schulz (NS5) in bf16 vs fp32 on the CPU model's
                                 matrices, one by one and stacked by shape
  python -m lab.bench --train    training steps at the device preset's grad accumulation: nanoGPT
                                 baseline vs ours fp vs ours QAT, eager and compiled
                                 (lab/bench_train.py; --runs= picks some; on CPU it keeps
                                 freed memory as train.py does, --keep_memory=False does not)
  python -m lab.bench --train --model=M   a pretrained model's shape against transformers' own
                                 training step and generate
  python -m lab.bench --profile  where the CPU step time goes (torch.profiler), ours QAT and fp vs nanoGPT,
                                 what each technique (Muon, RoPE, the quantisers) costs the step, and
                                 the step split into matmuls + the rest: ours / nanoGPT with a k-times
                                 faster BLAS (lab/bench_profile.py)
  python -m lab.bench --decode   batch-1 greedy decoding, fp bf16 vs packed ternary
                                 (lab/bench_decode.py); with --shape=1b a 1B-class model
                                 (16 x 2048, GQA 32/8, vocab 128,256), random weights; --modes=
                                 picks modes and their order (gpu_check: graph,compile,eager)
  python -m lab.bench --quality  time to quality: our quick start vs a nanoGPT-shaped fp baseline to
                                 the same val loss, as a ratio from one run (lab/bench_quality.py)

The nanoGPT baseline of every comparison is lab/nanogpt.py; real nanoGPT is
lab/against_nanogpt.py's.

Kernel timing (this file). Each shape's weights are rotated through enough copies to exceed the L2
cache (> 256 MiB in all), so each call streams its weights from HBM as a real decode step does.
Columns:
  graph us     GPU time per call: one CUDA graph holding one call per weight copy, replayed 10
               times, timed with CUDA events; the median replay over the calls it holds. No host
               time in it.
  do_bench us  triton.testing.do_bench's median (return_mode="median"), the column of earlier
               measurements; at small shapes it holds host time, since do_bench only hides what its
               cache flush outlasts
  host us      wall time per call of 50 calls issued back to back without a sync: the Python and
               launch cost
Bandwidth (GB/s, % copy) is from the graph time, against a measured device-to-device copy (read +
write bytes): the bytes a call must move, the packed weights, x, y and the scales, and at M > 16 also the
int8 copy of W that the prefill path's unpack kernel writes and its GEMM reads (at least once). speedup is
bf16 over the matmul alone (x already int8); the linear column is the whole packed linear as a model runs it
(kernels.op.BoundLinear: the quantiser's launch, then the matmul's). On CPU (tests) the same functions run with plain-torch stand-ins of the kernels and no
graph column.
"""

from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import math
import signal
import statistics
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
        print(f"{name:5s} tokeniser: {rates[1] / 1e6:7.2f} M tokens/s (median of 3, encode_batch "
              f"on the shipped corpus, {torch.get_num_threads()} threads)")


def bench_muon():
    """NS5 on the CPU preset's hidden matrices, in bf16 and fp32, matrix by matrix and stacked by
    shape (muon_steps: one batched NS5 per shape), the stacked results checked against the others."""
    from model import GPT, GPTConfig
    from muon import by_shape, split_muon_params, zeropower_via_newtonschulz5
    model = GPT(GPTConfig())  # the CPU preset's shape
    groups = by_shape([p.detach() for p in split_muon_params(model)[0]])  # as muon_steps stacks them
    mats = [m for ms in groups.values() for m in ms]  # in the stacks' order
    stacks = [torch.stack(ms) for ms in groups.values()]
    for dtype in (torch.bfloat16, torch.float32):
        outs = {}
        for how, arg in (("matrix by matrix", mats), (f"{len(stacks)} stacks by shape", stacks)):
            for _ in range(2):
                [zeropower_via_newtonschulz5(m, dtype=dtype) for m in arg]
            t = time.perf_counter()
            for _ in range(5):
                outs[how] = [zeropower_via_newtonschulz5(m, dtype=dtype) for m in arg]
            ms = (time.perf_counter() - t) / 5 * 1000
            same = ""
            if len(outs) == 2:
                one, stacked = outs.values()
                same = "; the same bits" if all(torch.equal(a, b) for a, b in zip(
                    one, [o for s in stacked for o in s.unbind(0)])) else "; DIFFERENT bits"
            print(f"NS5 on the {len(mats)} hidden matrices of the CPU model, {str(dtype):15s} "
                  f"{how:18s}: {ms:8.1f} ms per step{same}")


# -----------------------------------------------------------------------------
# kernels: M x K activations times an N x K weight

# kernels.ternary_matmul.DECODE_MAX_M, the most rows the decode kernel takes (tests/test_packed.py checks the
# two agree); not imported: importing the kernels fixes TRITON_INTERPRET before a test can set it
DECODE_MAX_M = 16
SHAPES = [(m, n, k) for m in (1, 16, 2048) for n, k in ((4096, 4096), (11008, 4096), (4096, 11008))]
# SmolLM2-135M's layers; a batch of 4
SHAPES += [(1, 576, 576), (1, 1536, 576), (1, 576, 1536), (4, 4096, 4096)]
L2_BUDGET = 256 * 2**20  # bytes of rotated weight copies per shape: more than any GPU's L2


def copies_for(nbytes, budget=L2_BUDGET):
    """How many copies of an nbytes weight rotate through more than budget bytes (at least 2)."""
    return max(2, math.ceil(budget / nbytes))


def kernel_ops(cuda):
    """(quantise, ternary matmul) as the benchmark calls them: the Triton kernels on CUDA; on CPU
    their plain-torch contract (quant.activation_quant, kernels.planes.ternary_matmul_reference), so
    the harness runs in tests."""
    if cuda:
        from kernels.ternary_matmul import quantize_activations, ternary_matmul
        return quantize_activations, ternary_matmul
    import quant
    from kernels.planes import ternary_matmul_reference
    return quant.activation_quant, ternary_matmul_reference


def layer_calls(x, wp, gamma, K, bound):
    """The whole packed linear of x for each packed weight of wp, as functions of no argument. bound: as a
    PackedBitLinear runs it eagerly on a GPU, kernels.op.BoundLinear (its checks, word view and launch settings
    made once per weight: the host cost a model pays); else kernel_ops(False)'s stand-ins, quantise then matmul."""
    if bound:
        from kernels.op import BoundLinear
        return [lambda b=BoundLinear(w, gamma, K): b(x) for w in wp]
    quantize, matmul = kernel_ops(False)
    return [lambda w=w: matmul(*quantize(x), w, gamma, out_dtype=x.dtype) for w in wp]


def host_us(fn, n=50, sync=lambda: None):
    """Wall microseconds per call of n calls issued back to back (no sync between them): the host's
    cost of a call while the device keeps up; on CPU, where nothing is asynchronous, the whole
    call."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    sync()
    return 1e6 * t / n


def wall_median_us(fn, n=20, sync=lambda: None):
    """The median of n synchronised wall-clock calls, in microseconds (do_bench's stand-in off
    CUDA)."""
    times = []
    for _ in range(n + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(times[1:])


def per_call_median_us(replay_ms, calls):
    """The median replay time of a graph of `calls` calls, per call, in microseconds."""
    return 1e3 * statistics.median(replay_ms) / calls


def cuda_graph_replays_ms(calls, replays=10):
    """CUDA only: the list calls (no-argument functions) captured in order in one CUDA graph after
    one warm-up pass on a side stream (Triton compiles there); the milliseconds of each of `replays`
    replays (CUDA events)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()  # first replay: uploads the graph
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def cuda_do_bench_us(fn):
    """CUDA only: triton.testing.do_bench's median, in microseconds (its default return_mode is the
    mean)."""
    from triton.testing import do_bench
    return 1e3 * do_bench(fn, return_mode="median")


def cuda_copy_bandwidth():
    """CUDA only: bytes/s of a 1 GiB device-to-device copy, read + write."""
    buf = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(buf)
    return 2 * buf.numel() / (cuda_do_bench_us(lambda: out.copy_(buf)) / 1e6)


def kernel_row(M, N, K, dev, budget=L2_BUDGET):
    """One shape's timings (us per call) of bf16 F.linear, the ternary matmul alone and the whole
    packed linear (quantise + matmul from the bf16 input), each over its rotated weight copies:
    graph (CUDA), do_bench (CUDA; CPU: a wall-clock median), host; the copies' count and the bytes a
    ternary call moves."""
    import torch.nn.functional as F
    cuda = dev == "cuda"
    quantize, matmul = kernel_ops(cuda)
    g = torch.Generator(dev).manual_seed(0)
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g)
          for _ in range(copies_for(N * K * 2, budget))]
    wp = [torch.randint(0, 256, (N, (K + 3) // 4), device=dev, dtype=torch.uint8, generator=g)
          for _ in range(copies_for(N * ((K + 3) // 4), budget))]
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    x_q, x_scale = quantize(x)
    gamma = torch.tensor(0.02, device=dev)
    bf16 = torch.bfloat16
    calls = {"bf16": [lambda w=w: F.linear(x, w) for w in ws],
             "ternary": [lambda w=w: matmul(x_q, x_scale, w, gamma, out_dtype=bf16) for w in wp],
             "linear": layer_calls(x, wp, gamma, K, cuda)}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # moved: the packed weights, int8 x, bf16 y and the scales; prefill (M > 16) also writes W's int8 codes
    # (the unpack kernel: 16 a packed word) and reads them at least once
    unpacked = 2 * N * 16 * ((K + 15) // 16) if M > DECODE_MAX_M else 0
    row = dict(M=M, N=N, K=K, copies=(len(ws), len(wp)),
               moved=N * ((K + 3) // 4) + M * K + M * N * 2 + M * 4 + unpacked)
    for name, fns in calls.items():
        rotate = _rotation(fns)
        graph = per_call_median_us(cuda_graph_replays_ms(fns), len(fns)) if cuda else None
        row[name] = dict(graph=graph,
                         do_bench=cuda_do_bench_us(rotate) if cuda else wall_median_us(rotate),
                         host=host_us(rotate, sync=sync))
    return row


def mma_graph_us(M, N, K, budget=L2_BUDGET):
    """CUDA only: GPU us per call of ternary_matmul(config="decode-mma") in one CUDA graph over
    rotated weight copies, as kernel_row's ternary column."""
    from kernels.ternary_matmul import quantize_activations, ternary_matmul
    g = torch.Generator("cuda").manual_seed(0)
    wp = [torch.randint(0, 256, (N, (K + 3) // 4), device="cuda", dtype=torch.uint8, generator=g)
          for _ in range(copies_for(N * ((K + 3) // 4), budget))]
    x_q, x_scale = quantize_activations(torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g))
    gamma = torch.tensor(0.02, device="cuda")
    fns = [lambda w=w: ternary_matmul(x_q, x_scale, w, gamma, out_dtype=torch.bfloat16, config="decode-mma")
           for w in wp]
    return per_call_median_us(cuda_graph_replays_ms(fns), len(fns))


def _rotation(fns):
    """One function calling fns in turn, one per call."""
    i = [0]

    def call():
        i[0] = (i[0] + 1) % len(fns)
        return fns[i[0]]()
    return call


def kernel_line(r, copy_bw=None):
    """A row of the kernel table from kernel_row's dict; '-' where a column was not measured (no
    graph on CPU)."""
    def us(v):
        return f"{v:9.1f}" if v is not None else f"{'-':>9s}"
    b, t, lin = r["bf16"], r["ternary"], r["linear"]
    gbs = r["moved"] / (t["graph"] / 1e6) / 1e9 if t["graph"] else None
    speedup = f"{b['graph'] / t['graph']:7.2f}" if t["graph"] else f"{'-':>7s}"
    pct = f"{100 * gbs * 1e9 / copy_bw:6.1f}" if gbs and copy_bw else f"{'-':>6s}"
    kind = "decode" if r["M"] <= DECODE_MAX_M else "prefill"
    bw = f"{gbs:8.0f}" if gbs else f"{'-':>8s}"
    return (f"{r['M']:5d} {r['N']:6d} {r['K']:6d} {kind:>7} | {us(b['graph'])} {us(t['graph'])} "
            f"{speedup} {us(lin['graph'])} | {bw} {pct} | {us(b['do_bench'])} "
            f"{us(t['do_bench'])} {us(lin['do_bench'])} | {us(b['host'])} {us(t['host'])} "
            f"{us(lin['host'])}")


COLUMNS = f"{'bf16':>9} {'ternary':>9} {'linear':>9}"
KERNEL_HEADER = (f"{'':27s} | {'graph us (GPU time)':^37s} | {'ternary BW':^15s} | "
                 f"{'do_bench median us':^29s} | {'host us per call':^29s}\n"
                 f"{'M':>5} {'N':>6} {'K':>6} {'kernel':>7} | {'bf16':>9} {'ternary':>9} "
                 f"{'speedup':>7} {'linear':>9} | {'GB/s':>8} {'% copy':>6} | {COLUMNS} | "
                 f"{COLUMNS}")


def bench_kernels(shapes=None, dev=None, budget=L2_BUDGET):
    """The kernel table (this file's docstring says what each column times). dev None: CUDA, or a
    note and nothing without it; dev="cpu" runs the harness with the plain-torch stand-ins (tests,
    tiny shapes)."""
    if dev is None and not torch.cuda.is_available():
        print("bench.py: no CUDA device here; the kernel benchmark needs a GPU (the kernels are "
              "tested on CPU under TRITON_INTERPRET=1: python -m pytest tests/test_kernels.py)")
        return []
    dev = dev or "cuda"
    cuda = dev == "cuda"
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU (plain-torch stand-ins)'}, "
          f"torch {torch.__version__}")
    copy_bw = cuda_copy_bandwidth() if cuda else None
    if copy_bw:
        print(f"measured device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    print("us per call. ternary: the matmul kernel alone; linear: quantise + matmul from the bf16 "
          "input (a PackedBitLinear's two launches). Columns: GPU time in one CUDA graph | "
          "ternary's bandwidth from it | do_bench median (the earlier column) | host time per call")
    print(KERNEL_HEADER)
    rows = []
    for M, N, K in shapes or SHAPES:
        try:
            rows.append(kernel_row(M, N, K, dev, budget))
            print(kernel_line(rows[-1], copy_bw), flush=True)
            if cuda and 1 < M <= 16:  # the decode on tensor cores, not the default until it measures faster
                print(f"{'':20s}decode-mma | {'':9s} {mma_graph_us(M, N, K, budget):9.1f} (graph us, the "
                      "same rotated weights)", flush=True)
        except Exception as e:  # a shape or config that cannot run here: say why, go on with the rest
            print(f"{M:5d} {N:6d} {K:6d} failed: {type(e).__name__}: "
                  f"{(str(e).strip().splitlines() or [''])[0][:200]}", flush=True)
    quantize, _ = kernel_ops(cuda)
    for M, K in ((1, 4096), (16, 4096), (2048, 4096), (2048, 11008)) if shapes is None else ():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        t = cuda_do_bench_us(lambda: quantize(x))
        print(f"quantize_activations M={M:5d} K={K:6d}: {t:8.1f} us (do_bench median), "
              f"{(M * K * 3 + M * 4) / (t / 1e6) / 1e9:6.0f} GB/s")
    return rows


# -----------------------------------------------------------------------------
# the command


@dataclass
class BenchFlags:
    data: bool = False           # tokeniser throughput on the shipped corpus
    muon: bool = False           # NS5, bf16 vs fp32, on the CPU model's matrices, alone and stacked
    train: bool = False          # training steps: nanoGPT baseline vs ours fp vs ours ternary QAT
    profile: bool = False        # where the CPU step time goes (torch.profiler; each technique's cost;
                                 # the ratio with a faster BLAS)
    decode: bool = False         # batch-1 greedy decoding: fp vs packed, eager vs CUDA graphs
    quality: bool = False        # time to quality: ours vs a nanoGPT-shaped fp baseline, to the
                                 # same val loss
    target: float = 0.0          # --quality: the val loss to reach (finite, > 0); 0 = the
                                 # baseline's final val loss
    train_args: str = ""         # --quality: more train.py flags for our run and the shape of both,
                                 # e.g. "--lr=3e-3"
    model: str = ""              # --train: a pretrained model's real shape against transformers'
                                 # own training step and generate
                                 # (e.g. data/models/SmolLM2-135M-Instruct.Q4_1.gguf)
    runs: str = ""               # --train: some of the runs, comma-separated (default all):
                                 # nanogpt, fp, qat, qat_sep, qat_bf16 (CPU), nanogpt_c, fp_c,
                                 # qat_c (_c: compiled)
    keep_memory: bool = True     # --train on CPU: freed memory kept for the next step, as train.py
                                 # keeps it (tools.runtime.keep_freed_memory); False: glibc's default
    shape: str = "preset"        # --decode: preset (the device preset's model) or 1b (16 x 2048,
                                 # GQA 32/8 heads, FFN 8192, vocab 128,256, random weights: the
                                 # weights set the decode time)
    modes: str = ""              # --decode: some of the shape's modes, comma-separated, run in that
                                 # order (default all: generate, eager; on CUDA graph, compile; at 1b on
                                 # CUDA eager, graph)


OPTIONS = {"target": "quality", "train_args": "quality", "model": "train", "runs": "train",
           "keep_memory": "train", "shape": "decode", "modes": "decode"}  # option: the benchmark it belongs to


def main(argv):
    """One benchmark per run: the one flag given, or with none the ternary kernel (CUDA)."""
    given = parse(argv, BenchFlags, __doc__)
    opts = {k: given.pop(k) for k in OPTIONS if k in given}
    flags = {k: v for k, v in given.items() if v}
    if len(flags) > 1:
        die(f"give one benchmark at a time, not {' '.join('--' + k for k in flags)}", 2)
    for k in opts:
        if OPTIONS[k] not in flags:
            die(f"--{k} is an option of --{OPTIONS[k]}; add --{OPTIONS[k]}", 2)
    if "train" in flags and opts.get("model") and opts.get("runs"):
        die("--runs picks runs of the preset's benchmark; with --model the pretrained model's runs "
            "are fixed: drop one of them", 2)
    which = next(iter(flags), "kernels")
    try:
        return run(which, opts)
    except KeyboardInterrupt:  # nothing to keep: a benchmark writes only what it prints
        die(f"stopped by Ctrl-C during {'--' + which if flags else 'the kernel benchmark'}; "
            f"nothing was written", 128 + signal.SIGINT)


def run(which, opts):
    """The benchmark `which` (a flag's name, or "kernels") with its options."""
    if which == "train":
        from lab import bench_train
        runs = bench_train.check_runs(opts.get("runs", ""))
        if opts.get("model"):
            return bench_train.bench_pretrained(opts["model"])
        return bench_train.bench_train(runs=runs, keep_memory=opts.get("keep_memory", True))
    if which == "decode":
        from lab import bench_decode
        shape = bench_decode.check_shape(opts.get("shape", "preset"))
        return bench_decode.bench_decode(shape=shape, picked=opts.get("modes", ""))  # checks the modes first
    if which == "quality":
        from lab import bench_quality
        return bench_quality.bench_quality(**opts)
    if which == "profile":
        from lab import bench_profile
        return bench_profile.bench_profile()
    return dict(data=bench_data, muon=bench_muon, kernels=bench_kernels)[which]()


if __name__ == "__main__":
    main(sys.argv[1:])
