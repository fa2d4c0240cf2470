"""No output path eats a checkpoint: tools/export.py --out and sample.py --jsonl refuse a file that is a checkpoint,
an average or another kind of file (even with --overwrite=True), and another checkpoint's export unless
--overwrite=True (tools/outputs.py check_output); what the exports write for a masked-diffusion or a
full-precision model. Run: python -m pytest tests/test_outputs.py"""

import glob
import hashlib
import json
import os
import shutil

import pytest
import torch

import sample
from conftest import ROOT, TINY, fails, run
from tools import export, outputs


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """out/stage1 (fp), out/stage2 (ternary, lambda 1), out/dlm (a masked-diffusion conversion of stage 2)."""
    out = str(tmp_path_factory.mktemp("outputs"))
    run("--stage=1", "--max_iters=2", "--eval_interval=2", f"--out_dir={out}", *TINY)
    run("--stage=2", "--max_iters=4", "--eval_interval=4", "--checkpoint_interval=2", "--keep_last=3",
        f"--out_dir={out}", *TINY)
    run("--stage=dlm", "--max_iters=4", "--eval_interval=4", f"--out_dir={out}", *TINY)
    return out


@pytest.mark.slow
def test_an_export_never_lands_on_a_checkpoint_or_an_average(runs, capsys):
    s2 = os.path.join(runs, "stage2", "ckpt.pt")
    s1 = os.path.join(runs, "kept_stage1.pt")  # a checkpoint the stage-2 run does not read (its stage1/ckpt.pt,
    shutil.copy(os.path.join(runs, "stage1", "ckpt.pt"), s1)  # which it does, is refused as its --init_from)
    avg = os.path.join(runs, "stage2", "avg.pt")  # an average as averaging writes it: {"averaged": ..., "model": ...}
    torch.save({"model": torch.load(s2, weights_only=True)["model"], "averaged": {"steps": [2, 4]}}, avg)
    before = {p: _sha(p) for p in (s1, avg)}
    for argv, victim in ([f"--ckpt={s2}", f"--out={s1}"], s1), ([f"--ckpt={s2}", "--format=gguf", f"--out={avg}"], avg):
        for asked in ([], ["--overwrite=True"]):  # another kind of file: not even when asked
            msg = fails(capsys, *argv, *asked, code=2, main=export.main)
            assert victim in msg and "another kind" in msg and ("checkpoint" in msg or "average" in msg), msg
    assert {p: _sha(p) for p in (s1, avg)} == before  # nothing changed
    assert outputs.file_kind(s1)[0] == "checkpoint" and outputs.file_kind(avg)[0] == "average"
    os.remove(avg)
    os.remove(s1)


def test_a_re_export_replaces_its_own_export_but_not_another_checkpoints(runs, capsys, tmp_path):
    s2 = os.path.join(runs, "stage2", "ckpt.pt")
    out = str(tmp_path / "packed.pt")
    export.main([f"--ckpt={s2}", f"--out={out}"])
    export.main([f"--ckpt={s2}", f"--out={out}"])  # the same checkpoint again: fine
    assert outputs.file_kind(out) == ("packed", os.path.abspath(s2))
    other = str(tmp_path / "other.pt")
    shutil.copy(s2, other)
    first = _sha(out)
    msg = fails(capsys, f"--ckpt={other}", f"--out={out}", code=2, main=export.main)
    assert "another checkpoint" in msg and s2 in msg and "--overwrite=True" in msg and _sha(out) == first
    gguf = str(tmp_path / "m.gguf")
    export.main([f"--ckpt={s2}", "--format=gguf", f"--out={gguf}"])
    msg = fails(capsys, f"--ckpt={s2}", "--format=packed", f"--out={gguf}", code=2, main=export.main)  # packed over a GGUF
    assert "GGUF" in msg and "another kind" in msg
    export.main([f"--ckpt={other}", f"--out={out}", "--overwrite=True"])  # asked for: replaced
    assert outputs.file_kind(out) == ("packed", os.path.abspath(other))


