"""Turning a pretrained model into a ternary one with train.py (BitDistill's three stages): --init_from and --teacher
take a Hugging Face directory or a GGUF file; the architecture and the tokenizer come with the model.
A tiny Llama with GQA and an untied head, built with transformers (no download); the real SmolLM2-135M's import is
checked against transformers in tests/test_pretrained.py.
Run: python -m pytest tests/test_convert.py"""

import json
import os
import re

import pytest
import torch

from conftest import ROOT, fails, records, run

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


def test_calibration_runs_on_the_runs_device(monkeypatch):
    """--subln_gain=calibrated measures the converted model on the run's device (a GPU's forward, not the CPU's in
    fp32 before the model moves): model and batches are there when calibrate_subln runs (a device of its own here,
    "meta", stands in for the GPU)."""
    import dataclasses
    from model import GPT, GPTConfig
    from tools import seams, start
    seen = []
    monkeypatch.setattr(seams, "calibrate_subln", lambda model, batches: seen.append(
        (next(model.parameters()).device.type, {x.device.type for x, _ in batches})))
    fp = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, quant=False, subln=False))
    batches = [(torch.randint(0, 64, (2, 16)), None)]
    start.convert_pretrained(fp, dataclasses.replace(fp.config, quant=True, subln=True), batches, "meta")
    assert seen == [("meta", {"meta"})]


def test_stage2_from_a_pretrained_model_then_stage3_from_the_original(tiny_llama, tmp_path):
    """Stage 2 keeps the model's architecture (GQA, MLP width, untied head) and tokenizer, trains ternary and
    resumes; stage 3 distils the student from the original model as published (--teacher=<the same directory>)."""
    import torch
    out = f"--out_dir={tmp_path}"
    p = run("--stage=2", f"--init_from={tiny_llama}", "--max_iters=4", "--eval_interval=4", *FLAGS, out)
    assert "4 heads / 2 kv heads" in p.stdout and "SubLN inserted with unit gain" in p.stdout
    assert f"--init_from={tiny_llama}: loading the model with transformers" in p.stdout  # progress, then done
    assert f"--init_from={tiny_llama}: loaded, " in p.stdout and "NOTE: lambda" not in p.stdout
    assert f"step 0: scoring {tiny_llama} as published and converted" in p.stdout
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


def test_a_model_with_more_embedding_rows_than_tokens_converts_resumes_and_distils(tmp_path):
    """Qwen3's config has 151,936 vocabulary rows for 151,669 token ids: the converted run keeps the model's rows,
    and its resume and stage 3 (whose flags alone would build the tokenizer's size) build them too."""
    from imported import tiny_llama
    src = tiny_llama(str(tmp_path / "wide_vocab"), config_vocab=448)  # 384 ids
    out = f"--out_dir={tmp_path / 'run'}"
    run("--stage=2", f"--init_from={src}", "--max_iters=2", "--eval_interval=2", *FLAGS, out)
    assert torch.load(tmp_path / "run" / "stage2" / "ckpt.pt", weights_only=True)["model_args"]["vocab_size"] == 448
    run("--stage=2", f"--init_from={src}", "--max_iters=3", "--eval_interval=3", "--resume=True", *FLAGS, out)
    run("--stage=3", f"--teacher={src}", "--max_iters=1", "--eval_interval=1", *FLAGS, out)
    assert [r["step"] for r in records(str(tmp_path / "run"), stage=3) if "kd_logits" in r] == [1]


def test_stage3_from_a_student_of_another_vocabulary_names_the_converted_student(tiny_llama, tmp_path, capsys):
    """README's stage 3 (--teacher=<the model>) run where out/stage2 holds the byte quick start: the line says
    to start from a student converted from that model (--init_from), not to pass --tokenizer."""
    import torch
    from tokenizer import fingerprint, get_tokenizer
    (tmp_path / "stage2").mkdir()
    torch.save({"model_args": {"quant": True}, "model": {},
                "config": {"tokenizer": "byte", "tokenizer_fingerprint": fingerprint(get_tokenizer("byte"))}},
               tmp_path / "stage2" / "ckpt.pt")
    line = fails(capsys, "--stage=3", f"--teacher={tiny_llama}", f"--out_dir={tmp_path}", *FLAGS, code=2)
    assert "distil a student converted from it" in line and f"--stage=2 --init_from={tiny_llama}" in line, line
    assert "pass --tokenizer" not in line, line


