"""
Tests for kernels/packed_linear.py (PackedBitLinear, freeze_ternary, weight_bytes), tools/export.py and
sample.py --packed=True.

The packed layer is compared with the fake-quantised BitLinear of quant.py at lambda = 1, on the torch
reference path and on the Triton path (compiled on a GPU, Triton's CPU interpreter elsewhere), then whole
models, the export round trip, and sample.py end to end on a checkpoint made by train.py.

    python -m pytest tests/test_packed.py
"""

import contextlib
import copy
import errno
import importlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]  # scripts run as subprocesses from here

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # as in tests/test_kernels.py: triton.jit reads TRITON_INTERPRET when kernels.ternary_matmul is imported,
    # so set it first, and re-import the module if another test module imported it without the flag
    os.environ["TRITON_INTERPRET"] = "1"

import kernels.ternary_matmul as tm  # noqa: E402

if not ON_GPU and not tm.INTERPRETED:
    tm = importlib.reload(tm)  # packed_linear calls tm.<name>, so it sees the reloaded module

from tools import export, load  # noqa: E402
import quant  # noqa: E402
from conftest import fails  # noqa: E402
from kernels import op  # noqa: E402
from kernels.packed_linear import PackedBitLinear, freeze_ternary, weight_bytes  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
U = 2.0**-24  # fp32 unit roundoff
TINY = GPTConfig(vocab_size=257, block_size=32, n_layer=2, n_head=2, n_embd=32)  # K = 32 and 128: multiples of 4
HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp32_dot_bound(x_fq, w_fq):
    """Worst-case |fake - packed| for y = x_fq @ w_fq^T: the fake path rounds K products and K - 1 sums
    (<= K u sum|x w|, any summation order), plus a few roundings of the STE blend x + (Q(x) - x) and of the
    scales in both paths (<= 8 u sum|x w|); the packed path's int32 sum is exact."""
    K = x_fq.shape[-1]
    return (K + 8) * U * (x_fq.abs().double() @ w_fq.abs().double().T)


# -----------------------------------------------------------------------------
# one layer


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch-reference", "triton"])
@pytest.mark.parametrize("K,N", [(37, 5), (64, 33), (3, 1)])
def test_packed_bitlinear_matches_fake_quant_bitlinear_within_fp32_dot_bound(K, N, use_triton):
    device = DEVICE if use_triton else "cpu"
    torch.manual_seed(K * 100 + N)
    lin = quant.BitLinear(K, N)
    x = torch.randn(2, 3, K) * 3  # (B, T, K)
    packed = PackedBitLinear.from_bitlinear(lin, use_triton=use_triton).to(device)
    assert packed.w_packed.shape == (N, (K + 3) // 4) and packed.w_packed.dtype == torch.uint8
    assert [n for n, _ in packed.named_parameters()] == []  # buffers only, no latent weight
    with torch.no_grad():
        y_fake = lin(x)  # lambda = 1: fake-quantised activations and weights, fp32 matmul
        y = packed(x.to(device)).cpu()
    assert y.shape == (2, 3, N) and y.dtype == torch.float32
    bound = fp32_dot_bound(quant.activation_fake_quant(x), quant.weight_fake_quant(lin.weight.detach()))
    assert ((y.double() - y_fake.double()).abs() <= bound).all()
    # the Triton path against the reference path: the kernel contract, 1e-6 relative in fp32
    y_ref = PackedBitLinear.from_bitlinear(lin, use_triton=False)(x)
    assert ((y - y_ref).abs() <= 1e-6 * y_ref.abs()).all()
    # bf16 in -> bf16 out, within one bf16 ulp (2**-7 relative) of the fp32 result for the same input
    xb = x.bfloat16()
    yb = packed(xb.to(device)).cpu()
    yb_ref = PackedBitLinear.from_bitlinear(lin, use_triton=False)(xb.float())
    assert yb.dtype == torch.bfloat16 and ((yb.float() - yb_ref).abs() <= 2**-7 * yb_ref.abs()).all()


def test_packed_bitlinear_rejects_wrong_buffers():
    # the argument, the expected and the found dtype/shape
    with pytest.raises(ValueError) as e:
        PackedBitLinear(5, 3, torch.zeros(3, 1, dtype=torch.uint8), torch.tensor(1.0))
    assert all(f in str(e.value) for f in ("w_packed", "uint8", "(3, 2)", "(3, 1)")), e.value
    with pytest.raises(ValueError) as e:
        PackedBitLinear(5, 3, torch.zeros(3, 2, dtype=torch.uint8), torch.tensor(1.0, dtype=torch.float64))
    assert all(f in str(e.value) for f in ("w_scale", "float32", "float64")), e.value


# -----------------------------------------------------------------------------
# whole models


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT(TINY).eval()  # quant=True; buffers start at lambda = 1


def test_freeze_ternary_every_layer_matches_bitlinear_on_the_models_own_activations():
    """Every packed layer, fed the input its BitLinear saw inside the running model, gives its output
    within the fp32 bound. (Each BitLinear input here is already x_q / s from a QuantRMSNorm; quantising
    it again gives the same codes, because x_q / s * s' is within a few ulps of the integer x_q.)"""
    model = _tiny_model()
    frozen = freeze_ternary(copy.deepcopy(model))
    for m in model.modules():  # each layer's own forward, so its hook sees it (fused q/k/v skip the hooks)
        if hasattr(m, "fused"):
            m.fused = False
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, (i[0], o)))
             for name, m in model.named_modules() if isinstance(m, quant.BitLinear)]
    idx = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(idx, idx)
    for h in hooks:
        h.remove()
    assert len(seen) == 7 * TINY.n_layer
    for name, (x, y_fake) in seen.items():
        lin, packed = model.get_submodule(name), frozen.get_submodule(name)
        assert isinstance(packed, PackedBitLinear)
        with torch.no_grad():
            y = packed(x)
        bound = fp32_dot_bound(quant.activation_fake_quant(x), quant.weight_fake_quant(lin.weight.detach()))
        assert ((y.double() - y_fake.double()).abs() <= bound).all(), name


