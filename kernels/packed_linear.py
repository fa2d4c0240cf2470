"""
Packed-weight inference for BitNet b1.58: a trained BitLinear frozen to 2-bit codes plus one fp32 scale.

The idea: once lambda = 1, a hidden matrix is only ever used as W_q * gamma with W_q in {-1, 0, +1}, so
inference needs no full-precision latent weight at all. PackedBitLinear keeps the ternary codes packed
four to a byte (1/8 of the bytes of bf16) in the one layout (quant.pack_ternary: one shift and mask of an int32
word gives four codes for one dp4a), and gamma, and computes the inference form,
an exact int32 accumulation with the scales applied after it:

    x_q, x_scale = activation_quant(x)            per token: x_q int8 (..., K), x_scale = 1/s (..., 1)
    y = (x_q @ W_q^T) * x_scale * gamma           (..., N): int32 accumulation, then two fp32 multiplies

On CUDA inputs it runs the Triton kernels of kernels/ternary_matmul.py (the activation quantiser, then the matmul,
a bf16 result for bf16 input, else fp32) through kernels/op.py: eagerly a BoundLinear made once per weight, inside
torch.compile the registered op ternary_linear (a packed model compiles whole). On CPU quant.activation_quant, then
ternary_matmul_codes: the codes unpacked once to int8 (N, K) on the first CPU call and kept on the module (never
in state_dict or an export; unpacked again when w_packed changes or moves; inside torch.compile, unpacked in the
graph), an int32 torch._int_mm, the same numbers as ternary_matmul_reference bit for bit. use_triton=True forces the kernels, e.g. on CPU under
TRITON_INTERPRET=1. A layer's result equals BitLinear's fake-quantised forward at lambda = 1 up
to fp32 rounding (that path rounds every product and partial sum, this one only the final scalings). In a
whole model those ulps can flip an activation that sits on a rounding tie to the neighbouring int8 code,
so frozen logits agree with the unfrozen model's closely, not to the last bit.

freeze_ternary(model) swaps every BitLinear for a PackedBitLinear in place (packed here, at freeze
time), and each QuantRMSNorm for a PackedRMSNorm, which on the Triton path its packed readers run
inside their quantiser's kernel (tm.rmsnorm_quantize: one launch for the norm and one quantisation
of a q/k/v or gate/up stack); weight_bytes(model) measures the hidden matrices and the rest.
freeze_fp(model) is the fp baseline's counterpart: the q/k/v and gate/up weights of a full-precision
inference model stacked once (StackedLinear), not every call. The export file holds the same bytes.
Sources: BitNet b1.58 (arXiv 2402.17764, section 2) for the quantisers and BitNet b1.58 2B4T (arXiv
2504.12285) for inference from packed weights; the byte layout is docs/packed-format.md.

Demo:  python -m kernels.packed_linear          Test:  python -m pytest tests/test_packed.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels.ternary_matmul as tm  # used as tm.<name>, so a test that reloads the module is seen here
from kernels import op
import quant


class PackedBitLinear(nn.Module):
    """y = (x_q @ W_q^T) * x_scale * gamma from 2-bit packed W_q. Buffers only: nothing here trains.

    use_triton: None = the Triton kernels for CUDA inputs and the torch reference otherwise;
    True/False forces one (True on CPU needs TRITON_INTERPRET=1 set before kernels are imported).
    """

    def __init__(self, in_features, out_features, w_packed, w_scale, use_triton=None):
        super().__init__()
        shape = (out_features, (in_features + 3) // 4)
        if w_packed.dtype != torch.uint8 or tuple(w_packed.shape) != shape:
            raise ValueError(f"w_packed: expected uint8 {shape} for {in_features} -> {out_features} features, "
                             f"got {w_packed.dtype} {tuple(w_packed.shape)}; pack W_q with "
                             "quant.pack_ternary")
        if w_scale.dtype != torch.float32 or w_scale.numel() != 1:
            raise ValueError(f"w_scale: expected one float32 gamma, got {w_scale.dtype} {tuple(w_scale.shape)}")
        self.in_features, self.out_features, self.use_triton = in_features, out_features, use_triton
        self.register_buffer("w_packed", w_packed)            # (N, ceil(K/4)) uint8, four codes per byte (quant.pack_ternary)
        self.register_buffer("w_scale", w_scale.reshape(()))  # gamma, 0-d fp32
        # (PackedRMSNorm,) when freeze_ternary moved the norm before it into its quantiser
        self._pre_norm = ()

    @classmethod
    def from_bitlinear(cls, m, use_triton=None):
        """Pack weight_quant(m.weight); refuses a layer that is not ternary yet (lambda_ != 1) or has a bias."""
        lam = float(m.lambda_)
        if lam != 1.0:
            raise ValueError(f"lambda_ = {lam:.4g}, not 1: the layer still blends in its full-precision weight "
                             "(lambda-warmup unfinished), so it is not ternary; train until lambda reaches 1 "
                             "(past lambda_warmup_steps) before packing")
        if m.bias is not None:
            raise ValueError("BitLinear has a bias; PackedBitLinear has none (the model uses bias=False)")
        w_q, gamma = quant.weight_quant(m.weight.detach())  # int8 (N, K), fp32 0-d
        return cls(m.in_features, m.out_features, tm.pack_planes(w_q), gamma, use_triton)

    def forward(self, x):  # x (..., K) any float dtype -> (..., N) in x.dtype
        if self.triton_for(x):  # tm.quantize_activations is bit-identical to quant.activation_quant
            y = _triton_linear(x, self.w_packed, self.w_scale, self)
        else:
            x_q, x_scale = quant.activation_quant(x.reshape(-1, x.shape[-1]))  # rows: see _untriton_matmul
            y = _untriton_matmul(x_q, x_scale, self.w_packed, self.w_scale, self, self.in_features)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y.to(x.dtype)

    def stacked_forward(self, x, layers):
        """Several packed layers of one input (q, k, v; gate, up; self among them) in ONE kernel call: x quantised
        once, their codes stacked along N with one gamma per row (each matrix its own). The same numbers as
        calling each layer (the int32 sums are exact; the scaling is per element). The stack is built on the
        first call and kept beside the layers' own buffers (more packed bytes in memory, never in a file)."""
        stack = getattr(self, "_stack", None)
        # eager calls rebuild it after load_state_dict or .to(); a compiled graph uses the stack it was traced with
        # (dynamo cannot trace data_ptr), as it does every other tensor of the model
        if stack is None or (not torch.compiler.is_compiling() and stack[0] != _stack_key(layers)):
            w = torch.cat([m.w_packed for m in layers])  # (sum N_i, ceil(K/4))
            ws = torch.cat([m.w_scale.reshape(1).expand(m.out_features) for m in layers])  # (sum N_i,) per row
            self._stack = stack = (None if torch.compiler.is_compiling() else _stack_key(layers), w, ws)
            self._stack_bound = None
        if self.triton_for(x):
            y = _triton_linear(x, stack[1], stack[2], self, "_stack_bound")
        else:
            x_q, x_scale = quant.activation_quant(x.reshape(-1, x.shape[-1]))  # rows: see _untriton_matmul
            y = _untriton_matmul(x_q, x_scale, stack[1], stack[2], self, self.in_features, "_stack_codes")
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y.to(x.dtype).split([m.out_features for m in layers], dim=-1)

    def triton_for(self, x):
        """Whether x goes through the Triton kernels (use_triton, or x on CUDA when it is None)."""
        return x.is_cuda if self.use_triton is None else self.use_triton

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, packed 2-bit, use_triton={self.use_triton}"


