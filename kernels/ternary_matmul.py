"""
Ternary x int8 matmul in Triton: y = (x_q @ W_q^T) * x_scale * gamma, with 2-bit packed weights.

BitNet b1.58 inference needs only integer arithmetic between the scales: W_q in {-1, 0, +1} and
x_q in [-128, 127], so the product x_q @ W_q^T is a sum of small integers that an int32 accumulator
holds exactly. The scales are applied once, at the end. Sources: the quantisers of BitNet b1.58
(arXiv 2402.17764, section 2); W1.58A8 inference from 2-bit packed weights, BitNet b1.58 2B4T
(arXiv 2504.12285) and its GPU kernel, whose weights are permuted offline so that one shift and one mask of an
int32 word give four int8 codes for one dp4a. Byte layouts, export file and this contract: docs/packed-format.md.

Weights come as quant.pack_ternary packs them (plane order, kernels/planes.py; pack_planes is the same
function): read as int32 words, one shift and one mask give four codes (W_q + 1 in {0, 1, 2}) that
pair with one int32 word of the activations, so one dp4a does four multiply-adds.

Arithmetic, per output element:
    acc[m, n] = sum_k x_q[m, k] * W_q[n, k] = sum_k x_q[m, k] * code[n, k] - sum_k x_q[m, k]    int32, exact
    y[m, n]   = (float32(acc[m, n]) * x_scale[m]) * gamma   fp32, in this order, then cast to out_dtype
The kernels multiply by the codes (0, 1, 2) and subtract the row sum of x_q once, so the unpacking is one shift
and one mask. Every partial sum is below 2 * 128 * K < 2**31 (K < 2**23, checked). x_scale = 1/s is the
per-row scale from activation_quant, gamma the per-tensor weight scale; with several matrices stacked along N
(q, k, v of one input, one launch), w_scale holds each row's own matrix's gamma.

Chosen by the row count M (or forced with config="decode"|"prefill"); the scales in the epilogue:
    decode  (M <= 16): CUDA cores, bandwidth-bound, one launch. Each program owns BLOCK_N weight
            rows over the whole K and BLOCK_M rows of x (M rounded up to a power of two, at most
            DECODE_BLOCK_M = 8); it loads each weight word once (16-byte loads), unpacks each plane
            once with one shift and one mask, and runs one dp4a per word, plane and row of x. x is
            loaded in the accumulator's own layout, and the tile's axes are ordered for the installed
            Triton (DECODE_ROWS_FIRST), so the K loop holds no shuffles and no shared memory. No tensor
            cores, no padding of M = 1 to 16 rows, no split-K.
    prefill (M > 16):  two launches. _unpack_kernel turns the packed words into W_q as int8 once per
            call, whole words in and out (16 codes per word, a borrow-free per-byte subtract: no
            byte-wise work anywhere); _prefill_kernel is then a plain int8 GEMM on tensor cores
            (mma.sync .s8 on Ampere, wgmma .s8 on Hopper) with 16-byte loads of both operands and
            both scales in its epilogue: W_q holds -1/0/+1, so no row-sum correction is needed.
    decode-mma (config="decode-mma", M <= 16; not the default until measured on a GPU): the rows on
            int8 tensor cores, kernels/decode_mma.py.
The tile tables (DECODE_CONFIGS, PREFILL_CONFIGS, UNPACK_CONFIG) are fixed per shape class and GPU
generation: no autotuning, and a K loop of one step is not software-pipelined (num_stages = 1).
kernels/cross_compile.py compiles every entry for sm_80 and sm_90 and reads the result: instructions
per weight word in the K loop, registers, programs per SM, weight bytes in flight per SM
(tests/test_cross_compile.py).

rmsnorm_quantize(x, g, eps) is quant.RMSNorm and the quantiser in one kernel (one read of x, the
normed row in registers): a frozen model's norm runs inside the quantiser of the packed layers that
read it (kernels/packed_linear.py), so a layer's activations are quantised once for q, k and v.

The same contract in plain torch (ternary_matmul_reference; ternary_matmul_codes, the CPU path) is in
kernels/planes.py, beside the layout it reads; both are importable from here too.

dp4a: the compiled decode kernel multiplies with PTX dp4a.s32.s32 (inline asm). The interpreter cannot run
inline asm, so under TRITON_INTERPRET=1 (CPU tests) the same kernel uses _dp4a's pure-Triton form, which
computes the same int32 (each byte sign-extended, multiplied, added); DP4A is a constexpr of the kernel.

quantize_activations(x), the fused per-row absmax int8 quantiser, and rmsnorm_quantize live in
kernels/quantize.py (re-exported here); each equals quant.py's torch form bit for bit.

Test (CPU, interpreter):  python -m pytest tests/test_kernels.py
Compiled code (no GPU):   python -m kernels.cross_compile
Benchmark (GPU):          python -m lab.bench
Demo:                     python -m kernels.ternary_matmul    (CPU: TRITON_INTERPRET=1 python -m ...)
"""

