"""
Compile every Triton kernel configuration of kernels/ternary_matmul.py for real GPU targets, on a machine
without a GPU, and read what came out. Triton lowers a kernel to PTX with its bundled LLVM and assembles it with
its bundled ptxas, for any target named by hand (GPUTarget("cuda", 80, 32): Ampere, sm_80; 90: Hopper, sm_90),
and nothing is launched. The interpreter (TRITON_INTERPRET=1), which the kernel tests use on CPU, runs the
kernels as NumPy and never meets the compiler, so a kernel that cannot compile for a GPU passes there; this
catches it, and reports per kernel what only the compiled code shows:

    regs     registers per thread, spills (STL/LDL instructions in the SASS: local memory), shared memory
    mma      integer MMA instructions in the PTX (mma.sync ... .s8 on sm_80, wgmma ... .s8 on sm_90): prefill,
             and decode-mma (M <= 16 rows on tensor cores, the weight words unpacked in registers)
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

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import ternary_matmul as tm
from kernels.occupancy import SMS_OF, in_flight, occupancy  # noqa: F401

TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32)}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")  # Triton's ptxas, cuobjdump
# as a launch on model shapes specialises them: multiples of 16
ALIGNED = ("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "out_ptr", "xq_ptr", "g_ptr", "N", "K", "KW",
           "stride_xm", "stride_wn", "stride_om", "stride_x")
DECODE_ARGS = dict(x_ptr="*i32", xs_ptr="*fp32", w_ptr="*i32", ws_ptr="*fp32", out_ptr="*bf16",
                   M="i32", N="i32", KW="i32", stride_xm="i32", stride_wn="i32", stride_om="i32",
                   stride_ws="i32", BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_G="constexpr",
                   DP4A="constexpr", WRITE_ACC="constexpr", ROWS_FIRST="constexpr")
PREFILL_ARGS = dict(x_ptr="*i8", xs_ptr="*fp32", w_ptr="*i8", ws_ptr="*fp32", out_ptr="*bf16",
                    M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_om="i32",
                    stride_ws="i32", BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr",
                    GROUP_M="constexpr", WRITE_ACC="constexpr")
DECODE_MMA_ARGS = dict(x_ptr="*i8", xs_ptr="*fp32", w_ptr="*i32", ws_ptr="*fp32", out_ptr="*bf16",
                       M="i32", N="i32", KW="i32", stride_xm="i32", stride_wn="i32", stride_om="i32",
                       stride_ws="i32", BLOCK_N="constexpr", BLOCK_G="constexpr", WRITE_ACC="constexpr")
UNPACK_ARGS = dict(w_ptr="*i32", out_ptr="*i32", N="i32", KW="i32", stride_wn="i32",
                   BLOCK_N="constexpr", BLOCK_G="constexpr")
TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")


def _decode(name, cfg, out="*bf16", dp4a=True, write_acc=False, block_m=1, rows_first=None):
    """A decode configuration; M = 1 is specialised (constexpr) as a launch with one row specialises
    it. rows_first: the tile's axis order, by default the one the host launches with."""
    consts = dict(
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_G=cfg["BLOCK_G"],
        DP4A=dp4a,
        WRITE_ACC=write_acc,
        ROWS_FIRST=tm.DECODE_ROWS_FIRST if rows_first is None else rows_first,
    )
    sig = dict(DECODE_ARGS, out_ptr=out)
    if block_m == 1:
        consts["M"], sig["M"] = 1, "constexpr"
    return dict(
        name=name,
        kind="decode",
        kernel=tm._decode_kernel,
        signature=sig,
        constexprs=consts,
        options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        block_m=block_m,
    )


