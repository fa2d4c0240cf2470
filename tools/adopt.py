"""
Adopt llm.c-format token shards (llm.c's and modded-nanogpt's fineweb_train_*.bin /
fineweb_val_*.bin, or ours) as a dataset without re-tokenising: python -m tools.prepare
--adopt=<dir> --out_dir=<dir>.

Each shard's header and size are checked, its ids checked against the tokenizer's vocabulary, then
the shards are hard-linked (copied across file systems) in order as train_000.bin, ... and
val_000.bin, ..., with a meta.json, into a directory that replaces out_dir whole (tools/atomic.py
atomic_dir), as tools/prepare.py does. Test:
    python -m pytest tests/test_prepare.py -k adopt
"""

import json
import os
import re
import shutil

import data
from tokenizer import fingerprint, get_tokenizer
from tools import prepare
from tools.atomic import atomic_dir

# llm.c's shard names: fineweb_train_000001.bin; ours: train_000.bin
LLMC_SHARD = re.compile(r"(?:.*_)?(train|val)_?(\d+)\.bin")


def adopt(src, out_dir, tokenizer, overwrite=False):
    """Make out_dir a dataset of the llm.c-format shards in src (llm.c's and modded-nanogpt's
    fineweb_train_*.bin, fineweb_val_*.bin: the header format is ours) without re-tokenising: each
    shard's header and size checked, its ids checked against the tokenizer's vocabulary, then
    hard-linked (copied across file systems) in order as train_000.bin, ... and val_000.bin, ...,
    with a meta.json. No difficulty scores: not for --data_order=curriculum. Refused before a shard
    is read: no out_dir, out_dir = src, a shipped corpus's directory, a meta.json in src of another
    tokenizer, shard numbers with a gap or a repeat (renumbering would hide it). Without a
    meta.json, shards holding no end-of-text id of the tokenizer are refused too: they were made by
    another one. A dataset of other sources or another tokenizer in out_dir is replaced only with
    overwrite (prepare._check_replacing)."""
    tok = get_tokenizer(tokenizer)
    if not out_dir:  # everything below is checked before any shard is read
        raise ValueError(f"--adopt={src}: needs an --out_dir, the directory the adopted dataset "
                         f"goes to")
    if not os.path.isdir(src):
        raise ValueError(f"--adopt={src}: not a directory; pass the directory that holds the .bin "
                         f"shards")
    # the swap would replace its meta.json and delete its scores
    if os.path.realpath(src) == os.path.realpath(out_dir):
        raise ValueError(f"--adopt={src} and --out_dir={out_dir} are the same directory: adopting "
                         "it into itself would replace its meta.json and delete its difficulty "
                         f"scores; train.py --data={src} reads it as it is, or pass another "
                         "--out_dir")
    prepare._check_not_shipped(out_dir, tok.name)
    prepare._check_replacing(out_dir, tok.name, None, src, overwrite)
    has_meta = os.path.exists(os.path.join(src, "meta.json"))
    if has_meta:  # ours: it says which tokenizer made it
        made_by = data.read_meta(src)["tokenizer"]
        if not prepare.same_source(made_by, tok.name):
            raise ValueError(f"--adopt={src}: its meta.json says the shards are {made_by} ids, not "
                             f"--tokenizer={tok.name}; pass --tokenizer={made_by}, or prepare the "
                             f"sources again with {tok.name}")
    found = {"train": [], "val": []}
    for name in sorted(os.listdir(src)):
        m = LLMC_SHARD.fullmatch(name)
        if m:
            found[m.group(1)].append((int(m.group(2)), os.path.join(src, name)))
    for split in found:
        if not found[split]:
            raise ValueError(f"--adopt={src}: no {split} shards (names like "
                             f"fineweb_{split}_000001.bin or {split}_000.bin)")
        _check_numbering(src, split, sorted(found[split]))
    meta = dict(tokenizer=tok.name, tokenizer_fingerprint=fingerprint(tok),
                vocab_size=tok.vocab_size, eot=tok.eot, adopted_from=os.path.abspath(src),
                sources=[], cleaning=None, difficulty=None)
    highest = 0
    for split, shards in found.items():
        ntok = ndocs = 0
        for _, path in sorted(shards):
            tokens = data.read_shard(path)  # ValueError naming the file: bad magic, version or size
            top = int(tokens.max()) if tokens.size else 0
            if top >= tok.vocab_size:
                raise ValueError(f"{path}: token id {top} is outside the {tok.name} vocabulary "
                                 f"({tok.vocab_size}); pass the --tokenizer these shards were made "
                                 "with (llm.c's: --tokenizer=gpt2)")
            ntok, ndocs = ntok + tokens.size, ndocs + int((tokens == tok.eot).sum())
            meta["dtype"] = tokens.dtype.name
            meta["sources"].append(os.path.abspath(path))
            highest = max(highest, top)
        meta.update({f"{split}_tokens": ntok, f"{split}_shards": len(shards),
                     f"n_docs_{split}": ndocs})
    ntok = meta["train_tokens"] + meta["val_tokens"]
    # every document starts with an end-of-text id
    if not has_meta and ntok and not meta["n_docs_train"] + meta["n_docs_val"]:
        raise ValueError(f"--adopt={src}: not one {tok.name} end-of-text id ({tok.eot}) in its "
                         f"{ntok:,} tokens (ids 0..{highest}): these are not {tok.name} ids; pass "
                         "the --tokenizer these shards were made with (llm.c's: --tokenizer=gpt2; "
                         "ours: the one their meta.json names)")
    try:
        real = prepare._check_out_dir(out_dir)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        with atomic_dir(real) as tmp_dir:
            for split, shards in found.items():
                for k, (_, path) in enumerate(sorted(shards)):
                    dst = os.path.join(tmp_dir, f"{split}_{k:03d}.bin")
                    try:  # the file a symlinked shard names (link(2) would link the symlink itself)
                        os.link(os.path.realpath(path), dst)
                    except OSError:  # another file system (or no hard links there): a copy
                        shutil.copyfile(path, dst)
            with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2)
    except OSError as e:
        raise ValueError(f"{out_dir}: cannot write the dataset ({e.strerror or e}); nothing in "
                         f"{out_dir} was changed") from None
    print(f"adopted {len(found['train'])} train and {len(found['val'])} val shard(s) from {src} -> "
          f"{out_dir} ({meta['train_tokens']:,} + {meta['val_tokens']:,} {tok.name} tokens, not "
          "re-tokenised; no difficulty scores, so not for --data_order=curriculum)")
    return out_dir