def test_freeze_ternary_model_logits_and_greedy_generation_match_unfrozen():
    """Whole-model logits agree within 5% of the largest logit, not to fp32 precision: an int8 activation
    code sitting on a rounding tie (x * s = k + 0.5) can round one way on the fake path and the other on
    the packed path, whose outputs are exact multiples of x_scale * gamma (token 0 attends only to itself,
    so its attention output is exactly v_0 and such ties are common); one code moves that layer's outputs
    by about gamma / s and the change propagates. Over 60 seeds of this model the largest difference was
    1.6% of max|logits|; the per-layer test above is the exact check."""
    model = _tiny_model()
    frozen = freeze_ternary(copy.deepcopy(model))
    assert not any(isinstance(m, (quant.BitLinear, quant.QuantRMSNorm)) for m in frozen.modules())
    names = [n for n, _ in frozen.named_parameters()]
    assert names and not any(n.endswith(tuple(f"{h}.weight" for h in HIDDEN)) for n in names)
    assert not any(n.endswith("lambda_") for n in frozen.state_dict())
    idx = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, out = model(idx, idx)[0], frozen(idx, idx)[0]
    tol = 0.05 * ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=0, atol=tol)

    # greedy decoding with the packed model: every chosen token is the unfrozen model's argmax up to tol
    start = idx[:1, :4]
    seq = frozen.generate(start, max_new_tokens=8, top_k=1)
    assert seq.shape == (1, 12) and torch.equal(seq[:, :4], start)
    with torch.no_grad():
        logits = model(seq, seq)[0][0, 3:-1]  # (8, V): the logits each new token was chosen from
    chosen = logits.gather(1, seq[0, 4:, None]).squeeze(1)
    assert (chosen >= logits.max(dim=1).values - 2 * tol).all()


def test_freeze_ternary_keeps_each_norms_trained_gain():
    """A trained model's norm gains are not 1: the frozen model keeps each one (the norm that replaces a
    QuantRMSNorm carries its weight) and its logits match the fake-quant model's within the tolerance above.
    An untrained model's gains are exactly 1, so a frozen norm that dropped its gain would look right there."""
    model = _tiny_model()
    gen = torch.Generator().manual_seed(5)
    norms = [n for n, m in model.named_modules() if isinstance(m, quant.QuantRMSNorm)]
    assert norms
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.rpartition(".")[0] in norms:
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=gen))  # gains in [0.5, 2)
    frozen = freeze_ternary(copy.deepcopy(model))
    want, got = model.state_dict(), frozen.state_dict()
    for n in norms:
        assert not torch.equal(want[f"{n}.weight"], torch.ones_like(want[f"{n}.weight"])), n
        torch.testing.assert_close(got[f"{n}.weight"], want[f"{n}.weight"], rtol=0, atol=0, msg=n)
    idx = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, out = model(idx, idx)[0], frozen(idx, idx)[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=0.05 * ref.abs().max().item())


def test_freeze_ternary_refuses_unfinished_lambda_warmup_and_fp_models():
    model = _tiny_model()
    quant.set_lambda(model, 0.5)
    # named: the layer, lambda_ and its value, and the fix (train on until lambda is 1)
    with pytest.raises(ValueError) as e:
        freeze_ternary(model)
    assert re.match(r"h\.0\.\S+:", str(e.value)), e.value
    assert all(f in str(e.value) for f in ("lambda_", "0.5", "train")), e.value
    assert sum(isinstance(m, quant.BitLinear) for m in model.modules()) == 7 * TINY.n_layer  # left unchanged
    with pytest.raises(ValueError) as e:
        PackedBitLinear.from_bitlinear(model.h[0].attn.q_proj)
    assert all(f in str(e.value) for f in ("lambda_", "0.5", "train")), e.value
    fp_model = GPT(GPTConfig(**{**vars(TINY), "quant": False}))
    with pytest.raises(ValueError) as e:
        freeze_ternary(fp_model)
    assert "BitLinear" in str(e.value) and "quant=False" in str(e.value), e.value


