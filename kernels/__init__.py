"""Triton kernels. Import from the submodule: `from kernels.ternary_matmul import ternary_matmul`.
Here only what needs no Triton: on_device, which tools/decode.py uses on any platform."""

import contextlib

import torch


def on_device(dev):
    """Triton launches on the current CUDA device, whatever device the pointers are on: this makes the
    inputs' device current for the launch (tensors on cuda:1 while cuda:0 is current would otherwise
    run on cuda:0's stream); on the CPU (the interpreter) nothing."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
