"""
Compile every Triton kernel configuration of kernels/ternary_matmul.py for real GPU targets, on a machine
without a GPU: Triton lowers a kernel to PTX with its bundled LLVM and assembles it with its bundled ptxas,
for any target named by hand (GPUTarget("cuda", 80, 32): Ampere, sm_80; 90: Hopper, sm_90), and nothing is
launched. The interpreter (TRITON_INTERPRET=1), which the kernel tests use on CPU, runs the kernels as
NumPy and never meets the compiler, so a kernel that cannot compile for a GPU passes there; this catches it.

    python -m kernels.cross_compile            # every configuration, sm_80 and sm_90; prints one line each
Test:
    python -m pytest tests/test_cross_compile.py
"""

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's kernels are not compilable objects
    sys.exit("kernels.cross_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import ternary_matmul as tm  # noqa: E402

TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32)}
MATMUL_ARGS = dict(x_ptr="*i8", xs_ptr="*fp32", w_ptr="*u8", ws_ptr="*fp32", out_ptr="*fp32", acc_ptr="*i32",
                   M="i32", N="i32", K="i32", M_BUCKET="i32", stride_xm="i32", stride_wn="i32", stride_om="i32", stride_ws="i32")
MATMUL_CONSTS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "ATOMIC_ACC", "WRITE_ACC")


def _matmul(cfg, out="*fp32", **flags):
    sig = dict(MATMUL_ARGS, out_ptr=out, **{k: "constexpr" for k in MATMUL_CONSTS})
    return (tm._ternary_matmul_kernel, sig, dict(cfg.kwargs, **flags),
            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def jobs():
    """(name, kernel, signature, constexprs, options) of every configuration the host wrappers can launch."""
    out = []
    for i, cfg in enumerate(tm.DECODE_CONFIGS):  # split-K decode: int32 partial sums added atomically
        out.append((f"decode[{i}]", *_matmul(cfg, ATOMIC_ACC=True, WRITE_ACC=False)))
    for i, cfg in enumerate(tm.PREFILL_CONFIGS):  # prefill: scales in the epilogue
        out.append((f"prefill[{i}]", *_matmul(cfg, ATOMIC_ACC=False, WRITE_ACC=False)))
    cfg = tm.PREFILL_CONFIGS[0]
    out.append(("prefill[0] bf16 out", *_matmul(cfg, out="*bf16", ATOMIC_ACC=False, WRITE_ACC=False)))
    out.append(("prefill[0] int32 acc", *_matmul(cfg, out="*i32", ATOMIC_ACC=False, WRITE_ACC=True)))
    for dt in ("fp32", "bf16"):
        sig = dict(acc_ptr="*i32", xs_ptr="*fp32", ws_ptr="*fp32", out_ptr=f"*{dt}", N="i32", stride_om="i32",
                   stride_ws="i32", BLOCK_N="constexpr")
        out.append((f"scale {dt}", tm._scale_kernel, sig, dict(BLOCK_N=1024), dict(num_warps=4)))
    for dt, block, one_pass in (("fp32", 1024, True), ("bf16", 8192, False), ("fp16", 4096, True)):
        sig = dict(x_ptr=f"*{dt}", xq_ptr="*i8", xs_ptr="*fp32", K="i32", stride_x="i32", BLOCK_K="constexpr",
                   ONE_PASS="constexpr")
        out.append((f"quantize {dt} {'one pass' if one_pass else 'two loops'}", tm._quantize_activations_kernel,
                    sig, dict(BLOCK_K=block, ONE_PASS=one_pass),
                    dict(num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)))
    return out


def compile_one(kernel, signature, constexprs, options, target):
    """The compiled kernel (its .asm holds ttir, ttgir, llir, ptx and cubin); raises if it does not compile."""
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target,
                          options=dict({"enable_fp_fusion": True}, **options))


def main():
    failed = 0
    for tname, target in TARGETS.items():
        for name, kernel, sig, consts, opts in jobs():
            t0 = time.time()
            try:
                k = compile_one(kernel, sig, consts, opts, target)
                print(f"{tname} {name}: {len(k.asm['cubin']):,} bytes of cubin in {time.time() - t0:.1f}s")
            except Exception as e:  # noqa: BLE001 - report every configuration, then fail
                failed += 1
                print(f"{tname} {name}: FAILED: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    print(f"{'all configurations compiled' if not failed else f'{failed} configuration(s) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
