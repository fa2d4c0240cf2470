"""
Cleaning a corpus before it is tokenised: heuristic quality filters, exact deduplication, and
near-duplicate removal with MinHash + LSH. Each document goes through three gates in order and the
first one it fails drops it:

1. quality filters, a few cheap rules per document (the first rule failed is the reason reported)
   prose (Gopher, Rae et al., arXiv 2112.11446, App. A.1.1): 50..100,000 words; mean word length
   3..10; '#' per word and '...' per word each <= 0.1; >= 80% of words contain a letter; lines that repeat an
   earlier line <= 30% of the lines and <= 20% of the characters;
   code (Codex, arXiv 2107.03374 sec. 3.1; StarCoder, arXiv 2305.06161 sec. 4): >= 50 words; mean
   line length <= 100; longest line <= 1000; alphanumeric characters >= 25% of the text.
2. exact duplicates: the sha1 of the normalised text (lower case, whitespace collapsed) was seen.
3. near duplicates (Broder 1997; the LSH banding of Leskovec, Rajaraman & Ullman, "Mining of Massive
   Datasets", ch. 3; as used for LM data by Lee et al., arXiv 2107.06499 sec. 4.1):
     shingles S(d) = the set of word 5-grams of d; Jaccard J(a, b) = |S(a) & S(b)| / |S(a) | S(b)|
     MinHash: k hashes h_i; sig_i(d) = min over s in S(d) of h_i(s); P[sig_i(a) = sig_i(b)] = J
     LSH: the k values in b bands of r rows; a candidate pair: all r rows of some band agree,
          P[candidate] = 1 - (1 - J^r)^b (b=32, r=4: 0.9999 at J=0.8, 0.23 at J=0.3)
   a candidate pair is confirmed with the exact Jaccard of the shingle sets, J >= threshold (0.8,
   the source notes' example); the later document of a confirmed pair is dropped, the first kept.
Everything is numpy and the standard library; hashes are fixed (no Python hash() salt), so the same
corpus always gives the same result. tools/prepare.py runs it (--clean=prose|code|dedup|none).

Run (the report only, nothing written; --help for the flags):
    python -m lessons.clean                                         # the shipped code corpus
    python -m lessons.clean --kind=prose data/shakespeare.jsonl.gz  # the plays, Gopher's rules
Test:
    python -m pytest tests/test_clean.py
"""

import gzip
import hashlib
import json
import re
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PROSE = dict(min_words=50, max_words=100_000, min_mean_word=3.0, max_mean_word=10.0,
             max_symbols=0.1, min_alpha_words=0.8, max_dup_lines=0.3, max_dup_line_chars=0.2)
CODE = dict(min_words=50, max_mean_line=100.0, max_line=1000, min_alnum=0.25)
KINDS = {"prose": PROSE, "code": CODE}
LETTER = re.compile(r"[^\W\d_]")  # a letter in any script


def quality_reason(text, kind="prose"):
    """The first quality rule that text fails, as a short name, or None if it passes them all."""
    p, words = KINDS[kind], text.split()
    if len(words) < p["min_words"]:
        return "too few words"
    if kind == "code":
        lengths = [len(line) for line in text.split("\n")]
        if sum(lengths) / len(lengths) > p["max_mean_line"]:
            return "long mean line"
        if max(lengths) > p["max_line"]:
            return "very long line"
        if sum(c.isalnum() for c in text) / len(text) < p["min_alnum"]:
            return "few alphanumerics"
        return None
    if len(words) > p["max_words"]:
        return "too many words"
    if not p["min_mean_word"] <= sum(map(len, words)) / len(words) <= p["max_mean_word"]:
        return "odd mean word length"
    # each symbol on its own, as Gopher's "for either the hash symbol or the ellipsis"
    if max(text.count("#"), text.count("...") + text.count("\u2026")) / len(words) > p["max_symbols"]:
        return "symbols"
    if sum(bool(LETTER.search(w)) for w in words) / len(words) < p["min_alpha_words"]:
        return "few words with letters"
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    seen, dup, dup_chars = set(), 0, 0
    # a line that repeats an earlier one (its first occurrence is not a duplicate)
    for line in lines:
        if line in seen:
            dup, dup_chars = dup + 1, dup_chars + len(line)
        seen.add(line)
    chars = sum(map(len, lines))
    if dup > p["max_dup_lines"] * len(lines) or dup_chars > p["max_dup_line_chars"] * chars:
        return "repeated lines"
    return None


def normalise(text):
    return " ".join(text.lower().split())


