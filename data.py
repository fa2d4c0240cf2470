"""
Data for nanoBitNet: tokenise a corpus into binary shards once, then stream (B, T) batches from them.

Training reads windows of T+1 consecutive tokens straight from np.memmap, so loading costs nothing and the
loader's position is two integers per source (shard index, offset) that a checkpoint saves. Every document is
written as [eot] + tokens: the end-of-text token is PREPENDED, as in llm.c's fineweb.py, so it marks a document
start and the document ids of a packed row are doc_id = cumsum(tokens == eot) (REFERENCE.md section 6).

Shard format (llm.c convention, REFERENCE.md section 6): a header of 256 little-endian int32
    [0] = 20240520 (magic), [1] = version, [2] = number of tokens, [3:256] = 0
then the tokens: version 1 = uint16 (vocabulary <= 65536), version 2 = uint32 (larger vocabularies, as llm.c).

Tokenisers: "byte" (UTF-8 bytes 0..255, eot 256, vocab 257) and "gpt2" (tiktoken, built from the shipped
data/gpt2.tiktoken since tiktoken cannot download it offline; eot 50256, vocab 50257).

Run (the default corpus is the shipped data/shakespeare.jsonl.gz, written to data/shakespeare_<tokenizer>/):
    python data.py --tokenizer=byte
    python data.py --tokenizer=gpt2 --out_dir=data/mine corpus/*.txt more.jsonl.gz
Sources: .txt (the whole file is one document), .jsonl / .jsonl.gz (one {"text": ...} document per line).
Other flags: --val_every=20 (document i goes to val iff i % val_every == val_every - 1), --shard_tokens=100000000.
Test:
    python -m pytest tests/test_data.py
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
import tiktoken
import tiktoken.load
import torch

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # shipped assets, default outputs
SHAKESPEARE = os.path.join(DATA_DIR, "shakespeare.jsonl.gz")
GPT2_RANKS = os.path.join(DATA_DIR, "gpt2.tiktoken")
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
MAGIC = 20240520
HEADER_BYTES = 256 * 4
VERSION_DTYPE = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
TOKENIZERS = ("byte", "gpt2")

# -----------------------------------------------------------------------------
# tokenisers


class ByteTokenizer:
    """UTF-8 bytes as tokens; 256 is the end-of-text token."""
    name, eot, vocab_size = "byte", 256, 257

    def encode(self, text):
        return list(text.encode("utf-8"))

    def encode_batch(self, texts):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).tolist() for t in texts]

    def decode(self, ids):
        # eot (or any id >= 256) is not a byte: drop it rather than fail in the middle of a sample
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 byte-level BPE via tiktoken; encodes exactly as tiktoken.get_encoding("gpt2")."""
    name, eot, vocab_size = "gpt2", 50256, 50257

    def __init__(self):
        ranks = tiktoken.load.load_tiktoken_bpe(GPT2_RANKS)
        self.enc = tiktoken.Encoding("gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": self.eot}, explicit_n_vocab=self.vocab_size)

    def encode(self, text):
        return self.enc.encode_ordinary(text)  # "<|endoftext|>" in a text is plain text, never 50256

    def encode_batch(self, texts):
        return self.enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count())

    def decode(self, ids):
        return self.enc.decode(list(ids), errors="replace")


_tokenizers = {}  # loading the gpt2 ranks takes a moment: build each tokenizer once


def get_tokenizer(name):
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; valid: {', '.join(TOKENIZERS)}")
    if name not in _tokenizers:
        _tokenizers[name] = ByteTokenizer() if name == "byte" else GPT2Tokenizer()
    return _tokenizers[name]

# -----------------------------------------------------------------------------
# shards


def _remake_hint(path):
    """The command that re-creates the shard at path, from the meta.json beside it when there is one."""
    d = os.path.dirname(path) or "."
    try:
        with open(os.path.join(d, "meta.json")) as f:
            meta = json.load(f)
        srcs = "".join(" " + s for s in meta["sources"] if s != SHAKESPEARE)
        return f"re-run: python data.py --tokenizer={meta['tokenizer']} --out_dir={d}{srcs}"
    except (OSError, ValueError, KeyError, TypeError):
        return "re-create it with data.py (python data.py --help)"


