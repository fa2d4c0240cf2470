"""Tests for data.py: tokenisers, the shard format, prepare() and the DataLoader.
Run: python -m pytest tests/test_data.py"""

import base64
import gzip
import hashlib
import io
import json
import os
import re
import struct
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402

# -----------------------------------------------------------------------------
# shipped assets and tokenisers


def test_shipped_assets_are_the_documented_files_inside_the_repo():
    repo_data = os.path.join(os.path.dirname(os.path.abspath(data.__file__)), "data")
    expected = {"gpt2.tiktoken": "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
                "shakespeare.jsonl.gz": "9341b58f5b2795fe9e17259d9cba5c0fe5d7f9d8eab2e2db796c81d586903aeb"}
    for name, sha in expected.items():
        path = os.path.join(repo_data, name)
        assert path in (data.GPT2_RANKS, data.SHAKESPEARE)
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sha, name


def test_gpt2_known_token_ids():
    tok = data.get_tokenizer("gpt2")
    assert (tok.name, tok.eot, tok.vocab_size) == ("gpt2", 50256, 50257)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("hello world") == [31373, 995]  # tiktoken's documented example
    assert tok.encode(" the") == [262]
    # the special token's text is ordinary text for encode: tiktoken documents these ids for it
    assert tok.encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]
    assert tok.decode([50256]) == "<|endoftext|>"


def _pure_python_gpt2(text, ranks):
    """GPT-2 BPE written out independently of tiktoken: split with GPT-2's pattern (ASCII classes, valid for
    ASCII text), then merge the adjacent pair of lowest rank until no pair is in the vocabulary."""
    ids = []
    for piece in re.findall(r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^ \t\n\r\f\vA-Za-z0-9]+"
                            r"|[ \t\n\r\f\v]+(?![^ \t\n\r\f\v])|[ \t\n\r\f\v]+", text):
        parts = [bytes([b]) for b in piece.encode()]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 30))
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def test_gpt2_matches_pure_python_bpe_on_shakespeare():
    with open(data.GPT2_RANKS, "rb") as f:
        ranks = {base64.b64decode(tok): int(r) for tok, r in (line.split() for line in f if line.strip())}
    assert len(ranks) == 50256
    with gzip.open(data.SHAKESPEARE, "rt", encoding="utf-8") as f:
        text = json.loads(f.readline())["text"][:4000]
    assert text.isascii()
    assert data.get_tokenizer("gpt2").encode(text) == _pure_python_gpt2(text, ranks)


def test_gpt2_round_trips_unicode_and_batches_like_single_calls():
    tok = data.get_tokenizer("gpt2")
    texts = ["naïve café — Tōkyō 東京 🙂\n\ttabs  and   spaces ", "Hello world", ""]
    assert [tok.decode(tok.encode(s)) for s in texts] == texts
    assert tok.encode_batch(texts) == [tok.encode(s) for s in texts]


def test_byte_tokenizer_round_trip_eot_and_vocab():
    tok = data.get_tokenizer("byte")
    assert (tok.name, tok.eot, tok.vocab_size) == ("byte", 256, 257)
    s = "naïve 東京 🙂\n"
    assert tok.encode(s) == list(s.encode("utf-8"))
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode_batch([s, "", "ab"]) == [tok.encode(s), [], [97, 98]]
    assert tok.decode([256] + tok.encode(s) + [256]) == s  # eot decodes to nothing
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character is replaced, not an exception


def test_get_tokenizer_rejects_unknown_name_and_lists_valid_ones():
    with pytest.raises(ValueError, match="byte, gpt2"):
        data.get_tokenizer("sentencepiece")

# -----------------------------------------------------------------------------
# shards


@pytest.mark.parametrize("top, version, dtype", [(50256, 1, np.uint16), (65535, 1, np.uint16),
                                                 (65536, 2, np.uint32), (200_000, 2, np.uint32)])
def test_shard_round_trip_and_header_layout(tmp_path, top, version, dtype):
    tokens = np.random.default_rng(0).integers(0, top + 1, size=1001)
    tokens[0] = top
    path = tmp_path / "train_000.bin"
    data.write_shard(str(path), tokens)
    raw = path.read_bytes()
    header = struct.unpack("<256i", raw[:1024])  # read independently of data.py
    assert header[:3] == (20240520, version, 1001) and not any(header[3:])
    assert len(raw) == 1024 + 1001 * np.dtype(dtype).itemsize
    got = data.read_shard(str(path))
    assert isinstance(got, np.memmap) and got.dtype == dtype
    np.testing.assert_array_equal(got, tokens)
    assert os.listdir(tmp_path) == ["train_000.bin"]  # the temporary file was renamed, none left behind


