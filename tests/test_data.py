"""Tests for data.py: the shard format, the DataLoader and the tokenisers (tools/prepare.py: tests/test_prepare.py).
Run: python -m pytest tests/test_data.py"""

import base64
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
from tokenizer import GPT2_RANKS, get_tokenizer
from conftest import ENV, ROOT

SHIPPED_CORPUS = os.path.join(ROOT, "data", "shakespeare.jsonl.gz")

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
    assert os.listdir(tmp_path) == ["train_000.bin"]  # the shard alone, nothing beside it


def test_write_shard_refuses_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="70000"):
        data.write_shard(str(tmp_path / "a.bin"), [1, 70000], dtype=np.uint16)
    with pytest.raises(ValueError, match="negative"):
        data.write_shard(str(tmp_path / "a.bin"), [1, -1])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_write_shard_refuses_the_first_id_past_its_dtype_and_keeps_the_last_one_that_fits(tmp_path, dtype):
    """uint16 holds 0 .. 65,535: id 65,536 would wrap to 0, so it is refused; 65,535 round-trips (uint32 alike)."""
    top = 2 ** (8 * np.dtype(dtype).itemsize)
    with pytest.raises(ValueError, match=str(top)):
        data.write_shard(str(tmp_path / "a.bin"), np.array([1, top], dtype=np.int64), dtype=dtype)
    assert os.listdir(tmp_path) == []
    data.write_shard(str(tmp_path / "a.bin"), np.array([1, top - 1], dtype=np.int64), dtype=dtype)
    assert data.read_shard(str(tmp_path / "a.bin")).tolist() == [1, top - 1]


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
    elif how == "long":  # one token more than the header counts: never read as a prefix of the file
        raw += bytes(2)
    path.write_bytes(bytes(raw))


# key facts: what was found and what was expected (a shard of 500 uint16 tokens is 1024 + 1000 bytes)
@pytest.mark.parametrize("how, facts", [("magic", ["magic 0", "20240520"]),
                                        ("version", ["version 7"]),
                                        ("truncated", ["2021 bytes", "500 tokens", "2024 bytes"]),
                                        ("short", ["100 bytes", "1024-byte header"]),
                                        ("long", ["2026 bytes", "500 tokens", "2024 bytes"])])
def test_read_shard_refuses_corrupt_files_naming_the_file_and_the_fix(tmp_path, how, facts):
    path = tmp_path / "val_003.bin"
    data.write_shard(str(path), np.arange(500))
    _corrupt(path, how)
    with pytest.raises(ValueError) as e:
        data.read_shard(str(path))
    msg = str(e.value)
    assert str(path) in msg and all(f in msg for f in facts) and "\n" not in msg, msg
    assert f"python -m tools.prepare --out_dir={tmp_path} " in msg and "meta.json" in msg, msg  # the fix


def test_write_shard_over_a_shard_makes_a_new_file_and_a_mapped_one_keeps_its_tokens(tmp_path):
    """Never the old file rewritten in place: a loader that has it mapped keeps reading the tokens it mapped."""
    path = str(tmp_path / "train_000.bin")
    data.write_shard(path, np.arange(500))
    old, before = data.read_shard(path), data.shard_identity(path)
    data.write_shard(path, np.arange(1000, 1500))  # the same size, perhaps within the same clock tick
    assert data.shard_identity(path)[1] != before[1]  # another inode: a running loader sees DataChanged
    assert old[:3].tolist() == [0, 1, 2] and data.read_shard(path)[:3].tolist() == [1000, 1001, 1002]

# -----------------------------------------------------------------------------
# loader


def _shards(d, *arrays, split="train"):
    d.mkdir(parents=True, exist_ok=True)
    for k, a in enumerate(arrays):
        data.write_shard(str(d / f"{split}_{k:03d}.bin"), np.asarray(a))
    return str(d)


def test_loader_rows_are_consecutive_windows_and_y_is_x_shifted(tmp_path):
    d = _shards(tmp_path / "a", np.arange(1000))
    loader = data.DataLoader(d, "train", B=4, T=8, order="sequential")
    for step in range(3):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
        start = step * 32 + 8 * torch.arange(4)[:, None]
        assert torch.equal(x, start + torch.arange(8))
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)


