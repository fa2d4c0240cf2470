"""
Occupancy of an NVIDIA SM and bytes in flight, for reading kernels/cross_compile.py's reports
without a GPU.

Little's law: a memory system delivers bandwidth = bytes in flight / latency, so streaming the
weights at an H100's copy bandwidth needs about 15.5 KiB in flight per SM (issue 47's figure). A
kernel has in flight what its resident programs have issued and not yet used: programs per SM
(registers, threads, blocks, shared memory: the CUDA occupancy rules) times the bytes one program's
K step loads.
Test: python -m pytest tests/test_cross_compile.py -k occupancy
"""


def occupancy(regs, threads, shared, target):
    """Programs (thread blocks) one SM holds at once, from the per-SM limits of the target (sm_80
    A100, sm_90 H100): 64K registers allocated per warp in units of 256 (regs rounded up to 8 per
    thread), 2048 threads, 32 blocks, shared memory (164 / 227 KiB, 1 KiB reserved per block)."""
    smem = {"sm_80": 164 * 1024, "sm_90": 227 * 1024}[target]
    warps = -(-threads // 32)
    by_regs = 65536 // (warps * 32 * (-(-max(regs, 1) // 8) * 8))
    by_smem = smem // (shared + 1024)
    return max(0, min(by_regs, 2048 // threads, 32, by_smem))


SMS_OF = {"sm_80": 108, "sm_90": 132}  # an A100's SMs, an H100's


def in_flight(r, grid, step_bytes):
    """Weight bytes in flight per SM (Little's law: bandwidth = bytes in flight / latency): the
    programs resident on one SM at once (occupancy, and no more than the grid gives it) times the
    weight bytes one program's K step issues before it waits (num_stages - 1 steps ahead when the
    loop is software-pipelined)."""
    per_sm = min(r["occupancy"], -(-grid // SMS_OF[r["target"]]))
    return per_sm * step_bytes * max(1, r["num_stages"] - 1)