def test_write_shard_refuses_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="70000"):
        data.write_shard(str(tmp_path / "a.bin"), [1, 70000], dtype=np.uint16)
    with pytest.raises(ValueError, match="negative"):
        data.write_shard(str(tmp_path / "a.bin"), [1, -1])
    assert os.listdir(tmp_path) == []


def _corrupt(path, how):
    raw = bytearray(path.read_bytes())
    if how == "magic":
        raw[0:4] = struct.pack("<i", 0)
    elif how == "version":
        raw[4:8] = struct.pack("<i", 7)
    elif how == "truncated":
        raw = raw[:-3]
    elif how == "short":
        raw = raw[:100]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how, phrase", [("magic", "bad magic 0 (expected 20240520)"),
                                         ("version", "unsupported version 7"),
                                         ("truncated", "truncated"),
                                         ("short", "shorter than the 1024-byte header")])
def test_read_shard_refuses_corrupt_files_naming_the_file(tmp_path, how, phrase):
    path = tmp_path / "val_003.bin"
    data.write_shard(str(path), np.arange(500))
    _corrupt(path, how)
    with pytest.raises(ValueError) as e:
        data.read_shard(str(path))
    msg = str(e.value)
    assert str(path) in msg and phrase in msg and "\n" not in msg
    assert "data.py" in msg  # says what to run


def test_read_shard_error_says_how_to_remake_a_prepared_dataset(tmp_path):
    corpus = str(_write_corpus(tmp_path) / "*")
    out = data.prepare([corpus], tokenizer="byte", out_dir=str(tmp_path / "ds"), val_every=3)
    shard = tmp_path / "ds" / "train_000.bin"
    _corrupt(shard, "magic")
    with pytest.raises(ValueError, match=re.escape(f"re-run: python data.py --tokenizer=byte --out_dir={out}")):
        data.read_shard(str(shard))

# -----------------------------------------------------------------------------
# prepare


DOCS_TXT = "First document.\nIt has two lines.\n"
DOCS_JSONL = ["Second: jsonl line one.", "Third \u2014 with a dash.", "", "Fourth."]  # "" is skipped
DOCS_GZ = ["Fifth, from gzip.", "Sixth: caf\u00e9.", "Seventh and last."]
DOCS = [DOCS_TXT] + [d for d in DOCS_JSONL if d] + DOCS_GZ  # 7 documents in source order


def _write_corpus(tmp_path):
    """Writes a.txt, b.jsonl, c.jsonl.gz; returns the directory."""
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    (d / "a.txt").write_text(DOCS_TXT, encoding="utf-8")
    lines = [json.dumps({"text": t, "title": "x"}) for t in DOCS_JSONL]
    (d / "b.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n", encoding="utf-8")  # a blank line too
    with gzip.open(d / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps({"text": t}) for t in DOCS_GZ))
    return d


def _read_split(out_dir, split):
    names = sorted(n for n in os.listdir(out_dir) if re.fullmatch(rf"{split}_\d+\.bin", n))
    return [data.read_shard(os.path.join(out_dir, n)) for n in names]


@pytest.mark.parametrize("tokenizer", ["byte", "gpt2"])
def test_prepare_splits_by_document_with_eot_prepended(tmp_path, tokenizer):
    d = _write_corpus(tmp_path)
    tok = data.get_tokenizer(tokenizer)
    sources = [str(d / "a.txt"), str(d / "b.jsonl"), str(d / "c.*")]  # a glob too
    out = data.prepare(sources, tokenizer=tokenizer, out_dir=str(tmp_path / "out"), val_every=3, shard_tokens=16)
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
    assert meta == dict(meta, tokenizer=tokenizer, vocab_size=tok.vocab_size, eot=tok.eot, dtype="uint16",
                        n_docs_train=5, n_docs_val=2, train_tokens=len(expect["train"]),
                        val_tokens=len(expect["val"]), sources=[str(d / n) for n in ("a.txt", "b.jsonl", "c.jsonl.gz")])
    train = np.concatenate(_read_split(out, "train"))
    assert train[0] == tok.eot and (train == tok.eot).sum() == 5  # one eot per document, at its start