def test_weight_bytes_measures_latent_and_packed_hidden_matrices():
    model = _tiny_model()
    numel = sum(m.weight.numel() for m in model.modules() if isinstance(m, quant.BitLinear))
    before = weight_bytes(model)
    assert before["hidden"] == 4 * numel and before["hidden_numel"] == numel
    after = weight_bytes(freeze_ternary(model))
    assert after["hidden"] * 8 == 2 * numel  # every in_features here is a multiple of 4
    # other: the embedding (tied with the head, counted once) and the norm gains, plus 4-byte scalars:
    # before, lambda_ of 7 BitLinear and 4 QuantRMSNorm per layer; after, gamma of 7 PackedBitLinear per layer
    C, L = TINY.n_embd, TINY.n_layer
    shared = 4 * (TINY.vocab_size * C + L * (3 * C + TINY.hidden_dim()) + C)
    assert before["other"] == shared + 4 * 11 * L
    assert after["other"] == shared + 4 * 7 * L
    # the fp twin with its q/k/v and gate/up stacks kept (lab.bench --decode's fp model): the same hidden
    # matrices in fp32, its kept stacks read instead of the weights, nothing counted twice, no lambda
    from kernels.packed_linear import freeze_fp
    fp = weight_bytes(freeze_fp(GPT(dataclasses.replace(TINY, quant=False))))
    assert (fp["hidden"], fp["hidden_numel"], fp["other"]) == (4 * numel, numel, shared)


# -----------------------------------------------------------------------------
# tools/export.py and load_packed


def test_export_round_trip_is_bit_exact_and_one_eighth_of_bf16(tmp_path):
    model = _tiny_model()
    packed = {n: quant.pack_ternary(quant.weight_quant(m.weight.detach())[0])
              for n, m in model.named_modules() if isinstance(m, quant.BitLinear)}
    frozen = freeze_ternary(model)
    path = str(tmp_path / "packed.pt")
    torch.save(export.packed_state(frozen, "byte"), path)
    obj = torch.load(path, weights_only=True)  # plain tensors, ints and strings only
    assert obj["format"] == "nanobitnet-packed-v2" and obj["tokenizer"] == "byte"
    # one layout: the file and the layers in memory hold quant.pack_ternary's bytes
    assert packed.keys() == obj["packed"].keys()
    assert all(torch.equal(obj["packed"][n]["w_packed"], b) and torch.equal(frozen.get_submodule(n).w_packed, b)
               for n, b in packed.items())
    assert set(obj["packed"]) == {n for n, m in frozen.named_modules() if isinstance(m, PackedBitLinear)}
    assert not any(k.endswith("lambda_") or k.rpartition(".")[0] in obj["packed"] for k in obj["fp"])
    packed_bytes = sum(p["w_packed"].numel() * p["w_packed"].element_size() for p in obj["packed"].values())
    bf16_bytes = sum(2 * p["in_features"] * p["out_features"] for p in obj["packed"].values())
    assert packed_bytes * 8 == bf16_bytes

    model, tokenizer = export.load_packed(path)
    assert tokenizer == "byte"
    idx = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(idx, idx)[0], frozen(idx, idx)[0])
    with pytest.raises(ValueError) as e:  # the file, the format it should have, and how to make one
        load.model_from_packed({"model": {}}, "some.pt")
    assert all(f in str(e.value) for f in ("some.pt", "nanobitnet-packed-v2", "python -m tools.export")), e.value
    with pytest.raises(ValueError) as e:  # format v1 (rows in k order), never released: re-export it
        load.model_from_packed({**obj, "format": "nanobitnet-packed-v1"}, "old.pt")
    assert all(f in str(e.value) for f in ("old.pt", "nanobitnet-packed-v1", "python -m tools.export")), e.value


