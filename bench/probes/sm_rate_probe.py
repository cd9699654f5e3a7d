"""GPU probe: does a worker's DRAM streaming rate depend on which SM it runs on?

The 1B step's traces show the phases' last tasks ending 2-2.5 us after the mean task
(gate_up, down), and the same workers late layer after layer. This launches a grid of
``2 x SMs`` programs (as the megakernel does), each streaming its own slice of a bf16
weight buffer through a TMA ring (as a GEMV task does) and recording its SM, start and end.
Per SM, over many launches: the mean lateness of its programs' ends against the launch's
mean end, and whether the ranking holds between the first and second half of the launches
(a correlation near 1: a property of the SM; near 0: noise).

Env: PROBE_SLICE_KIB (per program, default 256: a gate_up task), PROBE_LAUNCHES (40),
PROBE_OUT (JSON path).
"""
import json
import math
import os
import statistics as st

import torch
import triton
import triton.language as tl

from mk.persistent.sync import now_ns, sm_id


@triton.jit
def stream_kernel(w_ptr, sink_ptr, times_ptr, rows_per, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr):
    pid = tl.program_id(0)
    t0 = now_ns(True)
    desc = tl.make_tensor_descriptor(w_ptr, shape=[rows_per * tl.num_programs(0), K], strides=[K, 1],
                                     block_shape=[BLOCK_N, BLOCK_K])
    n_k = K // BLOCK_K
    n = (rows_per // BLOCK_N) * n_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in tl.range(0, n, num_stages=STAGES):
        r = pid * rows_per + (i // n_k) * BLOCK_N
        acc += desc.load([r, (i % n_k) * BLOCK_K]).to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(acc))
    t1 = now_ns(True)
    tl.store(times_ptr + pid * 3, t0)
    tl.store(times_ptr + pid * 3 + 1, t1)
    tl.store(times_ptr + pid * 3 + 2, sm_id(True).to(tl.int64))


def _corr(a, b):
    ma, mb = st.mean(a), st.mean(b)
    num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return num / den if den else 0.0


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = 2 * sms
    K, block_n, block_k = 2048, 32, 256
    slice_bytes = int(os.environ.get("PROBE_SLICE_KIB", "256")) * 1024
    rows_per = slice_bytes // (K * 2)
    launches = int(os.environ.get("PROBE_LAUNCHES", "40"))
    w = torch.randn(rows_per * programs, K, device="cuda", dtype=torch.bfloat16)
    sink = torch.zeros(programs, device="cuda")
    times = torch.zeros(programs * 3, dtype=torch.int64, device="cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    late_by_sm = {}
    dur_by_sm = {}
    start_spread, end_spread = [], []
    for it in range(launches + 2):
        flush.zero_()  # weights come from DRAM, as in the step
        stream_kernel[(programs,)](w, sink, times, rows_per, K, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=4)
        torch.cuda.synchronize()
        if it < 2:
            continue
        t = times.view(-1, 3).tolist()
        ends = [e for _, e, _ in t]
        mean_end = st.mean(ends)
        start_spread.append((max(s for s, _, _ in t) - min(s for s, _, _ in t)) / 1e3)
        end_spread.append((max(ends) - mean_end) / 1e3)
        for s, e, sm in t:
            late_by_sm.setdefault(sm, []).append((e - mean_end) / 1e3)
            dur_by_sm.setdefault(sm, []).append((e - s) / 1e3)
    # each SM has two programs a launch: halves of the launches, each SM's mean lateness
    half = len(next(iter(late_by_sm.values()))) // 2
    first = [st.mean(v[:half]) for v in late_by_sm.values()]
    second = [st.mean(v[half:]) for v in late_by_sm.values()]
    per_sm = sorted(((sm, st.mean(v), st.mean(dur_by_sm[sm])) for sm, v in late_by_sm.items()), key=lambda r: -r[1])
    out = {
        "device": torch.cuda.get_device_name(), "sms": sms, "programs": programs, "slice_kib": slice_bytes // 1024,
        "launches": launches, "sms_seen": len(late_by_sm),
        "max_minus_mean_end_us": st.mean(end_spread), "start_spread_us": st.mean(start_spread),
        "mean_duration_us": st.mean(x for v in dur_by_sm.values() for x in v),
        "sm_lateness_corr_halves": _corr(first, second),
        "slowest_sms": [{"sm": sm, "late_us": round(l, 3), "dur_us": round(d, 3)} for sm, l, d in per_sm[:16]],
        "fastest_sms": [{"sm": sm, "late_us": round(l, 3), "dur_us": round(d, 3)} for sm, l, d in per_sm[-8:]],
        "late_by_sm_id": {sm: round(st.mean(v), 3) for sm, v in sorted(late_by_sm.items())},
    }
    print(json.dumps({k: v for k, v in out.items() if k != "late_by_sm_id"}, indent=1))
    path = os.environ.get("PROBE_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
