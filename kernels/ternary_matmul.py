"""
Ternary x int8 matmul in Triton: y = (x_q @ W_q^T) * x_scale * gamma, with 2-bit packed weights.

BitNet b1.58 inference needs only integer arithmetic between the scales: W_q in {-1, 0, +1} and
x_q in [-128, 127], so the product x_q @ W_q^T is a sum of small integers that an int32 accumulator
holds exactly. The scales are applied once, at the end. Sources: the quantisers of BitNet b1.58
(arXiv 2402.17764, section 2); W1.58A8 inference from 2-bit packed weights, BitNet b1.58 2B4T
(arXiv 2504.12285) and its GPU kernel, whose weights are permuted offline so that one shift and one mask of an
int32 word give four int8 codes for one dp4a. Byte layouts, export file and this contract: docs/packed-format.md.

Weights come as quant.pack_ternary packs them (plane order, kernels/planes.py; pack_planes is the same
function): read as int32 words, one shift and one mask give four codes (W_q + 1 in {0, 1, 2}) that pair with one int32 word of the activations, so one dp4a does four
multiply-adds.

Arithmetic, per output element:
    acc[m, n] = sum_k x_q[m, k] * W_q[n, k] = sum_k x_q[m, k] * code[n, k] - sum_k x_q[m, k]    int32, exact
    y[m, n]   = (float32(acc[m, n]) * x_scale[m]) * gamma   fp32, in this order, then cast to out_dtype
The kernels multiply by the codes (0, 1, 2) and subtract the row sum of x_q once, so the unpacking is one shift
and one mask. Every partial sum is below 2 * 128 * K < 2**31 (K < 2**23, checked). x_scale = 1/s is the
per-row scale from activation_quant, gamma the per-tensor weight scale; with several matrices stacked along N
(q, k, v of one input, one launch), w_scale holds each row's own matrix's gamma.

Two kernels, chosen by the row count M (or forced with config="decode"|"prefill"); one launch each, the scales
in its epilogue, so a layer is two launches in all (quantize_activations, then this):
    decode  (M <= 16): CUDA cores, bandwidth-bound. Each program owns BLOCK_N weight rows over the whole K and
            loads each of their words once (16-byte loads), one dp4a per word and plane; the rows of x loop
            inside the program (for M > 1 the weight words come again from L1/L2, never DRAM twice). No tensor
            cores, no padding of M = 1 to 16 rows, no split-K: the table gives 2 rows a program where N is
            small, so N = 576 is already 288 programs for the 132 SMs of an H100.
    prefill (M > 16):  int8 tensor cores (mma.sync .s8 on Ampere, wgmma .s8 on Hopper). Each program loads its
            weight words once per K step, unpacks each plane in registers to an int8 tile, and runs one tl.dot
            per plane against the matching slice of x.
The tile tables (DECODE_CONFIGS, PREFILL_CONFIGS) are fixed per shape class and GPU generation: no autotuning,
no tile larger than it needs to be, and a K loop of one step is not software-pipelined (num_stages = 1).
kernels/cross_compile.py compiles every entry for sm_80 and sm_90 and reads the result (tests/test_cross_compile.py).

The same contract in plain torch (ternary_matmul_reference; ternary_matmul_codes, the CPU path) is in
kernels/planes.py, beside the layout it reads; both are importable from here too.

dp4a: the compiled decode kernel multiplies with PTX dp4a.s32.s32 (inline asm). The interpreter cannot run
inline asm, so under TRITON_INTERPRET=1 (CPU tests) the same kernel uses _dp4a's pure-Triton form, which
computes the same int32 (each byte sign-extended, multiplied, added); DP4A is a constexpr of the kernel.

quantize_activations(x) is the fused per-row absmax int8 quantiser; it equals quant.activation_quant
bit for bit (IEEE division via tl.math.div_rn, round-half-to-even, no FMA contraction).

Test (CPU, interpreter):  python -m pytest tests/test_kernels.py
Compiled code (no GPU):   python -m kernels.cross_compile
Benchmark (GPU):          python -m lab.bench
Demo:                     python kernels/ternary_matmul.py    (CPU: TRITON_INTERPRET=1 python ...)
"""

