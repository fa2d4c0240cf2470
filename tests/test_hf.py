"""tools/export.py --format=hf: the directory loads in transformers as its own BitNetForCausalLM (CPU, float32) and
computes our logits to float32 rounding on the val text; greedy generation gives our tokens; the packed weights
decode, by hand, to our ternary codes with weight_scale = 1/gamma; the GPT-2 tokenizer encodes as ours; and the
command line refuses, in one line, what the format cannot hold. docs/hf-format.md says what goes where.

    python -m pytest tests/test_hf.py
"""
import json
import os
import sys

if __name__ == "__main__":  # run as a script (the measurement at the bottom): the repository root is importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never ask the Hub (read at import)
# transformers is imported in the tests that use it: its BitNet model takes seconds to import, and every pytest
# worker imports every test module to collect it

import data
from tokenizer import ByteTokenizer, get_tokenizer
import quant
from conftest import ROOT, TINY, fails, run
from model import GPT, GPTConfig
from tools import export

VAL = os.path.join(ROOT, "data", "shakespeare_byte", "val_000.bin")  # shipped: the corpus TINY trains on
# transformers' BitLinear decorates its activation quantiser and weight unpacking with @torch.compile, which costs
# 10-15 s of inductor compilation on 2 CPU cores; eager runs the same Python code (the same max difference, 1.49e-07,
# was measured both ways on this model: docs/hf-format.md)
EAGER = "force_eager"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A TINY ternary model trained past its lambda warm-up (lambda = 1 at step 4), exported by the command line,
    then loaded back by transformers: (checkpoint path, export directory, our model, transformers' model, what
    from_pretrained says it loaded)."""
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp("hf")
    run(f"--out_dir={d}", "--stage=2", "--init_from=scratch", *TINY, "--max_iters=4", "--eval_interval=4")
    ckpt, out = str(d / "stage2" / "ckpt.pt"), str(d / "hf")
    export.main(["--format=hf", f"--ckpt={ckpt}", f"--out={out}"])
    ours, _ = export.load_training_checkpoint(ckpt)
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    return ckpt, out, ours.eval(), hf.eval(), info


def _val_tokens(n, start=1000):
    return torch.from_numpy(data.read_shard(VAL)[start:start + n].astype(np.int64)).unsqueeze(0)  # (1, n)


@pytest.mark.slow
def test_transformers_loads_its_own_bitnet_with_packed_bitlinear_layers(exported):
    from transformers import BitNetForCausalLM
    from transformers.integrations.bitnet import BitLinear as HfBitLinear
    _, out, ours, hf, info = exported
    assert {k: v for k, v in info.items() if v} == {}  # no missing, unexpected or mismatched tensor: all are read
    c = ours.config
    assert type(hf) is BitNetForCausalLM and hf.dtype == torch.float32
    q = hf.model.layers[0].self_attn.q_proj
    assert type(q) is HfBitLinear and q.weight.dtype == torch.uint8 and q.weight.shape == (c.n_embd // 4, c.n_embd)
    assert type(hf.lm_head) is torch.nn.Linear  # modules_to_not_convert: the head stays full precision ...
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # ... and tied
    hc = hf.config
    assert hc.rope_parameters["rope_theta"] == c.rope_theta != 500000.0  # not BitNetConfig's default
    assert (hc.rms_norm_eps, hc.intermediate_size, hc.hidden_act, hc.num_key_value_heads, hc.vocab_size) == \
        (c.norm_eps, c.hidden_dim(), "silu", c.n_head, c.vocab_size)
    assert hc.bos_token_id == hc.eos_token_id == c.eot == 256 and hc.max_position_embeddings == c.block_size
    assert json.load(open(os.path.join(out, "nanobitnet.json")))["format"] == export.HF_FORMAT


def _unpack_by_hand(packed):
    """transformers' packing, decoded independently: byte (r, k) holds W_q[r + j*N/4, k] + 1 at bits 2j..2j+1."""
    return torch.cat([((packed >> (2 * j)) & 3).to(torch.int8) - 1 for j in range(4)])  # (N, K)


