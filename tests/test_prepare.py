"""Tests for tools/prepare.py: reading a corpus, the train/val split by document, shards on disk,
the command line.
Run: python -m pytest tests/test_prepare.py"""

import errno
import gzip
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import data
from tokenizer import get_tokenizer
from tools import atomic, prepare
from conftest import ENV, ROOT

DOCS_TXT = "First document.\nIt has two lines.\n"
# "" is skipped
DOCS_JSONL = ["Second: jsonl line one.", "Third \u2014 with a dash.", "", "Fourth."]
DOCS_GZ = ["Fifth, from gzip.", "Sixth: caf\u00e9.", "Seventh and last."]
DOCS = [DOCS_TXT] + [d for d in DOCS_JSONL if d] + DOCS_GZ  # 7 documents in source order


def _write_corpus(tmp_path):
    """Writes a.txt, b.jsonl, c.jsonl.gz; returns the directory."""
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    (d / "a.txt").write_text(DOCS_TXT, encoding="utf-8")
    lines = [json.dumps({"text": t, "title": "x"}) for t in DOCS_JSONL]
    # a blank line too
    (d / "b.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n", encoding="utf-8")
    with gzip.open(d / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps({"text": t}) for t in DOCS_GZ))
    return d


def _read_split(out_dir, split):
    names = sorted(n for n in os.listdir(out_dir) if re.fullmatch(rf"{split}_\d+\.bin", n))
    return [data.read_shard(os.path.join(out_dir, n)) for n in names]


