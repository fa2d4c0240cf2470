"""
A Llama-style decoder whose hidden matrices can be BitNet b1.58 ternary layers.

The idea: pre-norm transformer blocks (RMSNorm, rotary positions, gated MLP, no biases) in which every
hidden projection (q, k, v, o, gate, up, down) is a separate `BitLinear` when `quant=True`, each with its own
gamma (one scale for a fused qkv matrix would be another quantiser). q, k, v still run as ONE matmul, and gate
and up as one, over the stacked weights, each quantised by its own gamma first (`project`). The token
embedding, the LM head and the norms stay full precision. SubLN adds one more RMSNorm right before
o_proj and right before down_proj, which keeps the inputs of those two quantised matrices well scaled.
Grouped-query attention (n_kv_head < n_head K/V heads, each shared by n_head / n_kv_head query heads), a head_dim
of its own and Qwen3's q/k norms make this model, with quant=False and subln=False, transformers' Llama, Mistral and
Qwen3 (tools/pretrained.py loads them, with their logits).

Sources: BitNet b1.58 2B4T (HF modeling_bitnet) for the layout, BitDistill (arXiv 2510.13998, Stage 1)
for SubLN; RoPE (arXiv 2104.09864); GQA (arXiv 2305.13245); the document mask packs documents as in "Efficient
Sequence Packing without Cross-contamination" (arXiv 2107.02027, section 3).

    h   = x + o_proj(SubLN(Attn(RMSNorm(x))))          Attn: causal SDPA with RoPE on q and k (after the q/k norms)
    out = h + down_proj(SubLN(silu(gate(RMSNorm(h))) * up(RMSNorm(h))))     (SwiGLU; we pick SiLU)

Document mask (optional, `doc_mask=True`): documents start with the end-of-text token; a token attends
only to earlier tokens of its own document, doc = cumsum(idx == eot), and positions restart at 0 in each
document, so a packed row computes exactly what each document alone would.

Generation (generate): a static KV cache (KVCache, gpt-fast's), one block loop (forward_with_states)
for training, the prompt and each decode step; the step (decode_step) samples and advances its
position on the device, so tools/decode.py can replay it as one CUDA graph.

Run:  python model.py (prints a parameter count and a forward pass)    Test:  python -m pytest tests/test_model.py
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from quant import BitLinear, QuantRMSNorm, RMSNorm, stacked_linear


def precompute_rope(head_dim, length, theta):
    """apply_rope's tables, (length, 2, hd/2) each: cos for both halves, sin signed (-sin, +sin)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # (hd/2,)
    freqs = torch.outer(torch.arange(length).float(), inv_freq)                   # (L, hd/2)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack([cos, cos], dim=1), torch.stack([-sin, sin], dim=1)


def apply_rope(x, cos, sin):
    """x: (B, nh, T, hd); cos, sin: precompute_rope's rows, (T, 2, hd/2) or (B, 1, T, 2, hd/2).
    Rotates the halves of hd, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in fp32, without a
    cat: x * cos + (x, halves swapped) * signed sin; x1*cos + x2*(-sin) is x1*cos - x2*sin in IEEE,
    bit for bit. Eagerly RoPE computes it; torch.compile fuses the formula itself."""
    xs = x.unflatten(-1, (2, -1))  # (..., 2, hd/2): a view
    if x.dtype != torch.float32:
        xs = xs.float()
    y = (xs * cos + xs.flip(-2) * sin) if torch.compiler.is_compiling() else RoPE.apply(xs, cos, sin)
    y = y.flatten(-2)
    return y if y.dtype == x.dtype else y.to(x.dtype)


class RoPE(torch.autograd.Function):
    """apply_rope's xs * cos + flip(xs) * sin without the flip (a gather: on a CPU slower than both
    multiplies), the swapped product written half by half; backward the rotation's transpose,
    g * cos + flip(g * sin), the same way. Forward and gradient have autograd's bits."""

    @staticmethod
    def swapped_times(x, sin, i):  # i = 0: flip(x) * sin;  i = 1: flip(x * sin)
        t = torch.empty_like(x)
        torch.mul(x.select(-2, 1), sin.select(-2, i), out=t.select(-2, 0))
        torch.mul(x.select(-2, 0), sin.select(-2, 1 - i), out=t.select(-2, 1))
        return t

    @staticmethod
    def forward(ctx, xs, cos, sin):
        ctx.save_for_backward(cos, sin)
        return torch.mul(xs, cos).add_(RoPE.swapped_times(xs, sin, 0))

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return torch.mul(g, cos).add_(RoPE.swapped_times(g, sin, 1)), None, None