def _prefill(name, cfg, out="*bf16", write_acc=False):
    consts = dict({k: cfg[k] for k in TILE}, WRITE_ACC=write_acc)
    return dict(name=name, kind="prefill", kernel=tm._prefill_kernel, signature=dict(PREFILL_ARGS, out_ptr=out),
                constexprs=consts, options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def jobs(target):
    """Every configuration the host wrappers can launch on this target (dicts: name, kind, kernel, signature,
    constexprs, options)."""
    arch = target.arch // 10
    out = [
        _decode(f"decode {key}", cfg)
        for key, cfg in tm.DECODE_CONFIGS.items()
        if not key.startswith("rows")
    ]
    for bm in (2, 4, tm.DECODE_BLOCK_M):
        out.append(_decode(f"decode rows M={bm}", tm.DECODE_CONFIGS["rows"], block_m=bm))
    # the axis order the installed Triton does not want (tm.DECODE_ROWS_FIRST): what it costs in the K loop
    out.append(_decode("decode rows M=4, the other axis order", tm.DECODE_CONFIGS["rows"], block_m=4,
                       rows_first=not tm.DECODE_ROWS_FIRST))
    c = tm.DECODE_MMA_CONFIG
    out.append(dict(name="decode-mma M<=16", kind="decode-mma", kernel=tm._decode_mma_kernel, signature=DECODE_MMA_ARGS,
                    constexprs=dict(BLOCK_N=c["BLOCK_N"], BLOCK_G=c["BLOCK_G"], WRITE_ACC=False),
                    options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]), block_m=16))
    cfg = tm.DECODE_CONFIGS["long-wide"]
    out.append(_decode("decode long-wide fp32 out", cfg, out="*fp32"))
    out.append(_decode("decode long-wide int32 acc", cfg, out="*i32", write_acc=True))
    out.append(_decode("decode long-wide pure-Triton dp4a", cfg, dp4a=False))  # the interpreter's form, compiled
    for M, cls in ((64, "short"), (2048, "tall")):
        for K, steps in ((4096, "many K steps"), (128, "one K step")):
            out.append(_prefill(f"prefill sm_{arch}x {cls}, {steps}", tm.prefill_config(M, K, arch)))
    cfg = tm.prefill_config(2048, 4096, arch)
    out.append(_prefill(f"prefill sm_{arch}x tall fp32 out", cfg, out="*fp32"))
    out.append(_prefill(f"prefill sm_{arch}x tall int32 acc", cfg, out="*i32", write_acc=True))
    u = tm.UNPACK_CONFIG
    out.append(dict(name="unpack", kind="unpack", kernel=tm._unpack_kernel, signature=UNPACK_ARGS,
                    constexprs=dict(BLOCK_N=u["BLOCK_N"], BLOCK_G=u["BLOCK_G"]),
                    options=dict(num_warps=u["num_warps"], num_stages=u["num_stages"])))
    for dt, block, one_pass in (("fp32", 1024, True), ("bf16", 8192, False), ("fp16", 4096, True)):
        sig = dict(x_ptr=f"*{dt}", xq_ptr="*i8", xs_ptr="*fp32", K="i32", stride_x="i32", BLOCK_K="constexpr",
                   ONE_PASS="constexpr")
        out.append(dict(name=f"quantize {dt} {'one pass' if one_pass else 'two loops'}", kind="quantize",
                        kernel=tm._quantize_activations_kernel, signature=sig,
                        constexprs=dict(BLOCK_K=block, ONE_PASS=one_pass),
                        options=dict(num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)))
    # K = 1: a GPU launch passes an int argument equal to 1 as a constant (Triton's specialisation), which the
    # interpreter never does: the kernel must compile with K a plain int too
    for dt, K in (("fp32", 576), ("bf16", 4096), ("bf16", 11008), ("fp32", 1)):
        st = tm.norm_quant_settings(K)
        sig = dict(
            x_ptr=f"*{dt}",
            g_ptr=f"*{dt}",
            xq_ptr="*i8",
            xs_ptr="*fp32",
            K="constexpr" if K == 1 else "i32",
            stride_x="i32",
            eps="fp32",
            BLOCK_K="constexpr",
            ONE_PASS="constexpr",
            BF16="constexpr",
        )
        out.append(
            dict(
                name=f"rmsnorm+quantize {dt} K={K}",
                kind="quantize",
                kernel=tm._rmsnorm_quant_kernel,
                signature=sig,
                constexprs=dict(BLOCK_K=st["BLOCK_K"], ONE_PASS=st["ONE_PASS"], BF16=dt == "bf16",
                                **({"K": 1} if K == 1 else {})),
                options=dict(num_warps=st["num_warps"], enable_fp_fusion=False),
            )
        )
    return out