import importlib
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
from kernels import quantize as _quantize  # noqa: E402
if _quantize.INTERPRETED != INTERPRETED:  # this module reloaded under TRITON_INTERPRET=1: the quantisers too
    importlib.reload(_quantize)
from kernels.quantize import (_check_device, _quantize_activations_kernel,  # noqa: E402,F401
                              _rmsnorm_quant_kernel, norm_quant_settings, on_device, quantize_activations,
                              rmsnorm_quantize)
from kernels import decode_mma as _decode_mma  # noqa: E402
if _decode_mma.INTERPRETED != INTERPRETED:
    importlib.reload(_decode_mma)
from kernels.decode_mma import DECODE_MMA_CONFIG, _decode_mma_kernel, launch_decode_mma  # noqa: E402,F401

# -----------------------------------------------------------------------------
# kernels


# the combine functions of tl.sum and tl.max: compiled, a reduction like any other; interpreted, the
# interpreter recognises them and reduces with NumPy in one call instead of one Python call per
# element
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


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
    # rows of x per program (1 for M = 1; up to 16): each weight word unpacked once for all
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # weight rows per program, over the whole K
    BLOCK_G: tl.constexpr,  # words of each row per loop step (4 per thread: 16-byte loads)
    DP4A: tl.constexpr,     # PTX dp4a (compiled) or its pure-Triton form (interpreter)
    WRITE_ACC: tl.constexpr,  # store the int32 accumulator instead of y
    ROWS_FIRST: tl.constexpr,  # tile axes (rows of x, weight rows, words), else (weight rows, rows of x, words)
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_g = tl.arange(0, BLOCK_G)
    if ROWS_FIRST:  # (BM, BN) tiles of y
        m2 = offs_m[:, None]
        n2 = offs_n[None, :]
    else:  # (BN, BM)
        m2 = offs_m[None, :]
        n2 = offs_n[:, None]
    m3, n3 = m2[:, :, None], n2[:, :, None]
    w_rows = w_ptr + n3.to(tl.int64) * stride_wn  # weight rows along their axis, 1 along the other
    x_rows = x_ptr + m3.to(tl.int64) * stride_xm
    zero = (m3 + n3 + offs_g[None, None, :]) * 0  # the whole (BM, BN, BG) or (BN, BM, BG) tile
    acc = zero  # per-lane partial sums of x * code
    xsum = (m3 + offs_g[None, None, :]) * 0  # per-lane partial sums of x
    ones = xsum + 0x01010101  # four int8 ones
    for g0 in range(0, KW, BLOCK_G):
        g = (g0 + offs_g)[None, None, :]
        g_mask = g < KW
        # each word once, along the weight rows only
        w = tl.load(w_rows + g, mask=(n3 < N) & g_mask, other=0)
        for i in tl.static_range(4):  # plane i: k = iQ + 4g .. iQ + 4g + 3, Q = 4 * KW
            # once for all rows
            c = tl.broadcast_to((w >> (2 * i)) & 0x03030303, zero.shape)
            xi = tl.load(x_rows + i * KW + g, mask=(m3 < M) & g_mask, other=0)
            # the same words in acc's layout
            xb = tl.load(x_rows + i * KW + g + zero, mask=((m3 < M) & g_mask) & (zero == 0), other=0)
            acc = _dp4a(c, xb, acc, DP4A)
            xsum = _dp4a(xi, ones, xsum, DP4A)
    # x @ code - sum(x) = x @ W_q
    total = tl.reduce(acc, 2, _SUM) - tl.reduce(xsum, 2, _SUM)
    out = out_ptr + m2.to(tl.int64) * stride_om + n2
    out_mask = (m2 < M) & (n2 < N)
    if WRITE_ACC:
        tl.store(out, total, mask=out_mask)
    else:  # same order as the reference: (acc * x_scale) * gamma
        gamma = tl.load(ws_ptr + n2 * stride_ws, mask=n2 < N, other=0.0)  # fp32
        xs = tl.load(xs_ptr + m2, mask=m2 < M, other=0.0)  # fp32
        y = total.to(tl.float32) * xs * gamma
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _unpack_kernel(w_ptr, out_ptr, N, KW, stride_wn, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """Packed words -> W_q as int8 (N, 16 KW), whole words in and out: the four codes of plane i in
    word g are bytes of (w >> 2i) & 0x03030303, minus one in each byte without a borrow crossing
    bytes (each byte's top bit set first, cleared after: {0, 1, 2} -> {-1, 0, 1}); they are the int8
    elements iQ + 4g .. + 3 (Q = 4 KW), so the output row is W_q in k order, padded with zeros,
    written as int32 words (16-byte stores)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask = (offs_n < N)[:, None] & (g < KW)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    # (BN, BG) int32
    w = tl.load(w_ptr + rows * stride_wn + g[None, :], mask=mask, other=0x55555555)
    for i in tl.static_range(4):
        codes = ((w >> (2 * i)) & 0x03030303) | -2139062144  # -2139062144 = 0x80808080
        w_q = (codes - 0x01010101) ^ -2139062144
        tl.store(out_ptr + rows * (4 * KW) + i * KW + g[None, :], w_q, mask=mask)


@triton.jit
def _prefill_kernel(
    # x (M, K) int8, x_scale (M,), W_q (N, >= K) int8, gamma, y
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # programs that share a weight tile run next to each other (it stays in L2)
    WRITE_ACC: tl.constexpr,
):
    """An int8 GEMM on W_q unpacked once per call (_unpack_kernel): x_q @ W_q^T on int8 tensor
    cores, both scales in the epilogue. Both operands come as whole int8 tiles (16-byte loads, no
    unpacking in the loop)."""
    pid = tl.program_id(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (BM, 1)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BN, 1)
    acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        # (BM, BK) int8
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0)
        # (BN, BK) int8
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)  # int8 tensor cores, exact
    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if WRITE_ACC:
        tl.store(out_ptr + out_offs, acc, mask=out_mask)
    else:
        xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)  # (BM,) fp32
        gamma = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)  # (BN,) fp32
        y = acc.to(tl.float32) * xs[:, None] * gamma[None, :]  # same order as the reference: (acc * x_scale) * gamma
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)



# -----------------------------------------------------------------------------
# configurations: fixed tables, one entry per shape class (and GPU generation for prefill); no autotuning

DECODE_MAX_M = 16  # up to this many rows, use the decode kernel
DECODE_BLOCK_M = 8  # rows of x one decode program multiplies with each unpacked weight word
SMS = 132  # an H100's SMs: the decode table gives at least two programs per SM where N allows
# Triton's coalescing pass orders two equally contiguous axes of a load by their index: highest first since
# Triton 3.7, lowest first before. The decode tile's weight rows must take the threads (each word unpacked once, in
# registers, for all rows of x): on the axis Triton takes first. The other order spreads threads over the rows of x
# and sends every unpacked word through shared memory to them (STS, LDS and barriers in the K loop; compiled with
# Triton 3.5 and 3.6 and with 3.7 to 3.9, kernels/cross_compile.py).
DECODE_ROWS_FIRST = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7)

# decode, M = 1: 4 int32 words (16-byte loads) per thread and row, BLOCK_G words of every row per
# loop step: "short" rows (K <= 1024, at most 64 words) in one warp, longer ones 256 words (4096
# elements) per step in two warps (64 threads along K, each holding all BLOCK_N rows, so x is loaded
# once per program); "wide" (N >= 2 * 8 * SMS): 8 rows a program, else 2, for more programs.
# num_stages = 1: no shared-memory staging; a thread's 16-byte loads of all its rows are in flight
# at once, and many programs share each SM. decode, 2 <= M <= 16 ("rows"): BLOCK_M = M rounded up to
# a power of two, at most DECODE_BLOCK_M (a thread keeps BLOCK_M accumulators and x words per weight
# word: 16 rows spill registers, 8 do not; M = 9..16 is two programs along M, each weight word
# unpacked twice instead of 16 times).
DECODE_CONFIGS = {
    "short-narrow": dict(BLOCK_N=2, BLOCK_G=64, num_warps=1, num_stages=1),
    "short-wide": dict(BLOCK_N=8, BLOCK_G=64, num_warps=1, num_stages=1),
    "long-narrow": dict(BLOCK_N=2, BLOCK_G=256, num_warps=2, num_stages=1),
    "long-wide": dict(BLOCK_N=8, BLOCK_G=256, num_warps=2, num_stages=1),
    "rows": dict(BLOCK_N=8, BLOCK_G=64, num_warps=4, num_stages=1),
}
# prefill (an int8 GEMM on W_q unpacked once per call): by GPU generation (8: Ampere/Ada mma.sync,
# 9: Hopper wgmma) and M ("short": M <= 64, "tall": more); BLOCK_K = 128 int8 = 128 bytes of each
# row per K step
PREFILL_CONFIGS = {
    (8, "short"): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    (8, "tall"): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    (9, "short"): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    (9, "tall"): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
}
# 4 words in and 16 out per thread
UNPACK_CONFIG = dict(BLOCK_N=8, BLOCK_G=64, num_warps=4, num_stages=1)
# interpreter: small GPU-legal shapes (32 is the smallest int8 tl.dot K); BLOCK_G = 8 words makes K
# = 256 two decode steps; few programs, since the interpreter pays per program and op
INTERPRETER_CONFIGS = {
    "decode": dict(BLOCK_N=16, BLOCK_G=8),  # N = 33, 37: three programs, the last one masked
    "prefill": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8),
    "unpack": dict(BLOCK_N=16, BLOCK_G=8),
}


def decode_block_m(M):
    """Rows of x per decode program: M rounded up to a power of two, at most DECODE_BLOCK_M (16 in
    the interpreter, which pays per program and op, not per element: M = 17 is two programs along M
    there)."""
    return min(triton.next_power_of_2(max(M, 1)), 16 if INTERPRETED else DECODE_BLOCK_M)


def decode_config(N, K, M=1):
    """The DECODE_CONFIGS key for an (N, K) weight and M rows."""
    if M > 1:
        return "rows"
    return f"{'short' if (K + 15) // 16 <= 64 else 'long'}-{'wide' if N >= 2 * 8 * SMS else 'narrow'}"


def prefill_config(M, K, arch):
    """The PREFILL_CONFIGS entry for M rows and arch (the CUDA capability's major), with num_stages = 1 when the
    K loop has one step: nothing to overlap, and no software pipeline around a loop of one iteration."""
    cfg = dict(PREFILL_CONFIGS[(9 if arch >= 9 else 8, "short" if M <= 64 else "tall")])
    if K <= cfg["BLOCK_K"]:
        cfg["num_stages"] = 1
    return cfg


def unpack_codes(w, N, KW, out=None):
    """(N, KW) int32 weight words -> W_q int8 (N, 16 KW) in k order (zeros past K): one
    _unpack_kernel launch."""
    if out is None:
        out = torch.empty((N, 16 * KW), dtype=torch.int8, device=w.device)
    cfg = INTERPRETER_CONFIGS["unpack"] if INTERPRETED else UNPACK_CONFIG
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(KW, cfg["BLOCK_G"]))
    _unpack_kernel[grid](w, out.view(torch.int32), N, KW, w.stride(0), **cfg)
    return out


def decode_launch(N, K, M):
    """The decode kernel's settings (the table's entry or the interpreter's, BLOCK_M, DP4A, ROWS_FIRST) and
    its grid for an (N, K) weight and M rows: programs over N and over M, BLOCK_M rows each."""
    cfg = INTERPRETER_CONFIGS["decode"] if INTERPRETED else DECODE_CONFIGS[decode_config(N, K, M)]
    bm = decode_block_m(M)
    settings = dict(cfg, BLOCK_M=bm, DP4A=not INTERPRETED, ROWS_FIRST=DECODE_ROWS_FIRST)
    return settings, (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, bm))


def launch_decode(xw, xs, w, ws, y, M, N, KW, stride_ws, return_acc=False):
    """The decode kernel on x words (M, 4 KW) and weight words (N, KW), as decode_launch sets it."""
    settings, grid = decode_launch(N, 16 * KW, M)
    _decode_kernel[grid](xw, xs, w, ws, y, M, N, KW, xw.stride(0), w.stride(0), y.stride(0),
                         stride_ws, WRITE_ACC=return_acc, **settings)


def launch_prefill(x2, xs, w, ws, y, M, N, K, KW, stride_ws, return_acc=False, cfg=None,
                   codes=None):
    """Unpack the weight words once (codes: a preallocated (N, 16 KW) int8 buffer, or None), then
    the GEMM."""
    codes = unpack_codes(w, N, KW, codes)
    if cfg is None:
        cfg = (INTERPRETER_CONFIGS["prefill"] if INTERPRETED
               else prefill_config(M, K, torch.cuda.get_device_capability(x2.device)[0]))
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _prefill_kernel[grid](x2, xs, codes, ws, y, M, N, K, x2.stride(0), codes.stride(0), y.stride(0),
                          stride_ws, WRITE_ACC=return_acc, **cfg)


# -----------------------------------------------------------------------------
# host wrappers


def ternary_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, *, out=None, config=None,
                   return_acc=False):
    """y = (x_q @ W_q^T) * x_scale * gamma with W_q unpacked on the fly from w_packed.

    x_q (..., K) int8, x_scale (..., 1) fp32, w_packed (N, ceil(K/4)) uint8 as quant.pack_ternary (= pack_planes)
    writes it, w_scale fp32 with one element (gamma), or N: one gamma per
    output row, for several matrices stacked along N (q, k, v in one call).
    Returns y (..., N) in out_dtype (float32 or bfloat16), or with return_acc=True the exact int32
    accumulator x_q @ W_q^T instead. out= writes into a given contiguous (..., N) tensor.
    config: "decode", "prefill" or None (decode when the row count is <= DECODE_MAX_M); "decode-mma" (at most
    16 rows) the decode on int8 tensor cores.
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
    if config not in (None, "decode", "prefill", "decode-mma"):
        raise ValueError(f"config: expected 'decode', 'decode-mma', 'prefill' or None, got {config!r}")
    if config == "decode-mma" and M > DECODE_MAX_M:
        raise ValueError(f"config='decode-mma' takes at most {DECODE_MAX_M} rows, got {M}")
    dev = _check_device(x_q, x_scale, w_packed, w_scale)
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

    with on_device(dev):
        if config == "decode-mma":
            launch_decode_mma(_x_words(x2, K, KW), xs, w, ws, y, M, N, KW, stride_ws, return_acc)
        elif M <= DECODE_MAX_M if config is None else config == "decode":
            launch_decode(_x_words(x2, K, KW), xs, w, ws, y, M, N, KW, stride_ws, return_acc)
        else:
            launch_prefill(x2, xs, w, ws, y, M, N, K, KW, stride_ws, return_acc)
    return out


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    if device == "cpu" and not INTERPRETED:
        raise SystemExit("no CUDA device: run the demo with TRITON_INTERPRET=1 python -m kernels.ternary_matmul")
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
