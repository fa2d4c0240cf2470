"""
GGUF export for llama.cpp's `bitnet` architecture: run what you trained here in llama.cpp (or bitnet.cpp).

GGUF is llama.cpp's file: key-value metadata, then named tensors. llama.cpp's bitnet architecture (written for
1bitLLM's BitNet b1.58 models, arXiv 2402.17764) is our model's shape exactly, as its source says
(src/models/bitnet.cpp, and llama_model_rope_type in src/llama-model.cpp, ggml-org/llama.cpp):

    per layer:  h = x + attn_output(attn_sub_norm(attention(rope(attn_q(attn_norm(x))), rope(attn_k(..)), attn_v(..))))
                x = h + ffn_down(ffn_sub_norm(silu(ffn_gate(ffn_norm(h))) * ffn_up(ffn_norm(h))))
    then:       logits = token_embd @ output_norm(x)        the head is always the embedding (tied): no output.weight
    each matmul W x is followed by "* W.scale" when the optional one-element tensor blk.N.<W>.scale exists
    RoPE: NEOX, the two halves of each head rotate together (our apply_rope); no q/k row permutation is needed
    the FFN activation is SiLU-gated (our SwiGLU); every norm is RMSNorm with bitnet.attention.layer_norm_rms_epsilon

Our tensors map one to one (model.py name -> GGUF name): wte -> token_embd, h.N.attn_norm -> blk.N.attn_norm,
attn.{q,k,v,o}_proj -> attn_{q,k,v,output}, attn.subln -> attn_sub_norm, mlp_norm -> ffn_norm,
mlp.{gate,up,down}_proj -> ffn_{gate,up,down}, mlp.subln -> ffn_sub_norm, norm_f -> output_norm.
A hidden matrix goes out as its ternary codes W_q in {-1, 0, +1} (quant.weight_quant) plus `.scale` = gamma in
F32, so the file holds exactly what our forward pass multiplies by:
  - TQ2_0 when its row length K is a multiple of 256 (the type's block): 2 bits per weight + an fp16 block scale
    d, which is 1.0 for codes in {-1, 0, 1}, so the codes are exact;
  - F16 otherwise (llama.cpp rejects a quantised row that does not fill whole blocks): {-1, 0, 1} are exact in F16.
The embedding and the norms go out as F32. Vocabulary: GPT-2 BPE (tokenizer.ggml.model "gpt2": the tokens in
GPT-2's byte-to-unicode spelling, and the merges recovered from tiktoken's ranks), or our byte tokenizer as
the same model with the 256 byte tokens and one merge that can never fire (llama.cpp requires the key and
gguf-py cannot write an empty list); <|endoftext|> is BOS and EOS, as every document starts with it in training.

Not the same numbers as ours: we quantise each activation row to int8 per token (absmax over the whole row);
llama.cpp multiplies F16 weights by float activations, and TQ2_0 weights by activations quantised to 8 bits in
blocks of 256 (Q8_K). scripts/check_llamacpp.sh measures the difference on the val text.

    python export.py --format=gguf --ckpt=out/stage2/ckpt.pt --out=out/stage2/model.gguf
Test: python -m pytest tests/test_gguf.py     (needs the gguf package: pip install gguf)
"""

import numpy as np

from quant import weight_quant

