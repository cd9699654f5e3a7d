"""GPU sweep of mk.tasks.linear configs at M=1 (bf16), timed as bench/ times them.

Prints per shape the fastest configs with their fraction of the copy bandwidth measured
in the same run; the winners become linear_config's defaults.
"""
import itertools, json, math, os
import torch
from mk.tasks.linear import LinearConfig, linear
from mk.timing import copy_bandwidth, graph_time_us

bw = copy_bandwidth()["copy_Bps"]
print(f"copy {bw/1e12:.3f} TB/s")
rows = []
for K, N in [(4096, 6144), (4096, 28672), (14336, 4096), (2048, 2048), (2048, 8192)]:
    nbytes = N * K * 2
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, math.ceil(400e6 / nbytes)))]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ ws[0].float().T
    res = []
    for bn, bk, nw, sk in itertools.product([2, 4, 8, 16], [256, 512, 1024, 2048], [2, 4, 8], [1, 2]):
        if bn * bk > 16384 or bk > K or bk < 8 * 32 * nw // 2:
            continue
        cfg = LinearConfig(block_m=1, block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=1)
        try:
            y = linear(x, ws[0], config=cfg)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            us = graph_time_us([lambda w=w: linear(x, w, config=cfg) for w in ws] * (40 // len(ws) + 1))
        except Exception:
            continue
        res.append(dict(K=K, N=N, bn=bn, bk=bk, warps=nw, split_k=sk, us=us, frac=nbytes / (us * 1e-6) / bw, err=err))
    res.sort(key=lambda r: r["us"])
    for r in res[:5]:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
    rows += res
    del ws
json.dump({"device": torch.cuda.get_device_name(), "copy_Bps": bw, "rows": rows},
          open(os.path.join(os.environ.get("OUT", "."), "linear_sweep.json"), "w"), indent=1)
