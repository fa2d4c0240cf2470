"""
Tests for kernels/ternary_matmul.py against independent torch computations and quant.py.

Without a CUDA device the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1), so these tests
are part of the normal suite everywhere and are never skipped. On a GPU they run compiled (dp4a, int8 MMA).

    python -m pytest tests/test_kernels.py
"""

import importlib
import os
import re

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # triton.jit reads TRITON_INTERPRET when it decorates a kernel, i.e. when kernels.ternary_matmul
    # is imported, not at launch. So set it before that import, and re-import the module if another
    # test module already imported it without the flag. The variable stays set for the rest of the
    # pytest process, which is what any other Triton code wants on a machine without a GPU.
    os.environ["TRITON_INTERPRET"] = "1"

import kernels.ternary_matmul as tm  # noqa: E402
import quant  # noqa: E402

if not ON_GPU and not tm.INTERPRETED:
    tm = importlib.reload(tm)

DEVICE = "cuda" if ON_GPU else "cpu"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _dp4a_probe(a_ptr, b_ptr, c_ptr, out_ptr, BLOCK: tl.constexpr, DP4A: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tm._dp4a(tl.load(a_ptr + offs), tl.load(b_ptr + offs), tl.load(c_ptr + offs), DP4A))


def _case_data(M, K, N, seed):
    """Fresh random int8 activations, ternary weights (packed by quant.pack_ternary) and scales."""
    g = torch.Generator().manual_seed(seed)
    x_q = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    w_q = (torch.randint(0, 3, (N, K), generator=g) - 1).to(torch.int8)
    x_scale = torch.rand(M, 1, generator=g) * 0.05 + 1e-3
    w_scale = torch.rand((), generator=g) + 0.01
    return x_q, w_q, x_scale, w_scale


# M in {1, 3, 17, 64} x K in {4, 60, 100, 256}, N cycling through odd sizes; each in both configurations (CASES)
MK = [(M, K) for M in (1, 3, 17, 64) for K in (4, 60, 100, 256)]
SHAPES = [(M, K, (1, 33, 37)[i % 3]) for i, (M, K) in enumerate(MK)]
CONFIGS = ["decode", "prefill"]  # forced, so both kernels (dp4a on CUDA cores, int8 tl.dot) run on CPU for every M


# decode forced up to M = 17 (one row past its domain, M <= 16): the interpreter pays for every row of its row loop
CASES = [(M, K, N, c) for M, K, N in SHAPES for c in CONFIGS if not (c == "decode" and M > 17)]


@pytest.mark.parametrize("M,K,N,config", CASES)
def test_ternary_matmul_integer_part_exact_and_scaled_within_1e6(M, K, N, config):
    x_q, w_q, x_scale, w_scale = _case_data(M, K, N, seed=M * 100_003 + K * 101 + N * 2 + CONFIGS.index(config))
    x_q, x_scale, w_scale = x_q.to(DEVICE), x_scale.to(DEVICE), w_scale.to(DEVICE)
    w_packed = quant.pack_ternary(w_q).to(DEVICE)  # what a learner packs is what the kernels read

    # integer part: bitwise equal to x_q @ W_q^T in int64, from the codes before packing
    acc_expected = (x_q.cpu().long() @ w_q.long().T).int()
    acc_out = torch.full((M, N), 2**31 - 1, dtype=torch.int32, device=DEVICE)  # poison: unwritten stays huge
    acc = tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, config=config, return_acc=True, out=acc_out)
    assert acc is acc_out
    assert torch.equal(acc.cpu(), acc_expected)
    assert torch.equal(tm.ternary_matmul_reference(x_q, x_scale, w_packed, w_scale, return_acc=True).cpu(), acc_expected)

    # fp32: elementwise |y - y_ref| <= 1e-6 |y_ref| (where y_ref == 0 this demands y == 0; NaN fails)
    y_ref = tm.ternary_matmul_reference(x_q, x_scale, w_packed, w_scale)
    y = tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, config=config,
                          out=torch.full((M, N), float("nan"), device=DEVICE))
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert ((y - y_ref).abs() <= 1e-6 * y_ref.abs()).all()

    # bf16 output: within one bf16 ulp (2**-7 relative) of the fp32 reference
    y16 = tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=torch.bfloat16, config=config,
                            out=torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE))
    assert y16.dtype == torch.bfloat16
    assert ((y16.float() - y_ref).abs() <= 2**-7 * y_ref.abs()).all()


