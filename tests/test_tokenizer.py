"""Tests for tokenizer.py's model tokenizers (get_tokenizer of a .gguf file, a Hugging Face directory, a hub id):
the real SmolLM2-135M GGUF (the session fixture smollm2, tests/conftest.py) against transformers' own encoding, and
a tiny tokenizer built here with `tokenizers` and saved as a directory (no download). byte and gpt2: tests/test_data.py.
Run: python -m pytest tests/test_tokenizer.py"""

import pytest

import tokenizer
from tokenizer import get_tokenizer

TEXTS = {
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "shakespeare": "HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "unicode": "caf\u00e9 na\u00efve \u2014 \u201cquoted\u201d, \u6f22\u5b57 and \U0001F642, tabs\tand  two spaces\n",
}


@pytest.fixture(scope="module")
def smol(smollm2):
    """The SmolLM2 tokenizer, loaded once (a GGUF's vocabulary takes seconds to read)."""
    return get_tokenizer(smollm2)


def test_smollm2_encodes_exactly_as_transformers_without_special_tokens(smol, smollm2):
    assert smol.name == smollm2  # as given: what meta.json records and train.py compares
    assert smol.eot == 0 and smol.vocab_size == 49152 == len(smol.hf)
    # the GGUF is the Instruct model, whose eos ends a chat turn (<|im_end|> = 2): eot is the document separator
    assert smol.hf.eos_token_id == 2 and smol.hf.convert_ids_to_tokens(0) == "<|endoftext|>"
    for name, text in TEXTS.items():
        ids = smol.encode(text)
        assert ids == smol.hf(text, add_special_tokens=False)["input_ids"], name
        assert len(ids) < len(text.encode("utf-8")) and min(ids) > 16, name  # BPE merges; no special token
        assert smol.decode(ids) == text, name
        assert smol.decode_bytes(ids) == text.encode("utf-8"), name
    assert smol.encode("Hello world") == [19556, 905]  # pinned: a change of tokenizer or of loading shows here
    assert smol.encode_batch(list(TEXTS.values())) == [smol.encode(t) for t in TEXTS.values()]
    assert smol.decode_bytes([0] + smol.encode("Hello world") + [0]) == b"Hello world"  # eot carries no text
    assert smol.decode([0]) == "<|endoftext|>"


def test_special_token_strings_in_a_text_stay_plain_text(smol):
    text = "a <|endoftext|> b <|im_start|> c"
    ids = smol.encode(text)
    assert smol.eot not in ids and 1 not in ids  # as gpt2's encode_ordinary: a document never forges an eot
    assert ids == smol.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert smol.decode(ids) == text
    assert smol.eot in smol.hf(text, add_special_tokens=False)["input_ids"]  # what transformers does by default


def test_get_tokenizer_builds_each_model_tokenizer_once(smol, smollm2):
    assert get_tokenizer(smollm2) is smol


def _tiny_tokenizer(path, extra_special=()):
    """A byte-level BPE trained here on a few lines, whose post-processor adds a BOS (as Llama's does), with eos
    </s> and one added token, saved by transformers as a model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", *extra_special]
    tk.train_from_iterator(list(TEXTS.values()) * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    hf.add_tokens(["<extra_token>"])
    hf.save_pretrained(str(path))
    return hf


def test_a_model_directory_gives_its_tokenizer_without_bos(tmp_path):
    hf = _tiny_tokenizer(tmp_path / "tiny")
    tok = get_tokenizer(str(tmp_path / "tiny"))
    assert tok.name == str(tmp_path / "tiny")
    assert tok.eot == hf.convert_tokens_to_ids("</s>") == 1  # no <|endoftext|> in its vocabulary: its eos
    added = hf.convert_tokens_to_ids("<extra_token>")
    assert tok.vocab_size == len(hf) == hf.backend_tokenizer.get_vocab_size(with_added_tokens=False) + 1 == added + 1
    for name, text in TEXTS.items():
        ids = tok.encode(text)
        assert hf(text)["input_ids"][0] == 0 and hf(text)["input_ids"][1:] == ids, name  # the BOS is left out
        assert tok.decode(ids) == text, name
    assert tok.encode("x <extra_token>")[-1] == added  # an added (not special) token is still one id


def test_the_vocabulary_s_end_of_text_token_wins_over_eos(tmp_path):
    _tiny_tokenizer(tmp_path / "tiny", extra_special=("<|endoftext|>",))
    tok = get_tokenizer(str(tmp_path / "tiny"))
    assert tok.eot == 2 and tok.hf.eos_token_id == 1


@pytest.mark.parametrize("name, fact", [("sentencepiece", "unknown tokenizer 'sentencepiece'"),
                                        ("missing/model.gguf", "no such .gguf file 'missing/model.gguf'")])
def test_a_bad_name_is_one_line_naming_it_and_what_is_accepted(name, fact):
    with pytest.raises(ValueError) as e:
        get_tokenizer(name)
    msg = str(e.value)
    assert fact in msg and "\n" not in msg
    assert "byte, gpt2, a Hugging Face model directory, a hub id (org/name) or a .gguf file" in msg


def test_a_directory_or_gguf_without_a_tokenizer_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.gguf").write_bytes(b"GGUF not really")
    for name in (str(tmp_path / "empty"), str(tmp_path / "junk.gguf")):
        with pytest.raises(ValueError) as e:
            get_tokenizer(name)
        msg = str(e.value)
        start = "the directory has no tokenizer files" if name.endswith("empty") else "transformers cannot load it"
        assert msg.startswith(f"tokenizer {name!r}: {start}") and "\n" not in msg, msg
        assert name not in tokenizer._tokenizers  # a failed load is not cached: fixed files load on the next call


def test_a_fingerprint_names_the_vocabulary_not_the_path_or_the_size(tmp_path):
    """tokenizer.fingerprint: what --init_from, --teacher, --resume and meta.json compare. One vocabulary at two
    paths is one fingerprint; two vocabularies of one size are two."""
    import shutil
    _tiny_tokenizer(tmp_path / "a", extra_special=("<|x|>",))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    _tiny_tokenizer(tmp_path / "c", extra_special=("<|y|>",))
    a, b, c = (get_tokenizer(str(tmp_path / n)) for n in "abc")
    assert a.vocab_size == c.vocab_size and a.eot == c.eot
    assert tokenizer.fingerprint(a) == tokenizer.fingerprint(b) != tokenizer.fingerprint(c)
    byte, gpt2 = get_tokenizer("byte"), get_tokenizer("gpt2")
    assert (tokenizer.fingerprint(byte), tokenizer.fingerprint(gpt2)) == ("f169d05676eb8a17", "8b695ae4574e9983")


def test_a_vocabulary_with_gaps_between_its_ids_sizes_the_model_by_its_largest_id(tmp_path):
    """A tokenizer.json whose ids skip some numbers (10 words, then <|endoftext|> = 20, <unk> = 21) has 12 tokens
    and ids up to 21: vocab_size is 22, so the embedding has a row for every id encode can give (with 12 rows the
    first step stopped on an IndexError), and the shards' dtype is chosen by the largest id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(10)}
    vocab.update({"<|endoftext|>": 20, "<unk>": 21})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="<unk>")
    hf.save_pretrained(str(tmp_path / "gaps"))
    tok = get_tokenizer(str(tmp_path / "gaps"))
    assert len(hf) == 12 and tok.eot == 20 and tok.encode("w1 w9 zz") == [1, 9, 21]
    assert tok.vocab_size == 22
    assert tok.pieces()[20] == "<|endoftext|>" and tok.pieces()[15] == ""  # a gap has no token