ARCH = "bitnet"
QK_K = 256  # TQ2_0's block: a row is quantised in whole blocks
HIDDEN = {"attn.q_proj": "attn_q", "attn.k_proj": "attn_k", "attn.v_proj": "attn_v", "attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
NORMS = {"attn_norm": "attn_norm", "attn.subln": "attn_sub_norm", "mlp_norm": "ffn_norm", "mlp.subln": "ffn_sub_norm"}


def gguf_tensors(model):
    """[(GGUF name, float32 array (out, in) or (n,), GGML type name)] of a ternary GPT, in file order.
    Hidden matrices: the codes W_q and a `.scale` of gamma (see the docstring); the rest as they are."""
    c = model.config
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = [("token_embd.weight", sd["wte.weight"].numpy(), "F32")]
    for i in range(c.n_layer):
        for ours, theirs in HIDDEN.items():
            w = sd[f"h.{i}.{ours}.weight"]  # (out, in)
            if c.quant:
                w_q, gamma = weight_quant(w)
                kind = "TQ2_0" if w.shape[1] % QK_K == 0 else "F16"
                out += [(f"blk.{i}.{theirs}.weight", w_q.float().numpy(), kind),
                        (f"blk.{i}.{theirs}.scale", gamma.reshape(1).numpy(), "F32")]
            else:  # a full-precision (stage 1) model: the weights themselves, no scale
                out.append((f"blk.{i}.{theirs}.weight", w.numpy(), "F32"))
        for ours, theirs in NORMS.items():
            out.append((f"blk.{i}.{theirs}.weight", sd[f"h.{i}.{ours}.weight"].numpy(), "F32"))
    out.append(("output_norm.weight", sd["norm_f.weight"].numpy(), "F32"))
    return out


def write_gguf(model, tokenizer, path):
    """Write model (a GPT of model.py) and its tokenizer ("byte" | "gpt2") as a GGUF file for llama.cpp's
    bitnet architecture. Returns {GGML type name: number of tensors}. ValueError if llama.cpp cannot hold it."""
    import gguf  # here: only this export needs the package
    c = model.config
    if not c.subln:
        raise ValueError("llama.cpp's bitnet architecture has sub-norms before attn_output and ffn_down; this model "
                         "was trained without SubLN (--subln=False), so it has nothing to put there")
    if not c.tie_embeddings:
        raise ValueError("llama.cpp's bitnet architecture uses the embedding as the LM head; this model's head is its own")
    if c.quant and any(float(m.lambda_) != 1.0 for n, m in model.named_modules() if hasattr(m, "lambda_")):
        raise ValueError("the checkpoint is mid lambda warm-up (lambda < 1): it is not yet a ternary model; train "
                         "past --lambda_warmup_steps first")
    w = gguf.GGUFWriter(path, ARCH)
    w.add_context_length(c.block_size)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(c.hidden_dim())
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head)
    w.add_rope_dimension_count(c.n_embd // c.n_head)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_TQ2_0 if c.quant else gguf.LlamaFileType.ALL_F32)
    _add_vocab(w, tokenizer, c.vocab_size)
    counts = {}
    for name, arr, kind in gguf_tensors(model):
        t = getattr(gguf.GGMLQuantizationType, kind)
        data = gguf.quants.quantize(arr, t) if kind == "TQ2_0" else arr.astype(np.float16 if kind == "F16" else np.float32)
        w.add_tensor(name, data, raw_dtype=t if kind == "TQ2_0" else None)
        counts[kind] = counts.get(kind, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def _add_vocab(w, tokenizer, n_vocab):
    """GPT-2-style vocabulary metadata: tokens in GPT-2's byte-to-unicode spelling, types, merges, BOS/EOS."""
    import gguf
    import data  # the tokenizers (data.py needs tiktoken only for gpt2)
    spell = gguf.vocab.bytes_to_unicode()  # byte -> printable character, e.g. 0x20 -> "Ġ"
    tok = data.get_tokenizer(tokenizer)
    if tokenizer == "byte":
        tokens = [spell[b] for b in range(256)]
        merges = ["ĠĠ ĠĠ"]  # never fires: no merge makes "ĠĠ"; llama.cpp needs a non-empty merges key
    else:
        ranks = tok.enc._mergeable_ranks  # token bytes -> rank = id
        by_id = sorted(ranks, key=ranks.get)
        tokens = ["".join(spell[b] for b in t) for t in by_id]
        merges = [" ".join("".join(spell[b] for b in p) for p in _split(ranks, t)) for t in by_id if len(t) > 1]
    tokens.append("<|endoftext|>")  # id tok.eot = len(tokens) - 1
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    for i in range(len(tokens), n_vocab):  # --pad_vocab rows: never produced by the tokenizer
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.eot)
    w.add_eos_token_id(tok.eot)
    w.add_add_bos_token(True)


def _split(ranks, token):
    """The two tokens whose merge made `token`: byte-pair encode it with only the merges ranked before it."""
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


def verify_gguf(path, model):
    """Read the file back with gguf's reader and compare every tensor with what gguf_tensors(model) says it
    must hold (dequantised; exact, since codes, gamma and the fp tensors are all stored exactly). Returns the
    list of mismatches, empty when the file is right."""
    import gguf
    want = {name: arr for name, arr, _ in gguf_tensors(model)}
    got = {t.name: t for t in gguf.GGUFReader(path).tensors}
    bad = [f"{n}: missing" for n in want if n not in got] + [f"{n}: not ours" for n in got if n not in want]
    for name, arr in want.items():
        if name in got:
            t = got[name]
            x = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(arr.shape)
            if not np.array_equal(x, arr):
                bad.append(f"{name}: {int((x != arr).sum())} of {arr.size} values differ")
    return bad
