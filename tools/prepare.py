"""
Tokenise a corpus once into the binary shards that data.py's DataLoader streams (format: data.py,
docs/shard-format.md).

Documents (tools/sources.py reads them) are first cleaned (lessons/clean.py: quality rules for prose
or code, exact and MinHash near-duplicate removal; --clean=prose|code|dedup|none, by default the
shipped corpus's setting and none for your own files, the report printed). Document i (in source
order, empty and removed documents skipped) goes to val iff i % val_every == val_every - 1, so the
split is by document and the same corpus always gives byte-identical shards. Each document is
written as [eot] + tokens into {train,val}_000.bin, ... of exactly shard_tokens tokens (the last
shorter; uint16 ids, llm.c's version 1, or uint32, version 2, when the vocabulary exceeds 65,536),
each with its difficulty scores (<shard>.difficulty.npy, difficulty(): what --data_order=curriculum
sorts by), plus a meta.json. The dataset is built in a temporary directory beside out_dir, which
then replaces out_dir whole (tools/atomic.py atomic_dir), so a failed, stopped or killed run leaves
an older dataset intact, and a loader never sees a mix of two runs.

Run (the default corpus: the shipped data/shakespeare.jsonl.gz, into data/shakespeare_<tokenizer>/):
    python -m tools.prepare --tokenizer=byte
    python -m tools.prepare --corpus=python   # the shipped code corpus (data/README.md)
    python -m tools.prepare input.txt         # one .txt (nanoGPT's): its paragraphs are documents
    python -m tools.prepare --tokenizer=gpt2 --out_dir=data/mine corpus/*.txt more.jsonl.gz
    python -m tools.prepare --tokenizer=gpt2 --out_dir=data/fineweb_edu \
        fineweb-edu/sample/10BT/*.parquet
    python -m tools.prepare --tokenizer=gpt2 --adopt=llm.c/dev/data/fineweb10B \
        --out_dir=data/fineweb10B
    python -m tools.prepare --tokenizer=data/models/SmolLM2-135M-Instruct.Q4_1.gguf
        (a pretrained model's own ids, into data/shakespeare_SmolLM2-135M-Instruct.Q4_1-<hash>/;
        python -m tools.get_model smollm2 fetches it; --tokenizer also takes a Hugging Face model
        directory or a hub id; meta.json records the name as given)
Sources: .txt (the whole file is one document; a .txt given alone is cut into paragraphs at its
blank lines), .jsonl / .jsonl.gz (one {"text": ...} document per line), .parquet (the "text" column,
read one row group at a time). --adopt uses llm.c-format shards as they are (tools/adopt.py). A
shipped corpus's directory (data/shakespeare_<tokenizer>, what train.py --data=shakespeare reads)
takes only that corpus as shipped: your own files, another --clean or adopted shards go to another
--out_dir. Any other --out_dir holding a dataset of other sources or another tokenizer's ids is
replaced only with --overwrite=True. python -m tools.prepare --help lists every flag.
Test:
    python -m pytest tests/test_prepare.py
"""

from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import dataclasses
import hashlib
import json
import os
import re
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
from tools.sources import Progress, chunks, expand, iter_documents, one_txt  # noqa: F401

DATA_DIR = os.path.join(ROOT, "data")  # shipped assets, default outputs
SHAKESPEARE = os.path.join(DATA_DIR, "shakespeare.jsonl.gz")
PYTHON = os.path.join(DATA_DIR, "python.jsonl.gz")
# the shipped corpora (data/README.md): name -> (file, default --clean). The plays are deduplicated
# but not quality-filtered: Gopher's repeated-lines rule, written for web text, would drop The Merry
# Wives of Windsor, whose speaker names ("FALSTAFF.") repeat past its limit (python -m lessons.clean
# --kind=prose data/shakespeare.jsonl.gz shows it)
CORPORA = {"shakespeare": (SHAKESPEARE, "dedup"), "python": (PYTHON, "code")}
# quality rules (lessons/clean.py) and deduplication, for prose or code; deduplication only; nothing
CLEAN = ("prose", "code", "dedup", "none")
VAL_EVERY_RULE = ("expected an integer >= 2 (every val_every-th document goes to val; 1 would "
                  "leave none for train)")


