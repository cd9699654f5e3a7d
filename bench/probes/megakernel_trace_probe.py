"""GPU probe: where a megakernel GEMV chain spends its time, from its own trace.

Per config: task body time (ready -> end), wait time (start -> ready), the gap between a
layer's last signal and the next layer's first ready (barrier latency), the gap between
a worker's consecutive tasks, and per-layer time. JSON/PNG traces go to $OUT."""
import json, os, statistics as st, sys
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _harness import gemv_chain  # noqa: E402
from mk.persistent.graph import lower  # noqa: E402
from mk.persistent.runtime import Megakernel  # noqa: E402

out = os.environ.get("OUT", ".")
sms = torch.cuda.get_device_properties(0).multi_processor_count
rows = []
for (layers, n, bn, bk, warps, wps, pf, backoff) in [
        (64, 2048, 8, 2048, 8, 2, 2048, 0), (64, 2048, 8, 2048, 8, 2, 2048, 1000), (64, 2048, 16, 2048, 8, 1, 2048, 0),
        (16, 8192, 16, 512, 8, 2, 1024, 0), (16, 8192, 2, 2048, 2, 8, 1024, 0), (16, 8192, 32, 512, 8, 1, 1024, 0)]:
    g, ws, x, o = gemv_chain(layers, n, block_n=bn, block_k=bk, num_warps=warps, prefetch_k=pf)
    prog = lower(g, num_workers=sms * wps)
    k = Megakernel(prog, trace=True, backoff_ns=backoff)
    if prog.num_workers > k.residency().max_workers:
        print("skip", bn, wps, k.residency()); continue
    for _ in range(3):
        k.run()
    torch.cuda.synchronize()
    ev = k.trace_events()
    tiles = len(g.tasks) // layers
    layer_of = lambda t: t // tiles  # noqa: E731
    body = [e["end_us"] - e["ready_us"] for e in ev]
    wait = [e["ready_us"] - e["start_us"] for e in ev]
    last_end = [max(e["end_us"] for e in ev if layer_of(e["task"]) == l) for l in range(layers)]
    first_ready = [min(e["ready_us"] for e in ev if layer_of(e["task"]) == l) for l in range(layers)]
    barrier = [first_ready[l] - last_end[l - 1] for l in range(1, layers)]
    by_worker = {}
    for e in ev:
        by_worker.setdefault(e["worker"], []).append(e)
    gaps = [b["start_us"] - a["end_us"] for es in by_worker.values() for a, b in zip(es, es[1:])]
    total = max(last_end)
    r = dict(layers=layers, n=n, bn=bn, bk=bk, warps=warps, workers=prog.num_workers, backoff=backoff,
             total_us=total, per_layer_us=total / layers, body_med=st.median(body), body_max=max(body),
             wait_med=st.median(wait), barrier_med=st.median(barrier), barrier_max=max(barrier),
             gap_med=st.median(gaps) if gaps else 0, first_ready_l1=first_ready[1], last_end_l0=last_end[0],
             regs=k.residency().n_regs)
    print({a: round(b, 3) if isinstance(b, float) else b for a, b in r.items()}, flush=True)
    rows.append(r)
    tag = f"{layers}x{n}-bn{bn}-w{prog.num_workers}-b{backoff}"
    k.save_trace(os.path.join(out, f"trace-{tag}.json"), os.path.join(out, f"trace-{tag}.png") if bn == 16 else None)
    del k, g, prog, ws
json.dump(rows, open(os.path.join(out, "megakernel_trace_probe.json"), "w"), indent=1)
