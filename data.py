"""
Binary token shards in llm.c's format, and the loader that streams (B, T) batches from them.

A corpus is tokenised once (tools/prepare.py) into shards; training reads windows of T+1 consecutive tokens straight
from np.memmap, so loading costs nothing and the loader's position is a few integers that a checkpoint saves.
One shard file, as llm.c's dev/data/data_common.py writes it (in full in docs/shard-format.md):
    header  256 little-endian int32 = [20240520 (magic), version, n_tokens, 0, ..., 0]    (1024 bytes)
    tokens  n_tokens little-endian uint16 (version 1, vocabulary <= 65536) or uint32 (version 2)
    size    exactly 1024 + n_tokens * 2 (or * 4) bytes: a file cut short is refused, never read
Version 1 is llm.c's GPT-2 shard byte for byte; version 2 is ours (llm.c marks its uint32 shards with another magic).
A directory holds train_000.bin, train_001.bin, ..., val_000.bin, ... and the meta.json that made them. Every
document is stored as [eot] + tokens: the end-of-text token is PREPENDED, as in llm.c's fineweb.py, so it marks
where a document starts, and the document ids of a packed row are doc_id = cumsum(tokens == eot).
The windows come shuffled (the default), in shard order, or easy-to-hard (a curriculum, after Luo et al.,
arXiv 2511.18903: each chunk's zlib compression ratio, prepare.difficulty, read in ascending order).

The tokenisers that make the ids are in tokenizer.py. Copied alone into another project, this file needs only
numpy and torch.

Run:
    python -m tools.prepare --tokenizer=byte    # writes data/shakespeare_byte/ (see tools/prepare.py for your own corpus)
    python data.py                              # prints the first batch of those shards
Test:
    python -m pytest tests/test_data.py
"""

import json
import os
import re
import sys

import numpy as np
import torch

MAGIC = 20240520                                          # header[0]
VERSION_DTYPE = {1: np.dtype("<u2"), 2: np.dtype("<u4")}  # header[1] -> the type of the tokens
HEADER_BYTES = 256 * 4                                    # header[2] = n_tokens, header[3:] = 0


# a shard header holds its token count as an int32
MAX_SHARD_TOKENS = 2**31 - 1


def write_shard(path, tokens, dtype=None):
    """Write a 1-D array of token ids as one shard. dtype None: uint16 when every id fits, else uint32.
    A write cut short leaves a file that read_shard refuses (its size disagrees with its header); tools/prepare.py
    writes a whole dataset into a new directory and renames that into place."""
    tokens = np.asarray(tokens).reshape(-1)
    dtype = _check_tokens(path, tokens, dtype)
    header = np.zeros(256, dtype="<i4")
    header[:3] = MAGIC, 1 if dtype.itemsize == 2 else 2, tokens.size
    if os.path.lexists(path):  # a new file, never the old one rewritten: a loader may have the old one mapped
        os.remove(path)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype, copy=False).tobytes())


def read_shard(path, identity=None):
    """The tokens of a shard as a read-only np.memmap, after checking its magic, version and size (a bad shard is
    one ValueError naming the file). identity: shard_identity(path) as seen earlier; another file now: DataChanged."""
    with _open_shard(path, identity) as f:  # one open file: the header checked is the one of the file mapped
        version, ntok = _check_header(path, f)
        if ntok == 0:
            return np.zeros(0, dtype=VERSION_DTYPE[version])  # mmap cannot map zero bytes
        return np.memmap(f, dtype=VERSION_DTYPE[version], mode="r", offset=HEADER_BYTES, shape=(ntok,))


def read_meta(d):
    """meta.json of shard directory d (what made the shards, see tools/prepare.py) as a dict. A missing, empty or
    damaged file, or one without "tokenizer", raises ValueError naming the file and the fix."""
    return _check_meta_json(os.path.join(d, "meta.json"))

# -----------------------------------------------------------------------------
# loader