def test_a_gguf_export_replaces_its_own_gguf_but_not_another_checkpoints(runs, capsys, tmp_path):
    """--format=gguf refuses to replace another checkpoint's GGUF, as the packed and HF formats do."""
    s2 = os.path.join(runs, "stage2", "ckpt.pt")
    other = str(tmp_path / "other.pt")
    shutil.copy(s2, other)
    gguf = str(tmp_path / "m.gguf")
    export.main([f"--ckpt={s2}", "--format=gguf", f"--out={gguf}"])
    export.main([f"--ckpt={s2}", "--format=gguf", f"--out={gguf}"])  # the same checkpoint again: fine
    assert outputs.file_kind(gguf) == ("gguf", os.path.abspath(s2))
    first = _sha(gguf)
    msg = fails(capsys, f"--ckpt={other}", "--format=gguf", f"--out={gguf}", code=2, main=export.main)
    assert gguf in msg and "another checkpoint" in msg and s2 in msg and "--overwrite=True" in msg, msg
    assert _sha(gguf) == first and not glob.glob(gguf + "*.tmp")
    export.main([f"--ckpt={other}", "--format=gguf", f"--out={gguf}", "--overwrite=True"])  # asked for: replaced
    assert outputs.file_kind(gguf) == ("gguf", os.path.abspath(other))



def test_a_re_export_after_the_run_was_replaced_needs_overwrite(capsys, tmp_path):
    """Exports record the id of the run that wrote their checkpoint (checkpoint.RUN_ID, kept by --resume). A run
    continued with --resume re-exports over its own exports as before; after train.py --overwrite=True replaced
    the run at the same path, its packed, GGUF and HF exports are the earlier run's last remnant: a re-export
    needs --overwrite=True (one line, the export unchanged). (Before: replaced, matched by path alone.)"""
    out = str(tmp_path / "o")
    ckpt = os.path.join(out, "stage2", "ckpt.pt")
    flags = ["--stage=2", "--eval_interval=2", f"--out_dir={out}", *TINY]
    run(*flags, "--max_iters=4")
    first = outputs.checkpoint_run(ckpt)
    assert first and len(first) == 16
    paths = {"packed": os.path.join(out, "stage2", "packed.pt"), "gguf": os.path.join(out, "stage2", "model.gguf"),
             "hf": os.path.join(out, "stage2", "hf")}
    for fmt in paths:
        export.main([f"--ckpt={ckpt}", f"--format={fmt}"])
        assert outputs.export_run(paths[fmt], fmt) == first
    run(*flags, "--max_iters=6", "--resume=True")  # the same run, further on: its id kept
    assert outputs.checkpoint_run(ckpt) == first
    for fmt in paths:
        export.main([f"--ckpt={ckpt}", f"--format={fmt}"])  # replaces its own export, as before
    run(*flags, "--max_iters=4", "--overwrite=True")  # another run in its place
    second = outputs.checkpoint_run(ckpt)
    assert second not in (None, first)
    for fmt, path in paths.items():
        before = _sha(os.path.join(path, "model.safetensors") if fmt == "hf" else path)
        msg = fails(capsys, f"--ckpt={ckpt}", f"--format={fmt}", code=2, main=export.main)
        assert "an earlier run's checkpoint" in msg and "--overwrite=True" in msg, msg
        assert _sha(os.path.join(path, "model.safetensors") if fmt == "hf" else path) == before
        export.main([f"--ckpt={ckpt}", f"--format={fmt}", "--overwrite=True"])  # asked for: replaced
        assert outputs.export_run(path, fmt) == second

def test_sample_jsonl_refuses_a_checkpoint_an_existing_file_and_a_missing_directory(runs, capsys, tmp_path):
    numbered = os.path.join(runs, "stage2", "ckpt_000002.pt")
    before = _sha(numbered)
    ckpt = f"--ckpt={os.path.join(runs, 'stage2', 'ckpt.pt')}"
    small = ["--num_samples=1", "--max_new_tokens=4", "--device=cpu"]
    for asked in ([], ["--overwrite=True"]):  # another kind of file: not even when asked
        msg = fails(capsys, ckpt, f"--jsonl={numbered}", *small, *asked, code=2, main=sample.main)
        assert numbered in msg and "training checkpoint" in msg and _sha(numbered) == before
    missing = str(tmp_path / "no" / "such" / "t.jsonl")
    msg = fails(capsys, ckpt, f"--jsonl={missing}", *small, code=1, main=sample.main)
    assert "does not exist" in msg and "mkdir -p" in msg
    mine = tmp_path / "t.jsonl"
    mine.write_text('{"text": "keep me"}\n')
    msg = fails(capsys, ckpt, f"--jsonl={mine}", *small, code=2, main=sample.main)
    assert "already exists" in msg and mine.read_text() == '{"text": "keep me"}\n'
    sample.main([ckpt, f"--jsonl={mine}", *small, "--overwrite=True"])
    assert len(mine.read_text().splitlines()) == 1 and "keep me" not in mine.read_text()
    json.loads(mine.read_text())