def test_packed_weights_are_our_ternary_codes_and_weight_scale_is_one_over_gamma(exported):
    from transformers.integrations.bitnet import pack_weights
    from safetensors.torch import load_file
    _, out, ours, hf, _ = exported
    t = load_file(os.path.join(out, "model.safetensors"))
    for i in range(ours.config.n_layer):
        for name, theirs in export.HF_HIDDEN.items():
            w_q, gamma = quant.weight_quant(ours.get_submodule(f"h.{i}.{name}").weight)
            packed, scale = t[f"model.layers.{i}.{theirs}.weight"], t[f"model.layers.{i}.{theirs}.weight_scale"]
            assert packed.dtype == torch.uint8 and torch.equal(_unpack_by_hand(packed), w_q), name
            assert torch.equal(packed, pack_weights(w_q.clone())), name  # transformers' own packer (in place: clone)
            assert scale.dtype == torch.float32 and scale.shape == (1,) and scale.item() == (1 / gamma).item(), name
            m = hf.get_submodule(f"model.layers.{i}.{theirs}")  # what transformers loaded is the file's
            assert torch.equal(m.weight, packed) and torch.equal(m.weight_scale, scale), name
        for name, theirs in export.HF_NORMS.items():
            assert torch.equal(t[f"model.layers.{i}.{theirs}.weight"], ours.get_submodule(f"h.{i}.{name}").weight)
    assert "lm_head.weight" not in t and torch.equal(t["model.embed_tokens.weight"], ours.wte.weight)


def past_a_tie(ours, hf, idx, tie=5e-4):
    """Run our model and transformers' load of its export on idx (B, T), and read every int8 activation code each
    computes (the four quantised norms of each layer, in forward order). Both compute the same codes from inputs
    that agree to float32 rounding: ours scales in fp32 before the matmul (x_q/s times W_q*gamma), transformers
    after it (the exact integer product / (s * weight_scale)), and their norms, RoPE and attention round in their
    own order. So a code may differ only where transformers' x*s lies within `tie` of k + 1/2 (a rounding tie),
    and then by 1; that changes its position and, through attention, the later positions of its row: those are
    "past a tie". Asserts that, and that every other position's logits agree to float32 rounding (1e-5 of their
    scale). Returns (past (B, T) bool, max |logit difference| per position (B, T), codes on a tie, argmax flips)."""
    seen = {}
    hooks = []
    for i in range(ours.config.n_layer):
        for a, b in export.HF_NORMS.items():  # our QuantRMSNorm's output is x_q/s; theirs is x, quantised next
            for side, m in ((0, ours.get_submodule(f"h.{i}.{a}")), (1, hf.get_submodule(f"model.layers.{i}.{b}"))):
                hooks.append(m.register_forward_hook(
                    lambda m, args, out, key=(i, a, side): seen.__setitem__(key, out)))
    with torch.no_grad(), torch.compiler.set_stance(EAGER):
        want = ours.forward_with_states(idx, idx)[0]  # (B, T, V): every position's logits
        got = hf(idx).logits
    for h in hooks:
        h.remove()
    past, ties = torch.zeros(idx.shape, dtype=torch.bool), 0
    for i in range(ours.config.n_layer):
        for a in export.HF_NORMS:
            x = seen[i, a, 1]
            xs = x * (127.0 / x.abs().amax(-1, keepdim=True).clamp(min=1e-5))  # transformers' activation_quant
            theirs = xs.round().clamp(-128, 127)
            mine = quant.activation_quant(seen[i, a, 0])[0].float()  # x_q/s quantised again: x_q exactly
            new = (mine != theirs) & ~past[..., None]  # a code that differs where no earlier one has reached
            on_tie = (xs - xs.floor() - 0.5).abs() < tie
            assert torch.all((mine - theirs).abs()[new] == 1) and torch.all(on_tie[new]), (i, a, int(new.sum()))
            ties += int(new.sum())
            past |= new.any(-1).cummax(-1).values  # its position and every later one of its row
    per_position = (got - want).abs().amax(-1)  # (B, T)
    scale = max(want.abs().max().item(), 1.0)
    assert per_position[~past].max() <= 1e-5 * scale, (per_position[~past].max().item(), scale)
    return past, per_position, ties, int((got.argmax(-1) != want.argmax(-1)).sum())