def test_decode_is_exact_in_both_axis_orders_of_its_tile(monkeypatch):
    """The decode tile's axes go in the order the installed Triton wants (tm.DECODE_ROWS_FIRST: weight rows on
    the axis its coalescing takes first; every other test runs that order); the other order gives x_q @ W_q^T
    exactly and y within 1e-6 too, for one row, a few, and more than one program holds (8 rows a program, as on
    a GPU), one gamma or one per row."""
    assert tm.DECODE_ROWS_FIRST == (tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7))
    monkeypatch.setattr(tm, "DECODE_ROWS_FIRST", not tm.DECODE_ROWS_FIRST)
    monkeypatch.setattr(tm, "decode_block_m", lambda M: min(triton.next_power_of_2(M), tm.DECODE_BLOCK_M))
    for M, K, N in ((1, 100, 37), (3, 60, 33), (12, 256, 20)):
        x_q, w_q, x_scale, w_scale = _case_data(M, K, N, seed=M + K + N)
        gammas = torch.rand(N, generator=torch.Generator().manual_seed(K)) + 0.01
        x_q, x_scale, w_scale, gammas = (t.to(DEVICE) for t in (x_q, x_scale, w_scale, gammas))
        w_packed = quant.pack_ternary(w_q).to(DEVICE)
        settings, grid = tm.decode_launch(N, K, M)
        assert settings["ROWS_FIRST"] == tm.DECODE_ROWS_FIRST and grid[1] == -(-M // 8)
        acc = tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, config="decode", return_acc=True,
                                out=torch.full((M, N), 2**31 - 1, dtype=torch.int32, device=DEVICE))
        assert torch.equal(acc.cpu(), (x_q.cpu().long() @ w_q.long().T).int()), (M, K, N)
        for scale in (w_scale, gammas):
            y_ref = tm.ternary_matmul_reference(x_q, x_scale, w_packed, scale)
            y = tm.ternary_matmul(x_q, x_scale, w_packed, scale, config="decode",
                                  out=torch.full((M, N), float("nan"), device=DEVICE))
            assert ((y - y_ref).abs() <= 1e-6 * y_ref.abs()).all(), (M, K, N)


# every tile table entry a GPU launches with, one test each (on a GPU each compiles once, spread over the workers)
TABLES = ([("decode", key) for key in tm.DECODE_CONFIGS] + [("prefill", key) for key in tm.PREFILL_CONFIGS]
          + [("decode-mma", None), ("unpack", None)])


@pytest.mark.parametrize("kind,key", TABLES)
def test_every_gpu_table_entry_computes_exactly(kind, key):
    """The tiles a GPU launches with (every DECODE_CONFIGS entry, rows at 3 and 12 rows with the GPU's 8 rows a
    program, every PREFILL_CONFIGS entry, DECODE_MMA_CONFIG, UNPACK_CONFIG) run here on the interpreter, which
    otherwise runs its own small tiles: the int32 accumulator equals x_q @ W_q^T exactly, on a shape that leaves
    every tile partly masked (N = 37, K = 600: 38 words, past one 32-word step, inside one of 64 or 256). On a GPU
    the same launches run compiled, the decode kernel with the PTX dp4a it runs with there."""
    K, N, KW = 600, 37, 38
    g = torch.Generator().manual_seed(600)
    w_q = (torch.randint(0, 3, (N, K), generator=g) - 1).to(torch.int8)
    w = tm._weight_words(quant.pack_ternary(w_q).to(DEVICE), K)
    ws = torch.ones(1, device=DEVICE)
    if kind == "unpack":
        codes = torch.full((N, 16 * KW), 7, dtype=torch.int8, device=DEVICE)
        cfg = tm.UNPACK_CONFIG
        tm._unpack_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(KW, cfg["BLOCK_G"]))](
            w, codes.view(torch.int32), N, KW, w.stride(0), **cfg)
        assert torch.equal(codes[:, :K].cpu(), w_q) and not codes[:, K:].any()
        return
    rows = {"decode": (3, 12) if key == "rows" else (1,), "prefill": (5, 70), "decode-mma": (5, 16)}[kind]
    for M in rows:
        x_q = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
        want = (x_q.long() @ w_q.long().T).int()
        x_q, xs = x_q.to(DEVICE), torch.ones(M, device=DEVICE)
        acc = torch.full((M, N), 2**31 - 1, dtype=torch.int32, device=DEVICE)  # poison: unwritten stays huge
        if kind == "decode":
            cfg, bm = tm.DECODE_CONFIGS[key], min(triton.next_power_of_2(M), tm.DECODE_BLOCK_M)
            grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, bm))
            tm._decode_kernel[grid](tm._x_words(x_q, K, KW), xs, w, ws, acc, M, N, KW, 4 * KW, KW, N, 0,
                                    BLOCK_M=bm, DP4A=not tm.INTERPRETED, WRITE_ACC=True, ROWS_FIRST=tm.DECODE_ROWS_FIRST, **cfg)
        elif kind == "prefill":
            tm.launch_prefill(x_q, xs, w, ws, acc, M, N, K, KW, 0, return_acc=True, cfg=tm.PREFILL_CONFIGS[key])
        else:
            tm.launch_decode_mma(tm._x_words(x_q, K, KW), xs, w, ws, acc, M, N, KW, 0, return_acc=True,
                                 cfg=tm.DECODE_MMA_CONFIG)
        assert torch.equal(acc.cpu(), want), (kind, key, M)


