"""
Compile every Triton kernel configuration of kernels/ternary_matmul.py for real GPU targets, on a machine
without a GPU, and read what came out. Triton lowers a kernel to PTX with its bundled LLVM and assembles it with
its bundled ptxas, for any target named by hand (GPUTarget("cuda", 80, 32): Ampere, sm_80; 90: Hopper, sm_90),
and nothing is launched. The interpreter (TRITON_INTERPRET=1), which the kernel tests use on CPU, runs the
kernels as NumPy and never meets the compiler, so a kernel that cannot compile for a GPU passes there; this
catches it, and reports per kernel what only the compiled code shows:

    regs     registers per thread, spills (STL/LDL instructions in the SASS: local memory), shared memory
    mma      integer MMA instructions in the PTX (mma.sync ... .s8 on sm_80, wgmma ... .s8 on sm_90)
    dp4a     dp4a instructions in the PTX
    wload    the global loads whose address comes from the weight pointer, with their widths in bytes.
             Found by following registers in the PTX: the one loaded from the weight parameter (ld.param of
             <kernel>_param_2), then every register computed from a followed one (address arithmetic); a load
             (ld.global, or cp.async into shared memory when the loop is software-pipelined) whose address
             register is followed reads weight bytes. Each static instruction runs once per thread per K step
             (a software-pipelined loop, cp.async, has num_stages - 1 more steps' copies in its prologue), so
             with every byte read once: sum of widths * threads == tile bytes (BLOCK_N * BLOCK_G * 4), times
             num_stages when pipelined. The kernel before plane order loaded each byte once per code: 1-byte
             loads, 4x its tile.

The compile assumes what a launch on real model shapes specialises: 16-byte aligned pointers and K, N and the
strides multiples of 16 (Triton then emits 16-byte vector loads), M = 1 for the decode kernel.

    python -m kernels.cross_compile                  # every configuration, sm_80 and sm_90; one line each
    python -m kernels.cross_compile --json=PATH      # and the reports as a JSON list (tests/test_cross_compile.py)
Test:
    python -m pytest tests/test_cross_compile.py
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's kernels are not compilable objects
    sys.exit("kernels.cross_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import ternary_matmul as tm  # noqa: E402

TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32)}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")  # Triton's ptxas, cuobjdump
ALIGNED = ("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "out_ptr", "xq_ptr", "N", "K", "KW", "stride_xm", "stride_wn",
           "stride_om")  # as a launch on model shapes specialises them: multiples of 16
DECODE_ARGS = dict(x_ptr="*i32", xs_ptr="*fp32", w_ptr="*i32", ws_ptr="*fp32", out_ptr="*bf16", M="constexpr",
                   N="i32", KW="i32", stride_xm="i32", stride_wn="i32", stride_om="i32", stride_ws="i32",
                   BLOCK_N="constexpr", BLOCK_G="constexpr", DP4A="constexpr", WRITE_ACC="constexpr")
PREFILL_ARGS = dict(x_ptr="*i8", xs_ptr="*fp32", w_ptr="*i32", ws_ptr="*fp32", out_ptr="*bf16", M="i32", N="i32",
                    K="i32", KW="i32", stride_xm="i32", stride_wn="i32", stride_om="i32", stride_ws="i32",
                    BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_G="constexpr", GROUP_M="constexpr",
                    WRITE_ACC="constexpr")
TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_G", "GROUP_M")


def _decode(name, cfg, out="*bf16", dp4a=True, write_acc=False):
    consts = dict(M=1, BLOCK_N=cfg["BLOCK_N"], BLOCK_G=cfg["BLOCK_G"], DP4A=dp4a, WRITE_ACC=write_acc)
    return dict(name=name, kind="decode", kernel=tm._decode_kernel, signature=dict(DECODE_ARGS, out_ptr=out),
                constexprs=consts, options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def _prefill(name, cfg, out="*bf16", write_acc=False):
    consts = dict({k: cfg[k] for k in TILE}, WRITE_ACC=write_acc)
    return dict(name=name, kind="prefill", kernel=tm._prefill_kernel, signature=dict(PREFILL_ARGS, out_ptr=out),
                constexprs=consts, options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def jobs(target):
    """Every configuration the host wrappers can launch on this target (dicts: name, kind, kernel, signature,
    constexprs, options)."""
    arch = target.arch // 10
    out = [_decode(f"decode {key}", cfg) for key, cfg in tm.DECODE_CONFIGS.items()]
    cfg = tm.DECODE_CONFIGS["long-wide"]
    out.append(_decode("decode long-wide fp32 out", cfg, out="*fp32"))
    out.append(_decode("decode long-wide int32 acc", cfg, out="*i32", write_acc=True))
    out.append(_decode("decode long-wide pure-Triton dp4a", cfg, dp4a=False))  # the interpreter's form, compiled
    for M, cls in ((64, "short"), (2048, "tall")):
        for K, steps in ((4096, "many K steps"), (256, "one K step")):
            out.append(_prefill(f"prefill sm_{arch}x {cls}, {steps}", tm.prefill_config(M, K, arch)))
    cfg = tm.prefill_config(2048, 4096, arch)
    out.append(_prefill(f"prefill sm_{arch}x tall fp32 out", cfg, out="*fp32"))
    out.append(_prefill(f"prefill sm_{arch}x tall int32 acc", cfg, out="*i32", write_acc=True))
    for dt, block, one_pass in (("fp32", 1024, True), ("bf16", 8192, False), ("fp16", 4096, True)):
        sig = dict(x_ptr=f"*{dt}", xq_ptr="*i8", xs_ptr="*fp32", K="i32", stride_x="i32", BLOCK_K="constexpr",
                   ONE_PASS="constexpr")
        out.append(dict(name=f"quantize {dt} {'one pass' if one_pass else 'two loops'}", kind="quantize",
                        kernel=tm._quantize_activations_kernel, signature=sig,
                        constexprs=dict(BLOCK_K=block, ONE_PASS=one_pass),
                        options=dict(num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)))
    return out


def compile_one(kernel, signature, constexprs, options, target):
    """The compiled kernel (its .asm holds ttir, ttgir, llir, ptx and cubin); raises if it does not compile."""
    args = [a for a in kernel.arg_names]
    attrs = {(args.index(a),): [["tt.divisibility", 16]] for a in ALIGNED
             if a in args and signature.get(a) != "constexpr"}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=target, options=dict({"enable_fp_fusion": True}, **options))


_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+(.*);")
_REG = re.compile(r"%[a-z]+\d+")


def weight_loads(ptx, kernel_name, param=2):
    """[(opcode, bytes)] of the global loads whose address derives from <kernel_name>_param_<param> (see top)."""
    lines = [m.groups() for m in map(_INSTR.match, ptx.splitlines()) if m]
    followed = set()
    for op, operands in lines:
        if op.startswith("ld.param") and f"[{kernel_name}_param_{param}]" in operands:
            followed.update(_REG.findall(operands.split(",")[0]))
    changed = True
    while changed:  # registers computed from followed ones (loop-carried pointers need more than one pass)
        changed = False
        for op, operands in lines:
            if op.startswith(("ld.", "st.", "cp.", "atom.", "red.")) or "," not in operands:
                continue  # a load's result is data, not an address
            dst, src = operands.split(",", 1)
            if followed.intersection(_REG.findall(src)):
                new = set(_REG.findall(dst)) - followed
                if new:
                    followed |= new
                    changed = True
    loads = []
    for op, operands in lines:
        addrs = re.findall(r"\[\s*(%rd\d+)[^\]]*\]", operands)
        if op.startswith("ld.global") and addrs and addrs[0] in followed:
            vec = re.search(r"\.v(\d)\.", op + ".")
            bits = int(re.search(r"\.[bsuf](\d+)$", op).group(1))
            loads.append((op, (int(vec.group(1)) if vec else 1) * bits // 8))
        elif op.startswith("cp.async") and ".global" in op and len(addrs) >= 1 and addrs[-1] in followed:
            loads.append((op, int(operands.split(",")[2], 0)))
    return loads


def report(job, k):
    """What the compiled kernel holds (see top): a dict of plain numbers and strings."""
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    mma = sorted(set(re.findall(r"\b((?:wgmma\.mma_async|mma\.sync)[\w.]*)", ptx)))
    loads = weight_loads(ptx, k.name) if job["kind"] != "quantize" else []
    c, o = job["constexprs"], job["options"]
    r = dict(name=job["name"], kind=job["kind"], regs=int(re.search(r"REG:(\d+)", res).group(1)),
             stack=int(re.search(r"STACK:(\d+)", res).group(1)),
             spills=len(re.findall(r"\b(?:STL|LDL)\b", sass)), shared=k.metadata.shared,
             mma=mma, n_mma=sum(ptx.count(m + " ") for m in mma), dp4a=ptx.count("dp4a."),
             wload_widths=sorted({w for _, w in loads}), n_wload=len(loads), wload_bytes=sum(w for _, w in loads),
             wload_pipelined=any(op.startswith("cp.async") for op, _ in loads),
             threads=32 * o["num_warps"], num_stages=o.get("num_stages", 1), cubin_bytes=len(k.asm["cubin"]))
    if job["kind"] != "quantize":
        r["tile_bytes"] = c["BLOCK_N"] * c["BLOCK_G"] * 4  # the weight words of one K step
    return r


def run(targets=TARGETS):
    """[report or {name, target, error}] for every job on every target."""
    results = []
    for tname, target in targets.items():
        for job in jobs(target):
            t0 = time.time()
            try:
                k = compile_one(job["kernel"], job["signature"], job["constexprs"], job["options"], target)
                r = report(job, k)
            except Exception as e:  # noqa: BLE001 - report every configuration, then fail
                results.append(dict(name=job["name"], kind=job["kind"], target=tname,
                                    error=str(e).splitlines()[0] if str(e) else type(e).__name__))
                continue
            results.append(dict(r, target=tname, seconds=round(time.time() - t0, 1)))
    return results


def main(argv=()):
    results = run()
    failed = sum("error" in r for r in results)
    for a in argv:
        if a.startswith("--json="):
            with open(a.split("=", 1)[1], "w") as f:
                json.dump(results, f, indent=1)
    for r in results:
        if "error" in r:
            print(f"{r['target']} {r['name']}: FAILED: {r['error']}")
            continue
        loads = ""
        if r["kind"] != "quantize":
            stages = f" x {r['num_stages']} stages, cp.async" if r["wload_pipelined"] else ""
            loads = (f", weight loads {r['n_wload']} x {'/'.join(map(str, r['wload_widths']))} B x {r['threads']} "
                     f"threads = {r['wload_bytes'] * r['threads']:,} B (tile {r['tile_bytes']:,} B{stages})")
        print(f"{r['target']} {r['name']}: {r['cubin_bytes']:,} bytes of cubin, {r['regs']} regs, {r['spills']} spills, "
              f"{r['shared'] // 1024} KiB shared, "
              f"{r['n_mma']} MMA {' '.join(r['mma']) or '-'}, {r['dp4a']} dp4a{loads}, {r['seconds']}s")
    print("all configurations compiled" if not failed else f"{failed} configuration(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
