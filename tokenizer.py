"""
The tokenisers a corpus is cut into ids with: UTF-8 bytes, GPT-2's byte-level BPE, or a pretrained model's own.

  byte  every UTF-8 byte is its own id (0..255) and 256 is end-of-text: vocab 257, nothing to learn or load;
        what the CPU quick start uses, so a 0.9M-parameter model spends no parameters on a large embedding
  gpt2  GPT-2's BPE (Radford et al. 2019, section 2.2: byte-level BPE with a regex pre-split), through tiktoken:
        eot 50256, vocab 50257. The merge ranks are the file data/gpt2.tiktoken that ships with the repository
        (beside this file), because tiktoken cannot download them offline. Encodes exactly as
        tiktoken.get_encoding("gpt2"); "<|endoftext|>" inside a text stays plain text.
  a model  the tokenizer of the model --init_from names: a Hugging Face model directory, a hub id (org/name) or a
        .gguf file, loaded by transformers' AutoTokenizer (tools/get_model.py fetches SmolLM2-135M's GGUF). It
        encodes as AutoTokenizer does without special tokens (no BOS), special-token strings in a text as plain
        text; eot is the document separator it was pre-trained with, <|endoftext|> or <|end_of_text|> when its
        vocabulary has one (a chat model's eos ends a turn: SmolLM2-Instruct's is <|im_end|>), else its eos;
        vocab_size is len(tokenizer), added tokens included (SmolLM2: eot 0, vocab 49152), or the largest id + 1 when the
        ids have gaps. A hub id is read
        from the local cache alone when the hub does not answer within 3 s (hub_unreachable): one error at once.
All give name (as given to get_tokenizer: what meta.json records), eot, vocab_size, encode, encode_batch, decode (bad
bytes replaced), decode_bytes and pieces (each id's token). fingerprint(tok) names the vocabulary itself: a hash
over eot and the id -> token mapping, equal for two paths to one model, different for two vocabularies of one size. Copied alone into another project: the byte tokenizer needs only numpy; gpt2
needs tiktoken and data/gpt2.tiktoken beside this file; a model's needs transformers.

Test: python -m pytest tests/test_tokenizer.py tests/test_data.py -k "tokenizer or copied_alone"
"""

import hashlib
import logging
import os
import re
import socket
import urllib.parse

import numpy as np

TOKENIZERS = ("byte", "gpt2")  # built in; any other name must be a model source (HFTokenizer)
GPT2_RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2.tiktoken")  # shipped
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class ByteTokenizer:
    """UTF-8 bytes as tokens; 256 is the end-of-text token."""
    name, eot, vocab_size = "byte", 256, 257

    def encode(self, text):
        return list(text.encode("utf-8"))

    def encode_batch(self, texts):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).tolist() for t in texts]

    def decode(self, ids):
        # eot (or any id >= 256) is not a byte: drop it rather than fail in the middle of a sample
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids):
        ids = np.asarray(ids)
        return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()

    def pieces(self):
        return [bytes([i]) for i in range(256)] + [b"<|endoftext|>"]


class GPT2Tokenizer:
    """GPT-2 byte-level BPE via tiktoken; encodes exactly as tiktoken.get_encoding("gpt2")."""
    name, eot, vocab_size = "gpt2", 50256, 50257

    def __init__(self):
        try:  # here, not at the top: the byte tokenizer, shards and loader work without tiktoken
            import tiktoken
            import tiktoken.load
        except ImportError:
            raise ImportError("the gpt2 tokenizer needs tiktoken: pip install tiktoken (or use the byte "
                              "tokenizer, which needs nothing)") from None
        if not os.path.isfile(GPT2_RANKS):
            raise FileNotFoundError(
                f"{GPT2_RANKS}: missing. The GPT-2 vocabulary is the file data/gpt2.tiktoken that ships with "
                f"nanoBitNet (tiktoken cannot download it offline), read from the data/ folder beside tokenizer.py; "
                f"copy it there, or use the byte tokenizer")
        ranks = tiktoken.load.load_tiktoken_bpe(GPT2_RANKS)
        self.enc = tiktoken.Encoding("gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": self.eot}, explicit_n_vocab=self.vocab_size)

    def encode(self, text):
        return self.enc.encode_ordinary(text)  # "<|endoftext|>" in a text is plain text, never 50256

    def encode_batch(self, texts):
        return self.enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count())

    def decode(self, ids):
        return self.enc.decode(list(ids), errors="replace")

    def decode_bytes(self, ids):
        return self.enc.decode_bytes([int(i) for i in ids if i != self.eot])

    def pieces(self):
        return [self.enc.decode_single_token_bytes(i) for i in range(self.vocab_size)]