@pytest.mark.parametrize("M,K,N", [(1, 4, 33), (3, 100, 37), (8, 256, 1), (16, 60, 70), (11, 500, 20)])
def test_decode_on_tensor_cores_is_exact_for_up_to_16_rows(M, K, N):
    """config="decode-mma" (x_q's rows on int8 tensor cores, each weight word unpacked in registers once for all
    of them): the int32 accumulator equals x_q @ W_q^T exactly, y equals the reference within 1e-6, with one
    gamma or one per row; past K and past N nothing leaks in (odd K and N); more than 16 rows is refused."""
    x_q, w_q, x_scale, w_scale = _case_data(M, K, N, seed=M * 31 + K * 7 + N)
    gammas = torch.rand(N, generator=torch.Generator().manual_seed(K)) + 0.01
    x_q, x_scale, w_scale, gammas = (t.to(DEVICE) for t in (x_q, x_scale, w_scale, gammas))
    w_packed = quant.pack_ternary(w_q).to(DEVICE)
    acc = tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, config="decode-mma", return_acc=True,
                            out=torch.full((M, N), 2**31 - 1, dtype=torch.int32, device=DEVICE))
    assert torch.equal(acc.cpu(), (x_q.cpu().long() @ w_q.long().T).int())
    for scale in (w_scale, gammas):
        y_ref = tm.ternary_matmul_reference(x_q, x_scale, w_packed, scale)
        y = tm.ternary_matmul(x_q, x_scale, w_packed, scale, config="decode-mma",
                              out=torch.full((M, N), float("nan"), device=DEVICE))
        assert ((y - y_ref).abs() <= 1e-6 * y_ref.abs()).all()
    with pytest.raises(ValueError, match="at most 16 rows"):
        tm.ternary_matmul(torch.zeros(17, K, dtype=torch.int8, device=DEVICE), torch.ones(17, 1, device=DEVICE),
                          w_packed, w_scale, config="decode-mma")


