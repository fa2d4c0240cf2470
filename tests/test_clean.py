"""lessons/clean.py: quality filters, exact and MinHash-LSH near-duplicate removal, and
tools/prepare.py's use of them."""
import gzip
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from lessons import clean
from tools import prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _words(n, seed):
    """n distinct made-up words: every word 5-gram of the text is distinct."""
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 7)) + str(i) for i in range(n)]


def _set_jaccard(a, b, n=5):
    """Independent reference: Jaccard of the word 5-gram sets, with Python tuples."""
    ga = {tuple(a[i:i + n]) for i in range(len(a) - n + 1)}
    gb = {tuple(b[i:i + n]) for i in range(len(b) - n + 1)}
    return len(ga & gb) / len(ga | gb)


def _docs():
    base = _words(400, 0)
    near = list(base)
    for i in (50, 150, 250, 350):  # 4 words changed: 20 of 396 shingles differ on each side
        near[i] = "changed" + str(i)
    far = base[:187] + _words(213, 1)  # shares its first 183 shingles: J = 183 / (792 - 183) = 0.30
    return base, near, far


def test_shingles_and_jaccard_match_an_independent_set_implementation():
    base, near, far = _docs()
    for other in (near, far):
        want = _set_jaccard(base, other)
        got = clean.jaccard(clean.shingles(" ".join(base)), clean.shingles(" ".join(other)))
        assert got == pytest.approx(want, abs=1e-9)  # no 32-bit collision among ~800 shingles
    assert len(clean.shingles(" ".join(base))) == 396
    # fewer than 5 words: the whole text is one shingle
    assert len(clean.shingles("Too short")) == 1
    # a text without a word has no shingle, and shares none with another such text: J = 0, so distinct
    # wordless documents are all kept; an exact repeat is still an exact duplicate
    assert len(clean.shingles("👍👍 🎉")) == 0 and clean.jaccard(clean.shingles("👍👍 🎉"), clean.shingles("∑ ≈ ∞")) == 0
    c = clean.Cleaner(None)
    assert [c.keep(t) for t in ("👍👍 🎉", "?!?! ... ---", "∑ ≈ ∞", "🚀✨ ☕", "∑ ≈ ∞")] == [True] * 4 + [False]
    assert dict(c.removed) == {"exact duplicate": 1}


def test_minhash_agreement_estimates_jaccard():
    """P[sig_i(a) = sig_i(b)] = J: the fraction of agreeing rows is within 4 standard errors of
    J."""
    base, near, far = _docs()
    mh = clean.MinHash(k=512, seed=3)
    a = mh.signature(clean.shingles(" ".join(base)))
    for other in (near, far):
        j = _set_jaccard(base, other)
        agree = float(np.mean(a == mh.signature(clean.shingles(" ".join(other)))))
        assert abs(agree - j) < 4 * math.sqrt(j * (1 - j) / 512), (agree, j)


def test_planted_exact_and_near_duplicates_are_removed_and_a_distant_pair_is_kept():
    base, near, far = _docs()
    assert _set_jaccard(base, near) >= 0.9 and 0.25 < _set_jaccard(base, far) < 0.35
    cleaner = clean.Cleaner(kind=None)  # deduplication only: these are not sentences
    original = " ".join(base)
    # same text once case and whitespace are normalised
    exact = "  " + original.upper().replace(" ", "\n") + " "
    kept = [cleaner.keep(t) for t in (original, exact, " ".join(near), " ".join(far))]
    assert kept == [True, False, False, True]
    assert cleaner.removed == {"exact duplicate": 1, "near duplicate": 1}
    assert "4 documents in, 2 removed" in cleaner.report()


def test_near_duplicate_threshold_is_the_exact_jaccard():
    """With the threshold just above and just below the pair's Jaccard, the pair is kept and
    removed."""
    base, near, _ = _docs()
    j = _set_jaccard(base, near)
    for threshold, second_kept in ((j + 0.01, True), (j - 0.01, False)):
        c = clean.Cleaner(kind=None, threshold=threshold)
        assert [c.keep(" ".join(base)), c.keep(" ".join(near))] == [True, second_kept]


