"""
Ternary x int8 matmul in Triton: y = (x_q @ W_q^T) * x_scale * gamma, with 2-bit packed weights.

BitNet b1.58 inference needs only integer arithmetic between the scales: W_q in {-1, 0, +1} and
x_q in [-128, 127], so the product x_q @ W_q^T is a sum of small integers that an int32 accumulator
holds exactly (|acc| <= 128 * K < 2**31 for K < 2**24). The scales are applied once, at the end. Sources: the
quantisers of BitNet b1.58 (arXiv 2402.17764, section 2); W1.58A8 inference from 2-bit packed weights, BitNet
b1.58 2B4T (arXiv 2504.12285). Byte layout, export file and this contract: docs/packed-format.md.

Packed weight layout (same as quant.pack_ternary):
    code = W_q + 1 in {0, 1, 2}: 0b00 = -1, 0b01 = 0, 0b10 = +1        (0b11 is never written)
    w_packed[n, k // 4] holds element k in bits 2*(k % 4) .. 2*(k % 4) + 1       (N, ceil(K/4)) uint8
    K is padded to a multiple of 4 with code 0b01 (weight 0), so the padding adds nothing.

Arithmetic, per output element:
    acc[m, n] = sum_k x_q[m, k] * W_q[n, k]                int32, exact, order-independent
    y[m, n]   = (float32(acc[m, n]) * x_scale[m]) * gamma   fp32, in this order, then cast to out_dtype
x_scale = 1/s is the per-row scale from activation_quant, gamma the per-tensor weight scale; with several
matrices stacked along N (q, k, v of one input, one launch), w_scale holds each row's own matrix's gamma.

Why int8 tensor cores: tl.dot(int8, int8) -> int32 runs on the integer MMA units of Ampere (mma.s8)
and Hopper (wgmma .s8), which is exact, twice the fp16 rate, and half the operand bytes. Each program
decodes its 2-bit weight tile to an int8 tile in registers and feeds it to tl.dot; in global memory
the weights stay packed (1/8 of the bf16 bytes), which is what matters when decoding is memory bound.
The decode is the simplest one: the (BLOCK_N, BLOCK_K) tile of bytes w_packed[n, k // 4] is loaded
with each byte repeated for its four k (same cache line, so DRAM traffic is unchanged), then
(byte >> 2 * (k % 4)) & 3 minus 1.

Two launch shapes (chosen by M, or forced with config="decode"|"prefill"):
    decode  (M <= 16): BLOCK_M = 16 (the rows, padded), narrow BLOCK_N, and split-K: SPLIT_K
            programs per output tile each reduce a slice of K and atomically add their int32 partial
            sums into a zeroed buffer; a second tiny kernel applies the scales. Integer addition is
            associative, so split-K stays exact and deterministic. N = 4096 with BLOCK_N = 32 is only
            128 programs for the 132 SMs of an H100, one each; SPLIT_K = 2..8 gives several per SM.
    prefill (M > 16): bigger tiles (64-256 rows), no split-K, scales applied in the epilogue.
On CUDA both are autotuned over a few configs keyed on (M bucket, N, K). Under the Triton
interpreter (TRITON_INTERPRET=1, CPU) each uses one small fixed config: autotuning would only be slow.

quantize_activations(x) is the fused per-row absmax int8 quantiser; it equals quant.activation_quant
bit for bit (IEEE division via tl.math.div_rn, round-half-to-even, no FMA contraction).

Test (CPU, interpreter):  python -m pytest tests/test_kernels.py
Benchmark (GPU):          python -m lab.bench
Demo:                     python kernels/ternary_matmul.py    (CPU: TRITON_INTERPRET=1 python ...)
"""

import math
import os

import torch
import triton
import triton.language as tl

# triton.jit reads TRITON_INTERPRET when it decorates, i.e. when this module is imported; this mirrors it.
# The kernels use only builtins of triton.language, none of its own @triton.jit helpers (tl.zeros,
# tl.cdiv, tl.max are jit functions, fixed as compiled or interpreted when triton is first imported),
# so re-importing this module after setting TRITON_INTERPRET=1 is enough to switch it to the interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# -----------------------------------------------------------------------------
# kernels