def document_mask(idx, eot):
    """Packed rows of documents that each start with eot: a token attends only to earlier tokens of its own
    document, and positions restart at 0 in each document. Returns (pos (B, T), mask (B, 1, T, T) bool)."""
    T = idx.size(1)
    t = torch.arange(T, device=idx.device)
    starts = idx == eot                                              # (B, T)
    doc = starts.cumsum(dim=1)                                       # document id of every token
    pos = t - torch.where(starts, t, 0).cummax(dim=1).values         # position within its document
    mask = (doc.unsqueeze(2) == doc.unsqueeze(1)) & (t.unsqueeze(1) >= t.unsqueeze(0))  # same doc, causal
    return pos, mask.unsqueeze(1)


def make_linear(config, fan_in, fan_out, input_quantized):
    """BitLinear when quant (which skips its own activation quantiser if a QuantRMSNorm did it), else nn.Linear."""
    if config.quant:
        return BitLinear(fan_in, fan_out, bias=False, quantize_input=not input_quantized)
    return nn.Linear(fan_in, fan_out, bias=False)


def make_norm(config, dim):
    """The norm before quantised projections: it quantises its output for them when quant (quant.QuantRMSNorm)."""
    return QuantRMSNorm(dim, eps=config.norm_eps) if config.quant else RMSNorm(dim, eps=config.norm_eps)


def project(x, layers, fused=True):
    """Projections of the same input: q, k, v (or gate, up). fused: one matmul over the stacked weights, each
    matrix keeping its own gamma (quant.stacked_linear): the same numbers in one GEMM instead of three (two). A
    layer type that is neither nn.Linear nor BitLinear (e.g. the packed inference layer) may stack itself with
    a `stacked_forward(x, layers)`; otherwise each layer runs alone. The parameters stay separate either way,
    so checkpoints, Muon (one orthogonalisation per matrix) and every export see q, k, v as three matrices.
    (Fused, the layers' own forward is not called: a forward hook on q_proj does not fire; set fused=False.)"""
    if not fused:
        return [m(x) for m in layers]
    if all(isinstance(m, nn.Linear) for m in layers):  # BitLinear is an nn.Linear too
        return stacked_linear(x, layers)
    if hasattr(layers[0], "stacked_forward"):
        return layers[0].stacked_forward(x, layers)
    return [m(x) for m in layers]


class SiLUMul(torch.autograd.Function):
    """SwiGLU's silu(gate) * up from one (..., 2H) tensor [gate | up] (the stacked gate/up product), with
    the gradient written into one (..., 2H) tensor: the same ops and bits as autograd through
    F.silu(gate) * up, without the cat that splitting the product costs in backward."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        s = F.silu(gate)
        ctx.save_for_backward(gate, up, s)
        return s * up

    @staticmethod
    def backward(ctx, g):
        gate, up, s = ctx.saved_tensors
        if torch.compiler.is_compiling():  # dynamo traces no strided out=; inductor writes the cat in place
            return torch.cat([torch.ops.aten.silu_backward(g * up, gate), g * s], dim=-1)
        d = g.new_empty(g.shape[:-1] + (2 * g.size(-1),))
        d_gate, d_up = d.chunk(2, dim=-1)
        torch.mul(g, s, out=d_up)
        torch.mul(g, up, out=d_gate)  # silu's input gradient, then silu' applied in place
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        return d


class SDPA(nn.Module):
    """softmax(q k^T / sqrt(hd) + mask) v, all heads at once: q (B, nh, T, hd), k, v (B, nkv, T, hd) -> (B, nh, T, hd).
    Grouped-query attention (nkv < nh): K/V head j serves the nh / nkv consecutive query heads from j * nh / nkv on,
    as transformers' repeat_kv."""

    def forward(self, q, k, v, mask=None, is_causal=True):
        if k.size(1) != q.size(1):
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))  # (B, nh, T, hd)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


