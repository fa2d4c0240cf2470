"""Triton kernels. Import from the submodule: `from kernels.ternary_matmul import ternary_matmul`."""