def test_a_diffusion_model_is_refused_as_gguf_and_its_packed_export_samples(runs, capsys, tmp_path):
    d = os.path.join(runs, "dlm", "ckpt.pt")
    msg = fails(capsys, f"--ckpt={d}", "--format=gguf", f"--out={tmp_path / 'd.gguf'}", main=export.main)
    assert "masked-diffusion" in msg and not os.path.exists(tmp_path / "d.gguf")
    packed = str(tmp_path / "dlm_packed.pt")
    export.main([f"--ckpt={d}", f"--out={packed}"])
    assert torch.load(packed, weights_only=True)["dlm_shift"] is True
    capsys.readouterr()
    sample.main([f"--ckpt={packed}", "--dlm=True", "--num_samples=1", "--max_new_tokens=4", "--steps=2",
                 "--device=cpu"])
    assert "---------------" in capsys.readouterr().out


def test_a_full_precision_gguf_says_what_it_wrote(runs, capsys, tmp_path):
    export.main([f"--ckpt={os.path.join(runs, 'stage1', 'ckpt.pt')}", "--format=gguf", f"--out={tmp_path / 'f.gguf'}"])
    out = capsys.readouterr().out
    assert "F32 (a full-precision model: no ternary codes, no gamma)" in out and "F16" not in out and "TQ2_0" not in out


@pytest.mark.parametrize("stop", ["ctrl_c", "sigterm"])
def test_an_export_stopped_midway_leaves_no_tmp_and_the_old_export(runs, capsys, tmp_path, monkeypatch, stop):
    import signal
    s2 = os.path.join(runs, "stage2", "ckpt.pt")
    out = str(tmp_path / "packed.pt")
    export.main([f"--ckpt={s2}", f"--out={out}"])
    before = _sha(out)
    real = torch.save

    def interrupted(obj, f, *args, **kwargs):
        real({"half": torch.zeros(3)}, f)  # a half-written .tmp
        if stop == "ctrl_c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(torch, "save", interrupted)
    code = 128 + (signal.SIGINT if stop == "ctrl_c" else signal.SIGTERM)
    msg = fails(capsys, f"--ckpt={s2}", f"--out={out}", code=code, main=export.main)
    assert ("Ctrl-C" if stop == "ctrl_c" else "SIGTERM") in msg and "unchanged" in msg
    assert _sha(out) == before and not glob.glob(out + "*.tmp")
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler was put back


def _pretrained_run(runs, tmp_path):
    """(model directory, GGUF, checkpoint from the directory, checkpoint from the GGUF): the stage-2 checkpoint
    rewritten as a run converted from a pretrained model (its config names the model as --init_from and tokenizer,
    as tools/start.py saves it). Nothing reads the models before the refusals under test."""
    m = tmp_path / "M"
    m.mkdir()
    (m / "config.json").write_text('{"model_type": "llama"}')
    (m / "tokenizer.json").write_text('{"model": {}}')
    gguf = tmp_path / "src.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    obj = torch.load(os.path.join(runs, "stage2", "ckpt.pt"), weights_only=True)
    made = []
    for src in (m, gguf):
        path = str(tmp_path / f"from_{src.name}.pt")
        torch.save({**obj, "config": {**obj["config"], "init_from": str(src), "tokenizer": str(src)}}, path)
        made.append(path)
    return str(m), str(gguf), *made


