"""
Our GPT as a directory of Hugging Face transformers' bitnet architecture (BitNetForCausalLM), the
format half of `python -m tools.export --format=hf` (tools/export.py writes the directory whole and
says what it wrote).

    write_hf(model, tokenizer, out_dir)  config.json, model.safetensors, nanobitnet.json, the
                                         tokenizer's files
    hf_config(c), hf_tensors(model)      the config and the tensors, by transformers' names
                                         (HF_HIDDEN, HF_NORMS)
    hf_refusal(model)                    why transformers' bitnet would not compute what the model
                                         computes

The mapping, the packing and the scale convention are in docs/hf-format.md.
Test: python -m pytest tests/test_hf.py
"""

import dataclasses
import json
import os

import torch

from quant import weight_quant
from tools.outputs import SOURCE_RUN


# Hugging Face transformers' bitnet architecture: a directory that
# AutoModelForCausalLM.from_pretrained loads as
# BitNetForCausalLM, its hidden matrices as transformers' BitLinear (integrations/bitnet.py).
# Checked against
# transformers 5.24's source; the mapping, the packing and the scale convention are in
# docs/hf-format.md.
#
# transformers' BitLinear: y = (x_q @ W_q^T) / (s * weight_scale) s = 127 / max|x| per token, as
# ours
#   ours (quant.py):          y = (x_q @ W_q^T) * gamma / s             so weight_scale = 1 / gamma


# in <out>/nanobitnet.json: the directory is an export of ours, and of which checkpoint
HF_FORMAT = "nanobitnet-hf-v1"
HF_HIDDEN = {"attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
             "attn.o_proj": "self_attn.o_proj", "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj",
             "mlp.down_proj": "mlp.down_proj"}
HF_NORMS = {"attn_norm": "input_layernorm", "attn.subln": "self_attn.attn_sub_norm",
            "mlp_norm": "post_attention_layernorm", "mlp.subln": "mlp.ffn_sub_norm"}