def test_logits_agree_with_ours_to_float32_rounding_up_to_an_int8_rounding_tie(exported):
    """256 windows of val text through the TINY model trained past its warm-up (8192 positions): at all but a few
    positions the logits agree to float32 rounding; the others come after a code that rounded the other way on a
    tie (past_a_tie). python -m pytest -n 0 tests/test_hf.py -k tie -s prints the counts."""
    _, _, ours, hf, _ = exported
    T = ours.config.block_size
    idx = _val_tokens(256 * T).view(256, T)
    past, diff, ties, flips = past_a_tie(ours, hf, idx)
    print(f"TINY model: {ties} codes on a rounding tie; {int(past.sum())} of {past.numel()} positions past one, "
          f"max |logit difference| {diff[past].max().item() if ties else 0:.3g} there, "
          f"{diff[~past].max().item():.3g} elsewhere; {flips} argmax flips")
    assert past.float().mean() < 0.05 and not past[0].any()  # the first window is exact


def test_greedy_generation_gives_our_tokens(exported):
    _, _, ours, hf, _ = exported
    prompt = _val_tokens(8, start=5000)
    n = ours.config.block_size - prompt.size(1)  # within the context: ours would crop past block_size, theirs not
    torch.manual_seed(0)
    want = ours.generate(prompt, n, top_k=1)
    hf.generation_config.eos_token_id = None  # ours never stops at eot: compare all n tokens
    with torch.compiler.set_stance(EAGER):
        got = hf.generate(prompt, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert got.tolist() == want.tolist(), (got.tolist(), want.tolist())


def test_gpt2_tokenizer_encodes_as_ours_in_a_padded_vocabulary(tmp_path):
    from transformers import AutoTokenizer
    m = GPT(GPTConfig(vocab_size=50304, eot=50256, n_layer=1, n_head=2, n_embd=32, block_size=32))  # --pad_vocab
    out = str(tmp_path / "hf")
    export.write_hf(m, "gpt2", out)
    tok = AutoTokenizer.from_pretrained(out)
    ours = get_tokenizer("gpt2")
    text = ByteTokenizer().decode(data.read_shard(VAL)[:20000])  # real text, with its newlines and spaces
    text += " Ünïcödé, 'll 've  tabs\t\tand 12345 digits  \n\n  "
    ids = tok(text)["input_ids"]
    assert ids == ours.encode(text) and tok.decode(ids) == text
    assert tok.eos_token_id == tok.bos_token_id == 50256 and tok.convert_ids_to_tokens(50256) == "<|endoftext|>"
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["vocab_size"] == 50304 and cfg["eos_token_id"] == 50256  # 47 padding rows the tokenizer never makes
    byte = _save_ckpt(str(tmp_path / "byte.pt"))  # a byte model exported over it: the GPT-2 tokenizer files go
    export.main(["--format=hf", f"--ckpt={byte}", f"--out={out}", "--overwrite=True"])  # no source: not ours to drop
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "nanobitnet.json"]


def test_tie_word_embeddings_says_whether_the_head_is_the_embedding(tmp_path):
    """hf_config's tie_word_embeddings follows the model: a tied model says True; an untied one False, and loads
    with its own head (True would say its head is the embedding; transformers 5 keeps the file's own lm_head only
    because the two differ, with a warning). No training run: an untrained model of the shape, written by write_hf
    and read back."""
    from transformers import AutoModelForCausalLM
    import dataclasses
    tied = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)
    assert tied.tie_embeddings and export.hf_config(tied)["tie_word_embeddings"] is True
    torch.manual_seed(0)
    m = GPT(dataclasses.replace(tied, tie_embeddings=False)).eval()
    assert export.hf_config(m.config)["tie_word_embeddings"] is False
    out = str(tmp_path / "hf")
    export.write_hf(m, "byte", out)
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert hf.config.tie_word_embeddings is False and {k: v for k, v in info.items() if v} == {}
    assert torch.equal(hf.lm_head.weight, m.lm_head.weight) and torch.equal(hf.model.embed_tokens.weight, m.wte.weight)
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)


def _save_ckpt(path, **kw):
    """A checkpoint of an untrained model of the given shape, as load_training_checkpoint reads it."""
    m = GPT(GPTConfig(**dict(dict(n_layer=1, n_head=2, n_embd=32, block_size=32), **kw)))
    torch.save({"model_args": vars(m.config), "config": {"tokenizer": "byte"}, "model": m.state_dict()}, path)
    return path


