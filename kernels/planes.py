"""
The plane layout of 2-bit ternary weights, and the ternary x int8 contract in plain torch.

A ternary matrix W_q in {-1, 0, +1} (N, K) is stored as codes W_q + 1 in {0, 1, 2}, four to a byte, in one layout:
quant.pack_ternary writes it (pack_planes here is the same function), the kernels read it, the export file holds it.
A row of K codes is cut into four planes of Q = ceil(K/4) codes, and byte j holds code j of each plane:
    w[n, j] (N, Q) uint8 holds k = j, j + Q, j + 2Q, j + 3Q in bits 0-1, 2-3, 4-5, 6-7     (0b11 is never written)
    k >= K (up to 4Q) holds code 0b01 (weight 0), so the padding adds nothing.
Read as little-endian int32 words, word g of a row holds k = 4g..4g+3 of each plane, and
    (word >> 2i) & 0x03030303 = the four codes of k = iQ + 4g .. iQ + 4g + 3, one per byte,
which pair with the activations' int32 word iQ/4 + g: one shift, one mask and one dp4a do four multiply-adds
(after the GPU kernel of BitNet b1.58 2B4T, arXiv 2504.12285, whose weights are permuted offline for the same
reason). Bytes in k order (k in bits 2*(k % 4) of byte k // 4, the layout of format v1 exports, which the loader
refuses): planes_from_packed converts them, packed_from_planes back, both exactly (docs/packed-format.md).

The contract every implementation meets (BitNet b1.58, arXiv 2402.17764, section 2):
    acc[m, n] = sum_k x_q[m, k] * W_q[n, k]                 int32, exact (|acc| <= 128 K < 2**31)
    y[m, n]   = (float32(acc[m, n]) * x_scale[m]) * gamma   fp32, in this order, then cast to out_dtype
ternary_matmul_reference unpacks on every call and multiplies in float64 (exact, CPU or CUDA);
ternary_matmul_codes takes the codes unpacked once to (N, K) int8 (PackedBitLinear keeps them on CPU) and gets
the same accumulator from torch._int_mm. The Triton kernels are kernels/ternary_matmul.py.

Test: python -m pytest tests/test_kernels.py
"""

import torch

from quant import pack_ternary as pack_planes  # noqa: F401  the one layout, under the kernels' name for it

K_MAX = 2**23  # 2 * 128 * K < 2**31: the largest partial sum of codes (0..2) times int8 stays in int32

# -----------------------------------------------------------------------------
# the layout

_PLANE_SHIFTS = (0, 2, 4, 6)


def _codes(w, order):
    """(N, Q) uint8 -> (N, 4Q) codes in k order, from "planes" (quant.pack_ternary) or "sequential" (v1) bytes."""
    shifts = torch.tensor(_PLANE_SHIFTS, dtype=torch.uint8, device=w.device)
    codes = (w.unsqueeze(-1) >> shifts) & 3  # (N, Q, 4): byte j, slot i
    return (codes.transpose(1, 2) if order == "planes" else codes).reshape(w.shape[0], -1)


def _pack_codes(codes, order):
    """(N, 4Q) codes in k order -> (N, Q) uint8 bytes in the given order."""
    N = codes.shape[0]
    slots = codes.view(N, 4, -1) if order == "planes" else codes.view(N, -1, 4).transpose(1, 2)  # (N, i, j)
    return (slots[:, 0] | slots[:, 1] << 2 | slots[:, 2] << 4 | slots[:, 3] << 6).contiguous()


def planes_from_packed(w_packed):
    """A v1 export's sequential bytes (k in bits 2*(k % 4) of byte k // 4) -> plane order; exact."""
    return _pack_codes(_codes(w_packed, "sequential"), "planes")


def packed_from_planes(w_planes):
    """Plane order -> the sequential bytes of a v1 export; the inverse of the above."""
    return _pack_codes(_codes(w_planes, "planes"), "sequential")


