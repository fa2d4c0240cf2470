"""
Published models as our GPT: transformers' Llama, Mistral and Qwen3 are model.py's GPT with
quant=False and subln=False, so their weights load by name (hf_name) into a config read from theirs
(config_from_hf), and our forward gives transformers' logits (tests/test_pretrained.py:
bit-identical on the tiny cases).

    from_pretrained(source)          a Hugging Face directory, a hub id or a .gguf file -> GPT
    from_transformers(hf, source)    a transformers model already in memory -> GPT (sharing its
                                     tensors)
    is_model_source(name)            a GGUF, a Hugging Face model directory or a hub id: a name
                                     from_pretrained takes (--init_from, --teacher, --tokenizer)

A GGUF file loads through transformers' own reader (the gguf package dequantises it, and
transformers undoes llama.cpp's q/k row permutation), so a GGUF model is the same transformers model
as its Hugging Face original. A model we would not compute exactly (RoPE scaling, sliding windows,
biases, experts, another activation; in a GGUF also the RoPE scaling transformers' reader drops:
check_gguf), or asked for a block_size past its max_position_embeddings, is refused before its
weights are read: one ValueError line naming the config field. A damaged or foreign file (what
transformers, safetensors or gguf raise: unreadable) is one ValueError line naming it.
Test: python -m pytest tests/test_pretrained.py
"""

import contextlib
import os
import re

import torch

from model import GPT, GPTConfig, precompute_rope
from tokenizer import hub_unreachable
from tools.outputs import HF_MARKER, ours


def from_pretrained(source, block_size=None, check=None):
    """A published Llama-family (llama, mistral) or Qwen3 model as our GPT, in full precision and
    without SubLN (quant=False, subln=False: the stages convert it), with transformers' logits.
    source: a Hugging Face model directory (config.json + safetensors), a hub id (downloaded where
    there is a network) or a .gguf file. block_size: the given one, else
    min(max_position_embeddings, 2048); eot: the config's eos_token_id (a run takes its tokenizer's
    end-of-text instead, the id its shards separate documents with: start.pretrained_start). check:
    called with our GPTConfig before any weight is read (a caller's own refusals)."""
    from transformers import AutoModelForCausalLM
    path, kw, hf_config = hf_config_of(source)
    config = config_from_hf(hf_config, block_size)  # refuses here, before any weight is read
    if check is not None:
        check(config)
    # a mismatch is ours to report (below), not transformers' table of it
    with unreadable(source, "weights"):
        hf, info = AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=torch.float32,
                                                        output_loading_info=True, ignore_mismatched_sizes=True, **kw)
    if info["mismatched_keys"]:  # transformers would have initialised them at random
        name, theirs, ours = sorted(info["mismatched_keys"], key=str)[0]
        raise ValueError(f"{source}: its weights do not fit its config: {name} is {list(theirs)} "
                         f"in the weights but {list(ours)} by the config (vocab_size = "
                         f"{hf_config.vocab_size}, hidden_size = {hf_config.hidden_size}, head_dim "
                         f"= {getattr(hf_config, 'head_dim', None)}): a config of another model?")
    if info["missing_keys"]:  # transformers would have initialised them at random
        raise ValueError(f"tie_word_embeddings = {hf_config.tie_word_embeddings}: {source} lacks "
                         f"{sorted(info['missing_keys'])}, which transformers would fill at random")
    if info.get("unexpected_keys"):  # transformers would have dropped them: another model's logits
        extra = sorted(info["unexpected_keys"])
        raise ValueError(f"{source}: its weights hold {', '.join(extra[:3])}{', ...' * (len(extra) > 3)} "
                         f"({len(extra)} tensors), which its config ({hf_config.model_type}) has no place for "
                         "(attention biases, q/k norms of another architecture?): a config of another model?")
    return from_transformers(hf, source, block_size)


def hf_config_of(source):
    """(path, keyword arguments, transformers config) of a pretrained model, its config alone read
    (no weights)."""
    from transformers import AutoConfig
    # offline: the cache, at once
    path, kw = str(source), {"local_files_only": hub_unreachable(str(source))}
    # refuses what transformers would drop
    head_dim = check_gguf(source) if path.endswith(".gguf") else None
    if path.endswith(".gguf"):
        path, kw = os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    with unreadable(source, "config"):
        hf_config = AutoConfig.from_pretrained(path, **kw)
    if head_dim:  # transformers' qwen3 GGUF reader drops attention.key_length (and assumes 128)
        hf_config.head_dim = head_dim
    return path, kw, hf_config


