"""
Fast autoregressive decoding: model.generate with its decode step captured as one CUDA graph.

The idea (gpt-fast's CUDA-graph decode, github.com/pytorch-labs/gpt-fast, generate.py): at batch 1 a
decode step is dozens of small kernels, and launching them costs more than running them.
model.generate decodes from a static KV cache (model.KVCache: keys and values preallocated, written
in place), and its step (GPT.decode_step) samples, writes the token and advances the position on the
device. Given the position as a tensor, the step has the same shapes and addresses at every
position: captured once, it is replayed, one launch a token:

    k_buf[:, :, pos] = k;  v_buf[:, :, pos] = v       index_copy_ at pos, a (1,) int64 tensor
    y = softmax(q k_buf^T / sqrt(hd) + mask) v_buf    mask = arange(block_size) <= pos

Modes (Decoder(model, mode)):
    eager    model.generate itself: attention over the written positions only (the default on CPU)
    fixed    the fixed-shape step above, run eagerly: what the graph captures, runnable on CPU.
             Masked attention over the whole buffer rounds differently from attention over the
             written slice: logits agree to float rounding
    graph    fixed, captured as one torch.cuda.CUDAGraph and replayed (CUDA; the default there)
    compile  fixed, torch.compile(fullgraph=True) (inductor fuses small ops), then captured (CUDA)
The prompt and each refill at block_size run eagerly (model.generate's loop); the host replays the
step and reads the tokens back once, at a refill or at the end. doc_mask models refill every token.

Use:  Decoder(model).generate(idx, max_new_tokens, temperature, top_k, vocab), as model.generate
Run:  python -m lab.bench --decode (tokens/s)     Test:  python -m pytest tests/test_decode.py
"""

import torch

from kernels import on_device  # no Triton: kernels/__init__.py
from model import DecodeState

MODES = ("eager", "fixed", "graph", "compile")


class Decoder:
    """A model's decoding buffers (model.DecodeState) and, for graph/compile, its captured step.
    Reuse one for many generate calls with the same batch size: the buffers and the graph are
    kept."""

    def __init__(self, model, mode="auto"):
        if mode == "auto":
            mode = "graph" if model.rope_cos.is_cuda else "eager"
        if mode not in MODES:
            raise ValueError(f"mode={mode}: expected auto or one of {', '.join(MODES)}")
        device = model.rope_cos.device
        if mode in ("graph", "compile") and device.type != "cuda":
            raise ValueError(f"mode={mode} captures a CUDA graph; the model is on {device}: use eager or fixed")
        self.model, self.mode, self.state, self.graph, self.sampling = model, mode, None, None, None

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, vocab=None):
        """model.generate(idx, max_new_tokens, temperature, top_k, vocab) with this mode's step."""
        if self.mode == "eager" or idx.dim() != 2:  # model.generate refuses what is not (B, T)
            return self.model.generate(idx, max_new_tokens, temperature, top_k, vocab)
        if self.state is None or self.state.seq.size(0) != idx.size(0):
            self.state, self.graph = DecodeState(self.model, idx.size(0)), None
        m, s, sampling = self.model, self.state, (temperature, top_k, vocab)
        run = lambda: m.decode_step(s, s.pos, *sampling)  # noqa: E731  the fixed-shape step

        def replay(pos):  # captured at its first call (after the prefill), again for other sampling
            if self.graph is None or self.sampling != sampling:
                self.graph, self.sampling = _captured(run, self.mode == "compile", s), sampling
            self.graph.replay()
        step = (lambda pos: run()) if self.mode == "fixed" else replay
        # the graph, its stream and the Triton kernels run on the current CUDA device: the model's
        with on_device(s.pos.device):
            return m.generate(idx, max_new_tokens, temperature, top_k, vocab, state=s, step=step)



def _captured(fn, compile, s):
    """torch.cuda.CUDAGraph of fn, the step on DecodeState s, warmed up first (compiles, the packed
    layers' stacks) on a side stream, as torch.cuda.graph requires."""
    if compile:
        fn = torch.compile(fn, fullgraph=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _warm_up(fn, s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _warm_up(fn, s, runs=3):
    """Run the step fn a few times from the current position, each run undone (s.pos put back; the
    k, v it wrote at pos are the ones the next step writes there, and s.seq past pos is written
    again before it is read): warming up never runs past block_size."""
    here = s.pos.clone()
    for _ in range(runs):
        fn()
        s.pos.copy_(here)


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, mode="auto", vocab=None):
    """model.generate(idx, max_new_tokens, temperature, top_k, vocab) through a new Decoder(model, mode)."""
    return Decoder(model, mode).generate(idx, max_new_tokens, temperature, top_k, vocab)