def _weight_words(w, K):
    """(N, ceil(K/4)) plane-order bytes -> (N, ceil(K/16)) int32 words whose planes are 4 * ceil(K/16) bytes.
    A view when ceil(K/4) is a multiple of 4 (K % 16 == 0 or >= 13); otherwise the codes are re-laid in planes
    of 4 * ceil(K/16) bytes, a copy on every call (no model here has such a K: its dimensions are multiples of 16)."""
    Q, KW = w.shape[1], (K + 15) // 16
    if Q == 4 * KW:
        w = w.contiguous()
        return (w if w.data_ptr() % 4 == 0 else w.clone()).view(torch.int32)
    codes = torch.ones((w.shape[0], 16 * KW), dtype=torch.uint8, device=w.device)
    codes[:, :K] = _codes(w, "planes")[:, :K]
    return _pack_codes(codes, "planes").view(torch.int32)


def _x_words(x2, K, KW):
    """(M, K) int8 -> (M, 4 * KW) int32 words, x zero-padded to 16 * KW; a view when K == 16 * KW."""
    if K == 16 * KW and x2.data_ptr() % 4 == 0:
        return x2.view(torch.int32)
    xp = torch.zeros((x2.shape[0], 16 * KW), dtype=torch.int8, device=x2.device)
    xp[:, :K] = x2
    return xp.view(torch.int32)



# -----------------------------------------------------------------------------
# reference in plain torch (independent of the kernels and of quant.py)


def unpack_ternary_reference(w_packed, K):
    """(N, ceil(K/4)) uint8 in plane order -> (N, K) int8 in {-1, 0, 1}: element k is bits 2*(k // Q) of byte k % Q."""
    N, Q = w_packed.shape
    k = torch.arange(K, device=w_packed.device)
    codes = (w_packed[:, k % Q].to(torch.int32) >> (2 * (k // Q)).to(torch.int32)) & 3  # (N, K)
    return (codes - 1).to(torch.int8)


def ternary_matmul_reference(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, return_acc=False):
    """The same contract as ternary_matmul, in torch.

    The integer product is computed in float64, which is exact here (every partial sum is an
    integer of magnitude <= 128 * K < 2**53) and, unlike integer matmul, exists on CPU and CUDA.
    """
    K = x_q.shape[-1]
    w = unpack_ternary_reference(w_packed, K)  # (N, K)
    acc = (x_q.double() @ w.double().T).to(torch.int32)  # (..., N), exact
    return acc if return_acc else _scaled(acc, x_scale, w_scale, out_dtype)


def _scaled(acc, x_scale, w_scale, out_dtype):
    """acc (..., N) int32 -> acc * x_scale * gamma in out_dtype: two fp32 multiplies, in this order."""
    gamma = w_scale.float().reshape(()) if w_scale.numel() == 1 else w_scale.float().reshape(-1)  # () or (N,)
    y = acc.float() * x_scale.float().reshape(*acc.shape[:-1], 1) * gamma
    return y.to(out_dtype)


def ternary_matmul_codes(x_q, x_scale, w_q, w_scale, out_dtype=torch.float32, return_acc=False):
    """The same contract from the unpacked (N, K) int8 codes w_q (unpack_ternary_reference(w_packed, K)), for CPU
    tensors: the int32 accumulator by torch._int_mm, int8 x int8 products summed in int32 (exact: |sum| <= 128 K
    < 2**31 for K <= K_MAX), so acc and y equal ternary_matmul_reference's bit for bit. Any M, K, N on CPU."""
    K = x_q.shape[-1]
    if K == 1:  # an outer product; torch._int_mm (torch 2.13, CPU) gets it wrong for N > 1
        acc = x_q.to(torch.int32) * w_q.reshape(-1).to(torch.int32)  # (..., 1) * (N,): (..., N) int32
    else:
        acc = torch._int_mm(x_q.reshape(-1, K), w_q.T).reshape(*x_q.shape[:-1], w_q.shape[0])  # (..., N) int32
    return acc if return_acc else _scaled(acc, x_scale, w_scale, out_dtype)
