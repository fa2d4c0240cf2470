"""
BitNet b1.58: ternary weights and 8-bit activations, trained with a straight-through estimator.

The idea: every hidden matrix is used as W_q * gamma with W_q in {-1, 0, +1} (1.58 bits), and every
activation entering it as x_q / s with x_q an int8. Training keeps full-precision "latent" weights and
quantises on the fly in the forward pass; the straight-through estimator (STE) lets the gradient pass
through the rounding as if it were the identity, so the optimizer updates the latent weights.

Sources: BitNet b1.58 (arXiv 2402.17764, section 2); Microsoft's "training tips, code and FAQ" (Fig. 3);
HF transformers integrations/bitnet.py; lambda-warmup from the HF blog "Fine-tuning LLMs to 1.58bit".

    weights (per tensor, absmean):  gamma = max(mean|W|, 1e-5)            1e-5 = GAMMA_MIN: training and export alike
                                    W_q   = clamp(round(W / gamma), -1, 1)           fake-quant: W_q * gamma
    activations (per token, absmax): s    = 127 / max(max|x|, 1e-5)                   (per row of the last dim)
                                    x_q   = clamp(round(x * s), -128, 127)           fake-quant: x_q / s
    STE with lambda-warmup:         v_lam = v + lam * stopgrad(Q(v) - v)             lam: 0 = fp, 1 = ternary
    inference:                      y = (x_q @ W_q^T) * gamma / s                    (int32 accumulation, exact)
    q, k, v of one input:           [q k v] = x @ [W_q,i * gamma_i]^T stacked, one matmul, gamma per matrix

torch.round rounds half to even (0.5 -> 0, 1.5 -> 2 -> clamped to 1), computed in fp32.
lambda lives in a 0-d buffer of every BitLinear (and QuantRMSNorm), and its default is 1: ternary. Loading
full-precision weights (an nn.Linear checkpoint, load_state_dict(strict=False)) leaves it at 1, so the loaded
model computes ternary; it stays full precision only after set_lambda(model, 0). A BitLinear checkpoint
brings its own saved lambda_. Being a tensor, lambda never recompiles a torch.compile'd model as it moves.
Packed storage for inference, four ternary weights per byte: pack_ternary, specified in docs/packed-format.md.
Speed (the same values, computed less often: QuantRMSNorm, the weight-quant cache): the section at the bottom.

Run the demo:  python quant.py          Test:  python -m pytest tests/test_quant.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# quantizers: integer codes plus the scale, and the fake-quantised ("dequantised") forms used in training

# the floor of gamma, one value for training (weight_fake_quant), weight_quant and every export:
# a matrix with mean|W| below it (all zero, or tiny) has codes 0 everywhere, in each of them
GAMMA_MIN = 1e-5


def weight_quant(w):
    """Absmean ternary quantisation of a whole matrix. Returns int8 codes in {-1,0,1}
    and fp32 gamma."""
    w = w.float()
    scale = w.abs().mean().clamp(min=GAMMA_MIN)  # gamma, 0-d
    w_q = (w / scale).round().clamp(-1, 1).to(torch.int8)
    return w_q, scale


def activation_quant(x):
    """Per-token absmax int8 quantisation over the last dim. Returns int8 codes and
    fp32 scale = 1/s."""
    x = x.float()
    s = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)  # (..., 1)
    x_q = (x * s).round().clamp(-128, 127).to(torch.int8)
    return x_q, 1.0 / s


@torch.no_grad()
def weight_fake_quant(w):
    """W_q * gamma in w's dtype, computed in fp32 (the forward value seen by F.linear in training).
    No autograd graph: the gradient comes from the STE."""
    wf = w.float()
    scale = wf.abs().mean().clamp(min=GAMMA_MIN)
    return (wf / scale).round_().clamp_(-1, 1).mul_(scale).to(w.dtype)


@torch.no_grad()
def activation_fake_quant(x):
    """x_q / s in x's dtype, computed in fp32: one row absmax, one scale, one rounding per row.
    max|x| is taken as max(amax(x), -amin(x)): the same value as x.abs().amax(-1) without writing
    |x|, and on a CPU several times faster than torch.linalg.vector_norm(x, inf) (python -m
    lab.bench --profile times both). The clamp to [-128, 127]
    never binds here: |x * s| <= 127 (1 + 2^-23) < 127.5 rounds to at most 127. No autograd graph:
    the gradient comes from the STE."""
    xf = x.float()
    absmax = torch.maximum(xf.amax(-1, keepdim=True), xf.amin(-1, keepdim=True).neg_())
    s = 127.0 / absmax.clamp_(min=1e-5)
    return (xf * s).round_().div_(s).to(x.dtype)


class STE(torch.autograd.Function):
    """Forward lerp(v, Q(v), lambda) = v + lambda (Q(v) - v), one op, exactly Q(v) at lambda 1 and v
    at 0; backward passes the gradient to v unchanged (none to Q(v) or lambda): no op at all."""

    @staticmethod
    def forward(ctx, v, v_quant, lambda_):
        return torch.lerp(v, v_quant, lambda_.to(v.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def ste(v, v_quant, lambda_):
    """v + lambda * stopgrad(Q(v) - v): the forward value blends to Q(v), the gradient is the
    identity."""
    return STE.apply(v, v_quant, lambda_)


# -----------------------------------------------------------------------------
# BitLinear


class BitLinear(nn.Linear):
    """nn.Linear whose forward sees lambda-blended fake-quantised activations and weights.

    The latent weight stays full precision (the optimizer's master copy). Set the blend with
    `set_lambda(model, lam)` or `m.lambda_.fill_(lam)`; 0 is exactly F.linear, 1 is BitNet b1.58.
    quantize_input=False when the op before it already quantised x (QuantRMSNorm, speed section).
    In model.py that is every BitLinear: each reads a QuantRMSNorm's output, so the activation
    quantiser that runs there is the norm's (the same ste(x, activation_fake_quant(x), lambda) as
    forward() below), and of BitLinear only quantized_weight() runs (stacked_linear calls it for
    q, k, v and gate, up). Used alone, as an nn.Linear swap, it quantises its input itself.

    Swapping it for an nn.Linear in another project, three differences to know:
      - bias defaults to False (BitNet b1.58 has no biases; PackedBitLinear refuses them), where nn.Linear's
        defaults to True: a bare nn.Linear(a, b) -> BitLinear(a, b) drops the bias. Pass bias= explicitly;
        BitLinear(a, b, bias=True) has exactly nn.Linear(a, b)'s parameters.
      - lambda_ starts at 1: ternary from the first step, and ternary after loading full-precision weights
        into it. To keep loaded weights full precision (or for lambda-warmup), set_lambda(model, 0.0) after
        building or loading the model, and raise it during training.
      - the state dict has one key more, "lambda_" (saved, so a resumed run keeps its lambda). An nn.Linear
        checkpoint loads with load_state_dict(sd, strict=False), whose missing_keys are then only the lambda_
        keys; code that counts keys (nanoGPT's from_pretrained asserts equal counts) must leave them out.
    """

    def __init__(self, in_features, out_features, bias=False, quantize_input=True, device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        # 0-d; 0 = fp, 1 = ternary (default)
        self.register_buffer("lambda_", torch.ones((), device=device))
        self.quantize_input = quantize_input
        self.w_quant = None  # W_q * gamma, cached once per step by cache_weight_quant (speed)

    def forward(self, x):
        if self.quantize_input:
            x = ste(x, activation_fake_quant(x), self.lambda_)         # (..., in)
        return F.linear(x, self.quantized_weight(), self.bias)          # (..., out)

    def quantized_weight(self):
        """The weight F.linear sees: the lambda blend of W and W_q * gamma, gamma this matrix's own
        (out, in). The cached W_q * gamma (cache_weight_quant) is the same tensor, computed once."""
        w_quant = weight_fake_quant(self.weight) if self.w_quant is None else self.w_quant
        return ste(self.weight, w_quant, self.lambda_)


def stacked_linear(x, layers, split=True):
    """Several projections of one input (q, k, v; gate, up) as ONE matmul: the layers' weights, each quantised
    with its own gamma (a BitLinear) or as it is (an nn.Linear), stacked along the output dim. Every output
    column is the same dot product as in the layer's own forward, so the result equals calling the layers one
    by one up to fp32 rounding, in one larger GEMM; the gradient flows back into each layer's own weight.
    Returns one output (..., out_i) per layer (views of the one product), or with split=False the one
    product (..., sum out), whose gradient then stays one tensor (no cat of the parts in backward)."""
    if len({(isinstance(m, BitLinear) and m.quantize_input) for m in layers}) > 1:
        raise ValueError("stacked_linear: the layers must all quantise their input, or none")
    if isinstance(layers[0], BitLinear) and layers[0].quantize_input:  # once for all (one lambda)
        x = ste(x, activation_fake_quant(x), layers[0].lambda_)
    w = torch.cat([m.quantized_weight() if isinstance(m, BitLinear) else m.weight
                   for m in layers])  # (sum out, in)
    bias = None if all(m.bias is None for m in layers) else torch.cat(
        [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in layers])
    y = F.linear(x, w, bias)
    return y.split([m.out_features for m in layers], dim=-1) if split else y


def set_lambda(model, lam):
    """Write lam into every BitLinear's and QuantRMSNorm's buffer in place (no recompile, no host
    sync)."""
    for m in model.modules():
        if isinstance(m, (BitLinear, QuantRMSNorm)):
            m.lambda_.fill_(lam)


# -----------------------------------------------------------------------------
# 2-bit packing: four ternary codes per byte along the input dimension, as in BitNet b1.58 2B4T
# (arXiv 2504.12285); the bit layout is ours, with worked bytes in docs/packed-format.md, and it is the one the
# kernels read (kernels/ternary_matmul.py) and the export file holds. code = W_q + 1 in {0, 1, 2} (0b00 = -1,
# 0b01 = 0, 0b10 = +1). A row of K codes is cut into four planes of Q = ceil(K/4), padded with 0b01 (weight 0);
# byte j holds element j of each plane: k = j, j + Q, j + 2Q, j + 3Q in bits 0-1, 2-3, 4-5, 6-7. So four bytes
# read as one int32 word, shifted by 2i and masked with 0x03030303, are four consecutive codes of plane i: one
# dp4a on the GPU. That is 2 bits per weight: 1/8 of the bytes of bf16.


def pack_ternary(w_q):
    """(N, K) int8 in {-1,0,1} -> (N, Q) uint8, Q = ceil(K/4): byte j holds k = j + iQ in bits
    2i..2i+1."""
    N, K = w_q.shape
    Q = (K + 3) // 4
    codes = torch.ones((N, 4 * Q), dtype=torch.uint8, device=w_q.device)  # 0b01 (weight 0) past K
    codes[:, :K] = (w_q.to(torch.int16) + 1).to(torch.uint8)  # {0, 1, 2}
    planes = codes.view(N, 4, Q)  # (N, plane i, byte j): element k = iQ + j
    return (planes[:, 0] | planes[:, 1] << 2 | planes[:, 2] << 4 | planes[:, 3] << 6).contiguous()


def unpack_ternary(packed, in_features):
    """(N, ceil(K/4)) uint8 -> (N, K) int8 in {-1,0,1}; the inverse of pack_ternary."""
    N = packed.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device).view(1, 4, 1)
    codes = (packed.unsqueeze(1) >> shifts) & 3  # (N, plane i, byte j): element k = iQ + j
    return (codes.reshape(N, -1)[:, :in_features].to(torch.int8) - 1).contiguous()


# -----------------------------------------------------------------------------
# Speed: the same values and gradients as above, computed less often. Where the quantisation cost goes:
#   - Activation quantisation is a row reduction (absmax) plus elementwise work on every BitLinear input. In our
#     model each BitLinear reads a norm's output (pre-norms feed q/k/v and gate/up, SubLN feeds o_proj and
#     down_proj), so QuantRMSNorm quantises once for all its readers (1 pass instead of 3 for q/k/v), and under
#     torch.compile the norm, absmax and rounding become one fused kernel. BitLinear(quantize_input=False) then
#     skips its own quantiser.
#   - Weight quantisation is a whole-matrix reduction (absmean) and a rounding pass per matrix. It depends only
#     on the weights, which change once per optimizer step, so with gradient accumulation cache_weight_quant
#     computes W_q * gamma once per step and every micro-batch reuses it (same values, gradients);
#     clear_weight_quant drops the cache before the weights change.
#   - lambda is a tensor, never a Python float: no recompilation as it warms up, and no host sync to read it.
#   - In eager mode (the CPU default) every op is a dispatch and a pass over memory: the STE is one
#     lerp forward and nothing backward, the fake quantisers round and scale in place, and
#     RMSNormCPU gives the norms a 7-pass backward (python -m lab.bench --train counts a step's ops).


class RMSNormCPU(torch.autograd.Function):
    """F.rms_norm over the last dim, for fp32 CPU tensors in eager mode, with a hand-written
    backward, and with lambda_ given QuantRMSNorm's whole forward (the STE's lerp to
    activation_fake_quant of the norm's output), whose backward is the norm's (the STE passes the
    gradient unchanged). On the CPU torch has no fused RMSNorm: F.rms_norm runs the six ops below,
    and autograd differentiates them in about 23 more. The forward here is the same six ops in the same order (the same bits as
    F.rms_norm, then as ste(y, activation_fake_quant(y), lambda_)); the backward is 7 passes over
    (..., dim), within fp32 rounding of autograd's, with t = g x_hat:
        y = x_hat * w,  x_hat = x * r,  r = 1 / sqrt(mean(x^2) + eps)
        dx = r * (g w - x_hat * m) = r (g w) - x (r^2 m),  m = mean(g w x_hat) = (t @ w) / dim,
        dw = sum over rows of t
    In eager mode a new tensor costs more than its op (its memory is cold), so results are written
    over temporaries and x_hat is recomputed from the saved input: one new (..., dim) tensor
    forward (two with lambda_) and one backward, where autograd through the formula makes 5 and 4."""

    @staticmethod
    def forward(ctx, x, w, eps, lambda_=None):
        p = x.pow(2)
        r = p.mean(-1, keepdim=True).add_(eps).rsqrt_()  # (..., 1)
        ctx.save_for_backward(x, r, w)
        y = torch.mul(x, r, out=p).mul_(w)  # x_hat * w, x_hat = x * r: never a tensor of its own
        if lambda_ is None:
            return y
        q = activation_fake_quant(y)
        return torch.lerp(y, q, lambda_.to(y.dtype), out=q)  # ste(y, q, lambda_)'s forward

    @staticmethod
    def backward(ctx, g):
        x, r, w = ctx.saved_tensors
        n = w.numel()
        t = torch.mul(g, x).mul_(r)  # g x_hat: the one new (..., dim) tensor
        dw = t.reshape(-1, n).sum(0)
        k = torch.matmul(t, w).unsqueeze_(-1).mul_(r).mul_(r).div_(n)  # r^2 m, m by a GEMV
        return torch.mul(g, w, out=t).mul_(r).addcmul_(x, k, value=-1), dw, None, None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm with its gain cast to the input's dtype, so that under bf16 autocast (a bf16 input, an fp32 gain)
    torch dispatches to its fused RMSNorm kernel instead of the unfused fallback. In fp32 the cast is a no-op: the
    same op on the same tensors as nn.RMSNorm, bit for bit. The parameter stays fp32 (the
    optimizer's copy). An fp32 CPU input with a 1-D gain runs RMSNormCPU in eager mode: the same
    forward bits, a 7-pass backward."""

    def forward(self, x):
        w = self.weight.to(x.dtype) if self.weight is not None else None
        if self.on_cpu_path(x):
            return RMSNormCPU.apply(x, w, self.eps_for(x))
        return F.rms_norm(x, self.normalized_shape, w, self.eps)

    def on_cpu_path(self, x):
        """RMSNormCPU's case: fp32 on the CPU, eager. Under torch.compile the formula runs instead,
        which inductor fuses and differentiates itself: RMSNormCPU's in-place forward is not safe to
        trace (torch 2.11's compile gets its gradients wrong)."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and self.weight is not None
                and self.weight.dim() == 1 and not torch.compiler.is_compiling())

    def eps_for(self, x):
        return torch.finfo(x.dtype).eps if self.eps is None else self.eps  # as F.rms_norm


class QuantRMSNorm(RMSNorm):
    """RMSNorm whose output is already the lambda-blended int8 fake-quantised activation.

    In our model every BitLinear reads the output of a norm (pre-norms feed q/k/v and gate/up, SubLN feeds
    o_proj and down_proj), so the activation quantiser moves into that norm: one quantisation for q, k and v
    instead of three, and under torch.compile the norm, the row absmax and the rounding fuse into one kernel.
    """

    def __init__(self, dim, eps=1e-5, device=None):
        super().__init__(dim, eps=eps, device=device)
        self.register_buffer("lambda_", torch.ones((), device=device))

    def forward(self, x):
        if self.on_cpu_path(x):  # the same values in fewer passes
            return RMSNormCPU.apply(x, self.weight.to(x.dtype), self.eps_for(x), self.lambda_)
        y = super().forward(x)
        return ste(y, activation_fake_quant(y), self.lambda_)


@torch.no_grad()
def cache_weight_quant(model):
    """Quantise every BitLinear weight once, for all micro-batches of one optimizer step (gradient
    accumulation). Call after the optimizer step, before the next forward; clear_weight_quant undoes it."""
    for m in model.modules():
        if isinstance(m, BitLinear):
            m.w_quant = weight_fake_quant(m.weight)


def clear_weight_quant(model):
    for m in model.modules():
        if isinstance(m, BitLinear):
            m.w_quant = None


if __name__ == "__main__":
    torch.manual_seed(0)
    w = torch.randn(4, 6)
    w_q, gamma = weight_quant(w)
    print("W:\n", w, "\nW_q:\n", w_q, "\ngamma:", gamma.item(), "(= mean|W|)",
          w.abs().mean().item())
    x = torch.randn(2, 6)
    x_q, x_scale = activation_quant(x)
    print("x_q:\n", x_q, "\nrow absmax / 127:", (x.abs().amax(-1) / 127).tolist(),
          "scale:", x_scale.flatten().tolist())
    packed = pack_ternary(w_q)
    print("packed", tuple(packed.shape), packed.dtype, "round-trip ok:",
          torch.equal(unpack_ternary(packed, 6), w_q))
    lin = BitLinear(6, 4)
    lin.weight.data.copy_(w)
    y_int = (x_q.int() @ w_q.int().T).float() * x_scale * gamma  # inference form
    print("int path vs fake-quant BitLinear, max abs diff:", (y_int - lin(x)).abs().max().item())