class DataLoader:
    """Streams (x, y) batches of shape (B, T) from the {split}_NNN.bin shards of one or more directories.

    sources: a directory, or a dict {directory: weight} with weights > 0 (normalised).
    A source is cut into windows of T+1 tokens starting at 0, T, 2T, ... of each shard (a shard's tail too short
    for a window is dropped), numbered 0, 1, 2, ... in shard order; a row is one window, x its first T tokens and
    y its last T. The position, like llm.c's (shard, offset), is integers: cursor[s], how many rows source s has
    given (its next row is window(s, cursor[s])), and the state of one seeded np.random.Generator that draws the
    source of each of the B * world_size global rows of a batch. Every rank draws the same sources and advances
    every cursor, keeping global rows r*B .. (r+1)*B - 1 for rank r, so one rank's state_dict() resumes them all.
    order (which window the j-th row of a source is):
      shuffle     (default, the measured best) each epoch a seeded permutation of the windows (nanoGPT samples
                  random offsets instead)
      sequential  window j mod n_windows, wrapping: a row's neighbours are the text that follows it; what an
                  evaluation on val reads with next_batch() (sweep() reads every window in shard order anyway)
      curriculum  the shuffled windows, each consecutive block of `span` of them sorted easy-to-hard by the
                  difficulty scores tools/prepare.py wrote (prepare.difficulty); span = the rows a run draws, so a
                  one-source curriculum run reads exactly the windows a shuffled run reads, only in another order
                  (mixed sources: a source's block is its weight's share of the rows, and the draws it gets
                  differ from that share by chance, so the last few windows differ)
    """

    def __init__(self, sources, split, B, T, rank=0, world_size=1, seed=1337, order="shuffle", span=0):
        sources = _check_sources(sources, rank, world_size)
        if order not in ORDERS:
            raise ValueError(f"unknown data order {order!r}; expected one of {', '.join(ORDERS)}")
        self.dirs = list(sources)
        self.weights = np.array([float(w) for w in sources.values()]) / sum(sources.values())
        self.split, self.B, self.T, self.rank, self.world_size, self.seed = split, B, T, rank, world_size, seed
        self.shards = [find_shards(d, split) for d in self.dirs]  # per source: its shard paths, in order
        self.identities = [[shard_identity(p) for p in paths] for paths in self.shards]  # to notice a re-prepare
        self.lengths = [[len(read_shard(p, i)) for p, i in zip(ps, ids)]  # validates every header
                        for ps, ids in zip(self.shards, self.identities)]
        # per source: the vocabulary its meta.json records (None: shards alone), which every id read must be below
        self.vocab = _check_meta(self.dirs, split, self.lengths)
        _check_block_size(self.shards, self.lengths, T)
        self.windows = [_windows(ns, T) for ns in self.lengths]  # per source: (shard index, offset) arrays
        self.scores = [window_difficulty(p, ns, T) for p, ns in zip(self.shards, self.lengths)] \
            if order == "curriculum" else None
        self.order, self.span = order, span
        self.reset()

    def reset(self):
        """Back to the start of every source with a re-seeded RNG (each evaluation on val begins so). Shards are mapped
        again, so shards that tools/prepare.py replaced since raise DataChanged at the next batch."""
        self.cursor = [0] * len(self.dirs)  # per source: how many of its windows were read
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        self._mapped = [(None, None)] * len(self.dirs)  # per source: (shard index, memmap)
        self._block = [(None, None)] * len(self.dirs)   # per source: (block number, its window numbers)

    def window(self, s, j):
        """Window number of the j-th row that source s gives, in this loader's order."""
        n = len(self.windows[s][0])
        if self.order == "sequential":
            return j % n
        span = n if self.order == "shuffle" else self.span_of(s)
        b, i = divmod(j, span)
        if self._block[s][0] != b:
            ids = self._shuffled(s, np.arange(b * span, (b + 1) * span))
            if self.order == "curriculum":  # easy to hard; ties keep the shuffled order
                ids = ids[np.argsort(self.scores[s][ids], kind="stable")]
            self._block[s] = (b, ids)
        return int(self._block[s][1][i])

    def _shuffled(self, s, m):
        """Window numbers at positions m of source s's shuffled stream: epoch e is a permutation seeded by
        (seed, source, e), so every rank and every resume draws the same one."""
        n = len(self.windows[s][0])
        out = np.empty(len(m), dtype=np.int64)
        for e in np.unique(m // n):
            at = m // n == e
            out[at] = np.random.Generator(np.random.PCG64([self.seed, s, int(e)])).permutation(n)[m[at] % n]
        return out

    def span_of(self, s):
        """Curriculum block of source s: its share of span rows (span 0: one epoch)."""
        n = len(self.windows[s][0])
        return max(1, round(self.span * self.weights[s])) if self.span else n

    def _tokens(self, s, k):
        if self._mapped[s][0] != k:  # map only the current shard of each source, and only the file first opened
            self._mapped[s] = (k, read_shard(self.shards[s][k], self.identities[s][k]))
        return self._mapped[s][1]

    def _check_ids(self, s, k, off, row):
        """row, after checking its ids are below source s's recorded vocabulary: a damaged shard (or one
        written over with another tokenizer's ids) stops with BadTokens naming the shard and the position,
        where the embedding would raise IndexError (a device-side assert on a GPU)."""
        top = int(row.max())
        if self.vocab[s] is not None and top >= self.vocab[s]:
            path = self.shards[s][k]
            raise BadTokens(f"{path}: token id {top} at token {off + int(row.argmax())} is outside the vocabulary "
                            f"of {self.vocab[s]} its meta.json records (a damaged shard, or written over by another "
                            f"tokenizer); {_fix(path)}")
        return row

    def next_batch(self):
        B, T = self.B, self.T
        src = self.rng.choice(len(self.dirs), size=B * self.world_size, p=self.weights)  # (B*world_size,)
        rows = []
        for g, s in enumerate(src):
            j, self.cursor[s] = self.cursor[s], self.cursor[s] + 1
            if self.rank * B <= g < (self.rank + 1) * B:  # this rank's rows; every rank counts all of them
                w = self.window(s, j)
                k, off = int(self.windows[s][0][w]), int(self.windows[s][1][w])
                rows.append(self._check_ids(s, k, off, self._tokens(s, k)[off:off + T + 1]))
        buf = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        x = buf[:, :-1].contiguous()  # (B, T)
        y = buf[:, 1:].contiguous()  # (B, T) next-token targets
        return x, y

    def sweep(self):
        """Every window of the split once, in shard order, as (x, y) batches: the whole-split evaluation.
        Rank r reads rows r*B .. (r+1)*B - 1 of each global batch of B * world_size windows; a row past the last
        window repeats window 0 with every target -1 (the loss ignores it), so all ranks read as many batches."""
        if len(self.dirs) != 1:
            raise ValueError("sweep() reads one source; make one loader per source")
        n, B, T = len(self.windows[0][0]), self.B, self.T
        for start in range(0, n, B * self.world_size):
            ids = np.arange(start + self.rank * B, start + (self.rank + 1) * B)
            rows = [self._check_ids(0, k, off, self._tokens(0, k)[off:off + T + 1])
                    for k, off in ((int(self.windows[0][0][w]), int(self.windows[0][1][w]))
                                   for w in np.where(ids < n, ids, 0))]
            buf = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
            x, y = buf[:, :-1].contiguous(), buf[:, 1:].contiguous()
            y[torch.from_numpy(ids >= n)] = -1
            yield x, y

    def state_dict(self):
        # plain Python types only: it loads inside a checkpoint with torch.load(weights_only=True)
        return {"dirs": [os.path.basename(os.path.normpath(d)) for d in self.dirs], "split": self.split,
                "windows": [len(w[0]) for w in self.windows], "order": self.order, "span": int(self.span), "cursor": [int(j) for j in self.cursor],
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, sd):
        _check_state(self, sd)
        self.reset()
        self.span = sd["span"]  # a resumed run keeps its curriculum blocks, even with another --max_iters
        self.cursor = [int(j) for j in sd["cursor"]]
        self.rng.bit_generator.state = sd["rng"]


ORDERS = ("sequential", "shuffle", "curriculum")


def _windows(lengths, T):
    """(shard index, offset) of every window of T+1 tokens in shards of these lengths, in shard order."""
    ks = [np.full((n - 1) // T, k) for k, n in enumerate(lengths)]
    offs = [np.arange((n - 1) // T) * T for n in lengths]
    return np.concatenate(ks).astype(np.int64), np.concatenate(offs).astype(np.int64)


def find_shards(d, split):
    """The {split}_NNN.bin paths of directory d in numeric order: train_1000.bin comes after train_999.bin.
    Refuses a set with a gap (000, 001, 003) or two files of one number: a copy or a run that did not finish."""
    names = [n for n in (os.listdir(d) if os.path.isdir(d) else []) if _shard_index(n, split) is not None]
    if not names:
        raise ValueError(f"{d}: no {split}_*.bin shards; create them: python -m tools.prepare --out_dir={d} [sources]")
    names.sort(key=lambda n: _shard_index(n, split))
    idx = [_shard_index(n, split) for n in names]
    for k in range(1, len(idx)):
        if idx[k] == idx[k - 1]:
            raise ValueError(f"{d}: {names[k - 1]} and {names[k]} are both {split} shard {idx[k]}; keep the one "
                             f"that belongs (tools/prepare.py names it {split}_{idx[k]:03d}.bin)")
    missing = min(set(range(len(idx) + 1)) - set(idx))
    if missing < len(idx):
        path = os.path.join(d, f"{split}_{missing:03d}.bin")
        raise ValueError(f"{path}: missing, but {d} has {split} shards numbered up to {idx[-1]} "
                         f"(an incomplete dataset); {_fix(path)}")
    return [os.path.join(d, n) for n in names]


def _shard_index(name, split):
    m = re.fullmatch(rf"{split}_(\d+)\.bin", name)
    return int(m.group(1)) if m else None

# -----------------------------------------------------------------------------
# difficulty: what the curriculum sorts by

DIFFICULTY_CHUNK = 256  # tokens per difficulty score (prepare.difficulty: the zlib ratio of the chunk's text)


def difficulty_path(shard):
    return shard[:-len(".bin")] + ".difficulty.npy"


def window_difficulty(shards, lengths, T):
    """Per window (as _windows numbers them): the mean difficulty of the chunks its T inputs touch (one chunk
    when T is a multiple of DIFFICULTY_CHUNK)."""
    out = []
    for path, n in zip(shards, lengths):
        try:
            chunks = np.load(difficulty_path(path))
        except (OSError, ValueError):
            raise ValueError(f"{difficulty_path(path)}: missing or unreadable, and the curriculum order needs it; "
                             f"{_fix(path)}") from None
        if len(chunks) != -(-n // DIFFICULTY_CHUNK):
            raise ValueError(f"{difficulty_path(path)}: {len(chunks)} scores for {n} tokens in chunks of "
                             f"{DIFFICULTY_CHUNK}: not this shard's; {_fix(path)}")
        csum = np.concatenate([[0.0], np.cumsum(chunks, dtype=np.float64)])
        off = np.arange((n - 1) // T) * T
        first, last = off // DIFFICULTY_CHUNK, (off + T - 1) // DIFFICULTY_CHUNK  # chunks of its inputs x
        out.append((csum[last + 1] - csum[first]) / (last + 1 - first))
    return np.concatenate(out)

# -----------------------------------------------------------------------------
# checks: a bad file or argument is one ValueError that names it and says what to do


def _fix(path):
    """What to do about a damaged file of the shard directory that holds path."""
    d = os.path.dirname(path) or "."
    return f"re-create the directory: python -m tools.prepare --out_dir={d} <the sources listed in its meta.json>"


def _check_tokens(path, tokens, dtype):
    """The little-endian dtype to store tokens as, after checking that every id fits it and the header."""
    top = int(tokens.max()) if tokens.size else 0
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"{path}: negative token id {tokens.min()}")
    dtype = np.dtype(dtype if dtype is not None else np.uint16 if top < 2**16 else np.uint32).newbyteorder("<")
    if dtype.kind != "u" or dtype.itemsize not in (2, 4) or top >= 2 ** (8 * dtype.itemsize):
        raise ValueError(f"{path}: token id {top} cannot be stored as {dtype.name}; use uint16 or uint32")
    if tokens.size > MAX_SHARD_TOKENS:
        raise ValueError(f"{path}: {tokens.size} tokens overflow the int32 header; use a smaller shard_tokens")
    return dtype


def _check_header(path, f):
    """(version, n_tokens) of the shard at path, open as f, after checking its magic, version and size."""
    size = os.fstat(f.fileno()).st_size
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header; {_fix(path)}")
    f.seek(0)
    magic, version, ntok = (int(v) for v in np.frombuffer(f.read(12), dtype="<i4"))
    if magic != MAGIC:
        raise ValueError(f"{path}: bad magic {magic} (expected {MAGIC}); {_fix(path)}")
    if version not in VERSION_DTYPE:
        raise ValueError(f"{path}: unsupported version {version} (expected 1 or 2); {_fix(path)}")
    expected = HEADER_BYTES + ntok * VERSION_DTYPE[version].itemsize
    if ntok < 0 or size != expected:
        raise ValueError(f"{path}: {size} bytes, but its header says {ntok} tokens = {expected} bytes "
                         f"(truncated or corrupt); {_fix(path)}")
    return version, ntok


def _check_sources(sources, rank, world_size):
    sources = {sources: 1.0} if isinstance(sources, str) else dict(sources)
    if not sources or not all(w > 0 for w in sources.values()):
        raise ValueError(f"sources must be a directory or a dict {{directory: weight > 0}}, got {sources}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    return sources


def _check_block_size(shards, lengths, T):
    for p, n in ((p, n) for paths, ns in zip(shards, lengths) for p, n in zip(paths, ns)):
        if n < T + 1:
            raise ValueError(f"{p}: block_size {T} is too large for this shard of {n} tokens (a row "
                             f"reads block_size+1); lower --block_size or prepare more data")


def _check_meta(dirs, split, lengths):
    """Each meta.json (optional: a directory of shards alone is fine) against the shards found beside it, then
    one tokenizer across sources. A meta.json without a shard count has its token count checked alone. Returns
    each source's recorded vocab_size (None without one)."""
    tokenizers, vocab = {}, []
    for d, ns in zip(dirs, lengths):
        vocab.append(None)
        if not os.path.exists(os.path.join(d, "meta.json")):
            continue
        meta = read_meta(d)
        tokenizers[d], vocab[-1] = meta["tokenizer"], meta.get("vocab_size")
        want = (meta.get(f"{split}_tokens", sum(ns)), meta.get(f"{split}_shards", len(ns)))
        if want != (sum(ns), len(ns)):
            path = os.path.join(d, "meta.json")
            raise ValueError(f"{path}: records {want[0]} {split} tokens in {want[1]} {split} shards, but {d} holds "
                             f"{sum(ns)} tokens in {len(ns)} shards (a partial copy, or shards of another run); "
                             f"{_fix(path)}")
    if len({os.path.realpath(t) if os.path.exists(t) else t for t in tokenizers.values()}) > 1:  # 1 model, 2 paths: 1
        raise ValueError(f"sources were made by different tokenizers {tokenizers}; mix only one tokenizer")
    return vocab


def _check_meta_json(path):
    d = os.path.dirname(path) or "."
    fix = f"re-create it: python -m tools.prepare --out_dir={d} <the sources it was made from>"
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; make the shards: python -m tools.prepare --out_dir={d} "
                         "<files>") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror}); {fix}") from None
    except ValueError as e:  # empty, cut short, not UTF-8
        raise ValueError(f"{path}: not valid JSON ({e}); {fix}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("tokenizer"), str):
        raise ValueError(f"{path}: no \"tokenizer\" field (a JSON object written by tools/prepare.py is expected); {fix}")
    return meta


def _check_state(loader, sd):
    """A state_dict() of a loader reading the same sources in the same order."""
    missing = [k for k in ("dirs", "split", "order", "span", "cursor", "rng") if k not in sd]
    if missing:
        raise ValueError(f"loader state with keys {', '.join(sorted(sd))} lacks {', '.join(missing)}: not a "
                         f"DataLoader.state_dict()")
    names = [os.path.basename(os.path.normpath(d)) for d in loader.dirs]
    if sd["dirs"] != names or sd["split"] != loader.split:
        raise ValueError(f"loader state is for {sd['split']} of {sd['dirs']} but this loader reads {loader.split} "
                         f"of {names}; resume with the same sources in the same order")
    now = [len(w[0]) for w in loader.windows]
    if "windows" in sd and sd["windows"] != now:  # a state saved before this key existed is not checked
        raise ValueError(f"loader state is for {sd['dirs']} holding {sd['windows']} windows of {loader.T + 1} tokens, "
                         f"but they hold {now} now: other shards under the same directory name(s); resume with the "
                         f"shards the run was trained on")
    if sd["order"] != loader.order:
        raise ValueError(f"loader state is for --data_order={sd['order']}, but this run asks for "
                         f"{loader.order}; resume with --data_order={sd['order']}")
    if len(sd["cursor"]) != len(loader.dirs) or min(sd["cursor"]) < 0:
        raise ValueError(f"loader state {sd['cursor']} does not fit the {len(loader.dirs)} source(s) of this run")

# -----------------------------------------------------------------------------
# shards replaced under a running loader (tools/prepare.py re-ran into its directory)


class DataChanged(ValueError):
    """The shards of a running DataLoader were replaced or removed (tools/prepare.py re-ran into its directory).
    Raised by next_batch() when it maps a shard, the first one after reset() included: every batch before it
    came from the files the loader opened, never from a mix. The position of the loader that raised it is then
    partway through that call, so a training loop stops without saving that loader's state_dict() (its last
    checkpoint, or a state_dict() taken before the step, resumes exactly)."""


class BadTokens(DataChanged):
    """A shard holds a token id at or past the vocabulary its meta.json records (DataLoader._check_ids)."""


def shard_identity(path):
    """(device, inode, size, mtime_ns) of a file: any rewrite or replacement of it changes one of them."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _open_shard(path, identity):
    """path opened for reading; with identity given, another file at path (or none) raises DataChanged."""
    d = os.path.dirname(path) or "."
    changed = (f"{d}: the shards changed while this run was reading them ({os.path.basename(path)} %s; "
               f"python -m tools.prepare re-ran?); restart the run, or --resume=True from its last checkpoint")
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        if identity is None:
            raise
        raise DataChanged(changed % "is gone") from None
    st = os.fstat(f.fileno())
    if identity is not None and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != tuple(identity):
        f.close()
        raise DataChanged(changed % "is another file now")
    return f

# -----------------------------------------------------------------------------


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if sys.argv[1:]:  # flags belong to the tokenising command: name it
        print(f"error: data.py takes no flags; tokenising is: python -m tools.prepare {' '.join(sys.argv[1:])}",
              file=sys.stderr)
        sys.exit(2)
    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare_byte")
    if not os.path.exists(os.path.join(d, "meta.json")):
        print(f"error: no shards in {d}; make them first: python -m tools.prepare --tokenizer=byte", file=sys.stderr)
        sys.exit(1)
    shard = os.path.join(d, "train_000.bin")
    print(f"{shard}: header {np.fromfile(shard, dtype='<i4', count=4).tolist()} (magic, version, n_tokens, 0)")
    x, y = DataLoader(d, "train", B=2, T=48, order="sequential").next_batch()  # (2, 48) each; y = x shifted by one
    for b in range(2):
        print(f"row {b}: x[:8] = {x[b, :8].tolist()}, y[:8] = {y[b, :8].tolist()}\n"
              f"       decoded: {bytes(t for t in x[b].tolist() if t < 256).decode('utf-8', 'replace')!r}")
