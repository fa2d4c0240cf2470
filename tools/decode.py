"""
Fast autoregressive decoding: a static KV cache, and on CUDA the decode step replayed as one CUDA graph.

The idea (gpt-fast's static cache and CUDA-graph decode, github.com/pytorch-labs/gpt-fast, generate.py): at batch 1
a decode step is dozens of small kernels, and launching them costs more than running them. Preallocate every layer's
keys and values, (B, n_kv_head, block_size, head_dim), write the new token's k, v in place at its position, and the
step has the same shapes and addresses at every position; capture it once as a CUDA graph and replay it, one launch
a token. The position is a tensor the step reads, so one captured step serves every position:

    k_buf[:, :, pos] = k;  v_buf[:, :, pos] = v             index_copy_ at pos, a (1,) int64 tensor
    y = softmax(q k_buf^T / sqrt(hd) + mask) v_buf          mask = arange(block_size) <= pos (the written positions)

Modes (Decoder(model, mode)):
    eager    attends over the written positions only (a slice, its length a Python int): bit for bit
             model.generate's logits (tested on CPU; the default without CUDA)
    fixed    the fixed-shape step above, eager: what the graph captures, runnable on CPU. Masked attention over the
             whole buffer rounds differently from attention over the slice, so logits agree to float rounding
    graph    fixed, captured as one torch.cuda.CUDAGraph and replayed (CUDA; the default there)
    compile  fixed, torch.compile(fullgraph=True) (inductor fuses the small ops), then captured (CUDA)
The prompt (and each refill) runs eagerly, exactly as model.generate's prefill, writing positions 0..T-1. At
block_size the context is cropped and refilled as model.generate does. generate's step owns the token: it samples
(model.sample_next: fixed shapes, no host sync), writes the token as the next input and into a buffer by position,
and advances the position tensor, all inside the captured graph; the host replays it and reads the tokens back once,
at a refill or at the end. doc_mask models keep model.generate (document-restarted positions, no cache).

Use:  Decoder(model).generate(idx, max_new_tokens, temperature, top_k), as model.generate (sample.py does)
Run:  python -m lab.bench --decode (tokens/s)     Test:  python -m pytest tests/test_decode.py
"""

import torch

from model import check_sampling, sample_next

MODES = ("eager", "fixed", "graph", "compile")


class LayerCache:
    """One layer's static keys and values. Attention.forward calls extend(k, v) with the new positions' k, v
    (B, nkv, T, hd) and attends over what it returns."""

    def __init__(self, decoder):
        self.decoder, self.k, self.v = decoder, None, None

    def extend(self, k, v):
        d = self.decoder
        if d.prefilling:  # positions 0..T-1: attend over the prompt itself, as model.generate's prefill does
            shape = (k.size(0), k.size(1), d.block_size, k.size(3))
            if self.k is None or self.k.shape != shape or self.k.dtype != k.dtype or self.k.device != k.device:
                self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
                d.graph = d.sampler = None  # new buffers: a captured step would read the old ones
            self.k[:, :, :k.size(2)] = k
            self.v[:, :, :v.size(2)] = v
            return k, v
        self.k.index_copy_(2, d.pos, k)  # one new position, at the position tensor
        self.v.index_copy_(2, d.pos, v)
        if d.length is not None:  # eager: the written positions only
            return self.k[:, :, :d.length], self.v[:, :, :d.length]
        return self.k, self.v  # fixed shapes: every position, the step's mask hides the unwritten ones


