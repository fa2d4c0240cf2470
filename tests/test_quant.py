"""Tests for quant.py against hand-computed values: the BitNet b1.58 quantisers (arXiv 2402.17764, section 2)
and the 2-bit packed layout of docs/packed-format.md. Run: python -m pytest tests/test_quant.py"""

import pytest
import torch
import torch.nn.functional as F

import quant
from quant import (BitLinear, QuantRMSNorm, activation_fake_quant, activation_quant, cache_weight_quant,
                   clear_weight_quant, pack_ternary, set_lambda, ste, unpack_ternary, weight_fake_quant, weight_quant)


def test_weight_quant_matches_hand_computed_absmean():
    w = torch.tensor([[0.5, -1.5, 3.0, 0.0]])  # gamma = mean|w| = 1.25; w/gamma = [0.4, -1.2, 2.4, 0]
    w_q, gamma = weight_quant(w)
    assert gamma.dtype == torch.float32 and gamma.item() == pytest.approx(1.25)
    assert w_q.dtype == torch.int8 and w_q.tolist() == [[0, -1, 1, 0]]


def test_weight_quant_rounds_exact_halves_to_even():
    # gamma = 1 exactly, so w / gamma keeps the halves: 0.5 -> 0, -0.5 -> 0, 1.5 -> 2 -> clamped to 1
    w_q, gamma = weight_quant(torch.tensor([[0.5, -0.5, 1.5, 1.5]]))
    assert gamma.item() == 1.0 and w_q.tolist() == [[0, 0, 1, 1]]
    w_q, _ = weight_quant(torch.tensor([[2.5, 0.5, 0.5, -0.5]]))  # 2.5 -> 2 -> 1, -0.5 -> -0
    assert w_q.tolist() == [[1, 0, 0, 0]]


def test_weight_quant_clamps_gamma_at_1e_5():
    w_q, gamma = weight_quant(torch.zeros(3, 5))
    assert gamma.item() == pytest.approx(1e-5) and not w_q.any()
    w_q, gamma = weight_quant(torch.full((2, 2), 1e-7))  # 1e-7 / 1e-5 = 0.01 -> 0
    assert gamma.item() == pytest.approx(1e-5) and not w_q.any()
    assert torch.isfinite(weight_fake_quant(torch.zeros(3, 5))).all()


def test_activation_quant_matches_hand_computed_absmax():
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0]])  # s = 127: [127, -63.5, 31.75, 0] -> [127, -64, 32, 0]
    x_q, scale = activation_quant(x)
    assert x_q.dtype == torch.int8 and x_q.tolist() == [[127, -64, 32, 0]]
    assert scale.shape == (1, 1) and scale.item() == pytest.approx(1 / 127)
    x_q, _ = activation_quant(torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5]]))  # s = 1: halves go to even
    assert x_q.tolist() == [[127, 0, 2, 2, -2]]