def test_prepare_is_deterministic_and_expands_globs_in_sorted_order(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    for name in ["doc2.txt", "doc10.txt", "doc1.txt"]:
        (d / name).write_text(name)
    outs = [data.prepare([str(d / "doc*.txt")], out_dir=str(tmp_path / f"o{k}"), val_every=2) for k in range(2)]
    train, val = (bytes(np.concatenate(_read_split(outs[0], s))) for s in ("train", "val"))
    assert data.get_tokenizer("byte").decode(np.frombuffer(val, np.uint16).tolist()) == "doc10.txt"
    assert data.get_tokenizer("byte").decode(np.frombuffer(train, np.uint16).tolist()) == "doc1.txtdoc2.txt"
    for name in os.listdir(outs[0]):
        if name.endswith(".bin"):
            assert (tmp_path / "o0" / name).read_bytes() == (tmp_path / "o1" / name).read_bytes()


def test_prepare_puts_last_document_in_val_when_val_every_exceeds_the_corpus(tmp_path):
    d = _write_corpus(tmp_path)
    out = data.prepare([str(d / "b.jsonl")], out_dir=str(tmp_path / "o"), val_every=20)
    tok = data.get_tokenizer("byte")
    np.testing.assert_array_equal(np.concatenate(_read_split(out, "val")), [256] + tok.encode("Fourth."))
    assert (np.concatenate(_read_split(out, "train")) == 256).sum() == 2


def test_prepare_replaces_stale_shards_of_an_earlier_run(tmp_path):
    d = _write_corpus(tmp_path)
    out = str(tmp_path / "o")
    data.prepare([str(d / "*")], out_dir=out, val_every=3, shard_tokens=10)
    assert len(_read_split(out, "train")) > 5
    data.prepare([str(d / "*")], out_dir=out, val_every=3)
    assert sorted(os.listdir(out)) == ["meta.json", "train_000.bin", "val_000.bin"]


@pytest.mark.parametrize("contents, phrase", [(["", '{"text": ""}\n'], "empty corpus"),
                                              (["only one", "\n"], "only one document")])
def test_prepare_refuses_corpus_without_two_documents_and_writes_nothing(tmp_path, contents, phrase):
    (tmp_path / "a.txt").write_text(contents[0])
    (tmp_path / "b.jsonl").write_text(contents[1])
    with pytest.raises(ValueError, match=phrase):
        data.prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], out_dir=str(tmp_path / "o"))
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.jsonl"]


def test_prepare_names_file_and_byte_offset_of_invalid_utf8(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"hello \xff world")
    with pytest.raises(ValueError, match=r"bad\.txt: not UTF-8: byte 0xff at byte offset 6"):
        data.prepare([str(tmp_path / "bad.txt")], out_dir=str(tmp_path / "o"))
    line1 = b'{"text": "fine"}\n'
    (tmp_path / "bad.jsonl").write_bytes(line1 + b'{"text": "caf\xe9"}\n')  # latin-1 e-acute
    with pytest.raises(ValueError, match=rf"bad\.jsonl: not UTF-8: byte 0xe9 at byte offset {len(line1) + 13}"):
        data.prepare([str(tmp_path / "bad.jsonl")], out_dir=str(tmp_path / "o"))


def test_prepare_names_missing_sources_and_bad_lines(tmp_path):
    with pytest.raises(ValueError, match="nope.txt: no such file"):
        data.prepare([str(tmp_path / "nope.txt")], out_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError, match="is a directory"):
        data.prepare([str(tmp_path)], out_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError, match=r"nothing\*.txt: the pattern matches no file"):
        data.prepare([str(tmp_path / "nothing*.txt")], out_dir=str(tmp_path / "o"))
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: expected a JSON object"):
        data.prepare([str(tmp_path / "x.jsonl")], out_dir=str(tmp_path / "o"))


def test_cli_bad_flag_exits_2_with_one_line(capsys):
    assert data.main(["--bogus=1"]) == 2
    assert data.main(["--tokenizer=sentencepiece"]) == 2
    assert data.main(["--val_every=x"]) == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 3 and "--bogus=1" in err[0] and "byte, gpt2" in err[1]


def test_cli_prepares_a_corpus_and_reports_errors_in_one_line(tmp_path, capsys):
    d = _write_corpus(tmp_path)
    assert data.main([f"--out_dir={tmp_path / 'o'}", "--val_every=2", str(d / "*")]) == 0
    out = capsys.readouterr().out
    assert "train: 4 docs" in out and "decoded: 'First document." in out
    assert os.path.exists(tmp_path / "o" / "val_000.bin")
    assert data.main([str(tmp_path / "missing.txt")]) == 1
    assert capsys.readouterr().err.count("\n") == 1

# -----------------------------------------------------------------------------
# loader