import math
import os

import torch
import triton
import triton.language as tl

from kernels.planes import (K_MAX, _codes, _pack_codes, _weight_words, _x_words, pack_planes,  # noqa: F401
                            packed_from_planes, planes_from_packed, ternary_matmul_codes, ternary_matmul_reference,
                            unpack_ternary_reference)

# triton.jit reads TRITON_INTERPRET when it decorates, i.e. when this module is imported; this mirrors it.
# The kernels use only builtins of triton.language and this module's own @triton.jit helpers, none of
# triton.language's jit functions (tl.zeros, tl.cdiv, tl.sum are jit functions, fixed as compiled or interpreted
# when triton is first imported), so re-importing this module after setting TRITON_INTERPRET=1 is enough to
# switch it to the interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# -----------------------------------------------------------------------------
# kernels


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _dp4a(a, b, c, DP4A: tl.constexpr):
    """c + sum over the four bytes of a * b, each byte a signed int8 (int32 in and out, wrapping like dp4a)."""
    if DP4A:  # compiled: the PTX instruction
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:  # the interpreter: byte j sign-extended is (v << (24 - 8j)) >> 24 (arithmetic shift)
        return (c + ((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
                + ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24))


@triton.jit
def _decode_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,  # x (M, 4KW) int32 words, x_scale (M,), w (N, KW) int32 words, gamma, y
    M, N, KW,  # KW = int32 words per weight row = ceil(K/16); each of the four planes of x is KW words
    stride_xm, stride_wn, stride_om, stride_ws,  # in elements; stride_ws: 0 = one gamma, 1 = one per output row
    BLOCK_N: tl.constexpr,  # weight rows per program, over the whole K
    BLOCK_G: tl.constexpr,  # words of each row per loop step (4 per thread: 16-byte loads)
    DP4A: tl.constexpr,     # PTX dp4a (compiled) or its pure-Triton form (interpreter)
    WRITE_ACC: tl.constexpr,  # store the int32 accumulator instead of y
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BN, 1)
    gamma = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)  # (BN,) fp32
    for m in range(M):  # the rows of x; this program's weight words are re-read from L1/L2 for m > 0
        x_row = x_ptr + tl.cast(m, tl.int64) * stride_xm
        acc = tl.full((BLOCK_N, BLOCK_G), 0, tl.int32)  # per-lane partial sums of x * code
        xsum = tl.full((1, BLOCK_G), 0, tl.int32)  # per-lane partial sums of x
        ones = tl.full((1, BLOCK_G), 0x01010101, tl.int32)  # four int8 ones (a tensor: int32 in the interpreter too)
        for g0 in range(0, KW, BLOCK_G):
            g = (g0 + offs_g)[None, :]  # (1, BG)
            g_mask = g < KW
            w = tl.load(w_rows + g, mask=n_mask[:, None] & g_mask, other=0)  # (BN, BG) int32, each word once
            for i in tl.static_range(4):  # plane i: k = iQ + 4g .. iQ + 4g + 3, Q = 4 * KW
                xi = tl.load(x_row + i * KW + g, mask=g_mask, other=0)  # (1, BG) int32: four int8 of x
                acc = _dp4a((w >> (2 * i)) & 0x03030303, xi, acc, DP4A)  # four codes (0..2) times four x
                xsum = _dp4a(xi, ones, xsum, DP4A)
        total = tl.reduce(acc, 1, _add) - tl.reduce(xsum, 1, _add)  # (BN,): x @ code - sum(x) = x @ W_q
        out = out_ptr + tl.cast(m, tl.int64) * stride_om + offs_n
        if WRITE_ACC:
            tl.store(out, total, mask=n_mask)
        else:  # same order as the reference: (acc * x_scale) * gamma
            y = total.to(tl.float32) * tl.load(xs_ptr + m) * gamma
            tl.store(out, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _prefill_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,  # x (M, K) int8, x_scale (M,), w (N, KW) int32 words, gamma, y
    M, N, K, KW, stride_xm, stride_wn, stride_om, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,  # weight words per row per K step: 4 * BLOCK_G elements of each of the four planes
    GROUP_M: tl.constexpr,  # programs that share a weight tile run next to each other (it stays in L2)
    WRITE_ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, 4 * BLOCK_G)  # elements of one plane in one K step
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (BM, 1)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BN, 1)
    byte_shift = (8 * tl.arange(0, 4))[None, None, :]  # (1, 1, 4)
    Q = 4 * KW  # elements per plane
    acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32)
    xsum = tl.full((BLOCK_M, 1), 0, tl.int32)
    for g0 in range(0, KW, BLOCK_G):
        g = g0 + offs_g
        w = tl.load(w_rows + g[None, :], mask=n_mask[:, None] & (g < KW)[None, :], other=0)  # (BN, BG) int32, once
        c_mask = 4 * g0 + offs_c < Q  # within the plane (x of the next plane must not enter xsum)
        for i in tl.static_range(4):
            k = i * Q + 4 * g0 + offs_c  # (4BG,) the elements of plane i in this step
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (c_mask & (k < K))[None, :], other=0)  # (BM, 4BG)
            codes = ((w[:, :, None] >> (byte_shift + 2 * i)) & 3).to(tl.int8)  # (BN, BG, 4): byte b of word g
            codes = tl.reshape(codes, (BLOCK_N, 4 * BLOCK_G))  # (BN, 4BG): element 4g + b, as x
            acc = tl.dot(x, tl.trans(codes), acc, out_dtype=tl.int32)  # int8 tensor cores, exact
            xsum += tl.reduce(x.to(tl.int32), 1, _add, keep_dims=True)
    acc = acc - xsum  # x @ code - sum(x) = x @ W_q
    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if WRITE_ACC:
        tl.store(out_ptr + out_offs, acc, mask=out_mask)
    else:
        xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)  # (BM,) fp32
        gamma = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)  # (BN,) fp32
        y = acc.to(tl.float32) * xs[:, None] * gamma[None, :]  # same order as the reference: (acc * x_scale) * gamma
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _round_half_even(v):
    """Round fp32 to the nearest integer, ties to even, for |v| < 2**22.

    Adding 1.5 * 2**23 moves v into [2**23, 2**24), where the fp32 spacing is exactly 1, so the
    hardware's round-to-nearest-even addition does the rounding; subtracting it back is exact.
    (libdevice.rint would do, but the interpreter cannot run it.) Nothing folds this away: Triton
    emits no reassociation flags, so LLVM must keep (v + c) - c. The one rewrite it may do, fusing a
    multiply into the add as an FMA, is ruled out twice: the caller puts a clamp between them, and
    quantize_activations launches with enable_fp_fusion=False, which makes the PTX say add.rn/mul.rn
    (checked in cross-compiled sm_80 and sm_90 PTX: add.rn.f32 with 0f4B400000, then with 0fCB400000).
    """
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _scale_from_absmax(absmax):
    """s = 127 / max(absmax, 1e-5), rounded exactly as torch rounds quant.activation_quant's formula.

    torch evaluates `127.0 / t` as t.reciprocal() * 127.0 (Tensor.__rtruediv__): two roundings, and
    they differ from one IEEE division for some absmax. tl.math.div_rn is the IEEE division; plain `/`
    on fp32 is div.full.f32 on NVIDIA, up to 2 ulp off.
    """
    return tl.math.div_rn(1.0, tl.maximum(absmax, 1e-5)) * 127.0


