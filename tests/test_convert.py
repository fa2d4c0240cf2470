"""Turning a pretrained model into a ternary one with train.py (BitDistill's three stages): --init_from and --teacher
take a Hugging Face directory or a GGUF file; the architecture and the tokenizer come with the model.
A tiny Llama with GQA and an untied head, built with transformers (no download); the real SmolLM2-135M's import is
checked against transformers in tests/test_pretrained.py.
Run: python -m pytest tests/test_convert.py"""

import json
import os
import re

import pytest

from conftest import fails, records, run

pytestmark = pytest.mark.slow  # each test trains or converts in a subprocess; the SmolLM2 one loads 135M weights

FLAGS = ["--batch_size=4", "--block_size=64", "--eval_iters=2", "--eval_whole=False", "--warmup_steps=1",
         "--lambda_warmup_steps=2", "--device=cpu"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random-initialised Llama (2 layers, width 64, 4 heads, 2 KV heads, untied head) with a byte-level BPE
    tokenizer of 384 ids, saved as transformers saves a model of its own (tests/imported.py)."""
    from imported import tiny_llama
    return tiny_llama(str(tmp_path_factory.mktemp("tiny") / "tiny_llama"))


def step0(stdout):
    """(converted, as published): the two val losses of train.py's step-0 line."""
    m = re.search(r"step 0: val loss ([0-9.]+) at lambda 0.*against ([0-9.]+) for", stdout)
    assert m, stdout[-2000:]
    return float(m.group(1)), float(m.group(2))


def test_without_subln_the_converted_model_at_lambda_0_is_the_model_as_published(tiny_llama, tmp_path):
    """At lambda 0 every BitLinear is its fp weight, so with --subln=False step 0 scores exactly what the published
    model scores on the same val rows; inserting SubLN with unit gain changes the function (the line says by how
    much), and the calibrated gain changes it less."""
    args = ["--stage=2", f"--init_from={tiny_llama}", "--max_iters=0", *FLAGS, f"--out_dir={tmp_path}"]
    same = step0(run(*args, "--subln=False").stdout)
    assert same[0] == same[1]
    unit = step0(run(*args, "--overwrite=True").stdout)
    calibrated = step0(run(*args, "--overwrite=True", "--subln_gain=calibrated").stdout)
    assert unit[1] == calibrated[1] == same[1] and unit[0] != unit[1]
    assert abs(calibrated[0] - calibrated[1]) < abs(unit[0] - unit[1])


def test_calibrated_gains_are_the_mean_rms_of_each_input_in_the_model_as_published():
    """lessons/subln.calibrate_subln: each gain is the mean over tokens of its input's rms in the model as published
    (fp layers, no SubLN), not in the ternary model at lambda 1 nor with SubLN normalising while it is measured
    (both change the inputs of every later norm); each lambda_ is left as built; no batch is a ValueError."""
    import dataclasses
    import torch
    from lessons.subln import calibrate_subln
    from model import GPT, GPTConfig
    from tools import start
    torch.manual_seed(0)
    fp = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, quant=False, subln=False)).eval()
    batches = [(torch.randint(0, 64, (2, 16)), None) for _ in range(3)]
    rms = {}  # the published model's o_proj and down_proj inputs: what each SubLN is inserted in front of
    hooks = [lin.register_forward_pre_hook(lambda m, inp, key=key: rms.setdefault(key, []).append(
        torch.sqrt(inp[0].float().pow(2).mean(-1) + fp.config.norm_eps).flatten()))
        for i, b in enumerate(fp.h) for key, lin in (((i, "attn"), b.attn.o_proj), ((i, "mlp"), b.mlp.down_proj))]
    with torch.no_grad():
        for x, _ in batches:
            fp(x)
    for h in hooks:
        h.remove()
    model = start.convert_pretrained(fp, dataclasses.replace(fp.config, quant=True, subln=True), batches)
    for (i, part), values in rms.items():
        gain = getattr(model.h[i], part).subln.weight
        assert torch.allclose(gain, torch.cat(values).mean().expand_as(gain), rtol=1e-5), (i, part)
    assert all(float(b) == 1.0 for n, b in model.named_buffers() if n.endswith("lambda_"))  # as built: ternary
    with pytest.raises(ValueError, match="at least one batch"):
        calibrate_subln(model, [])


def test_stage2_from_a_pretrained_model_then_stage3_from_the_original(tiny_llama, tmp_path):
    """Stage 2 keeps the model's architecture (GQA, MLP width, untied head) and tokenizer, trains ternary and
    resumes; stage 3 distils the student from the original model as published (--teacher=<the same directory>)."""
    import torch
    out = f"--out_dir={tmp_path}"
    p = run("--stage=2", f"--init_from={tiny_llama}", "--max_iters=4", "--eval_interval=4", *FLAGS, out)
    assert "4 heads / 2 kv heads" in p.stdout and "SubLN inserted with unit gain" in p.stdout
    ckpt = torch.load(tmp_path / "stage2" / "ckpt.pt", weights_only=True)
    args = ckpt["model_args"]
    assert (args["n_kv_head"], args["mlp_hidden"], args["tie_embeddings"], args["quant"], args["subln"]) == \
        (2, 160, False, True, True)
    assert ckpt["config"]["tokenizer"] == tiny_llama and ckpt["model"]["h.0.attn.k_proj.weight"].shape == (32, 64)
    run("--stage=2", f"--init_from={tiny_llama}", "--max_iters=6", "--eval_interval=6", "--resume=True",
        *FLAGS, out)
    assert records(str(tmp_path))[-1]["step"] == 6
    run("--stage=3", f"--teacher={tiny_llama}", "--max_iters=2", "--eval_interval=2", *FLAGS, out)
    steps = [r for r in records(str(tmp_path), stage=3) if "kd_logits" in r]
    assert steps and all(r["kd_logits"] > 0 for r in steps)