def _triton_linear(x, w_packed, w_scale, owner, attr="_bound"):
    """The Triton kernels. Eager: an op.BoundLinear made once per weight, kept as owner.<attr> (made again when
    w_packed, w_scale or the pre-norm's gain is another tensor or was written in place). Inside
    torch.compile: the registered op op.ternary_linear (op.norm_ternary_linear with a pre-norm),
    whose fake gives the output's shape, so dynamo traces one opaque call, not the launches. With
    owner._pre_norm (freeze_ternary), x is the norm's input: the norm runs in the quantiser's kernel
    (tm.rmsnorm_quantize), once for the whole stack."""
    norm = owner._pre_norm[0] if owner._pre_norm else None
    if torch.compiler.is_compiling():
        if norm is None:
            return op.ternary_linear(x, w_packed, w_scale)
        return op.norm_ternary_linear(x, norm.weight, norm.eps_for(x), w_packed, w_scale)
    # w_scale: a stand-in that never changes the key
    g = norm.weight if norm is not None else w_scale
    b = getattr(owner, attr, None)
    if (b is None or b[0] is not w_packed or b[1] != w_packed._version or b[2] is not w_scale
            or b[3] != w_scale._version or b[5] is not g or b[6] != g._version):
        nb = None if norm is None else (norm.weight, norm.eps)
        b = (w_packed, w_packed._version, w_scale, w_scale._version,
             op.BoundLinear(w_packed, w_scale, owner.in_features, nb), g, g._version)
        setattr(owner, attr, b)
    return b[4](x)