class KVCache:
    """One block's keys and values, (B, n_kv_head, block_size, head_dim), written in place
    (gpt-fast's static cache): a step has the same shapes and addresses at every position.
    update(pos, k, v) writes k, v (B, nkv, T, hd) at pos..pos+T-1 for an int pos, returning the
    written positions 0..pos+T-1, or at the positions pos, a (T,) tensor, returning the whole buffer
    (the caller masks the unwritten)."""

    def __init__(self, shape, dtype, device):
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))

    def update(self, pos, k, v):
        if isinstance(pos, int):
            end = pos + k.size(2)
            self.k[:, :, pos:end], self.v[:, :, pos:end] = k, v
            return self.k[:, :, :end], self.v[:, :, :end]
        self.k.index_copy_(2, pos, k), self.v.index_copy_(2, pos, v)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        C, nh, nkv, hd = config.n_embd, config.n_head, config.kv_heads(), config.head_size()
        if nh % nkv or hd % 2 or not (config.head_dim or C % nh == 0):
            raise ValueError(f"n_head={nh} must be a multiple of n_kv_head={nkv}, and head_dim={hd} even (RoPE "
                             f"rotates pairs); with head_dim=0, n_embd={C} must split into n_head={nh} heads")
        self.n_head, self.n_kv_head, self.head_dim = nh, nkv, hd
        self.q_proj = make_linear(config, C, nh * hd, input_quantized=True)  # input: Block.attn_norm
        self.k_proj = make_linear(config, C, nkv * hd, input_quantized=True)
        self.v_proj = make_linear(config, C, nkv * hd, input_quantized=True)
        self.o_proj = make_linear(config, nh * hd, C, input_quantized=config.subln)
        self.subln = make_norm(config, nh * hd) if config.subln else nn.Identity()
        # Qwen3: an RMSNorm over hd on each head of q and k, before RoPE (full precision: no BitLinear reads it)
        self.q_norm = RMSNorm(hd, eps=config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, eps=config.norm_eps) if config.qk_norm else nn.Identity()
        self.causal = config.causal
        self.fused = config.fused
        self.attend = SDPA()  # a module of its own, so a lesson can hook q and k (QK-clip: lessons/muon_variants.py)

    def forward(self, x, cos, sin, mask, want_qkv=False, cache=None, pos=None):
        B, T, C = x.size()
        nh, nkv, hd = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), self.fused)  # (B, T, nh*hd), 2x (B, T, nkv*hd)
        q = self.q_norm(q.view(B, T, nh, hd)).transpose(1, 2)   # (B, nh, T, hd)
        k = self.k_norm(k.view(B, T, nkv, hd)).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, nkv, hd).transpose(1, 2)               # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # generation: the earlier positions' keys and values are kept
            k, v = cache.update(pos, k, v)
        # causal when queries and keys are the same positions; one new query sees every cached key
        y = self.attend(q, k, v, mask, self.causal and mask is None and q.size(2) == k.size(2))
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hd)  # (B, T, nh*hd) heads concatenated
        return self.o_proj(self.subln(y)), ((q, k, v) if want_qkv else None)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        C, H = config.n_embd, config.hidden_dim()
        self.gate_proj = make_linear(config, C, H, input_quantized=True)  # input: Block.mlp_norm
        self.up_proj = make_linear(config, C, H, input_quantized=True)
        self.down_proj = make_linear(config, H, C, input_quantized=config.subln)
        self.subln = make_norm(config, H) if config.subln else nn.Identity()
        self.fused = config.fused

    def forward(self, x):
        layers = (self.gate_proj, self.up_proj)
        if self.fused and all(isinstance(m, nn.Linear) for m in layers):  # [gate | up] as one product
            h = SiLUMul.apply(stacked_linear(x, layers, split=False))
        else:
            gate, up = project(x, layers, self.fused)
            h = F.silu(gate) * up  # (B, T, H)
        return self.down_proj(self.subln(h))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn_norm = make_norm(config, config.n_embd)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, want_qkv=False, cache=None, pos=None):
        a, qkv = self.attn(self.attn_norm(x), cos, sin, mask, want_qkv, cache, pos)
        x = x + a
        x = x + self.mlp(self.mlp_norm(x))
        return x, qkv