def test_loader_moves_to_next_shard_dropping_the_tail_and_wraps(tmp_path):
    d = _shards(tmp_path / "a", np.arange(20), np.arange(100, 125))
    loader = data.DataLoader(d, "train", B=1, T=8, order="sequential")
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


def test_sweep_reads_every_window_once_across_ranks_padding_with_ignored_targets(tmp_path):
    """The whole-split evaluation: 2 shards of 100 and 45 tokens give 12 + 5 windows of T+1 = 9; B=3 on 2 ranks:
    3 global batches of 6, the last one 5 real rows and 1 padding row whose targets are all -1."""
    d = _shards(tmp_path / "s", np.arange(100), 1000 + np.arange(45), split="val")
    ranks = [list(data.DataLoader(d, "val", B=3, T=8, rank=r, world_size=2).sweep()) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 3  # every rank runs as many forward passes
    starts = [int(x[i, 0]) for r in (0, 1) for x, y in ranks[r] for i in range(len(x)) if (y[i] != -1).all()]
    assert sorted(starts) == [8 * k for k in range(12)] + [1000 + 8 * k for k in range(5)]  # each window once
    x, y = ranks[1][-1]
    assert (y[2] == -1).all() and (y[:2] != -1).all() and torch.equal(y[0, :-1], x[0, 1:])
    one = torch.cat([x for x, _ in data.DataLoader(d, "val", B=6, T=8).sweep()])
    two = torch.cat([torch.cat([ranks[0][k][0], ranks[1][k][0]]) for k in range(3)])
    assert torch.equal(one, two)  # the same rows as one rank with the global batch


def test_shuffled_batch_rows_are_not_consecutive_windows(tmp_path):
    """--data_order=shuffle: the 16 rows of a batch come from all over the split (sequential: 16 neighbours)."""
    d = _shards(tmp_path / "a", np.arange(100_000) % 60_000)
    for order, neighbours in (("sequential", 15), ("shuffle", 0)):
        starts = data.DataLoader(d, "train", B=16, T=64, order=order).next_batch()[0][:, 0].numpy()
        assert int(np.sum(np.diff(starts) == 64)) <= neighbours and (order == "shuffle" or
                                                                    np.all(np.diff(starts) == 64))


def test_loader_default_order_is_shuffle(tmp_path):
    """The measured best order (python -m lab order, lab/results/order.md) is the default; train.py passes
    --data_order anyway, and its evaluations ask for order="sequential"."""
    d = _shards(tmp_path / "a", np.arange(20), np.arange(100, 125))  # windows start at 0, 8 | 100, 108, 116
    default = data.DataLoader(d, "train", B=1, T=8, seed=3)
    assert default.order == "shuffle" and default.state_dict()["order"] == "shuffle"
    starts = _row_starts(default, 10)
    assert starts == _row_starts(data.DataLoader(d, "train", B=1, T=8, order="shuffle", seed=3), 10)
    assert starts != _row_starts(data.DataLoader(d, "train", B=1, T=8, order="sequential"), 10)


def test_loader_refuses_block_size_larger_than_a_shard(tmp_path):
    d = _shards(tmp_path / "a", np.arange(100), np.arange(10))
    with pytest.raises(ValueError) as e:
        data.DataLoader(d, "train", B=1, T=10)
    msg = str(e.value)
    assert "train_001.bin" in msg and "block_size 10" in msg and "10 tokens" in msg and "--block_size" in msg, msg
    assert data.DataLoader(d, "train", B=1, T=9).next_batch()[0].shape == (1, 9)  # T+1 = 10 tokens fit exactly


def test_loader_refuses_missing_shards_and_mixed_tokenizers(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as e:
        data.DataLoader(str(tmp_path / "empty"), "val", B=1, T=4)
    assert "val_*.bin" in str(e.value) and f"python -m tools.prepare --out_dir={tmp_path / 'empty'}" in str(e.value)
    sources = _two_sources(tmp_path)
    for d, name in zip(sources, ["byte", "gpt2"]):
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump({"tokenizer": name}, f)
    with pytest.raises(ValueError, match="tokenizer") as e:
        data.DataLoader(sources, "train", B=1, T=4)
    assert "byte" in str(e.value) and "gpt2" in str(e.value)


def test_one_model_named_by_two_paths_is_one_tokenizer(tmp_path, monkeypatch):
    """Shards of one model's tokenizer, one source prepared with its absolute path and one with a relative path
    (train.py and the lab name it either way): the same tokenizer, mixed without a word; another model still not."""
    model = tmp_path / "models" / "m.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF")
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    sources = _two_sources(tmp_path)
    for d, name in zip(sources, [str(model), "models/m.gguf"]):
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump({"tokenizer": name}, f)
    data.DataLoader(sources, "train", B=1, T=4)
    with open(os.path.join(list(sources)[1], "meta.json"), "w") as f:
        json.dump({"tokenizer": "n.gguf"}, f)
    with pytest.raises(ValueError, match="different tokenizers"):
        data.DataLoader(sources, "train", B=1, T=4)


def test_loader_reads_shards_in_numeric_order(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    for k in range(1001):  # "train_1000.bin" sorts before "train_999.bin" as text
        data.write_shard(str(d / f"train_{k:03d}.bin"), np.full(9, k))
    loader = data.DataLoader(str(d), "train", B=1, T=8, order="sequential")
    loader.load_state_dict(dict(loader.state_dict(), cursor=[999]))  # one window per shard: window 999 is shard 999
    assert [loader.next_batch()[0][0, 0].item() for _ in range(3)] == [999, 1000, 0]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped corpus, byte-tokenised twice with other shard sizes and splits: two sources of several shards."""
    from tools import prepare
    d = tmp_path_factory.mktemp("shipped")
    return (prepare.prepare(tokenizer="byte", out_dir=str(d / "a"), shard_tokens=1_000_000),
            prepare.prepare(tokenizer="byte", out_dir=str(d / "b"), shard_tokens=700_000, val_every=7))


def _digest(batches):
    h = hashlib.sha256()
    for x, y in batches:
        h.update(x.numpy().astype("<i8").tobytes())
        h.update(y.numpy().astype("<i8").tobytes())
    return h.hexdigest()[:16]


# sha256 of the first batches: the measured numbers (lab/results) were trained on these batches, in this order, so
# the loader must keep giving them
PINNED = [  # (sources, order, seed, span, rank, world_size, B, T, batches, digest)
    ("a", "shuffle", 1337, 0, 0, 1, 4, 64, 20, "733b7f44bcecc1ba"),
    ("a", "shuffle", 7, 0, 0, 1, 4, 64, 20, "6a718bda7340981c"),
    ("a", "sequential", 1337, 0, 0, 1, 4, 64, 20, "33193b7cc32af57b"),
    ("a", "curriculum", 1337, 64, 0, 1, 4, 64, 20, "e0de374670bbdc9d"),
    ("a", "curriculum", 7, 0, 0, 1, 4, 64, 20, "c86bdae664f26f64"),
    ("ab", "shuffle", 1337, 0, 1, 2, 4, 64, 20, "8bda6a8efd8e6e45"),  # mixed 1:3, rank 1 of 2
    ("ab", "curriculum", 3, 32, 1, 2, 4, 64, 20, "d8f730b5472473c3"),
    ("a", "shuffle", 5, 600, 0, 1, 32, 4096, 40, "9cee38da08061b1b"),  # 1280 rows of 1180 windows: a new epoch
    ("a", "curriculum", 5, 600, 0, 1, 32, 4096, 40, "37fd5fcffb778ff1"),
    ("a", "sequential", 5, 600, 0, 1, 32, 4096, 40, "578b8da1649862b4"),  # wraps
]


@pytest.mark.slow
@pytest.mark.parametrize("src, order, seed, span, rank, world, B, T, n, digest", PINNED)
def test_loader_gives_the_pinned_batches_of_the_shipped_corpus(shipped, src, order, seed, span, rank, world, B, T, n,
                                                               digest):
    a, b = shipped
    sources = a if src == "a" else {a: 1.0, b: 3.0}
    loader = data.DataLoader(sources, "train", B=B, T=T, seed=seed, order=order, span=span, rank=rank,
                             world_size=world)
    assert _digest(loader.next_batch() for _ in range(n)) == digest


def test_sweep_gives_the_pinned_batches_of_the_shipped_corpus(shipped):
    assert _digest(data.DataLoader(shipped[1], "val", B=16, T=256, rank=1, world_size=2).sweep()) == "f8460147b19a9796"

# -----------------------------------------------------------------------------
# a damaged or changing dataset: refused in one line, never read silently


def _meta(d, **fields):
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(dict({"tokenizer": "byte"}, **fields), f)


def test_loader_refuses_a_shard_set_with_a_gap_naming_the_missing_file(tmp_path):
    d = _shards(tmp_path / "a", *[np.arange(100)] * 4)
    os.remove(os.path.join(d, "train_002.bin"))
    with pytest.raises(ValueError) as e:
        data.DataLoader(d, "train", B=1, T=8)
    msg = str(e.value)
    assert os.path.join(d, "train_002.bin") in msg and "missing" in msg and "python -m tools.prepare" in msg, msg


@pytest.mark.parametrize("fields, facts", [
    (dict(train_tokens=300), ["300 train tokens", "200 tokens"]),  # an old meta.json: token counts only
    (dict(train_tokens=200, train_shards=3), ["3 train shards", "2 shards"])])
def test_loader_refuses_shards_that_disagree_with_meta_json(tmp_path, fields, facts):
    d = _shards(tmp_path / "a", np.arange(100), np.arange(100))
    _meta(d, **fields)
    with pytest.raises(ValueError) as e:
        data.DataLoader(d, "train", B=1, T=8)
    msg = str(e.value)
    assert os.path.join(d, "meta.json") in msg and all(f in msg for f in facts) and "tools.prepare" in msg, msg
    _meta(d, train_tokens=200)  # agreeing counts, without the shard count of an old meta.json: fine
    assert data.DataLoader(d, "train", B=1, T=8).next_batch()[0].shape == (1, 8)


@pytest.mark.parametrize("content, fact", [(b"", "not valid JSON"), (b'{"tokenizer": "byte", ', "not valid JSON"),
                                           (b"\xff\xfe", "not valid JSON"), (b'{"vocab_size": 257}', "tokenizer"),
                                           (b'["byte"]', "tokenizer")])
def test_read_meta_refuses_a_damaged_meta_json_naming_it_and_the_fix(tmp_path, content, fact):
    d = _shards(tmp_path / "a", np.arange(100))
    (tmp_path / "a" / "meta.json").write_bytes(content)
    for call in (lambda: data.read_meta(d), lambda: data.DataLoader(d, "train", B=1, T=8)):
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert os.path.join(d, "meta.json") in msg and fact in msg and "python -m tools.prepare" in msg, msg
    _meta(d)
    assert data.read_meta(d) == {"tokenizer": "byte"}
    os.remove(os.path.join(d, "meta.json"))
    with pytest.raises(ValueError, match="no such file.*python -m tools.prepare"):
        data.read_meta(d)


def _replace_dataset(d, *arrays, split="train"):
    """What tools/prepare.py does to a directory a run is reading: new files (new inodes) under the same names."""
    _shards(d, *arrays, split=split)
    _meta(str(d))


def test_loader_keeps_its_mapped_shard_then_stops_with_data_changed_when_shards_are_replaced(tmp_path):
    d = tmp_path / "a"
    _replace_dataset(d, np.arange(100), np.arange(100, 200))
    loader = data.DataLoader(str(d), "train", B=1, T=8, order="sequential")
    assert loader.next_batch()[0][0, 0].item() == 0
    _replace_dataset(d, np.arange(1000, 1100), np.arange(1100, 1150))  # re-prepared: other data, shorter shard
    # the shard it has mapped stays the old file, read consistently: windows 8, 16, ..., 88 of the old shard 0
    assert [loader.next_batch()[0][0, 0].item() for _ in range(11)] == list(range(8, 96, 8))
    with pytest.raises(data.DataChanged) as e:  # moving on to shard 1 finds another file there
        loader.next_batch()
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and str(d) in msg and "changed" in msg and "--resume=True" in msg, msg


def test_loader_reset_for_evaluation_stops_with_data_changed_after_a_re_prepare(tmp_path):
    d = tmp_path / "a"
    _replace_dataset(d, np.arange(500), split="val")
    val = data.DataLoader(str(d), "val", B=2, T=16, order="sequential")  # as train.py evaluates
    first = val.next_batch()[0]
    val.reset()
    assert torch.equal(val.next_batch()[0], first)
    _replace_dataset(d, np.arange(20), split="val")  # a smaller val shard: rows of the old length would not fit
    val.reset()
    with pytest.raises(data.DataChanged, match="tools.prepare"):
        val.next_batch()
    os.remove(d / "val_000.bin")  # a directory being swapped away: a missing shard is a change too
    val.reset()
    with pytest.raises(data.DataChanged, match="changed"):
        val.next_batch()

# -----------------------------------------------------------------------------
# tokenisers and the shipped assets


def test_shipped_assets_are_the_documented_files_inside_the_repo():
    # data/README.md lists these sums; prepare.SHAKESPEARE is checked in tests/test_prepare.py
    expected = {"gpt2.tiktoken": "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
                "shakespeare.jsonl.gz": "9341b58f5b2795fe9e17259d9cba5c0fe5d7f9d8eab2e2db796c81d586903aeb",
                "python.jsonl.gz": "29456fd35da3476c7975cf5433899412ef7e5ce6bdd078a004b2a039bac44399"}
    assert GPT2_RANKS == os.path.join(ROOT, "data", "gpt2.tiktoken")
    for name, sha in expected.items():
        with open(os.path.join(ROOT, "data", name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sha, name


def test_gpt2_known_token_ids():
    tok = get_tokenizer("gpt2")
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
    with open(GPT2_RANKS, "rb") as f:
        ranks = {base64.b64decode(tok): int(r) for tok, r in (line.split() for line in f if line.strip())}
    assert len(ranks) == 50256
    with gzip.open(SHIPPED_CORPUS, "rt", encoding="utf-8") as f:
        text = json.loads(f.readline())["text"][:4000]
    assert text.isascii()
    assert get_tokenizer("gpt2").encode(text) == _pure_python_gpt2(text, ranks)


def test_gpt2_round_trips_unicode_and_batches_like_single_calls():
    tok = get_tokenizer("gpt2")
    texts = ["naïve café — Tōkyō 東京 🙂\n\ttabs  and   spaces ", "Hello world", ""]
    assert [tok.decode(tok.encode(s)) for s in texts] == texts
    assert tok.encode_batch(texts) == [tok.encode(s) for s in texts]


def test_byte_tokenizer_round_trip_eot_and_vocab():
    tok = get_tokenizer("byte")
    assert (tok.name, tok.eot, tok.vocab_size) == ("byte", 256, 257)
    s = "naïve 東京 🙂\n"
    assert tok.encode(s) == list(s.encode("utf-8"))
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode_batch([s, "", "ab"]) == [tok.encode(s), [], [97, 98]]
    assert tok.decode([256] + tok.encode(s) + [256]) == s  # eot decodes to nothing
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character is replaced, not an exception


def test_get_tokenizer_rejects_unknown_name_and_lists_valid_ones():
    with pytest.raises(ValueError, match="byte, gpt2"):
        get_tokenizer("sentencepiece")

# -----------------------------------------------------------------------------
# the module as a file to copy


def _python(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=120)


def _copied_alone(tmp_path, script, tiktoken=True, files=("data.py", "tokenizer.py")):
    """Run script beside copies of data.py and tokenizer.py alone in an empty directory, as when they are copied
    into another project (no data/ folder, no other repository file importable); tiktoken=False makes importing
    it fail."""
    alone = tmp_path / "project"
    shutil.rmtree(alone, ignore_errors=True)
    alone.mkdir()
    for name in files:
        shutil.copy(os.path.join(ROOT, name), alone)
    prelude = "import sys\n" + ("" if tiktoken else 'sys.modules["tiktoken"] = None  # import tiktoken now fails\n')
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", prelude + script], cwd=alone, capture_output=True, text=True,
                          env=env, timeout=120), alone


@pytest.mark.slow
def test_data_and_tokenizer_copied_alone_work_without_tiktoken_until_gpt2_is_asked_for(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    script = f"""import data, tokenizer
print(data.__file__)
data.write_shard({str(shards / "train_000.bin")!r}, [256] + tokenizer.get_tokenizer("byte").encode("hello"))
x, y = data.DataLoader({str(shards)!r}, "train", B=1, T=5).next_batch()
print(tokenizer.get_tokenizer("byte").decode(x[0].tolist() + y[0, -1:].tolist()))
try:
    tokenizer.get_tokenizer("gpt2")
except (ImportError, FileNotFoundError) as e:
    print(type(e).__name__, e)"""
    p, alone = _copied_alone(tmp_path, script, tiktoken=False)
    out = p.stdout.split("\n")
    assert p.returncode == 0 and out[:2] == [str(alone / "data.py"), "hello"], p.stdout + p.stderr
    assert out[2].startswith("ImportError") and "pip install tiktoken" in out[2], out[2]
    # with tiktoken, the missing vocabulary file: where it comes from, and that tiktoken cannot fetch it offline
    p, _ = _copied_alone(tmp_path, script)
    err = p.stdout.split("\n")[2]
    assert err.startswith("FileNotFoundError") and str(alone / "data" / "gpt2.tiktoken") in err, p.stdout + p.stderr
    assert "data/gpt2.tiktoken" in err and "ships with nanoBitNet" in err and "offline" in err and "byte" in err, err
    # data.py needs no tokenizer at all: shards and the loader work with it alone
    p, _ = _copied_alone(tmp_path, f"""import data
data.write_shard({str(shards / "train_000.bin")!r}, [256, 104, 105, 33, 10, 256, 104, 105])
print(data.DataLoader({str(shards)!r}, "train", B=1, T=5).next_batch()[0].tolist())""", files=("data.py",))
    assert p.returncode == 0 and p.stdout.strip() == "[[256, 104, 105, 33, 10]]", p.stdout + p.stderr


@pytest.mark.slow
def test_data_py_copied_alone_refuses_a_bad_shard_in_one_line(tmp_path):
    """Without tools/prepare.py beside it, data.py still checks every shard: a bad magic, another version, a file
    cut short, a header whose token count disagrees with the file, and shards that disagree with meta.json."""
    d = tmp_path / "s"
    script = f"""import json, os, struct, data
d = {str(d)!r}
os.makedirs(d)
def shard(damage):
    path = os.path.join(d, "train_000.bin")
    data.write_shard(path, list(range(500)))
    raw = bytearray(open(path, "rb").read())
    if damage == "magic": raw[0:4] = struct.pack("<i", 0)
    if damage == "version": raw[4:8] = struct.pack("<i", 7)
    if damage == "truncated": raw = raw[:-3]
    if damage == "count": raw[8:12] = struct.pack("<i", 499)
    open(path, "wb").write(bytes(raw))
    json.dump({{"tokenizer": "byte", "train_tokens": 501 if damage == "meta" else 500}}, open(os.path.join(d, "meta.json"), "w"))
for damage in ("none", "magic", "version", "truncated", "count", "meta"):
    shard(damage)
    try:
        print(damage, data.DataLoader(d, "train", B=1, T=8).next_batch()[0].shape)
    except ValueError as e:
        print(damage, str(e).replace(chr(10), "NEWLINE"))"""
    p, _ = _copied_alone(tmp_path, script, files=("data.py",))
    out = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    assert p.returncode == 0 and list(out) == ["none", "magic", "version", "truncated", "count", "meta"], p.stdout + p.stderr
    assert out.pop("none") == "torch.Size([1, 8])"
    facts = {"magic": "bad magic 0", "version": "version 7", "truncated": "2021 bytes", "count": "499 tokens",
             "meta": "501 train tokens"}
    for damage, msg in out.items():
        assert facts[damage] in msg and str(d) in msg and "NEWLINE" not in msg, (damage, msg)


def test_data_py_opens_with_the_format_and_the_loader():
    """A learner finds the shard format (documented once, in the docstring) and the loader on the first screens;
    the checks come after them."""
    import ast
    with open(os.path.join(ROOT, "data.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    line = {n.name: n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert line["write_shard"] < line["read_shard"] < line["DataLoader"] <= 100, line
    assert max(line["DataLoader"], line["find_shards"]) < min(v for k, v in line.items() if k.startswith("_check")), line
    doc = ast.get_docstring(tree)
    assert all(f in doc for f in ("20240520", "version", "n_tokens", "uint16", "uint32", "1024")), doc


@pytest.mark.slow
def test_data_py_with_the_old_tokenising_flags_points_to_prepare_py():
    p = _python("data.py", "--tokenizer=byte")
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and "python -m tools.prepare --tokenizer=byte" in err[0], p.stderr

# -----------------------------------------------------------------------------
# data orders: shuffled and curriculum (easy-to-hard)


def _scored(tmp_path, *shards, T=8, name="c"):
    """Shards whose windows of T have known difficulty scores: window w of the whole source scores
    score_of(first token of w) = a fixed pseudo-random number, written as tools/prepare.py writes them."""
    d = _shards(tmp_path / name, *shards)
    for k, a in enumerate(shards):
        a = np.asarray(a)
        per_chunk = (a[::data.DIFFICULTY_CHUNK] * 7919 % 1000).astype(np.float32)  # one score per chunk
        np.save(data.difficulty_path(os.path.join(d, f"train_{k:03d}.bin")), per_chunk)
    return d


def _row_starts(loader, n):
    return [int(v) for _ in range(n) for v in loader.next_batch()[0][:, 0]]


def test_shuffle_reads_every_window_once_per_epoch_in_a_seeded_order(tmp_path):
    d = _shards(tmp_path / "a", np.arange(20), np.arange(100, 125))  # windows start at 0, 8 | 100, 108, 116
    shuffled = data.DataLoader(d, "train", B=1, T=8, order="shuffle", seed=3)
    a = _row_starts(shuffled, 10)
    assert sorted(a[:5]) == sorted(a[5:]) == [0, 8, 100, 108, 116] and a[:5] != a[5:]  # new permutation each epoch
    assert _row_starts(data.DataLoader(d, "train", B=1, T=8, order="shuffle", seed=3), 10) == a  # seeded
    assert _row_starts(data.DataLoader(d, "train", B=1, T=8, order="shuffle", seed=4), 10) != a


def test_curriculum_reads_the_shuffled_windows_easy_to_hard(tmp_path):
    """Each block of span rows holds exactly the windows a shuffled loader reads in those rows, sorted by the
    difficulty tools/prepare.py wrote: the two orders differ only in order."""
    C = data.DIFFICULTY_CHUNK
    d = _scored(tmp_path, np.arange(40 * C), np.arange(40 * C, 70 * C))
    T, span = C, 24  # one chunk per window
    score = {int(t): float(t * 7919 % 1000) for t in range(0, 70 * C, C)}
    cur = data.DataLoader(d, "train", B=4, T=T, order="curriculum", span=span, seed=1)
    shuf = data.DataLoader(d, "train", B=4, T=T, order="shuffle", seed=1)
    for block in range(3):  # 6 batches of 4 = one block of 24
        c, s = _row_starts(cur, 6), _row_starts(shuf, 6)
        assert sorted(c) == sorted(s)
        assert [score[t] for t in c] == sorted(score[t] for t in c)  # ascending difficulty
    # span 0: one block = one epoch (39 + 29 windows: a shard's last chunk has no token after it), sorted through
    whole = _row_starts(data.DataLoader(d, "train", B=4, T=T, order="curriculum", seed=1), 17)
    starts = [*range(0, 39 * C, C), *range(40 * C, 69 * C, C)]
    assert sorted(whole) == starts and [score[t] for t in whole] == sorted(score[t] for t in starts)


def test_curriculum_blocks_of_weighted_sources_are_their_share_of_span(tmp_path):
    """Two sources mixed 1:3 and span = 24 rows: each source's curriculum block is its share of the span, 6 and 18
    windows, so block by block it reads the windows the shuffled loader reads from that source, sorted
    easy-to-hard (a block of 24 from each would read a's 6 easiest of 24 where the shuffled run reads 6 others)."""
    C = data.DIFFICULTY_CHUNK
    a = _scored(tmp_path, np.arange(60 * C), name="a")
    b = _scored(tmp_path, np.arange(100 * C, 160 * C), name="b")  # tokens >= 100 C: rows of b are told apart

    def score(t):  # _scored's difficulty of the window starting at token t
        return float(t * 7919 % 1000)
    streams = {}
    for order in ("curriculum", "shuffle"):
        loader = data.DataLoader({a: 1.0, b: 3.0}, "train", B=4, T=C, order=order, span=24, seed=2)
        rows = _row_starts(loader, 24)  # 96 rows: 4 blocks of 24
        streams[order] = {src: [t for t in rows if (t >= 100 * C) == (src == "b")] for src in "ab"}
    for src, block in (("a", 6), ("b", 18)):
        cur, shuf = streams["curriculum"][src], streams["shuffle"][src]
        n = len(cur) // block * block  # whole blocks only
        assert n >= 2 * block and len(shuf) == len(cur)
        for i in range(0, n, block):
            got = cur[i:i + block]
            assert sorted(got) == sorted(shuf[i:i + block]), (src, i)
            assert [score(t) for t in got] == sorted(score(t) for t in got), (src, i)


@pytest.mark.parametrize("order", ["shuffle", "curriculum"])
def test_ordered_loader_is_rank_aware_and_resumes_exactly(tmp_path, order):
    C = data.DIFFICULTY_CHUNK
    d = _scored(tmp_path, np.arange(30 * C), np.arange(30 * C, 50 * C))
    kw = dict(T=C // 2, order=order, span=20, seed=5)
    ranks = [data.DataLoader(d, "train", B=2, rank=r, world_size=2, **kw) for r in range(2)]
    single = data.DataLoader(d, "train", B=4, **kw)
    for _ in range(15):  # crosses blocks and an epoch (99 windows of 128)
        x = single.next_batch()[0]
        assert torch.equal(torch.cat([ld.next_batch()[0] for ld in ranks]), x)
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    buf = io.BytesIO()
    torch.save({"loader": single.state_dict()}, buf)
    expected = [single.next_batch()[0] for _ in range(40)]
    buf.seek(0)
    fresh = data.DataLoader(d, "train", B=4, **dict(kw, span=999))  # a resumed run keeps its saved span
    fresh.load_state_dict(torch.load(buf, weights_only=True)["loader"])
    assert all(torch.equal(a, fresh.next_batch()[0]) for a in expected)


def test_curriculum_refuses_shards_without_scores_and_resume_with_another_order(tmp_path):
    d = _shards(tmp_path / "a", np.arange(100))
    with pytest.raises(ValueError, match="difficulty.npy") as e:
        data.DataLoader(d, "train", B=1, T=8, order="curriculum")
    assert "tools.prepare" in str(e.value)
    with pytest.raises(ValueError, match="data order"):
        data.DataLoader(d, "train", B=1, T=8, order="random")
    sd = data.DataLoader(d, "train", B=1, T=8, order="shuffle").state_dict()
    with pytest.raises(ValueError, match="--data_order=shuffle"):
        data.DataLoader(d, "train", B=1, T=8, order="sequential").load_state_dict(sd)


def test_loader_refuses_a_state_from_before_orders(tmp_path):
    """A loader state holding "pos", (shard, offset) per source, and no cursor (an older layout): refused in one
    line rather than guessed (tools/checkpoint.py's load names such a checkpoint first, tests/test_fault.py)."""
    d = _shards(tmp_path / "a", np.arange(20), np.arange(100, 125))
    loader = data.DataLoader(d, "train", B=1, T=8, order="sequential")
    sd = {k: v for k, v in loader.state_dict().items() if k not in ("order", "span", "cursor")}
    with pytest.raises(ValueError) as e:
        loader.load_state_dict(dict(sd, pos=[[1, 8]]))
    assert "pos" in str(e.value) and "lacks" in str(e.value) and "\n" not in str(e.value)


def test_difficulty_is_the_zlib_ratio_of_each_chunk_and_prepare_writes_it(tmp_path):
    import zlib

    from tools import prepare
    tok = get_tokenizer("byte")
    rep, varied = b"ab" * 128, bytes(np.random.default_rng(0).integers(32, 127, 256, dtype=np.uint8))
    scores = prepare.difficulty(np.frombuffer(rep + varied, dtype=np.uint8).astype(np.int64), tok.decode_bytes)
    assert scores.tolist() == pytest.approx([len(zlib.compress(rep, 9)) / 256, len(zlib.compress(varied, 9)) / 256])
    assert scores[0] < 0.2 < 0.8 < scores[1]  # a refrain is easy, noise is hard
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in ["la " * 500, "x", "The quick brown fox. " * 40]))
    out = prepare.prepare([str(src)], tokenizer="byte", out_dir=str(tmp_path / "s"), val_every=2)
    toks = data.read_shard(os.path.join(out, "train_000.bin"))
    saved = np.load(data.difficulty_path(os.path.join(out, "train_000.bin")))
    assert saved.tolist() == prepare.difficulty(np.asarray(toks), tok.decode_bytes).tolist()
    assert len(saved) == -(-len(toks) // data.DIFFICULTY_CHUNK)
