"""
Ternary x int8 matmul for 2 to 16 rows of x on int8 tensor cores: the decode of a small batch (or of a few
speculated tokens), where the dp4a kernel of kernels/ternary_matmul.py unpacks each weight word once per 8 rows.

The same contract as ternary_matmul (docs/packed-format.md): W_q in {-1, 0, +1} packed four to a byte in plane
order, x_q int8, and per output element

    acc[m, n] = sum_k x_q[m, k] * W_q[n, k]                      int32, exact (|acc| < 128 K)
    y[m, n]   = (float32(acc[m, n]) * x_scale[m]) * gamma[n]     fp32, in this order, then cast

The weights are the MMA's A operand and the M <= 16 rows of x its 16 columns (y^T = W_q x_q^T): BLOCK_N weight
rows fill the tile's other side. Each weight word is loaded once (16-byte loads) and unpacked in registers for
every row at once, whole words as _unpack_kernel does: plane i's four codes (w >> 2i) & 0x03030303 minus one in
each byte, without a borrow crossing bytes, are four int8 weights, byte j for k = iQ + 4g + j (Q = 4 KW). The
sum over k is taken byte by byte: byte j of every word, a (BN, BG) int8 tile, against x's elements
iQ + 4g + j (x's plane tile split four ways in registers): four MMAs a plane. Sources: BitNet b1.58 (arXiv
2402.17764, section 2) for the quantisers; W1.58A8 inference from 2-bit packed weights, BitNet b1.58 2B4T
(arXiv 2504.12285).

Chosen with ternary_matmul(..., config="decode-mma"); not the default until a GPU measures it against the dp4a
form (python -m lab.bench prints both at M = 4 and 16). kernels/cross_compile.py reads its compiled K loop
(sm_90: 53.5 instructions a weight word for all 16 rows, 16 wgmma .s8 a K step; the dp4a form: 175 for 16 rows).

Test (CPU, interpreter):  python -m pytest tests/test_kernels.py -k tensor_cores
Compiled code (no GPU):   python -m kernels.cross_compile
"""

import os

import torch
import triton
import triton.language as tl

# triton.jit reads TRITON_INTERPRET when it decorates, i.e. when this module is imported; kernels/ternary_matmul.py
# reloads this module when it is reloaded under another setting
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _decode_mma_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,  # x (M, 16 KW) int8 (x words as bytes), x_scale, w (N, KW) int32, gamma, y
    M, N, KW,
    stride_xm, stride_wn, stride_om, stride_ws,
    BLOCK_N: tl.constexpr,  # weight rows per program: the tensor-core tile's M side
    BLOCK_G: tl.constexpr,  # words of each row per K step (>= 32: the int8 MMA's K)
    WRITE_ACC: tl.constexpr,
):
    """Decode for 2 <= M <= 16 on int8 tensor cores, weights as the A operand (y^T = W_q x_q^T: the
    N side fills the tile's rows, the M <= 16 rows of x its 16 columns). Each weight word is loaded
    once and unpacked in registers for all rows of x, whole words as in _unpack_kernel: plane i's
    four codes (w >> 2i) & 0x03030303, minus one in each byte without a borrow, are four int8
    weights W_q, byte j for k = iQ + 4g + j. The sum over k is taken byte by byte: byte j of every
    word (a (BN, BG) int8 tile) against x's elements iQ + 4g + j (x's plane-i bytes, split four
    ways), four MMAs a plane. W_q holds -1/0/+1: no row-sum correction."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_c = tl.arange(0, 4 * BLOCK_G)  # x's bytes of one plane and K step
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BN, 1)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (16, 1)
    acc = tl.full((BLOCK_N, 16), 0, tl.int32)
    for g0 in range(0, KW, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        # (BN, BG) int32, each word once; past K (and past N) the code 1 of every byte: weight 0
        w = tl.load(w_rows + g[None, :], mask=n_mask[:, None] & (g < KW)[None, :], other=0x55555555)
        c_mask = (g0 * 4 + offs_c) < 4 * KW
        for i in tl.static_range(4):
            # four int8 W_q per word; -2139062144 = 0x80808080
            v = ((((w >> (2 * i)) & 0x03030303) | -2139062144) - 0x01010101) ^ -2139062144
            x = tl.load(x_rows + (i * 4 * KW + 4 * g0 + offs_c)[None, :], mask=m_mask[:, None] & c_mask[None, :],
                        other=0)  # (16, 4 BG) int8: k = iQ + 4 g0 + c, Q = 4 KW bytes of each plane
            # (16, BG, 2, 2)[m, g, t, a] is byte j = 2t + a of word g; split takes the last dim
            x_even, x_odd = tl.split(tl.reshape(x, (16, BLOCK_G, 2, 2)))  # bytes 0, 2 and 1, 3: [m, g, t]
            x0, x2 = tl.split(x_even)
            x1, x3 = tl.split(x_odd)
            acc = tl.dot(v.to(tl.int8), tl.trans(x0), acc, out_dtype=tl.int32)  # byte 0 of each word
            acc = tl.dot((v >> 8).to(tl.int8), tl.trans(x1), acc, out_dtype=tl.int32)
            acc = tl.dot((v >> 16).to(tl.int8), tl.trans(x2), acc, out_dtype=tl.int32)
            acc = tl.dot((v >> 24).to(tl.int8), tl.trans(x3), acc, out_dtype=tl.int32)
    out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]  # y[m, n] = acc[n, m]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if WRITE_ACC:
        tl.store(out, acc, mask=out_mask)
    else:  # same order as the reference: (acc * x_scale) * gamma
        gamma = tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)  # (BN,) fp32
        xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)  # (16,) fp32
        y = acc.to(tl.float32) * xs[None, :] * gamma[:, None]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=out_mask)


# 64 weight rows a program (the tile's M side), 32 words = 128 codes of each plane per K step (>= 32: the int8 MMA's K)
DECODE_MMA_CONFIG = dict(BLOCK_N=64, BLOCK_G=32, num_warps=4, num_stages=1)
INTERPRETER_CONFIG = dict(BLOCK_N=16, BLOCK_G=32)  # few programs: the interpreter pays per program and op


def launch_decode_mma(xw, xs, w, ws, y, M, N, KW, stride_ws, return_acc=False, cfg=None):
    """The kernel on x words (M, 4 KW) int32, read as bytes, and weight words (N, KW); ternary_matmul checks the
    arguments and calls this for config="decode-mma"."""
    if cfg is None:
        cfg = INTERPRETER_CONFIG if INTERPRETED else DECODE_MMA_CONFIG
    x8 = xw.view(torch.int8)  # (M, 16 KW)
    _decode_mma_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](x8, xs, w, ws, y, M, N, KW, x8.stride(0), w.stride(0),
                                                          y.stride(0), stride_ws, WRITE_ACC=return_acc, **cfg)