def test_every_export_floors_gamma_where_training_does():
    """BitLinear's training gamma, weight_quant and the exports clamp gamma at the same floor (quant.GAMMA_MIN).
    Under the floor (q_proj all zero, down_proj tiny: mean|W| about 8e-8) the packed, GGUF and HF exports hold codes 0
    and gamma = quant.GAMMA_MIN, and the packed layer computes exactly what the training forward does: zero."""
    model = _tiny_model()
    with torch.no_grad():
        model.h[0].attn.q_proj.weight.zero_()
        model.h[1].mlp.down_proj.weight.copy_(torch.randn_like(model.h[1].mlp.down_proj.weight) * 1e-7)
    floor = torch.tensor(quant.GAMMA_MIN).item()  # as float32
    gguf, hf = dict((n, a) for n, a, _ in export.gguf_tensors(model)), export.hf_tensors(model)
    for name, theirs, hf_name in (("h.0.attn.q_proj", "blk.0.attn_q", "model.layers.0.self_attn.q_proj"),
                                  ("h.1.mlp.down_proj", "blk.1.ffn_down", "model.layers.1.mlp.down_proj")):
        lin = model.get_submodule(name)
        packed = PackedBitLinear.from_bitlinear(lin, use_triton=False)
        assert packed.w_scale.item() == floor and not quant.unpack_ternary(packed.w_packed, lin.in_features).any()
        x = torch.randn(3, lin.in_features)
        with torch.no_grad():
            assert torch.equal(lin(x), packed(x)) and not lin(x).any(), name  # the training forward: zero too
        assert gguf[f"{theirs}.scale"].item() == floor and not gguf[f"{theirs}.weight"].any(), theirs
        assert hf[f"{hf_name}.weight_scale"].item() == (1 / torch.tensor(floor)).item(), hf_name


# -----------------------------------------------------------------------------
# end to end: train.py -> sample.py --packed=True, tools/export.py, sample.py on the export

SMALL = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4", "--max_iters=3",
         "--eval_interval=3", "--eval_iters=1", "--lambda_warmup_steps=1", "--device=cpu"]