@contextlib.contextmanager
def unreadable(source, what):
    """What transformers, safetensors or gguf raise for a damaged or foreign file (OSError, a JSON
    error, SafetensorError, a shape mismatch's RuntimeError, ...) as one ValueError line naming
    source."""
    from transformers.utils import logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report of a bad file is the error line below, once
    try:
        yield
    except Exception as e:
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"{source}: cannot load its {what} ({type(e).__name__}: {why})") from None
    finally:
        logging.set_verbosity(level)


def check_gguf(source):
    """A GGUF's hyperparameters transformers' GGUF reader drops without a word: RoPE scaling (the
    <arch>.rope.scaling.* keys, or the rope_freqs tensor llama.cpp writes for Llama 3.1/3.2's llama3
    scaling) is refused, one ValueError naming it, as config_from_hf refuses a config.json's
    rope_scaling. Returns the head size its <arch>.attention.key_length gives (None without one),
    for the config."""
    from gguf import GGUFReader
    with unreadable(source, "GGUF header"):
        reader = GGUFReader(str(source))
        fields = {k: f.contents() for k, f in reader.fields.items() if ".rope.scaling." in k or ".attention." in k}
        tensors = [t.name for t in reader.tensors]
    keys = [fields.get(k) for k in sorted(fields) if k.endswith((".attention.key_length", ".attention.value_length"))]
    if len(set(keys)) > 1:
        raise ValueError(f"attention.key_length and value_length = {keys} in {source}: our "
                         "attention has one head size")
    fields = {k: v for k, v in fields.items() if ".rope.scaling." in k}
    for key, value in sorted(fields.items()):
        if (key.endswith(".type") and value != "none") or (key.endswith(".factor") and value not in (0.0, 1.0)):
            raise ValueError(f"{key} = {value!r} in {source}: RoPE scaling is not implemented "
                             "(from_pretrained takes llama, mistral and qwen3 models with plain "
                             "RoPE)")
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"rope_freqs in {source}: llama.cpp's per-frequency RoPE scaling (Llama "
                         "3.1/3.2's llama3 rope_scaling) is not implemented (from_pretrained takes "
                         "models with plain RoPE)")
    # transformers' reader maps the tensors its architecture has and drops the rest without a word
    # (a llama file's optional attention biases, say): refused, as a directory's unexpected weights
    extra = sorted(t for t in tensors if not re.fullmatch(GGUF_TENSORS, t))
    if extra:
        raise ValueError(f"{source} holds {', '.join(extra[:3])}{', ...' * (len(extra) > 3)} ({len(extra)} "
                         "tensors) that transformers' GGUF reader would drop (from_pretrained takes llama, mistral "
                         "and qwen3 models without biases)")
    return keys[0] if keys else None


# the tensors of a llama, mistral or qwen3 GGUF (llama.cpp's names) that the import maps
GGUF_TENSORS = (r"token_embd\.weight|output_norm\.weight|output\.weight|blk\.\d+\.(attn_norm|attn_q|attn_k|"
                r"attn_v|attn_output|attn_q_norm|attn_k_norm|ffn_norm|ffn_gate|ffn_up|ffn_down)\.weight")


def from_transformers(hf, source, block_size=None):
    """A transformers model in memory (float32; a *ForCausalLM of model_type llama, mistral or
    qwen3) as our GPT with its weights: our parameters take its tensors (no copy: the two share
    storage; load_state_dict into a model of one's own to train apart from it). source: where it
    came from (model.source). model.hf_config is its config. Refuses what config_from_hf refuses, a
    tied config with a separate head, and weights we have no place for."""
    hf_config = hf.config
    config = config_from_hf(hf_config, block_size)
    if config.tie_embeddings and not torch.equal(hf.get_input_embeddings().weight, hf.lm_head.weight):
        raise ValueError(f"tie_word_embeddings = True, but {source} has an lm_head that differs "
                         "from its embedding (transformers keeps both, untied): set it to false in "
                         "the config")
    theirs = hf.state_dict()
    # no random init and no second copy: our parameters take transformers' tensors
    with torch.device("meta"):
        model = GPT(config)
    names = {name: hf_name(name) for name in model.state_dict()}
    extra = set(theirs) - set(names.values())
    if extra:  # weights our model has no place for (biases under another name, ...)
        raise ValueError(f"model_type = {hf_config.model_type!r}, but {source} holds weights "
                         f"model.py has no place for: {sorted(extra)[:4]}")
    model.load_state_dict({ours: theirs[name] for ours, name in names.items()}, assign=True)
    if config.tie_embeddings:  # assign made two parameters of the one tensor: one parameter again
        model.lm_head.weight = model.wte.weight
    model.rope_cos, model.rope_sin = precompute_rope(config.head_size(), config.block_size, config.rope_theta)
    model.source, model.hf_config = str(source), hf_config
    return model