@triton.jit
def _quantize_row(x, s):
    """clamp(round(x * s), -128, 127) as int8, rounding the fp32 product exactly like torch.

    The clamp comes before the rounding (equal results: the bounds are integers and rounding is
    monotone), which also keeps the product from reaching the add inside _round_half_even: an FMA
    would round x * s + c once instead of twice and break ties such as 0.49999997 -> 0.
    """
    v = tl.minimum(tl.maximum(x * s, -128.0), 127.0)
    return _round_half_even(v).to(tl.int8)


@triton.jit
def _quantize_activations_kernel(x_ptr, xq_ptr, xs_ptr, K, stride_x, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    """One program per row: s = 127 / max(absmax, 1e-5); x_q = clamp(round(x * s)); x_scale = 1 / s."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = xq_ptr + row * K
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # the whole row fits in one block: read it once, keep it in registers
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        s = _scale_from_absmax(tl.reduce(tl.abs(x), 0, _max_combine))
        tl.store(q_row + offs, _quantize_row(x, s), mask=mask)
    else:  # long row: one loop for the absmax, a second one to quantise
        amax = tl.full((BLOCK_K,), 0.0, dtype=tl.float32)  # running elementwise max of |x|
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = _scale_from_absmax(tl.reduce(amax, 0, _max_combine))
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _quantize_row(x, s), mask=mask)
    tl.store(xs_ptr + row, tl.math.div_rn(1.0, s))  # x_scale = 1 / s, as torch's 1.0 / s (exact reciprocal)


# -----------------------------------------------------------------------------
# configurations: fixed tables, one entry per shape class (and GPU generation for prefill); no autotuning

DECODE_MAX_M = 16  # up to this many rows, use the decode kernel
SMS = 132  # an H100's SMs: the decode table gives at least two programs per SM where N allows

# decode: 4 int32 words (16-byte loads) per thread and row, BLOCK_G words of every row per loop step: "short" rows
# (K <= 1024, at most 64 words) in one warp (16 threads along K, 2 rows at a time), longer ones 256 words (4096
# elements) per step in two warps (64 threads along K, each holding all BLOCK_N rows, so x is loaded once per
# program); "wide" (N >= 2 * 8 * SMS): 8 rows a program, else 2, for more programs. num_stages = 1: no shared-memory
# staging; a thread's 16-byte loads of all its rows are in flight at once, and many programs share each SM
DECODE_CONFIGS = {
    "short-narrow": dict(BLOCK_N=2, BLOCK_G=64, num_warps=1, num_stages=1),
    "short-wide": dict(BLOCK_N=8, BLOCK_G=64, num_warps=1, num_stages=1),
    "long-narrow": dict(BLOCK_N=2, BLOCK_G=256, num_warps=2, num_stages=1),
    "long-wide": dict(BLOCK_N=8, BLOCK_G=256, num_warps=2, num_stages=1),
}
# prefill: by GPU generation (8: Ampere/Ada mma.sync, 9: Hopper wgmma) and M ("short": M <= 64, "tall": more);
# BLOCK_G = 16 words = 64 elements of each plane per tl.dot, 256 elements per K step
PREFILL_CONFIGS = {
    (8, "short"): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_G=16, GROUP_M=8, num_warps=4, num_stages=3),
    (8, "tall"): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_G=16, GROUP_M=8, num_warps=8, num_stages=3),
    (9, "short"): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_G=16, GROUP_M=8, num_warps=4, num_stages=3),
    (9, "tall"): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_G=16, GROUP_M=8, num_warps=8, num_stages=3),
}
# interpreter: small GPU-legal shapes (a plane slice of 4 * 8 = 32 elements is the smallest int8 tl.dot);
# BLOCK_G = 8 words makes K = 256 two loop steps; few programs, since the interpreter pays per program and op
INTERPRETER_CONFIGS = {
    "decode": dict(BLOCK_N=16, BLOCK_G=8),  # N = 33, 37: three programs, the last one masked
    "prefill": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_G=8, GROUP_M=8),
}


def decode_config(N, K):
    """The DECODE_CONFIGS key for an (N, K) weight."""
    return f"{'short' if (K + 15) // 16 <= 64 else 'long'}-{'wide' if N >= 2 * 8 * SMS else 'narrow'}"


def prefill_config(M, K, arch):
    """The PREFILL_CONFIGS entry for M rows and arch (the CUDA capability's major), with num_stages = 1 when the
    K loop has one step: nothing to overlap, and no software pipeline around a loop of one iteration."""
    cfg = dict(PREFILL_CONFIGS[(9 if arch >= 9 else 8, "short" if M <= 64 else "tall")])
    if (K + 15) // 16 <= cfg["BLOCK_G"]:
        cfg["num_stages"] = 1
    return cfg


# -----------------------------------------------------------------------------
# host wrappers


def _check_device(*tensors):
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all inputs must be on one device, found {t.device} and {dev}")
    if not INTERPRETED and dev.type != "cuda":
        raise ValueError(f"inputs are on {dev}; the Triton kernels need CUDA tensors "
                         "(or set TRITON_INTERPRET=1 before importing this module to run them on CPU)")


def ternary_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, *, out=None, config=None,
                   return_acc=False):
    """y = (x_q @ W_q^T) * x_scale * gamma with W_q unpacked on the fly from w_packed.

    x_q (..., K) int8, x_scale (..., 1) fp32, w_packed (N, ceil(K/4)) uint8 as quant.pack_ternary (= pack_planes)
    writes it, w_scale fp32 with one element (gamma), or N: one gamma per
    output row, for several matrices stacked along N (q, k, v in one call).
    Returns y (..., N) in out_dtype (float32 or bfloat16), or with return_acc=True the exact int32
    accumulator x_q @ W_q^T instead. out= writes into a given contiguous (..., N) tensor.
    config: "decode", "prefill" or None (decode when the row count is <= DECODE_MAX_M).
    """
    if x_q.dtype != torch.int8 or x_q.dim() < 1:
        raise TypeError(f"x_q: expected int8 (..., K), got {x_q.dtype} {tuple(x_q.shape)}; quantise with quantize_activations")
    if w_packed.dtype != torch.uint8 or w_packed.dim() != 2:
        raise TypeError(f"w_packed: expected uint8 (N, ceil(K/4)), got {w_packed.dtype} {tuple(w_packed.shape)}; "
                        "pack with quant.pack_ternary")
    lead, K = x_q.shape[:-1], x_q.shape[-1]
    N, M = w_packed.shape[0], math.prod(lead)
    if w_packed.shape[1] != (K + 3) // 4:
        raise ValueError(f"w_packed has {w_packed.shape[1]} bytes per row, expected ceil(K/4) = {(K + 3) // 4} for K = {K}")
    if K >= K_MAX:
        raise ValueError(f"K = {K}: the int32 accumulator is exact only for K < {K_MAX}")
    if x_scale.dtype != torch.float32 or x_scale.numel() != M:
        raise ValueError(f"x_scale: expected float32 with {M} elements (one per row), got {x_scale.dtype} {tuple(x_scale.shape)}")
    if w_scale.dtype != torch.float32 or w_scale.numel() not in (1, N):
        raise ValueError(f"w_scale: expected float32 with one element (gamma) or N = {N} (one per row), got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype: expected torch.float32 or torch.bfloat16, got {out_dtype}")
    if config not in (None, "decode", "prefill"):
        raise ValueError(f"config: expected 'decode', 'prefill' or None, got {config!r}")
    _check_device(x_q, x_scale, w_packed, w_scale)
    res_dtype = torch.int32 if return_acc else out_dtype
    if out is None:
        out = torch.empty((*lead, N), dtype=res_dtype, device=x_q.device)
    elif out.shape != (*lead, N) or out.dtype != res_dtype or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous {res_dtype} {(*lead, N)}, got {out.dtype} {tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    y = out.view(M, N)  # (M, N)
    if K == 0:  # an empty sum
        y.zero_()
        return out
    x2 = x_q.reshape(M, K).contiguous()  # (M, K)
    xs = x_scale.reshape(M).contiguous()
    ws = w_scale.reshape(-1).contiguous()  # (1,) or (N,)
    stride_ws = 0 if ws.numel() == 1 else 1
    KW = (K + 15) // 16
    w = _weight_words(w_packed, K)  # (N, KW) int32: a view for K % 16 == 0

    if M <= DECODE_MAX_M if config is None else config == "decode":
        xw = _x_words(x2, K, KW)  # (M, 4 KW) int32: a view for K % 16 == 0
        cfg = dict(INTERPRETER_CONFIGS["decode"]) if INTERPRETED else dict(DECODE_CONFIGS[decode_config(N, K)])
        grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
        _decode_kernel[grid](xw, xs, w, ws, y, M, N, KW, xw.stride(0), w.stride(0), N, stride_ws,
                             DP4A=not INTERPRETED, WRITE_ACC=return_acc, **cfg)
    else:
        if INTERPRETED:
            cfg = dict(INTERPRETER_CONFIGS["prefill"])
        else:
            cfg = prefill_config(M, K, torch.cuda.get_device_capability(x_q.device)[0])
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _prefill_kernel[grid](x2, xs, w, ws, y, M, N, K, KW, x2.stride(0), w.stride(0), N, stride_ws,
                              WRITE_ACC=return_acc, **cfg)
    return out


def quantize_activations(x, *, block_k=None):
    """Per-row absmax int8 quantisation, bit-identical to quant.activation_quant(x).

    x (..., K) float32 or bfloat16 -> (x_q (..., K) int8, x_scale (..., 1) float32 = 1/s).
    block_k: the row block; rows longer than it take the two-loop path (default: whole row up to 8192).
    """
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() < 1:
        raise TypeError(f"x: expected a float32/bfloat16/float16 tensor (..., K), got {x.dtype} {tuple(x.shape)}")
    _check_device(x)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if K and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    x_q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    x_scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if R == 0:
        return x_q, x_scale
    block = block_k or min(triton.next_power_of_2(max(K, 1)), 8192)
    block = triton.next_power_of_2(block)
    # enable_fp_fusion=False: no FMA contraction anywhere in this kernel (see _quantize_row)
    _quantize_activations_kernel[(R,)](x2, x_q, x_scale, K, x2.stride(0), BLOCK_K=block, ONE_PASS=K <= block,
                                       num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)
    return x_q, x_scale


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    if device == "cpu" and not INTERPRETED:
        raise SystemExit("no CUDA device: run the demo with TRITON_INTERPRET=1 python kernels/ternary_matmul.py")
    torch.manual_seed(0)
    M, K, N = 3, 100, 37
    x = torch.randn(M, K, device=device)
    x_q, x_scale = quantize_activations(x)
    w_q = torch.randint(-1, 2, (N, K), dtype=torch.int8, device=device)
    w_packed = pack_planes(w_q)  # (N, ceil(K/4)): byte j holds k = j, j + 25, j + 50, j + 75
    gamma = torch.tensor(0.02, device=device)
    print(f"x_q {tuple(x_q.shape)} int8, row absmax -> 127:", x_q.abs().amax(-1).tolist())
    for config in ("decode", "prefill"):
        acc = ternary_matmul(x_q, x_scale, w_packed, gamma, config=config, return_acc=True)
        y = ternary_matmul(x_q, x_scale, w_packed, gamma, config=config)
        acc_ref = ternary_matmul_reference(x_q, x_scale, w_packed, gamma, return_acc=True)
        y_ref = ternary_matmul_reference(x_q, x_scale, w_packed, gamma)
        print(f"{config}: int32 acc equal: {torch.equal(acc, acc_ref)}, max |y - y_ref|: {(y - y_ref).abs().max().item():.3g},"
              f" max |y - x @ (W_q*gamma)^T|: {(y - x @ (w_q.float() * gamma).T).abs().max().item():.3g} (activation rounding)")