# and the narrowest layers: torch._int_mm (torch 2.13, CPU) sums wrongly at K = 1 for N > 1
@pytest.mark.parametrize("M,K,N", SHAPES + [(3, 1, 8), (1, 1, 33), (2, 2, 8), (5, 3, 4)])
def test_cpu_int8_codes_matmul_equals_the_reference_bit_for_bit(M, K, N):
    """ternary_matmul_codes (torch._int_mm on the unpacked int8 codes): the reference's acc and y, exactly."""
    x_q, w_q, x_scale, w_scale = _case_data(M, K, N, seed=M * 7 + K * 11 + N)
    w_packed = tm.pack_planes(w_q)
    codes = tm.unpack_ternary_reference(w_packed, K)
    for args in ((x_q, x_scale), (x_q.view(1, M, K), x_scale.view(1, M, 1))):  # 2-d and batched rows
        acc = tm.ternary_matmul_codes(*args, codes, w_scale, return_acc=True)
        assert acc.dtype == torch.int32 and torch.equal(acc.reshape(M, N), (x_q.long() @ w_q.long().T).int())
        assert torch.equal(tm.ternary_matmul_codes(*args, codes, w_scale),
                           tm.ternary_matmul_reference(*args, w_packed, w_scale))
    gammas = torch.rand(N, generator=torch.Generator().manual_seed(K)) + 0.01  # one gamma per row (stacked)
    assert torch.equal(tm.ternary_matmul_codes(x_q, x_scale, codes, gammas),
                       tm.ternary_matmul_reference(x_q, x_scale, w_packed, gammas))