@triton.jit
def _ternary_matmul_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, acc_ptr,  # x_q (M, K) int8, x_scale (M,), w (N, K/4) uint8, gamma, y, acc
    M, N, K, M_BUCKET,  # M_BUCKET is only an autotuning key (a power of two), unused in the body
    stride_xm, stride_wn, stride_om, stride_ws,  # stride_ws: 0 = one gamma, 1 = one per output row (stacked layers)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,     # programs along K per output tile (needs ATOMIC_ACC when > 1)
    ATOMIC_ACC: tl.constexpr,  # atomically add the int32 partial sums into acc_ptr (zeroed by the host)
    WRITE_ACC: tl.constexpr,   # without ATOMIC_ACC: store the raw int32 accumulator instead of y
):
    tl.static_assert(SPLIT_K == 1 or ATOMIC_ACC, "split-K needs the atomic int32 accumulator")
    tl.static_assert(BLOCK_K % 4 == 0, "BLOCK_K must be a multiple of 4 (four codes per byte)")
    pid_m = tl.program_id(0)  # m fastest: neighbouring programs share one weight tile (read from L2)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    # every K block starts at a multiple of BLOCK_K (a multiple of 4), so k % 4 == kk % 4
    shift = ((offs_kk % 4) * 2).to(tl.uint8)[None, :]  # (1, BLOCK_K)

    acc = tl.full((BLOCK_M, BLOCK_N), 0, dtype=tl.int32)
    for kb in range(pid_k, (K + BLOCK_K - 1) // BLOCK_K, SPLIT_K):  # this program's K blocks, interleaved
        offs_k = kb * BLOCK_K + offs_kk
        k_mask = offs_k < K
        # x beyond K (and beyond M) is 0, so whatever weight sits there contributes nothing
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)  # (BM, BK) int8
        # each byte is loaded once per k it holds (4x, same cache line); masked bytes read as 0b01010101
        packed = tl.load(w_rows + (offs_k // 4)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0x55)
        w = ((packed >> shift) & 3).to(tl.int8) - 1  # (BN, BK) in {-1, 0, 1}
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)  # (BM, BN) int32, exact

    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC_ACC:
        tl.atomic_add(acc_ptr + out_offs, acc, mask=out_mask, sem="relaxed")  # int adds: order-free
    elif WRITE_ACC:
        tl.store(acc_ptr + out_offs, acc, mask=out_mask)
    else:
        xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)  # (BM,) fp32
        gamma = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)  # (BN,) fp32
        y = acc.to(tl.float32) * xs[:, None] * gamma[None, :]  # same order as the reference: (acc * x_scale) * gamma
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _scale_kernel(acc_ptr, xs_ptr, ws_ptr, out_ptr, N, stride_om, stride_ws, BLOCK_N: tl.constexpr):
    """Epilogue of the split-K path: y[m, :] = (float(acc[m, :]) * x_scale[m]) * gamma[:] (one, or per row n)."""
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    offs = row.to(tl.int64) * stride_om + offs_n
    acc = tl.load(acc_ptr + offs, mask=mask, other=0)
    y = acc.to(tl.float32) * tl.load(xs_ptr + row) * tl.load(ws_ptr + offs_n * stride_ws, mask=mask, other=0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


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
# configurations: autotuned on CUDA, one fixed small config under the interpreter

DECODE_MAX_M = 16  # up to this many rows, use the decode configuration


def _cfg(bm, bn, bk, split_k, warps, stages):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k), num_warps=warps, num_stages=stages)


DECODE_CONFIGS = [  # N=4096 with BLOCK_N=32 is 128 tiles; SPLIT_K multiplies the program count
    _cfg(16, 32, 128, 1, 4, 4),
    _cfg(16, 32, 128, 2, 4, 4),
    _cfg(16, 32, 256, 4, 4, 4),
    _cfg(16, 64, 128, 4, 4, 4),
    _cfg(16, 64, 256, 8, 4, 3),
    _cfg(16, 128, 128, 8, 4, 3),
]
PREFILL_CONFIGS = [
    _cfg(128, 128, 64, 1, 8, 3),
    _cfg(128, 256, 64, 1, 8, 3),
    _cfg(256, 128, 64, 1, 8, 3),
    _cfg(64, 128, 128, 1, 4, 4),
    _cfg(128, 64, 128, 1, 4, 4),
    _cfg(64, 64, 128, 1, 4, 4),
]
# interpreter: GPU-legal shapes (tl.dot on int8 needs K >= 32); decode keeps SPLIT_K = 2 so the
# atomic split-K path is exercised on CPU too
INTERPRETER_CONFIGS = {
    "decode": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2),
    "prefill": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1),
}

if INTERPRETED:
    _decode_kernel = _prefill_kernel = _ternary_matmul_kernel
