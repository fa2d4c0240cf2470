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
block_size the context is cropped and refilled as model.generate does. Sampling (model.sample_next) runs outside the
graph. doc_mask models keep model.generate (document-restarted positions, no cache): Decoder.generate calls it.

Use:  Decoder(model).generate(idx, max_new_tokens, temperature, top_k), as model.generate (sample.py does)
Run:  python -m lab.bench --decode (tokens/s)     Test:  python -m pytest tests/test_decode.py
"""

import torch

from model import sample_next

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
                d.graph = None  # new buffers: a captured step would read the old ones
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
        self.prefilling, self.length, self.graph, self.out = False, None, None, None

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
            self.token, self.graph = token.clone(), None
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
        """Warm up (compiles, Triton autotuning, the packed layers' stacks) on a side stream, then capture one step."""
        fn = lambda: self._step(self.token)  # noqa: E731
        if self.mode == "compile":
            fn = torch.compile(fn, fullgraph=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # rewrites the current position with the same k, v: harmless
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """model.generate's tokens (same cropping at block_size, same sampling) from the static cache; a doc_mask
        model runs model.generate itself."""
        if self.model.config.doc_mask:
            return self.model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
        pos = None
        for _ in range(max_new_tokens):
            if pos is None or pos >= self.block_size:  # (re)fill from the last block_size tokens
                ctx = idx[:, -self.block_size:]
                logits, pos = self.prefill(ctx), ctx.size(1)
            else:
                logits, pos = self.step(idx[:, -1:], pos), pos + 1
            idx = torch.cat((idx, sample_next(logits[:, -1, :], temperature, top_k)), dim=1)
        return idx


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, mode="auto"):
    """model.generate(idx, max_new_tokens, temperature, top_k) through a new Decoder(model, mode)."""
    return Decoder(model, mode).generate(idx, max_new_tokens, temperature, top_k)
