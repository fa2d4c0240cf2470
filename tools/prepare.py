"""
Tokenise a corpus once into the binary shards that data.py's DataLoader streams (format: data.py, docs/shard-format.md).

Documents are first cleaned (lessons/clean.py: quality rules for prose or code, exact and MinHash near-duplicate
removal; --clean=prose|code|dedup|none, by default the shipped corpus's setting and none for your own files,
the report printed). Document i (in source order, empty and removed documents skipped) goes to val iff
i % val_every == val_every - 1, so the split is by document and the same corpus always gives byte-identical
shards. Each document is written as [eot] + tokens into {train,val}_000.bin, ... of exactly shard_tokens tokens
(the last shorter; uint16 ids, llm.c's version 1, or uint32, version 2, when the vocabulary exceeds 65,536), each with its difficulty scores (<shard>.difficulty.npy, difficulty(): what
--data_order=curriculum sorts by), plus a meta.json. The dataset is built in a temporary directory beside
out_dir, which then replaces out_dir whole (tools/atomic.py atomic_dir), so a failed, stopped or killed run leaves
an older dataset intact, and a loader never sees a mix of two runs.

Run (the default corpus is the shipped data/shakespeare.jsonl.gz, written to data/shakespeare_<tokenizer>/):
    python -m tools.prepare --tokenizer=byte
    python -m tools.prepare --corpus=python       # the shipped code corpus (data/README.md) -> data/python_byte/
    python -m tools.prepare --tokenizer=gpt2 --out_dir=data/mine corpus/*.txt more.jsonl.gz
    python -m tools.prepare --tokenizer=gpt2 --out_dir=data/fineweb_edu fineweb-edu/sample/10BT/*.parquet
    python -m tools.prepare --tokenizer=gpt2 --adopt=llm.c/dev/data/fineweb10B --out_dir=data/fineweb10B
    python -m tools.prepare --tokenizer=data/models/SmolLM2-135M-Instruct.Q4_1.gguf  # a pretrained model's own ids
        (-> data/shakespeare_SmolLM2-135M-Instruct.Q4_1/; python -m tools.get_model smollm2 fetches it; --tokenizer
        also takes a Hugging Face model directory or a hub id; meta.json records the name as given)
Sources: .txt (the whole file is one document), .jsonl / .jsonl.gz (one {"text": ...} document per line),
.parquet (the "text" column, read one row group at a time). --adopt uses llm.c-format shards as they are.
A shipped corpus's directory (data/shakespeare_<tokenizer>, what train.py --data=shakespeare reads) takes only that
corpus as shipped: your own files, another --clean or adopted shards go to another --out_dir. Any other --out_dir
holding a dataset of other sources or another tokenizer's ids is replaced only with --overwrite=True.
python -m tools.prepare --help lists every flag.
Test:
    python -m pytest tests/test_prepare.py
"""

from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import contextlib
import dataclasses
import glob
import hashlib
import gzip
import json
import os
import re
import shutil
import signal
import sys
import time
import zlib
from dataclasses import dataclass

import numpy as np

import data
from tokenizer import fingerprint, get_tokenizer
from lessons import clean
from tools.atomic import ROOT, atomic_dir, stoppable, swapped_out, write_failed
from tools.flags import die, parse

DATA_DIR = os.path.join(ROOT, "data")  # shipped assets, default outputs
SHAKESPEARE = os.path.join(DATA_DIR, "shakespeare.jsonl.gz")
PYTHON = os.path.join(DATA_DIR, "python.jsonl.gz")
# the shipped corpora (data/README.md): name -> (file, default --clean). The plays are deduplicated but not
# quality-filtered: Gopher's repeated-lines rule, written for web text, would drop The Merry Wives of Windsor,
# whose speaker names ("FALSTAFF.") are 32% of its lines (python -m lessons.clean data/shakespeare.jsonl.gz shows it)
CORPORA = {"shakespeare": (SHAKESPEARE, "dedup"), "python": (PYTHON, "code")}
CLEAN = ("prose", "code", "dedup", "none")  # quality rules (lessons/clean.py) + deduplication; dedup only; nothing
VAL_EVERY_RULE = "expected an integer >= 2 (every val_every-th document goes to val; 1 would leave none for train)"