def pack_hf(w_q):
    """(N, K) int8 in {-1,0,1} -> (N/4, K) uint8 in transformers' layout (integrations/bitnet.py
    pack_weights): along the output dim N, in four blocks of N/4 rows; byte (r, k) holds W_q[r +
    j*N/4, k] at bits 2j..2j+1 as the code W_q + 1. Ours (quant.pack_ternary) packs four consecutive
    k of one row instead."""
    N, K = w_q.shape
    # codes[j]: rows j*N/4 .. (j+1)*N/4 - 1
    codes = (w_q.to(torch.int16) + 1).to(torch.uint8).view(4, N // 4, K)
    return (codes[0] | codes[1] << 2 | codes[2] << 4 | codes[3] << 6).contiguous()  # (N/4, K)


def hf_refusal(model):
    """None if transformers' bitnet architecture computes what the model computes, else why not (one
    sentence)."""
    c = model.config
    if not c.quant:
        return ("it is a full-precision model (quant=False, stage 1), and transformers' bitnet "
                "loads only ternary weights; export a stage-2 checkpoint")
    if any(float(m.lambda_) != 1.0 for m in model.modules() if hasattr(m, "lambda_")):
        return ("the checkpoint is mid lambda warm-up (lambda < 1): it is not yet a ternary model; "
                "train past --lambda_warmup_steps first")
    if not c.causal:
        return ("it is a masked-diffusion model (--stage=dlm): bidirectional attention and a mask "
                "token, which transformers' bitnet would run as a causal next-token model; export "
                "its stage-2 checkpoint instead")
    if not c.subln:
        return ("transformers' bitnet has sub-norms before o_proj and down_proj (attn_sub_norm, "
                "ffn_sub_norm); this model was trained without SubLN (--subln=False), so it has "
                "nothing to put there")
    if c.qk_norm:
        return ("it has q/k norms (qk_norm, Qwen3's q_norm and k_norm before RoPE), which "
                "transformers' bitnet does not have; export it as packed (python -m tools.export) "
                "instead")
    q, kv = c.n_head * c.head_size(), c.kv_heads() * c.head_size()
    if q != c.n_embd:
        return (f"its attention is {c.n_head} heads x {c.head_size()} = {q} wide, not n_embd {c.n_embd}, and "
                "transformers' bitnet makes its attention sub-norm (attn_sub_norm) n_embd wide, so it would refuse "
                "the export; export it as packed (python -m tools.export) or GGUF instead")
    if c.n_embd % 4 or c.hidden_dim() % 4 or kv % 4:
        return ("transformers packs four rows of a hidden matrix into each byte, so every output "
                f"width must be a multiple of 4; this model has n_embd {c.n_embd}, MLP hidden "
                f"{c.hidden_dim()} and K/V width {kv}: train one with widths that are")
    return None


def hf_config(c):
    """config.json of BitNetConfig (transformers/models/bitnet/configuration_bitnet.py) for our
    GPTConfig c."""
    return {
        "architectures": ["BitNetForCausalLM"],
        "model_type": "bitnet",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.hidden_dim(),
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        # grouped-query attention when fewer than num_attention_heads
        "num_key_value_heads": c.kv_heads(),
        "head_dim": c.head_size(),
        # silu(gate) * up: our SwiGLU (BitNet 2B4T uses relu2)
        "hidden_act": "silu",
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.norm_eps,
        # transformers >= 5 reads this
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        # transformers 4.x reads this; both would default to 500000
        "rope_theta": c.rope_theta,
        "attention_bias": False,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": c.eot,                 # every training document starts with eot
        "eos_token_id": c.eot,
        "pad_token_id": None,
        # the embedding and norms as trained (dtype="auto" loads this)
        "dtype": "float32",
        "quantization_config": {
            "quant_method": "bitnet",
            # packed uint8 weights, y / (s * weight_scale); not autobitlinear
            "linear_class": "bitlinear",
            "quantization_mode": "offline",
            "use_rms_norm": False,             # our norms are the model's own RMSNorm modules
            # the head is the full-precision embedding (or its own fp matrix)
            "modules_to_not_convert": ["lm_head"],
        },
    }


def hf_tensors(model):
    """{name in BitNetForCausalLM's state dict: tensor} for model.safetensors: each hidden matrix as
    pack_hf(W_q) with weight_scale = 1/gamma (fp32, shape (1,)); the embedding, the norms (and an
    untied head) in fp32."""
    c = model.config
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm_f.weight"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(c.n_layer):
        for ours, theirs in HF_HIDDEN.items():
            w_q, gamma = weight_quant(sd[f"h.{i}.{ours}.weight"])
            out[f"model.layers.{i}.{theirs}.weight"] = pack_hf(w_q)
            out[f"model.layers.{i}.{theirs}.weight_scale"] = (1.0 / gamma).reshape(1)
        for ours, theirs in HF_NORMS.items():
            out[f"model.layers.{i}.{theirs}.weight"] = sd[f"h.{i}.{ours}.weight"]
    # clone: safetensors refuses shared storage
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_tokenizer(tokenizer, block_size):
    """{file name: text} of a GPT-2 tokenizer that AutoTokenizer loads offline (tokenizer.json,
    built from the shipped data/gpt2.tiktoken ranks, merges recovered as for GGUF), or {} for the
    byte tokenizer (use token ids) and for an imported model's (write_hf saves that one with
    transformers' save_pretrained)."""
    if tokenizer not in ("gpt2",):
        return {}
    # its bytes_to_unicode: GPT-2's byte -> printable character spelling, as in _add_vocab
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizer import get_tokenizer
    tok = get_tokenizer(tokenizer)
    spell = gguf.vocab.bytes_to_unicode()
    ranks = tok.enc._mergeable_ranks  # token bytes -> rank = id
    by_id = sorted(ranks, key=ranks.get)
    vocab = {"".join(spell[b] for b in t): i for i, t in enumerate(by_id)}
    merges = [tuple("".join(spell[b] for b in p) for p in _split(ranks, t)) for t in by_id if len(t) > 1]
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # GPT-2's split regex, then bytes
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken("<|endoftext|>", special=True)])  # id tok.eot = len(vocab)
    assert bpe.token_to_id("<|endoftext|>") == tok.eot
    eot = "<|endoftext|>"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eot, "eos_token": eot, "unk_token": eot,
              "model_max_length": block_size, "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": bpe.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def write_hf(model, tokenizer, out_dir, source=None, source_run=None):
    """Write model (a GPT of model.py) and its tokenizer ("byte" | "gpt2") into the directory
    out_dir (made if missing), replacing the files of those names; returns their names. ValueError
    if the format cannot hold it."""
    from safetensors.torch import save_file
    why = hf_refusal(model)
    if why:
        raise ValueError(why)
    os.makedirs(out_dir, exist_ok=True)
    texts = {"config.json": json.dumps(hf_config(model.config), indent=2) + "\n",
             **hf_tokenizer(tokenizer, model.config.block_size)}
    # an imported model's own files
    saved = _save_model_tokenizer(tokenizer, model.config.block_size, out_dir)
    names = ["model.safetensors", *texts, *saved, "nanobitnet.json"]
    marker = {"format": HF_FORMAT, "source": source, SOURCE_RUN: source_run, "tokenizer": tokenizer,
              "model_args": dataclasses.asdict(model.config), "files": names}
    texts["nanobitnet.json"] = json.dumps(marker, indent=2) + "\n"
    path = os.path.join(out_dir, "model.safetensors")
    save_file(hf_tensors(model), path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    # safetensors writes 0600; the other files get the usual permissions
    os.chmod(path, 0o666 & ~umask)
    for name, text in texts.items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    return names


def _save_model_tokenizer(tokenizer, block_size, out_dir):
    """An imported model's tokenizer (tokenizer.py's HFTokenizer: its source directory, hub id or
    .gguf) saved into out_dir by transformers' save_pretrained (tokenizer.json,
    tokenizer_config.json, ...); returns the file names. Nothing for byte and gpt2."""
    if tokenizer in ("byte", "gpt2"):
        return []
    from tokenizer import get_tokenizer
    hf = get_tokenizer(tokenizer).hf
    # HFTokenizer lifts it for long corpora: the export says the model's context
    longest = hf.model_max_length
    hf.model_max_length = block_size
    try:
        paths = hf.save_pretrained(out_dir)
    finally:
        hf.model_max_length = longest
    return sorted({os.path.basename(p) for p in paths if os.path.isfile(p)})


def _split(ranks, token):
    """The two tokens whose merge made `token`: byte-pair encode it with only the merges ranked
    before it."""
    parts = [bytes([b]) for b in token]
    limit = ranks[token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, limit), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        r, i = min(pairs)
        if r >= limit:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    assert len(parts) == 2, (token, parts)
    return parts