def hf_name(name):
    """Our parameter name -> transformers' (Llama, Mistral, Qwen3): h.0.attn.q_proj.weight ->
    model.layers.0.self_attn.q_proj.weight, h.0.attn_norm.weight ->
    model.layers.0.input_layernorm.weight."""
    for ours, theirs in (("wte.", "model.embed_tokens."), ("norm_f.", "model.norm."), ("h.", "model.layers.")):
        if name.startswith(ours):
            name = theirs + name[len(ours):]
    for ours, theirs in ((".attn_norm.", ".input_layernorm."), (".mlp_norm.", ".post_attention_layernorm."),
                         (".attn.", ".self_attn.")):
        name = name.replace(ours, theirs)
    return name


def config_from_hf(hf, block_size=None):
    """Our GPTConfig (quant=False, subln=False) for a transformers config of model_type llama,
    mistral or qwen3. Refuses, in one ValueError line naming the field, what this model does not
    compute exactly."""
    def refuse(field, value, why):
        raise ValueError(f"{field} = {value!r} in the model's config: {why} (from_pretrained takes "
                         "llama, mistral and qwen3 models with plain RoPE, full attention, SiLU "
                         "and no biases)")
    if hf.model_type not in ("llama", "mistral", "qwen3"):
        refuse("model_type", hf.model_type, "an architecture model.py does not implement")
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": getattr(hf, "rope_theta", 10000.0)}
    # transformers 5 keeps config.json's rope_scaling here
    if rope.get("rope_type", "default") != "default":
        refuse("rope_scaling", rope, f"RoPE scaling ({rope['rope_type']}) is not implemented")
    for field, why in (("use_sliding_window", "sliding-window attention is not implemented"),
                       ("sliding_window", "sliding-window attention is not implemented"),
                       ("attention_bias", "our projections have no bias"), ("mlp_bias", "our MLP "
                                                                                        "has no "
                                                                                        "bias"),
                       ("num_experts", "mixture-of-experts is not implemented"),
                       ("num_local_experts", "mixture-of-experts is not implemented")):
        if getattr(hf, field, None) not in (None, False, 0):
            refuse(field, getattr(hf, field), why)
    if hf.hidden_act != "silu":
        refuse("hidden_act", hf.hidden_act, "our MLP is silu(gate) * up")
    if hf.num_attention_heads % (hf.num_key_value_heads or hf.num_attention_heads):
        refuse("num_key_value_heads", hf.num_key_value_heads,
               f"it must divide num_attention_heads {hf.num_attention_heads}")
    # RoPE past its trained context: no error, wrong
    if block_size and block_size > hf.max_position_embeddings:
        raise ValueError(f"block_size {block_size} is longer than the model's context "
                         f"(max_position_embeddings = {hf.max_position_embeddings}): pass "
                         f"--block_size={hf.max_position_embeddings} or less")
    eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, (list, tuple)) else hf.eos_token_id
    if eos is None:
        refuse("eos_token_id", None, "our shards start each document with it (eot)")
    return GPTConfig(vocab_size=hf.vocab_size, block_size=block_size or min(hf.max_position_embeddings, 2048),
                     n_layer=hf.num_hidden_layers, n_head=hf.num_attention_heads,
                     n_kv_head=hf.num_key_value_heads or hf.num_attention_heads, n_embd=hf.hidden_size,
                     head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                     qk_norm=hf.model_type == "qwen3", mlp_hidden=hf.intermediate_size, quant=False, subln=False,
                     tie_embeddings=bool(hf.tie_word_embeddings), rope_theta=float(rope["rope_theta"]),
                     norm_eps=hf.rms_norm_eps, eot=int(eos))


# -----------------------------------------------------------------------------
# which names are pretrained models


def is_model_source(name):
    """True when name is a pretrained model as published (from_pretrained takes it): a GGUF file, a Hugging
    Face model directory (config.json), or a hub id ("org/name", not a path on this machine)."""
    if not name or name in ("auto", "scratch", "byte", "gpt2"):
        return False
    if os.path.isfile(name):
        return name.endswith(".gguf") and not ours(name)  # our bitnet GGUF: a checkpoint's export
    if os.path.isdir(name):  # a model (config.json) or a tokenizer alone (for --tokenizer), not an export of ours
        files = ("config.json", "tokenizer.json", "tokenizer_config.json")
        return any(os.path.exists(os.path.join(name, f)) for f in files) and \
            not os.path.exists(os.path.join(name, HF_MARKER))
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.endswith((".pt", ".gguf", ".bin")) and \
        not name.startswith(".") and not os.path.isdir(parts[0])  # data/tiny_lama: a mistyped path, not a hub id