def iter_documents(paths, progress=None):
    """Yield the text of every non-empty document, in order. A file that is not valid UTF-8 is refused with
    the byte offset of its first bad byte: the text is never silently altered. progress (a Progress) is told
    how far through the sources' bytes the reading is."""
    for i, path in enumerate(paths):
        with _reading(path):  # a damaged .gz or an unreadable file: one line naming it
            if progress is not None:
                progress.file(i)
            if path.endswith(".parquet"):
                yield from _parquet_documents(path, progress)
                continue
            if path.endswith(".txt"):  # binary read: no newline translation, the same bytes on every platform
                with open(path, "rb") as f:
                    text = _utf8(f.read(), path, 0)
                if text:
                    yield text
                continue
            offset = 0
            with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
                raw_file = f.fileobj if path.endswith(".gz") else f  # compressed position: the fraction read
                for lineno, raw in enumerate(f, 1):
                    line, offset = _utf8(raw, path, offset), offset + len(raw)
                    if progress is not None and lineno % 1024 == 0:
                        progress.within(raw_file.tell())
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


def _parquet_documents(path, progress=None):
    """The "text" column of a parquet file (FineWeb-Edu, DCLM and nanochat's shards), one row group at a time, so
    memory holds one row group, not the file."""
    try:
        import pyarrow.parquet as pq  # only parquet sources need it
    except ImportError:
        raise ValueError(f"{path}: reading parquet needs pyarrow: pip install -r requirements.txt") from None
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own errors: not a parquet file, a truncated footer
        raise ValueError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:200]})") from None
    if "text" not in f.schema_arrow.names:
        raise ValueError(f"{path}: no \"text\" column (it has {', '.join(f.schema_arrow.names[:8])}); the documents "
                         f"must be in a string column named text")
    for g in range(f.num_row_groups):
        for row, text in enumerate(f.read_row_group(g, columns=["text"]).column("text").to_pylist()):
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{path}: row group {g}, row {row}: text is {type(text).__name__}, not a string")
            if text:
                yield text
        if progress is not None:
            progress.within((g + 1) / f.num_row_groups * os.path.getsize(path))


class Progress:
    """A progress line every `every` seconds (never in the first `every`): the fraction of the sources' bytes
    read, tokens so far, tokens/s and the time left at that rate."""

    def __init__(self, paths, every=2.0):
        self.sizes = [os.path.getsize(p) for p in paths]
        self.total, self.done, self.pos, self.i = max(sum(self.sizes), 1), 0, 0, 0
        self.every, self.t0, self.last, self.tokens = every, time.time(), time.time(), 0

    def file(self, i):
        self.done, self.pos, self.i = sum(self.sizes[:i]), 0, i

    def within(self, pos):
        self.pos = min(pos, self.sizes[self.i])

    def tokens_added(self, n):
        self.tokens += n
        if time.time() - self.last >= self.every:
            self.show()

    def show(self, done=False):
        now = self.last = time.time()
        frac, rate = 1.0 if done else (self.done + self.pos) / self.total, self.tokens / max(now - self.t0, 1e-9)
        left = (now - self.t0) * (1 - frac) / frac if frac > 0 else float("nan")
        eta = f"{int(left // 60)}:{int(left % 60):02d}" if left == left else "?"
        print(f"  {frac:5.1%} of the sources, {self.tokens:,} tokens, {rate:,.0f} tokens/s, {eta} left", flush=True)


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