def test_cpu_int8_codes_matmul_is_exact_at_the_int8_extremes():
    """-128 and 127 against -1 and +1 over a long K: every product at its largest, no int16 saturation anywhere."""
    K = 8192
    x_q = torch.tensor([[-128] * K, [127] * K, [-128, 127] * (K // 2), [127, -128] * (K // 2)], dtype=torch.int8)
    w_q = torch.tensor([[-1] * K, [1] * K, [-1, 1] * (K // 2), [1, -1] * (K // 2)], dtype=torch.int8)
    acc = tm.ternary_matmul_codes(x_q, torch.ones(4, 1), w_q, torch.tensor(1.0), return_acc=True)
    assert torch.equal(acc, (x_q.long() @ w_q.long().T).int())
    assert acc.abs().max() == 128 * K


@pytest.mark.parametrize("config", CONFIGS)
def test_ternary_matmul_one_gamma_per_row_for_stacked_matrices(config):
    """w_scale with N elements (q, k, v stacked along N, each its own gamma): row n scaled by w_scale[n]."""
    x_q, w_q, x_scale, _ = _case_data(17, 60, 37, seed=7)
    w_scale = torch.rand(37, generator=torch.Generator().manual_seed(8)) + 0.01
    x_q, x_scale, w_scale = x_q.to(DEVICE), x_scale.to(DEVICE), w_scale.to(DEVICE)
    w_packed = tm.pack_planes(w_q).to(DEVICE)
    expected = (x_q.cpu().long() @ w_q.long().T).float() * x_scale.cpu() * w_scale.cpu()  # (17, 37)
    y_ref = tm.ternary_matmul_reference(x_q, x_scale, w_packed, w_scale)
    y = tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, config=config)
    assert torch.equal(y_ref.cpu(), expected)
    assert ((y.cpu() - expected).abs() <= 1e-6 * expected.abs()).all()
    with pytest.raises(ValueError, match="one per row"):
        tm.ternary_matmul(x_q, x_scale, w_packed, w_scale[:5], config=config)


@pytest.mark.parametrize("config", CONFIGS)
def test_ternary_matmul_extreme_accumulator_and_leading_dims(config):
    """All x_q = -128 against all-(+1) or all-(-1) rows: |acc| = 128 * K, the largest possible."""
    K, N = 256, 2
    x_q = torch.full((2, 1, K), -128, dtype=torch.int8, device=DEVICE)  # (B, T, K)
    w_q = torch.stack([torch.ones(K), -torch.ones(K)]).to(torch.int8)  # (N, K)
    x_scale = torch.full((2, 1, 1), 0.5, device=DEVICE)
    gamma = torch.tensor(0.25, device=DEVICE)
    acc = tm.ternary_matmul(x_q, x_scale, tm.pack_planes(w_q).to(DEVICE), gamma, config=config, return_acc=True)
    assert acc.shape == (2, 1, N)
    assert acc[..., 0].eq(-128 * K).all() and acc[..., 1].eq(128 * K).all()


def test_reference_unpack_matches_quant_unpack_ternary():
    g = torch.Generator().manual_seed(7)
    for K in (1, 4, 5, 99):
        w_q = (torch.randint(0, 3, (6, K), generator=g) - 1).to(torch.int8)
        packed = quant.pack_ternary(w_q)
        assert torch.equal(tm.unpack_ternary_reference(packed, K), w_q)
        assert torch.equal(quant.unpack_ternary(packed, K), w_q)


def test_plane_order_layout_and_conversions():
    """One layout: quant.pack_ternary (= tm.pack_planes) puts k = j + iQ in bits 2i of byte j (Q = ceil(K/4)); a v1
    export's k-order bytes (k in bits 2*(k % 4) of byte k // 4, packed here by hand) convert to it and back exactly,
    padding included."""
    assert tm.pack_planes is quant.pack_ternary
    w_q = torch.tensor([[-1, 0, 1, 1, 1]], dtype=torch.int8)  # K = 5, Q = 2: byte 0 = k 0, 2, 4, (6); byte 1 = k 1, 3, (5, 7)
    planes = quant.pack_ternary(w_q)
    # byte 0: codes 0 (k0), 2 (k2), 2 (k4), 1 (pad) -> 0b01101000; byte 1: 1 (k1), 2 (k3), 1, 1 -> 0b01011001
    assert planes.tolist() == [[0b01101000, 0b01011001]]
    assert tm.planes_from_packed(torch.tensor([[164, 86]], dtype=torch.uint8)).tolist() == planes.tolist()
    g = torch.Generator().manual_seed(3)
    for K in (1, 3, 4, 16, 37, 64, 100):
        w_q = (torch.randint(0, 3, (5, K), generator=g) - 1).to(torch.int8)
        codes = torch.ones(5, 4 * ((K + 3) // 4), dtype=torch.int32)
        codes[:, :K] = w_q.int() + 1
        c = codes.view(5, -1, 4)
        seq = (c[..., 0] | c[..., 1] << 2 | c[..., 2] << 4 | c[..., 3] << 6).to(torch.uint8)  # v1's bytes
        planes = quant.pack_ternary(w_q)
        assert planes.shape == seq.shape == (5, (K + 3) // 4) and planes.dtype == torch.uint8
        assert torch.equal(tm.planes_from_packed(seq), planes) and torch.equal(tm.packed_from_planes(planes), seq)
        assert torch.equal(tm.unpack_ternary_reference(planes, K), w_q)
        # the kernels' int32 words: word g, shifted by 2i and masked, is the codes of k = iQ' + 4g .. + 3, one a byte
        words = tm._weight_words(planes, K)
        KW = (K + 15) // 16
        assert words.dtype == torch.int32 and words.shape == (5, KW)
        codes = (words.view(torch.uint8).view(5, KW * 4).unsqueeze(1) >> torch.tensor([0, 2, 4, 6]).view(1, 4, 1).to(
            torch.uint8)) & 3  # (N, plane i, byte j): k = 4 KW i + j
        padded = torch.ones(5, 16 * KW, dtype=torch.int8)
        padded[:, :K] = w_q + 1
        assert torch.equal(codes.reshape(5, -1).to(torch.int8), padded)


def test_dp4a_pure_triton_form_is_the_signed_byte_dot_product():
    """The interpreter's _dp4a (DP4A=False): c + sum_j a_j * b_j over the four bytes, each a signed int8, wrapping in
    int32: what PTX dp4a.s32.s32 computes (the compiled path; tests/test_cross_compile.py finds it in the PTX)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randint(-2**31, 2**31, (64,), generator=g, dtype=torch.int64).to(torch.int32)
    b = torch.randint(-2**31, 2**31, (64,), generator=g, dtype=torch.int64).to(torch.int32)
    a[:4] = torch.tensor([0x80808080, 0x7F7F7F7F, 0x03030303, -1], dtype=torch.int64).to(torch.int32)
    b[:4] = torch.tensor([0x80808080, 0x80808080, 0x01010101, -1], dtype=torch.int64).to(torch.int32)
    c = torch.randint(-2**31, 2**31, (64,), generator=g, dtype=torch.int64).to(torch.int32)
    c[:4] = torch.tensor([2**31 - 1, 0, 5, -2**31], dtype=torch.int64).to(torch.int32)
    out = torch.empty_like(c, device=DEVICE)
    _dp4a_probe[(1,)](a.to(DEVICE), b.to(DEVICE), c.to(DEVICE), out, BLOCK=64, DP4A=ON_GPU)  # dp4a itself on a GPU
    ab = (a.view(torch.int8).view(64, 4).long() * b.view(torch.int8).view(64, 4).long()).sum(1)
    expected = ((c.long() + ab + 2**31) % 2**32 - 2**31).to(torch.int32)  # int32 wrap-around
    assert torch.equal(out.cpu(), expected)
    assert expected[:4].tolist() == [2**31 - 1 + 4 * 16384 - 2**32, -4 * 127 * 128, 5 + 12, -2**31 + 4]


def test_decode_and_prefill_on_a_k_whose_rows_are_whole_words_but_not_16_aligned():
    """K = 62: ceil(K/4) = 16 bytes, so the weights are used as int32 words in place, and x is zero-padded to 64."""
    x_q, w_q, x_scale, w_scale = _case_data(3, 62, 5, seed=11)
    expected = (x_q.long() @ w_q.long().T).int()
    for config in CONFIGS:
        acc = tm.ternary_matmul(x_q.to(DEVICE), x_scale.to(DEVICE), tm.pack_planes(w_q).to(DEVICE),
                                w_scale.to(DEVICE), config=config, return_acc=True)
        assert torch.equal(acc.cpu(), expected), config


def test_config_tables_fit_the_problem():
    """Fixed tables, no autotuning: a prefill whose K loop is one step is not software-pipelined (a pipelined
    one-iteration loop is the plausible cause of the hang this kernel once had at M=17, K=60, N=1); the decode table
    gives enough programs for 132 SMs; every entry is one that kernels/cross_compile.py compiles."""
    assert tm.prefill_config(17, 60, 9)["num_stages"] == 1 and tm.prefill_config(17, 60, 8)["num_stages"] == 1
    assert tm.prefill_config(2048, 4096, 9)["num_stages"] == 3 and tm.prefill_config(2048, 4096, 9)["BLOCK_M"] == 128
    assert tm.prefill_config(17, 4096, 8)["BLOCK_M"] == 64
    for arch in (8, 9):  # a K loop of exactly one step (K <= BLOCK_K = 128) is not pipelined
        assert [tm.prefill_config(64, K, arch)["num_stages"] for K in (113, 128, 129)] == [
            1,
            1,
            3,
        ], arch
    cap = 16 if tm.INTERPRETED else 8  # rows per program
    assert [tm.decode_block_m(M) for M in (1, 2, 3, 5, 8, 9, 17)] == [
        1,
        2,
        4,
        8,
        8,
        min(16, cap),
        cap,
    ]
    assert (
        tm.decode_config(4096, 4096, 1) == "long-wide" and tm.decode_config(4096, 4096, 2) == "rows"
    )
    for N, K in ((4096, 4096), (576, 576), (192, 576), (1, 60), (11008, 4096), (4096, 11008)):
        cfg = tm.DECODE_CONFIGS[tm.decode_config(N, K)]
        assert -(-N // cfg["BLOCK_N"]) >= min(2 * tm.SMS, N // 2), (N, K)  # programs: 2 a SM, or 1 per 2 rows


def test_the_kernels_launch_with_their_inputs_device_current(monkeypatch):
    """Triton launches on the current CUDA device, not on the pointers' one: ternary_matmul, quantize_activations
    and rmsnorm_quantize launch under on_device(the inputs' device), which makes a CUDA device current (cuda:1's
    tensors with cuda:0 current ran on cuda:0's stream) and does nothing on the CPU (the interpreter)."""
    import contextlib
    assert isinstance(tm.on_device(torch.device("cpu")), contextlib.nullcontext)
    guard = tm.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    entered = []

    def recorded(dev):
        entered.append(dev)
        return contextlib.nullcontext()
    monkeypatch.setattr(tm, "on_device", recorded)
    monkeypatch.setattr(tm._quantize, "on_device", recorded)
    x = torch.randn(3, 64, device=DEVICE)
    x_q, x_scale = tm.quantize_activations(x)
    tm.rmsnorm_quantize(x, torch.ones(64, device=DEVICE))
    w = quant.pack_ternary(torch.zeros(5, 64, dtype=torch.int8)).to(DEVICE)
    tm.ternary_matmul(x_q, x_scale, w, torch.ones(1, device=DEVICE))
    assert entered == [x.device] * 3


def test_ternary_matmul_matches_bitlinear_forward():
    """quantize_activations + packed matmul computes what the fake-quantised BitLinear computes."""
    torch.manual_seed(0)
    lin = quant.BitLinear(100, 37)
    x = torch.randn(2, 3, 100)
    w_q, gamma = quant.weight_quant(lin.weight.detach())
    x_q, x_scale = tm.quantize_activations(x.to(DEVICE))
    y = tm.ternary_matmul(x_q, x_scale, tm.pack_planes(w_q).to(DEVICE), gamma.to(DEVICE))
    with torch.no_grad():
        y_fake = lin(x)
    assert y.shape == (2, 3, 37)
    torch.testing.assert_close(y.cpu(), y_fake, rtol=1e-5, atol=1e-5)


def test_ternary_matmul_rejects_bad_inputs_with_clear_errors():
    x_q = torch.zeros(2, 8, dtype=torch.int8, device=DEVICE)
    w = torch.zeros(3, 2, dtype=torch.uint8, device=DEVICE)
    xs, g = torch.ones(2, 1, device=DEVICE), torch.tensor(1.0, device=DEVICE)
    # each error names the argument, what was expected and what was found (regexes, searched anywhere)
    cases = [
        (TypeError, lambda: tm.ternary_matmul(x_q.float(), xs, w, g), ("x_q", "int8", "float32")),
        (ValueError, lambda: tm.ternary_matmul(x_q, xs, w[:, :1], g), ("w_packed", r"\b1\b", r"\b2\b", r"\b8\b")),
        (ValueError, lambda: tm.ternary_matmul(x_q, xs[:1], w, g), ("x_scale", r"\b2\b", r"\(1, 1\)")),
        (ValueError, lambda: tm.ternary_matmul(x_q, xs, w, g.double()), ("w_scale", "float32", "float64")),
        (ValueError, lambda: tm.ternary_matmul(x_q, xs, w, g, out_dtype=torch.float16),
         ("out_dtype", "bfloat16", r"torch\.float16")),
    ]
    for exc, call, facts in cases:
        with pytest.raises(exc) as e:
            call()
        assert all(re.search(f, str(e.value)) for f in facts), (facts, str(e.value))


def test_unpack_kernel_writes_w_q_as_int8_in_k_order():
    """_unpack_kernel: packed words -> W_q (N, 16 KW) int8, element k = W_q[n, k], zeros past K (K =
    100: KW = 7)."""
    g = torch.Generator().manual_seed(9)
    for K, N in ((100, 37), (64, 3)):
        w_q = (torch.randint(0, 3, (N, K), generator=g) - 1).to(torch.int8)
        words = tm._weight_words(quant.pack_ternary(w_q), K).to(DEVICE)
        codes = tm.unpack_codes(words, N, (K + 15) // 16)
        want = torch.zeros(N, 16 * ((K + 15) // 16), dtype=torch.int8)
        want[:, :K] = w_q
        assert codes.dtype == torch.int8 and torch.equal(codes.cpu(), want), K


# -----------------------------------------------------------------------------
# rmsnorm_quantize == quant.RMSNorm then quant.activation_quant, bit for bit


def _norm_then_quant(x, g, eps):
    norm = quant.RMSNorm(x.shape[-1], eps=eps)
    norm.weight.data.copy_(g)
    with torch.no_grad():
        return quant.activation_quant(norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_quantize_is_the_norm_then_activation_quant_bit_for_bit(dtype):
    """One kernel for quant.RMSNorm (gain g, cast to x's dtype) and activation_quant. Rows whose
    squares sum exactly in fp32 (x = k / 256, |k| < 256: 8 significant bits, exact in bf16 too;
    every partial sum of squares is a multiple of 2**-16 below 2**7) leave no freedom to any
    summation order, so codes and scales equal torch's bit for bit: every other step is one IEEE
    operation in torch's order (the / K, + eps, 1 / sqrt, (x * r) * g, one rounding to bf16, the
    quantiser's). Odd K (7, 33), a zero row (all codes 0, scale from absmax 1e-5), a K = 100 row
    through the two-loop path (block 32). Random normal rows: every code equal, scales within 2 fp32
    ulps (torch's sum of squares runs in an order of its own; bf16's final rounding usually absorbs
    the difference)."""
    gen = torch.Generator().manual_seed(3)
    for K, block in ((7, None), (33, None), (100, 32)):
        gain = torch.rand(K, generator=gen) * 1.5 + 0.25
        x = (torch.randint(-255, 256, (3, K), generator=gen).float() / 256).to(dtype)
        x[1] = 0.0
        got = tm.rmsnorm_quantize(x.to(DEVICE), gain.to(DEVICE), 1e-5, block_k=block)
        want = _norm_then_quant(x, gain, 1e-5)
        assert got[0].dtype == torch.int8 and got[1].shape == (3, 1)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), (K, block)
        assert got[0][1].eq(0).all()
    x = torch.randn(2, 4, 60, generator=gen).to(dtype) * 3
    gain = torch.rand(60, generator=gen) + 0.5
    got, want = tm.rmsnorm_quantize(x.to(DEVICE), gain.to(DEVICE), 1e-6), _norm_then_quant(
        x, gain, 1e-6
    )
    assert torch.equal(got[0].cpu(), want[0])
    assert ((got[1].cpu() - want[1]).abs() <= 2 * 2**-23 * want[1]).all()


def test_rmsnorm_quantize_rejects_bad_inputs():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(TypeError, match="float16"):
        tm.rmsnorm_quantize(x.half(), torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match=r"gain \(8,\)"):
        tm.rmsnorm_quantize(x, torch.ones(7, device=DEVICE))


# -----------------------------------------------------------------------------
# quantize_activations == quant.activation_quant, bit for bit


def _assert_same_as_activation_quant(x, **kw):
    x_q, x_scale = tm.quantize_activations(x.to(DEVICE), **kw)
    ref_q, ref_scale = quant.activation_quant(x)
    assert x_q.dtype == torch.int8 and x_scale.dtype == torch.float32
    assert x_q.shape == ref_q.shape and x_scale.shape == ref_scale.shape
    assert torch.equal(x_q.cpu(), ref_q)
    assert torch.equal(x_scale.cpu(), ref_scale)
    return x_q.cpu()


def test_quantize_activations_rounds_half_to_even():
    # absmax 127, 254, 31.75 give s = 1, 0.5, 4 exactly, so these products are exact ties
    rows = torch.tensor([
        [127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 126.5, -126.5, 3.5, -1.5],
        [254.0, 1.0, 3.0, 5.0, -1.0, -5.0, 0.99999994, 7.0, 253.0, -253.0, 9.0, 0.0],
        [31.75, 0.125, 0.375, 0.625, -0.125, -0.625, 0.12499999, 0.875, 31.625, -31.625, 0.0, 0.0],
    ])
    assert quant.activation_quant(rows)[1].flatten().tolist() == [1.0, 2.0, 0.25]  # 1/s: ties are real ties
    x_q = _assert_same_as_activation_quant(rows)
    assert x_q.tolist() == [
        [127, 0, 2, 2, 0, -2, 0, 0, 126, -126, 4, -2],
        [127, 0, 2, 2, 0, -2, 0, 4, 126, -126, 4, 0],
        [127, 0, 2, 2, 0, -2, 0, 4, 126, -126, 0, 0],
    ]


def test_quantize_activations_matches_activation_quant():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 100, generator=g) * torch.logspace(-3, 3, 3).view(3, 1)  # (B, T, K), wide range
    x[1, 2] = 0.0  # an all-zero row: absmax clamps to 1e-5
    _assert_same_as_activation_quant(x)
    # many exact ties: half-integers in a row whose absmax makes s = 1
    ties = torch.randint(-254, 255, (4, 64), generator=g).float() / 2
    ties[:, 0] = 127.0
    _assert_same_as_activation_quant(ties)
    _assert_same_as_activation_quant((torch.randn(5, 60, generator=g) * 4).bfloat16())  # bf16 in, fp32 math


@pytest.mark.parametrize("block_k", [None, 128])  # one pass over a 512 block, and two loops of 128
def test_quantize_activations_long_row(block_k):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 300, generator=g)
    x[1, 257] = -9.0  # the absmax sits in the last block of the two-loop path
    _assert_same_as_activation_quant(x, block_k=block_k)
