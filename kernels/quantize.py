"""
The int8 activation quantisers of BitNet b1.58 in Triton, and RMSNorm fused into one of them.

BitNet b1.58 (arXiv 2402.17764, section 2) quantises each token's activations to int8 by its absmax:

    s = 127 / max|x|  (per row),   x_q = round(x * s) (ties to even),   x_scale = 1 / s

quantize_activations(x) is that, bit for bit with quant.activation_quant (IEEE division via tl.math.div_rn,
round-half-to-even, no FMA contraction). rmsnorm_quantize(x, g, eps) is quant.RMSNorm and the quantiser in one
kernel (one read of x, the normed row in registers): a frozen model's norm runs inside the quantiser of the
packed layers that read it (kernels/packed_linear.py). kernels/ternary_matmul.py multiplies what these return
and re-exports them (the tests switch both modules to the interpreter by reloading that one).

Test (CPU, interpreter):  python -m pytest tests/test_kernels.py
"""

import os

import torch
import triton
import triton.language as tl

from kernels import on_device

# triton.jit reads TRITON_INTERPRET when it decorates, i.e. when this module is imported
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# the combine function of tl.sum: interpreted, reduced with NumPy in one call
_SUM = tl.standard._sum_combine


@triton.jit
def _MAX(a, b):
    """max that keeps NaN, as torch's amax does: a row holding a NaN gets a NaN scale, so its output is NaN
    as torch's (a compiled tl.maximum is max.f32, which drops a NaN: the row would come out finite)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


def _check_device(*tensors):
    """The inputs' one device, refused in one line unless it is CUDA (or the interpreter runs); then
    launch under on_device(it)."""
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all inputs must be on one device, found {t.device} and {dev}")
    if not INTERPRETED and dev.type != "cuda":
        raise ValueError(f"inputs are on {dev}; the Triton kernels need CUDA tensors "
                         "(or set TRITON_INTERPRET=1 before importing this module to run them on CPU)")
    return dev


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
    return tl.math.div_rn(1.0, _MAX(absmax, 1e-5)) * 127.0


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
        s = _scale_from_absmax(tl.reduce(tl.abs(x), 0, _MAX))
        tl.store(q_row + offs, _quantize_row(x, s), mask=mask)
    else:  # long row: one loop for the absmax, a second one to quantise
        amax = tl.full((BLOCK_K,), 0.0, dtype=tl.float32)  # running elementwise max of |x|
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = _MAX(amax, tl.abs(x))
        s = _scale_from_absmax(tl.reduce(amax, 0, _MAX))
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _quantize_row(x, s), mask=mask)
    tl.store(xs_ptr + row, tl.math.div_rn(1.0, s))  # x_scale = 1 / s, as torch's 1.0 / s (exact reciprocal)


@triton.jit
def _round_to_bf16(v):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32: the 16 low bits rounded away by
    integer arithmetic, so compiled and interpreted kernels agree (the interpreter's own fp32 ->
    bf16 cast truncates)."""
    u = v.to(tl.int32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _normed(x, r, g, BF16: tl.constexpr):
    """quant.RMSNorm's value: (x * r) * g in fp32, one rounding to the input dtype (bf16) at the
    end."""
    y = (x * r) * g
    if BF16:
        y = _round_to_bf16(y)
    return y


@triton.jit
def _rmsnorm_quant_kernel(x_ptr, g_ptr, xq_ptr, xs_ptr, K, stride_x, eps,
                          BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, BF16: tl.constexpr):
    """One program per row: y = RMSNorm(x) * g (torch's formula and roundings), then y's int8 codes
    and 1 / s."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = xq_ptr + row * K
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # the row in registers: read x once, write x_q once
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        ss = tl.reduce(x * x, 0, _SUM)
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, K * 1.0) + eps))
        y = _normed(x, r, tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32), BF16)
        s = _scale_from_absmax(tl.reduce(tl.abs(y), 0, _MAX))
        tl.store(q_row + offs, _quantize_row(y, s), mask=mask)
    else:  # long row: the sum of squares, the absmax of y, then the codes (x read three times)
        acc = tl.full((BLOCK_K,), 0.0, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            acc += x * x
        ss = tl.reduce(acc, 0, _SUM)
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, K * 1.0) + eps))
        amax = tl.full((BLOCK_K,), 0.0, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            amax = _MAX(amax, tl.abs(_normed(x, r, g, BF16)))
        s = _scale_from_absmax(tl.reduce(amax, 0, _MAX))
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _quantize_row(_normed(x, r, g, BF16), s), mask=mask)
    tl.store(xs_ptr + row, tl.math.div_rn(1.0, s))


def quantize_activations(x, *, block_k=None):
    """Per-row absmax int8 quantisation, bit-identical to quant.activation_quant(x).

    x (..., K) float32 or bfloat16 -> (x_q (..., K) int8, x_scale (..., 1) float32 = 1/s).
    block_k: the row block; rows longer than it take the two-loop path (default: whole row up to 8192).
    """
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() < 1:
        raise TypeError(f"x: expected a float32/bfloat16/float16 tensor (..., K), got {x.dtype} {tuple(x.shape)}")
    dev = _check_device(x)
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
    with on_device(dev):
        _quantize_activations_kernel[(R,)](x2, x_q, x_scale, K, x2.stride(0), BLOCK_K=block, ONE_PASS=K <= block,
                                           num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)
    return x_q, x_scale



def norm_quant_settings(K, block_k=None):
    """Launch settings of the two row kernels for rows of K: one pass up to 8192 (or block_k), else
    loops."""
    block = triton.next_power_of_2(block_k or min(triton.next_power_of_2(max(K, 1)), 8192))
    return dict(BLOCK_K=block, ONE_PASS=K <= block, num_warps=4 if block <= 2048 else 8,
                enable_fp_fusion=False)


def rmsnorm_quantize(x, weight, eps=None, *, block_k=None):
    """quant.RMSNorm then quant.activation_quant in ONE kernel: (x_q (..., K) int8, x_scale (..., 1)
    fp32 = 1/s).

    x (..., K) float32 or bfloat16, weight (K,) the norm's gain (used as weight.to(x.dtype), as
    quant.RMSNorm does), eps None = torch.finfo(x.dtype).eps (F.rms_norm's default); block_k as
    quantize_activations'. The normed row is never written: it lives in registers between the two
    reductions (sum of squares, then absmax). Torch's roundings, op for op: the squares' sum, / K, +
    eps, 1 / sqrt (both IEEE: torch.rsqrt on CPU is that), (x * r) * g in fp32, one rounding to bf16
    for bf16 input, then activation_quant's. Bit for bit equal to torch whenever the fp32 sum of
    squares is (always when it is exact); torch itself sums in an order set by the CPU's vector
    width or CUDA's blocks, and a different order can move that sum, and so the row's codes and
    scale, by an ulp. """
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() < 1 or x.shape[-1] == 0:
        raise TypeError(
            f"x: expected a float32/bfloat16 tensor (..., K), K > 0, got {x.dtype} {tuple(x.shape)}"
        )
    K = x.shape[-1]
    if weight is None:
        weight = torch.ones(K, dtype=x.dtype, device=x.device)
    if weight.shape != (K,):
        raise ValueError(f"weight: expected the norm's gain ({K},), got {tuple(weight.shape)}")
    dev = _check_device(x, weight)
    x2 = x.reshape(-1, K)
    if K and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    x_q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    x_scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        eps = torch.finfo(x.dtype).eps if eps is None else float(eps)
        with on_device(dev):
            _rmsnorm_quant_kernel[(x2.shape[0],)](x2, weight.to(x.dtype).contiguous(), x_q, x_scale, K,
                                                  x2.stride(0), eps, BF16=x.dtype == torch.bfloat16,
                                                  **norm_quant_settings(K, block_k))
    return x_q, x_scale
