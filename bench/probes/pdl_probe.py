"""GPU probe: GEMV (M=1, bf16) with and without programmatic dependent launch (PDL) and
L2 prefetch of each tile's first weight columns before the dependency wait.

Timed as bench/ times it (CUDA-graph replays over rotating weight copies); prints per
shape the configs by speed with their fraction of the copy bandwidth of the same run.
"""
import itertools, json, math, os
import torch
from mk.tasks.linear import LinearConfig, linear, linear_config
from mk.timing import copy_bandwidth, graph_time_us

bw = copy_bandwidth()["copy_Bps"]
print(f"copy {bw/1e12:.3f} TB/s", flush=True)
rows = []
for K, N in [(4096, 6144), (4096, 28672), (14336, 4096)]:
    nbytes = N * K * 2
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, math.ceil(400e6 / nbytes)))]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ ws[0].float().T
    base = linear_config(1, N, K, torch.bfloat16)
    tiles = [(base.block_n, base.block_k, base.num_warps), (4, 1024, 2), (8, 512, 2), (16, 512, 4), (2, 2048, 2)]
    res = []
    for (bn, bk, nw), pf, pdl in itertools.product(dict.fromkeys(tiles), [0, 512, 1024, K], [False, True]):
        os.environ["MK_PDL"] = "1" if pdl else "0"
        cfg = LinearConfig(1, bn, bk, 1, nw, 1, prefetch_k=pf)
        try:
            y = linear(x, ws[0], config=cfg)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            us = graph_time_us([lambda w=w: linear(x, w, config=cfg) for w in ws] * (40 // len(ws) + 1))
        except Exception as e:
            print("fail", K, N, bn, bk, nw, pf, pdl, repr(e)[:300], flush=True)
            continue
        res.append(dict(K=K, N=N, bn=bn, bk=bk, warps=nw, prefetch_k=pf, pdl=pdl, us=us,
                        frac=(nbytes + 2 * (K + N)) / (us * 1e-6) / bw, err=err))
    res.sort(key=lambda r: r["us"])
    for r in res[:8]:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    for r in res:
        if (r["bn"], r["bk"], r["warps"]) == (base.block_n, base.block_k, base.num_warps) and r["prefetch_k"] in (0, 1024):
            print("default tile", {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    rows += res
    del ws
os.environ["MK_PDL"] = "1"
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_Bps": bw, "rows": rows},
          open(os.path.join(os.environ.get("OUT", "."), "pdl_probe.json"), "w"), indent=1)