@pytest.mark.slow
def test_the_shipped_corpus_gives_the_same_byte_shards_as_before(tmp_path):
    # the repo's measured numbers were trained on these exact shards: tokenisation and the format
    # must not drift
    out = prepare.prepare(tokenizer="byte", out_dir=str(tmp_path / "o"))
    expected = {"train_000.bin": "cb7d1685caca298793faef2b98deb30129de0af34d39a0f9de68cd9d3f217f98",
                "val_000.bin": "75172c9d93f250b5d3cd2d5f4ee899bd12d2d3e0fff1dc6ff0585803f2cfd69a"}
    for name, sha in expected.items():
        with open(os.path.join(out, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sha, name
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    assert prepare.SHAKESPEARE == os.path.join(ROOT, "data", "shakespeare.jsonl.gz") and meta[
        "sources"
    ] == [prepare.SHAKESPEARE]
    assert (meta["n_docs_train"], meta["n_docs_val"], meta["train_tokens"], meta["val_tokens"]) == (
        40, 2, 4_838_935, 218_305)


def test_iter_documents_yields_every_non_empty_document_in_source_order(tmp_path):
    d = _write_corpus(tmp_path)
    paths = [str(d / n) for n in ("a.txt", "b.jsonl", "c.jsonl.gz")]
    assert list(prepare.iter_documents(paths)) == DOCS


def test_read_shard_error_says_how_to_remake_a_prepared_dataset_whose_meta_json_lists_the_sources(
    tmp_path,
):
    d = _write_corpus(tmp_path)
    out = prepare.prepare([str(d / "*")], tokenizer="byte", out_dir=str(tmp_path / "ds"),
                          val_every=3)
    shard = tmp_path / "ds" / "train_000.bin"
    with open(shard, "r+b") as f:
        f.write(bytes(4))  # magic 0
    with pytest.raises(ValueError) as e:
        data.read_shard(str(shard))
    assert str(shard) in str(e.value) and f"python -m tools.prepare --out_dir={out} " in str(
        e.value
    ), str(e.value)
    assert "meta.json" in str(e.value) and data.read_meta(out)["sources"] == [
        str(d / n) for n in ("a.txt", "b.jsonl", "c.jsonl.gz")]


@pytest.mark.parametrize("tokenizer", ["byte", "gpt2"])
def test_prepare_splits_by_document_with_eot_prepended(tmp_path, tokenizer):
    d = _write_corpus(tmp_path)
    tok = get_tokenizer(tokenizer)
    sources = [str(d / "a.txt"), str(d / "b.jsonl"), str(d / "c.*")]  # a glob too
    out = prepare.prepare(sources, tokenizer=tokenizer, out_dir=str(tmp_path / "out"), val_every=3,
                          shard_tokens=16)
    val_idx = [2, 5]  # i % 3 == 2
    expect = {"train": [], "val": []}
    for i, doc in enumerate(DOCS):
        expect["val" if i in val_idx else "train"] += [tok.eot] + tok.encode(doc)
    for split in ("train", "val"):
        shards = _read_split(out, split)
        assert all(len(s) == 16 for s in shards[:-1]) and 0 < len(shards[-1]) <= 16
        assert all(s.dtype == np.uint16 for s in shards)
        np.testing.assert_array_equal(np.concatenate(shards), expect[split])
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    assert meta == dict(meta, tokenizer=tokenizer, vocab_size=tok.vocab_size, eot=tok.eot,
                        dtype="uint16", n_docs_train=5, n_docs_val=2,
                        train_tokens=len(expect["train"]), val_tokens=len(expect["val"]),
                        sources=[str(d / n) for n in ("a.txt", "b.jsonl", "c.jsonl.gz")],
                        train_shards=len(_read_split(out, "train")),
                        val_shards=len(_read_split(out, "val")))
    train = np.concatenate(_read_split(out, "train"))
    # one eot per document, at its start
    assert train[0] == tok.eot and (train == tok.eot).sum() == 5


def test_prepare_is_deterministic_and_expands_globs_in_sorted_order(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    for name in ["doc2.txt", "doc10.txt", "doc1.txt"]:
        (d / name).write_text(name)
    outs = [prepare.prepare([str(d / "doc*.txt")], out_dir=str(tmp_path / f"o{k}"),
                            val_every=2) for k in range(2)]
    train, val = (bytes(np.concatenate(_read_split(outs[0], s))) for s in ("train", "val"))
    assert get_tokenizer("byte").decode(np.frombuffer(val, np.uint16).tolist()) == "doc10.txt"
    assert get_tokenizer("byte").decode(np.frombuffer(train,
                                                      np.uint16).tolist()) == "doc1.txtdoc2.txt"
    for name in os.listdir(outs[0]):
        if name.endswith(".bin"):
            assert (tmp_path / "o0" / name).read_bytes() == (tmp_path / "o1" / name).read_bytes()


def test_prepare_puts_last_document_in_val_when_val_every_exceeds_the_corpus(tmp_path):
    d = _write_corpus(tmp_path)
    out = prepare.prepare([str(d / "b.jsonl")], out_dir=str(tmp_path / "o"), val_every=20)
    tok = get_tokenizer("byte")
    np.testing.assert_array_equal(np.concatenate(_read_split(out, "val")),
                                  [256] + tok.encode("Fourth."))
    assert (np.concatenate(_read_split(out, "train")) == 256).sum() == 2


def test_prepare_replaces_stale_shards_of_an_earlier_run(tmp_path):
    d = _write_corpus(tmp_path)
    out = str(tmp_path / "o")
    prepare.prepare([str(d / "*")], out_dir=out, val_every=3, shard_tokens=10)
    assert len(_read_split(out, "train")) > 5
    prepare.prepare([str(d / "*")], out_dir=out, val_every=3)
    assert sorted(os.listdir(out)) == ["meta.json", "train_000.bin", "train_000.difficulty.npy",
                                       "val_000.bin", "val_000.difficulty.npy"]


@pytest.mark.parametrize("contents, phrase", [(["", '{"text": ""}\n'], "empty corpus"),
                                              (["only one", "\n"], "only one document")])
def test_prepare_refuses_corpus_without_two_documents_and_writes_nothing(
    tmp_path, contents, phrase
):
    (tmp_path / "a.txt").write_text(contents[0])
    (tmp_path / "b.jsonl").write_text(contents[1])
    with pytest.raises(ValueError, match=phrase):
        prepare.prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")],
                        out_dir=str(tmp_path / "o"))
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.jsonl"]


def test_prepare_names_file_and_byte_offset_of_invalid_utf8(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"hello \xff world")
    line1 = b'{"text": "fine"}\n'
    (tmp_path / "bad.jsonl").write_bytes(line1 + b'{"text": "caf\xe9"}\n')  # latin-1 e-acute
    for name, byte, offset in [("bad.txt", "0xff", 6), ("bad.jsonl", "0xe9", len(line1) + 13)]:
        with pytest.raises(ValueError, match="UTF-8") as e:
            prepare.prepare([str(tmp_path / name)], out_dir=str(tmp_path / "o"))
        msg = str(e.value)
        assert (
            str(tmp_path / name) in msg
            and byte in msg
            and f"offset {offset}" in msg
            and "iconv" in msg
        ), msg


def test_prepare_names_missing_sources_and_bad_lines(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    cases = [(tmp_path / "nope.txt", ["nope.txt", "no such file"]),
             # the fix: pass its files
             (tmp_path, [str(tmp_path), "directory", str(tmp_path / "*.txt")]),
             (tmp_path / "nothing*.txt", ["nothing*.txt", "no file"]),
             (tmp_path / "x.jsonl", ["x.jsonl:2", '"text"'])]  # file and line
    for source, facts in cases:
        with pytest.raises(ValueError) as e:
            prepare.prepare([str(source)], out_dir=str(tmp_path / "o"))
        assert all(f in str(e.value) for f in facts), str(e.value)


def test_cli_bad_flag_exits_2_with_one_line(capsys):
    # a shard's token count is an int32 in its header: 2^31 is refused before any tokenising, not at the first
    # flush hours and ~2^31 buffered tokens later
    for argv in (["--bogus=1"], ["--tokenizer=sentencepiece"], ["--val_every=x"], ["--shard_tokens=2147483648"],
                 ["--shard_tokens=0"]):
        with pytest.raises(SystemExit) as e:
            prepare.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 5 and all(e.startswith("error: ") for e in err), err
    assert "--bogus=1" in err[0] and "byte, gpt2" in err[1] and "--val_every=x" in err[2]
    assert all("from 1 to 2147483647" in e for e in err[3:]), err


def test_cli_prepares_a_corpus_and_reports_errors_in_one_line(tmp_path, capsys):
    d = _write_corpus(tmp_path)
    assert prepare.main([f"--out_dir={tmp_path / 'o'}", "--val_every=2", str(d / "*")]) == 0
    out = capsys.readouterr().out
    assert "train: 4 docs" in out and "decoded: 'First document." in out
    assert os.path.exists(tmp_path / "o" / "val_000.bin")
    assert prepare.main([str(tmp_path / "missing.txt")]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    # a lone surrogate escape is not text: gpt2 would write U+FFFD for it, byte ids cannot encode it
    (tmp_path / "s.jsonl").write_text('{"text": "first"}\n{"text": "lone \\ud800 here"}\n'
                                      '{"text": "pair \\ud83d\\ude00 ok"}\n')
    for tokenizer in ("gpt2", "byte"):
        line = _refused(capsys, [f"--tokenizer={tokenizer}", f"--out_dir={tmp_path / 's'}",
                                 str(tmp_path / "s.jsonl")])
        assert f"{tmp_path / 's.jsonl'}:2:" in line and "surrogate" in line, line
    assert not os.path.exists(tmp_path / "s")
    (tmp_path / "s.jsonl").write_text('{"text": "first"}\n{"text": "pair \\ud83d\\ude00 ok"}\n')
    assert prepare.main([f"--out_dir={tmp_path / 's'}", str(tmp_path / "s.jsonl")]) == 0
    assert "\U0001f600".encode() in b"".join(
        get_tokenizer("byte").decode_bytes(t.tolist()) for t in _read_split(tmp_path / "s", "val"))


@pytest.mark.parametrize(
    "content, facts",
    [
        (b"fine text\nthen \xff\xfe latin-1", ["UTF-8", "0xff", "offset 15"]),
        (b"", ["empty corpus"]),
    ],
)
@pytest.mark.slow
def test_prepare_py_refuses_non_utf8_and_empty_corpora_in_one_line(tmp_path, content, facts):
    src = tmp_path / "corpus.txt"
    src.write_bytes(content)
    p = subprocess.run([sys.executable, "-m", "tools.prepare", f"--out_dir={tmp_path / 'o'}",
                        str(src)], capture_output=True, text=True, env=ENV, timeout=120)
    err = p.stderr.strip().splitlines()
    assert (
        p.returncode == 1
        and len(err) == 1
        and str(src) in err[0]
        and all(f in err[0] for f in facts)
    ), p.stderr
    assert not os.path.exists(tmp_path / "o" / "train_000.bin")

# -----------------------------------------------------------------------------
# faults: a kill, a signal, a full disk or a bad file never costs the dataset already there


def _files(d):
    """{name: bytes} of every file in directory d (None if d does not exist)."""
    return {n: (d / n).read_bytes() for n in os.listdir(d)} if os.path.isdir(d) else None


def _hidden(parent):
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


class _Killed(BaseException):
    """Stands for SIGKILL at a chosen point of prepare(); the disk state at that point is copied
    first."""


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_prepare_killed_at_any_write_or_rename_leaves_the_old_dataset_or_the_new_one(
    tmp_path, monkeypatch
):
    # every shard write and every rename of a re-prepare (the swap's) is a point to stop at:
    # in-process with an exception (clean-up runs: the old dataset must be back), and as a kill (the
    # disk copied just before it)
    d = _write_corpus(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    owner = f"{atomic._host()}_{_dead_pid()}"  # the temporary directories look like a killed process's
    monkeypatch.setattr(atomic, "_owner", lambda: owner)
    parent = tmp_path / "ds"
    out = parent / "o"
    old_run = dict(sources=[str(d / "*")], out_dir=str(out), val_every=3, shard_tokens=10)
    # other shards
    new_run = dict(sources=[str(d / "*")], out_dir=str(out), val_every=2, shard_tokens=7)
    prepare.prepare(**dict(new_run, out_dir=str(tmp_path / "new")))
    new = _files(tmp_path / "new")
    calls, kill_at = [0], [None]
    real = {name: getattr(os, name) for name in ("rename", "replace")}
    real_write_shard = data.write_shard

    def faulty(name):
        def f(*args, **kw):
            calls[0] += 1
            # what a kill just before this write or rename leaves on disk
            if calls[0] == kill_at[0]:
                shutil.copytree(parent, tmp_path / f"kill{calls[0]}", symlinks=True)
                raise _Killed
            return real[name](*args, **kw)
        return f

    for name in real:
        monkeypatch.setattr(os, name, faulty(name))
    real["write_shard"] = real_write_shard
    monkeypatch.setattr(data, "write_shard", faulty("write_shard"))
    prepare.prepare(**old_run)
    old = _files(out)
    calls[0] = 0
    prepare.prepare(**new_run)  # counts the writes and renames of one re-prepare
    total = calls[0]
    # a write per shard, and more
    assert _files(out) == new and total > len([n for n in new if n.endswith(".bin")])
    mid_swap = 0
    for n in range(1, total + 1):
        shutil.rmtree(parent)
        prepare.prepare(**old_run)
        calls[0], kill_at[0] = 0, n
        with pytest.raises(_Killed):
            prepare.prepare(**new_run)
        kill_at[0] = None
        assert _files(out) == old and _hidden(parent) == [], n  # an exception: cleaned up, old kept
        snap = tmp_path / f"kill{n}"  # a kill: no clean-up ran
        assert _files(snap / "o") in (old, new, None), n
        # killed between the two renames of the swap: a reader is told where it is
        if _files(snap / "o") is None:
            with pytest.raises(ValueError, match="mv .*old"):
                prepare.check_not_mid_swap(str(snap / "o"))
            # data.py alone: no shards
            with pytest.raises(ValueError, match="no train_.*python -m tools.prepare"):
                data.DataLoader(str(snap / "o"), "train", B=1, T=4)
            mid_swap += 1
        else:
            assert prepare.check_not_mid_swap(str(snap / "o")) is None
        # the next run, even a failing one, recovers
        with pytest.raises(ValueError, match="empty corpus"):
            # other sources
            prepare.prepare([str(tmp_path / "empty.txt")], out_dir=str(snap / "o"), overwrite=True)
        assert _files(snap / "o") in (old, new) and _hidden(snap) == [], n
        shutil.rmtree(snap)
    assert mid_swap == 1  # one point to stop at lies between the swap's two renames


def test_prepare_cleans_stale_temp_dirs_but_not_those_of_a_live_run(tmp_path):
    d = _write_corpus(tmp_path)
    parent = tmp_path / "ds"
    parent.mkdir()
    dead_pid, host = _dead_pid(), atomic._host()
    day_old = time.time() - 2 * 86400
    names = {f".o.tmp_{host}_{dead_pid}_abc123": "stale", f".o.old_{host}_{dead_pid}_abc123": "stale",
             f".o.tmp_{host}_1_abc123": "live", f".o.tmp_{host}_{os.getpid()}_abc123": "live",  # running
             ".o.tmp_k2j3h4g5": "live", ".o.tmp_q9w8e7r6": "live",  # no writer's host and pid: never ours
             f".o.tmp_otherhost_{dead_pid}_abc123": "live",  # another machine's pid cannot be checked here
             ".other.tmp_x_1_y": "live"}  # not this out_dir's
    for name in names:
        (parent / name).mkdir()
        (parent / name / "train_000.bin").write_bytes(b"x" * 100)
    os.utime(parent / ".o.tmp_q9w8e7r6", (day_old, day_old))
    prepare.prepare([str(d / "*")], out_dir=str(parent / "o"), val_every=3)
    assert _hidden(parent) == sorted(n for n, state in names.items() if state == "live")


def test_prepare_leaves_a_users_old_looking_directories_alone_and_does_not_report_them(tmp_path):
    """A directory beside out_dir named like a leftover but without a writer's host and pid is the
    user's: not restored as out_dir, not removed however old, not named to a reader as the previous
    dataset."""
    d = _write_corpus(tmp_path)
    parent = tmp_path / "ds"
    parent.mkdir()
    names = (".o.old_backup", ".o.old-backup", ".o.tmp-mine", ".o.tmp_mine")
    two_days_old = time.time() - 2 * 86400
    for n in names:
        (parent / n).mkdir()
        (parent / n / "train_000.bin").write_bytes(n.encode())
        os.utime(parent / n, (two_days_old, two_days_old))
    assert prepare.check_not_mid_swap(str(parent / "o")) is None
    prepare.prepare([str(d / "*")], out_dir=str(parent / "o"), val_every=3)
    assert _hidden(parent) == sorted(names) and _files(parent / "o")["train_000.bin"] not in [
        n.encode() for n in names
    ]
    assert all((parent / n / "train_000.bin").read_bytes() == n.encode() for n in names)

def test_prepare_replaces_a_directory_that_another_prepare_created_meanwhile(tmp_path, monkeypatch):
    # two nodes sharing a disk both prepare the shipped corpus on a first run: the later swap still
    # succeeds
    d = _write_corpus(tmp_path)
    out, other = tmp_path / "o", tmp_path / "other"
    prepare.prepare([str(d / "a.txt"), str(d / "b.jsonl")], out_dir=str(other))
    prepare.prepare([str(d / "*")], out_dir=str(tmp_path / "new"), val_every=3)
    rename, raced = os.rename, []

    def racing(src, dst):
        # the other run's swap lands just before this one's first rename
        if dst == str(out) and not raced:
            raced.append(shutil.copytree(other, out))
        return rename(src, dst)

    monkeypatch.setattr(os, "rename", racing)
    prepare.prepare([str(d / "*")], out_dir=str(out), val_every=3)
    assert _files(out) == _files(tmp_path / "new") and _hidden(tmp_path) == []


@pytest.mark.parametrize("damage, facts", [("not_gzip", ["not a gzip file", "gzip"]),
                                           ("truncated", ["ends early", "truncated"])])
def test_prepare_refuses_a_bad_gzip_source_in_one_line(tmp_path, capsys, damage, facts):
    d = _write_corpus(tmp_path)
    gz = d / "c.jsonl.gz"
    raw = gz.read_bytes()
    gz.write_bytes(
        b'{"text": "plain, not compressed"}\n' if damage == "not_gzip" else raw[: len(raw) - 12]
    )
    prepare.prepare([str(d / "a.txt"), str(d / "b.jsonl")], out_dir=str(tmp_path / "o"))
    before = _files(tmp_path / "o")
    assert prepare.main([f"--out_dir={tmp_path / 'o'}", str(d / "*")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and err[0].startswith(f"error: {gz}: ") and all(f in err[0] for f in facts)
    ), err
    assert _files(tmp_path / "o") == before and _hidden(tmp_path) == []


def test_prepare_gives_the_new_dataset_the_permissions_of_the_directory_it_replaces(tmp_path):
    d = _write_corpus(tmp_path)
    out = tmp_path / "o"
    prepare.prepare([str(d / "*")], out_dir=str(out), val_every=3)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask  # as os.makedirs would make it
    os.chmod(out, 0o750)
    prepare.prepare([str(d / "*")], out_dir=str(out), val_every=2)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o750


def test_prepare_refuses_an_out_dir_that_is_a_file_before_tokenising(tmp_path, capsys):
    d = _write_corpus(tmp_path)
    (tmp_path / "o").write_text("my notes")
    assert prepare.main([f"--out_dir={tmp_path / 'o'}", str(d / "*")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and str(tmp_path / "o") in err[0]
        and "not a directory" in err[0]
        and "--out_dir" in err[0]
    )
    assert (tmp_path / "o").read_text() == "my notes" and _hidden(tmp_path) == []


def test_prepare_refuses_an_out_dir_holding_other_files(tmp_path):
    d = _write_corpus(tmp_path)
    out = tmp_path / "o"
    prepare.prepare([str(d / "*")], out_dir=str(out), val_every=3)
    (out / "notes.txt").write_text("mine")
    before = _files(out)
    with pytest.raises(ValueError) as e:  # replacing the directory would delete notes.txt
        prepare.prepare([str(d / "*")], out_dir=str(out), val_every=2)
    assert str(out) in str(e.value) and "notes.txt" in str(e.value) and "--out_dir" in str(e.value)
    assert _files(out) == before


def test_prepare_on_a_full_disk_says_so_in_one_line_and_keeps_the_old_dataset(
    tmp_path, capsys, monkeypatch
):
    d = _write_corpus(tmp_path)
    out = tmp_path / "o"
    prepare.prepare([str(d / "*")], out_dir=str(out), val_every=3, shard_tokens=10)
    before = _files(out)
    written = [0]
    real_write_shard = data.write_shard

    def write_shard(*args, **kw):
        written[0] += 1
        if written[0] > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_shard(*args, **kw)

    monkeypatch.setattr(data, "write_shard", write_shard)
    assert prepare.main([f"--out_dir={out}", "--shard_tokens=10", str(d / "*")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and str(out) in err[0] and "No space left" in err[0] and "--out_dir" in err[0]
    ), err
    assert _files(out) == before and _hidden(tmp_path) == []


def test_loaders_reading_a_directory_that_prepare_replaces_stop_with_data_changed(tmp_path):
    d = _write_corpus(tmp_path)
    out = str(tmp_path / "o")
    # shards of 16: one row of T=8 each
    prepare.prepare([str(d / "*")], out_dir=out, val_every=2, shard_tokens=16)
    train = data.DataLoader(out, "train", B=1, T=8, order="sequential")
    val = data.DataLoader(out, "val", B=1, T=8, order="sequential")
    train.next_batch()
    val.next_batch()
    # less val
    prepare.prepare([str(d / "a.txt"), str(d / "b.jsonl")], out_dir=out, val_every=3,
                    shard_tokens=16)
    # an evaluation starts again at val shard 0; the train loader moves on to its shard 1
    val.reset()
    for loader in (train, val):
        with pytest.raises(data.DataChanged) as e:
            loader.next_batch()
        assert (
            out in str(e.value)
            and "tools.prepare" in str(e.value)
            and "--resume=True" in str(e.value)
        )
    # a new run reads the new data
    assert data.DataLoader(out, "val", B=1, T=4).next_batch()[0].shape == (1, 4)


@pytest.mark.slow
def test_prepare_py_stopped_by_sigterm_says_so_and_keeps_the_old_dataset(tmp_path):
    out = tmp_path / "o"
    d = _write_corpus(tmp_path)
    prepare.prepare([str(d / "*")], out_dir=str(out), val_every=3)
    before = _files(out)
    # the shipped corpus in shards of 2000 tokens: thousands of files, seconds of work to interrupt
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tools.prepare",
            f"--out_dir={out}",
            "--shard_tokens=2000",
            "--overwrite=True",
        ],  # other sources than the dataset in out
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while not any(
        n.startswith(".o.tmp_") and os.listdir(tmp_path / n) for n in os.listdir(tmp_path)
    ):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=60)
    err = stderr.strip().splitlines()
    assert (
        p.returncode != 0 and len(err) == 1 and "SIGTERM" in err[0] and str(out) in err[0]
    ), stderr
    assert _files(out) == before and _hidden(tmp_path) == []


# -----------------------------------------------------------------------------
# real pre-training data: parquet shards with a text column, and llm.c-format shards adopted as is


def _shard_files(d):
    return {n: open(os.path.join(d, n),
                    "rb").read() for n in sorted(os.listdir(d)) if n != "meta.json"}


def test_a_parquet_file_gives_the_same_shards_as_the_jsonl_of_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    # one empty
    docs = [f"Document {i}: " + "naïve text, some words " * (i % 7 + 1) for i in range(60)] + [""]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs) + "\n",
                                         encoding="utf-8")
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    # 4 row groups, streamed one at a time
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=16)
    assert pq.ParquetFile(tmp_path / "docs.parquet").num_row_groups == 4
    for tokenizer in ("byte", "gpt2"):
        a, b = (prepare.prepare([str(tmp_path / f"docs.{ext}")], tokenizer=tokenizer,
                                out_dir=str(tmp_path / f"{ext}_{tokenizer}"), val_every=5,
                                shard_tokens=3000) for ext in ("jsonl", "parquet"))
        assert _shard_files(a) == _shard_files(b) and len(_shard_files(a)) >= 4


def test_a_parquet_file_without_a_text_column_is_one_line(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "x.parquet")
    assert prepare.main([f"--out_dir={tmp_path / 'o'}", str(tmp_path / "x.parquet")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no \"text\" column" in err[0] and "content" in err[0]
    (tmp_path / "y.parquet").write_bytes(b"PAR1 not really")
    assert prepare.main([f"--out_dir={tmp_path / 'o'}", str(tmp_path / "y.parquet")]) == 1
    assert "not a readable parquet file" in capsys.readouterr().err


def test_progress_reports_the_fraction_tokens_per_second_and_time_left(
    tmp_path, capsys, monkeypatch
):
    p = prepare.Progress([__file__], every=0.0)
    p.file(0)
    p.within(os.path.getsize(__file__) // 4)
    p.tokens_added(1000)
    line = capsys.readouterr().out
    assert (
        "25.0% of the sources" in line
        and "1,000 tokens" in line
        and "tokens/s" in line
        and "left" in line
    )


@pytest.mark.slow
def test_llmc_shards_are_adopted_without_re_tokenising_and_train(tmp_path, capsys):
    src = tmp_path / "fineweb10B"
    src.mkdir()
    tok = get_tokenizer("gpt2")
    text = open(os.path.join(ROOT, "data", "README.md"), encoding="utf-8").read()
    doc = [tok.eot] + tok.encode(text)
    ids = np.array(doc * (9000 // len(doc) + 1), dtype=np.uint16)  # llm.c writes uint16 GPT-2 ids
    data.write_shard(str(src / "fineweb_val_000000.bin"), ids[:3000])
    data.write_shard(str(src / "fineweb_train_000001.bin"), ids[3000:6000])
    data.write_shard(str(src / "fineweb_train_000002.bin"), ids[6000:])
    out = str(tmp_path / "adopted")
    assert prepare.main(["--tokenizer=gpt2", f"--adopt={src}", f"--out_dir={out}"]) == 0
    assert "not re-tokenised" in capsys.readouterr().out
    for ours, theirs in (("val_000.bin", "fineweb_val_000000.bin"),
                         ("train_000.bin", "fineweb_train_000001.bin"),
                         ("train_001.bin", "fineweb_train_000002.bin")):
        assert open(os.path.join(out, ours), "rb").read() == open(src / theirs, "rb").read()
    meta = data.read_meta(out)
    assert (
        meta["tokenizer"] == "gpt2"
        and meta["train_tokens"] == len(ids) - 3000
        and meta["val_tokens"] == 3000
    )
    from conftest import TINY, run
    p = run("--stage=2", *TINY, "--tokenizer=gpt2", f"--data={out}", "--max_iters=2",
            "--eval_interval=2", f"--out_dir={tmp_path / 'run'}")
    assert "final val loss" in p.stdout
    # the wrong tokenizer and a damaged header are refused in one line, and nothing is written
    assert prepare.main(["--tokenizer=byte", f"--adopt={src}", f"--out_dir={tmp_path / 'b'}"]) == 1
    assert "--tokenizer" in capsys.readouterr().err and not os.path.exists(tmp_path / "b")
    raw = bytearray((src / "fineweb_train_000002.bin").read_bytes())
    raw[:4] = bytes(4)
    (src / "fineweb_train_000002.bin").write_bytes(bytes(raw))
    assert prepare.main(["--tokenizer=gpt2", f"--adopt={src}", f"--out_dir={tmp_path / 'c'}"]) == 1
    assert "magic" in capsys.readouterr().err and not os.path.exists(tmp_path / "c")


def test_the_gpt2_default_data_is_fineweb_edu_once_prepared_and_overuse_is_said(
    tmp_path, monkeypatch, capsys
):
    import types
    from tools import config, loaders
    monkeypatch.setattr(loaders, "FINEWEB_EDU", str(tmp_path / "fineweb_edu_gpt2"))
    gpt2, byte = config.TrainConfig(tokenizer="gpt2"), config.TrainConfig(tokenizer="byte")
    assert loaders.default_data(gpt2) == loaders.default_data(byte) == {"shakespeare": 1.0}
    (tmp_path / "fineweb_edu_gpt2").mkdir()
    (tmp_path / "fineweb_edu_gpt2" / "meta.json").write_text("{}")
    assert loaders.default_data(gpt2) == {str(tmp_path / "fineweb_edu_gpt2"): 1.0}
    assert loaders.default_data(byte) == {"shakespeare": 1.0}
    rt = types.SimpleNamespace(local_rank=0, rank=0, world=1, barrier=lambda: None, log=print)
    loaders.make_loaders(config.TrainConfig(max_iters=600), rt, None)  # the quick start: half an epoch
    assert "times over" not in capsys.readouterr().out
    loaders.make_loaders(config.TrainConfig(max_iters=60000), rt, None)  # 246M tokens of a 4.8M-token corpus
    assert "reads its training data 51 times over" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# a pretrained model's tokenizer: its own ids, and 4-byte ids (shard version 2) over 65,536 ids


def _header(path):
    return np.fromfile(path, dtype="<i4", count=3).tolist()  # magic, version, n_tokens


def test_a_corpus_prepared_with_the_smollm2_tokenizer_holds_exactly_its_ids(
    smollm2, tmp_path, capsys
):
    # loaded once per test run (tokenizer.py caches it; tests/test_tokenizer.py too)
    tok = get_tokenizer(smollm2)
    plays = list(prepare.iter_documents([prepare.SHAKESPEARE]))
    code = list(prepare.iter_documents([prepare.PYTHON]))
    docs = [plays[0][:3000], code[0][:3000],
            "caf\u00e9 \u2014 \u6f22\u5b57 \U0001F642 <|endoftext|> <|im_end|>\n", plays[1][:2000],
            code[1][:2000], "A last, short document."]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs) + "\n",
                                         encoding="utf-8")
    out = str(tmp_path / "smol")
    assert prepare.main([f"--tokenizer={smollm2}", f"--out_dir={out}", "--val_every=3",
                         "--shard_tokens=1500", str(tmp_path / "docs.jsonl")]) == 0
    assert "decoded: \"<|endoftext|>ALL'S WELL THAT ENDS WELL" in capsys.readouterr().out
    # eot = 0
    ids = [[0] + tok.hf(t, add_special_tokens=False,
                        split_special_tokens=True)["input_ids"] for t in docs]
    want = {"train": [i for k, d in enumerate(ids) if k % 3 != 2 for i in d],
            "val": [i for k, d in enumerate(ids) if k % 3 == 2 for i in d]}
    for split in ("train", "val"):
        shards = sorted(f for f in os.listdir(out) if f.startswith(split) and f.endswith(".bin"))
        # uint16: llm.c's format
        assert all(_header(os.path.join(out, f))[:2] == [data.MAGIC, 1] for f in shards)
        got = np.concatenate([data.read_shard(os.path.join(out, f)) for f in shards]).tolist()
        assert got == want[split], split
    # "<|endoftext|>" in a document is text, not a document break
    assert len(ids[2]) > 20 and ids[2].count(0) == 1
    meta = data.read_meta(out)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot"],
            meta["dtype"]) == (smollm2, 49152, 0, "uint16")
    assert meta["n_docs_train"] == 4 and meta["n_docs_val"] == 2


def _wide_tokenizer(path, n=70_000):
    """A word-level tokenizer of n words w0 .. w{n-1} plus <|endoftext|> (id n), saved as a model
    directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(n)}
    vocab.update({"<|endoftext|>": n, "<unk>": n + 1})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                            unk_token="<unk>").save_pretrained(str(path))
    return str(path)


def test_a_vocabulary_over_65536_writes_version_2_shards_that_the_loader_reads(tmp_path):
    name = _wide_tokenizer(tmp_path / "wide")
    rng = np.random.default_rng(0)
    # ids > 65,535
    docs = [rng.integers(60_000, 70_000, size=n).tolist() for n in (300, 200, 250, 400, 150, 350)]
    (tmp_path / "docs.jsonl").write_text(
        "\n".join(json.dumps({"text": " ".join(f"w{i}" for i in d)}) for d in docs)
    )
    out = prepare.prepare([str(tmp_path / "docs.jsonl")], tokenizer=name,
                          out_dir=str(tmp_path / "shards"), val_every=3, shard_tokens=527)
    meta = data.read_meta(out)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot"],
            meta["dtype"]) == (name, 70_002, 70_000, "uint32")
    train = [i for k, d in enumerate(docs) if k % 3 != 2 for i in [70_000] + d]
    shards = [os.path.join(out, f"train_{k:03d}.bin") for k in range(meta["train_shards"])]
    assert len(shards) == 2 and meta["train_tokens"] == len(train) == 1054
    for path in shards:
        magic, version, n = _header(path)
        assert (magic,
                version) == (data.MAGIC, 2) and os.path.getsize(path) == data.HEADER_BYTES + 4 * n
    assert np.concatenate([data.read_shard(p) for p in shards]).tolist() == train
    T = 64
    loader = data.DataLoader(out, "train", B=2, T=T, order="sequential")
    for j in range(4):  # windows in shard order: shard 0 holds 527 tokens, windows 0..7 of 65
        x, y = loader.next_batch()
        assert x.dtype == torch.long and x.shape == (2, T)
        for r in range(2):
            w = (2 * j + r) * T
            assert x[r].tolist() == train[w:w + T] and y[r].tolist() == train[w + 1:w + T + 1]
    assert int(x.max()) >= 65_536


def test_a_model_tokenizer_names_its_default_directory_by_its_last_part_and_where_it_is(tmp_path):
    """The last part of the source, and a hash of where it is: two models of one name never share
    shards."""
    import re
    gguf = os.path.join(ROOT, "data", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    got = prepare.default_out_dir(None, [prepare.SHAKESPEARE], gguf)
    assert re.fullmatch(
        re.escape(os.path.join(prepare.DATA_DIR, "shakespeare_SmolLM2-135M-Instruct.Q4_1-"))
        + "[0-9a-f]{8}",
        got,
    ), got
    hub = prepare.default_out_dir(["x/docs.jsonl"], ["x/docs.jsonl"], "HuggingFaceTB/SmolLM2-135M")
    assert os.path.basename(hub).startswith("docs_SmolLM2-135M-")
    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"  # the same name in two places
    for d in (a, b):
        d.mkdir(parents=True)
        (d / "tokenizer.json").write_text("{}")
    assert prepare.default_out_dir(None, [prepare.SHAKESPEARE], str(a)) != \
        prepare.default_out_dir(None, [prepare.SHAKESPEARE], str(b))


def test_adopted_shards_that_are_symlinks_are_linked_to_the_files_they_name(tmp_path, capsys):
    """A source directory of symlinked shards (a download cache: relative links into ../blobs): the adopted
    directory holds the files themselves, not links that dangle at another depth or vanish with the source."""
    blobs, src = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir(), src.mkdir()
    tok = get_tokenizer("gpt2")
    ids = np.array(([tok.eot] + tok.encode("to be or not to be")) * 200, dtype=np.uint16)
    for name, part in (("fineweb_val_000000.bin", ids[:600]), ("fineweb_train_000001.bin", ids[600:])):
        data.write_shard(str(blobs / name), part)
        os.symlink(os.path.join("..", "blobs", name), src / name)
    out = tmp_path / "deeper" / "adopted"
    assert prepare.main(["--tokenizer=gpt2", f"--adopt={src}", f"--out_dir={out}"]) == 0
    capsys.readouterr()
    for name in ("val_000.bin", "train_000.bin"):
        assert not os.path.islink(out / name) and os.path.getsize(out / name) > 1024
    import shutil
    shutil.rmtree(blobs)  # the source gone: the adopted dataset still reads
    assert data.read_meta(str(out))["train_tokens"] == len(ids) - 600
    assert open(out / "train_000.bin", "rb").read()[1024:] == ids[600:].tobytes()


def test_adopting_shards_of_another_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    corpus = _write_corpus(tmp_path)
    made = prepare.prepare([str(corpus / "*")], tokenizer="byte", out_dir=str(tmp_path / "byte"),
                           val_every=3)
    # byte ids are all valid gpt2 ids: only meta.json can tell
    assert prepare.main(["--tokenizer=gpt2", f"--adopt={made}",
                         f"--out_dir={tmp_path / 'adopted'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "meta.json says the shards are byte ids, not --tokenizer=gpt2" in err[0]
    )
    assert not os.path.exists(tmp_path / "adopted")
    assert prepare.main(["--tokenizer=byte", f"--adopt={made}",
                         f"--out_dir={tmp_path / 'adopted'}"]) == 0


def test_a_bad_tokenizer_is_one_line_before_anything_is_read(tmp_path, capsys):
    from conftest import fails
    line = fails(capsys, "--tokenizer=sentencepiece", f"--out_dir={tmp_path / 'o'}",
                 main=prepare.main, code=2)
    assert "--tokenizer=sentencepiece: unknown tokenizer" in line and "a .gguf file" in line
    line = fails(capsys, f"--tokenizer={tmp_path / 'none.gguf'}", main=prepare.main, code=2)
    assert "no such .gguf file" in line and not os.path.exists(tmp_path / "o")

# -----------------------------------------------------------------------------
# what --adopt and prepare must refuse (one line, nothing on disk changed), not lose or hide data


def _refused(capsys, argv, code=1):
    """prepare.main(argv) ends with `code` (returned, or a SystemExit for a bad flag value) after
    exactly one line 'error: ...' (an exception, a traceback in a real run, fails the test); returns
    that line."""
    try:
        rc = prepare.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    return err[0]


def _llmc(d, names, ids=np.arange(300) % 257):
    """Directory d of llm.c-format shards with these names (each a shard of ids, byte ids with the
    end-of-text 256 by default); returns d."""
    d.mkdir()
    for n in names:
        data.write_shard(str(d / n), ids)
    return d


def test_adopting_a_directory_into_itself_is_refused_and_keeps_its_scores_and_meta_json(
    tmp_path, capsys
):
    made = tmp_path / "D"
    prepare.prepare([str(_write_corpus(tmp_path) / "*")], out_dir=str(made), val_every=3)
    before = _files(made)
    assert "train_000.difficulty.npy" in before and "sources" in data.read_meta(str(made))
    (tmp_path / "link").symlink_to(made)
    for src, out in ((made, made), (tmp_path / "link", made), (made, tmp_path / "link")):
        line = _refused(capsys, [f"--adopt={src}", f"--out_dir={out}"])
        assert "same directory" in line and "--out_dir" in line and f"--data={src}" in line, line
    assert _files(made) == before and _hidden(tmp_path) == []


def test_adopt_refuses_a_gap_or_a_repeat_in_the_shard_numbers_naming_the_missing_shard(
    tmp_path, capsys
):
    # renumbering 000001, 000003 as train_000, train_001 would hide that 000002 is missing
    cases = [(["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000003.bin"],
              "fineweb_train_000002.bin is missing"),
             (["fineweb_val_000000.bin", "fineweb_train_000002.bin"],
              "fineweb_train_000001.bin is missing"),
             (["train_001.bin", "val_000.bin"], "train_000.bin is missing"),  # ours start at 000
             (["val_000.bin", "val_002.bin", "train_000.bin"], "val_001.bin is missing"),
             # llm.c's val is 000000 (only its train starts at 000001)
             (["fineweb_val_000001.bin", "fineweb_train_000001.bin"], "fineweb_val_000000.bin is missing"),
             (["fineweb_val_000000.bin", "fineweb_train_000001.bin", "train_001.bin"],
              "fineweb_train_000001.bin and train_001.bin are both train shard 1")]
    for k, (names, fact) in enumerate(cases):
        src = _llmc(tmp_path / f"src{k}", names)
        line = _refused(capsys, [f"--adopt={src}", f"--out_dir={tmp_path / 'o'}"])
        assert f"--adopt={src}" in line and fact in line, line
        assert not os.path.exists(tmp_path / "o") and _hidden(tmp_path) == []
    ok = _llmc(tmp_path / "ok",
               ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"])
    # llm.c's numbering: no gap
    assert prepare.main([f"--adopt={ok}", f"--out_dir={tmp_path / 'o'}"]) == 0
    assert sorted(n for n in os.listdir(tmp_path / "o") if n.endswith(".bin")) == [
        "train_000.bin", "train_001.bin", "val_000.bin"]


def test_adopt_refuses_a_token_id_equal_to_the_vocabulary_size(tmp_path, capsys):
    vocab = get_tokenizer("byte").vocab_size  # 257: ids 0..256
    for top, ok in ((vocab - 1, True), (vocab, False)):
        src = _llmc(tmp_path / f"s{top}", ["val_000.bin", "train_000.bin"],
                    ids=np.array([256, 1, 2, top]))
        if ok:
            assert prepare.main([f"--adopt={src}", f"--out_dir={tmp_path / f'o{top}'}"]) == 0
        else:
            line = _refused(capsys, [f"--adopt={src}", f"--out_dir={tmp_path / f'o{top}'}"])
            assert f"token id {vocab} is outside the byte vocabulary ({vocab})" in line, line
            assert not os.path.exists(tmp_path / f"o{top}")


def test_adopt_without_out_dir_is_refused_before_any_shard_is_read(tmp_path, capsys, monkeypatch):
    src = _llmc(tmp_path / "s", ["val_000.bin", "train_000.bin"])
    read = []
    monkeypatch.setattr(data, "read_shard", lambda *a,
                        **kw: read.append(a) or np.zeros(0, np.uint16))
    line = _refused(capsys, [f"--adopt={src}"], code=2)
    assert f"--adopt={src}" in line and "--out_dir" in line, line
    # adopt() itself, as another caller would call it
    with pytest.raises(ValueError, match="needs an --out_dir"):
        prepare.adopt(str(src), None, "byte")
    assert read == [] and sorted(os.listdir(tmp_path)) == ["s"]


def test_prepare_refuses_a_source_given_twice_also_through_another_path(tmp_path, capsys):
    d = _write_corpus(tmp_path)
    (tmp_path / "link.txt").symlink_to(d / "a.txt")
    os.link(d / "b.jsonl", tmp_path / "hard.jsonl")
    for sources, fact in (
        ([d / "a.txt", d / "a.txt"], f"{d / 'a.txt'}: given twice"),
        # a glob and the file
        ([d / "*", d / "c.jsonl.gz"], f"{d / 'c.jsonl.gz'}: given twice"),
        ([d / "a.txt", tmp_path / "link.txt"], f"link.txt: given twice (also as {d / 'a.txt'})"),
        ([d / "b.jsonl", tmp_path / "hard.jsonl"], "hard.jsonl: given twice (also as"),
    ):
        line = _refused(capsys, [f"--out_dir={tmp_path / 'o'}"] + [str(s) for s in sources])
        assert fact in line and "pass each source once" in line, line
    assert not os.path.exists(tmp_path / "o") and _hidden(tmp_path) == []


def test_val_every_1_is_refused_as_a_flag_by_the_rule_prepare_applies(tmp_path, capsys):
    d = _write_corpus(tmp_path)
    line = _refused(capsys, ["--val_every=1", f"--out_dir={tmp_path / 'o'}", str(d / "*")], code=2)
    assert line == f"error: --val_every=1: {prepare.VAL_EVERY_RULE}" and ">= 2" in line, line
    with pytest.raises(ValueError, match=f"val_every=1: {re.escape(prepare.VAL_EVERY_RULE)}"):
        prepare.prepare([str(d / "*")], out_dir=str(tmp_path / "o"), val_every=1)
    # the least it takes
    assert prepare.main(["--val_every=2", f"--out_dir={tmp_path / 'o'}", str(d / "*")]) == 0


def test_prepare_and_adopt_refuse_other_data_in_a_shipped_corpus_directory(
    tmp_path, capsys, monkeypatch
):
    # data/shakespeare_byte is what every --data=shakespeare run and the lab read: only the shipped
    # corpus, cleaned as shipped, in the tokenizer its name says, may go there (a stand-in data/
    # here: the real one is not touched)
    root = tmp_path / "data"
    root.mkdir()
    plays = root / "shakespeare.jsonl"
    plays.write_text(
        "".join(json.dumps({"text": f"Play {k}: to be or not to be."}) + "\n" for k in range(4))
    )
    monkeypatch.setattr(prepare, "DATA_DIR", str(root))
    code = root / "python.jsonl"
    code.write_text('{"text": "import os"}\n{"text": "import re"}\n')
    monkeypatch.setattr(prepare, "CORPORA",
                        {"shakespeare": (str(plays), "dedup"), "python": (str(code), "code")})
    shipped = root / "shakespeare_byte"
    # the shipped corpus into its directory: as train.py does it
    assert prepare.main([f"--out_dir={shipped}"]) == 0
    capsys.readouterr()
    before = _files(shipped)
    d = _write_corpus(tmp_path)
    (tmp_path / "alias").symlink_to(shipped)
    # your own file of that name: its default out_dir is shipped's
    own = tmp_path / "mine" / "shakespeare.jsonl"
    own.parent.mkdir()
    own.write_text('{"text": "mine"}\n{"text": "also mine"}\n')
    src = _llmc(tmp_path / "llmc", ["val_000.bin", "train_000.bin"])
    for argv, fact in (
        ([f"--out_dir={shipped}", str(d / "*")], f"not one for other sources ({d / 'a.txt'}"),
        ([f"--out_dir={tmp_path / 'alias'}", str(d / "a.txt")], "not one for other sources"),
        ([str(own)], f"{shipped} (the default --out_dir for shakespeare.jsonl)"),
        ([f"--out_dir={shipped}", str(plays)], "--clean=none (shipped: --clean=dedup)"),
        ([f"--out_dir={shipped}", "--clean=prose"], "--clean=prose (shipped: --clean=dedup)"),
        ([f"--out_dir={shipped}", "--corpus=python"], f"not one for other sources ({code})"),
        ([f"--out_dir={shipped}", "--tokenizer=gpt2"],
         f"gpt2 ids (it holds byte's); pass another --out_dir (e.g. "
         f"--out_dir={root}/shakespeare_gpt2)"),
        ([f"--out_dir={root / 'python_byte'}", str(d / "a.txt")], "python's directory"),
        ([f"--out_dir={root / 'shakespeare_tiny-0123abcd'}", str(d / "a.txt")], "shakespeare's"),
        ([f"--adopt={src}", f"--out_dir={shipped}"], "not one for adopted shards"),
    ):
        line = _refused(capsys, argv)
        assert "is the shipped corpus" in line and fact in line and "another --out_dir" in line, (
            argv,
            line,
        )
    assert _files(shipped) == before and _hidden(root) == [] and sorted(os.listdir(root)) == [
        "python.jsonl", "shakespeare.jsonl", "shakespeare_byte"]
    # the same corpus, as shipped
    assert prepare.main([f"--out_dir={shipped}", "--clean=dedup", str(plays)]) == 0
    assert _shard_files(shipped) == {n: b for n, b in before.items() if n != "meta.json"}
    assert data.read_meta(str(shipped))["sources"] == [str(plays)]
    # other names in data/ are yours
    for name in ("my_shakespeare_byte", "shakespeare_mine", "shakespeare"):
        assert prepare.main([f"--out_dir={root / name}", str(d / "*")]) == 0


def test_adopt_takes_the_tokenizer_its_meta_json_names_by_another_path_and_refuses_another(
    tmp_path, capsys
):
    name = _wide_tokenizer(tmp_path / "model", n=300)  # a model's tokenizer, named by a path
    (tmp_path / "words.jsonl").write_text(
        "".join(json.dumps({"text": f"w{k} w{k + 1} w{k + 2}"}) + "\n" for k in range(6))
    )
    made = prepare.prepare([str(tmp_path / "words.jsonl")], tokenizer=name,
                           out_dir=str(tmp_path / "made"), val_every=3)
    # the same model through another path: the same ids
    (tmp_path / "alias").symlink_to(tmp_path / "model")
    assert prepare.main([f"--tokenizer={tmp_path / 'alias'}", f"--adopt={made}",
                         f"--out_dir={tmp_path / 'a'}"]) == 0
    line = _refused(capsys, ["--tokenizer=byte", f"--adopt={made}", f"--out_dir={tmp_path / 'b'}"])
    assert (
        f"meta.json says the shards are {name} ids, not --tokenizer=byte" in line
        and f"--tokenizer={name}" in line
    )
    assert not os.path.exists(tmp_path / "b")


def test_check_shipped_tells_a_reader_that_a_shipped_corpus_directory_holds_other_data(
    tmp_path, monkeypatch
):
    # for train.py's and the lab's side: a directory written before prepare refused this (or by
    # hand) is named
    root = tmp_path / "data"
    root.mkdir()
    plays = root / "shakespeare.jsonl"
    plays.write_text("".join(json.dumps({"text": f"Play {k}."}) + "\n" for k in range(4)))
    monkeypatch.setattr(prepare, "DATA_DIR", str(root))
    monkeypatch.setattr(prepare, "CORPORA", {"shakespeare": (str(plays), "dedup")})
    shipped = prepare.prepare(tokenizer="byte")  # data/shakespeare_byte
    assert (
        shipped == str(root / "shakespeare_byte")
        and prepare.check_shipped(shipped, "shakespeare") is None
    )
    meta = data.read_meta(shipped)
    # the repository moved: still it
    moved = dict(meta, sources=["/an/older/checkout/data/shakespeare.jsonl"])
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"text": "a"}\n{"text": "b"}\n')
    namesake = tmp_path / "shakespeare.jsonl"
    shutil.copy(mine, namesake)
    for fields, fact in (
        (dict(sources=[str(mine)]), f"lists {mine}, not the shipped corpus shakespeare"),
        (dict(sources=[str(plays), str(mine)]), "not the shipped corpus"),
        # your file of its name
        (dict(sources=[str(namesake)]), f"lists {namesake}, not"),
        (dict(cleaning=None), "not the shipped corpus"),  # --clean=none
        (dict(cleaning=dict(meta["cleaning"], kind="prose")), "not the shipped corpus"),
        (dict(adopted_from=str(tmp_path)), "(adopted shards)"),
        (dict(sources=[]), "lists no sources"),
    ):
        (root / "shakespeare_byte" / "meta.json").write_text(json.dumps(dict(meta, **fields)))
        with pytest.raises(ValueError) as e:
            prepare.check_shipped(shipped, "shakespeare")
        assert str(e.value).startswith(f"{shipped}: its meta.json") and fact in str(e.value), str(
            e.value
        )
        assert "move it elsewhere" in str(e.value) and "--data" in str(e.value)
    (root / "shakespeare_byte" / "meta.json").write_text(json.dumps(moved))
    assert prepare.check_shipped(shipped, "shakespeare") is None
    (root / "shakespeare_byte" / "meta.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != "cleaning"})
    )
    # from before cleaning existed: not judged
    assert prepare.check_shipped(shipped, "shakespeare") is None


def test_adopting_shards_without_meta_json_that_hold_no_end_of_text_of_the_tokenizer_is_refused(
    tmp_path, capsys
):
    """Byte shards are valid GPT-2 ids (every id < 50,257), but a GPT-2 dataset starts each document
    with 50,256, which they never hold: without a meta.json to say so, that is how they are told
    apart (one line, nothing written). The same shards as byte ids, whose end-of-text 256 they hold,
    are adopted."""
    corpus = _write_corpus(tmp_path)
    made = prepare.prepare([str(corpus / "*")], tokenizer="byte", out_dir=str(tmp_path / "byte"),
                           val_every=3)
    bare = tmp_path / "bare"
    shutil.copytree(made, bare)
    os.remove(bare / "meta.json")  # llm.c-style: the shards alone
    ntok = sum(data.read_shard(str(p)).size for p in bare.glob("*.bin"))
    line = _refused(capsys, ["--tokenizer=gpt2", f"--adopt={bare}", f"--out_dir={tmp_path / 'o'}"])
    assert (
        f"--adopt={bare}: not one gpt2 end-of-text id (50256) in its {ntok:,} tokens (ids 0..256)"
        in line
    ), line
    assert "--tokenizer" in line and not os.path.exists(tmp_path / "o") and _hidden(tmp_path) == []
    assert prepare.main(["--tokenizer=byte", f"--adopt={bare}", f"--out_dir={tmp_path / 'o'}"]) == 0
    assert data.read_meta(str(tmp_path / "o"))["n_docs_train"] > 0


def test_preparing_over_a_dataset_of_other_sources_or_another_tokenizer_needs_overwrite(
    tmp_path, capsys
):
    """A directory holding a dataset is replaced whole by the next prepare into it: when that
    dataset is of other sources (none of the new ones), another tokenizer's ids or adopted shards,
    it takes --overwrite=True; one line names what the directory holds, and it is left as it was.
    The same sources again (or some added or dropped) in the same tokenizer replace it as before."""
    d = _write_corpus(tmp_path)
    other = tmp_path / "other.jsonl"
    other.write_text(
        "".join(json.dumps({"text": f"Another text, number {k}."}) + "\n" for k in range(6))
    )
    out = tmp_path / "o"
    assert prepare.main([f"--out_dir={out}", "--val_every=3", str(d / "*")]) == 0
    before = _files(out)
    src = _llmc(tmp_path / "llmc", ["val_000.bin", "train_000.bin"])
    for argv, fact in (([str(other)], f"not {other} in byte ids"),
                       (["--tokenizer=gpt2", str(other)], f"not {other} in gpt2 ids"),
                       # the same sources, other ids
                       (["--tokenizer=gpt2", str(d / "*")], "in gpt2 ids"),
                       ([f"--adopt={src}"], f"not shards adopted from {src}")):
        line = _refused(capsys, [f"--out_dir={out}", *argv])
        assert (
            f"--out_dir={out}: holds a dataset of {d / 'a.txt'}, {d / 'b.jsonl'}, ... in byte ids"
            in line
        ), line
        assert fact in line and "--overwrite=True" in line, line
        assert _files(out) == before and _hidden(tmp_path) == []
    capsys.readouterr()
    # one of its sources again
    assert prepare.main([f"--out_dir={out}", "--val_every=2", str(d / "b.jsonl")]) == 0
    assert prepare.main([f"--out_dir={out}", f"--adopt={src}", "--overwrite=True"]) == 0
    assert data.read_meta(str(out))["adopted_from"] == str(src)
    line = _refused(capsys, [f"--out_dir={out}", str(other)])
    assert f"holds a dataset of shards adopted from {src} in byte ids" in line, line
    assert prepare.main([f"--out_dir={out}", f"--adopt={src}"]) == 0  # the same shards again
    assert prepare.main([f"--out_dir={out}", "--overwrite=True", str(other)]) == 0
    assert data.read_meta(str(out))["sources"] == [str(other)]



def test_a_gone_source_is_the_new_one_of_its_name_only_at_its_recorded_size(tmp_path, capsys):
    """A dataset whose recorded source was deleted (the shards were its only copy) is replaced without
    --overwrite=True only by a source of the same name AND size (the checkout moved); a second download's file
    of the same name (every dataset's train-00000-of-00001.jsonl) with other text is refused and the shards
    stay. The same for adopted shard directories of one name. (Before: any namesake replaced it.)"""
    def corpus(d, word):
        d.mkdir(parents=True)
        f = d / "train-00000-of-00001.jsonl"
        f.write_text("".join(json.dumps({"text": f"{word} number {k}."}) + "\n" for k in range(6)))
        return f
    a, b = corpus(tmp_path / "dl" / "a", "First"), corpus(tmp_path / "dl" / "b", "Second text")
    out = tmp_path / "mine"
    assert prepare.main([f"--out_dir={out}", "--val_every=3", str(a)]) == 0
    assert data.read_meta(str(out))["source_bytes"] == [a.stat().st_size]
    moved = corpus(tmp_path / "moved", "First")  # the same bytes elsewhere
    a.unlink()
    before = _files(out)
    line = _refused(capsys, [f"--out_dir={out}", "--val_every=3", str(b)])
    assert f"holds a dataset of {a} in byte ids, not {b}" in line and "--overwrite=True" in line, line
    assert _files(out) == before
    assert prepare.main([f"--out_dir={out}", "--val_every=3", str(moved)]) == 0  # the checkout moved
    # adopted shards: a directory named shards, deleted after adopting, and another one of that name
    src = prepare.prepare([str(moved)], out_dir=str(tmp_path / "x" / "shards"), val_every=3)
    other = prepare.prepare([str(b)], out_dir=str(tmp_path / "y" / "shards"), val_every=3)
    adopted = tmp_path / "adopted"
    assert prepare.main([f"--out_dir={adopted}", f"--adopt={src}"]) == 0
    shutil.rmtree(src)
    before = _files(adopted)
    line = _refused(capsys, [f"--out_dir={adopted}", f"--adopt={other}"])
    assert f"holds a dataset of shards adopted from {src}" in line, line
    assert _files(adopted) == before
    # llm.c's shard names count too (what --adopt takes: fineweb_train_000001.bin)
    llmc = tmp_path / "llmc"
    llmc.mkdir()
    (llmc / "fineweb_train_000001.bin").write_bytes(b"x" * 10)
    (llmc / "fineweb_val_000000.bin").write_bytes(b"y" * 3)
    (llmc / "notes.txt").write_text("not a shard")
    assert prepare.source_bytes(str(llmc)) == 13

def test_ctrl_c_while_a_models_tokenizer_loads_is_one_line(tmp_path, capsys, monkeypatch):
    """A GGUF's vocabulary takes seconds to read, before any signal handler of the writing is set:
    Ctrl-C there is one line and exit 130, not a KeyboardInterrupt traceback."""
    from conftest import fails

    def interrupted(name):
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare, "get_tokenizer", interrupted)
    line = fails(capsys, "--tokenizer=byte", f"--out_dir={tmp_path / 'o'}", main=prepare.main,
                 code=130)
    assert "Ctrl-C" in line and "--tokenizer=byte" in line and not os.path.exists(tmp_path / "o")


def test_a_single_txt_like_nanogpts_input_txt_is_split_into_its_paragraphs(tmp_path, capsys):
    # nanoGPT's data/shakespeare_char/input.txt is one file: given alone, its paragraphs are the
    # documents (every 3rd to val here), and the documents joined are the file byte for byte
    speeches = [
        f"SPEAKER {k}:\nLine {k} of the play.\r\n" + ("\n \n" if k % 2 else "\n\n")
        for k in range(9)
    ]
    text = "\n\n" + "".join(speeches) + "END"  # blank lines first stay with the first paragraph
    (tmp_path / "input.txt").write_bytes(text.encode())
    assert prepare.main([f"--out_dir={tmp_path / 'o'}", "--val_every=3",
                         str(tmp_path / "input.txt")]) == 0
    assert f"the 10 paragraphs of {tmp_path / 'input.txt'}" in capsys.readouterr().out
    tok = get_tokenizer("byte")
    docs = [
        tok.decode(d.tolist())
        for split in ("train", "val")
        for shard in _read_split(tmp_path / "o", split)
        for d in np.split(shard, np.flatnonzero(shard == tok.eot))[1:]
    ]
    assert sorted(docs) == sorted(["\n\n" + speeches[0]] + speeches[1:] + ["END"])
    assert data.read_meta(str(tmp_path / "o"))["n_docs_val"] == 3
    # a last blank line without its newline stays with the paragraph before it (no document of spaces)
    (tmp_path / "end.txt").write_bytes(b"Para one.\n\nPara two.\n\n  ")
    assert prepare.main([f"--out_dir={tmp_path / 'e'}", "--val_every=2", "--clean=none",
                         str(tmp_path / "end.txt")]) == 0
    assert "the 2 paragraphs of" in capsys.readouterr().out
    assert [tok.decode(s.tolist()) for s in _read_split(tmp_path / "e", "val")] == ["Para two.\n\n  "]
    # the paragraphs counted are the file's, before cleaning removed any (two exact duplicates here)
    p = " ".join(f"w{i}" for i in range(60))
    (tmp_path / "dup.txt").write_text("\n\n".join([p, p, p.upper(), " ".join(f"v{i}" for i in range(60))]))
    assert prepare.main([f"--out_dir={tmp_path / 'd'}", "--val_every=2", "--clean=dedup",
                         str(tmp_path / "dup.txt")]) == 0
    out = capsys.readouterr().out
    assert "4 documents in, 2 removed" in out and "the 4 paragraphs of" in out, out
    # beside another file, a .txt is one document
    (tmp_path / "two.txt").write_text("one paragraph only\n")
    prepare.prepare([str(tmp_path / "input.txt"), str(tmp_path / "two.txt")],
                    out_dir=str(tmp_path / "p"), val_every=2)
    meta = data.read_meta(str(tmp_path / "p"))
    assert meta["n_docs_train"] + meta["n_docs_val"] == 2


def test_make_python_corpus_writes_its_corpus_and_replaces_nothing_else(tmp_path, capsys):
    """tools.make_python_corpus (the shipped code corpus, rebuilt from CPython 3.11.7's Lib/*.py): the same bytes
    as data/python.jsonl.gz (data/README.md's sha256) at a new path; a checkpoint, the other shipped corpus, a
    directory, a missing directory or an empty --out is one error line and nothing is written; another gzip file
    only with --overwrite=True."""
    from tools import make_python_corpus
    from conftest import fails
    if sys.version_info[:3] != (3, 11, 7):  # the corpus is pinned to that release: then its refusal is the test
        assert "needs CPython 3.11.7" in fails(capsys, f"--out={tmp_path}/p.gz", main=make_python_corpus.main)
        return
    out = tmp_path / "p.jsonl.gz"
    make_python_corpus.main([f"--out={out}"])
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(
        open(os.path.join(ROOT, "data", "python.jsonl.gz"), "rb").read()).digest()
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": {}, "model_args": {}, "config": {}, "step": 0}, ckpt)
    # the other corpus's gzip file, copied: a regression here would replace the copy, not the checkout's data
    shipped = tmp_path / "shakespeare.jsonl.gz"
    shutil.copyfile(os.path.join(ROOT, "data", "shakespeare.jsonl.gz"), shipped)
    before = {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in (ckpt, shipped)}
    for out_flag, said, code in ((ckpt, "not a gzip file", 2), (shipped, "--overwrite=True", 2),
                                 (tmp_path, "is a directory", 2), (tmp_path / "no" / "p.gz", "does not exist", 1),
                                 ("", "--out is empty", 2)):
        msg = fails(capsys, f"--out={out_flag}", code=code, main=make_python_corpus.main)
        assert said in msg, msg
    assert before == {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in (ckpt, shipped)}
    other = tmp_path / "other.gz"
    other.write_bytes(gzip.compress(b"x"))
    assert "--overwrite=True" in fails(capsys, f"--out={other}", code=2, main=make_python_corpus.main)
    make_python_corpus.main([f"--out={other}", "--overwrite=True"])
    assert other.read_bytes() == out.read_bytes()
