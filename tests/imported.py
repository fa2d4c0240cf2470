"""A tiny imported model for the export tests (tests/test_hf.py, test_gguf.py, test_packed.py, test_sample.py): a
random-initialised Llama built with transformers (2 layers, width 64, 4 heads, 2 KV heads, untied head) with a byte-level
BPE tokenizer of 384 ids, as tests/test_convert.py's tiny_llama, converted by train.py --init_from (SubLN inserted,
stage 2 ternary) for 4 steps: lambda reaches 1 at step 2, so every export takes it."""

import gzip
import json
import os

from conftest import ROOT, run

CONVERT = ["--stage=2", "--max_iters=4", "--eval_interval=4", "--lambda_warmup_steps=2", "--warmup_steps=1",
           "--batch_size=4", "--block_size=64", "--eval_iters=2", "--eval_whole=False", "--device=cpu"]


def tiny_llama(d, config_vocab=None):
    """Save the tiny Llama and its tokenizer in the directory d (made if missing); returns d. config_vocab: a
    vocabulary in the config (and embedding) larger than the tokenizer's, as Qwen3's 151,936 rows for 151,669
    ids."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    os.makedirs(d, exist_ok=True)
    with gzip.open(os.path.join(ROOT, "data", "shakespeare.jsonl.gz"), "rt") as f:
        text = [json.loads(line)["text"] for line in f][:5]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=config_vocab or len(fast), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, rope_theta=50000.0,
                       rms_norm_eps=1e-5)
    LlamaForCausalLM(conf).save_pretrained(d)
    fast.save_pretrained(d)
    return d


def converted(tmp):
    """(source directory, stage-2 checkpoint path) of the tiny Llama converted under the directory tmp (its shards
    there too: train.py would keep the shipped corpus's in data/shakespeare_tiny_llama, shared by every run)."""
    import subprocess
    import sys
    src = tiny_llama(os.path.join(str(tmp), "tiny_llama"))
    data, out = os.path.join(str(tmp), "data"), os.path.join(str(tmp), "run")
    corpus = os.path.join(str(tmp), "corpus.jsonl")  # 40 documents of the first play: 4 steps need no more
    with gzip.open(os.path.join(ROOT, "data", "shakespeare.jsonl.gz"), "rt") as f:
        text = json.loads(f.readline())["text"]
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"text": text[i * 2500:(i + 1) * 2500]}) + "\n" for i in range(40))
    subprocess.run([sys.executable, "-m", "tools.prepare", f"--tokenizer={src}", f"--out_dir={data}", corpus],
                   cwd=ROOT, check=True, capture_output=True)
    run(*CONVERT, f"--init_from={src}", f"--data={data}", f"--out_dir={out}")
    return src, os.path.join(out, "stage2", "ckpt.pt")