def _shards(d, *arrays, split="train"):
    d.mkdir(parents=True, exist_ok=True)
    for k, a in enumerate(arrays):
        data.write_shard(str(d / f"{split}_{k:03d}.bin"), np.asarray(a))
    return str(d)


def test_loader_rows_are_consecutive_windows_and_y_is_x_shifted(tmp_path):
    d = _shards(tmp_path / "a", np.arange(1000))
    loader = data.DataLoader(d, "train", B=4, T=8)
    for step in range(3):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
        start = step * 32 + 8 * torch.arange(4)[:, None]
        assert torch.equal(x, start + torch.arange(8))
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)


def test_loader_moves_to_next_shard_dropping_the_tail_and_wraps(tmp_path):
    d = _shards(tmp_path / "a", np.arange(20), np.arange(100, 125))
    loader = data.DataLoader(d, "train", B=1, T=8)
    starts = [loader.next_batch()[0][0, 0].item() for _ in range(7)]
    # shard 0 fits windows at 0, 8 (16+9 > 20); shard 1 at 0, 8, 16 (24+9 > 25); then shard 0 again
    assert starts == [0, 8, 100, 108, 116, 0, 8]


def _two_sources(tmp_path):
    a = _shards(tmp_path / "a", np.arange(0, 150), np.arange(150, 500))
    b = _shards(tmp_path / "b", np.arange(1000, 1150), np.arange(1150, 1400), np.arange(1400, 1500))
    return {a: 1.0, b: 3.0}


def test_loader_resumes_exactly_from_state_dict_with_two_sources(tmp_path):
    sources = _two_sources(tmp_path)
    loader = data.DataLoader(sources, "train", B=3, T=16, seed=7)
    first = [loader.next_batch() for _ in range(5)]
    buf = io.BytesIO()
    torch.save({"loader": loader.state_dict()}, buf)  # as inside a checkpoint
    expected = [loader.next_batch() for _ in range(9)]  # long enough to cross shard ends
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)["loader"]
    fresh = data.DataLoader(sources, "train", B=3, T=16, seed=7)
    fresh.load_state_dict(sd)
    for (x0, y0), (x1, y1) in zip(expected, [fresh.next_batch() for _ in range(9)]):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    loader.reset()
    assert all(torch.equal(loader.next_batch()[0], x) for x, _ in first)


def test_loader_ranks_together_equal_one_rank_with_the_global_batch(tmp_path):
    sources = _two_sources(tmp_path)
    ranks = [data.DataLoader(sources, "train", B=3, T=16, rank=r, world_size=2) for r in range(2)]
    single = data.DataLoader(sources, "train", B=6, T=16)
    for _ in range(12):
        x, y = single.next_batch()
        parts = [ld.next_batch() for ld in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()


def test_loader_mixing_proportions_match_weights(tmp_path):
    sources = _two_sources(tmp_path)  # weights 1 : 3, source b has tokens >= 1000
    loader = data.DataLoader(sources, "train", B=16, T=4, seed=123)
    n = 16 * 400
    from_b = sum(int((loader.next_batch()[0][:, 0] >= 1000).sum()) for _ in range(400))
    p = 0.75
    sigma = (n * p * (1 - p)) ** 0.5  # binomial standard deviation, about 35 rows
    assert abs(from_b - n * p) < 4 * sigma


def test_loader_refuses_block_size_larger_than_a_shard(tmp_path):
    d = _shards(tmp_path / "a", np.arange(100), np.arange(10))
    with pytest.raises(ValueError, match=r"train_001\.bin: block_size 10 is too large.*lower --block_size"):
        data.DataLoader(d, "train", B=1, T=10)
    data.DataLoader(d, "train", B=1, T=9)  # T+1 = 10 tokens fit exactly


def test_loader_refuses_missing_shards_and_mixed_tokenizers(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no val_\*\.bin shards.*python data.py"):
        data.DataLoader(str(tmp_path / "empty"), "val", B=1, T=4)
    sources = _two_sources(tmp_path)
    for d, name in zip(sources, ["byte", "gpt2"]):
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump({"tokenizer": name}, f)
    with pytest.raises(ValueError, match="different tokenizers"):
        data.DataLoader(sources, "train", B=1, T=4)


def test_loader_reads_shards_in_numeric_order(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    for k in (1000, 999):  # "train_1000.bin" sorts before "train_999.bin" as text
        data.write_shard(str(d / f"train_{k}.bin"), np.full(9, k))
    loader = data.DataLoader(str(d), "train", B=1, T=8)
    assert [loader.next_batch()[0][0, 0].item() for _ in range(2)] == [999, 1000]
