
Measured on an H100 (bench/NOTES.md, session 23): none 253, proxy 252, cta 252, gpu 895, use
559 cycles. The block cannot answer its question: with no fence the second clock read already
waits for the load (253 cycles is a round trip), so the fences' figures say nothing about loads
in flight. The decode step compiled without the proxy-fence pass answered it instead (1%).
"""GPU probe: does the TMA ring's per-chunk proxy fence wait for a global load in flight?

Triton's pipelined TMA loop (the GEMV streams of mk.tasks.linear.linear_run) issues
``fence.proxy.async.shared::cta`` (SASS: MEMBAR.ALL.CTA) every iteration before it reuses a
ring slot, and ptxas places the iteration's x look-ahead load before that fence (the sm_90
SASS of the 1B QKV task, bench/NOTES.md session 22). If the fence waits for the load, every
iteration pays an L2 round trip, whatever the look-ahead.

One program a warp times, with %clock64 around one PTX block: a global load of a line
another address away each repetition (so it misses L1), then the fence under test, then the
second clock read; the load's value is used after the block. Variants: ``none`` (no fence),
``proxy`` (fence.proxy.async.shared::cta), ``cta`` (membar.cta), ``gpu`` (membar.gl), ``use``
(a second load that needs the first's value: a full round trip, for scale), and a cp.async
(as the pipeliner issues for the RMSNorm weights) followed by no fence or the proxy fence. Prints cycles
(median over programs and repetitions); writes $OUT/fence_probe.json.

Measured on an H100 (bench/NOTES.md, session 23): none 253, proxy 252, cta 252, gpu 895, use
559 cycles. The block cannot answer its question: with no fence the second clock read already
waits for the load (253 cycles is a round trip), so the fences' figures say nothing about loads
in flight. The decode step compiled without the proxy-fence pass answered it instead (1%).
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

FENCES = {"none": "", "proxy": "fence.proxy.async.shared::cta;", "cta": "membar.cta;", "gpu": "membar.gl;"}


def timed_block(fence: str, use_first: bool) -> str:
    """PTX: $0 = cycles from before the load to after the fence (or the load's use)."""
    # "use": a second load whose address depends on the first's value (0): it issues only once
    # the first returns, so the clock after it measures a round trip.
    wait = ("cvt.u64.u32 d, v;\n add.u64 d, d, $1;\n ld.volatile.global.u32 w, [d];" if use_first
            else fence)
    return ("{\n .reg .u64 t0, t1, d;\n .reg .u32 v, w;\n mov.u32 w, 0;\n mov.u64 t0, %clock64;\n"
            f" ld.volatile.global.u32 v, [$1];\n {wait}\n mov.u64 t1, %clock64;\n sub.u64 t1, t1, t0;\n"
            " cvt.u32.u64 $0, t1;\n add.u32 v, v, w;\n add.u32 $0, $0, v;\n sub.u32 $0, $0, v;\n}")


@triton.jit
def timed_loads(src_ptr, out_ptr, ASM: tl.constexpr, REPS: tl.constexpr, STRIDE: tl.constexpr):
    pid = tl.program_id(0)
    for r in tl.static_range(REPS):
        ptr = src_ptr + (pid * REPS + r) * STRIDE
        cycles = tl.inline_asm_elementwise(ASM, "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + pid * REPS + r, cycles)


def timed_cp_async(fence: str) -> str:
    """PTX: $0 = cycles from before a 4-byte cp.async (global -> shared offset 0, which this
    probe's kernel uses for nothing else) to after the fence; the copy is waited for after."""
    return ("{\n .reg .u64 t0, t1;\n .reg .u32 s;\n mov.u32 s, 0;\n mov.u64 t0, %clock64;\n"
            " cp.async.ca.shared.global [s], [$1], 4;\n cp.async.commit_group;\n"
            f" {fence}\n mov.u64 t1, %clock64;\n cp.async.wait_all;\n sub.u64 t1, t1, t0;\n"
            " cvt.u32.u64 $0, t1;\n}")


def main() -> None:
    programs, reps, stride = 264, 16, 64  # 64 int32 = 256 bytes: a new line every load
    src = torch.zeros(programs * reps * stride, dtype=torch.int32, device="cuda")
    out = {}
    cases = [(name, timed_block(fence, use_first=False)) for name, fence in FENCES.items()]
    cases.append(("use", timed_block("", use_first=True)))
    # The pipeliner's cp.async of loop operands (RMSNorm weights) before the next fence.
    cases += [("cp.async " + name, timed_cp_async(FENCES[name])) for name in ("none", "proxy")]
    for name, asm in cases:
        cycles = torch.empty(programs * reps, dtype=torch.int32, device="cuda")
        for _ in range(2):  # the second launch finds src in L2
            timed_loads[(programs,)](src, cycles, ASM=asm, REPS=reps, STRIDE=stride, num_warps=1)
            torch.cuda.synchronize()
        torch.cuda.synchronize()
        out[name] = float(cycles.float().median())
        print(f"{name:>14}: {out[name]:7.0f} cycles", flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("MK_COMMIT"), "cycles": out}
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "fence_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