def test_the_runs_own_doc_mask_and_block_size_are_carried_into_a_pretrained_model(tiny_llama):
    """pretrained_start: the architecture is the model's, and quant, subln, doc_mask and block_size the run's."""
    from tokenizer import get_tokenizer
    from tools import start
    from tools.config import build_config, model_config
    for doc_mask in (True, False):
        cfg = build_config({"stage": 2, "init_from": tiny_llama, "doc_mask": doc_mask, "block_size": 48,
                            "device": "cpu"})
        tok = get_tokenizer(cfg.tokenizer)
        st = start.pretrained_start(cfg, model_config(cfg, tok.vocab_size, tok.eot), tiny_llama)
        c = st.model_conf
        assert (c.doc_mask, c.block_size, c.quant, c.subln, c.n_layer, c.n_kv_head) == (doc_mask, 48, True, True, 2, 2)


def test_an_architecture_flag_a_pretrained_model_overrules_is_refused(tiny_llama, imported_model, tmp_path, capsys):
    """--init_from=<a model>, --resume of a run that began from one, or --init_from=<its checkpoint>: the
    architecture is the model's, so --n_layer/--n_head/--n_embd that ask for another are refused, not dropped."""
    import hashlib
    import shutil
    digest = lambda path: hashlib.sha256(open(path, "rb").read()).hexdigest()
    msg = fails(capsys, "--stage=2", f"--init_from={tiny_llama}", "--n_layer=4", *FLAGS,
                f"--out_dir={tmp_path / 'o'}", code=2)
    assert "--n_layer=4" in msg and "n_layer=2" in msg and tiny_llama in msg, msg
    src, ckpt = imported_model
    os.makedirs(tmp_path / "r" / "stage2")
    mine = str(tmp_path / "r" / "stage2" / "ckpt.pt")
    shutil.copy(ckpt, mine)
    before = digest(mine)
    msg = fails(capsys, "--stage=2", "--resume=True", "--n_embd=32", f"--out_dir={tmp_path / 'r'}", code=2)
    assert "--n_embd=32" in msg and "n_embd=64" in msg and mine in msg and src in msg, msg
    assert digest(mine) == before
    msg = fails(capsys, "--stage=3", f"--init_from={mine}", f"--tokenizer={src}", f"--teacher={src}", "--n_head=2",
                *FLAGS, f"--out_dir={tmp_path / 'o3'}", code=2)
    assert "--n_head=2" in msg and "n_head=4" in msg, msg


def test_a_model_we_cannot_carry_is_one_error_line_naming_the_field(tiny_llama, tmp_path, capsys):
    """A config field we do not implement (here Llama 3's rope scaling) is refused before anything is written."""
    d = tmp_path / "scaled"
    d.mkdir()
    for name in os.listdir(tiny_llama):
        (d / name).write_bytes(open(os.path.join(tiny_llama, name), "rb").read())
    conf = json.loads((d / "config.json").read_text())
    conf["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}
    (d / "config.json").write_text(json.dumps(conf))
    msg = fails(capsys, "--stage=2", f"--init_from={d}", *FLAGS, f"--out_dir={tmp_path / 'o'}", code=2)
    assert "rope_scaling" in msg and str(d) in msg
    assert not os.path.exists(tmp_path / "o" / "stage2" / "ckpt.pt")
    msg = fails(capsys, "--stage=2", f"--init_from={tiny_llama}", "--tokenizer=byte", *FLAGS,
                f"--out_dir={tmp_path / 'o'}", code=2)  # another vocabulary's ids would index the wrong rows
    assert "--tokenizer=byte" in msg and f"--tokenizer={tiny_llama}" in msg


def test_check_llamacpp_scores_an_imported_model_on_its_own_tokenizers_val_text(imported_model, tmp_path, monkeypatch):
    """lab/check_llamacpp.py read data/shakespeare_<tokenizer>, a path that does not exist for a model's own
    tokenizer: it reads the shards train.py reads (plumbing.shipped_dir), made if missing. llama.cpp is a
    stand-in here (uniform logits: its loss is ln V exactly); the real run is in lab/results/convert.md."""
    import math
    import sys
    import types
    import numpy as np
    import torch
    from lab import check_llamacpp
    _, ckpt = imported_model

    class Uniform:
        def __init__(self, model_path, n_ctx, **kwargs):
            self.scores = np.zeros((n_ctx, 384), dtype=np.float32)
        reset = eval = lambda self, *a: None  # noqa: E731
        create_completion = lambda self, **kw: {"choices": [{"text": "x"}]}  # noqa: E731
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Uniform))
    c = torch.load(ckpt, weights_only=False)  # llama.cpp's bitnet ties the head: tie this one's (its embedding)
    c["model"]["lm_head.weight"] = c["model"]["wte.weight"]
    c["model_args"] = dict(c["model_args"], tie_embeddings=True)
    ckpt, out = str(tmp_path / "ckpt.pt"), str(tmp_path / "r.json")
    torch.save(c, ckpt)
    assert check_llamacpp.main([f"--ckpt={ckpt}", f"--gguf={tmp_path / 'm.gguf'}", f"--out={out}", "--windows=2",
                                "--samples=1"]) == 0
    result = json.load(open(out))
    assert result["tokens"] == 2 * 64 and abs(result["val_loss_llamacpp"] - math.log(384)) < 1e-4
    assert math.isfinite(result["val_loss_ours"]) and result["val_loss_ours"] < math.log(384) + 1
