"""Standalone GEMV (M=1, bf16, PDL): TMA bulk prefetch vs per-line prefetch, prefetch_k sweep."""
import math
import torch
import importlib
L = importlib.import_module("mk.tasks.linear")
from mk.timing import copy_bandwidth, graph_time_us

bw = copy_bandwidth()["copy_Bps"]
for K, N in [(4096, 6144), (4096, 28672), (14336, 4096)]:
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, math.ceil(400e6 / (N * K * 2))))]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ ws[0].float().T
    base = L.linear_config(1, N, K, torch.bfloat16)
    for bulk in (True, False):
        for pf in (0, 512, 1024, 2048):
            L.PREFETCH_BULK = bulk
            cfg = L.LinearConfig(**{**base.to_dict(), "prefetch_k": pf})
            y = L.linear(x, ws[0], config=cfg)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            us = graph_time_us([lambda w=w: L.linear(x, w, config=cfg) for w in ws] * (40 // len(ws) + 1))
            print(f"{K}->{N} bulk={bulk} pf={pf}: {us:.2f} us, {N*K*2/(us*1e-6)/bw:.3f} of copy, err {err:.4f}", flush=True)
