"""CUDA only, so not collected by the CPU suite (pytest collects test_*.py): lab/gpu_check.sh runs it on a GPU.
The decode step captured as a CUDA graph (and compiled, then captured) gives the eager static-cache step's tokens.
Run (on a CUDA machine): python -m pytest -n0 tests/gpu_decode.py"""
import pytest
import torch

from test_decode import MODELS, make
from tools import decode


@pytest.mark.parametrize("name", ["fp", "packed"])
@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_the_captured_step_decodes_the_eager_steps_tokens_on_cuda(name, mode):
    model = make(**MODELS[name]).cuda()
    idx = torch.randint(0, 60, (3, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    want = decode.generate(model, idx, 30, top_k=1, mode="eager")
    dec = decode.Decoder(model, mode)
    assert torch.equal(dec.generate(idx, 30, top_k=1), want)
    assert torch.equal(dec.generate(idx, 30, top_k=1), want)  # replayed again: the same graph, the same tokens
    fixed = decode.Decoder(model, "fixed")
    for d in (dec, fixed):
        d.prefill(idx)
    for pos in range(5, 12):  # logits of the captured step against the fixed step run eagerly
        token = want[:, pos:pos + 1]
        ref = fixed.step(token, pos)
        torch.testing.assert_close(dec.step(token, pos), ref, rtol=0, atol=1e-4 * ref.abs().max().item())

