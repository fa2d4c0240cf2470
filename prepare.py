"""
Tokenise a corpus once into the binary shards that data.py's DataLoader streams (format: data.py, docs/shard-format.md).

Document i (in source order, empty documents skipped) goes to val iff i % val_every == val_every - 1, so the split
is by document and the same corpus always gives byte-identical shards. Each document is written as [eot] + tokens
into {train,val}_000.bin, ... of exactly shard_tokens tokens (the last shorter), plus a meta.json. Shards are built
in a temporary directory and moved into out_dir only on success, so a failed run leaves an older dataset intact.

Run (the default corpus is the shipped data/shakespeare.jsonl.gz, written to data/shakespeare_<tokenizer>/):
    python prepare.py --tokenizer=byte
    python prepare.py --tokenizer=gpt2 --out_dir=data/mine corpus/*.txt more.jsonl.gz
Sources: .txt (the whole file is one document), .jsonl / .jsonl.gz (one {"text": ...} document per line).
Other flags: --val_every=20, --shard_tokens=100000000.
Test:
    python -m pytest tests/test_prepare.py
"""

import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np

import data

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # shipped assets, default outputs
SHAKESPEARE = os.path.join(DATA_DIR, "shakespeare.jsonl.gz")


def iter_documents(paths):
    """Yield the text of every non-empty document, in order. A file that is not valid UTF-8 is refused with
    the byte offset of its first bad byte: the text is never silently altered."""
    for path in paths:
        if path.endswith(".txt"):  # binary read: no newline translation, the same bytes on every platform
            with open(path, "rb") as f:
                text = _utf8(f.read(), path, 0)
            if text:
                yield text
            continue
        offset = 0
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line, offset = _utf8(raw, path, offset), offset + len(raw)
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    text = None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a string \"text\" field")
                if text:
                    yield text


def _chunks(docs, max_chars=1 << 22, max_docs=1024):
    """Group documents so that each encode_batch call keeps every thread busy, in bounded memory."""
    chunk, n = [], 0
    for d in docs:
        chunk.append(d)
        n += len(d)
        if n >= max_chars or len(chunk) >= max_docs:
            yield chunk
            chunk, n = [], 0
    if chunk:
        yield chunk


class _ShardWriter:
    """Writes one split's documents as {split}_000.bin, ... of exactly shard_tokens tokens (the last shorter)."""

    def __init__(self, out_dir, split, dtype, shard_tokens):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.buf, self.nbuf, self.nshards, self.ntok, self.ndocs = [], 0, 0, 0, 0

    def add(self, doc):  # doc: (1 + len(tokens),) = [eot] + tokens
        self.buf.append(doc)
        self.nbuf, self.ntok, self.ndocs = self.nbuf + len(doc), self.ntok + len(doc), self.ndocs + 1
        while self.nbuf >= self.shard_tokens:  # a document may go on into the next shard, as in llm.c
            self._flush(self.shard_tokens)

    def _flush(self, n):
        flat = np.concatenate(self.buf)
        data.write_shard(os.path.join(self.out_dir, f"{self.split}_{self.nshards:03d}.bin"), flat[:n], self.dtype)
        self.buf, self.nbuf, self.nshards = [flat[n:]], len(flat) - n, self.nshards + 1

    def close(self):
        if self.nbuf:
            self._flush(self.nbuf)
        return self.nshards