def difficulty(tokens, decode_bytes, chunk=data.DIFFICULTY_CHUNK):
    """Difficulty of each chunk of `chunk` tokens: the zlib compression ratio of its text, compressed bytes /
    raw bytes (the eot token carries no text). Text that repeats itself (refrains, lists of names, short
    exchanges) compresses well and scores low, 'easy'; dense, varied text scores high. It needs no model, so
    it is computed here once, deterministically, and prints how long that took; a small reference model's
    loss is the costlier alternative (it ranks by what one model finds hard, and must exist first).
    decode_bytes: token ids -> bytes (the tokenizer's)."""
    out = np.empty(-(-len(tokens) // chunk), dtype=np.float32)
    for c in range(len(out)):
        raw = decode_bytes(tokens[c * chunk:(c + 1) * chunk])
        out[c] = len(zlib.compress(raw, 9)) / len(raw) if raw else 0.0
    return out


class _ShardWriter:
    """Writes one split's documents as {split}_000.bin, ... of exactly shard_tokens tokens (the last shorter)."""

    def __init__(self, out_dir, split, dtype, shard_tokens, decode_bytes):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.decode_bytes = decode_bytes  # for the difficulty scores the curriculum order sorts by
        self.buf, self.nbuf, self.nshards, self.ntok, self.ndocs, self.score_s = [], 0, 0, 0, 0, 0.0

    def add(self, doc):  # doc: (1 + len(tokens),) = [eot] + tokens
        self.buf.append(doc)
        self.nbuf, self.ntok, self.ndocs = self.nbuf + len(doc), self.ntok + len(doc), self.ndocs + 1
        while self.nbuf >= self.shard_tokens:  # a document may go on into the next shard, as in llm.c
            self._flush(self.shard_tokens)

    def _flush(self, n):
        flat = np.concatenate(self.buf)
        path = os.path.join(self.out_dir, f"{self.split}_{self.nshards:03d}.bin")
        data.write_shard(path, flat[:n], self.dtype)
        t0 = time.time()
        np.save(data.difficulty_path(path), difficulty(flat[:n], self.decode_bytes))
        self.score_s += time.time() - t0
        self.buf, self.nbuf, self.nshards = [flat[n:]], len(flat) - n, self.nshards + 1

    def close(self):
        if self.nbuf:
            self._flush(self.nbuf)
        return self.nshards


def prepare(sources=None, tokenizer="byte", out_dir=None, val_every=20, shard_tokens=100_000_000, corpus="shakespeare",
            clean_as=None, overwrite=False):
    """Tokenise sources (None: the shipped corpus named `corpus`) into out_dir/{train,val}_NNN.bin and meta.json;
    return out_dir. clean_as: prose | code (quality rules, then exact and near-duplicate removal, lessons/clean.py),
    dedup (only the deduplication), none; None = the shipped corpus's default, or none for your own files.
    Document i (source order, empty and removed documents skipped) goes to val iff i % val_every == val_every - 1;
    if that picks none, the last document does. The new dataset is built in a temporary directory beside out_dir and
    then replaces out_dir whole, so a failed run leaves an older dataset intact. A ValueError says what went
    wrong in one line (a bad source, a full disk); out_dir is then as it was. A dataset of other sources or another
    tokenizer in out_dir is replaced only with overwrite (_check_replacing)."""
    t0 = time.time()
    tok = get_tokenizer(tokenizer)
    if val_every < 2:  # 1 would put every document in val and none in train
        raise ValueError(f"val_every={val_every}: {VAL_EVERY_RULE}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens}: expected an integer >= 1")
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; shipped: {', '.join(CORPORA)}")
    paths = [CORPORA[corpus][0]] if sources is None else _expand_sources(sources)
    clean_as = clean_as or (CORPORA[corpus][1] if sources is None else "none")
    if clean_as not in CLEAN:
        raise ValueError(f"unknown cleaning {clean_as!r}; expected one of {', '.join(CLEAN)}")
    cleaner = None if clean_as == "none" else clean.Cleaner(None if clean_as == "dedup" else clean_as)
    given, out_dir = out_dir, out_dir or default_out_dir(sources, paths, tok.name, corpus)
    _check_not_shipped(out_dir, tok.name, paths, clean_as, default=not given)  # before anything is read
    _check_replacing(out_dir, tok.name, paths, None, overwrite)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32  # shard version 1 (llm.c's), else 2 (ours, data.py)
    try:
        real = _check_out_dir(out_dir)  # the directory that gets replaced (out_dir may be a symlink to it)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        with atomic_dir(real) as tmp_dir:  # which first clears what killed runs left beside it
            train, val = (_ShardWriter(tmp_dir, split, dtype, shard_tokens, tok.decode_bytes)
                          for split in ("train", "val"))
            i, held = 0, None  # held: the latest train document, kept back in case it must be the only val one
            progress = Progress(paths)
            docs = iter_documents(paths, progress)
            for chunk in _chunks(docs if cleaner is None else filter(cleaner.keep, docs)):
                encoded = tok.encode_batch(chunk)  # batched: tiktoken encodes the chunk on all threads
                progress.tokens_added(sum(len(ids) + 1 for ids in encoded))
                for ids in encoded:
                    doc = np.empty(1 + len(ids), dtype=dtype)
                    doc[0], doc[1:] = tok.eot, ids  # eot first: it marks where the document starts
                    if i % val_every == val_every - 1:
                        val.add(doc)
                    else:
                        if held is not None:
                            train.add(held)
                        held = doc
                    i += 1
            progress.show(done=True)
            if i < 2:  # checked before anything is written
                what = "empty corpus: no non-empty document" if i == 0 else "only one document"
                if cleaner is not None and cleaner.removed:
                    what += f" left after cleaning ({cleaner.report()}; --clean=none keeps them all)"
                raise ValueError(f"{what} in {', '.join(paths)}; the train/val split is by document, so give at "
                                 f"least 2 (e.g. several .txt files or .jsonl lines)")
            (val if val.ndocs == 0 else train).add(held)
            n_train, n_val = train.close(), val.close()
            meta = dict(tokenizer=tok.name, tokenizer_fingerprint=fingerprint(tok), vocab_size=tok.vocab_size,
                        eot=tok.eot, dtype=np.dtype(dtype).name,
                        n_docs_train=train.ndocs, n_docs_val=val.ndocs, train_tokens=train.ntok, val_tokens=val.ntok,
                        train_shards=n_train, val_shards=n_val, sources=paths, val_every=val_every,
                        cleaning=cleaner.summary() if cleaner else None,
                        difficulty=f"zlib compression ratio per {data.DIFFICULTY_CHUNK} tokens, <shard>.difficulty.npy")
            with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2)
    except OSError as e:  # writing failed (a full disk, no permission): the sources were read without error
        why, cause, fix = write_failed(e, out_dir)
        raise ValueError(f"{out_dir}: cannot write the new dataset ({why}; {cause}); {fix} or pass another "
                         f"--out_dir; nothing in {out_dir} was changed") from None
    seconds = time.time() - t0
    print(f"{cleaner.report() if cleaner else 'cleaning: none (--clean=prose|code|dedup to filter)'}\n"
          f"{tok.name} tokens of {len(paths)} file(s) -> {out_dir} in {seconds:.1f}s, "
          f"{(train.ntok + val.ntok) / seconds:,.0f} tokens/s\n"
          f"  train: {train.ndocs:,} docs, {train.ntok:,} tokens, {n_train} shard(s)\n"
          f"  val:   {val.ndocs:,} docs, {val.ntok:,} tokens, {n_val} shard(s)\n"
          f"  difficulty scores (zlib ratio per {data.DIFFICULTY_CHUNK} tokens): {train.score_s + val.score_s:.1f}s")
    return out_dir


LLMC_SHARD = re.compile(r"(?:.*_)?(train|val)_?(\d+)\.bin")  # llm.c: fineweb_train_000001.bin; ours: train_000.bin


def adopt(src, out_dir, tokenizer, overwrite=False):
    """Make out_dir a dataset of the llm.c-format shards in src (llm.c's and modded-nanogpt's fineweb_train_*.bin,
    fineweb_val_*.bin: the header format is ours) without re-tokenising: each shard's header and size checked,
    its ids checked against the tokenizer's vocabulary, then hard-linked (copied across file systems) in order
    as train_000.bin, ... and val_000.bin, ..., with a meta.json. No difficulty scores: not for --data_order=curriculum.
    Refused before a shard is read: no out_dir, out_dir = src, a shipped corpus's directory, a meta.json in src of
    another tokenizer, shard numbers with a gap or a repeat (renumbering would hide it). Without a meta.json, shards
    holding no end-of-text id of the tokenizer are refused too: they were made by another one. A dataset of other
    sources or another tokenizer in out_dir is replaced only with overwrite (_check_replacing)."""
    tok = get_tokenizer(tokenizer)
    if not out_dir:  # everything below is checked before any shard is read
        raise ValueError(f"--adopt={src}: needs an --out_dir, the directory the adopted dataset goes to")
    if not os.path.isdir(src):
        raise ValueError(f"--adopt={src}: not a directory; pass the directory that holds the .bin shards")
    if os.path.realpath(src) == os.path.realpath(out_dir):  # the swap would replace its meta.json and delete its scores
        raise ValueError(f"--adopt={src} and --out_dir={out_dir} are the same directory: adopting it into itself "
                         f"would replace its meta.json and delete its difficulty scores; train.py --data={src} reads "
                         f"it as it is, or pass another --out_dir")
    _check_not_shipped(out_dir, tok.name)
    _check_replacing(out_dir, tok.name, None, src, overwrite)
    has_meta = os.path.exists(os.path.join(src, "meta.json"))
    if has_meta:  # ours: it says which tokenizer made it
        made_by = data.read_meta(src)["tokenizer"]
        if not same_source(made_by, tok.name):
            raise ValueError(f"--adopt={src}: its meta.json says the shards are {made_by} ids, not --tokenizer="
                             f"{tok.name}; pass --tokenizer={made_by}, or prepare the sources again with {tok.name}")
    found = {"train": [], "val": []}
    for name in sorted(os.listdir(src)):
        m = LLMC_SHARD.fullmatch(name)
        if m:
            found[m.group(1)].append((int(m.group(2)), os.path.join(src, name)))
    for split in found:
        if not found[split]:
            raise ValueError(f"--adopt={src}: no {split} shards (names like fineweb_{split}_000001.bin or "
                             f"{split}_000.bin)")
        _check_numbering(src, split, sorted(found[split]))
    meta = dict(tokenizer=tok.name, tokenizer_fingerprint=fingerprint(tok), vocab_size=tok.vocab_size, eot=tok.eot,
                adopted_from=os.path.abspath(src),
                sources=[], cleaning=None, difficulty=None)
    highest = 0
    for split, shards in found.items():
        ntok = ndocs = 0
        for _, path in sorted(shards):
            tokens = data.read_shard(path)  # ValueError naming the file: bad magic, version or size
            top = int(tokens.max()) if tokens.size else 0
            if top >= tok.vocab_size:
                raise ValueError(f"{path}: token id {top} is outside the {tok.name} vocabulary ({tok.vocab_size}); "
                                 f"pass the --tokenizer these shards were made with (llm.c's: --tokenizer=gpt2)")
            ntok, ndocs = ntok + tokens.size, ndocs + int((tokens == tok.eot).sum())
            meta["dtype"] = tokens.dtype.name
            meta["sources"].append(os.path.abspath(path))
            highest = max(highest, top)
        meta.update({f"{split}_tokens": ntok, f"{split}_shards": len(shards), f"n_docs_{split}": ndocs})
    ntok = meta["train_tokens"] + meta["val_tokens"]
    if not has_meta and ntok and not meta["n_docs_train"] + meta["n_docs_val"]:  # every document starts with one
        raise ValueError(f"--adopt={src}: not one {tok.name} end-of-text id ({tok.eot}) in its {ntok:,} tokens (ids "
                         f"0..{highest}): these are not {tok.name} ids; pass the --tokenizer these shards were made with "
                         f"(llm.c's: --tokenizer=gpt2; ours: the one their meta.json names)")
    try:
        real = _check_out_dir(out_dir)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        with atomic_dir(real) as tmp_dir:
            for split, shards in found.items():
                for k, (_, path) in enumerate(sorted(shards)):
                    dst = os.path.join(tmp_dir, f"{split}_{k:03d}.bin")
                    try:
                        os.link(path, dst)
                    except OSError:  # another file system (or no hard links there): a copy
                        shutil.copyfile(path, dst)
            with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2)
    except OSError as e:
        raise ValueError(f"{out_dir}: cannot write the dataset ({e.strerror or e}); nothing in {out_dir} was "
                         f"changed") from None
    print(f"adopted {len(found['train'])} train and {len(found['val'])} val shard(s) from {src} -> {out_dir} "
          f"({meta['train_tokens']:,} + {meta['val_tokens']:,} {tok.name} tokens, not re-tokenised; no difficulty "
          f"scores, so not for --data_order=curriculum)")
    return out_dir