def difficulty(tokens, decode_bytes, chunk=data.DIFFICULTY_CHUNK):
    """Difficulty of each chunk of `chunk` tokens: the zlib compression ratio of its text,
    compressed bytes / raw bytes (the eot token carries no text). Text that repeats itself
    (refrains, lists of names, short exchanges) compresses well and scores low, 'easy'; dense,
    varied text scores high. It needs no model, so it is computed here once, deterministically, and
    prints how long that took; a small reference model's loss is the costlier alternative (it ranks
    by what one model finds hard, and must exist first). decode_bytes: token ids -> bytes (the
    tokenizer's)."""
    out = np.empty(-(-len(tokens) // chunk), dtype=np.float32)
    for c in range(len(out)):
        raw = decode_bytes(tokens[c * chunk:(c + 1) * chunk])
        out[c] = len(zlib.compress(raw, 9)) / len(raw) if raw else 0.0
    return out


class _ShardWriter:
    """Writes one split's documents as {split}_000.bin, ... of exactly shard_tokens tokens (the last
    shorter)."""

    def __init__(self, out_dir, split, dtype, shard_tokens, decode_bytes):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.shard_tokens = shard_tokens
        self.decode_bytes = decode_bytes  # for the difficulty scores the curriculum order sorts by
        self.buf, self.nbuf, self.nshards, self.ntok, self.ndocs, self.score_s = [], 0, 0, 0, 0, 0.0

    def add(self, doc):  # doc: (1 + len(tokens),) = [eot] + tokens
        self.buf.append(doc)
        self.nbuf, self.ntok = self.nbuf + len(doc), self.ntok + len(doc)
        self.ndocs += 1
        while self.nbuf >= self.shard_tokens:  # a document may go on into the next shard (as llm.c)
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


SHARD_TOKENS_RULE = f"expected an integer from 1 to {data.MAX_SHARD_TOKENS} (a shard header's int32 count)"


def prepare(sources=None, tokenizer="byte", out_dir=None, val_every=20, shard_tokens=100_000_000,
            corpus="shakespeare", clean_as=None, overwrite=False):
    """Tokenise sources (None: the shipped corpus named `corpus`) into out_dir/{train,val}_NNN.bin
    and meta.json; return out_dir. clean_as: prose | code (quality rules, then exact and
    near-duplicate removal, lessons/clean.py), dedup (only the deduplication), none; None = the
    shipped corpus's default, or none for your own files. Document i (source order, empty and
    removed documents skipped) goes to val iff i % val_every == val_every - 1; if that picks none,
    the last document does. The new dataset is built in a temporary directory beside out_dir and
    then replaces out_dir whole, so a failed run leaves an older dataset intact. A ValueError says
    what went wrong in one line (a bad source, a full disk); out_dir is then as it was. A dataset of
    other sources or another tokenizer in out_dir is replaced only with overwrite
    (_check_replacing)."""
    t0 = time.time()
    tok = get_tokenizer(tokenizer)
    if val_every < 2:  # 1 would put every document in val and none in train
        raise ValueError(f"val_every={val_every}: {VAL_EVERY_RULE}")
    if not 1 <= shard_tokens <= data.MAX_SHARD_TOKENS:
        raise ValueError(f"shard_tokens={shard_tokens}: {SHARD_TOKENS_RULE}")
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; shipped: {', '.join(CORPORA)}")
    paths = [CORPORA[corpus][0]] if sources is None else expand(sources)
    clean_as = clean_as or (CORPORA[corpus][1] if sources is None else "none")
    if clean_as not in CLEAN:
        raise ValueError(f"unknown cleaning {clean_as!r}; expected one of {', '.join(CLEAN)}")
    cleaner = None if clean_as == "none" else clean.Cleaner(
        None if clean_as == "dedup" else clean_as)
    given, out_dir = out_dir, out_dir or default_out_dir(sources, paths, tok.name, corpus)
    _check_not_shipped(out_dir, tok.name, paths, clean_as, default=not given)  # before any reading
    _check_replacing(out_dir, tok.name, paths, None, overwrite)
    # shard version 1 (llm.c's), else 2 (ours, data.py)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    split_txt = one_txt(paths)  # a single .txt: its paragraphs are the documents
    try:
        real = _check_out_dir(out_dir)  # the directory replaced (out_dir may be a symlink to it)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        with atomic_dir(real) as tmp_dir:  # which first clears what killed runs left beside it
            train, val = (_ShardWriter(tmp_dir, split, dtype, shard_tokens, tok.decode_bytes)
                          for split in ("train", "val"))
            # held: the latest train document, kept back in case it must be the only val one
            i, held = 0, None
            progress = Progress(paths)
            docs = iter_documents(paths, progress, split_txt)
            for chunk in chunks(docs if cleaner is None else filter(cleaner.keep, docs)):
                encoded = tok.encode_batch(chunk)  # batched: tiktoken uses every thread
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
                    what += (f" left after cleaning ({cleaner.report()}; --clean=none keeps them "
                             f"all)")
                raise ValueError(f"{what} in {', '.join(paths)}; the train/val split is by "
                                 "document, so give at least 2 (e.g. several .txt files or .jsonl "
                                 "lines, or one .txt with blank lines between its paragraphs)")
            (val if val.ndocs == 0 else train).add(held)
            n_train, n_val = train.close(), val.close()
            meta = dict(tokenizer=tok.name, tokenizer_fingerprint=fingerprint(tok),
                        vocab_size=tok.vocab_size, eot=tok.eot, dtype=np.dtype(dtype).name,
                        n_docs_train=train.ndocs, n_docs_val=val.ndocs, train_tokens=train.ntok,
                        val_tokens=val.ntok, train_shards=n_train, val_shards=n_val, sources=paths,
                        source_bytes=[source_bytes(p) for p in paths],  # _check_replacing knows a moved source by them
                        val_every=val_every, cleaning=cleaner.summary() if cleaner else None,
                        difficulty=f"zlib compression ratio per {data.DIFFICULTY_CHUNK} tokens, "
                                   f"<shard>.difficulty.npy")
            with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2)
    except OSError as e:  # writing failed (a full disk, no permission): the sources were read without error
        why, cause, fix = write_failed(e, out_dir)
        raise ValueError(f"{out_dir}: cannot write the new dataset ({why}; {cause}); {fix} or pass another "
                         f"--out_dir; nothing in {out_dir} was changed") from None
    seconds = time.time() - t0
    cleaned = cleaner.report() if cleaner else "cleaning: none (--clean=prose|code|dedup to filter)"
    n_in = cleaner.docs_in if cleaner else i  # paragraphs read, before cleaning removed any
    docs = f"documents: the {n_in:,} paragraphs of {paths[0]} (one .txt source)\n" if split_txt else ""
    rate = (train.ntok + val.ntok) / seconds
    print(f"{cleaned}\n{docs}{tok.name} tokens of {len(paths)} file(s) -> {out_dir} in "
          f"{seconds:.1f}s, {rate:,.0f} tokens/s\n"
          f"  train: {train.ndocs:,} docs, {train.ntok:,} tokens, {n_train} shard(s)\n"
          f"  val:   {val.ndocs:,} docs, {val.ntok:,} tokens, {n_val} shard(s)\n"
          f"  difficulty scores (zlib ratio per {data.DIFFICULTY_CHUNK} tokens): "
          f"{train.score_s + val.score_s:.1f}s")
    return out_dir


def adopt(src, out_dir, tokenizer, overwrite=False):
    """llm.c-format shards in src made the dataset out_dir as they are: tools/adopt.py's adopt()."""
    from tools.adopt import adopt as adopt_shards  # it imports this module's checks
    return adopt_shards(src, out_dir, tokenizer, overwrite)


def default_out_dir(sources, paths, tokenizer_name, corpus="shakespeare"):
    """data/<corpus>_<tokenizer> for a shipped corpus, else data/<first source's stem>_<tokenizer>;
    a model's tokenizer by the last part of its source (source_slug: SmolLM2-135M-Instruct.Q4_1 for
    its .gguf)."""
    stem = re.sub(r"\.(txt|jsonl|jsonl\.gz|parquet)$", "", os.path.basename(paths[0]))
    name = corpus if sources is None else stem
    return os.path.join(DATA_DIR, f"{name}_{source_slug(tokenizer_name)}")


def tokenize_throughput(tokenizer_name):
    """Tokens per second of encode_batch on the shipped Shakespeare corpus (reading the file is not
    timed)."""
    tok = get_tokenizer(tokenizer_name)
    texts = list(iter_documents([SHAKESPEARE]))
    tok.encode_batch(texts[:1])  # warm-up
    t0 = time.perf_counter()
    n = sum(len(ids) for ids in tok.encode_batch(texts))
    return n / (time.perf_counter() - t0)

# -----------------------------------------------------------------------------
# where the dataset goes: out_dir, its name, and who may write into it


def _check_out_dir(out_dir):
    """The real path of out_dir after refusing what the swap would destroy: a regular file, or a
    directory holding files that tools/prepare.py did not write (they would be deleted with the old
    dataset)."""
    real = os.path.realpath(out_dir)
    if os.path.exists(real) and not os.path.isdir(real):
        raise ValueError(f"{out_dir}: exists and is not a directory; pass a new directory, or an "
                         f"earlier tools/prepare.py output, as --out_dir")
    ours = re.compile(r"meta\.json|(train|val)_\d+\.(bin|difficulty\.npy)")
    names = os.listdir(real) if os.path.isdir(real) else []
    other = sorted(n for n in names if not ours.fullmatch(n))
    if other:
        raise ValueError(f"{out_dir}: also holds "
                         f"{', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, which "
                         "re-preparing would delete (the whole directory is replaced); move them "
                         "out, or pass another --out_dir")
    return real


def _check_replacing(out_dir, tokenizer, paths, adopted_from, overwrite):
    """Refuse, without overwrite, to replace a dataset in out_dir that holds something else than the
    one about to be written: another tokenizer's ids, or other sources, none of them among paths
    (adopted_from for --adopt: another shard directory, or adopted shards replaced by tokenised
    sources, or the other way round). The same sources, or some added or dropped, in the same
    tokenizer (another --val_every, --shard_tokens or --clean) are replaced as before. A meta.json
    that cannot be read is no dataset to keep (data.py says to re-create it). A recorded source that
    is gone is the new one of its name only when it has the recorded size (the checkout moved); a
    namesake of another size is other data (a second download's 000_00000.parquet)."""
    if overwrite or not os.path.exists(os.path.join(out_dir, "meta.json")):
        return
    try:
        meta = data.read_meta(out_dir)
    except ValueError:
        return
    def same(a, b, size):  # or a recorded path gone and b of its name and size: the checkout moved
        moved = (not os.path.exists(a) and os.path.basename(a) == os.path.basename(b)
                 and size is not None and size == source_bytes(b))
        return same_source(a, b) or moved
    was = meta.get("adopted_from")
    if was is not None or adopted_from is not None:  # the shards here are the adopted ones
        same_data = (was is not None and adopted_from is not None
                     and same(str(was), adopted_from, source_bytes(out_dir)))
    else:
        had = [str(p) for p in meta.get("sources") or []]
        sizes = meta.get("source_bytes") or [None] * len(had)  # a meta.json without them: no move recognised
        same_data = any(same(a, b, n) for a, n in zip(had, sizes) for b in paths)
    made_by = str(meta["tokenizer"])
    if same_data and same_source(made_by, tokenizer):
        return
    def listed(names):
        return f"{', '.join(map(str, names[:2]))}{', ...' if len(names) > 2 else ''}"
    held = f"shards adopted from {was}" if was is not None else \
        listed(meta.get("sources") or ["no sources"])
    new = f"shards adopted from {adopted_from}" if adopted_from is not None else listed(paths)
    raise ValueError(f"--out_dir={out_dir}: holds a dataset of {held} in {made_by} ids, not {new} "
                     f"in {tokenizer} ids; writing here replaces it whole: pass --overwrite=True "
                     "to replace it, or another --out_dir")


def source_slug(name):
    """A file-name-safe short name of a tokenizer or model source: byte and gpt2 as they are, a
    model by its last part without the extension and a hash of where it is (two models of one name
    do not share shards): data/models/SmolLM2-135M-Instruct.Q4_1.gguf ->
    SmolLM2-135M-Instruct.Q4_1-<8 hex digits>."""
    if name in ("byte", "gpt2"):
        return name
    base = os.path.basename(os.path.normpath(name))
    base = base[:-len(".gguf")] if base.endswith(".gguf") else base
    where = os.path.realpath(name) if os.path.exists(name) else name
    digest = hashlib.sha1(where.encode()).hexdigest()[:8]
    return (re.sub(r"[^A-Za-z0-9._-]+", "-", base) or "model") + "-" + digest


def source_bytes(path):
    """A source's size: a file's bytes, or the train/val shards' of a shard directory (what --adopt
    links, llm.c's names too); None if it is not there."""
    if os.path.isdir(path):
        from tools.adopt import LLMC_SHARD  # (tools/adopt.py imports this module)
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if LLMC_SHARD.fullmatch(n))
    return os.path.getsize(path) if os.path.isfile(path) else None