@dataclass
class GPTConfig:
    vocab_size: int = 257      # 257 = bytes + end-of-text; 50257 for GPT-2
    block_size: int = 256      # max context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_kv_head: int = 0         # key/value heads, each shared by n_head / n_kv_head query heads (GQA); 0 = n_head
    head_dim: int = 0          # 0 = n_embd // n_head; Qwen3 sets its own (q_proj: n_embd -> n_head * head_dim)
    qk_norm: bool = False      # Qwen3: RMSNorm over head_dim on each head of q and k, before RoPE
    mlp_hidden: int = 0        # 0 = 8/3 * n_embd rounded up to a multiple of 64 (Llama)
    quant: bool = True         # hidden projections are BitLinear (ternary) instead of nn.Linear
    subln: bool = True         # extra RMSNorm before o_proj and down_proj (BitDistill Stage 1)
    tie_embeddings: bool = True  # LM head shares the embedding matrix (nanoGPT, BitNet 2B4T)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    doc_mask: bool = False     # attend within documents only (needs eot); off = plain causal, faster
    eot: int = 256             # end-of-text id that starts every document in the shards
    causal: bool = True        # False: every position attends to every other (the masked-diffusion LM, lessons/dlm.py)
    fused: bool = True         # q/k/v and gate/up as one matmul each, every matrix with its own gamma (project)

    def hidden_dim(self):
        return self.mlp_hidden or 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def kv_heads(self):
        return self.n_kv_head or self.n_head

    def head_size(self):
        return self.head_dim or self.n_embd // self.n_head


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm_f = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        cos, sin = precompute_rope(config.head_size(), config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, 2, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2 scaled init of the residual projections
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, **states):
        """idx, targets: (B, T) int64. Returns (logits, loss); loss is None without targets, and then only the
        last position's logits are computed, as in nanoGPT. With keywords, forward_with_states(idx, targets,
        **states) -> (logits, loss, states): DDP and torch.compile wrap forward only, so distillation's states
        come through it."""
        if states:
            return self.forward_with_states(idx, targets, **states)
        logits, loss, _ = self.forward_with_states(idx, targets)
        return logits, loss

    def forward_with_states(self, idx, targets=None, qkv_layer=None, hiddens=False, cache=None,
                            pos=0, all_logits=False):
        """forward, plus the states distillation reads: returns (logits, loss, states) with states["qkv"] the
        (q, k, v) of block `qkv_layer` (may be negative; q, k after the q/k norms and RoPE; q (B, nh, T, hd), k and v
        (B, nkv, T, hd): the K/V heads, not repeated) or None, and
        states["hiddens"] every block's output (B, T, C) if `hiddens`, else []. all_logits: every position's
        logits without targets (a teacher's: no loss computed over (B, T, V)).
        generate passes cache (a KVCache per block) and pos: the first token's position (an int) or
        each token's (a (T,) tensor), as KVCache.update takes them."""
        B, T = idx.size()
        L = self.config.block_size
        assert T <= L, f"sequence of {T} tokens > block_size {L}"
        cos, sin, mask = self.rope_cos[:T], self.rope_sin[:T], None  # mask None = plain causal
        if cache is not None and not isinstance(pos, int):  # the whole cache, after pos masked
            cos, sin = self.rope_cos.index_select(0, pos), self.rope_sin.index_select(0, pos)
            mask = (torch.arange(L, device=idx.device) <= pos.unsqueeze(1)).view(1, 1, T, L)
        elif self.config.doc_mask:  # generate: at pos 0
            doc_pos, mask = document_mask(idx, self.config.eot)
            cos, sin = self.rope_cos[doc_pos].unsqueeze(1), self.rope_sin[doc_pos].unsqueeze(1)
        elif pos:
            cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        want_layer = None if qkv_layer is None else qkv_layer % self.config.n_layer
        x = self.wte(idx)  # (B, T, C)
        states = {"qkv": None, "hiddens": []}
        for i, (block, c) in enumerate(zip(self.h, cache or [None] * len(self.h))):
            x, qkv = block(x, cos, sin, mask, i == want_layer, c, pos)
            if i == want_layer:
                states["qkv"] = qkv
            if hiddens:
                states["hiddens"].append(x)
        x = self.norm_f(x)
        if targets is None and want_layer is None and not hiddens and not all_logits:
            return self.lm_head(x[:, -1:, :]), None, states  # (B, 1, V): generation needs the last one only
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss, states

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, vocab=None, state=None,
                 step=None):
        """Sample max_new_tokens continuations of idx (B, T), cropping the context to block_size. A
        static KV cache keeps each layer's keys and values, so a step (decode_step) runs the new
        token only; at block_size the context is cropped and refilled: its full forward (activations
        are quantised per token: cached positions are what a full forward computes); a doc_mask
        model refills every token. vocab: sample among the first vocab ids only (a padded
        vocabulary's tokenizer's). state, step: tools/decode.py's DecodeState and step(pos), pos the
        host's copy of state.pos; default new buffers and the eager step."""
        check_sampling(idx, self.config.vocab_size, temperature, top_k, vocab)
        L = self.config.block_size
        s = state or DecodeState(self, idx.size(0))
        step = step or (lambda pos: self.decode_step(s, pos, temperature, top_k, vocab))
        pos = first = None  # host copies: the newest token's position, the first new one's
        for _ in range(max_new_tokens):
            if pos is None or pos >= L or self.config.doc_mask:  # (re)fill: the last L tokens
                if pos is not None:
                    idx = torch.cat((idx, s.seq[:, first:pos + 1]), dim=1)
                ctx = idx[:, -L:]
                pos = first = ctx.size(1)
                s.pos.fill_(pos - 1)
                self.decode_step(s, 0, temperature, top_k, vocab, ctx)
            else:
                step(pos)
                pos += 1
        return idx if pos is None else torch.cat((idx, s.seq[:, first:pos + 1]), dim=1)

    def decode_step(self, s, pos, temperature=1.0, top_k=None, vocab=None, idx=None):
        """generate's step on DecodeState s: the tokens idx (default the newest, s.seq at s.pos) at
        pos in (an int, or s.pos itself: fixed shapes), the next token sampled (sample_next) and
        written to s.seq at s.pos + 1, s.pos advanced; all on the device, no host read
        (tools/decode.py captures it)."""
        idx = s.seq.index_select(1, s.pos) if idx is None else idx  # (B, 1)
        logits = self.forward_with_states(idx, cache=s.cache, pos=pos)[0]
        s.seq.index_copy_(1, s.pos + 1, sample_next(logits[:, -1, :], temperature, top_k, vocab))
        s.pos.add_(1)