def _check_numbering(src, split, shards):
    """Shards (number, path), sorted, numbered without a gap or a repeat from 0 (or 1: llm.c numbers its train shards
    after its val shard 000000), so that renumbering them train_000, train_001, ... hides nothing."""
    def named(path, k):  # path's name with its number replaced by k, in the same width
        m = LLMC_SHARD.fullmatch(os.path.basename(path))
        return os.path.join(src, m.string[:m.start(2)] + f"{k:0{m.end(2) - m.start(2)}d}" + m.string[m.end(2):])

    first, path = shards[0]
    start = 0 if os.path.basename(path).startswith(split) else 1  # ours start at 000, llm.c's train at 000001
    if first > start:
        missing = named(path, start)
    else:
        for (a, pa), (b, pb) in zip(shards, shards[1:]):
            if a == b:
                raise ValueError(f"--adopt={src}: {os.path.basename(pa)} and {os.path.basename(pb)} are both {split} "
                                 f"shard {a}; move the one that does not belong out of {src}")
            if b > a + 1:
                missing = named(pb, a + 1)
                break
        else:
            return
    raise ValueError(f"--adopt={src}: {missing} is missing, but {src} has {split} shards numbered up to "
                     f"{shards[-1][0]} (an incomplete download or copy?); fetch it, or move the {split} shards after "
                     f"the gap out of {src}")