def write_shard(path, tokens, dtype=None):
    """Write a 1-D array of token ids as one shard. dtype None: uint16 when every id fits, else uint32."""
    tokens = np.asarray(tokens).reshape(-1)
    top = int(tokens.max()) if tokens.size else 0
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"{path}: negative token id {tokens.min()}")
    dtype = np.dtype(dtype if dtype is not None else np.uint16 if top < 2**16 else np.uint32).newbyteorder("<")
    if dtype.kind != "u" or dtype.itemsize not in (2, 4) or top >= 2 ** (8 * dtype.itemsize):
        raise ValueError(f"{path}: token id {top} cannot be stored as {dtype.name}; use uint16 or uint32")
    if tokens.size >= 2**31:
        raise ValueError(f"{path}: {tokens.size} tokens overflow the int32 header; use a smaller shard_tokens")
    header = np.zeros(256, dtype="<i4")
    header[:3] = MAGIC, 1 if dtype.itemsize == 2 else 2, tokens.size
    # write beside the target, then rename: a crash never leaves a half shard under the real name
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype(dtype, copy=False).tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_shard(path):
    """Check a shard's header and size against each other; return its tokens as a read-only np.memmap."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header; {_remake_hint(path)}")
    magic, version, ntok = (int(v) for v in np.fromfile(path, dtype="<i4", count=3))
    if magic != MAGIC:
        raise ValueError(f"{path}: bad magic {magic} (expected {MAGIC}); {_remake_hint(path)}")
    if version not in VERSION_DTYPE:
        raise ValueError(f"{path}: unsupported version {version} (expected 1 or 2); {_remake_hint(path)}")
    dtype = VERSION_DTYPE[version]
    expected = HEADER_BYTES + ntok * dtype.itemsize
    if ntok < 0 or size != expected:
        raise ValueError(f"{path}: {size} bytes, but its header says {ntok} tokens = {expected} bytes "
                         f"(truncated or corrupt); {_remake_hint(path)}")
    if ntok == 0:
        return np.zeros(0, dtype=dtype)  # mmap cannot map zero bytes
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(ntok,))

# -----------------------------------------------------------------------------
# corpus -> shards


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
        write_shard(os.path.join(self.out_dir, f"{self.split}_{self.nshards:03d}.bin"), flat[:n], self.dtype)
        self.buf, self.nbuf, self.nshards = [flat[n:]], len(flat) - n, self.nshards + 1

    def close(self):
        if self.nbuf:
            self._flush(self.nbuf)
        return self.nshards


def _shard_index(name, split):
    m = re.fullmatch(rf"{split}_(\d+)\.bin", name)
    return int(m.group(1)) if m else None


def prepare(sources=None, tokenizer="byte", out_dir=None, val_every=20, shard_tokens=100_000_000):
    """Tokenise sources into out_dir/{train,val}_NNN.bin and meta.json; return out_dir.
    Document i (source order, empty documents skipped) goes to val iff i % val_every == val_every - 1; if that
    picks none, the last document does. Shards are built in a temporary directory and moved into out_dir only
    on success (replacing the shards and meta.json there), so a failed run leaves an older dataset intact."""
    t0 = time.time()
    tok = get_tokenizer(tokenizer)
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
            if name == "meta.json" or any(_shard_index(name, s) is not None for s in ("train", "val")):
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
    tok = get_tokenizer(tokenizer_name)
    texts = list(iter_documents([SHAKESPEARE]))
    tok.encode_batch(texts[:1])  # warm-up
    t0 = time.perf_counter()
    n = sum(len(ids) for ids in tok.encode_batch(texts))
    return n / (time.perf_counter() - t0)

# -----------------------------------------------------------------------------
# loader


class DataLoader:
    """Streams (x, y) batches of shape (B, T) from the {split}_*.bin shards of one or more directories.

    sources: a directory, or a dict {directory: weight} with weights > 0 (normalised).
    Each call, one seeded np.random.Generator, the same on every rank, draws the source of each of the
    B * world_size global rows, so all ranks agree without talking. Within a source, rows are consecutive
    windows of its token stream: its j-th row of the call starts at pos + j*T and reads T+1 tokens (x = the
    first T, y = the last T); rank r keeps global rows r*B .. (r+1)*B - 1; each source then advances by
    (its rows)*T. A window that would run past the end of its shard moves that source to the next shard at
    offset 0 (after the last shard, the first), dropping the tail. The state, (shard index, offset) per source
    plus the RNG, is the same on every rank, so one rank's state_dict() resumes them all exactly.
    """

    def __init__(self, sources, split, B, T, rank=0, world_size=1, seed=1337):
        sources = {sources: 1.0} if isinstance(sources, str) else dict(sources)
        if not sources or not all(w > 0 for w in sources.values()):
            raise ValueError(f"sources must be a directory or a dict {{directory: weight > 0}}, got {sources}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.dirs = list(sources)
        self.weights = np.array([float(w) for w in sources.values()]) / sum(sources.values())
        self.split, self.B, self.T, self.rank, self.world_size, self.seed = split, B, T, rank, world_size, seed
        self.shards, self.lengths, tokenizers = [], [], {}
        for d in self.dirs:
            names = [n for n in (os.listdir(d) if os.path.isdir(d) else []) if _shard_index(n, split) is not None]
            if not names:
                raise ValueError(f"{d}: no {split}_*.bin shards; create them: python data.py --out_dir={d} [sources]")
            # numeric order: train_1000.bin comes after train_999.bin
            paths = [os.path.join(d, n) for n in sorted(names, key=lambda n: _shard_index(n, split))]
            self.shards.append(paths)
            self.lengths.append([len(read_shard(p)) for p in paths])  # validates every header now
            for p, n in zip(paths, self.lengths[-1]):
                if n < T + 1:
                    raise ValueError(f"{p}: block_size {T} is too large for this shard of {n} tokens (a row "
                                     f"reads block_size+1); lower --block_size or prepare more data")
            if os.path.exists(os.path.join(d, "meta.json")):
                with open(os.path.join(d, "meta.json")) as f:
                    tokenizers[d] = json.load(f).get("tokenizer")
        if len(set(tokenizers.values())) > 1:
            raise ValueError(f"sources were made by different tokenizers {tokenizers}; mix only one tokenizer")
        self.reset()

    def reset(self):
        """Back to the start of every source with a re-seeded RNG (used to evaluate on val)."""
        self.pos = [[0, 0] for _ in self.dirs]  # per source: [shard index, offset]
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        self._mapped = [(None, None)] * len(self.dirs)  # per source: (shard index, memmap)

    def _tokens(self, s, k):
        if self._mapped[s][0] != k:  # map only the current shard of each source
            self._mapped[s] = (k, read_shard(self.shards[s][k]))
        return self._mapped[s][1]

    def next_batch(self):
        B, T = self.B, self.T
        src = self.rng.choice(len(self.dirs), size=B * self.world_size, p=self.weights)  # (B*world_size,)
        rows = []
        for g, s in enumerate(src):
            k, off = self.pos[s]
            if off + T + 1 > self.lengths[s][k]:  # drop the shard's tail, go on in the next one (wrapping)
                k, off = (k + 1) % len(self.shards[s]), 0
            if self.rank * B <= g < (self.rank + 1) * B:
                rows.append(self._tokens(s, k)[off:off + T + 1])
            self.pos[s] = [k, off + T]
        buf = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        x = buf[:, :-1].contiguous()  # (B, T)
        y = buf[:, 1:].contiguous()  # (B, T) next-token targets
        return x, y

    def state_dict(self):
        # plain Python types only: it loads inside a checkpoint with torch.load(weights_only=True)
        return {"dirs": [os.path.basename(os.path.normpath(d)) for d in self.dirs], "split": self.split,
                "pos": [[int(k), int(off)] for k, off in self.pos], "rng": self.rng.bit_generator.state}

    def load_state_dict(self, sd):
        names = [os.path.basename(os.path.normpath(d)) for d in self.dirs]
        if sd["dirs"] != names or sd["split"] != self.split:
            raise ValueError(f"loader state is for {sd['split']} of {sd['dirs']} but this loader reads {self.split} "
                             f"of {names}; resume with the same sources in the same order")
        for s, (k, off) in enumerate(sd["pos"]):
            if not 0 <= k < len(self.shards[s]):
                raise ValueError(f"loader state points at shard {k} of {self.dirs[s]}, which has "
                                 f"{len(self.shards[s])} {self.split} shards; was the data prepared again?")
        self.reset()
        self.pos = [[int(k), int(off)] for k, off in sd["pos"]]
        self.rng.bit_generator.state = sd["rng"]

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
            print(f"data.py: bad flag {a}; valid: --tokenizer=byte|gpt2 --out_dir=DIR --val_every=N "
                  f"--shard_tokens=N [sources ...]", file=sys.stderr)
            return 2
        opts[key] = int(val) if isinstance(opts[key], int) else val
    if opts["tokenizer"] not in TOKENIZERS:
        print(f"data.py: unknown tokenizer {opts['tokenizer']!r}; valid: {', '.join(TOKENIZERS)}", file=sys.stderr)
        return 2
    try:
        out_dir = prepare(sources or None, **opts)
    except ValueError as e:  # a bad corpus: one line that says what to fix, not a traceback
        print(f"data.py: {e}", file=sys.stderr)
        return 1
    sample = read_shard(os.path.join(out_dir, "train_000.bin"))[:48].tolist()
    print(f"first train tokens: {sample}\ndecoded: {get_tokenizer(opts['tokenizer']).decode(sample)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