def _stack_key(layers):
    """What a stacked copy of layers' codes was made from: each layer's codes tensor, its storage and version."""
    return tuple((id(m), m.w_packed.data_ptr(), m.w_packed._version, m.w_packed.device) for m in layers)


def _untriton_matmul(x_q, x_scale, w_packed, w_scale, owner, K, attr="_codes"):
    """The matmul without Triton. CPU: ternary_matmul_codes on int8 codes unpacked from w_packed once and kept as
    owner.<attr> (a plain attribute: not a buffer, so never saved), unpacked again when w_packed is another tensor
    or was written in place (load_state_dict). Inside torch.compile the codes are unpacked in the graph (nothing
    is cached while tracing), then the same torch._int_mm. x_q comes as rows (M, K): inductor (torch 2.13, CPU)
    hands torch._int_mm uninitialised memory when x_q was quantised in the graph from a (1, 1, K) input.
    CUDA with use_triton=False: ternary_matmul_reference."""
    if x_q.device.type != "cpu":
        return tm.ternary_matmul_reference(x_q, x_scale, w_packed, w_scale)
    if torch.compiler.is_compiling():
        return tm.ternary_matmul_codes(x_q, x_scale, tm.unpack_ternary_reference(w_packed, K), w_scale)
    cached = getattr(owner, attr, None)
    if cached is None or cached[0] is not w_packed or cached[1] != w_packed._version:
        cached = (w_packed, w_packed._version, tm.unpack_ternary_reference(w_packed, K).contiguous())  # (N, K) int8
        setattr(owner, attr, cached)
    return tm.ternary_matmul_codes(x_q, x_scale, cached[2], w_scale)


class PackedRMSNorm(quant.RMSNorm):
    """The norm before packed layers in a frozen model (what a QuantRMSNorm becomes): quant.RMSNorm,
    except that on the Triton path its readers (the PackedBitLinears that read only its output: q,
    k, v; gate, up; o or down) run it inside their activation quantiser's kernel
    (tm.rmsnorm_quantize: one read of x, the normed row kept in registers, one quantisation shared
    by a stack), so there it passes x through unchanged. On the torch path (CPU) it is quant.RMSNorm
    and its readers quantise its output, exactly as before."""

    _readers = ()

    def forward(self, x):
        if self._readers and self._readers[0].triton_for(x):
            return x  # the readers normalise (their _pre_norm is this module)
        return super().forward(x)

    def eps_for(self, x):
        """F.rms_norm's eps: its own, or the input dtype's machine epsilon when None."""
        return torch.finfo(x.dtype).eps if self.eps is None else self.eps


