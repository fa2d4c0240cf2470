"""
The two tokenisers a corpus is cut into ids with: UTF-8 bytes, and GPT-2's byte-level BPE.

  byte  every UTF-8 byte is its own id (0..255) and 256 is end-of-text: vocab 257, nothing to learn or load;
        what the CPU quick start uses, so a 0.9M-parameter model spends no parameters on a large embedding
  gpt2  GPT-2's BPE (Radford et al. 2019, section 2.2: byte-level BPE with a regex pre-split), through tiktoken:
        eot 50256, vocab 50257. The merge ranks are the file data/gpt2.tiktoken that ships with the repository
        (beside this file), because tiktoken cannot download them offline. Encodes exactly as
        tiktoken.get_encoding("gpt2"); "<|endoftext|>" inside a text stays plain text.
Both give encode, encode_batch, decode (bad bytes replaced) and decode_bytes. Copied alone into another project:
the byte tokenizer needs only numpy; gpt2 needs tiktoken and data/gpt2.tiktoken beside this file.

Test: python -m pytest tests/test_data.py -k "tokenizer or copied_alone"
"""

import os

import numpy as np

TOKENIZERS = ("byte", "gpt2")
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


_tokenizers = {}  # loading the gpt2 ranks takes a moment: build each tokenizer once


def get_tokenizer(name):
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; valid: {', '.join(TOKENIZERS)}")
    if name not in _tokenizers:
        _tokenizers[name] = ByteTokenizer() if name == "byte" else GPT2Tokenizer()
    return _tokenizers[name]
