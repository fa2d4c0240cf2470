"""tools/export.py --format=gguf: what llama.cpp's bitnet architecture reads, checked by reading the
file back (gguf's reader, and TQ2_0 bytes decoded here by hand), vocabulary metadata, and the command line.
The end-to-end run in llama.cpp itself is lab/check_llamacpp.sh (not in CI: it compiles llama.cpp)."""
import errno
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from tools import export as gguf_export
import quant
from conftest import ENV, ROOT, TINY, fails, run
from model import GPT, GPTConfig


def _model(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**dict(dict(vocab_size=257, n_layer=2, n_head=2, n_embd=64, block_size=32), **kw))).eval()


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_every_tensor_reads_back_exactly_as_ternary_codes_and_gamma(tmp_path):
    m = _model()
    path = str(tmp_path / "m.gguf")
    counts = gguf_export.write_gguf(m, "byte", path)
    assert counts == {"F32": 1 + 2 * (7 + 4) + 1, "F16": 2 * 7}  # K = 64 or 192: not whole blocks of 256
    assert gguf_export.verify_gguf(path, m) == []
    t = _tensors(path)
    w_q, gamma = quant.weight_quant(m.h[1].mlp.down_proj.weight)
    assert np.array_equal(np.asarray(t["blk.1.ffn_down.weight"].data), w_q.numpy().astype(np.float16))
    assert float(t["blk.1.ffn_down.scale"].data[0]) == gamma.item()  # F32: gamma exactly
    assert list(t["blk.1.ffn_down.weight"].shape) == [m.config.hidden_dim(), 64]  # ggml order: (in, out)
    names = {"attn_q": "attn.q_proj", "attn_k": "attn.k_proj", "attn_v": "attn.v_proj", "attn_output": "attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}  # llama.cpp's names
    for i in range(2):
        for theirs, ours in names.items():
            w_q, gamma = quant.weight_quant(m.get_submodule(f"h.{i}.{ours}").weight)
            assert np.array_equal(np.asarray(t[f"blk.{i}.{theirs}.weight"].data, np.float32), w_q.numpy()), theirs
            assert float(t[f"blk.{i}.{theirs}.scale"].data[0]) == gamma.item()
        for theirs, ours in {"attn_norm": "attn_norm", "attn_sub_norm": "attn.subln", "ffn_norm": "mlp_norm",
                             "ffn_sub_norm": "mlp.subln"}.items():
            assert np.array_equal(t[f"blk.{i}.{theirs}.weight"].data, m.get_submodule(f"h.{i}.{ours}").weight.detach())
    assert "output.weight" not in t  # tied: llama.cpp's bitnet uses token_embd as the head
    assert np.array_equal(np.asarray(t["token_embd.weight"].data), m.wte.weight.detach().numpy())


def test_a_changed_tensor_is_caught(tmp_path):
    m = _model()
    path = str(tmp_path / "m.gguf")
    gguf_export.write_gguf(m, "byte", path)
    t = _tensors(path)["blk.0.attn_k.weight"]
    with open(path, "r+b") as f:  # flip one weight of attn_k from its code to another value
        f.seek(t.data_offset + 2 * 5)
        old = np.frombuffer(f.read(2), np.float16)[0]
        f.seek(t.data_offset + 2 * 5)
        f.write(np.float16(0.0 if old != 0 else 1.0).tobytes())
    assert gguf_export.verify_gguf(path, m) == ["blk.0.attn_k.weight: 1 of 4096 values differ"]


def _decode_tq2_0(raw, rows, cols):
    """Independent decoder of ggml's TQ2_0 blocks (256 weights in 66 bytes: qs[64], then d as fp16): in each half
    of 128 weights, byte j holds weights j, j+32, j+64, j+96 at bits 0, 2, 4, 6, each stored as code + 1."""
    blocks = np.asarray(raw, np.uint8).reshape(rows, cols // 256, 66)
    out = np.empty((rows, cols // 256, 256), np.float32)
    d = blocks[..., 64:66].copy().view(np.float16)[..., 0].astype(np.float32)
    for half in range(2):
        qs = blocks[..., 32 * half:32 * half + 32]
        for s in range(4):
            out[..., 128 * half + 32 * s:128 * half + 32 * s + 32] = ((qs >> (2 * s)) & 3).astype(np.float32) - 1
    return (out * d[..., None]).reshape(rows, cols)


def test_rows_of_whole_256_blocks_go_out_as_tq2_0_decoded_by_hand(tmp_path):
    m = _model(n_embd=256, n_head=4, mlp_hidden=512)
    path = str(tmp_path / "m.gguf")
    assert gguf_export.write_gguf(m, "byte", path) == {"F32": 1 + 2 * (7 + 4) + 1, "TQ2_0": 2 * 7}
    assert gguf_export.verify_gguf(path, m) == []
    t = _tensors(path)["blk.1.ffn_gate.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.TQ2_0 and t.n_bytes == 512 * 256 // 256 * 66
    w_q, _ = quant.weight_quant(m.h[1].mlp.gate_proj.weight)
    assert np.array_equal(_decode_tq2_0(t.data, 512, 256), w_q.numpy().astype(np.float32))  # d = 1: exact


def test_tq2_0_is_chosen_by_the_row_length_k_the_input_dim(tmp_path):
    """TQ2_0 quantises each row (K = in_features values) in blocks of 256, so a hidden matrix goes out as TQ2_0
    exactly when K is a multiple of 256: with n_embd 64 and mlp_hidden 256, ffn_down (K = 256, 64 rows) does, and
    ffn_gate / ffn_up (256 rows of K = 64) and the attention matrices (K = 64) go out as F16."""
    m = _model(mlp_hidden=256)
    path = str(tmp_path / "m.gguf")
    assert gguf_export.write_gguf(m, "byte", path) == {"F32": 1 + 2 * (7 + 4) + 1, "TQ2_0": 2, "F16": 2 * 6}
    t = _tensors(path)
    for i in range(2):
        for theirs, ours in {"attn_q": "attn.q_proj", "attn_output": "attn.o_proj", "ffn_gate": "mlp.gate_proj",
                             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}.items():
            k = m.get_submodule(f"h.{i}.{ours}").in_features
            want = gguf.GGMLQuantizationType.TQ2_0 if k % 256 == 0 else gguf.GGMLQuantizationType.F16
            assert t[f"blk.{i}.{theirs}.weight"].tensor_type == want, (theirs, k)
    assert gguf_export.verify_gguf(path, m) == []


def test_hyperparameters_are_what_llama_cpp_builds_the_model_from(tmp_path):
    """bitnet.* keys: a RoPE dimension count of the head size n_embd / n_head (32 here, not n_embd 64), as many
    KV heads as heads, the feed-forward width, the RMSNorm eps and the RoPE base of the model."""
    m = _model()
    c = m.config
    path = str(tmp_path / "m.gguf")
    gguf_export.write_gguf(m, "byte", path)
    f = gguf.GGUFReader(path).fields
    want = {"rope.dimension_count": c.n_embd // c.n_head, "embedding_length": c.n_embd, "block_count": c.n_layer,
            "feed_forward_length": c.hidden_dim(), "attention.head_count": c.n_head,
            "attention.head_count_kv": c.n_head, "context_length": c.block_size}
    assert {k: f[f"bitnet.{k}"].contents() for k in want} == want and want["rope.dimension_count"] == 32
    assert f["bitnet.rope.freq_base"].contents() == c.rope_theta
    assert f["bitnet.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(c.norm_eps)


@pytest.mark.slow
def test_vocabulary_metadata_byte_and_gpt2(tmp_path):
    path = str(tmp_path / "b.gguf")
    gguf_export.write_gguf(_model(vocab_size=320), "byte", path)  # padded past 257 as --pad_vocab does
    f = gguf.GGUFReader(path).fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 320 and tokens[32] == "Ġ" and tokens[10] == "Ċ" and tokens[65] == "A"
    assert tokens[256] == "<|endoftext|>" and tokens[257] == "[PAD257]" and len(set(tokens)) == 320
    types = f["tokenizer.ggml.token_type"].contents()
    assert types[:256] == [1] * 256 and types[256] == 3 and set(types[257:]) == {5}  # normal, control, unused
    assert f["tokenizer.ggml.bos_token_id"].contents() == f["tokenizer.ggml.eos_token_id"].contents() == 256
    assert f["tokenizer.ggml.add_bos_token"].contents() is True  # eot before a prompt, as before every document
    assert f["general.architecture"].contents() == "bitnet" and f["bitnet.context_length"].contents() == 32
    path = str(tmp_path / "g.gguf")
    gguf_export.write_gguf(_model(vocab_size=50257), "gpt2", path)
    f = gguf.GGUFReader(path).fields
    merges = f["tokenizer.ggml.merges"].contents()
    assert len(merges) == 50000 and merges[:3] == ["Ġ t", "Ġ a", "h e"]  # GPT-2's merges.txt starts so
    assert f["tokenizer.ggml.tokens"].contents()[50256] == "<|endoftext|>"
    assert f["tokenizer.ggml.bos_token_id"].contents() == 50256 and f["tokenizer.ggml.add_bos_token"].contents() is True


def test_llama_cpp_starts_a_prompt_with_eot_as_every_training_document_starts(tmp_path):
    """add_bos_token is written True. tools/prepare.py writes each document as [eot] + tokens
    and sample.py prompts with [eot] + the start text, so the model has only ever seen text after an eot: the GGUF
    names eot as BOS (id 256 of the byte tokenizer) and tells llama.cpp to add it before the prompt."""
    path, m = str(tmp_path / "b.gguf"), _model()
    gguf_export.write_gguf(m, "byte", path)
    f = gguf.GGUFReader(path).fields
    assert f["tokenizer.ggml.add_bos_token"].contents() is True
    assert f["tokenizer.ggml.bos_token_id"].contents() == 256 == m.config.eot
    assert f["tokenizer.ggml.tokens"].contents()[256] == "<|endoftext|>"


def _save_ckpt(path):
    """A checkpoint of an untrained ternary model (SubLN, tied head: what the GGUF export takes), byte tokenizer."""
    m = _model(n_layer=1, n_embd=32)
    torch.save({"model_args": vars(m.config), "config": {"tokenizer": "byte"}, "model": m.state_dict()}, path)
    return path


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                   OSError("4096 requested and 1136 written")],  # numpy's tofile: no errno
                         ids=["ENOSPC", "numpy-tofile"])
def test_a_gguf_export_on_a_full_disk_names_out_and_the_disk_and_keeps_the_old_file(tmp_path, capsys, monkeypatch,
                                                                                   error):
    """A full disk during --format=gguf is one line naming --out and the disk holding it (not blaming the
    checkpoint); the earlier GGUF at --out whole, no .tmp left."""
    ckpt, out = _save_ckpt(str(tmp_path / "ckpt.pt")), str(tmp_path / "m.gguf")
    gguf_export.main(["--format=gguf", f"--ckpt={ckpt}", f"--out={out}"])
    capsys.readouterr()
    before = open(out, "rb").read()

    def full_disk(self, **kwargs):
        self.fout[0].write(b"half the tensors")
        raise error
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    err = fails(capsys, "--format=gguf", f"--ckpt={ckpt}", f"--out={out}", code=1, main=gguf_export.main)
    assert err.startswith(f"error: --out={out}: cannot write the GGUF ({error.strerror or error})"), err
    assert f"the disk holding {tmp_path} has " in err and "free disk space" in err and "unchanged" in err, err
    assert "ckpt.pt" not in err  # the checkpoint was read whole: not its fault
    assert open(out, "rb").read() == before and sorted(os.listdir(tmp_path)) == ["ckpt.pt", "m.gguf"]
    if os.path.isdir("/proc/self/fd"):  # Linux: no handle keeps the removed partial file's blocks (the free space said)
        held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")]
        assert not [h for h in held if h.startswith(out)], held


def test_an_out_named_gguf_is_a_gguf_and_a_name_of_another_format_is_refused(tmp_path, capsys):
    """--out=model.gguf without --format wrote our torch packed file under that name (and --format=gguf
    --out=model.pt a GGUF named .pt), exit 0: the name decides when --format is not given, and an --out whose
    extension names another format than --format's is one line, nothing written."""
    ckpt = _save_ckpt(str(tmp_path / "ckpt.pt"))
    gguf_export.main([f"--ckpt={ckpt}", f"--out={tmp_path / 'm.gguf'}"])
    assert open(tmp_path / "m.gguf", "rb").read(4) == b"GGUF" and "verified" in capsys.readouterr().out
    for argv, named in ((["--format=gguf", f"--out={tmp_path / 'm.pt'}"], ".pt file"),
                        (["--format=packed", f"--out={tmp_path / 'p.gguf'}"], "GGUF file"),
                        (["--format=hf", f"--out={tmp_path / 'h.gguf'}"], "GGUF file")):
        err = fails(capsys, f"--ckpt={ckpt}", *argv, code=2, main=gguf_export.main)
        assert argv[1] in err and named in err and argv[0] in err, err
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "m.gguf"]


@pytest.mark.slow
def test_export_command_line_gguf_and_its_refusals(tmp_path, capsys):
    out = str(tmp_path / "o")
    run(f"--out_dir={out}", "--stage=2", "--init_from=scratch", *TINY, "--max_iters=6", "--eval_interval=6")
    ckpt = os.path.join(out, "stage2", "ckpt.pt")
    p = subprocess.run([sys.executable, "-m", "tools.export", "--format=gguf", f"--ckpt={ckpt}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True)
    assert p.returncode == 0 and "architecture bitnet" in p.stdout and "verified" in p.stdout, p.stderr
    assert os.path.exists(os.path.join(out, "stage2", "model.gguf"))
    p = subprocess.run([sys.executable, "-m", "tools.export", "--format=onnx", f"--ckpt={ckpt}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "packed" in p.stderr
    with pytest.raises(ValueError, match="SubLN"):
        gguf_export.write_gguf(_model(subln=False), "byte", str(tmp_path / "x.gguf"))
    m = _model()
    quant.set_lambda(m, 0.5)
    with pytest.raises(ValueError, match="lambda"):
        gguf_export.write_gguf(m, "byte", str(tmp_path / "y.gguf"))


# -----------------------------------------------------------------------------
# lab/check_llamacpp.py's outputs, with a stand-in for llama-cpp-python (which compiles llama.cpp)


class _FakeLlama:
    """llama_cpp.Llama as lab/check_llamacpp.py calls it: uniform logits, one fixed sample; with
    `script` set, the logits after each token name the next token of the script (the greedy tokens
    it "generates"). As llama-cpp-python (0.3), the scores are written only in a context opened with
    logits_all=True."""
    script = None

    def __init__(self, model_path, n_ctx, logits_all=False, **kwargs):
        self.scores = np.zeros((n_ctx, 257), dtype=np.float32)
        self.n_tokens, self.logits_all = 0, logits_all

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        self.n_tokens += len(tokens)
        if self.script is not None and self.logits_all:
            self.scores[self.n_tokens - 1] = 0
            self.scores[self.n_tokens - 1, self.script.pop(0)] = 1

    def create_completion(self, **kwargs):
        return {"choices": [{"text": "fake sample"}]}


@pytest.mark.slow
@pytest.mark.slow  # trains a tiny run (a subprocess)
def test_check_llamacpp_never_writes_over_a_checkpoint_and_keeps_its_outputs(
    tmp_path, capsys, monkeypatch
):
    """--out=<a checkpoint> and --gguf=<a checkpoint> are refused: neither rewrites the checkpoint
    (nor its hard-linked ckpt_N.pt) as JSON or as a GGUF."""
    import hashlib
    import json
    import types
    from conftest import fails
    from lab import check_llamacpp
    from tools import outputs
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_FakeLlama))
    run(f"--out_dir={tmp_path}", "--stage=2", "--init_from=scratch", *TINY, "--max_iters=4",
        "--eval_interval=4")
    d = tmp_path / "stage2"
    ckpt, numbered, another = str(d / "ckpt.pt"), str(d / "ckpt_000004.pt"), str(d / "another.pt")
    shutil.copy(ckpt, another)  # another run's checkpoint
    def digest():
        return {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in os.listdir(d)}
    before = digest()
    small = ["--windows=1", "--samples=1", "--gen_tokens=0"]
    for flag in ("--out", "--gguf"):
        for asked in ([], ["--overwrite=True"]):  # not even when asked
            msg = fails(capsys, f"--ckpt={ckpt}", f"{flag}={numbered}", *small, *asked, code=2,
                        main=check_llamacpp.main)  # a hard link of --ckpt
            assert f"{flag}={numbered}" in msg and "same file as --ckpt" in msg, msg
            msg = fails(capsys, f"--ckpt={ckpt}", f"{flag}={another}", *small, *asked, code=2,
                        main=check_llamacpp.main)
            assert f"{flag}={another}" in msg and "training checkpoint" in msg, msg
    assert digest() == before
    gguf, result = str(tmp_path / "m.gguf"), str(tmp_path / "r.json")
    assert check_llamacpp.main([f"--ckpt={ckpt}", f"--gguf={gguf}", f"--out={result}", *small]) == 0
    assert json.load(open(result))["tokens"] == 32 and outputs.file_kind(gguf) == ("gguf", ckpt)
    msg = fails(capsys, f"--ckpt={ckpt}", f"--gguf={gguf}", f"--out={result}", *small, code=2,
                # the GGUF of the same checkpoint may go; an earlier result stays
                main=check_llamacpp.main)
    assert f"--out={result}" in msg and "already exists" in msg and "--overwrite=True" in msg, msg
    assert check_llamacpp.main([f"--ckpt={ckpt}", f"--gguf={gguf}", f"--out={result}", *small,
                                "--overwrite=True"]) == 0
    msg = fails(capsys, f"--ckpt={ckpt}", "--windows=0", code=2, main=check_llamacpp.main)
    assert "--windows=0" in msg
    assert digest() == before and sorted(os.listdir(tmp_path)) == ["m.gguf", "r.json", "stage2"]


# -----------------------------------------------------------------------------
# an imported model's shape and vocabulary (tests/imported.py's tiny Llama: GQA, its own byte-level BPE tokenizer)


def _field(reader, key):
    f = reader.fields[key]
    if len(f.data) == 1:
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]
    return [bytes(f.parts[i]).decode() if f.types[-1] == gguf.GGUFValueType.STRING else f.parts[i].tolist()[0]
            for i in f.data]


@pytest.mark.slow
def test_an_imported_model_writes_head_count_kv_head_dims_and_its_vocabulary(tmp_path):
    """GQA (4 heads, 2 K/V heads of 16), rope theta and eps as the model's, and the source's BPE vocabulary as
    gguf-py writes a "gpt2" one: every token in its byte-level spelling, <|endoftext|> CONTROL, its merges, the
    "gpt-2" pre-tokenizer (tokenizer.json: ByteLevel alone). Reads back tensor by tensor."""
    from imported import tiny_llama
    from tokenizer import get_tokenizer
    src = tiny_llama(str(tmp_path / "tiny_llama"))
    tok = get_tokenizer(src)
    m = _model(vocab_size=tok.vocab_size, eot=tok.eot, n_head=4, n_kv_head=2, rope_theta=50000.0, norm_eps=1e-5)
    path = str(tmp_path / "m.gguf")
    gguf_export.write_gguf(m, src, path)
    assert gguf_export.verify_gguf(path, m) == []
    r = gguf.GGUFReader(path)
    assert (_field(r, "bitnet.attention.head_count"), _field(r, "bitnet.attention.head_count_kv")) == (4, 2)
    assert (_field(r, "bitnet.attention.key_length"), _field(r, "bitnet.attention.value_length"),
            _field(r, "bitnet.rope.dimension_count")) == (16, 16, 16)
    assert _field(r, "bitnet.rope.freq_base") == 50000.0
    assert list(_tensors(path)["blk.0.attn_k.weight"].shape) == [64, 32]  # ggml order (in, out): 2 K heads of 16
    tokens = _field(r, "tokenizer.ggml.tokens")
    vocab = tok.hf.get_vocab()
    assert len(tokens) == tok.vocab_size and all(tokens[i] == t for t, i in vocab.items())
    types = _field(r, "tokenizer.ggml.token_type")
    assert types[tok.eot] == gguf.TokenType.CONTROL and types.count(gguf.TokenType.NORMAL) == tok.vocab_size - 1
    import json
    merges = json.load(open(os.path.join(src, "tokenizer.json")))["model"]["merges"]
    assert _field(r, "tokenizer.ggml.merges") == [x if isinstance(x, str) else " ".join(x) for x in merges]
    assert (_field(r, "tokenizer.ggml.model"), _field(r, "tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    assert _field(r, "tokenizer.ggml.eos_token_id") == tok.eot == 0
    assert _field(r, "tokenizer.ggml.add_bos_token") is False  # its BOS is its own, not eot (docs/gguf-format.md)


@pytest.mark.slow
def test_qk_norm_and_an_untied_head_are_refused_for_llama_cpp(tmp_path):
    for kw, fact in ((dict(qk_norm=True), "qk_norm"), (dict(tie_embeddings=False), "LM head")):
        with pytest.raises(ValueError, match=fact):
            gguf_export.write_gguf(_model(**kw), "byte", str(tmp_path / "m.gguf"))


@pytest.mark.slow  # trains a tiny run (a subprocess)
def test_check_llamacpp_times_greedy_generation_in_both_and_counts_the_tokens_that_agree(
    tmp_path, monkeypatch
):
    """generation_speed: llama.cpp's greedy tokens (here scripted) against ours from the frozen
    packed model, the prompt excluded: tokens/s of each, and the length of the common start (all n
    when llama.cpp picks ours, 3 when it parts at the fourth)."""
    import copy
    import types
    import torch
    from lab import check_llamacpp
    from tools import decode, export
    from kernels.packed_linear import freeze_ternary
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_FakeLlama))
    run(f"--out_dir={tmp_path}", "--stage=2", "--init_from=scratch", *TINY, "--max_iters=4",
        "--eval_interval=4")
    model, _ = export.load_training_checkpoint(str(tmp_path / "stage2" / "ckpt.pt"))
    prompt = torch.arange(5, 21)
    with torch.no_grad():
        ours = decode.Decoder(freeze_ternary(copy.deepcopy(model)).eval(), "eager").generate(
            prompt[None], 8, top_k=1
        )
    ours = ours[0, 16:].tolist()
    for script, agree in ((ours, 8), (ours[:3] + [(ours[3] + 1) % 257] + ours[4:], 3)):
        # the prompt's eval pops the first
        monkeypatch.setattr(_FakeLlama, "script", list(script) + [0])
        r = check_llamacpp.generation_speed(model, "unused.gguf", prompt, 8)
        assert r["greedy_tokens_agreeing_from_the_start"] == agree and r["gen_tokens"] == 8
        assert r["llamacpp_gen_tokens_per_s"] > 0 and r["ours_packed_gen_tokens_per_s"] > 0


def test_check_llamacpp_sh_help_prints_the_flags_without_installing_anything(tmp_path):
    """--help answers at once: the script's pip install (a compile of tens of minutes) is not
    reached; a pip that records being called stands in for the real one on PATH."""
    (tmp_path / "pip").write_text(f"#!/bin/sh\ntouch {tmp_path / 'pip_ran'}\nexit 1\n")
    os.chmod(tmp_path / "pip", 0o755)
    env = dict(ENV, PATH=f"{tmp_path}{os.pathsep}{ENV.get('PATH', '')}", PYTHONPATH=ROOT)
    for flag in ("--help", "-h"):
        r = subprocess.run(["bash", os.path.join(ROOT, "lab", "check_llamacpp.sh"), flag], env=env,
                           capture_output=True, text=True, timeout=120)
        assert (
            r.returncode == 0 and "--gen_tokens" in r.stdout and "llama.cpp" in r.stdout
        ), r.stderr
    assert not (tmp_path / "pip_ran").exists()