# the layers that read a norm's output, by the norm's name in its parent (model.py's Block,
# Attention, MLP)
_READERS = {
    "attn_norm": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    "mlp_norm": ("mlp.gate_proj", "mlp.up_proj"),
    "subln": ("o_proj", "down_proj"),
}


def _defer_norms(model, new):
    """Give each frozen norm whose readers are all new PackedBitLinears of its width to them (see
    PackedRMSNorm)."""
    for name, norm in new.items():
        if not isinstance(norm, PackedRMSNorm):
            continue
        parent, _, child = name.rpartition(".")
        paths = [f"{parent}.{p}" if parent else p for p in _READERS.get(child, ())]
        readers = [new[p] for p in paths if p in new]
        if readers and all(
            isinstance(r, PackedBitLinear)
            and r.in_features == norm.normalized_shape[0]
            and r.use_triton == readers[0].use_triton
            for r in readers
        ):
            norm._readers = tuple(readers)
            for r in readers:
                r._pre_norm = (norm,)


def freeze_ternary(model, use_triton=None):
    """Replace every BitLinear in model by a PackedBitLinear, in place, and return the model.

    A QuantRMSNorm (a norm that fake-quantises its output for the BitLinears after it) becomes a
    PackedRMSNorm with the same gain (quant.RMSNorm; PackedBitLinear quantises its own input, to the
    int8 codes the integer product needs); on the Triton path its readers run it in their
    quantiser's kernel (PackedRMSNorm). Everything is checked before anything is replaced, so a
    refused model stays unchanged. Raises ValueError for a model without BitLinear (quant=False) and
    for any lambda_ != 1. """
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, (quant.BitLinear, quant.QuantRMSNorm))]
    if not any(isinstance(m, (quant.BitLinear, PackedBitLinear)) for m in model.modules()):
        raise ValueError("the model has no BitLinear layers to pack: it is full precision (quant=False, e.g. a "
                         "stage-1 checkpoint); use a ternary one (stage 2 or 3)")
    new = {}
    for name, m in targets:
        try:
            if isinstance(m, quant.BitLinear):
                new[name] = PackedBitLinear.from_bitlinear(m, use_triton)
            elif float(m.lambda_) != 1.0:
                raise ValueError(f"lambda_ = {float(m.lambda_):.4g}, not 1: its output is not the int8 activation "
                                 "yet (lambda-warmup unfinished); train until lambda reaches 1 before packing")
            else:
                new[name] = PackedRMSNorm(m.normalized_shape, eps=m.eps, device=m.weight.device,
                                          dtype=m.weight.dtype)
                new[name].weight = m.weight
        except ValueError as e:
            raise ValueError(f"{name or type(model).__name__}: {e}") from None
    if "" in new:  # the model is itself one BitLinear
        return new[""]
    _defer_norms(model, new)
    for name, m in new.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, m)
    return model


class StackedLinear(nn.Module):
    """An inference nn.Linear (the same weight and bias Parameters, the same state-dict keys) whose
    stack with its siblings (q, k, v; gate, up) is concatenated once and kept, not on every call as
    quant.stacked_linear does: stacked_forward is F.linear over the kept stack, the same numbers bit
    for bit. The stack is made again when a weight is another tensor or was written in place
    (load_state_dict, .to()); inside torch.compile the stack it was traced with is used. Not an
    nn.Linear subclass, so model.project calls its stacked_forward."""

    def __init__(self, lin):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def stacked_forward(self, x, layers):
        stack = getattr(self, "_stack", None)
        if stack is None or (
            not torch.compiler.is_compiling() and stack[0] != _weights_key(layers)
        ):
            with torch.no_grad():
                w = torch.cat([m.weight for m in layers])  # (sum out, in)
                b = (
                    None
                    if all(m.bias is None for m in layers)
                    else torch.cat(
                        [
                            m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                            for m in layers
                        ]
                    )
                )
            self._stack = stack = (
                None if torch.compiler.is_compiling() else _weights_key(layers),
                w,
                b,
            )
        return F.linear(x, stack[1], stack[2]).split([m.out_features for m in layers], dim=-1)


