"""
The packed linear as one call: quantise the activations, then the ternary matmul (kernels/ternary_matmul.py),
for a model's layers rather than for a lesson on the kernels.

    linear(x, w_packed, w_scale)       x (..., K) float -> (..., N): quantize_activations, then ternary_matmul
    ternary_linear                     the same registered as a torch op ("nanobitnet::ternary_linear") with a fake
                                       that gives its output's shape, so torch.compile(fullgraph=True) traces a packed
                                       model as one opaque call per layer and CUDA graphs capture it
    BoundLinear(w_packed, w_scale, K)  linear for one weight with its checks, int32 word view and launch settings made
                                       once: per call three allocations, two views and two launches

kernels/packed_linear.py's PackedBitLinear calls BoundLinear eagerly and ternary_linear inside torch.compile. The
arithmetic and its sources (BitNet b1.58, arXiv 2402.17764; BitNet b1.58 2B4T, arXiv 2504.12285) are
kernels/ternary_matmul.py's; the byte layout is docs/packed-format.md.
Test: python -m pytest tests/test_packed.py
"""

import torch
from triton import cdiv, next_power_of_2

import kernels.ternary_matmul as tm  # used as tm.<name>: a test that reloads it (TRITON_INTERPRET=1) is seen here

def linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) float -> (..., N): quantize_activations, then ternary_matmul; bf16 out for bf16 x, else fp32."""
    x_q, x_scale = tm.quantize_activations(x)
    out_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    return tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=out_dtype)


ternary_linear = torch.library.custom_op("nanobitnet::ternary_linear", linear, mutates_args=())  # the same, as an op


class BoundLinear:
    """linear(x, w_packed, w_scale) for one packed weight, with the checks, the weight's int32 word view and the
    launch settings made once (PackedBitLinear keeps one per weight): a call allocates x_q, x_scale and y, makes
    two views and launches the quantiser and one matmul kernel, the same kernels with the same settings as
    linear, so the same numbers bit for bit. Inputs linear would re-lay (K % 16 != 0, a dtype other than fp32 or
    bf16) go through linear itself."""

    def __init__(self, w_packed, w_scale, K):
        N = w_packed.shape[0]
        if w_packed.dtype != torch.uint8 or w_packed.dim() != 2 or w_packed.shape[1] != (K + 3) // 4:
            raise ValueError(f"w_packed: expected uint8 (N, ceil(K/4)) for K = {K}, got {w_packed.dtype} "
                             f"{tuple(w_packed.shape)}; pack with quant.pack_ternary")
        if w_scale.dtype != torch.float32 or w_scale.numel() not in (1, N) or K >= tm.K_MAX:
            raise ValueError(f"w_scale: expected float32 with 1 or N = {N} elements, got {w_scale.dtype} "
                             f"{tuple(w_scale.shape)} (and K < {tm.K_MAX}, K = {K})")
        tm._check_device(w_packed, w_scale)
        self.w_packed, self.w_scale, self.N, self.K, self.KW = w_packed, w_scale, N, K, (K + 15) // 16
        self.whole = K % 16 == 0 and K > 0  # rows of whole int32 words: views, no re-laying
        self.w = tm._weight_words(w_packed, K) if self.whole else None  # (N, KW) int32
        self.ws = w_scale.reshape(-1).contiguous()
        self.stride_ws = 0 if self.ws.numel() == 1 else 1
        block = min(next_power_of_2(max(K, 1)), 8192)
        self.quant = dict(BLOCK_K=block, ONE_PASS=K <= block, num_warps=4 if block <= 2048 else 8,
                          enable_fp_fusion=False)
        dec = tm.INTERPRETER_CONFIGS["decode"] if tm.INTERPRETED else tm.DECODE_CONFIGS[tm.decode_config(N, K)]
        self.decode = dict(dec, DP4A=not tm.INTERPRETED, WRITE_ACC=False)
        self.decode_grid = (cdiv(N, dec["BLOCK_N"]),)
        arch = 0 if tm.INTERPRETED else torch.cuda.get_device_capability(w_packed.device)[0]
        self.prefill = {tall: dict(tm.INTERPRETER_CONFIGS["prefill"]) if tm.INTERPRETED else
                        tm.prefill_config(65 if tall else 64, K, arch) for tall in (False, True)}

    def __call__(self, x):
        K, N = self.K, self.N
        if not self.whole or x.dtype not in (torch.float32, torch.bfloat16) or x.device != self.w.device:
            return linear(x, self.w_packed, self.w_scale)
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        M = x2.shape[0]
        x_q = torch.empty((M, K), dtype=torch.int8, device=x.device)
        x_scale = torch.empty((M,), dtype=torch.float32, device=x.device)
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)  # bf16 for bf16 x, else fp32: linear's rule
        if M:
            tm._quantize_activations_kernel[(M,)](x2, x_q, x_scale, K, x2.stride(0), **self.quant)
            if M <= tm.DECODE_MAX_M:
                tm._decode_kernel[self.decode_grid](x_q.view(torch.int32), x_scale, self.w, self.ws, y, M, N,
                                                    self.KW, K // 4, self.KW, N, self.stride_ws, **self.decode)
            else:
                cfg = self.prefill[M > 64]
                grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
                tm._prefill_kernel[grid](x_q, x_scale, self.w, self.ws, y, M, N, K, self.KW, K, self.KW, N,
                                         self.stride_ws, WRITE_ACC=False, **cfg)
        return y.view(*x.shape[:-1], N)


@ternary_linear.register_fake
def _(x, w_packed, w_scale):
    return x.new_empty((*x.shape[:-1], w_packed.shape[0]),
                       dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
