"""GPU probe: the megakernel on chained GEMVs (issue 3's benchmarks) over tile shapes,
warps, workers per SM and weight prefetch, against torch.mv and mk's own linear launches
replayed from a CUDA graph. Prints per-layer µs; JSON to $OUT/megakernel_probe.json."""
import json, os, sys, time
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _harness import gemv_chain, gemv_chain_ref  # noqa: E402
from mk.persistent.graph import lower  # noqa: E402
from mk.persistent.runtime import Megakernel  # noqa: E402
from mk.tasks.linear import linear  # noqa: E402
from mk.timing import capture_graph, copy_bandwidth, event_time_us, graph_time_us  # noqa: E402

sms = torch.cuda.get_device_properties(0).multi_processor_count
bw = copy_bandwidth()["copy_Bps"]
print(f"copy {bw/1e12:.3f} TB/s, {sms} SMs", flush=True)
rows = []
# (block_n, block_k, warps, workers per SM, prefetch_k, tma_stages)
CASES = {
    (64, 2048): [(8, 2048, 4, 2, 2048, 0), (8, 2048, 4, 2, 0, 0), (16, 256, 4, 2, 0, 4), (32, 256, 4, 2, 0, 4),
                 (16, 256, 4, 2, 2048, 4), (8, 256, 4, 2, 0, 4)],
    (16, 8192): [(32, 256, 4, 2, 1024, 4), (32, 256, 4, 2, 0, 4), (16, 256, 4, 2, 0, 4)],
}
VARIANTS = [dict(defer_signals=True), dict(defer_signals=False), dict(defer_signals=False, backoff_ns=100),
            dict(defer_signals=True, backoff_ns=100)]
if os.environ.get("PROBE_QUICK"):
    VARIANTS = [dict(defer_signals=True)]
# Lowering variants: at most this many producers per event counter (None: one per consumer set).
for (layers, n), configs in CASES.items():
    g0, ws, x, _ = gemv_chain(layers, n, block_n=2)
    ref = gemv_chain_ref(ws, x)
    nbytes = n * n * 2
    hs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(layers + 1)]
    hs[0].copy_(x[0])
    t_torch = graph_time_us([lambda l=l: torch.mv(ws[l], hs[l], out=hs[l + 1]) for l in range(layers)])
    hm = [x] + [None] * layers

    def mk_ops():
        h = x
        for w in ws:
            h = linear(h, w)
        return h
    t_ops = graph_time_us([mk_ops]) / layers
    print(f"{layers}x{n}: torch.mv {t_torch:.2f} us/layer ({nbytes/(t_torch*1e-6)/bw:.3f} of copy), "
          f"mk linear launches {t_ops:.2f}", flush=True)
    rows.append(dict(layers=layers, n=n, provider="torch", us_per_layer=t_torch))
    rows.append(dict(layers=layers, n=n, provider="mk_ops", us_per_layer=t_ops))
    for (bn, bk, warps, wps, pf, tma), var in [(c, v) for c in configs for v in VARIANTS]:
        try:
            t0 = time.time()
            g, _, _, out = gemv_chain(layers, n, weights=ws, x=x, block_n=bn, block_k=bk, num_warps=warps,
                                      prefetch_k=pf, tma_stages=tma)
            prog = lower(g, num_workers=sms * wps)
            t_lower = time.time() - t0
            k = Megakernel(prog, **var)
            res = k.residency()
            if prog.num_workers > res.max_workers:
                print("skip", bn, bk, warps, wps, pf, tma, "max workers", res.max_workers, flush=True)
                continue
            k.run()
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            graph = capture_graph([k.launch] * 3)
            us = event_time_us(graph.replay, reps=10, warmup=2) / 3 / layers
            k.check()
            r = dict(layers=layers, n=n, provider="mk", bn=bn, bk=bk, warps=warps, workers=prog.num_workers,
                     prefetch_k=pf, tma_stages=tma, **var, us_per_layer=us, vs_torch=t_torch / us, frac_of_copy=nbytes / (us * 1e-6) / bw,
                     err=err, regs=res.n_regs, smem=res.shared_bytes, lower_s=t_lower, tasks=len(g.tasks))
            rows.append(r)
            print({a: round(b, 3) if isinstance(b, float) else b for a, b in r.items()}, flush=True)
            del k, g, prog
        except Exception as e:
            print("fail", bn, bk, warps, wps, pf, tma, repr(e)[:400], flush=True)
    del ws, g0
json.dump({"device": torch.cuda.get_device_name(), "copy_Bps": bw, "rows": rows},
          open(os.path.join(os.environ.get("OUT", "."), "megakernel_probe.json"), "w"), indent=1)