@pytest.mark.parametrize("kw,fact", [
    (dict(quant=False), "full-precision"), (dict(causal=False, vocab_size=258), "masked-diffusion"), (dict(subln=False), "SubLN"),
    (dict(n_embd=34, n_head=1), "multiple of 4"), (dict(mlp_hidden=66), "multiple of 4"), (dict(lambda_=0.5), "lambda"),
    (dict(n_head=16, n_kv_head=1, head_dim=2), "multiple of 4"), (dict(qk_norm=True), "qk_norm"),
    (dict(n_kv_head=1, head_dim=24), "attn_sub_norm")])  # heads x head_dim = 48, not n_embd 32
def test_what_the_format_cannot_hold_is_refused_in_one_line(tmp_path, capsys, kw, fact):
    ckpt = str(tmp_path / "ckpt.pt")
    lam = kw.pop("lambda_", None)
    _save_ckpt(ckpt, **kw)
    if lam is not None:  # mid warm-up: the saved lambda_ buffers are below 1
        obj = torch.load(ckpt)
        obj["model"] = {k: torch.tensor(lam) if k.endswith("lambda_") else v for k, v in obj["model"].items()}
        torch.save(obj, ckpt)
    out = str(tmp_path / "hf")
    err = fails(capsys, "--format=hf", f"--ckpt={ckpt}", f"--out={out}", code=1, main=export.main)
    assert fact in err and "transformers" in err and ckpt in err
    assert not os.path.exists(out) and os.listdir(tmp_path) == ["ckpt.pt"]  # nothing written, no temp left


def test_out_is_a_directory_never_a_file_nor_another_directory_unless_overwrite(tmp_path, capsys):
    ckpt = _save_ckpt(str(tmp_path / "ckpt.pt"))
    f = tmp_path / "file"
    f.write_text("mine")
    err = fails(capsys, "--format=hf", f"--ckpt={ckpt}", f"--out={f}", code=2, main=export.main)
    assert "is a file" in err and f.read_text() == "mine"
    err = fails(capsys, "--format=hf", f"--ckpt={ckpt}", f"--out={f}", "--overwrite=True", code=2, main=export.main)
    assert "is a file" in err and f.read_text() == "mine"  # not even with --overwrite
    d = tmp_path / "theirs"
    d.mkdir()
    (d / "notes.txt").write_text("keep")
    err = fails(capsys, "--format=hf", f"--ckpt={ckpt}", f"--out={d}", code=2, main=export.main)
    assert "notes.txt" in err and "--overwrite=True" in err and os.listdir(d) == ["notes.txt"]
    export.main(["--format=hf", f"--ckpt={ckpt}", f"--out={d}", "--overwrite=True"])  # our files beside theirs
    assert (d / "notes.txt").read_text() == "keep" and (d / "model.safetensors").exists()
    export.main(["--format=hf", f"--ckpt={ckpt}", f"--out={d}"])  # an export of ours, of this checkpoint: replaced
    other = _save_ckpt(str(tmp_path / "other.pt"))
    err = fails(capsys, "--format=hf", f"--ckpt={other}", f"--out={d}", code=2, main=export.main)
    assert "another checkpoint" in err and ckpt in err
    err = fails(capsys, "--format=hf", f"--ckpt={ckpt}", f"--out={tmp_path}", "--overwrite=True", code=2,
                main=export.main)
    assert "directory of --ckpt" in err
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "file", "other.pt", "theirs"]  # no temp directory left


# -----------------------------------------------------------------------------
# the directory is swapped in whole (tools/atomic.py atomic_dir): a stop, a kill or a full disk at any moment
# leaves --out the old export or the new one, never a mix, and says which