def test_a_conversion_that_ends_before_lambda_reaches_1_says_so_at_its_start(tiny_llama, capsys):
    """--init_from=<a model> --max_iters below --lambda_warmup_steps: the start note says the saved model will not
    be ternary and which --lambda_warmup_steps fits; a run whose warm-up fits says nothing of it."""
    from types import SimpleNamespace
    from model import GPTConfig
    from tools import start
    for steps, warmup, said in ((2, 600, True), (600, 600, False), (60, 30, False)):
        cfg = SimpleNamespace(stage=2, tokenizer=tiny_llama, block_size=64, subln_gain="unit", quant_start=0.0,
                              max_iters=steps, lambda_warmup_steps=warmup)
        note = start.pretrained_start(cfg, GPTConfig(quant=True, subln=True, block_size=64), tiny_llama).note
        assert ("NOTE: lambda reaches 1 at step 600" in note and f"--lambda_warmup_steps={steps // 2}" in note) == said
    assert "loading the model with transformers" in capsys.readouterr().out


def test_the_runs_own_doc_mask_and_block_size_are_carried_into_a_pretrained_model(tiny_llama):
    """pretrained_start: the architecture is the model's, and quant, subln, doc_mask and block_size the run's."""
    from tokenizer import get_tokenizer
    from tools import start
    from tools.checks import build_config
    from tools.config import model_config
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
    tokenizer: it reads the shards train.py reads (loaders.shipped_dir), made if missing. llama.cpp is a
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
                                "--samples=1", "--gen_tokens=0"]) == 0
    result = json.load(open(out))
    assert result["tokens"] == 2 * 64 and abs(result["val_loss_llamacpp"] - math.log(384)) < 1e-4
    assert math.isfinite(result["val_loss_ours"]) and result["val_loss_ours"] < math.log(384) + 1


def _bpe(d, vocab, lines):
    """A byte-level BPE of vocab ids (<|endoftext|> = 0) trained on the shipped corpus's documents `lines` (a
    slice), saved by transformers as a tokenizer directory d; returns str(d)."""
    import gzip
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from conftest import ROOT
    with gzip.open(os.path.join(ROOT, "data", "shakespeare.jsonl.gz"), "rt") as f:
        text = [json.loads(line)["text"] for line in f][lines]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(d))
    return str(d)


def _small_jsonl(path, docs=40, chars=2500):
    """A corpus file of `docs` documents of `chars` characters cut from the shipped Shakespeare text, for
    tools/prepare.py (document 20 and 40 go to val): seconds less to tokenise and clean than the whole corpus."""
    import gzip
    from conftest import ROOT
    with gzip.open(os.path.join(ROOT, "data", "shakespeare.jsonl.gz"), "rt") as f:
        text = json.loads(f.readline())["text"]
    with open(path, "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": text[i * chars:(i + 1) * chars]}) + "\n")
    return str(path)


def test_the_models_eot_is_the_document_separator_of_its_shards_not_the_configs_eos(tiny_llama, tmp_path):
    """A model whose config's eos is another token (SmolLM2-Instruct: <|im_end|> = 2) gets as eot the tokenizer's
    end-of-text, the id tools/prepare.py starts every document with (meta.json's eot), so --doc_mask=True finds
    the documents; the HF export names that id as bos and eos."""
    import shutil
    from tokenizer import get_tokenizer
    from tools import export, prepare, start
    from tools.checks import build_config
    from tools.config import model_config
    d = tmp_path / "chat"
    shutil.copytree(tiny_llama, d)
    conf = json.loads((d / "config.json").read_text())
    conf["eos_token_id"] = conf["bos_token_id"] = 2  # a chat model's end of turn, not the document separator
    (d / "config.json").write_text(json.dumps(conf))
    cfg = build_config({"stage": 2, "init_from": str(d), "doc_mask": True, "device": "cpu", "block_size": 64})
    tok = get_tokenizer(cfg.tokenizer)
    st = start.pretrained_start(cfg, model_config(cfg, tok.vocab_size, tok.eot), str(d))
    prepare.prepare([_small_jsonl(tmp_path / "c.jsonl")], tokenizer=str(d), out_dir=str(tmp_path / "shards"))
    meta = json.loads((tmp_path / "shards" / "meta.json").read_text())
    assert st.model_conf.doc_mask and st.model_conf.eot == meta["eot"] == tok.eot == 0 != conf["eos_token_id"]
    hf = export.hf_config(st.model_conf)
    assert hf["bos_token_id"] == hf["eos_token_id"] == 0


