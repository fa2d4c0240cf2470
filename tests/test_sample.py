"""
Tests for sample.py's refusals: a bad flag or a bad file gives one "error: ..." line on stderr naming the
flag or file and the fix, and a non-zero exit (2 for a flag value, 1 for a file), never a traceback. Flags
are checked before any checkpoint is read: the flag cases point --ckpt at a file that does not exist.
Sampling itself (a training checkpoint, --packed=True, an export) is tested end to end in tests/test_packed.py.

    python -m pytest tests/test_sample.py
"""

import dataclasses
import errno
import glob
import json
import os

import pytest
import torch

from tools import export
import sample
from conftest import fails
from kernels.packed_linear import freeze_ternary
from model import GPT, GPTConfig

TINY = GPTConfig(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_embd=32)  # the byte tokenizer's vocabulary
MISSING = "/nonexistent/ckpt.pt"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A training checkpoint as train.py writes it (the keys sample.py reads) and a packed export, both of TINY."""
    d = tmp_path_factory.mktemp("sample")
    torch.manual_seed(0)
    model = GPT(TINY)
    torch.save({"step": 0, "model_args": dataclasses.asdict(TINY), "model": model.state_dict(),
                "config": {"tokenizer": "byte"}}, d / "ckpt.pt")
    torch.save(export.packed_state(freeze_ternary(model.eval()), "byte"), d / "packed.pt")
    return d


FLAG_REFUSALS = {  # argv (--ckpt is MISSING), facts in the error line; all exit 2
    "top_k-0": (["--top_k=0"], ["--top_k=0", ">= 1"]),
    "top_k-negative": (["--top_k=-1"], ["--top_k=-1", ">= 1"]),
    "temperature-nan": (["--temperature=nan"], ["--temperature=nan", "finite", "> 0", "--top_k=1"]),
    "temperature-inf": (["--temperature=inf"], ["--temperature=inf", "finite", "> 0"]),
    "temperature-negative": (["--temperature=-5"], ["--temperature=-5", "> 0", "--top_k=1"]),
    "temperature-0": (["--temperature=0"], ["--temperature=0", "> 0", "greedy", "--top_k=1"]),
    "temperature-tiny": (["--temperature=1e-39"], ["--temperature=1e-39", "at least 1e-06", "--top_k=1"]),
    "temperature-below-the-floor": (["--temperature=9e-7"], ["--temperature=9e-07", "at least 1e-06"]),
    "max_new_tokens-negative": (["--max_new_tokens=-5"], ["--max_new_tokens=-5", ">= 1"]),
    "num_samples-0": (["--num_samples=0"], ["--num_samples=0", ">= 1"]),
    "seed-negative": (["--seed=-1"], ["--seed=-1", ">= 0"]),
    "remasking-unknown": (["--remasking=lowest"], ["--remasking=lowest", "random or low_confidence"]),
    "device-unknown": (["--device=tpu"], ["--device=tpu", "auto, cpu, cuda"]),
    "start-not-utf8": (["--start=\udcff"], ["--start", "UTF-8"]),  # an undecodable byte in argv
    "top_k-not-an-int": (["--top_k=many"], ["--top_k=many", "int"]),
    "packed-not-a-bool": (["--packed=maybe"], ["--packed=maybe", "true or false"]),
    "decode-unknown": (["--decode=fast"], ["--decode=fast", "auto, eager, fixed, graph, compile"]),
    "decode-graph-on-cpu": (["--decode=graph", "--device=cpu"], ["--decode=graph", "CUDA", "--decode=eager"]),
    "unknown-flag": (["--bogus=1"], ["'--bogus=1'", "ckpt, start"]),
    "no-value": (["--top_k"], ["--top_k", "value"]),  # tools/flags.py's wording (tests/test_flags.py pins it)
}


@pytest.mark.parametrize("case", FLAG_REFUSALS)
def test_bad_flag_is_one_line_exit_2_before_any_checkpoint_is_read(case, capsys):
    argv, facts = FLAG_REFUSALS[case]
    err = fails(capsys, f"--ckpt={MISSING}", *argv, code=2, main=sample.main)
    assert all(f in err for f in facts), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(capsys):
    err = fails(capsys, f"--ckpt={MISSING}", "--device=cuda", code=2, main=sample.main)
    assert all(f in err for f in ("--device=cuda", "no CUDA device", "--device=cpu")), err


@pytest.mark.parametrize("device,current", [("cuda:1", [1]), ("cuda", []), ("auto", [])])
def test_a_cuda_device_is_made_current_before_the_checkpoint_loads(monkeypatch, device, current):
    """--device=cuda:1: Triton kernels and CUDA graphs run on the current device, so sample.py makes cuda:1 current
    (torch.cuda.set_device, run as it is down to the driver call) before it loads anything; --device=cuda and auto
    (the default on a GPU) use the current device as it is (torch.cuda.set_device("cuda") raises: no index). A
    two-GPU machine is faked: CUDA present, two devices."""
    made = []

    class Loaded(Exception):
        pass

    def load_model(ckpt, dev, packed):
        assert dev == ("cuda" if device == "auto" else device)
        raise Loaded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", made.append, raising=False)
    monkeypatch.setattr(sample, "load_model", load_model)
    with pytest.raises(Loaded):
        sample.main([f"--ckpt={MISSING}", f"--device={device}"])
    assert made == current


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:0:1", "cuda:99"])
def test_sample_and_train_refuse_a_device_in_the_same_line(device, capsys, tmp_path):
    """One device rule for both commands (tools/runtime.check_device): the same error line, naming the flag."""
    said = fails(capsys, f"--ckpt={MISSING}", f"--device={device}", code=2, main=sample.main)
    assert said == fails(capsys, f"--device={device}", f"--out_dir={tmp_path}", code=2)
    assert f"--device={device}" in said


def test_sample_runs_on_the_test_files(files, capsys):
    """The files below are sound: what the refusals break is only what each case changes."""
    for name in ("ckpt.pt", "packed.pt"):
        sample.main([f"--ckpt={files / name}", "--max_new_tokens=3", "--num_samples=1", "--device=cpu"])
        assert capsys.readouterr().out.count("---------------") == 1


def test_start_file_reads_the_prompt_from_a_file_as_nanogpt_does(files, tmp_path, capsys):
    """--start=FILE:prompt.txt (nanoGPT's) was taken as the literal prompt "FILE:prompt.txt": it is the file's
    text, the same samples as the text given inline; a missing or non-UTF-8 file is one line, exit 2."""
    (tmp_path / "p.txt").write_bytes("ROMEO: é\n".encode())
    argv = [f"--ckpt={files / 'ckpt.pt'}", "--max_new_tokens=5", "--num_samples=1", "--device=cpu", "--seed=3"]
    sample.main([*argv, f"--start=FILE:{tmp_path / 'p.txt'}"])
    from_file = capsys.readouterr().out
    sample.main([*argv, "--start=ROMEO: é\n"])
    assert from_file == capsys.readouterr().out and from_file.startswith("ROMEO: é\n")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    for path, fact in ((tmp_path / "none.txt", "cannot read"), (tmp_path / "bad.txt", "not UTF-8")):
        err = fails(capsys, *argv, f"--start=FILE:{path}", code=2, main=sample.main)
        assert f"--start=FILE:{path}" in err and fact in err, err


def test_a_packed_export_of_an_earlier_run_than_the_checkpoint_beside_it_is_said(files, tmp_path, capsys):
    """After train.py --overwrite=True the old packed.pt stayed beside the new ckpt.pt and sample.py sampled the
    earlier model without a word: a note names both runs and the re-export; the same run, or a packed file alone or
    of an unknown run, samples without one."""
    from tools.checkpoint import RUN_ID
    from tools.outputs import SOURCE_RUN
    ck = torch.load(files / "ckpt.pt", weights_only=True)
    packed = torch.load(files / "packed.pt", weights_only=True)
    argv = [f"--ckpt={tmp_path / 'packed.pt'}", "--max_new_tokens=2", "--num_samples=1", "--device=cpu"]
    for made, now, said in (("aaaa", "bbbb", True), ("aaaa", "aaaa", False), (None, "bbbb", False)):
        torch.save({**packed, **({SOURCE_RUN: made} if made else {})}, tmp_path / "packed.pt")
        torch.save({**ck, "config": {**ck["config"], RUN_ID: now}}, tmp_path / "ckpt.pt")
        sample.main(argv)
        err = capsys.readouterr().err
        assert ("was exported from an earlier run" in err and "run aaaa, not bbbb" in err
                and "--overwrite=True" in err) == said, (made, now, err)


def _truncated(d, files):
    data = (files / "ckpt.pt").read_bytes()
    (d / "ckpt.pt").write_bytes(data[: len(data) // 2])


def _mismatched_export(d, files):  # a gpt2-sized vocabulary under the byte tokenizer
    obj = torch.load(files / "packed.pt", weights_only=True)
    obj["model_args"]["vocab_size"] = 50257
    torch.save(obj, d / "ckpt.pt")


def _unknown_tokenizer(d, files):
    obj = torch.load(files / "ckpt.pt", weights_only=True)
    obj["config"]["tokenizer"] = "sentencepiece"
    torch.save(obj, d / "ckpt.pt")


def _directory(d, files):
    (d / "ckpt.pt").mkdir()


FILE_REFUSALS = {  # how to spoil {d}/ckpt.pt, exit code, facts in the error line
    "truncated-checkpoint": (_truncated, 1, ["{d}/ckpt.pt", "cannot load checkpoint", "corrupt or truncated"]),
    "export-tokenizer-does-not-fit-vocabulary": (_mismatched_export, 1, ["{d}/ckpt.pt", "'byte'", "257", "50257",
                                                                         "python -m tools.export"]),
    "unknown-tokenizer": (_unknown_tokenizer, 1, ["{d}/ckpt.pt", "'sentencepiece'", "byte, gpt2"]),
    "ckpt-is-a-directory": (_directory, 2, ["--ckpt={d}/ckpt.pt", "directory", "{d}/ckpt.pt/ckpt.pt"]),
}


@pytest.mark.parametrize("case", FILE_REFUSALS)
def test_bad_checkpoint_file_is_one_line_naming_the_file(case, files, tmp_path, capsys):
    spoil, code, facts = FILE_REFUSALS[case]
    spoil(tmp_path, files)
    err = fails(capsys, f"--ckpt={tmp_path / 'ckpt.pt'}", "--device=cpu", "--max_new_tokens=3", code=code,
                main=sample.main)
    assert all(f.format(d=tmp_path) in err for f in facts), err


def test_teacher_written_corpus_shards_and_mixes_into_the_loader(files, tmp_path):
    # sample.write_corpus -> tools/prepare.py -> a second source the mixing loader reads beside the first
    import data
    from tools import prepare
    model, tok = sample.load_model(str(files / "ckpt.pt"), "cpu")
    torch.manual_seed(0)
    path = str(tmp_path / "teacher.jsonl")
    chars = sample.write_corpus(model, tok, path, num_samples=40, max_new_tokens=30, temperature=1.0, batch_size=16)
    lines = [json.loads(line)["text"] for line in open(path)]
    assert len(lines) == 40 and sum(map(len, lines)) == chars and chars > 0
    assert not glob.glob(path + "*.tmp")
    prepare.prepare([path], tokenizer="byte", out_dir=str(tmp_path / "shards"))
    mine = str(tmp_path / "mine")
    os.makedirs(mine)
    data.write_shard(os.path.join(mine, "train_000.bin"), [7] * 5000)  # all 7s: easy to tell
    data.write_shard(os.path.join(mine, "val_000.bin"), [7] * 500)
    with open(os.path.join(mine, "meta.json"), "w") as f:
        json.dump({"tokenizer": "byte", "vocab_size": 257, "eot": 256}, f)
    loader = data.DataLoader({mine: 0.5, str(tmp_path / "shards"): 0.5}, "train", 8, 8, seed=1)
    rows = torch.cat([loader.next_batch()[0] for _ in range(10)])  # (80, 8)
    teacher_rows = (rows != 7).any(1).float().mean().item()
    assert 0.3 < teacher_rows < 0.7  # about half the rows come from the teacher's text



def test_a_full_disk_while_writing_jsonl_is_one_line_and_keeps_the_old_file(files, tmp_path, capsys, monkeypatch):
    """--jsonl on a disk that fills mid-write: one error line naming the flag and the disk, exit 1, no traceback;
    the file there before is unchanged and no temporary file is left."""
    from conftest import fails
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "kept"}\n')
    real = json.dumps

    def dumps_then_fill(obj, *a, **k):
        if isinstance(obj, dict) and "text" in obj:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, *a, **k)
    monkeypatch.setattr(sample.json, "dumps", dumps_then_fill)
    msg = fails(capsys, f"--ckpt={files / 'ckpt.pt'}", "--device=cpu", "--num_samples=2", "--max_new_tokens=4",
                f"--jsonl={path}", "--overwrite=True", main=sample.main)
    assert msg.startswith(f"error: --jsonl={path}: cannot write it (No space left on device); the disk holding"), msg
    assert path.read_text() == '{"text": "kept"}\n' and os.listdir(tmp_path) == ["t.jsonl"]

def _greedy(model, ids, n):
    """n tokens of greedy decoding, computed here with full forwards (no KV cache): ids + continuation, a list."""
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            idx = torch.cat([idx, model(idx)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[0].tolist()


def test_temperature_near_zero_samples_the_greedy_continuation(files, tmp_path, capsys):
    """--temperature divides the logits before sampling, so at 1e-6 every draw is the argmax: what sample.py prints,
    and each document --jsonl writes (cut at its first end-of-text), is the greedy continuation computed here. (At
    temperature 1 this random model's near-flat logits give other text.)"""
    model, tok = sample.load_model(str(files / "ckpt.pt"), "cpu")
    row = _greedy(model, [tok.eot] + tok.encode("\n"), 10)[1:]  # what sample.py decodes: the prompt's eot dropped
    flags = [f"--ckpt={files / 'ckpt.pt'}", "--max_new_tokens=10", "--device=cpu", "--temperature=1e-6", "--top_k=257"]
    sample.main([*flags, "--num_samples=1"])
    assert capsys.readouterr().out == tok.decode(row) + "\n---------------\n"
    sample.main([*flags, "--num_samples=2", f"--jsonl={tmp_path / 't.jsonl'}"])
    text = tok.decode(row[:row.index(tok.eot)] if tok.eot in row else row)
    assert [json.loads(line)["text"] for line in open(tmp_path / "t.jsonl")] == [text, text]


def test_every_cpu_decode_mode_prints_the_greedy_continuation(files, capsys):
    """sample.py decodes from tools/decode.py's static cache: --decode=eager (the CPU default) and fixed (the step a
    CUDA graph captures, run eagerly) print the greedy continuation of full forwards, past block_size (16)."""
    model, tok = sample.load_model(str(files / "ckpt.pt"), "cpu")
    row = _greedy_cropped(model, [tok.eot] + tok.encode("\n"), 24, 16)[1:]
    for mode in ("auto", "eager", "fixed"):
        sample.main([f"--ckpt={files / 'ckpt.pt'}", "--max_new_tokens=24", "--device=cpu", "--top_k=1",
                     "--num_samples=1", f"--decode={mode}"])
        assert capsys.readouterr().out == tok.decode(row) + "\n---------------\n", mode


def _greedy_cropped(model, ids, n, block_size):
    """_greedy with the context cropped to the last block_size tokens, as model.generate crops it."""
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            idx = torch.cat([idx, model(idx[:, -block_size:])[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[0].tolist()


@pytest.fixture(scope="module")
def dlm_ckpt(files):
    """TINY's checkpoint made a masked-diffusion model (dlm.add_mask_token, as train.py --stage=dlm saves it): the
    path of its checkpoint (block_size 16), the model and its mask id."""
    from lessons import dlm
    model, _ = sample.load_model(str(files / "ckpt.pt"), "cpu")
    m, mask_id = dlm.add_mask_token(model)
    torch.save({"step": 0, "model_args": dataclasses.asdict(m.config), "model": m.state_dict(),
                "config": {"tokenizer": "byte", "dlm_shift": True}}, files / "dlm.pt")
    return files / "dlm.pt", m.eval(), mask_id


def test_dlm_sampling_temperature_goes_from_greedy_to_near_uniform(dlm_ckpt, capsys):
    """sample.py --dlm=True in one step (every mask committed at once): at --temperature=1e-6 it fills in the
    per-position argmax, dlm.generate's greedy fill; at 100 the draws are nearly uniform over 257 tokens, and 10 of
    them matching the argmax would happen with probability about 257^-10."""
    from lessons import dlm
    from tokenizer import get_tokenizer
    path, m, mask_id = dlm_ckpt
    tok = get_tokenizer("byte")
    prompt = torch.tensor([[tok.eot] + tok.encode("\n")])
    greedy = tok.decode(dlm.generate(m, prompt, 10, 1, mask_id, shift=True)[0, 1:].tolist())
    outs = {}
    for t in ("1e-6", "100"):
        sample.main([f"--ckpt={path}", "--dlm=True", "--steps=1", "--max_new_tokens=10",
                     "--num_samples=1", "--device=cpu", f"--temperature={t}", "--top_k=258"])
        outs[t] = capsys.readouterr().out
    assert outs["1e-6"] == greedy + "\n---------------\n"
    assert outs["100"] != outs["1e-6"]


def test_dlm_max_new_tokens_past_the_context_is_refused_naming_the_largest_that_fits(dlm_ckpt, capsys, monkeypatch):
    """--dlm=True --max_new_tokens past the context is refused, not cut short without a word. Prompt and
    continuation share one context (block_size 16 here; the prompt "\n" after end-of-text is 2 tokens): 14 is
    generated in full, 15 or 1000 is one line naming --max_new_tokens and 14."""
    from lessons import dlm
    path = dlm_ckpt[0]
    flags = [f"--ckpt={path}", "--dlm=True", "--num_samples=1", "--device=cpu", "--steps=2"]
    for n in (15, 1000):
        err = fails(capsys, *flags, f"--max_new_tokens={n}", code=2, main=sample.main)
        assert all(f in err for f in (f"--max_new_tokens={n}", "block_size 16", "--max_new_tokens=14")), err
    lengths, real = [], dlm.generate
    monkeypatch.setattr(dlm, "generate", lambda model, x, gen_len, *a, **k: lengths.append(gen_len) or real(
        model, x, gen_len, *a, **k))
    sample.main([*flags, "--max_new_tokens=14"])
    assert lengths == [14] and capsys.readouterr().out.count("---------------") == 1


def test_a_gguf_or_an_hf_export_as_ckpt_says_what_it_is_and_which_program_reads_it(files, tmp_path, capsys):
    """A GGUF file, an HF export directory, model.safetensors or nanobitnet.json given as --ckpt is named for what
    it is, not called "corrupt or truncated" (nor "a directory")."""
    ckpt = str(files / "ckpt.pt")
    model, _ = sample.load_model(ckpt, "cpu")
    capsys.readouterr()
    gguf, hf = str(tmp_path / "model.gguf"), str(tmp_path / "hf")
    export.write_gguf(model, "byte", gguf, source=ckpt)
    export.write_hf(model, "byte", hf, source=ckpt)
    for path, facts in ((gguf, ["GGUF", "llama.cpp"]), (hf, ["HF export directory", "from_pretrained"]),
                        (os.path.join(hf, "model.safetensors"), ["HF export directory", "from_pretrained"]),
                        (os.path.join(hf, "nanobitnet.json"), ["HF export directory", "from_pretrained"])):
        err = fails(capsys, f"--ckpt={path}", "--device=cpu", "--max_new_tokens=3", code=2, main=sample.main)
        assert f"--ckpt={path}" in err and all(f in err for f in facts) and ckpt in err and "corrupt" not in err, err
        err = fails(capsys, f"--ckpt={path}", f"--out={tmp_path / 'p.pt'}", code=2, main=export.main)
        assert f"--ckpt={path}" in err and facts[0] in err, err


def test_dlm_refuses_jsonl_and_decode_in_one_line(capsys, tmp_path):
    """--dlm=True fills masks with lessons/dlm.py: --jsonl (which it never wrote) and --decode (which it never used)
    are refused before anything is read, not dropped."""
    for flag in (f"--jsonl={tmp_path / 'x.jsonl'}", "--decode=fixed"):
        msg = fails(capsys, "--dlm=True", flag, code=2, main=sample.main)
        assert flag.split("=")[0] in msg and "masked-diffusion" in msg, msg
    assert not os.path.exists(tmp_path / "x.jsonl")