def default_out_dir(sources, paths, tokenizer_name, corpus="shakespeare"):
    """data/<corpus>_<tokenizer> for a shipped corpus, else data/<first source's stem>_<tokenizer>; a model's
    tokenizer by the last part of its source (source_slug: SmolLM2-135M-Instruct.Q4_1 for its .gguf)."""
    stem = re.sub(r"\.(txt|jsonl|jsonl\.gz|parquet)$", "", os.path.basename(paths[0]))
    return os.path.join(DATA_DIR, f"{corpus if sources is None else stem}_{source_slug(tokenizer_name)}")


def tokenize_throughput(tokenizer_name):
    """Tokens per second of encode_batch on the shipped Shakespeare corpus (reading the file is not timed)."""
    tok = get_tokenizer(tokenizer_name)
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
    seen = {}  # (device, inode) -> path: the same file through another path or a symlink is the same source
    for p in paths:
        if not p.endswith((".txt", ".jsonl", ".jsonl.gz", ".parquet")):
            raise ValueError(f"{p}: unsupported file type; expected .txt, .jsonl, .jsonl.gz or .parquet")
        with _reading(p):
            st = os.stat(p)
        first = seen.get((st.st_dev, st.st_ino))
        if first is not None:  # this file came before, by this name or another
            also = "" if first == p else f" (also as {first})"
            raise ValueError(f"{p}: given twice{also}, so every document in it would be in the dataset twice; "
                             f"pass each source once")
        seen[st.st_dev, st.st_ino] = p
    if not paths:
        raise ValueError("no sources given")
    return paths


