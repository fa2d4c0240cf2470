"""CUDA only, so not collected by the CPU suite (pytest collects test_*.py): lab/gpu_check.sh runs it on a GPU.
The decode step captured as a CUDA graph (and compiled, then captured) decodes the fixed-shape
step's tokens, greedy across the refill at block_size, and replays the same graph again; sampling
recaptures.
Run (on a CUDA machine): python -m pytest -n0 tests/gpu_decode.py"""
import pytest
import torch

from test_decode import MODELS, make
from tools import decode


# mode varies fastest: xdist hands out tests two at a time, so each worker starts with one inductor compile, not two
@pytest.mark.parametrize("mode", ["graph", "compile"])
@pytest.mark.parametrize("name", ["fp", "packed"])
def test_the_captured_step_decodes_the_fixed_steps_tokens_on_cuda(name, mode):
    model = make(**MODELS[name]).cuda()
    idx = torch.randint(0, 60, (3, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    want = decode.generate(model, idx, 30, top_k=1, mode="fixed")  # 11 steps, then refills
    dec = decode.Decoder(model, mode)
    assert torch.equal(dec.generate(idx, 30, top_k=1), want)
    graph = dec.graph
    assert torch.equal(dec.generate(idx, 30, top_k=1), want) and dec.graph is graph  # replayed
    long = idx.repeat(1, 3)  # 15 tokens: captured at position 15 of 16, the warm-up stays inside
    want_long = decode.generate(model, long, 4, top_k=1, mode="fixed")
    assert torch.equal(decode.Decoder(model, mode).generate(long, 4, top_k=1), want_long)
    if mode == "graph":  # sampling inside the graph (inductor would draw other random numbers)
        out = dec.generate(idx, 30, temperature=0.8, top_k=20)
        assert out.shape == (3, 35) and not torch.equal(out, want) and dec.graph is not graph