class DecodeState:
    """generate's buffers for a batch: a KVCache per block, the tokens by position seq
    (B, block_size + 1) and the newest one's position pos (1,), the next step's input."""

    def __init__(self, model, batch):
        c, w = model.config, model.wte.weight
        shape = (batch, c.kv_heads(), c.block_size, c.head_size())
        self.cache = [KVCache(shape, w.dtype, w.device) for _ in model.h]
        self.pos = torch.zeros(1, dtype=torch.long, device=w.device)
        self.seq = torch.zeros(batch, c.block_size + 1, dtype=torch.long, device=w.device)


def check_sampling(idx, vocab_size, temperature, top_k, vocab=None):
    """ValueError, one sentence naming the argument, for what generate cannot sample from or with. Reads idx's
    smallest and largest id (one host read, before generating)."""
    if idx.dim() != 2 or idx.size(1) == 0 or idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"idx: expected (B, T) integer token ids with T >= 1, got {idx.dtype} {tuple(idx.shape)}; "
                         f"start from at least one token (end-of-text)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k}: expected None or an integer >= 1 (1 is greedy decoding)")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature}: expected a finite number > 0; for greedy decoding use top_k=1")
    if vocab is not None and not 1 <= vocab <= vocab_size:
        raise ValueError(f"vocab={vocab}: expected 1 .. {vocab_size}, the model's vocabulary")
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if lo < 0 or hi >= (vocab or vocab_size):
        raise ValueError(f"idx holds ids {lo} .. {hi}, outside the vocabulary 0 .. {(vocab or vocab_size) - 1}")


def sample_next(logits, temperature=1.0, top_k=None, vocab=None):
    """The next token (B, 1) drawn from the last position's logits (B, V) at temperature, among the top_k, and
    among the first `vocab` ids when given (a --pad_vocab model's rows past its tokenizer's never win).
    The draw is argmax(p / E) with E ~ Exponential(1) per token (the exponential race: token i wins with
    probability p_i), fixed shapes and no host sync, so a captured CUDA graph can sample. top_k=1 (greedy) is the
    argmax of the logits alone: no draw, and among equal logits the lowest id."""
    logits = logits if vocab is None else logits[:, :vocab]
    if top_k == 1:
        return torch.argmax(logits, dim=-1, keepdim=True)
    logits = logits / max(temperature, 1e-6)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, -1:], -float("inf"))
    probs = F.softmax(logits.float(), dim=-1)
    race = torch.empty_like(probs).exponential_().clamp_min_(1e-30)  # E > 0: a zero p never wins, even 0 / tiny
    return torch.argmax(probs / race, dim=-1, keepdim=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    n_bit = sum(m.weight.numel() for m in model.modules() if isinstance(m, BitLinear))
    print(f"{model.get_num_params() / 1e6:.2f}M non-embedding params, {n_bit / 1e6:.2f}M of them ternary")
    idx = torch.randint(0, 256, (2, 64))
    logits, loss = model(idx, idx)
    print(f"loss at init {loss.item():.3f} (ln(vocab) = {math.log(model.config.vocab_size):.3f})")