def test_another_tokenizer_than_the_models_is_refused_by_its_vocabulary_not_its_size(tiny_llama, tmp_path, capsys):
    """--init_from=A --tokenizer=B and a stage-3 --teacher=A for a run in B: refused when B is not A's vocabulary,
    smaller or of the very same size (a fingerprint of the id -> token mapping, not vocab_size); A at another path
    is A."""
    import shutil
    from tokenizer import fingerprint, get_tokenizer
    from tools import start
    from tools.checks import build_config
    smaller, same_size = _bpe(tmp_path / "smaller", 300, slice(0, 5)), _bpe(tmp_path / "other", 384, slice(5, 10))
    assert get_tokenizer(same_size).vocab_size == get_tokenizer(tiny_llama).vocab_size == 384
    assert fingerprint(get_tokenizer(same_size)) != fingerprint(get_tokenizer(tiny_llama))
    for tok in (smaller, same_size):
        msg = fails(capsys, "--stage=2", f"--init_from={tiny_llama}", f"--tokenizer={tok}", *FLAGS,
                    f"--out_dir={tmp_path / 'o'}", code=2)
        assert f"--tokenizer={tok} is not the tokenizer of --init_from={tiny_llama}" in msg and "fingerprint" in msg
        assert not os.path.exists(tmp_path / "o" / "stage2" / "ckpt.pt")
        cfg = build_config({"stage": 3, "teacher": tiny_llama, "tokenizer": tok, "device": "cpu"})
        with pytest.raises(SystemExit) as e:
            start._load_teacher(cfg, None, tiny_llama, None, "cpu", True)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "the tokenizer of the --teacher" in err and tok in err, err
    moved = str(tmp_path / "moved")
    shutil.copytree(tiny_llama, moved)
    start.check_same_tokenizer("--tokenizer", moved, "the tokenizer of --init_from", tiny_llama)  # no exit: the same