@contextlib.contextmanager
def _reading(p):
    """Reading source p: a damaged gzip stream or an unreadable file becomes one ValueError naming it."""
    try:
        yield
    except gzip.BadGzipFile as e:
        raise ValueError(f"{p}: not a gzip file ({e}); compress it with gzip, or if it is plain text, "
                         f"rename it to {p[:-3]}") from None
    except (EOFError, zlib.error) as e:
        raise ValueError(f"{p}: the gzip stream ends early or is corrupt ({e}; a truncated download?); "
                         f"get the file again, or check it with: gzip -t {p}") from None
    except OSError as e:
        raise ValueError(f"{p}: cannot be read ({e.strerror or e}); check the file and its permissions") from None


def _utf8(raw, path, offset):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = " of the decompressed text" if path.endswith(".gz") else ""
        raise ValueError(f"{path}: not UTF-8: byte 0x{raw[e.start]:02x} at byte offset {offset + e.start}{where}; "
                         f"convert the file to UTF-8 first (e.g. iconv -f latin1 -t utf-8)") from None

# -----------------------------------------------------------------------------
# where the dataset goes: out_dir, its name, and who may write into it


def _check_out_dir(out_dir):
    """The real path of out_dir after refusing what the swap would destroy: a regular file, or a directory
    holding files that tools/prepare.py did not write (they would be deleted with the old dataset)."""
    real = os.path.realpath(out_dir)
    if os.path.exists(real) and not os.path.isdir(real):
        raise ValueError(f"{out_dir}: exists and is not a directory; pass a new directory, or an earlier "
                         f"tools/prepare.py output, as --out_dir")
    ours = re.compile(r"meta\.json|(train|val)_\d+\.(bin|difficulty\.npy)")
    other = sorted(n for n in (os.listdir(real) if os.path.isdir(real) else []) if not ours.fullmatch(n))
    if other:
        raise ValueError(f"{out_dir}: also holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, which "
                         f"re-preparing would delete (the whole directory is replaced); move them out, or pass "
                         f"another --out_dir")
    return real


def _check_replacing(out_dir, tokenizer, paths, adopted_from, overwrite):
    """Refuse, without overwrite, to replace a dataset in out_dir that holds something else than the one about to be
    written: another tokenizer's ids, or other sources, none of them among paths (adopted_from for --adopt: another
    shard directory, or adopted shards replaced by tokenised sources, or the other way round). The same sources, or
    some added or dropped, in the same tokenizer (another --val_every, --shard_tokens or --clean) are replaced as
    before. A meta.json that cannot be read is no dataset to keep (data.py says to re-create it)."""
    if overwrite or not os.path.exists(os.path.join(out_dir, "meta.json")):
        return
    try:
        meta = data.read_meta(out_dir)
    except ValueError:
        return
    same = lambda a, b: a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)) or \
        (not os.path.exists(a) and os.path.basename(a) == os.path.basename(b))  # the checkout moved
    was = meta.get("adopted_from")
    if was is not None or adopted_from is not None:
        same_data = was is not None and adopted_from is not None and same(str(was), adopted_from)
    else:
        had = [str(p) for p in meta.get("sources") or []]
        same_data = any(same(a, b) for a in had for b in paths)
    made_by = str(meta["tokenizer"])
    if same_data and same_source(made_by, tokenizer):
        return
    held = f"shards adopted from {was}" if was is not None else \
        f"{', '.join(map(str, (meta.get('sources') or ['no sources'])[:2]))}{', ...' if len(meta.get('sources') or []) > 2 else ''}"
    new = f"shards adopted from {adopted_from}" if adopted_from is not None else \
        f"{', '.join(paths[:2])}{', ...' if len(paths) > 2 else ''}"
    raise ValueError(f"--out_dir={out_dir}: holds a dataset of {held} in {made_by} ids, not {new} in {tokenizer} "
                     f"ids; writing here replaces it whole: pass --overwrite=True to replace it, or another --out_dir")