class HFTokenizer:
    """A pretrained model's tokenizer through transformers' AutoTokenizer: a model directory, a hub id or a .gguf."""

    def __init__(self, name):
        try:  # here, not at the top: byte and gpt2 work without transformers
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(f"the tokenizer of {name} needs transformers: pip install transformers") from None
        folder, gguf = (os.path.dirname(name) or ".", os.path.basename(name)) if name.endswith(".gguf") else (name, None)
        quiet = logging.getLogger("huggingface_hub")  # its retries would print a line per attempt offline
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        offline = hub_unreachable(name)  # then only the local cache, at once: no minute of retries
        if gguf:  # transformers rebuilds the tokenizer from the GGUF's vocabulary: the slow part of loading one
            print(f"reading the tokenizer of {name} (transformers rebuilds it from the GGUF's vocabulary, once "
                  f"per process)", flush=True)
        try:
            self.hf = AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {}),
                                                    local_files_only=offline)
        except Exception as e:  # transformers' own errors (OSError, ValueError, ...): one line, naming the source
            why = " ".join(str(e).split())[:200]
            files = os.path.isdir(name) and any(os.path.exists(os.path.join(name, f))
                                                for f in ("tokenizer.json", "tokenizer_config.json"))
            if os.path.isdir(name) and not files:
                raise ValueError(f"tokenizer {name!r}: the directory has no tokenizer files (tokenizer.json, "
                                 f"tokenizer_config.json); copy them in from where the model came from, or "
                                 f"pass a model directory or .gguf that has them") from None
            where = ("its tokenizer.json / tokenizer_config.json" if os.path.isdir(name) else
                     "a .gguf file with a tokenizer" if gguf else
                     "the local cache (the hub cannot be reached: no network, or HF_HUB_OFFLINE set? pass a local "
                     "directory or .gguf)" if offline else "the hub (pass a local directory or .gguf)")
            raise ValueError(f"tokenizer {name!r}: transformers cannot load it from {where} ({type(e).__name__}: "
                             f"{why})") from None
        finally:
            quiet.setLevel(level)
        self.hf.model_max_length = 2**62  # corpora are long documents: no "longer than the maximum" warnings
        vocab = self.hf.get_vocab()
        eot = next((vocab[t] for t in ("<|endoftext|>", "<|end_of_text|>") if t in vocab), self.hf.eos_token_id)
        if eot is None:
            raise ValueError(f"tokenizer {name!r}: no end-of-text token (no <|endoftext|>, no eos_token)")
        # ids run to the largest one: a vocabulary with gaps between its ids has more ids than tokens
        self.name, self.eot, self.vocab_size = name, int(eot), max(len(self.hf), max(vocab.values()) + 1)

    def encode(self, text):
        return self.encode_batch([text])[0]

    def encode_batch(self, texts):  # no BOS/EOS; "<|endoftext|>" in a text is plain text, never eot
        return self.hf(list(texts), add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def decode(self, ids):
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def decode_bytes(self, ids):  # a character cut between two ids becomes U+FFFD
        return self.decode([i for i in ids if i != self.eot]).encode("utf-8")

    def pieces(self):
        return [t or "" for t in self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))]


_tokenizers = {}  # loading a vocabulary takes a moment (a GGUF's: seconds): build each tokenizer once


def get_tokenizer(name):
    """byte, gpt2, or a model source: a Hugging Face model directory, a hub id (org/name) or a .gguf file."""
    if name not in _tokenizers:
        if name in TOKENIZERS:
            _tokenizers[name] = ByteTokenizer() if name == "byte" else GPT2Tokenizer()
        elif is_model_source(name):
            _tokenizers[name] = HFTokenizer(name)
        else:
            what = "no such .gguf file" if name.endswith(".gguf") else \
                "no such directory" if "/" in name or os.sep in name else "unknown tokenizer"
            raise ValueError(f"{what} {name!r}; valid: {', '.join(TOKENIZERS)}, a Hugging Face model directory, a hub "
                             f"id (org/name) or a .gguf file (python -m tools.get_model smollm2 fetches one)")
    return _tokenizers[name]


def fingerprint(tok):
    """16 hex digits naming tok's vocabulary: sha256 over eot and every id's token. Two tokenizers with one
    fingerprint give every token the same id; a model trained on one reads the other's ids as its own."""
    if getattr(tok, "_fingerprint", None) is None:
        h = hashlib.sha256(f"eot {tok.eot} vocab {tok.vocab_size}\n".encode())
        for piece in tok.pieces():
            piece = piece.encode("utf-8", "surrogatepass") if isinstance(piece, str) else piece
            h.update(len(piece).to_bytes(4, "little") + piece)
        tok._fingerprint = h.hexdigest()[:16]
    return tok._fingerprint


def is_model_source(name):
    """Whether name could be a model's tokenizer: an existing directory or .gguf file, or a hub id org/name."""
    if name.endswith(".gguf"):
        return os.path.isfile(name)
    if os.path.isdir(name.split("/")[0]):  # data/tiny_lama: a mistyped path here, not a hub id
        return os.path.isdir(name)
    return os.path.isdir(name) or re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None


_hub = {}  # whether the hub answered: asked once per process


def hub_unreachable(name):
    """True when name is a hub id (no such path here) and HF_HUB_OFFLINE is set or the hub (HF_ENDPOINT, else
    huggingface.co) does not answer within 3 s: transformers is then told to read the local cache only, and fails
    at once instead of after a minute of retries."""
    if os.path.exists(name) or name.endswith(".gguf"):
        return False
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return True  # told not to ask it
    if "up" not in _hub:
        url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
        try:
            port = url.port or (80 if url.scheme == "http" else 443)
            socket.create_connection((url.hostname, port), timeout=3).close()
            _hub["up"] = True
        except (OSError, ValueError):
            _hub["up"] = False
    return not _hub["up"]