def _weights_key(layers):
    return tuple(
        (id(t), t.data_ptr(), t._version)
        for m in layers
        for t in (m.weight, m.bias)
        if t is not None
    )


def freeze_fp(model):
    """The full-precision baseline for inference: every nn.Linear that model.project stacks (q, k,
    v; gate, up) becomes a StackedLinear over the same Parameters, so a decode step reads one kept
    stack per projection group instead of concatenating the weights each step. Same outputs bit for
    bit; returns the model (changed in place). For timing only: the stack is detached (no gradient
    reaches the weights through it)."""
    for name, m in list(model.named_modules()):
        if type(m) is nn.Linear and name.rpartition(".")[2] in _STACKED:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, StackedLinear(m))
    return model


_STACKED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def weight_bytes(model):
    """Measured bytes: {"hidden": the blocks' hidden matrices as stored (packed codes, BitLinear latent weights,
    or an fp model's nn.Linear weights), "hidden_numel": how many weights they hold, "other": every other
    state-dict tensor (embedding, head, norms, scales), a tied tensor counted once}."""
    hidden, numel, seen = 0, 0, set()
    for m in (model.h.modules() if hasattr(model, "h") else model.modules()):  # the head is not a hidden matrix
        t = m.w_packed if isinstance(m, PackedBitLinear) else m.weight if isinstance(m, (nn.Linear, StackedLinear)) \
            else None
        if t is not None:
            hidden += t.numel() * t.element_size()
            numel += m.in_features * m.out_features
            seen.add(t.data_ptr())
    other = 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            other += t.numel() * t.element_size()
    return {"hidden": hidden, "hidden_numel": numel, "other": other}


def bytes_line(packed, latent=None):
    """One line: packed hidden-matrix bytes vs bf16 and fp32, both weight_bytes dicts. latent, measured
    before freeze_ternary, gives the trained size; without it (a packed export) fp32 is 4 bytes a weight."""
    mb = lambda b: f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.2f} kB"  # noqa: E731
    numel, hidden = packed["hidden_numel"], packed["hidden"]
    if latent is None:
        before = f"{mb(4 * numel)} fp32 (from shapes)"
    else:
        kind = {4: "fp32", 2: "16-bit"}.get(latent["hidden"] / numel, "latent")
        before = f"{mb(latent['hidden'])} {kind}"
    return (f"hidden-matrix weights: {before} / {mb(2 * numel)} bf16 -> {mb(hidden)} packed "
            f"(1/{2 * numel / hidden:.3g} of bf16); other weights (embedding, head, norms, scales): "
            f"{mb(packed['other'])}")


if __name__ == "__main__":
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig()).eval()
    idx = torch.randint(0, 256, (1, 64))
    with torch.no_grad():
        ref = model(idx, idx)[0]
    before = weight_bytes(model)
    freeze_ternary(model)
    after = weight_bytes(model)
    with torch.no_grad():
        out = model(idx, idx)[0]
    print(bytes_line(after, before))
    names = [n for n, _ in model.named_parameters()]
    print(f"{len(names)} parameters left, none a hidden projection: {not any('proj' in n for n in names)}")
    print(f"logits, packed vs fake-quantised BitLinear: max |diff| {(out - ref).abs().max().item():.2e}, "
          f"median {(out - ref).abs().median().item():.2e} (logits up to {ref.abs().max().item():.2f}; "
          "the large ones come from activations on a rounding tie)")