def same_source(a, b):
    """Whether two tokenizer or model names are the same one: equal names, or two paths to the same
    file or folder."""
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


# the name of a shipped corpus's directory: data/<corpus>_<source_slug(tokenizer)>
SHIPPED_DIR = re.compile(r"(?P<corpus>[^_]+)_(?P<tok>byte|gpt2|[A-Za-z0-9._-]+-[0-9a-f]{8})")


def _check_not_shipped(out_dir, tokenizer, paths=None, clean_as=None, default=False):
    """Refuse to write into a shipped corpus's directory, data/<corpus>_<tokenizer slug> (what
    train.py --data=<corpus>, its default, and the lab read, prepared once and then used as it is),
    anything but that corpus cleaned as shipped in the tokenizer its name says: your own sources,
    another cleaning, another tokenizer's ids, adopted shards (paths None). default: out_dir was not
    given (default_out_dir named it after the first source)."""
    parent, name = os.path.split(os.path.realpath(out_dir))
    m = SHIPPED_DIR.fullmatch(name)
    if parent != os.path.realpath(DATA_DIR) or not m or m["corpus"] not in CORPORA:
        return
    corpus, (shipped, cleaning) = m["corpus"], CORPORA[m["corpus"]]
    same_corpus = paths is not None and len(paths) == 1 and \
        os.path.realpath(paths[0]) == os.path.realpath(shipped)
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
    if same_corpus and clean_as == cleaning:  # only the tokenizer differs: that tokenizer's own
        other = os.path.join(os.path.dirname(out_dir) or ".", f"{corpus}_{source_slug(tokenizer)}")
    where = f"{out_dir} (the default --out_dir for {os.path.basename(paths[0])})" if default else \
        f"--out_dir={out_dir}"
    raise ValueError(f"{where}: is the shipped corpus {corpus}'s directory (train.py "
                     f"--data={corpus} and the lab read it), not one for {what}; pass another "
                     f"--out_dir (e.g. --out_dir={other})")