def source_slug(name):
    """A file-name-safe short name of a tokenizer or model source: byte and gpt2 as they are, a model by its last
    part without the extension and a hash of where it is (two models of one name do not share shards):
    data/models/SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct.Q4_1-<8 hex digits>."""
    if name in ("byte", "gpt2"):
        return name
    base = os.path.basename(os.path.normpath(name))
    base = base[:-len(".gguf")] if base.endswith(".gguf") else base
    where = os.path.realpath(name) if os.path.exists(name) else name
    return (re.sub(r"[^A-Za-z0-9._-]+", "-", base) or "model") + "-" + hashlib.sha1(where.encode()).hexdigest()[:8]


def same_source(a, b):
    """Whether two tokenizer or model names are the same one: equal names, or two paths to the same file or folder."""
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


# the name of a shipped corpus's directory: data/<corpus>_<source_slug(tokenizer)>
SHIPPED_DIR = re.compile(r"(?P<corpus>[^_]+)_(?P<tok>byte|gpt2|[A-Za-z0-9._-]+-[0-9a-f]{8})")


def _check_not_shipped(out_dir, tokenizer, paths=None, clean_as=None, default=False):
    """Refuse to write into a shipped corpus's directory, data/<corpus>_<tokenizer slug> (what train.py --data=<corpus>,
    its default, and the lab read, prepared once and then used as it is), anything but that corpus cleaned as shipped
    in the tokenizer its name says: your own sources, another cleaning, another tokenizer's ids, adopted shards
    (paths None). default: out_dir was not given (default_out_dir named it after the first source)."""
    parent, name = os.path.split(os.path.realpath(out_dir))
    m = SHIPPED_DIR.fullmatch(name)
    if parent != os.path.realpath(DATA_DIR) or not m or m["corpus"] not in CORPORA:
        return
    corpus, (shipped, cleaning) = m["corpus"], CORPORA[m["corpus"]]
    same_corpus = paths is not None and len(paths) == 1 and os.path.realpath(paths[0]) == os.path.realpath(shipped)
    if not same_corpus:
        what = "adopted shards" if paths is None else f"other sources ({', '.join(paths[:2])}" \
            f"{', ...' if len(paths) > 2 else ''})"
    elif clean_as != cleaning:
        what = f"{corpus} cleaned with --clean={clean_as} (shipped: --clean={cleaning})"
    elif m["tok"] != source_slug(tokenizer):
        what = f"{tokenizer} ids (it holds {m['tok']}'s)"
    else:
        return
    other = os.path.join(os.path.dirname(out_dir) or ".", f"my_{name}")
    if same_corpus and clean_as == cleaning:  # only the tokenizer differs: that tokenizer's own directory
        other = os.path.join(os.path.dirname(out_dir) or ".", f"{corpus}_{source_slug(tokenizer)}")
    where = f"{out_dir} (the default --out_dir for {os.path.basename(paths[0])})" if default else f"--out_dir={out_dir}"
    raise ValueError(f"{where}: is the shipped corpus {corpus}'s directory (train.py --data={corpus} and the lab "
                     f"read it), not one for {what}; pass another --out_dir (e.g. --out_dir={other})")


def check_shipped(d, corpus):
    """For a reader of shipped corpus `corpus`'s directory d (train.py --data=<corpus>, the lab): raise a ValueError
    when its meta.json says it holds something else (another source, another cleaning, adopted shards: written by
    hand or by a tools/prepare.py from before _check_not_shipped), instead of training on it as that corpus. The
    source is compared by name, and as a file where the recorded path still exists (the checkout may have moved)."""
    meta = data.read_meta(d)
    shipped, cleaning = CORPORA[corpus]
    sources = meta.get("sources") or []
    ok = len(sources) == 1 and os.path.basename(sources[0]) == os.path.basename(shipped) and \
        (not os.path.exists(sources[0]) or os.path.samefile(sources[0], shipped)) and "adopted_from" not in meta
    if "cleaning" in meta:  # a meta.json from before cleaning existed does not say
        made = "none" if meta["cleaning"] is None else meta["cleaning"].get("kind") or "dedup"
        ok = ok and made == cleaning
    if not ok:
        raise ValueError(f"{d}: its meta.json lists {', '.join(sources[:2]) or 'no sources'}"
                         f"{' (adopted shards)' if 'adopted_from' in meta else ''}, not the shipped corpus {corpus} "
                         f"as tools/prepare.py makes it, yet train.py --data={corpus} and the lab read this directory; "
                         f"move it elsewhere (and pass that path as --data), then the shipped corpus is prepared again")