def _pair(shared_words, seed, n=400):
    """Two n-word documents sharing their first shared_words words, then made-up words of their own:
    they share shared_words - 4 of their n - 4 word 5-grams each."""
    a = _words(n, seed)
    return a, a[:shared_words] + _words(n - shared_words, seed + 10_000)


def test_a_pair_at_exactly_the_threshold_is_a_near_duplicate():
    """The rule is J >= threshold: a pair sharing 352 of its 396 5-grams each has J = 352 / 440 =
    0.8, the default threshold exactly, and is removed (LSH makes it a candidate with probability 1
    - (1 - 0.8^4)^32 = 0.99999995)."""
    a, b = _pair(356, seed=2)
    assert _set_jaccard(a, b) == 0.8
    c = clean.Cleaner(kind=None)
    assert c.threshold == 0.8 and [c.keep(" ".join(a)), c.keep(" ".join(b))] == [True, False]


def test_lsh_candidates_follow_the_banding_s_curve_of_32_bands_of_4_rows():
    """A pair of Jaccard J becomes a candidate with probability 1 - (1 - J^r)^b: 0.873 at J = 0.5
    for b = 32 bands of r = 4 rows (1e-9 for 4 bands of 32). With the threshold below J every
    candidate is confirmed, so the share of 40 independent J = 0.5 pairs removed is that
    probability, within 4 binomial standard deviations."""
    removed = 0
    for seed in range(40):
        a, b = _pair(268, seed=100 + seed)  # 264 of 396 5-grams shared: J = 264 / 528
        assert _set_jaccard(a, b) == 0.5
        c = clean.Cleaner(kind=None, threshold=0.4)
        removed += [c.keep(" ".join(a)), c.keep(" ".join(b))] == [True, False]
    p = 1 - (1 - 0.5 ** 4) ** 32
    assert abs(removed / 40 - p) < 4 * math.sqrt(p * (1 - p) / 40), (removed, p)


PROSE_JUNK = {
    "too few words": "Click here to subscribe now!",
    "symbols": " ".join(["#tag #more #trend ... words"] * 30),
    "few words with letters": " ".join(["1234 5678 90123 4567 89 word"] * 40),
    "repeated lines": "\n".join(
        ["Buy cheap watches today, best prices online"] * 30 + ["Contact us for more."]
    ),
    "odd mean word length": " ".join(["a b c d e f g h i j"] * 10),
}
CODE_JUNK = {
    "very long line": "x = [" + ", ".join(str(i) for i in range(400)) + "]\n" + "y = 1\n" * 40,
    "long mean line": "\n".join(["data = '" + "ab12" * 30 + "'"] * 20),
    "few alphanumerics": "def f(x):\n" + "\n".join(["    + - * / = ( ) [ ] { } ;"] * 60) + "\n",
    "too few words": "from _decimal import *\n",
}


@pytest.mark.parametrize("kind, junk", [("prose", PROSE_JUNK), ("code", CODE_JUNK)])
def test_quality_filters_remove_planted_junk_for_the_stated_reason(kind, junk):
    for reason, text in junk.items():
        assert clean.quality_reason(text, kind) == reason, reason



def test_gophers_symbol_rule_counts_the_hash_and_the_ellipsis_each_on_its_own():
    """Gopher drops a document whose symbol-to-word ratio is above 0.1 "for either the hash symbol or the
    ellipsis": one at 0.08 and the other at 0.08 passes (their sum, 0.16, dropped it), either at 0.12 fails."""
    words = ["plain"] * 92

    def doc(hashes, dots):
        return " ".join(words + ["#tag"] * hashes + ["wait..."] * dots)
    assert clean.quality_reason(doc(8, 8), "prose") is None  # 108 words, 8 of each: 0.074 each
    assert clean.quality_reason(doc(13, 0), "prose") == "symbols"  # 13 / 105
    assert clean.quality_reason(doc(0, 13), "prose") == "symbols"