@pytest.mark.parametrize("asked", [[], ["--overwrite=True"]])
def test_no_output_lands_on_or_in_what_the_run_reads(runs, capsys, tmp_path, asked):
    """sample.py --jsonl, lab.check_llamacpp --gguf/--out, lab.mask_outliers --out and tools.export --out never
    replace the pretrained model (or its tokenizer.json/config.json) the checkpoint's run was converted from, nor
    write into its directory, not even with --overwrite=True: one line naming what the file is."""
    from lab import check_llamacpp, mask_outliers
    m, gguf, from_m, from_gguf = _pretrained_run(runs, tmp_path)
    files = [os.path.join(m, "config.json"), os.path.join(m, "tokenizer.json"), gguf]
    before = {p: _sha(p) for p in files}
    small = ["--num_samples=1", "--max_new_tokens=4", "--device=cpu"]
    cases = [(sample.main, [f"--ckpt={from_m}", f"--jsonl={m}/tokenizer.json", *small], "the run's tokenizer"),
             (sample.main, [f"--ckpt={from_m}", f"--jsonl={m}/config.json", *small], "the run's tokenizer"),
             (sample.main, [f"--ckpt={from_m}", f"--jsonl={m}/samples.jsonl", *small], "is inside"),
             (check_llamacpp.main, [f"--ckpt={from_gguf}", f"--gguf={gguf}"], "the run's"),
             (check_llamacpp.main, [f"--ckpt={from_m}", f"--gguf={tmp_path}/x.gguf", f"--out={m}/config.json"],
              "the run's tokenizer"),
             (export.main, [f"--ckpt={from_gguf}", "--format=gguf", f"--out={gguf}"], "the run's"),
             (export.main, [f"--ckpt={from_m}", f"--out={m}/packed.pt"], "is inside"),
             (mask_outliers.main, [f"--model={m}", f"--out={m}/config.json"], "--model")]
    for main, argv, said in cases:
        msg = fails(capsys, *argv, *asked, code=2, main=main)
        assert said in msg and "--overwrite=True" in msg, (argv, msg)
    assert {p: _sha(p) for p in files} == before and sorted(os.listdir(m)) == ["config.json", "tokenizer.json"]


def test_overwrite_never_deletes_the_checkpoint_a_run_starts_from(runs, capsys, tmp_path, monkeypatch):
    """train.py --init_from=<a checkpoint of the run in out_dir> --overwrite=True, given or by --init_from=auto
    (stages 2, 3 and dlm): refused before anything is loaded, and the earlier run's files are all still there; --out_dir inside a shard
    directory it reads too, given or the default corpus's."""
    out = str(tmp_path)
    shutil.copytree(os.path.join(runs, "stage2"), os.path.join(out, "stage2"))
    numbered = os.path.join(out, "stage2", "ckpt_000002.pt")
    before = sorted(os.listdir(os.path.join(out, "stage2")))
    for init in (numbered, os.path.join(out, "stage2", "ckpt.pt")):
        msg = fails(capsys, "--stage=2", f"--init_from={init}", f"--out_dir={out}", "--overwrite=True", *TINY, code=2)
        assert init in msg and "--overwrite=True would delete" in msg, msg
    assert sorted(os.listdir(os.path.join(out, "stage2"))) == before
    shards = os.path.join(out, "shards")
    shutil.copytree(os.path.join(ROOT, "data", "shakespeare_byte"), shards)
    msg = fails(capsys, "--stage=1", f"--data={shards}", f"--out_dir={shards}/runs", *TINY, code=2)
    assert "is inside the run's --data shards" in msg, msg
    # --init_from=auto names the previous stage's ckpt.pt: a stage-2 run into that stage-1 directory
    # (--run_name=stage1) with --overwrite=True would delete the checkpoint it starts from
    shutil.copytree(os.path.join(runs, "stage1"), os.path.join(out, "stage1"))
    before = sorted(os.listdir(os.path.join(out, "stage1")))
    msg = fails(capsys, "--stage=2", f"--out_dir={out}", "--run_name=stage1", "--overwrite=True", *TINY, code=2)
    assert os.path.join(out, "stage1", "ckpt.pt") in msg and "--overwrite=True would delete" in msg, msg
    assert sorted(os.listdir(os.path.join(out, "stage1"))) == before
    # stage 3's default --teacher (stage1/ckpt.pt) likewise
    msg = fails(capsys, "--stage=3", f"--out_dir={out}", "--run_name=stage1", "--overwrite=True", *TINY, code=2)
    assert "--teacher" in msg and "--overwrite=True would delete" in msg, msg
    assert sorted(os.listdir(os.path.join(out, "stage1"))) == before
    # and --stage=dlm's, the stage-2 checkpoint it converts (--run_name=stage2)
    before = sorted(os.listdir(os.path.join(out, "stage2")))
    msg = fails(capsys, "--stage=dlm", f"--out_dir={out}", "--run_name=stage2", "--overwrite=True", *TINY, code=2)
    assert os.path.join(out, "stage2", "ckpt.pt") in msg and "--overwrite=True would delete" in msg, msg
    assert sorted(os.listdir(os.path.join(out, "stage2"))) == before
    # the default --data (the shipped corpus's shards, data/shakespeare_byte, here under a stand-in root) is an
    # input too: no run writes into it
    from tools import loaders
    monkeypatch.setattr(loaders, "ROOT", out)
    os.makedirs(os.path.join(out, "data", "shakespeare_byte"))
    msg = fails(capsys, "--stage=1", f"--out_dir={out}/data", "--run_name=shakespeare_byte", "--max_iters=1", *TINY,
                code=2)
    assert "the run's --data shards" in msg and os.path.join(out, "data", "shakespeare_byte") in msg, msg