def check_not_mid_swap(d):
    """For a reader that finds no dataset d: if a tools/prepare.py was killed between the two renames that swap a
    dataset in (atomic.atomic_dir), raise a ValueError saying where the previous dataset is (the next run puts it
    back)."""
    old = swapped_out(d)
    if old:
        raise ValueError(f"{d}: missing, but {old} holds its previous dataset (a tools/prepare.py was killed while "
                         f"replacing it); restore it: mv {old} {d} (or re-run tools/prepare.py, which restores it first)")

# -----------------------------------------------------------------------------


def _default_for(sources, tokenizer, corpus):
    try:
        return default_out_dir(sources or None, _expand_sources(sources) if sources else [SHAKESPEARE], tokenizer,
                               corpus)
    except ValueError:  # a bad source: prepare() says so at once
        return "<its default>"


@dataclass
class PrepareConfig:
    tokenizer: str = "byte"      # byte (257 ids), gpt2 (50257 ids), or a model's: HF directory, hub id or .gguf
    out_dir: str = ""            # where the shards go; "" = data/<corpus>_<tokenizer> (or data/<first source>_...)
    val_every: int = 20          # every val_every-th document goes to the val split
    shard_tokens: int = 100_000_000  # tokens per shard file
    corpus: str = "shakespeare"  # a shipped corpus, used when no source files are given: shakespeare or python
    clean: str = ""              # prose, code, dedup or none; "" = the shipped corpus's setting, none for your files
    adopt: str = ""              # a directory of llm.c-format .bin shards (llm.c, modded-nanogpt) to use as they are
    overwrite: bool = False      # replace an --out_dir that holds a dataset of other sources or another tokenizer


def main(argv):
    flags, sources = parse(argv, PrepareConfig, __doc__, positional="FILE ...  .txt, .jsonl or .jsonl.gz sources")
    opts = dataclasses.asdict(PrepareConfig(**flags))
    opts["out_dir"], opts["clean"] = opts["out_dir"] or None, opts["clean"] or None
    if opts["val_every"] < 2:
        die(f"--val_every={opts['val_every']}: {VAL_EVERY_RULE}", 2)
    if opts["shard_tokens"] < 1:
        die(f"--shard_tokens={opts['shard_tokens']}: expected an integer >= 1", 2)
    for key, valid in (("corpus", CORPORA), ("clean", CLEAN)):
        if opts[key] is not None and opts[key] not in valid:
            die(f"--{key}={opts[key]}: expected one of {', '.join(valid)}", 2)
    try:  # a model's tokenizer loads here (seconds), once: prepare() and adopt() get the same object
        get_tokenizer(opts["tokenizer"])
    except (ValueError, ImportError) as e:
        die(f"--tokenizer={opts['tokenizer']}: {e}", 2)
    except KeyboardInterrupt:  # a GGUF's vocabulary takes seconds to read: nothing is written yet
        die(f"stopped by Ctrl-C while loading --tokenizer={opts['tokenizer']}; nothing was written",
            128 + signal.SIGINT)
    if opts["adopt"] and (sources or opts["out_dir"] is None):  # checked before any shard is read
        die(f"--adopt={opts['adopt']}: takes the shard directory and an --out_dir for the adopted dataset "
            f"(e.g. --out_dir=data/fineweb10B_{source_slug(opts['tokenizer'])}), and no source files", 2)
    # SIGTERM or Ctrl-C: one line saying whether out_dir is as it was or already the whole new dataset. Only here,
    # not in prepare(): train.py calls prepare() and has its own signal handling
    try:
        with stoppable("--out_dir", opts["out_dir"] or _default_for(sources, opts["tokenizer"], opts["corpus"])):
            if opts["adopt"]:
                adopt(opts["adopt"], opts["out_dir"], opts["tokenizer"], opts["overwrite"])
                return 0
            kw = {k: v for k, v in opts.items() if k not in ("clean", "adopt")}
            out_dir = prepare(sources or None, clean_as=opts["clean"], **kw)
    except ValueError as e:  # a bad corpus, a full disk: one line that says what to fix, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    sample = data.read_shard(os.path.join(out_dir, "train_000.bin"))[:48].tolist()
    print(f"first train tokens: {sample}\ndecoded: {get_tokenizer(opts['tokenizer']).decode(sample)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