def check_shipped(d, corpus):
    """For a reader of shipped corpus `corpus`'s directory d (train.py --data=<corpus>, the lab):
    raise a ValueError when its meta.json says it holds something else (another source, another
    cleaning, adopted shards: written by hand or by a tools/prepare.py from before
    _check_not_shipped), instead of training on it as that corpus. The source is compared by name,
    and as a file where the recorded path still exists (the checkout may have moved)."""
    meta = data.read_meta(d)
    shipped, cleaning = CORPORA[corpus]
    sources = meta.get("sources") or []
    ok = len(sources) == 1 and os.path.basename(sources[0]) == os.path.basename(shipped) and \
        (not os.path.exists(sources[0]) or os.path.samefile(sources[0], shipped)) and \
        "adopted_from" not in meta
    if "cleaning" in meta:  # a meta.json from before cleaning existed does not say
        made = "none" if meta["cleaning"] is None else meta["cleaning"].get("kind") or "dedup"
        ok = ok and made == cleaning
    if not ok:
        adopted = " (adopted shards)" if "adopted_from" in meta else ""
        listed = ", ".join(sources[:2]) or "no sources"
        raise ValueError(f"{d}: its meta.json lists {listed}{adopted}, "
                         f"not the shipped corpus {corpus} as tools/prepare.py makes it, yet "
                         f"train.py --data={corpus} and the lab read this directory; move it "
                         "elsewhere (and pass that path as --data), then the shipped corpus is "
                         "prepared again")