def shingles(text, n=5):
    """The set of word n-grams of text (lower case, \\w+ words) as sorted unique uint32 hashes. A
    word is hashed with crc32, an n-gram by a polynomial over its words' hashes (mod 2^64), mixed,
    kept to its top 32 bits."""
    words = re.findall(r"\w+", text.lower())
    if not words:
        return np.zeros(0, dtype=np.uint32)
    table = {}
    ids = np.array([table.setdefault(w, zlib.crc32(w.encode())) for w in words], dtype=np.uint64)
    m = max(len(ids) - n + 1, 1)  # a text shorter than n words is one shingle
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(min(n, len(ids))):
            h = h * np.uint64(0x100000001B3) + ids[i:i + m]
        # mix: every word reaches the top 32 bits
        h = (h ^ (h >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
    return np.unique((h >> np.uint64(32)).astype(np.uint32))


def jaccard(a, b):
    """|a & b| / |a | b| of two sorted unique arrays; 0 for two empty ones (texts without a word share
    no shingle: only the exact-duplicate gate compares them)."""
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter) if len(a) + len(b) else 0.0


class MinHash:
    """k hash functions h_i(x) = (a_i x + b_i mod 2^64) >> 32 on 32-bit x (multiply-add-shift, a_i
    odd)."""

    def __init__(self, k=128, seed=0):
        rng = np.random.Generator(np.random.PCG64(seed))
        self.a = rng.integers(0, 2**63, size=(k, 1), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.b = rng.integers(0, 2**63, size=(k, 1), dtype=np.uint64)

    def signature(self, sh, chunk=8192):
        """(k,) uint32: per hash function, its minimum over the shingles sh."""
        sig = np.full(len(self.a), 2**32 - 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            # (k, chunk) at a time: bounded memory for long documents
            for i in range(0, len(sh), chunk):
                x = sh[i:i + chunk].astype(np.uint64)[None, :]
                sig = np.minimum(sig, ((self.a * x + self.b) >> np.uint64(32)).min(axis=1))
        return sig.astype(np.uint32)


@dataclass
class Cleaner:
    """Streaming: keep(text) says whether a document survives, given every document kept before
    it."""
    kind: str = "prose"           # prose | code: which quality rules (None: no quality filter)
    threshold: float = 0.8        # near duplicate: exact Jaccard of word 5-gram sets >= threshold
    bands: int = 32
    rows: int = 4
    removed: Counter = field(default_factory=Counter)  # reason -> documents
    docs_in: int = 0
    chars_in: int = 0
    chars_out: int = 0
    seconds: float = 0.0

    def __post_init__(self):
        self.minhash = MinHash(self.bands * self.rows)
        self.exact = set()      # sha1 of the normalised text of every kept document
        self.buckets = {}       # (band, its r values as bytes) -> ids of kept documents
        self.kept = []          # shingle sets of kept documents, by id

    def keep(self, text):
        t0 = time.perf_counter()
        self.docs_in, self.chars_in = self.docs_in + 1, self.chars_in + len(text)
        reason = self._reason(text)
        if reason:
            self.removed[reason] += 1
        else:
            self.chars_out += len(text)
        self.seconds += time.perf_counter() - t0
        return reason is None

    def _reason(self, text):
        reason = quality_reason(text, self.kind) if self.kind else None
        if reason:
            return reason
        digest = hashlib.sha1(normalise(text).encode()).digest()
        if digest in self.exact:
            return "exact duplicate"
        sh = shingles(text)
        bands = self.minhash.signature(sh).reshape(self.bands, self.rows)
        keys = [(j, v.tobytes()) for j, v in enumerate(bands)]
        candidates = {i for key in keys for i in self.buckets.get(key, ())}
        if any(jaccard(sh, self.kept[i]) >= self.threshold for i in sorted(candidates)):
            return "near duplicate"
        self.exact.add(digest)
        for key in keys:
            self.buckets.setdefault(key, []).append(len(self.kept))
        self.kept.append(sh)
        return None

    def report(self):
        """One line per gate: documents in, removed and why, kept; and the throughput."""
        out = sum(self.removed.values())
        most_first = sorted(self.removed.items(), key=lambda kv: -kv[1])
        why = ", ".join(f"{n} {r}" for r, n in most_first) or "none"
        return (f"cleaning ({self.kind or 'no quality filter'}, near-duplicate Jaccard >= "
                f"{self.threshold}): {self.docs_in:,} documents in, {out:,} removed ({why}), "
                f"{self.docs_in - out:,} kept; {self.chars_in - self.chars_out:,} of "
                f"{self.chars_in:,} characters removed; "
                f"{self.chars_in / 1e6 / max(self.seconds, 1e-9):.1f} M characters/s")

    def summary(self):
        """The report as plain types, for meta.json."""
        return dict(kind=self.kind, threshold=self.threshold, bands=self.bands, rows=self.rows,
                    docs_in=self.docs_in, docs_removed=dict(self.removed), chars_in=self.chars_in,
                    chars_out=self.chars_out, seconds=round(self.seconds, 3))


def main(argv):
    """python -m lessons.clean [--kind=code|prose|dedup] [FILE.jsonl[.gz] ...]: the cleaning report
    of the files ({"text": ...} per line; none: the shipped code corpus), nothing written; 0, or 2
    after one 'error: ...' line for a bad argument or file."""
    import os
    import sys
    kind, paths = "code", []
    for a in argv:
        if a in ("-h", "--help"):
            print(__doc__.split("Run:")[0].rstrip() + "\n\n" + main.__doc__.split(":")[0] + "\n  "
                  "--kind=code|prose|dedup  quality rules for code or prose, then deduplication; "
                  "dedup: only that (default code)")
            return 0
        if a.startswith("--kind="):
            kind = a.split("=", 1)[1]
            if kind not in ("code", "prose", "dedup"):
                print(f"error: --kind={kind}: expected code, prose or dedup", file=sys.stderr)
                return 2
        elif a.startswith("-"):
            print(f"error: {a}: unknown option; python -m lessons.clean --help lists them",
                  file=sys.stderr)
            return 2
        else:
            paths.append(a)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cleaner = Cleaner(None if kind == "dedup" else kind)
    for path in paths or [os.path.join(root, "data", "python.jsonl.gz")]:
        n = 0
        try:
            with gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else \
                    open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    text = json.loads(line)["text"] if line.strip() else ""
                    if text:  # as tools.prepare: an empty text is no document
                        cleaner.keep(text)
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            why = getattr(e, "strerror", None) or \
                f"not a {{\"text\": ...}} JSON line ({type(e).__name__})"
            where = f"line {n}: " if n else ""
            print(f"error: {path}: {where}{why}; pass .jsonl or .jsonl.gz files of "
                  f"{{\"text\": ...}} lines", file=sys.stderr)
            return 2
    print(cleaner.report())
    return 0


# the demo: the shipped code corpus cleaned as code, or your files; nothing written
if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