def _gguf(path, source=None):
    """A GGUF holding only its header: ours names the checkpoint it came from (outputs.GGUF_SOURCE)."""
    import gguf
    w = gguf.GGUFWriter(path, "bitnet" if source else "llama")
    if source:
        w.add_string(outputs.GGUF_SOURCE, source)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_each_file_that_is_no_starting_checkpoint_is_named_with_what_to_pass(tmp_path, capsys):
    """Issue 50 case 15: where a checkpoint is read, each file is named for what it is, with the fix: a ternary
    checkpoint into stage 1, a packed export or a masked-diffusion checkpoint as --init_from, our bitnet GGUF as
    --init_from, a pretrained GGUF or model directory as --ckpt, a model directory without tokenizer files."""
    import train
    src = str(tmp_path / "run" / "ckpt.pt")
    files = {"ternary.pt": {"model_args": {"quant": True}, "model": {}},
             "packed.pt": {"format": export.FORMAT, "model_args": {}, "source": src},
             "dlm.pt": {"model_args": {"causal": False}, "model": {}}}
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
    ours, theirs = _gguf(str(tmp_path / "ours.gguf"), source=src), _gguf(str(tmp_path / "theirs.gguf"))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    p = lambda n: str(tmp_path / n)
    out = f"--out_dir={tmp_path / 'out'}"
    cases = [  # (main, argv, exit code, words the line holds)
        (train.main, ["--stage=1", f"--init_from={p('ternary.pt')}", out, *TINY], 2,
         ["ternary", "stage 1 trains the full-precision", f"--stage=2 --init_from={p('ternary.pt')}"]),
        (train.main, ["--stage=2", f"--init_from={p('packed.pt')}", out, *TINY], 2,
         ["is a packed export", f"--init_from={src}"]),
        (train.main, ["--stage=2", f"--init_from={p('dlm.pt')}", out, *TINY], 2,
         ["masked-diffusion", "--dlm=True", "causal checkpoint it was converted from"]),
        (train.main, ["--stage=2", f"--init_from={ours}", out, *TINY], 2,
         ["is a GGUF file (tools/export.py", f"exported from ({src})"]),
        (sample.main, [f"--ckpt={theirs}", "--device=cpu"], 2,
         ["pretrained model as published (a GGUF file", f"--init_from={theirs}"]),
        (sample.main, [f"--ckpt={model_dir}", "--device=cpu"], 2,
         ["pretrained model as published (a Hugging Face model directory", f"--init_from={model_dir}"]),
        (train.main, ["--stage=2", f"--tokenizer={model_dir}", out, *TINY], 2,
         ["has no tokenizer files", "copy them in"]),
    ]
    for main, argv, code, words in cases:
        line = fails(capsys, *argv, code=code, main=main)
        assert all(w in line for w in words), (words, line)
        assert "does not fit" not in line and "missing model" not in line and "transformers cannot" not in line
    assert not os.path.exists(tmp_path / "out" / "stage2" / "ckpt.pt")