def check_not_mid_swap(d):
    """For a reader that finds no dataset d: if a tools/prepare.py was killed between the two renames that swap a
    dataset in (atomic.atomic_dir), raise a ValueError saying where the previous dataset is (the next run puts it
    back)."""
    old = swapped_out(d)
    if old:
        raise ValueError(f"{d}: missing, but {old} holds its previous dataset (a tools/prepare.py "
                         f"was killed while replacing it); restore it: mv {old} {d} (or re-run "
                         "tools/prepare.py, which restores it first)")

# -----------------------------------------------------------------------------


def _default_for(sources, tokenizer, corpus):
    try:
        paths = expand(sources) if sources else [SHAKESPEARE]
        return default_out_dir(sources or None, paths, tokenizer, corpus)
    except ValueError:  # a bad source: prepare() says so at once
        return "<its default>"


@dataclass
class PrepareConfig:
    tokenizer: str = "byte"      # byte, gpt2, or a model's: its HF directory, hub id or .gguf
    out_dir: str = ""            # where the shards go; "" = data/<corpus or 1st source>_<tokenizer>
    val_every: int = 20          # every val_every-th document goes to the val split
    shard_tokens: int = 100_000_000  # tokens per shard file
    corpus: str = "shakespeare"  # the shipped corpus when no file is given: shakespeare or python
    clean: str = ""              # prose, code, dedup or none; "" = the shipped corpus's, or none
    adopt: str = ""              # a directory of llm.c-format .bin shards, used as they are
    overwrite: bool = False      # replace an --out_dir holding other sources' or tokenizer's data