def test_a_run_records_its_tokenizer_where_it_is_and_never_exports_over_it(tiny_llama, tmp_path, capsys):
    """The command typed with a relative path: the checkpoint records the model's absolute path and fingerprint,
    so sample.py reads it from any directory. An export never replaces the model the run reads its tokenizer
    from, with or without --overwrite. When the model moves, sample.py and --resume name the missing model, and
    --resume --tokenizer=<where it is now> continues (the same vocabulary, by fingerprint)."""
    import shutil
    import subprocess
    import sys
    import torch
    import sample
    from conftest import ROOT
    from tools import export, prepare
    src, shards = tmp_path / "model", str(tmp_path / "shards")
    shutil.copytree(tiny_llama, src)
    prepare.prepare([_small_jsonl(tmp_path / "c.jsonl")], tokenizer=str(src), out_dir=shards)
    out = f"--out_dir={tmp_path / 'run'}"
    typed = os.path.relpath(src, ROOT)  # run() starts train.py in the repository
    run("--stage=2", f"--init_from={typed}", "--max_iters=2", "--eval_interval=2", f"--data={shards}", *FLAGS, out)
    ckpt = str(tmp_path / "run" / "stage2" / "ckpt.pt")
    config = torch.load(ckpt, weights_only=True)["config"]
    assert config["tokenizer"] == str(src)
    from tokenizer import fingerprint, get_tokenizer
    assert config["tokenizer_fingerprint"] == fingerprint(get_tokenizer(str(src)))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--ckpt={ckpt}", "--num_samples=1",
                        "--max_new_tokens=4", "--device=cpu"], cwd=str(tmp_path), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]  # from another directory
    before = sorted(os.listdir(src))
    for overwrite in ([], ["--overwrite=True"]):
        msg = fails(capsys, f"--ckpt={ckpt}", "--format=hf", f"--out={src}", *overwrite, code=2, main=export.main)
        assert "the run's tokenizer" in msg and str(src) in msg and "not even with --overwrite=True" in msg, msg
    assert sorted(os.listdir(src)) == before
    moved = tmp_path / "moved"
    src.rename(moved)
    msg = fails(capsys, f"--ckpt={ckpt}", "--device=cpu", main=sample.main)
    assert str(src) in msg and "not there" in msg and "not written by train.py" not in msg, msg
    msg = fails(capsys, "--stage=2", "--resume=True", "--max_iters=3", *FLAGS, out, code=2)
    assert str(src) in msg and "not there" in msg and "--tokenizer=" in msg, msg
    other = _bpe(tmp_path / "other", 384, slice(5, 10))  # the same size, another vocabulary
    msg = fails(capsys, "--stage=2", "--resume=True", "--max_iters=3", f"--tokenizer={other}", *FLAGS, out, code=2)
    assert f"--tokenizer={other} is not the tokenizer" in msg and "fingerprint" in msg, msg
    run("--stage=2", "--resume=True", "--max_iters=3", "--eval_interval=3", f"--tokenizer={moved}", *FLAGS, out)
    assert records(str(tmp_path / "run"))[-1]["step"] == 3


def test_shards_of_another_vocabulary_at_the_same_path_are_refused(tmp_path, capsys):
    """meta.json records the tokenizer's fingerprint: a run whose --tokenizer names the path the shards were made
    with, where another tokenizer now is, stops before training on ids of another vocabulary."""
    import shutil
    from tools import loaders, prepare
    from tools.checks import build_config
    tok, shards = _bpe(tmp_path / "tok", 384, slice(0, 5)), str(tmp_path / "shards")
    prepare.prepare([_small_jsonl(tmp_path / "c.jsonl")], tokenizer=tok, out_dir=shards)
    cfg = build_config({"stage": 2, "tokenizer": tok, "data": shards, "device": "cpu"})
    assert loaders.resolve_data(cfg) == {shards: 1.0}
    shutil.rmtree(tok)
    _bpe(tmp_path / "tok", 384, slice(5, 10))  # another vocabulary of the same size at the same path
    import tokenizer
    tokenizer._tokenizers.pop(tok)  # a new process would load it afresh
    with pytest.raises(SystemExit):
        loaders.resolve_data(cfg)
    err = capsys.readouterr().err
    assert "was tokenised with" in err and "fingerprint" in err and tok in err, err


def test_a_model_whose_tokenizer_or_context_does_not_fit_is_one_error_line_naming_the_flag(tiny_llama, tmp_path,
                                                                                            capsys):
    """train.py loads the model's tokenizer before anything else: a directory without tokenizer files, a damaged
    config.json, a GGUF transformers cannot read (here a text file; our own bitnet export is another) as
    --init_from or --teacher are one line naming the flag. A --block_size past the model's max_position_embeddings
    (256) is refused for the student's start and for the teacher alike. Nothing is written."""
    notok, broken = tmp_path / "notok", tmp_path / "broken"
    for d in (notok, broken):
        d.mkdir()
        for name in os.listdir(tiny_llama):
            if d == broken or not name.startswith("tokenizer"):
                (d / name).write_bytes(open(os.path.join(tiny_llama, name), "rb").read())
    (broken / "config.json").write_text("")
    (tmp_path / "text.gguf").write_text("not a GGUF\n")
    out = f"--out_dir={tmp_path / 'o'}"
    for flag, source in (("--init_from", notok), ("--init_from", broken), ("--teacher", tmp_path / "text.gguf")):
        stage = "--stage=3" if flag == "--teacher" else "--stage=2"
        msg = fails(capsys, stage, f"{flag}={source}", *FLAGS, out, code=2)
        assert msg.startswith(f"error: {flag}={source}: "), msg
    msg = fails(capsys, "--stage=2", f"--init_from={tiny_llama}", *FLAGS, "--block_size=512", out, code=2)
    assert "max_position_embeddings = 256" in msg and "--block_size=256" in msg, msg
    run("--stage=2", f"--init_from={tiny_llama}", "--max_iters=2", "--eval_interval=2", *FLAGS,
        f"--out_dir={tmp_path / 's'}")
    os.link(tmp_path / "s" / "stage2" / "ckpt.pt", tmp_path / "student.pt")  # a ternary student, for stage 3
    msg = fails(capsys, "--stage=3", f"--init_from={tmp_path / 'student.pt'}", f"--teacher={tiny_llama}", *FLAGS,
                "--block_size=512", out, code=2)
    # the student began from that model too: its own start is refused first (start.adopt_architecture reads the
    # model's context from its config), naming the context
    assert "--block_size=512" in msg and "256 positions, its max_position_embeddings" in msg, msg
    assert not any(os.path.exists(tmp_path / "o" / d / "ckpt.pt") for d in ("stage2", "stage3"))