def _check_numbering(src, split, shards):
    """Shards (number, path), sorted, numbered without a gap or a repeat from 0 (or 1: llm.c numbers
    its train shards after its val shard 000000), so that renumbering them train_000, train_001, ...
    hides nothing."""
    def named(path, k):  # path's name with its number replaced by k, in the same width
        m = LLMC_SHARD.fullmatch(os.path.basename(path))
        number = f"{k:0{m.end(2) - m.start(2)}d}"
        return os.path.join(src, m.string[:m.start(2)] + number + m.string[m.end(2):])

    first, path = shards[0]
    # ours start at 000, llm.c's val at 000000 and its train at 000001
    start = 1 if split == "train" and not os.path.basename(path).startswith(split) else 0
    if first > start:
        missing = named(path, start)
    else:
        for (a, pa), (b, pb) in zip(shards, shards[1:]):
            if a == b:
                raise ValueError(f"--adopt={src}: {os.path.basename(pa)} and "
                                 f"{os.path.basename(pb)} are both {split} shard {a}; move the one "
                                 f"that does not belong out of {src}")
            if b > a + 1:
                missing = named(pb, a + 1)
                break
        else:
            return
    raise ValueError(f"--adopt={src}: {missing} is missing, but {src} has {split} shards numbered "
                     f"up to {shards[-1][0]} (an incomplete download or copy?); fetch it, or move "
                     f"the {split} shards after the gap out of {src}")