def _snapshot(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@pytest.mark.parametrize("when", ["writing", "moving"])
def test_a_sigterm_during_an_hf_export_leaves_the_old_or_the_new_directory_and_says_which(tmp_path, capsys,
                                                                                         monkeypatch, when):
    """A SIGTERM between the file moves of --format=hf leaves --out as it was, never old and new files mixed, and
    the message says so truly."""
    import signal
    old_ckpt, new_ckpt = _save_ckpt(str(tmp_path / "old.pt")), _save_ckpt(str(tmp_path / "new.pt"))
    out, ref = str(tmp_path / "hf"), str(tmp_path / "ref")
    export.main(["--format=hf", f"--ckpt={old_ckpt}", f"--out={out}"])
    export.main(["--format=hf", f"--ckpt={new_ckpt}", f"--out={ref}"])  # what the new export holds
    old, new = _snapshot(out), _snapshot(ref)
    assert old["model.safetensors"] != new["model.safetensors"]
    if when == "writing":
        real_write = export.write_hf

        def write_then_sigterm(*args, **kwargs):
            names = real_write(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)
            return names
        monkeypatch.setattr(export, "write_hf", write_then_sigterm)
    else:  # right after the first rename or file move into --out
        for name in ("rename", "replace"):
            def move_then_sigterm(src, dst, real=getattr(os, name)):
                real(src, dst)
                monkeypatch.undo()
                os.kill(os.getpid(), signal.SIGTERM)
            monkeypatch.setattr(os, name, move_then_sigterm)
    err = fails(capsys, "--format=hf", f"--ckpt={new_ckpt}", f"--out={out}", "--overwrite=True",
                code=128 + signal.SIGTERM, main=export.main)
    now = _snapshot(out)
    assert now in (old, new), sorted(n for n in now if now[n] != old.get(n))  # never a mix
    assert "SIGTERM" in err and f"--out={out}" in err and ("unchanged" if now == old else "written whole") in err, err
    assert now == old if when == "writing" else now == new
    assert sorted(os.listdir(tmp_path)) == ["hf", "new.pt", "old.pt", "ref"]  # no temporary directory left


def test_an_hf_export_clears_what_a_killed_export_left_beside_out(tmp_path):
    """The .hf.tmp_<owner> directories a SIGKILLed HF export leaves are removed by the next export; killed between
    its two renames, it leaves the old directory under .hf.old_<owner>, which goes back to --out."""
    import subprocess
    import sys
    from tools import atomic
    ckpt, out = _save_ckpt(str(tmp_path / "ckpt.pt")), str(tmp_path / "hf")
    export.main(["--format=hf", f"--ckpt={ckpt}", f"--out={out}"])
    before = _snapshot(out)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = f"{atomic._host()}_{done.stdout.strip()}_ab12"  # the host and pid of an export that was killed
    half = tmp_path / f".hf.tmp_{owner}"  # a half-written directory
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")
    os.rename(out, tmp_path / f".hf.old_{owner}")  # killed between the renames: --out is missing for a moment
    export.main(["--format=hf", f"--ckpt={ckpt}", f"--out={out}"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "hf"] and _snapshot(out) == before


def test_an_hf_export_on_a_full_disk_is_one_line_and_keeps_the_old_directory(tmp_path, capsys, monkeypatch):
    """--format=hf on a full disk is one error line, not a traceback (SafetensorError)."""
    import safetensors.torch
    from safetensors import SafetensorError
    ckpt, out = _save_ckpt(str(tmp_path / "ckpt.pt")), str(tmp_path / "hf")
    export.main(["--format=hf", f"--ckpt={ckpt}", f"--out={out}"])
    before = _snapshot(out)

    def full_disk(tensors, path, metadata=None):
        open(path, "wb").write(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    err = fails(capsys, "--format=hf", f"--ckpt={ckpt}", f"--out={out}", code=1, main=export.main)
    assert f"--out={out}" in err and "No space left" in err and "unchanged" in err, err
    assert _snapshot(out) == before and sorted(os.listdir(tmp_path)) == ["ckpt.pt", "hf"]


# -----------------------------------------------------------------------------
# an imported model (train.py --init_from: tests/imported.py's tiny Llama with GQA, an untied head and its own BPE
# tokenizer, converted to ternary): transformers' bitnet with its GQA, the source's tokenizer files, our logits


@pytest.fixture(scope="module")
def imported_export(imported_model, tmp_path_factory):
    """(tiny Llama source directory, its stage-2 checkpoint, export directory, our model, transformers' model, info)."""
    from transformers import AutoModelForCausalLM
    src, ckpt = imported_model
    out = str(tmp_path_factory.mktemp("imported_hf") / "hf")
    export.main(["--format=hf", f"--ckpt={ckpt}", f"--out={out}"])
    ours, _ = export.load_training_checkpoint(ckpt)
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    return src, ckpt, out, ours.eval(), hf.eval(), info


@pytest.mark.slow
def test_an_imported_model_exports_with_its_gqa_untied_head_and_config(imported_export):
    from transformers import BitNetForCausalLM
    src, _, out, ours, hf, info = imported_export
    c = ours.config
    assert (c.n_head, c.kv_heads(), c.head_size(), c.tie_embeddings) == (4, 2, 16, False)  # the tiny Llama's shape
    assert {k: v for k, v in info.items() if v} == {} and type(hf) is BitNetForCausalLM
    hc = hf.config
    assert (hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim, hc.intermediate_size, hc.hidden_act) == \
        (4, 2, 16, 160, "silu")
    assert (hc.rms_norm_eps, hc.rope_parameters["rope_theta"], hc.tie_word_embeddings) == (1e-5, 50000.0, False)
    assert hf.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16 // 4, 64)  # K: 2 heads of 16, packed by 4
    assert torch.equal(hf.lm_head.weight, ours.lm_head.weight)  # the head is its own matrix, in full precision
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()


def test_an_imported_model_carries_its_tokenizer_files(imported_export):
    """The source's tokenizer as transformers saves it (tokenizer.json ...): it encodes and decodes as the source's."""
    from transformers import AutoTokenizer
    from tokenizer import HFTokenizer
    src, _, out, ours, _, _ = imported_export
    mine, theirs = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(out)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    text = "To be, or not to be: that is the question.\n  Ünïcödé 123"
    assert theirs(text)["input_ids"] == mine(text)["input_ids"] and theirs.decode(mine(text)["input_ids"]) == text
    assert len(theirs) == ours.config.vocab_size and theirs.eos_token_id == ours.config.eot == 0
    marker = json.load(open(os.path.join(out, "nanobitnet.json")))
    assert "tokenizer.json" in marker["files"] and marker["tokenizer"] == src
    assert HFTokenizer(out).encode(text) == HFTokenizer(src).encode(text)  # our own loader reads the export too


def test_an_imported_model_gives_our_logits_in_transformers(imported_export):
    """Our logits to float32 rounding up to an int8 rounding tie (past_a_tie), on 8 sequences of random ids: a wrong
    head order, K/V sharing, rope theta or norm would change codes far from any tie."""
    _, _, _, ours, hf, _ = imported_export
    torch.manual_seed(0)
    idx = torch.randint(0, ours.config.vocab_size, (8, ours.config.block_size))
    past, diff, ties, flips = past_a_tie(ours, hf, idx)
    print(f"imported model: {ties} codes on a rounding tie; {int(past.sum())} of {past.numel()} positions past one")
    assert past.float().mean() < 0.5


@pytest.mark.slow
def test_the_real_smollm2_converted_and_trained_two_steps_exports_with_our_logits_layer_by_layer(
        smollm2, smollm2_models, tmp_path):
    """SmolLM2-135M's embedding and first 4 of its 30 layers (its real weights, GQA and head_dim: what each layer
    computes does not depend on how many follow it) with SubLN, ternary (lambda 1), two AdamW steps on
    Shakespeare, exported and loaded back by transformers. End to end the logits may differ past an int8 rounding
    tie (past_a_tie), and the change grows through the layers after it. So each layer is checked alone, given
    transformers' own input: at all but
    a few positions it computes our output to float32 rounding, and a tie moves a position by under 1% of the
    layer's scale. A wrong head order, K/V sharing, scale, rope or norm moves every position of every layer."""
    from transformers import AutoModelForCausalLM
    import dataclasses
    from tokenizer import get_tokenizer
    fp = smollm2_models[0]  # SmolLM2 imported (block_size=64), shared: read, never trained
    ours = GPT(dataclasses.replace(fp.config, quant=True, subln=True, n_layer=4))
    first4 = {k: v for k, v in fp.state_dict().items() if not k.startswith("h.") or int(k.split(".")[1]) < 4}
    assert ours.load_state_dict(first4, strict=False).unexpected_keys == []  # + SubLN gains and lambdas
    quant.set_lambda(ours, 1.0)
    with open(os.path.join(ROOT, "data", "shakespeare.jsonl.gz"), "rb") as f:
        import gzip
        text = json.loads(gzip.decompress(f.read()).decode().splitlines()[0])["text"]
    ids = torch.tensor([get_tokenizer(smollm2).encode(text)[:3 * 65]])
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    for x in (ids[:, :65], ids[:, 65:130]):  # two stage-2 steps: ternary weights move, SubLN gains leave 1
        opt.zero_grad()
        ours.forward_with_states(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
    assert ours.h[0].attn.subln.weight.ne(1).any()
    out = str(tmp_path / "hf")
    export.write_hf(ours.eval(), smollm2, out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (hf.config.num_key_value_heads, hf.config.head_dim, hf.config.tie_word_embeddings) == (3, 64, True)
    seen = {}
    for i, layer in enumerate(hf.model.layers):  # each layer's input and output inside transformers' forward
        layer.register_forward_hook(lambda m, a, kw, o, i=i: seen.__setitem__(
            i, ((a[0] if a else kw["hidden_states"]).clone(), (o[0] if isinstance(o, tuple) else o).clone())),
            with_kwargs=True)
    idx = ids[:, 130:194]
    with torch.no_grad(), torch.compiler.set_stance(EAGER):
        end_to_end = (hf(idx).logits - ours.forward_with_states(idx, idx)[0]).abs().max().item()
        T = idx.size(1)
        worst, off = 0.0, 0
        for i, block in enumerate(ours.h):
            x, want = seen[i]
            got = block(x, ours.rope_cos[:T], ours.rope_sin[:T], None)[0]
            per_position = (got - want).abs().amax(-1)[0] / want.abs().max()  # (T,) relative to the layer's scale
            off += int((per_position > 1e-5).sum())
            worst = max(worst, per_position.max().item())
    L = ours.config.n_layer
    print(f"SmolLM2: max |logit difference| {end_to_end:.3g} end to end; layer by layer {off} of {L * T} (layer, "
          f"position) pairs past a rounding tie, worst {worst:.3g} of the layer's scale")
    assert off <= 0.05 * L * T and worst <= 1e-2, (off, worst)


@pytest.mark.parametrize("fmt", ["hf", "packed", "gguf"])
def test_ctrl_c_while_the_checkpoint_and_its_tokenizer_load_is_one_line(tmp_path, capsys, monkeypatch, fmt):
    """A model's tokenizer (a GGUF's: seconds) loads with the checkpoint: Ctrl-C there is one line and exit 130 in
    every format, and nothing is written."""
    import tools.load
    ckpt = _save_ckpt(str(tmp_path / "ckpt.pt"))

    def interrupted(name):
        raise KeyboardInterrupt
    monkeypatch.setattr(tools.load, "get_tokenizer", interrupted)
    out = str(tmp_path / "out")
    err = fails(capsys, f"--format={fmt}", f"--ckpt={ckpt}", f"--out={out}", code=130, main=export.main)
    assert "Ctrl-C" in err and out in err and os.listdir(tmp_path) == ["ckpt.pt"]


if __name__ == "__main__":
    # python tests/test_hf.py <ckpt.pt> [windows]: past_a_tie on a trained model's export (README's HF figures)
    import tempfile
    from transformers import AutoModelForCausalLM
    ckpt, windows = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16
    with tempfile.TemporaryDirectory() as d:
        export.main(["--format=hf", f"--ckpt={ckpt}", f"--out={d}/hf"])
        hf = AutoModelForCausalLM.from_pretrained(f"{d}/hf", dtype=torch.float32).eval()
        ours = export.load_training_checkpoint(ckpt)[0].eval()
        T = ours.config.block_size
        past, diff, ties, flips = past_a_tie(ours, hf, _val_tokens(windows * T).view(windows, T))
    print(f"{ties} codes on an int8 rounding tie; {int(past.sum())} of {past.numel()} positions past one; max "
          f"|logit difference| {diff[past].max().item() if ties else 0:.3g} there, {diff[~past].max().item():.3g} "
          f"elsewhere; {flips} argmax flips")