def prepare(sources=None, tokenizer="byte", out_dir=None, val_every=20, shard_tokens=100_000_000):
    """Tokenise sources into out_dir/{train,val}_NNN.bin and meta.json; return out_dir.
    Document i (source order, empty documents skipped) goes to val iff i % val_every == val_every - 1; if that
    picks none, the last document does. Shards are built in a temporary directory and moved into out_dir only
    on success (replacing the shards and meta.json there), so a failed run leaves an older dataset intact."""
    t0 = time.time()
    tok = data.get_tokenizer(tokenizer)
    if val_every < 2 or shard_tokens < 1:
        raise ValueError(f"need val_every >= 2 (got {val_every}) and shard_tokens >= 1 (got {shard_tokens})")
    paths = [SHAKESPEARE] if sources is None else _expand_sources(sources)
    stem = re.sub(r"\.(txt|jsonl|jsonl\.gz)$", "", os.path.basename(paths[0]))
    dataset = "shakespeare" if sources is None else stem
    out_dir = out_dir or os.path.join(DATA_DIR, f"{dataset}_{tok.name}")
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp_")
    try:
        train, val = (_ShardWriter(tmp_dir, split, dtype, shard_tokens) for split in ("train", "val"))
        i, held = 0, None  # held: the latest train document, kept back in case it must be the only val one
        for chunk in _chunks(iter_documents(paths)):
            for ids in tok.encode_batch(chunk):  # batched: tiktoken encodes the chunk on all threads
                doc = np.empty(1 + len(ids), dtype=dtype)
                doc[0], doc[1:] = tok.eot, ids  # eot first: it marks where the document starts
                if i % val_every == val_every - 1:
                    val.add(doc)
                else:
                    if held is not None:
                        train.add(held)
                    held = doc
                i += 1
        if i < 2:  # checked before anything is written
            what = "empty corpus: no non-empty document" if i == 0 else "only one document"
            raise ValueError(f"{what} in {', '.join(paths)}; the train/val split is by document, so give at "
                             f"least 2 (e.g. several .txt files or .jsonl lines)")
        (val if val.ndocs == 0 else train).add(held)
        n_train, n_val = train.close(), val.close()
        meta = dict(tokenizer=tok.name, vocab_size=tok.vocab_size, eot=tok.eot, dtype=np.dtype(dtype).name,
                    n_docs_train=train.ndocs, n_docs_val=val.ndocs, train_tokens=train.ntok, val_tokens=val.ntok,
                    sources=paths, val_every=val_every)
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(out_dir):  # the loader would also read stale shards of an earlier, larger run
            if name == "meta.json" or re.fullmatch(r"(train|val)_\d+\.bin", name):
                os.remove(os.path.join(out_dir, name))
        for name in os.listdir(tmp_dir):
            os.replace(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    print(f"{tok.name} tokens of {len(paths)} file(s) -> {out_dir} in {time.time() - t0:.1f}s\n"
          f"  train: {train.ndocs:,} docs, {train.ntok:,} tokens, {n_train} shard(s)\n"
          f"  val:   {val.ndocs:,} docs, {val.ntok:,} tokens, {n_val} shard(s)")
    return out_dir


def tokenize_throughput(tokenizer_name):
    """Tokens per second of encode_batch on the shipped Shakespeare corpus (reading the file is not timed)."""
    tok = data.get_tokenizer(tokenizer_name)
    texts = list(iter_documents([SHAKESPEARE]))
    tok.encode_batch(texts[:1])  # warm-up
    t0 = time.perf_counter()
    n = sum(len(ids) for ids in tok.encode_batch(texts))
    return n / (time.perf_counter() - t0)

# -----------------------------------------------------------------------------
# validation: a bad source is refused in one line that names the file and says what to do


def _expand_sources(sources):
    paths = []
    for s in [sources] if isinstance(sources, str) else sources:
        if os.path.isdir(s):
            raise ValueError(f"{s}: is a directory; pass its files, e.g. '{os.path.join(s, '*.txt')}'")
        matches = sorted(glob.glob(s)) if glob.has_magic(s) else [s] if os.path.isfile(s) else []
        if not matches:
            raise ValueError(f"{s}: {'the pattern matches no file' if glob.has_magic(s) else 'no such file'}")
        paths += matches
    for p in paths:
        if not p.endswith((".txt", ".jsonl", ".jsonl.gz")):
            raise ValueError(f"{p}: unsupported file type; expected .txt, .jsonl or .jsonl.gz")
    if not paths:
        raise ValueError("no sources given")
    return paths


def _utf8(raw, path, offset):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = " of the decompressed text" if path.endswith(".gz") else ""
        raise ValueError(f"{path}: not UTF-8: byte 0x{raw[e.start]:02x} at byte offset {offset + e.start}{where}; "
                         f"convert the file to UTF-8 first (e.g. iconv -f latin1 -t utf-8)") from None

# -----------------------------------------------------------------------------


def main(argv):
    opts = {"tokenizer": "byte", "out_dir": None, "val_every": 20, "shard_tokens": 100_000_000}
    sources = [a for a in argv if not a.startswith("-")]
    for a in (a for a in argv if a.startswith("-")):
        if a in ("-h", "--help"):
            print(__doc__)
            return 0
        key, eq, val = a[2:].partition("=")
        if key not in opts or not eq or (isinstance(opts[key], int) and not val.isdigit()):
            print(f"prepare.py: bad flag {a}; valid: --tokenizer=byte|gpt2 --out_dir=DIR --val_every=N "
                  f"--shard_tokens=N [sources ...]", file=sys.stderr)
            return 2
        opts[key] = int(val) if isinstance(opts[key], int) else val
    if opts["tokenizer"] not in data.TOKENIZERS:
        print(f"prepare.py: unknown tokenizer {opts['tokenizer']!r}; valid: {', '.join(data.TOKENIZERS)}",
              file=sys.stderr)
        return 2
    try:
        out_dir = prepare(sources or None, **opts)
    except ValueError as e:  # a bad corpus: one line that says what to fix, not a traceback
        print(f"prepare.py: {e}", file=sys.stderr)
        return 1
    sample = data.read_shard(os.path.join(out_dir, "train_000.bin"))[:48].tolist()
    print(f"first train tokens: {sample}\ndecoded: {data.get_tokenizer(opts['tokenizer']).decode(sample)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
