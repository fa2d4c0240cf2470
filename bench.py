"""
Benchmarks. Every speed number in README comes from one of these commands.

  python bench.py            Triton ternary matmul vs bf16 F.linear at decode and prefill shapes (CUDA only;
                             prints a note and exits 0 without a GPU)
  python bench.py --data     tokeniser throughput on the shipped corpus (target: gpt2 >= 2M tokens/s on 2 cores)
  python bench.py --muon     Newton-Schulz (NS5) in bf16 vs fp32 on the hidden matrices of the CPU model

Kernel timing: triton.testing.do_bench (median of many runs), with the weights rotated through enough
copies to exceed L2, so each call streams its weights from HBM as a real decode step does. Bandwidth is
reported against a measured device-to-device copy (read + write bytes / time).
"""

import math
import sys
import time

import torch


def bench_data():
    import data
    for name in ("byte", "gpt2"):
        data.tokenize_throughput(name)  # warm-up: builds the encoder, reads the corpus
        rates = sorted(data.tokenize_throughput(name) for _ in range(3))
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


def bench_kernels():
    if not torch.cuda.is_available():
        print("bench.py: no CUDA device here; the kernel benchmark needs a GPU (the kernels are tested on CPU "
              "under TRITON_INTERPRET=1: python -m pytest tests/test_kernels.py)")
        return
    import torch.nn.functional as F
    from triton.testing import do_bench
    from kernels.ternary_matmul import quantize_activations, ternary_matmul
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    buf = torch.empty(2**30, dtype=torch.uint8, device=dev)  # 1 GiB device-to-device copy
    out = torch.empty_like(buf)
    copy_s = do_bench(lambda: out.copy_(buf)) / 1e3
    copy_bw = 2 * buf.numel() / copy_s
    print(f"measured device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    del buf, out

    def rotated(make, nbytes):
        n = max(2, math.ceil(256 * 2**20 / nbytes))  # > 256 MiB in all: never resident in L2
        return [make() for _ in range(n)]

    print(f"{'M':>5} {'N':>6} {'K':>6} | {'bf16 us':>9} {'ternary us':>10} {'speedup':>7} | "
          f"{'ternary GB/s':>12} {'% copy':>6}")
    shapes = [(m, n, k) for m in (1, 16, 2048) for n, k in ((4096, 4096), (11008, 4096), (4096, 11008))]
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
        t_bf16, t_tern = do_bench(run_bf16), do_bench(run_ternary)  # ms, median
        moved = N * ((K + 3) // 4) + M * K + M * N * 2 + M * 4  # packed weights, int8 x, bf16 y, scales
        gbs = moved / (t_tern / 1e3) / 1e9
        print(f"{M:5d} {N:6d} {K:6d} | {t_bf16 * 1e3:9.1f} {t_tern * 1e3:10.1f} {t_bf16 / t_tern:7.2f} | "
              f"{gbs:12.0f} {100 * gbs * 1e9 / copy_bw:6.1f}")
        del ws, wp
    for M, K in ((1, 4096), (16, 4096), (2048, 4096), (2048, 11008)):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        t = do_bench(lambda: quantize_activations(x))
        print(f"quantize_activations M={M:5d} K={K:6d}: {t * 1e3:8.1f} us, "
              f"{(M * K * 3 + M * 4) / (t / 1e3) / 1e9:6.0f} GB/s")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--data"]:
        bench_data()
    elif args == ["--muon"]:
        bench_muon()
    elif not args:
        bench_kernels()
    else:
        print(f"bench.py: unknown arguments {args}; use no argument, --data or --muon", file=sys.stderr)
        sys.exit(2)