def compile_one(kernel, signature, constexprs, options, target):
    """The compiled kernel (its .asm holds ttir, ttgir, llir, ptx and cubin); raises if it does not compile."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's kernels are not compilable objects
        sys.exit("kernels.cross_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)")
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


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][\w.]*)([^;]*);")


def sass_instructions(sass):
    """[(address, opcode, operands)] of the SASS listing."""
    return [(int(a, 16), op, rest.strip()) for a, op, rest in _SASS.findall(sass)]


def k_loop(sass):
    """The instructions of the K loop: the shortest backward branch's body that holds a global load
    (LDG, or LDGSTS where the loop copies into shared memory). [] when the kernel has no such
    loop."""
    ins = sass_instructions(sass)
    loops = []
    for addr, op, rest in ins:
        t = re.match(r"0x([0-9a-f]+)", rest)
        if op == "BRA" and t and int(t.group(1), 16) < addr:
            body = [i for i in ins if int(t.group(1), 16) <= i[0] <= addr]
            if any(i[1].startswith(("LDG", "LDGSTS")) for i in body):
                loops.append(body)
    return min(loops, key=len) if loops else []


# (N, K): lab.bench's
SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (576, 576), (1536, 576), (576, 1536))


def decode_flight(reports, N, K, target="sm_90"):
    """The M = 1 decode launch of an (N, K) weight on target, from the compiled reports: {config,
    grid, occupancy, step_bytes (weight bytes one program's K step loads), in_flight (per SM,
    Little's law), need (the smaller of 15.5 KiB, what an H100 needs for its copy bandwidth at its
    DRAM latency, and the whole matrix over the SMs)}."""
    key = tm.decode_config(N, K)
    r = next(r for r in reports if r["target"] == target and r["name"] == f"decode {key}")
    cfg, KW = tm.DECODE_CONFIGS[key], (K + 15) // 16
    grid = -(-N // cfg["BLOCK_N"])
    step = cfg["BLOCK_N"] * min(cfg["BLOCK_G"], KW) * 4
    need = min(15.5 * 1024, N * KW * 4 / SMS_OF[target])
    return dict(config=key, grid=grid, occupancy=r["occupancy"], step_bytes=step,
                in_flight=in_flight(r, grid, step), need=round(need))


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
    loads = (
        weight_loads(ptx, k.name, 0 if job["kind"] == "unpack" else 2)
        if job["kind"] != "quantize"
        else []
    )
    c, o = job["constexprs"], job["options"]
    r = dict(name=job["name"], kind=job["kind"], regs=int(re.search(r"REG:(\d+)", res).group(1)),
             stack=int(re.search(r"STACK:(\d+)", res).group(1)),
             spills=len(re.findall(r"\b(?:STL|LDL)\b", sass)), shared=k.metadata.shared,
             mma=mma, n_mma=sum(ptx.count(m + " ") for m in mma), dp4a=ptx.count("dp4a."),
             wload_widths=sorted({w for _, w in loads}), n_wload=len(loads), wload_bytes=sum(w for _, w in loads),
             wload_pipelined=any(op.startswith("cp.async") for op, _ in loads),
             threads=32 * o["num_warps"], num_stages=o.get("num_stages", 1), cubin_bytes=len(k.asm["cubin"]))
    if job["kind"] == "prefill":
        r["tile_bytes"] = c["BLOCK_N"] * c["BLOCK_K"]  # the unpacked int8 weights of one K step
    elif job["kind"] != "quantize":
        # the weight words of one K step (unpack: of the program)
        r["tile_bytes"] = c["BLOCK_N"] * c["BLOCK_G"] * 4
    r["block_m"] = job.get("block_m", c.get("BLOCK_M"))
    r["rows_first"] = c.get("ROWS_FIRST")
    loop = k_loop(sass)
    ops = [op for _, op, _ in loop]
    r["loop_instructions"] = len(loop)
    r["loop_counts"] = {
        name: sum(op.startswith(pre) for op in ops)
        for name, pre in (
            ("shfl", "SHFL"),
            ("sts", "STS"),
            ("lds", "LDS"),
            ("dp4a", "IDP.4A"),
            ("bar", "BAR"),
            ("mma", ("IMMA", "HMMA", "HGMMA", "IGMMA")),
        )
    }
    # one-byte shared-memory stores, whole kernel
    r["sts_u8"] = len(re.findall(r"\bSTS\.(?:U8|S8)\b", sass))
    r["instructions"] = len(sass_instructions(sass))
    r["ptx_fp"] = {
        op: len(re.findall(rf"\b{re.escape(op)}\b", ptx))
        for op in ("sqrt.rn.f32", "div.rn.f32", "rsqrt.approx.f32", "sqrt.approx.f32", "fma.rn.f32", "max.f32",
                   "min.f32", "max.NaN.f32")
    }
    if job["kind"] == "unpack":  # no loop: the whole kernel, per word a thread unpacks
        r["instr_per_word"] = round(r["instructions"] / (r["tile_bytes"] / 4 / r["threads"]), 2)
    if job["kind"] in ("decode", "decode-mma", "prefill"):  # per packed word: 16 weights (prefill: 16 int8 codes)
        words = r["tile_bytes"] / (16 if job["kind"] == "prefill" else 4) / r["threads"]
        r["instr_per_word"] = round(r["loop_instructions"] / words, 2)  # per thread and K step
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
            r = dict(r, target=tname, seconds=round(time.time() - t0, 1))
            r["occupancy"] = occupancy(r["regs"], r["threads"], r["shared"], tname)
            results.append(r)
    return results


def main(argv=()):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__[__doc__.index("    python -m kernels.cross_compile "):__doc__.index("Test:")].rstrip())
        return 0
    wrong = [a for a in argv if not a.startswith("--json=")]
    if wrong:
        print(f"error: {wrong[0]}: expected --json=PATH (or --help)", file=sys.stderr)
        return 2
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
        loop = (f", K loop {r['loop_instructions']} instructions" +
                (f" ({r['instr_per_word']} a weight word)" if r.get("instr_per_word") else ""))
        print(f"{r['target']} {r['name']}: {r['cubin_bytes']:,} bytes of cubin, {r['regs']} regs, {r['spills']} spills, "
              f"{r['shared'] // 1024} KiB shared, {r['occupancy']} programs per SM{loop}, "
              f"{r['n_mma']} MMA {' '.join(r['mma']) or '-'}, {r['dp4a']} dp4a{loads}, {r['seconds']}s")
    if not failed:
        for N, K in SHAPES:
            f = decode_flight(results, N, K)
            print(f"sm_90 M=1 {N}x{K}: decode {f['config']}, {f['grid']} programs, "
                  f"{f['occupancy']} resident per SM, {f['step_bytes']:,} B a step -> "
                  f"{f['in_flight']:,} B in flight per SM (need {f['need']:,})")
    print("all configurations compiled" if not failed else f"{failed} configuration(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