def _run(script, *args):
    # one thread: these models are tiny, and a second thread only contends with whatever else runs
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A stage-1 (fp) and a stage-2 (ternary, lambda reached 1, started from stage 1) checkpoint from train.py."""
    out = tmp_path_factory.mktemp("runs")
    for stage in (1, 2):
        p = _run("train.py", f"--stage={stage}", f"--out_dir={out}", *SMALL)
        assert p.returncode == 0, p.stderr[-2000:]
    return out


@pytest.mark.slow
def test_sample_packed_prints_one_eighth_and_generates(trained):
    p = _run("sample.py", f"--ckpt={trained / 'stage2' / 'ckpt.pt'}", "--packed=True", "--max_new_tokens=20",
             "--num_samples=1", "--device=cpu")
    assert p.returncode == 0, p.stderr[-2000:]
    line = p.stdout.splitlines()[0]
    assert line.startswith("hidden-matrix weights:") and "fp32" in line and "(1/8 of bf16)" in line, line
    assert p.stdout.count("---------------") == 1


def test_sample_packed_on_fp_checkpoint_and_export_errors(trained, capsys, tmp_path):
    import sample

    with pytest.raises(SystemExit) as e:
        sample.main([f"--ckpt={trained / 'stage1' / 'ckpt.pt'}", "--packed=True", "--device=cpu"])
    assert e.value.code == 1 and "quant=False" in capsys.readouterr().err
    def parse(argv):
        return sample.parse(argv, sample.SampleConfig)
    assert parse(["--packed=False"])["packed"] is False and parse(["--packed=true"])["packed"] is True
    assert parse(["--packed=yes"])["packed"] is True and parse(["--packed=off"])["packed"] is False  # as train.py
    with pytest.raises(SystemExit):
        parse(["--packed=maybe"])

    with pytest.raises(SystemExit) as e:
        export.main([f"--ckpt={trained / 'stage1' / 'ckpt.pt'}", f"--out={tmp_path / 'x.pt'}"])
    assert e.value.code == 1 and "quant=False" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        export.main([f"--ckpt={tmp_path / 'missing.pt'}"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and str(tmp_path / "missing.pt") in err and "train.py" in err, err
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        export.main([f"--ckpt={tmp_path / 'corrupt.pt'}"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and str(tmp_path / "corrupt.pt") in err, err


def test_export_cli_then_sample_reads_the_export(trained, capsys, tmp_path):
    import sample

    out = tmp_path / "packed.pt"
    export.main([f"--ckpt={trained / 'stage2' / 'ckpt.pt'}", f"--out={out}"])
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "(1/8)" in printed
    ckpt = torch.load(trained / "stage2" / "ckpt.pt", weights_only=True)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    frozen = freeze_ternary(model.eval())
    loaded, tokenizer = export.load_packed(str(out))
    assert tokenizer == ckpt["config"]["tokenizer"]
    idx = torch.randint(0, 257, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(idx, idx)[0], frozen(idx, idx)[0])
    sample.main([f"--ckpt={out}", "--max_new_tokens=5", "--num_samples=1", "--device=cpu"])
    printed = capsys.readouterr().out
    assert "(1/8 of bf16)" in printed and "packed export" in printed


# -----------------------------------------------------------------------------
# tools/export.py refusals: one "error: ..." line naming the flag or file and the fix, flags checked before
# anything is read, and nothing already on disk lost


@pytest.fixture
def run_dir(trained, tmp_path):
    """A copy of the stage-2 run: ckpt_<step>.pt and ckpt.pt, a hard link to it (as checkpoint.save leaves them),
    and a packed export."""
    numbered = next((trained / "stage2").glob("ckpt_*.pt"))
    shutil.copy(numbered, tmp_path / numbered.name)
    os.link(tmp_path / numbered.name, tmp_path / "ckpt.pt")
    torch.save(export.packed_state(freeze_ternary(_tiny_model()), "byte"), tmp_path / "packed.pt")
    return tmp_path


def _snapshot(d):
    return {p.name: p.read_bytes() for p in d.iterdir()}


EXPORT_REFUSALS = {  # {d}: the run directory of run_dir; (argv, exit code, facts in the error line)
    "out-in-missing-directory": (["--ckpt={d}/ckpt.pt", "--out={d}/no/such/packed.pt"], 1,
                                 ["--out={d}/no/such/packed.pt", "does not exist", "mkdir -p {d}/no/such"]),
    "out-is-a-directory": (["--ckpt={d}/ckpt.pt", "--out={d}"], 2, ["--out={d}", "directory", "{d}/packed.pt"]),
    "out-is-ckpt": (["--ckpt={d}/ckpt.pt", "--out={d}/ckpt.pt"], 2,
                    ["--out={d}/ckpt.pt", "same file", "another --out"]),
    "out-is-a-hard-link-of-ckpt": (["--ckpt={d}/ckpt.pt", "--out={d}/{n}"], 2,  # {n}: ckpt_<step>.pt
                                   ["--out={d}/{n}", "same file", "another --out"]),
    "default-out-is-ckpt": (["--ckpt={d}/packed.pt"], 2,  # --out defaults to packed.pt beside --ckpt
                            ["--out={d}/packed.pt", "same file", "another --out"]),
    "ckpt-is-a-packed-export": (["--ckpt={d}/packed.pt", "--out={d}/packed2.pt"], 1,
                                ["{d}/packed.pt", "already a packed export", "sample.py --ckpt={d}/packed.pt"]),
    "ckpt-is-a-directory": (["--ckpt={d}"], 2, ["--ckpt={d}", "directory", "--ckpt={d}/ckpt.pt"]),
    "unknown-flag": (["--bogus=1"], 2, ["'--bogus=1'", "ckpt, out"]),
    "no-value": (["--ckpt"], 2, ["--ckpt needs a value", "--ckpt=out/stage2/ckpt.pt"]),  # tools/flags.py
}


@pytest.mark.parametrize("case", EXPORT_REFUSALS)
def test_export_refuses_bad_paths_in_one_line_and_leaves_the_run_intact(case, run_dir, capsys):
    argv, code, facts = EXPORT_REFUSALS[case]
    numbered = next(run_dir.glob("ckpt_*.pt")).name
    fill = lambda s: s.format(d=run_dir, n=numbered)  # noqa: E731
    before = _snapshot(run_dir)
    err = fails(capsys, *map(fill, argv), code=code, main=export.main)
    assert all(fill(f) in err for f in facts), err
    assert _snapshot(run_dir) == before  # no file written, replaced or left behind (.tmp)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                   RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")],
                         ids=["OSError-ENOSPC", "RuntimeError-from-torch.save"])
def test_export_on_a_full_disk_keeps_the_previous_export_and_leaves_no_tmp(error, run_dir, capsys, monkeypatch):
    """torch.save reports a full disk as OSError or, from its zip writer, as RuntimeError."""
    out = run_dir / "out.pt"
    export.main([f"--ckpt={run_dir / 'ckpt.pt'}", f"--out={out}"])  # the previous export (a re-export may replace it)
    capsys.readouterr()

    def full_disk(obj, f, *args, **kwargs):
        with open(f, "ab") if isinstance(f, (str, os.PathLike)) else contextlib.nullcontext(f) as fh:
            fh.write(b"half an export")
        raise error

    monkeypatch.setattr(torch, "save", full_disk)
    before = _snapshot(run_dir)
    err = fails(capsys, f"--ckpt={run_dir / 'ckpt.pt'}", f"--out={out}", code=1, main=export.main)
    assert all(f in err for f in (f"--out={out}", "unchanged", "free disk space")), err
    assert _snapshot(run_dir) == before  # the previous export as it was, no out.pt.tmp


def test_cpu_path_unpacks_the_codes_once_never_saves_them_and_follows_new_weights(monkeypatch):
    """On CPU the int8 codes are unpacked on the first call and kept (a second call unpacks nothing), are not in
    state_dict, and are unpacked again after load_state_dict writes new packed weights into the buffer."""
    torch.manual_seed(0)
    a, b = quant.BitLinear(32, 16), quant.BitLinear(32, 16)
    p, q = PackedBitLinear.from_bitlinear(a, use_triton=False), PackedBitLinear.from_bitlinear(b, use_triton=False)
    x = torch.randn(3, 32)
    want = tm.ternary_matmul_reference(*quant.activation_quant(x), p.w_packed, p.w_scale)
    unpacks = []
    unpack = tm.unpack_ternary_reference
    monkeypatch.setattr(tm, "unpack_ternary_reference", lambda *a: unpacks.append(1) or unpack(*a))
    y1 = p(x)
    y2 = p(x)
    assert len(unpacks) == 1 and torch.equal(y1, y2)
    assert torch.equal(y1, want)
    assert set(p.state_dict()) == {"w_packed", "w_scale"}
    p.load_state_dict(q.state_dict())
    assert torch.equal(p(x), q(x)) and not torch.equal(p(x), y1) and len(unpacks) == 3  # p again, and q once


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch-reference", "triton"])
def test_stacked_packed_layers_run_as_one_call_with_each_matrix_gamma(use_triton, monkeypatch):
    """q, k, v of a frozen model: one kernel call on the stacked codes, w_scale one gamma per row, the same
    numbers as the three layers alone (the int32 sums are exact, the scaling per element)."""
    device = DEVICE if use_triton else "cpu"
    torch.manual_seed(0)
    bl = [quant.BitLinear(32, n).to(device) for n in (32, 16, 48)]
    with torch.no_grad():
        bl[1].weight.mul_(7.0)
    packed = [PackedBitLinear.from_bitlinear(m, use_triton) for m in bl]
    x = torch.randn(5, 32, device=device)
    calls = []
    if use_triton:  # the bound linear of the stack: its weight is the stacked codes
        call = op.BoundLinear.__call__
        monkeypatch.setattr(op.BoundLinear, "__call__", lambda b, x: calls.append(b.w_packed.shape) or call(b, x))
    else:  # CPU: the stacked codes unpacked to int8
        fn = tm.ternary_matmul_codes
        monkeypatch.setattr(tm, fn.__name__, lambda *a, **k: calls.append(a[2].shape) or fn(*a, **k))
    outs = packed[0].stacked_forward(x, packed)
    # one call, fed the stacked matrix: 96 rows of 32/4 packed bytes (Triton) or of 32 int8 codes (CPU)
    assert calls == [torch.Size([96, 8] if use_triton else [96, 32])]
    monkeypatch.undo()
    for p, y in zip(packed, outs):
        assert torch.equal(y, p(x))
    model = freeze_ternary(GPT(TINY).eval())  # the model's own path: the same logits stacked or not
    idx = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        a = model(idx)[0]
        for m in model.modules():
            if hasattr(m, "fused"):
                m.fused = False
        assert torch.equal(a, model(idx)[0])


def test_a_frozen_models_norms_run_in_the_quantiser_once_per_stack(monkeypatch):
    """freeze_ternary on the Triton path: each QuantRMSNorm becomes a PackedRMSNorm that passes x
    through, and the packed layers reading it run the norm inside their quantiser
    (tm.rmsnorm_quantize): per layer four fused norm+quantise launches (before q/k/v as one stack,
    o, gate/up as one stack, down), no separate quantiser, and the frozen model's logits equal the
    torch path's (norm, activation_quant, int8 matmul), whose norms still run as modules. The fp
    baseline: freeze_fp keeps the q/k/v and gate/up stacks, the same logits bit for bit and one
    concatenation per stack for many calls (quant.stacked_linear concatenates on every call)."""
    from kernels.packed_linear import PackedRMSNorm, freeze_fp
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, subln=True)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    fast = freeze_ternary(copy.deepcopy(model), use_triton=True).to(DEVICE)
    slow = freeze_ternary(copy.deepcopy(model), use_triton=False)
    norms = [m for m in fast.modules() if isinstance(m, PackedRMSNorm)]
    assert len(norms) == 4 and all(len(n._readers) in (1, 2, 3) for n in norms)
    launches = []
    for name in ("_rmsnorm_quant_kernel", "_quantize_activations_kernel"):
        kernel = getattr(tm, name)
        monkeypatch.setattr(
            tm,
            name,
            type(
                "K",
                (),
                {
                    "__getitem__": lambda self, grid, k=kernel, n=name: (
                        lambda *a, **kw: launches.append(n) or k[grid](*a, **kw)
                    )
                },
            )(),
        )
    idx = torch.randint(0, 64, (1, 2))
    with torch.no_grad():
        got, want = fast(idx.to(DEVICE))[0], slow(idx)[0]
    assert launches == ["_rmsnorm_quant_kernel"] * 4, launches
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-5 * want.abs().max().item())

    fp = GPT(GPTConfig(**{**vars(cfg), "quant": False})).eval()
    cats = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.append(1) or cat(*a, **k))
    with torch.no_grad():
        ref = [fp(idx)[0] for _ in range(2)]
        n_plain = len(cats)
        frozen = freeze_fp(copy.deepcopy(fp))
        cats.clear()
        out = [frozen(idx)[0] for _ in range(2)]
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    # q/k/v and gate/up: concatenated on each of the 2 calls (4), or once each (2); RoPE's own cats
    # alike in both
    assert n_plain - len(cats) == 4 - 2, (n_plain, len(cats))


@pytest.mark.parametrize("M", [1, 3, 17])
def test_the_bound_linear_gives_linears_numbers_bit_for_bit(M):
    """op.BoundLinear (what PackedBitLinear calls on the Triton path) against op.linear: decode (M <= 16) and prefill
    (M = 17; M > 64 takes the same code with another table entry, the same entry under the interpreter), fp32 and
    bf16, one gamma and one per row, and a shape linear re-lays (K % 16 != 0, decode only: it calls linear)."""
    g = torch.Generator().manual_seed(M)
    shapes = ((64, 40, False), (96, 33, True), (60, 8, False)) if M < 17 else ((96, 33, True),)  # prefill: one
    for K, N, per_row in shapes:
        w_packed = quant.pack_ternary((torch.randint(0, 3, (N, K), generator=g) - 1).to(torch.int8)).to(DEVICE)
        w_scale = (torch.rand(N if per_row else (), generator=g) + 0.01).to(DEVICE)
        bound = op.BoundLinear(w_packed, w_scale, K)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(1, M, K, generator=g).to(DEVICE, dtype)
            want = op.linear(x, w_packed, w_scale)
            got = bound(x)
            assert got.dtype == want.dtype and got.shape == (1, M, N) and torch.equal(got, want), (K, N, dtype)


def test_decode_with_more_rows_than_one_program_holds_computes_every_row(monkeypatch):
    """9 to 16 rows are two decode programs along M on a GPU (8 rows a program, DECODE_BLOCK_M; the interpreter
    holds 16 in one): with that cap, the bound linear and ternary_matmul give every row of M = 12 its numbers.
    (BoundLinear once launched one program along M, and rows 8 to 11 kept what torch.empty left there.)"""
    monkeypatch.setattr(tm, "decode_block_m", lambda M: min(tm.triton.next_power_of_2(max(M, 1)), tm.DECODE_BLOCK_M))
    g = torch.Generator().manual_seed(12)
    K, N, M = 64, 40, 12
    w_q = (torch.randint(0, 3, (N, K), generator=g) - 1).to(torch.int8)
    w_packed, w_scale = quant.pack_ternary(w_q).to(DEVICE), torch.tensor(0.02).to(DEVICE)
    bound = op.BoundLinear(w_packed, w_scale, K)
    assert bound.decode[M][1][1] == 2  # two programs along M
    x = torch.randn(M, K, generator=g).to(DEVICE)
    want = op.linear(x, w_packed, w_scale)
    assert torch.equal(bound(x), want)
    x_q, x_scale = tm.quantize_activations(x)
    acc = tm.ternary_matmul(x_q, x_scale, w_packed, w_scale, config="decode", return_acc=True)
    assert torch.equal(acc.cpu(), x_q.cpu().int() @ w_q.int().T)


def test_a_packed_linear_call_is_a_few_python_calls_and_aten_ops(monkeypatch):
    """Host cost of one PackedBitLinear.forward on the Triton path, the launches faked (what runs before a kernel
    starts): the checks, word views and launch settings are made once (op.BoundLinear), so a call is at most 14
    Python calls (nn.Module's own three included) and 7 aten ops (a view of x; x_q, x_scale and y; the int32 view of
    x_q, which dispatches as view.dtype and detach; y's view); it was 35 and 12 when every call checked and
    re-derived them."""
    import sys
    from torch.utils._python_dispatch import TorchDispatchMode

    launches = []

    class FakeKernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(self.name)

    for name in ("_decode_kernel", "_prefill_kernel", "_quantize_activations_kernel"):
        monkeypatch.setattr(tm, name, FakeKernel(name))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    layer = PackedBitLinear.from_bitlinear(quant.BitLinear(768, 768), use_triton=True).to(DEVICE)
    x = torch.randn(1, 1, 768, device=DEVICE)
    calls, ops = [], []
    with torch.no_grad():
        layer(x)  # binds the weight once
        launches.clear()
        sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
        try:
            layer(x)
        finally:
            sys.setprofile(None)
        with Ops():
            layer(x)
    assert launches == ["_quantize_activations_kernel", "_decode_kernel"] * 2
    assert len(calls) <= 14 and len(ops) <= 7, (calls, ops)


def test_the_kernel_benchmarks_linear_column_runs_what_a_packed_layer_runs():
    """lab.bench's linear column on a GPU times op.BoundLinear, the call PackedBitLinear makes eagerly (its host
    cost is the model's), one bound weight per rotated copy; the numbers are op.linear's bit for bit (here
    through the interpreter). Off the GPU the column keeps its plain-torch stand-ins."""
    from kernels import op
    from lab import bench
    g = torch.Generator().manual_seed(0)
    K, N = 64, 48
    wp = [torch.randint(0, 256, (N, K // 4), dtype=torch.uint8, generator=g).to(DEVICE) for _ in range(3)]
    x = torch.randn(1, K, generator=g).to(DEVICE, torch.bfloat16)
    gamma = torch.tensor(0.02, device=DEVICE)
    bound = bench.layer_calls(x, wp, gamma, K, bound=True)
    assert [type(f.__defaults__[0]) for f in bound] == [op.BoundLinear] * 3
    assert [f.__defaults__[0].w_packed for f in bound] == wp
    for f, w in zip(bound, wp):
        y = f()
        assert y.dtype == torch.bfloat16 and torch.equal(y, op.linear(x, w, gamma))
    assert bench.DECODE_MAX_M == tm.DECODE_MAX_M  # the bench's decode/prefill split is the kernels'
    plain = bench.layer_calls(x, wp, gamma, K, bound=False)
    quantize, matmul = bench.kernel_ops(False)
    assert torch.equal(plain[1](), matmul(*quantize(x), wp[1], gamma, out_dtype=torch.bfloat16))


def test_the_triton_packed_model_compiles_whole_through_the_registered_op():
    """torch.compile(fullgraph=True) traces a packed model on the Triton path (through aot_eager: dynamo and the
    fake, not inductor's code generation, whose fused kernels round RoPE's products otherwise: on a GPU with FMA):
    the kernels are one registered op (op.ternary_linear) whose fake gives the shape, so the launch code is never
    traced; the compiled logits equal the eager ones bit for bit. torch.library.opcheck checks the op against its
    fake. Inductor's compile of the packed decode step runs on a GPU in tests/gpu_decode.py (the same tokens)."""
    torch.manual_seed(0)
    x, w_q = torch.randn(3, 64, device=DEVICE), torch.randint(-1, 2, (40, 64), dtype=torch.int8)
    torch.library.opcheck(op.ternary_linear, (x, tm.pack_planes(w_q).to(DEVICE), torch.tensor(0.3, device=DEVICE)))
    model = freeze_ternary(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)).eval(),
                           use_triton=True).to(DEVICE)
    idx = torch.randint(0, 64, (1, 2), device=DEVICE)  # two positions: the interpreter pays per row
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(model, fullgraph=True, backend="aot_eager")(idx)[0], model(idx)[0])


