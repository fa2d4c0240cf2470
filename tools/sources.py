"""
Reading a corpus for tools/prepare.py: source files and patterns in, the text of each document out,
in order.

Sources: .txt (the whole file is one document; a .txt given alone, such as nanoGPT's input.txt, is
cut into paragraphs at its blank lines, so that it holds the two or more documents a train/val split
by document needs, and the paragraphs joined are the file byte for byte), .jsonl / .jsonl.gz (one
{"text": ...} document per line), .parquet (the "text" column, read one row group at a time). A bad
source is refused with one ValueError that names the file and says what to do: a missing file, a
directory, an unsupported type, a file given twice, bytes that are not UTF-8 (with their offset), a
damaged gzip stream, a JSON line without a string "text".
Test:
    python -m pytest tests/test_prepare.py
"""

import contextlib
import glob
import gzip
import json
import os
import re
import time
import zlib

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")


def expand(sources):
    """The files that sources (names and glob patterns) stand for, in order, each one checked to
    exist, be of a supported type and come only once."""
    paths = []
    for s in [sources] if isinstance(sources, str) else sources:
        if os.path.isdir(s):
            example = os.path.join(s, "*.txt")
            raise ValueError(f"{s}: is a directory; pass its files, e.g. '{example}'")
        matches = sorted(glob.glob(s)) if glob.has_magic(s) else [s] if os.path.isfile(s) else []
        if not matches:
            what = "the pattern matches no file" if glob.has_magic(s) else "no such file"
            raise ValueError(f"{s}: {what}")
        paths += matches
    # (device, inode) -> path: the same file through another path or a symlink is the same source
    seen = {}
    for p in paths:
        if not p.endswith(SUFFIXES):
            raise ValueError(f"{p}: unsupported file type; expected .txt, .jsonl, .jsonl.gz or "
                             f".parquet")
        with reading(p):
            st = os.stat(p)
        first = seen.get((st.st_dev, st.st_ino))
        if first is not None:  # this file came before, by this name or another
            also = "" if first == p else f" (also as {first})"
            raise ValueError(f"{p}: given twice{also}, so every document in it would be in the "
                             "dataset twice; pass each source once")
        seen[st.st_dev, st.st_ino] = p
    if not paths:
        raise ValueError("no sources given")
    return paths


def one_txt(paths):
    """Whether paths is a single .txt file, whose paragraphs are then its documents
    (paragraphs())."""
    return len(paths) == 1 and paths[0].endswith(".txt")


def paragraphs(text):
    """text cut after each run of blank lines (a blank line: only spaces, tabs or a carriage
    return), the run staying with the paragraph before it (leading blank lines with the first):
    "".join(...) == text."""
    out, start = [], 0
    for m in re.finditer(r"\n(?:[ \t\r]*\n)+", text):
        if m.end() < len(text) and text[start:m.end()].strip():  # blank lines first: the next one's
            out.append(text[start:m.end()])
            start = m.end()
    if out and not text[start:].strip():  # a last blank line without its newline: the paragraph before's
        out[-1] += text[start:]
        return out
    return out + [text[start:]] if text else []


def iter_documents(paths, progress=None, split_txt=False):
    """Yield the text of every non-empty document, in order. A file that is not valid UTF-8 is
    refused with the byte offset of its first bad byte: the text is never silently altered. progress
    (a Progress) is told how far through the sources' bytes the reading is. split_txt: a .txt file's
    paragraphs are its documents."""
    for i, path in enumerate(paths):
        with reading(path):  # a damaged .gz or an unreadable file: one line naming it
            if progress is not None:
                progress.file(i)
            if path.endswith(".parquet"):
                yield from _parquet_documents(path, progress)
                continue
            if path.endswith(".txt"):  # read as bytes: no newline translation, on every platform
                with open(path, "rb") as f:
                    text = _utf8(f.read(), path, 0)
                yield from (paragraphs(text) if split_txt else [text] if text else [])
                continue
            yield from _jsonl_documents(path, progress)


LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins a valid pair into one character


def _jsonl_documents(path, progress=None):
    offset = 0
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        raw_file = f.fileobj if path.endswith(".gz") else f  # compressed position: fraction read
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
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a string \"text\" "
                                 f"field")
            if "\\u" in line and LONE_SURROGATE.search(text):  # only a JSON escape can make one
                raise ValueError(f"{path}:{lineno}: its \"text\" holds a lone UTF-16 surrogate (an "
                                 "unpaired \\ud800-\\udfff escape): not Unicode text, which a tokenizer "
                                 "would alter or refuse; fix or remove that line")
            if text:
                yield text


def _parquet_documents(path, progress=None):
    """The "text" column of a parquet file (FineWeb-Edu, DCLM and nanochat's shards), one row group
    at a time, so memory holds one row group, not the file."""
    try:
        import pyarrow.parquet as pq  # only parquet sources need it
    except ImportError:
        raise ValueError(f"{path}: reading parquet needs pyarrow: pip install -r "
                         f"requirements.txt") from None
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own errors: not a parquet file, a truncated footer
        why = str(e).splitlines()[0][:200]
        raise ValueError(f"{path}: not a readable parquet file ({why})") from None
    names = f.schema_arrow.names
    if "text" not in names:
        raise ValueError(f"{path}: no \"text\" column (it has {', '.join(names[:8])}); the "
                         "documents must be in a string column named text")
    for g in range(f.num_row_groups):
        column = f.read_row_group(g, columns=["text"]).column("text").to_pylist()
        for row, text in enumerate(column):
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{path}: row group {g}, row {row}: text is "
                                 f"{type(text).__name__}, not a string")
            if text:
                yield text
        if progress is not None:
            progress.within((g + 1) / f.num_row_groups * os.path.getsize(path))


class Progress:
    """A progress line every `every` seconds (never in the first `every`): the fraction of the
    sources' bytes read, tokens so far, tokens/s and the time left at that rate."""

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
        frac = 1.0 if done else (self.done + self.pos) / self.total
        rate = self.tokens / max(now - self.t0, 1e-9)
        left = (now - self.t0) * (1 - frac) / frac if frac > 0 else float("nan")
        eta = f"{int(left // 60)}:{int(left % 60):02d}" if left == left else "?"
        print(f"  {frac:5.1%} of the sources, {self.tokens:,} tokens, {rate:,.0f} tokens/s, "
              f"{eta} left", flush=True)


def chunks(docs, max_chars=1 << 22, max_docs=1024):
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


@contextlib.contextmanager
def reading(p):
    """Reading source p: a damaged gzip stream or an unreadable file becomes one ValueError naming
    it."""
    try:
        yield
    except gzip.BadGzipFile as e:
        raise ValueError(f"{p}: not a gzip file ({e}); compress it with gzip, or if it is plain "
                         f"text, rename it to {p[:-3]}") from None
    except (EOFError, zlib.error) as e:
        raise ValueError(f"{p}: the gzip stream ends early or is corrupt ({e}; a truncated "
                         f"download?); get the file again, or check it with: gzip -t {p}") from None
    except OSError as e:
        raise ValueError(f"{p}: cannot be read ({e.strerror or e}); check the file and its "
                         f"permissions") from None


def _utf8(raw, path, offset):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = " of the decompressed text" if path.endswith(".gz") else ""
        raise ValueError(f"{path}: not UTF-8: byte 0x{raw[e.start]:02x} at byte offset "
                         f"{offset + e.start}{where}; convert the file to UTF-8 first "
                         f"(e.g. iconv -f latin1 -t utf-8)") from None