def test_activation_quant_all_zero_row_is_finite_and_zero():
    x = torch.tensor([[0.0, 0.0, 0.0], [63.5, -127.0, 0.5]])
    x_q, scale = activation_quant(x)
    assert x_q[0].tolist() == [0, 0, 0] and x_q[1].tolist() == [64, -127, 0]  # s = 1: 63.5 -> 64, 0.5 -> 0
    assert scale[0].item() == pytest.approx(1e-5 / 127) and torch.isfinite(activation_fake_quant(x)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_fake_quant_equals_the_formula_with_abs_amax_bit_for_bit(dtype):
    """max(amax(x), -amin(x)) is max|x| exactly: the fake quantiser equals x_q / s written out with
    x.abs().amax(-1), on random rows, rows whose absmax is negative or tied (-3 and 3), all-zero rows and
    a NaN row (NaN stays NaN)."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(64, 48) * 10, torch.zeros(2, 48), torch.full((1, 48), -2.0)]).to(dtype)
    x[64, 5], x[65, :3] = 3.0, torch.tensor([-3.0, 3.0, 0.5])
    x[66, 7] = -5.0  # the absmax is the negative one

    def formula(x):
        xf = x.float()
        s = 127.0 / xf.abs().amax(-1, keepdim=True).clamp(min=1e-5)
        return ((xf * s).round() / s).to(x.dtype)
    assert torch.equal(activation_fake_quant(x), formula(x))
    nan_row = torch.tensor([[float("nan"), 1.0]], dtype=dtype)
    assert activation_fake_quant(nan_row).isnan().all()


def test_quantizers_reconstruct_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    x_q, scale = activation_quant(x)
    assert ((x_q.float() * scale - x).abs() <= 0.5 * scale + 1e-7).all()
    assert torch.allclose(activation_fake_quant(x), x_q.float() * scale, rtol=1e-6, atol=1e-7)
    w = torch.randn(16, 64)
    w_q, gamma = weight_quant(w)
    assert torch.equal(weight_fake_quant(w), w_q.float() * gamma)


def test_ste_gradient_is_identity():
    torch.manual_seed(0)
    v = torch.randn(5, 7, requires_grad=True)
    g = torch.randn(5, 7)
    out = ste(v, activation_fake_quant(v), torch.tensor(1.0))
    out.backward(g)
    assert torch.equal(v.grad, g)
    assert torch.equal(out.detach(), activation_fake_quant(v.detach()))


def test_bitlinear_lambda_zero_is_exactly_f_linear():
    torch.manual_seed(0)
    lin = BitLinear(32, 24)
    lin.lambda_.fill_(0.0)
    x = torch.randn(3, 5, 32)
    assert lin.bias is None
    assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_bitlinear_lambda_one_matches_integer_inference_form():
    torch.manual_seed(0)
    lin = BitLinear(64, 48)
    x = torch.randn(6, 64)
    x_q, x_scale = activation_quant(x)
    w_q, gamma = weight_quant(lin.weight)
    y_int = (x_q.to(torch.int32) @ w_q.to(torch.int32).T).float() * x_scale * gamma  # exact int accumulation
    assert torch.allclose(lin(x), y_int, rtol=1e-5, atol=1e-6)


def test_bitlinear_lambda_blends_and_gradients_flow_straight_through():
    torch.manual_seed(0)
    lin = BitLinear(16, 8)
    set_lambda(lin, 0.25)
    x = torch.randn(4, 16, requires_grad=True)
    y = lin(x)
    xb = x.detach() + 0.25 * (activation_fake_quant(x.detach()) - x.detach())
    wb = lin.weight.detach() + 0.25 * (weight_fake_quant(lin.weight.detach()) - lin.weight.detach())
    assert torch.allclose(y, F.linear(xb, wb), rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.allclose(x.grad, g @ wb, rtol=1e-6, atol=1e-6)            # d/dx through STE = W_blend
    assert torch.allclose(lin.weight.grad, g.T @ xb, rtol=1e-6, atol=1e-6)  # d/dW through STE = x_blend



def test_bitlinear_swapped_for_nn_linear_differs_only_as_documented():
    # quant.BitLinear's docstring: the bias default, lambda_ = 1 from the start, one more state-dict key.
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4)
    assert lin.bias is not None and BitLinear(6, 4).bias is None  # bias=False by default: pass bias= explicitly
    bit = BitLinear(6, 4, bias=True)
    assert [(n, p.shape) for n, p in bit.named_parameters()] == [(n, p.shape) for n, p in lin.named_parameters()]
    assert set(bit.state_dict()) - set(lin.state_dict()) == {"lambda_"} and bit.lambda_.item() == 1.0
    result = bit.load_state_dict(lin.state_dict(), strict=False)
    assert result.missing_keys == ["lambda_"] and result.unexpected_keys == []
    set_lambda(bit, 0.0)
    x = torch.randn(3, 6)
    assert torch.equal(bit(x), lin(x))  # at lambda 0 the loaded BitLinear is that nn.Linear

def test_loaded_full_precision_weights_are_ternary_until_set_lambda_zero_as_documented():
    """lambda_ defaults to 1 (ternary) and loading full-precision weights leaves it there: only
    set_lambda(model, 0) keeps the loaded model full precision. quant.py's docstring and BitLinear's say so."""
    torch.manual_seed(0)
    fp = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 4, bias=False))
    bit = torch.nn.Sequential(BitLinear(8, 8), torch.nn.ReLU(), BitLinear(8, 4))
    assert bit.load_state_dict(fp.state_dict(), strict=False).missing_keys == ["0.lambda_", "2.lambda_"]
    x = torch.randn(3, 8)
    assert [bit[i].lambda_.item() for i in (0, 2)] == [1.0, 1.0] and not torch.allclose(bit(x), fp(x))
    set_lambda(bit, 0)
    assert torch.equal(bit(x), fp(x))
    for doc in (quant.__doc__, BitLinear.__doc__):
        doc = " ".join(doc.split()).lower()
        assert "loading full-precision weights" in doc and "set_lambda(model, 0" in doc and "ternary" in doc, doc


def test_set_lambda_writes_every_buffer_and_it_is_saved():
    model = torch.nn.Sequential(BitLinear(4, 4), torch.nn.ReLU(), BitLinear(4, 4))
    set_lambda(model, 0.3)
    assert all(abs(m.lambda_.item() - 0.3) < 1e-7 for m in model if isinstance(m, BitLinear))
    assert "0.lambda_" in model.state_dict() and model.state_dict()["2.lambda_"].dim() == 0


def test_pack_ternary_matches_hand_computed_bytes():
    """docs/packed-format.md's worked bytes: byte j holds k = j, j + Q, j + 2Q, j + 3Q in bits 0-1 .. 6-7."""
    assert pack_ternary(torch.tensor([[-1, 0, 1, 1]], dtype=torch.int8)).tolist() == [[164]]  # Q = 1: k in order
    w_q = torch.tensor([[-1, 0, 1, 1, 1], [0, 0, 0, 0, -1]], dtype=torch.int8)  # K = 5, Q = 2
    packed = pack_ternary(w_q)
    # row 0: byte 0 = k 0, 2, 4, pad: codes 0, 2, 2, 1 -> 0 | 2<<2 | 2<<4 | 1<<6 = 104; byte 1 = k 1, 3, pad, pad:
    #        codes 1, 2, 1, 1 -> 1 | 8 | 16 | 64 = 89
    # row 1: byte 0 = codes 1, 1, 0, 1 -> 1 | 4 | 0 | 64 = 69; byte 1 = codes 1, 1, 1, 1 -> 85
    assert packed.dtype == torch.uint8 and packed.tolist() == [[104, 89], [69, 85]]


@pytest.mark.parametrize("K", [1, 3, 4, 5, 7, 13, 64, 65])
def test_pack_unpack_round_trip(K):
    torch.manual_seed(K)
    w_q = torch.randint(-1, 2, (9, K), dtype=torch.int8)
    packed = pack_ternary(w_q)
    assert packed.shape == (9, (K + 3) // 4)
    assert torch.equal(unpack_ternary(packed, K), w_q)


def test_packed_weight_is_one_eighth_of_bf16():
    w_q, _ = weight_quant(torch.randn(96, 256))
    packed = pack_ternary(w_q)
    bf16_bytes = w_q.to(torch.bfloat16).numel() * 2
    assert packed.numel() * packed.element_size() * 8 == bf16_bytes


def test_quant_rmsnorm_then_bitlinear_equals_rmsnorm_then_self_quantising_bitlinear():
    """The quantiser in the norm or in the BitLinear: the same output (torch's RMSNorm's forward
    bits too) and, through the same norm backward, the same input gradient bit for bit."""
    torch.manual_seed(0)
    norm, fused_norm = quant.RMSNorm(24, eps=1e-5), QuantRMSNorm(24, eps=1e-5)
    torch_norm = torch.nn.RMSNorm(24, eps=1e-5)
    lin = BitLinear(24, 16)
    lin_pre = BitLinear(24, 16, quantize_input=False)
    lin_pre.weight.data.copy_(lin.weight.data)
    for lam in (0.0, 0.4, 1.0):
        set_lambda(lin, lam), set_lambda(lin_pre, lam), set_lambda(fused_norm, lam)
        x = torch.randn(3, 7, 24, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        y, y2 = lin(norm(x)), lin_pre(fused_norm(x2))
        assert torch.equal(y, y2) and torch.equal(y, lin(torch_norm(x)))
        g = torch.randn_like(y)
        y.backward(g), y2.backward(g)
        assert torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("shape", [(2, 9, 24), (5, 384), (16, 64, 384)])
def test_rmsnorm_cpu_backward_matches_float64_autograd(shape):
    """quant.RMSNorm on fp32 CPU runs RMSNormCPU: the forward is nn.RMSNorm's bit for bit, and its
    hand-written 7-pass backward gives dx and dw within fp32 rounding of autograd through F.rms_norm
    in float64, and about as close to it as torch's own fp32 autograd (at most 3x its error)."""
    torch.manual_seed(0)
    C = shape[-1]
    norm = quant.RMSNorm(C, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    ref = torch.nn.RMSNorm(C, eps=1e-5)
    ref.weight.data.copy_(norm.weight.data)
    x = (3 * torch.randn(shape)).requires_grad_(True)
    g = torch.randn(shape)
    y = norm(x)
    assert y.grad_fn.name().startswith("RMSNormCPU") and torch.equal(y, ref(x))
    y.backward(g)
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    F.rms_norm(x64, (C,), w64, 1e-5).backward(g.double())
    torch.testing.assert_close(x.grad, x64.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad, w64.grad.float(), rtol=1e-5, atol=1e-5)
    x32 = x.detach().clone().requires_grad_(True)
    w32 = norm.weight.detach().clone().requires_grad_(True)
    F.rms_norm(x32, (C,), w32, 1e-5).backward(g)
    for ours, torch32, exact in ((x.grad, x32.grad, x64.grad), (norm.weight.grad, w32.grad, w64.grad)):
        err, err_torch = ((t.double() - exact).abs().max().item() for t in (ours, torch32))
        assert err <= 3 * err_torch + 1e-8, (err, err_torch)


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_quant_rmsnorm_cpu_path_equals_norm_then_ste_bit_for_bit(lam):
    """QuantRMSNorm on fp32 CPU runs its norm, quantiser and STE in one RMSNormCPU call: output,
    dx and dw equal the unfused ste(RMSNorm(x), activation_fake_quant(.), lambda) bit for bit."""
    torch.manual_seed(0)
    norm = QuantRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm.lambda_.fill_(lam)
    x = 3 * torch.randn(2, 9, 24)
    g = torch.randn(2, 9, 24)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got = norm(x1)
    assert got.grad_fn.name().startswith("RMSNormCPU")
    got.backward(g)
    dw, norm.weight.grad = norm.weight.grad, None
    y = quant.RMSNorm.forward(norm, x2)
    want = quant.ste(y, activation_fake_quant(y), norm.lambda_)
    want.backward(g)
    assert torch.equal(got, want) and torch.equal(x1.grad, x2.grad)
    assert torch.equal(dw, norm.weight.grad)


def test_cached_weight_quant_gives_identical_outputs_and_gradients():
    torch.manual_seed(0)
    lin = BitLinear(32, 16)
    set_lambda(lin, 0.7)
    xs = [torch.randn(4, 32) for _ in range(3)]
    for x in xs:  # three micro-batches, weight quantised in every forward
        lin(x).square().sum().backward()
    ref_grad, lin.weight.grad = lin.weight.grad.clone(), None
    ref_out = lin(xs[0])
    cache_weight_quant(lin)  # quantised once for all three
    assert lin.w_quant is not None and not lin.w_quant.requires_grad
    for x in xs:
        lin(x).square().sum().backward()
    assert torch.equal(lin(xs[0]), ref_out) and torch.equal(lin.weight.grad, ref_grad)
    clear_weight_quant(lin)
    with torch.no_grad():
        lin.weight.add_(0.1)  # after an optimizer step the cache must be gone, or the forward would be stale
    fresh = BitLinear(32, 16)
    fresh.weight.data.copy_(lin.weight.data)
    set_lambda(fresh, 0.7)
    assert torch.equal(lin(xs[0]), fresh(xs[0]))


# -----------------------------------------------------------------------------
# mutants of quant.py that only these tests catch


@pytest.mark.parametrize("scale", [0.0, 1e-7], ids=["all-zero", "tiny"])
def test_one_gamma_floor_for_the_training_forward_weight_quant_and_the_cache(scale):
    """gamma = max(mean|W|, GAMMA_MIN), one constant for BitLinear's training gamma and weight_quant (and so every
    export). The floor decides only where mean|W| is below it: an all-zero matrix, or a tiny one (mean|W| about
    8e-8 here), whose codes are 0 under 1e-5 but +-1 under 1e-8. The training forward (fresh or cached, lambda 1)
    must compute exactly weight_quant's integer form there: zero."""
    assert quant.GAMMA_MIN == 1e-5  # BitNet b1.58's floor, as docs and transformers' autobitlinear use
    torch.manual_seed(0)
    lin = BitLinear(16, 8)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 16) * scale)
    x = torch.randn(3, 16)
    w_q, gamma = weight_quant(lin.weight)
    assert gamma.item() == torch.tensor(quant.GAMMA_MIN).item() and not w_q.any()  # codes 0 under the floor
    x_q, x_scale = activation_quant(x)
    y_int = (x_q.int() @ w_q.int().T).float() * x_scale * gamma  # the inference (export) form: all zero
    assert torch.equal(weight_fake_quant(lin.weight), w_q.float() * gamma)
    assert torch.equal(lin.quantized_weight(), w_q.float() * gamma) and torch.equal(lin(x), y_int)
    cache_weight_quant(lin)
    assert torch.equal(lin(x), y_int)
    clear_weight_quant(lin)


@pytest.mark.parametrize("biases", [(True, True, True), (True, False, True), (False, True, False)])
@pytest.mark.parametrize("kind", ["BitLinear", "BitLinear-pre-quantised", "nn.Linear"])
def test_stacked_linear_of_biased_layers_equals_the_layers_alone(kind, biases):
    """stacked_linear stacks the biases with the weights (a zero block for a layer without one): each output, and
    each gradient of a weight and a bias, is what the layer computes alone."""
    torch.manual_seed(0)
    make = {"BitLinear": lambda n, b: BitLinear(16, n, bias=b),
            "BitLinear-pre-quantised": lambda n, b: BitLinear(16, n, bias=b, quantize_input=False),
            "nn.Linear": lambda n, b: torch.nn.Linear(16, n, bias=b)}[kind]
    layers = [make(n, b) for n, b in zip((8, 4, 12), biases)]
    with torch.no_grad():
        for m in layers:
            if m.bias is not None:
                m.bias.uniform_(1.0, 2.0)  # large against the products: a dropped bias moves every column by >= 1
    x = torch.randn(2, 5, 16)
    outs = quant.stacked_linear(x, layers)
    g = [torch.randn_like(y) for y in outs]
    sum((y * gi).sum() for y, gi in zip(outs, g)).backward()
    stacked_grads = [[p.grad.clone() for p in m.parameters()] for m in layers]
    for m in layers:
        m.zero_grad()
    for m, y, gi in zip(layers, outs, g):
        alone = m(x)
        torch.testing.assert_close(y, alone, rtol=1e-5, atol=1e-6)
        (alone * gi).sum().backward()
    for m, grads in zip(layers, stacked_grads):
        for (name, p), got in zip(m.named_parameters(), grads):
            torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-5, msg=name)