def test_calibration_batches_come_from_a_loader_of_their_own():
    """--subln_gain=calibrated measures on the first batches of a fresh sequential loader over the run's data; the
    run's own loader is untouched (its first training batch is still the one it would have given)."""
    import numpy as np
    from types import SimpleNamespace

    import data
    from tools import start
    shards = os.path.join(ROOT, "data", "shakespeare_byte")
    make = lambda order: data.DataLoader({shards: 1.0}, "train", 4, 32, seed=1, order=order)  # noqa: E731
    run_loader, fresh = make("shuffle"), make("shuffle")
    before = run_loader.state_dict()
    got = start.calibration_batches(SimpleNamespace(batch_size=4, block_size=32), run_loader, n=3)
    sequential = make("sequential")
    for x, y in got:
        want = sequential.next_batch()
        assert torch.equal(x, want[0]) and torch.equal(y, want[1])
    after = run_loader.state_dict()
    assert after["cursor"] == before["cursor"] and np.array_equal(after["rng"]["state"]["state"],
                                                                  before["rng"]["state"]["state"])
    assert all(torch.equal(a, b) for a, b in zip(run_loader.next_batch(), fresh.next_batch()))


def test_a_resume_of_a_moved_model_reads_the_shipped_shards_it_was_reading():
    """--resume=True --tokenizer=<the model at its new path> on a shipped corpus: the shards the run read are
    named for the model's old path, so the run's --data becomes those directories (the loader state's, in
    order, with their weights) and its note says so; --data given, or sources that are not shipped corpora,
    are left as they are."""
    from types import SimpleNamespace
    from conftest import ROOT
    from tools import start
    data_dir = os.path.join(ROOT, "data")
    ckpt = {"config": {"tokenizer": "/old/place/model", "data": "shakespeare:0.75,python:0.25"},
            "loader": {"dirs": ["shakespeare_byte", "python_byte"]}}  # shipped corpora's directories
    cfg = SimpleNamespace(tokenizer="/new/place/model", data="")
    note = start.shipped_of_moved_model(cfg, ckpt, given={"tokenizer": cfg.tokenizer})
    want = f"{data_dir}/shakespeare_byte:0.75,{data_dir}/python_byte:0.25"
    assert cfg.data == want and f"--data={want}" in note and "/old/place/model" in note, note
    ckpt["config"]["data"] = "shakespeare"
    ckpt["loader"]["dirs"] = ["shakespeare_byte"]
    cfg = SimpleNamespace(tokenizer="/new/place/model", data="")
    assert start.shipped_of_moved_model(cfg, ckpt, {}) and cfg.data == f"{data_dir}/shakespeare_byte"
    for given, dirs in (({"data": "shakespeare"}, ["shakespeare_byte"]), ({}, ["my_shards"])):
        cfg = SimpleNamespace(tokenizer="/new/place/model", data="")
        ckpt["loader"]["dirs"] = dirs
        assert start.shipped_of_moved_model(cfg, ckpt, given) == "" and cfg.data == ""