def _shipped(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_quality_filters_keep_real_documents():
    """Every shipped module of 50 words or more passes the code rules. 41 of the 42 plays pass
    Gopher's prose rules; the one that fails is The Merry Wives of Windsor, on repeated lines (its
    speaker names), which is why the shipped plays are only deduplicated (prepare.CORPORA)."""
    code = [d for d in _shipped(prepare.PYTHON) if len(d["text"].split()) >= 50]
    assert len(code) == 159 and all(clean.quality_reason(d["text"], "code") is None for d in code)
    failed = {d["title"]: clean.quality_reason(d["text"],
                                               "prose") for d in _shipped(prepare.SHAKESPEARE)}
    assert {t: r for t, r in failed.items() if r} == {"merry_wives_of_windsor": "repeated lines"}


def test_prepare_cleans_reports_and_records_the_counts(tmp_path, capsys):
    base, near, far = _docs()
    real = _shipped(prepare.PYTHON)[20]["text"]
    docs = [real, real.replace("\n", "\r\n").upper(), PROSE_JUNK["too few words"]]
    docs += ["\n".join(" ".join(w[i:i + 8]) for i in range(0, 400, 8)) for w in (base, near, far)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = prepare.prepare([str(src)], out_dir=str(tmp_path / "o"), val_every=2, clean_as="code")
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["cleaning"]["docs_in"] == 6
    assert meta["cleaning"]["docs_removed"] == {"exact duplicate": 1, "too few words": 1,
                                                "near duplicate": 1}
    assert meta["n_docs_train"] + meta["n_docs_val"] == 3
    assert "6 documents in, 3 removed" in capsys.readouterr().out
    # your own files: no cleaning by default
    prepare.prepare([str(src)], out_dir=str(tmp_path / "n"), val_every=2)
    meta = json.load(open(tmp_path / "n" / "meta.json"))
    assert meta["n_docs_train"] + meta["n_docs_val"] == 6 and meta["cleaning"] is None


@pytest.mark.slow
def test_clean_and_prepare_command_lines_print_the_report(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "lessons.clean"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert (
        r.returncode == 0 and "167 documents in, 8 removed (8 too few words), 159 kept" in r.stdout
    )
    r = subprocess.run(
        [sys.executable, "-m", "tools.prepare", "--corpus=python", f"--out_dir={tmp_path / 'py'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "159 kept" in r.stdout and "tokens/s" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "tools.prepare", "--clean=maybe"], cwd=ROOT,
                         env=env, capture_output=True, text=True)
    assert (
        bad.returncode == 2
        and bad.stderr.count("\n") == 1
        and "prose, code, dedup, none" in bad.stderr
    )


def test_clean_command_line_takes_help_a_kind_and_files_and_refuses_bad_input_in_one_line(
    tmp_path, capsys
):
    assert clean.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "python -m lessons.clean [--kind=code|prose|dedup]" in out and "MinHash" in out
    words = " ".join(_words(60, 0))
    src = tmp_path / "mine.jsonl"
    src.write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in (words, "", words.upper(), "", "too short"))
    )
    # the upper-cased copy is an exact duplicate; an empty text is no document (as tools.prepare)
    assert clean.main(["--kind=dedup", str(src)]) == 0
    assert "3 documents in, 1 removed (1 exact duplicate), 2 kept" in capsys.readouterr().out
    # and Gopher's 50-word minimum drops the third
    assert clean.main(["--kind=prose", str(src)]) == 0
    assert "3 documents in, 2 removed" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    for argv, fact in (
        (["--kind=web"], "--kind=web: expected code, prose or dedup"),
        (["--bogus"], "--bogus: unknown option"),
        ([str(tmp_path / "none.jsonl")], "none.jsonl: No such file"),
        ([str(tmp_path / "bad.jsonl")], "bad.jsonl: line 2: not a {\"text\": ...} JSON line"),
    ):
        assert clean.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and fact in err[0], (argv, err)