else:
    _key = ["M_BUCKET", "N", "K"]
    _decode_kernel = triton.autotune(DECODE_CONFIGS, key=_key, reset_to_zero=["acc_ptr"])(_ternary_matmul_kernel)
    _prefill_kernel = triton.autotune(PREFILL_CONFIGS, key=_key)(_ternary_matmul_kernel)

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

    x_q (..., K) int8, x_scale (..., 1) fp32, w_packed (N, ceil(K/4)) uint8, w_scale fp32 with one element
    (gamma), or N: one gamma per output row, for several matrices stacked along N (q, k, v in one call).
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
    x2 = x_q.reshape(M, K).contiguous()  # (M, K)
    w = w_packed.contiguous()  # (N, ceil(K/4))
    xs = x_scale.reshape(M).contiguous()
    ws = w_scale.reshape(-1).contiguous()  # (1,) or (N,)
    stride_ws = 0 if ws.numel() == 1 else 1
    res_dtype = torch.int32 if return_acc else out_dtype
    if out is None:
        out = torch.empty((*lead, N), dtype=res_dtype, device=x_q.device)
    elif out.shape != (*lead, N) or out.dtype != res_dtype or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous {res_dtype} {(*lead, N)}, got {out.dtype} {tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    y = out.view(M, N)  # (M, N)

    decode = M <= DECODE_MAX_M if config is None else config == "decode"
    fixed = INTERPRETER_CONFIGS["decode" if decode else "prefill"] if INTERPRETED else {}
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])
    m_bucket = min(triton.next_power_of_2(M), 4096)
    if decode:  # split-K partial sums meet in an int32 buffer, then one pass applies the scales
        acc = y.zero_() if return_acc else torch.zeros((M, N), dtype=torch.int32, device=x_q.device)
        _decode_kernel[grid](x2, xs, w, ws, acc, acc, M, N, K, m_bucket, x2.stride(0), w.stride(0), N, stride_ws,
                             ATOMIC_ACC=True, WRITE_ACC=False, **fixed)
        if not return_acc:
            _scale_kernel[(M, triton.cdiv(N, 1024))](acc, xs, ws, y, N, N, stride_ws, BLOCK_N=1024)
    else:
        _prefill_kernel[grid](x2, xs, w, ws, y, y, M, N, K, m_bucket, x2.stride(0), w.stride(0), N, stride_ws,
                              ATOMIC_ACC=False, WRITE_ACC=return_acc, **fixed)
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


# -----------------------------------------------------------------------------
# reference in plain torch (independent of the kernels and of quant.py)


def unpack_ternary_reference(w_packed, K):
    """(N, ceil(K/4)) uint8 -> (N, K) int8 in {-1, 0, 1}: element k is bits 2*(k%4).. of byte k//4."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=w_packed.device)
    codes = (w_packed.to(torch.int32).unsqueeze(-1) >> shifts) & 3  # (N, ceil(K/4), 4)
    return (codes.reshape(w_packed.shape[0], -1)[:, :K] - 1).to(torch.int8)


def ternary_matmul_reference(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, return_acc=False):
    """The same contract as ternary_matmul, in torch.

    The integer product is computed in float64, which is exact here (every partial sum is an
    integer of magnitude <= 128 * K < 2**53) and, unlike integer matmul, exists on CPU and CUDA.
    """
    K = x_q.shape[-1]
    w = unpack_ternary_reference(w_packed, K)  # (N, K)
    acc = (x_q.double() @ w.double().T).to(torch.int32)  # (..., N), exact
    if return_acc:
        return acc
    gamma = w_scale.float().reshape(()) if w_scale.numel() == 1 else w_scale.float().reshape(-1)  # () or (N,)
    y = acc.float() * x_scale.float().reshape(*x_q.shape[:-1], 1) * gamma
    return y.to(out_dtype)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    if device == "cpu" and not INTERPRETED:
        raise SystemExit("no CUDA device: run the demo with TRITON_INTERPRET=1 python kernels/ternary_matmul.py")
    torch.manual_seed(0)
    M, K, N = 3, 100, 37
    x = torch.randn(M, K, device=device)
    x_q, x_scale = quantize_activations(x)
    w_q = torch.randint(-1, 2, (N, K), dtype=torch.int8, device=device)
    codes = torch.cat([w_q.to(torch.uint8) + 1, torch.ones(N, (-K) % 4, dtype=torch.uint8, device=device)], 1)
    codes = codes.view(N, -1, 4)
    w_packed = codes[..., 0] | codes[..., 1] << 2 | codes[..., 2] << 4 | codes[..., 3] << 6  # (N, ceil(K/4))
    gamma = torch.tensor(0.02, device=device)
    print(f"x_q {tuple(x_q.shape)} int8, row absmax -> 127:", x_q.abs().amax(-1).tolist())
    for config in ("decode", "prefill"):
        acc = ternary_matmul(x_q, x_scale, w_packed, gamma, config=config, return_acc=True)
        y = ternary_matmul(x_q, x_scale, w_packed, gamma, config=config)
        acc_ref = ternary_matmul_reference(x_q, x_scale, w_packed, gamma, return_acc=True)
        y_ref = ternary_matmul_reference(x_q, x_scale, w_packed, gamma)
        print(f"{config}: int32 acc equal: {torch.equal(acc, acc_ref)}, max |y - y_ref|: {(y - y_ref).abs().max().item():.3g},"
              f" max |y - x @ (W_q*gamma)^T|: {(y - x @ (w_q.float() * gamma).T).abs().max().item():.3g} (activation rounding)")
