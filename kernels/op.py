"""
The packed linear as one call: quantise the activations, then the ternary matmul (kernels/ternary_matmul.py),
for a model's layers rather than for a lesson on the kernels.

    linear(x, w_packed, w_scale)       x (..., K) float -> (..., N): quantize_activations, then ternary_matmul
    ternary_linear                     the same registered as a torch op ("nanobitnet::ternary_linear") with a fake
                                       that gives its output's shape, so torch.compile(fullgraph=True) traces a packed
                                       model as one opaque call per layer and CUDA graphs capture it
    norm_linear(x, g, eps, w_packed, w_scale)   quant.RMSNorm (gain g) then linear, the norm and the
                                       activation quantisation in one kernel (rmsnorm_quantize);
                                       registered as "nanobitnet::norm_ternary_linear"
    BoundLinear(w_packed, w_scale, K[, norm])   linear (or norm_linear) for one weight with its
                                       checks, int32 word view and launch settings made once: per
                                       call three allocations, two views and two launches

kernels/packed_linear.py's PackedBitLinear calls BoundLinear eagerly and ternary_linear inside torch.compile. The
arithmetic and its sources (BitNet b1.58, arXiv 2402.17764; BitNet b1.58 2B4T, arXiv 2504.12285) are
kernels/ternary_matmul.py's; the byte layout is docs/packed-format.md.
Test: python -m pytest tests/test_packed.py
"""

import torch
import torch.nn.functional as F

import kernels.ternary_matmul as tm  # used as tm.<name>: a test that reloads it (TRITON_INTERPRET=1) is seen here

def linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) float -> (..., N): quantize_activations, then ternary_matmul; bf16 out for bf16 x, else fp32."""
    x_q, x_scale = tm.quantize_activations(x)
    out_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    return tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=out_dtype)


ternary_linear = torch.library.custom_op("nanobitnet::ternary_linear", linear, mutates_args=())  # the same, as an op


def norm_linear(x: torch.Tensor, g: torch.Tensor, eps: float, w_packed: torch.Tensor,
                w_scale: torch.Tensor) -> torch.Tensor:
    """linear(quant.RMSNorm(x) with gain g and eps), the norm and the quantiser one kernel
    (fp32/bf16 x; other dtypes: the norm in torch, then quantize_activations): the same numbers as
    the two apart (rmsnorm_quantize)."""
    if x.dtype in (torch.float32, torch.bfloat16):
        x_q, x_scale = tm.rmsnorm_quantize(x, g, eps)
    else:
        x_q, x_scale = tm.quantize_activations(F.rms_norm(x, (x.shape[-1],), g.to(x.dtype), eps))
    out_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    return tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=out_dtype)


norm_ternary_linear = torch.library.custom_op(
    "nanobitnet::norm_ternary_linear", norm_linear, mutates_args=()
)


class BoundLinear:
    """linear(x, w_packed, w_scale) for one packed weight, with the checks, the weight's int32 word view and the
    launch settings made once (PackedBitLinear keeps one per weight): a call allocates x_q, x_scale and y, makes
    two views and launches the quantiser and one matmul kernel, the same kernels with the same settings as
    linear, so the same numbers bit for bit. Inputs linear would re-lay (K % 16 != 0, a dtype other than fp32 or
    bf16) go through linear itself. The kernels launch on the current CUDA device, unguarded (a guard per call
    costs host time): for a model on another GPU make its device current first (torch.cuda.set_device, as
    sample.py does; tools/decode.py's Decoder does it for its generate)."""

    def __init__(self, w_packed, w_scale, K, norm=None):
        N = w_packed.shape[0]
        self.norm = norm  # None, or (gain, eps): quant.RMSNorm before the quantiser, in its kernel
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
        self.quant = tm.norm_quant_settings(K)
        # for M = 0 .. DECODE_MAX_M: the decode kernel's settings and grid
        self.decode = [tm.decode_launch(N, K, M) for M in range(tm.DECODE_MAX_M + 1)]
        arch = 0 if tm.INTERPRETED else torch.cuda.get_device_capability(w_packed.device)[0]
        self.prefill = {tall: dict(tm.INTERPRETER_CONFIGS["prefill"]) if tm.INTERPRETED else
                        tm.prefill_config(65 if tall else 64, K, arch) for tall in (False, True)}

    def __call__(self, x):
        K, N = self.K, self.N
        if not self.whole or x.dtype not in (torch.float32, torch.bfloat16) or x.device != self.w.device:
            if self.norm is not None:
                eps = torch.finfo(x.dtype).eps if self.norm[1] is None else self.norm[1]
                return norm_linear(x, self.norm[0], eps, self.w_packed, self.w_scale)
            return linear(x, self.w_packed, self.w_scale)
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        M = x2.shape[0]
        x_q = torch.empty((M, K), dtype=torch.int8, device=x.device)
        x_scale = torch.empty((M,), dtype=torch.float32, device=x.device)
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)  # bf16 for bf16 x, else fp32: linear's rule
        if M:
            if self.norm is None:
                tm._quantize_activations_kernel[(M,)](
                    x2, x_q, x_scale, K, x2.stride(0), **self.quant
                )
            else:
                g, eps = self.norm[0].to(x.dtype), self.norm[1]
                eps = torch.finfo(x.dtype).eps if eps is None else eps
                tm._rmsnorm_quant_kernel[(M,)](x2, g, x_q, x_scale, K, x2.stride(0), eps,
                                               BF16=x.dtype == torch.bfloat16, **self.quant)
            if M <= tm.DECODE_MAX_M:
                cfg, grid = self.decode[M]
                tm._decode_kernel[grid](
                    x_q.view(torch.int32),
                    x_scale,
                    self.w,
                    self.ws,
                    y,
                    M,
                    N,
                    self.KW,
                    K // 4,
                    self.KW,
                    N,
                    self.stride_ws,
                    WRITE_ACC=False,
                    **cfg,
                )
            else:
                tm.launch_prefill(
                    x_q,
                    x_scale,
                    self.w,
                    self.ws,
                    y,
                    M,
                    N,
                    K,
                    self.KW,
                    self.stride_ws,
                    cfg=self.prefill[M > 64],
                )
        return y.view(*x.shape[:-1], N)


@ternary_linear.register_fake
def _(x, w_packed, w_scale):
    return x.new_empty((*x.shape[:-1], w_packed.shape[0]),
                       dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)


@norm_ternary_linear.register_fake
def _(x, g, eps, w_packed, w_scale):
    return x.new_empty((*x.shape[:-1], w_packed.shape[0]),
                       dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