class Decoder:
    """A model's decoding state: its static KV cache, the position tensor and, for graph/compile, the captured step.
    Reuse one for many generate calls with the same batch size: the buffers and the graph are kept."""

    def __init__(self, model, mode="auto"):
        if mode == "auto":
            mode = "graph" if model.rope_cos.is_cuda else "eager"
        if mode not in MODES:
            raise ValueError(f"mode={mode}: expected auto or one of {', '.join(MODES)}")
        self.model, self.mode, self.block_size = model, mode, model.config.block_size
        device = model.rope_cos.device
        if mode in ("graph", "compile") and device.type != "cuda":
            raise ValueError(f"mode={mode} captures a CUDA graph; the model is on {device}: use eager or fixed")
        self.layers = [LayerCache(self) for _ in model.h]
        self.pos = torch.zeros(1, dtype=torch.long, device=device)   # the step's position
        self.positions = torch.arange(self.block_size, device=device)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)  # the step's input token (B, 1)
        self.seq = torch.zeros(1, self.block_size + 1, dtype=torch.long, device=device)  # tokens by position
        self.prefilling, self.length, self.graph, self.out = False, None, None, None
        self.sampler, self.sampling = None, None  # generate's captured step (graph/compile), and its settings

    @torch.no_grad()
    def prefill(self, idx):
        """Logits (B, 1, V) of the last of idx (B, T), T <= block_size, at positions 0..T-1; fills the cache."""
        if self.model.config.doc_mask:
            raise ValueError("a doc_mask model restarts positions at each end-of-text: decode it with model.generate")
        self.prefilling = True
        try:
            return self.model._decode(idx, self.layers, 0)
        finally:
            self.prefilling = False

    @torch.no_grad()
    def step(self, token, pos):
        """Logits (B, 1, V) of token (B, 1) at position pos (0 < pos < block_size, after a prefill of pos tokens).
        In graph/compile mode the result is the graph's output tensor, overwritten by the next step."""
        self.pos.fill_(pos)
        if self.mode == "eager":
            self.length = pos + 1
            try:
                return self._step(token)
            finally:
                self.length = None
        if self.mode == "fixed":
            return self._step(token)
        if self.token.shape != token.shape:
            self.token, self.graph, self.sampler = token.clone(), None, None
        self.token.copy_(token)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out

    def _step(self, token):
        """The decode step: fixed shapes, its position read from self.pos (a tensor) except in eager mode."""
        m = self.model
        cos, sin = m.rope_cos.index_select(0, self.pos), m.rope_sin.index_select(0, self.pos)  # (1, hd/2)
        mask = None if self.length is not None else (self.positions <= self.pos).view(1, 1, 1, -1)  # (1,1,1,L)
        x = m.wte(token)
        for block, cache in zip(m.h, self.layers):
            x, _ = block(x, cos, sin, mask, cache=cache)
        return m.lm_head(m.norm_f(x))  # (B, 1, V)

    def _capture(self):
        """The logits step (step()) as a CUDA graph."""
        self.graph, self.out = _captured(lambda: self._step(self.token), self.mode == "compile")

    def _sample_step(self, temperature, top_k, vocab=None):
        """generate's step, all on the device: the token at self.pos in, the next token sampled (model.sample_next)
        and written as the next input and into self.seq at pos + 1, the position advanced. No host read."""
        logits = self._step(self.token)
        nxt = sample_next(logits[:, -1, :], temperature, top_k, vocab)  # (B, 1)
        self.seq.index_copy_(1, self.pos + 1, nxt)
        self.token.copy_(nxt)
        self.pos.add_(1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, vocab=None):
        """model.generate's tokens (same cropping at block_size, same sampling, the same checks) from the static
        cache; a doc_mask model runs model.generate itself."""
        if self.model.config.doc_mask:
            return self.model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, vocab=vocab)
        check_sampling(idx, self.model.config.vocab_size, temperature, top_k, vocab)
        B, L = idx.size(0), self.block_size
        if self.token.size(0) != B:
            self.token, self.seq = self.token.new_zeros(B, 1), self.seq.new_zeros(B, L + 1)
            self.graph = self.sampler = None
        pos = first = None  # host copies: pos of the newest token (the next step's input), first new one's
        for _ in range(max_new_tokens):
            if pos is None or pos >= L:  # (re)fill from the last block_size tokens
                if pos is not None:
                    idx = torch.cat((idx, self.seq[:, first:pos + 1]), dim=1)
                ctx = idx[:, -L:]
                pos = first = ctx.size(1)
                nxt = sample_next(self.prefill(ctx)[:, -1, :], temperature, top_k, vocab)
                self.seq[:, pos:pos + 1] = nxt
                self.token.copy_(nxt)
                self.pos.fill_(pos)
                continue
            if self.mode in ("graph", "compile"):
                if self.sampler is None or self.sampling != (temperature, top_k, vocab):
                    self.sampling, here = (temperature, top_k, vocab), (self.pos.clone(), self.token.clone())
                    self.sampler, _ = _captured(lambda: self._sample_step(temperature, top_k, vocab),
                                                self.mode == "compile")
                    self.pos.copy_(here[0]), self.token.copy_(here[1])  # the warm-up stepped on: back to pos
                self.sampler.replay()
            elif self.mode == "eager":
                self.length = pos + 1  # attend over the written positions only
                try:
                    self._sample_step(temperature, top_k, vocab)
                finally:
                    self.length = None
            else:
                self._sample_step(temperature, top_k, vocab)
            pos += 1
        return idx if pos is None else torch.cat((idx, self.seq[:, first:pos + 1]), dim=1)


def _captured(fn, compile):
    """(torch.cuda.CUDAGraph of fn, its output): warmed up first (compiles, the packed layers' stacks) on a side
    stream, as torch.cuda.graph requires. The warm-up runs fn three times: a step rewrites the current position's
    k, v with the same values; the sampling step also moves on (the caller puts its position and token back: the
    k, v written past it are rewritten before any step attends to them)."""
    if compile:
        fn = torch.compile(fn, fullgraph=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, mode="auto", vocab=None):
    """model.generate(idx, max_new_tokens, temperature, top_k, vocab) through a new Decoder(model, mode)."""
    return Decoder(model, mode).generate(idx, max_new_tokens, temperature, top_k, vocab)