# -----------------------------------------------------------------------------
# an imported model (tests/imported.py: a tiny Llama with GQA, an untied head and its own BPE tokenizer, converted to
# ternary by train.py --init_from): the packed export keeps its shape and tokenizer, and sample.py decodes with it


@pytest.mark.slow
def test_an_imported_model_exports_packed_and_samples_text_in_its_own_tokenizer(imported_model, tmp_path, capsys):
    import sample
    from tokenizer import get_tokenizer
    src, ckpt = imported_model
    out = tmp_path / "packed.pt"
    export.main([f"--ckpt={ckpt}", f"--out={out}"])
    capsys.readouterr()
    loaded, tokenizer = export.load_packed(str(out))
    c = loaded.config
    assert tokenizer == src and (c.n_head, c.kv_heads(), c.tie_embeddings) == (4, 2, False)
    assert loaded.h[0].attn.k_proj.out_features == 32 and "lm_head.weight" in torch.load(out)["fp"]
    ours, _ = export.load_training_checkpoint(ckpt)
    frozen = freeze_ternary(ours.eval())
    idx = torch.randint(0, c.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(idx, idx)[0], frozen(idx, idx)[0])
    tok = get_tokenizer(src)
    start = "To be, or not"
    x = torch.tensor([[tok.eot] + tok.encode(start)])
    torch.manual_seed(0)
    want = tok.decode(loaded.generate(x, 12, top_k=1)[0, 1:].tolist())
    assert want.startswith(start)
    for path in (out, ckpt):  # the export, and the checkpoint itself with --packed=True
        sample.main([f"--ckpt={path}", f"--start={start}", "--max_new_tokens=12", "--top_k=1", "--num_samples=1",
                     "--device=cpu", *(["--packed=True"] if path == ckpt else [])])
        printed = capsys.readouterr().out
        assert f"\n{want}\n---------------\n" in printed, printed