def main(argv):
    flags, sources = parse(argv, PrepareConfig, __doc__,
                           positional="FILE ...  .txt, .jsonl, .jsonl.gz or .parquet sources")
    opts = dataclasses.asdict(PrepareConfig(**flags))
    opts["out_dir"], opts["clean"] = opts["out_dir"] or None, opts["clean"] or None
    if opts["val_every"] < 2:
        die(f"--val_every={opts['val_every']}: {VAL_EVERY_RULE}", 2)
    if not 1 <= opts["shard_tokens"] <= data.MAX_SHARD_TOKENS:
        die(f"--shard_tokens={opts['shard_tokens']}: {SHARD_TOKENS_RULE}", 2)
    for key, valid in (("corpus", CORPORA), ("clean", CLEAN)):
        if opts[key] is not None and opts[key] not in valid:
            die(f"--{key}={opts[key]}: expected one of {', '.join(valid)}", 2)
    try:  # a model's tokenizer loads here (seconds), once: prepare() and adopt() get the same one
        get_tokenizer(opts["tokenizer"])
    except (ValueError, ImportError) as e:
        die(f"--tokenizer={opts['tokenizer']}: {e}", 2)
    except KeyboardInterrupt:  # a GGUF's vocabulary takes seconds to read: nothing is written yet
        die(f"stopped by Ctrl-C while loading --tokenizer={opts['tokenizer']}; nothing was written",
            128 + signal.SIGINT)
    if opts["adopt"] and (sources or opts["out_dir"] is None):  # checked before any shard is read
        die(f"--adopt={opts['adopt']}: takes the shard directory and an --out_dir for the adopted "
            f"dataset (e.g. --out_dir=data/fineweb10B_{source_slug(opts['tokenizer'])}), and no "
            "source files", 2)
    # SIGTERM or Ctrl-C: one line saying whether out_dir is as it was or already the whole new
    # dataset. Only here, not in prepare(): train.py calls prepare() and has its own signal handling
    try:
        where = opts["out_dir"] or _default_for(sources, opts["tokenizer"], opts["corpus"])
        with stoppable("--out_dir", where):
            if opts["adopt"]:
                adopt(opts["adopt"], opts["out_dir"], opts["tokenizer"], opts["overwrite"])
                return 0
            kw = {k: v for k, v in opts.items() if k not in ("clean", "adopt")}
            out_dir = prepare(sources or None, clean_as=opts["clean"], **kw)
    except ValueError as e:  # a bad corpus, a full disk: one line saying what to fix, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    sample = data.read_shard(os.path.join(out_dir, "train_000.bin"))[:48].tolist()
    decoded = get_tokenizer(opts["tokenizer"]).decode(sample)
    print(f"first train tokens: {sample}\ndecoded: {decoded!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
