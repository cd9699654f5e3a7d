"""GPU sweep of linear configs at M=8 (bf16, tl.dot body with 16-row tiles), timed as bench/
times them; the winners become linear_config's skinny defaults."""
import itertools, json, math, os
import torch
import importlib
L = importlib.import_module("mk.tasks.linear")
from mk.timing import copy_bandwidth, graph_time_us

bw = copy_bandwidth()["copy_Bps"]
print(f"copy {bw/1e12:.3f} TB/s", flush=True)
rows = []
for K, N in [(4096, 6144), (4096, 28672), (14336, 4096)]:
    nbytes = N * K * 2
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, math.ceil(400e6 / nbytes)))]
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ ws[0].float().T
    t_torch = graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws] * (40 // len(ws) + 1))
    res = []
    for bn, bk, nw, st, sk in itertools.product([16, 32, 64], [64, 128, 256], [2, 4], [3, 4, 6], [1, 2]):
        if st * (16 + bn) * bk * 2 > 200 * 1024:
            continue
        cfg = L.LinearConfig(16, bn, bk, sk, nw, st)
        try:
            y = L.linear(x, ws[0], config=cfg)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            us = graph_time_us([lambda w=w: L.linear(x, w, config=cfg) for w in ws] * (40 // len(ws) + 1))
        except Exception as e:
            print("fail", bn, bk, nw, st, sk, repr(e)[:200], flush=True)
            continue
        res.append(dict(K=K, N=N, bn=bn, bk=bk, warps=nw, stages=st, split_k=sk, us=us,
                        frac=nbytes / (us * 1e-6) / bw, vs_torch=t_torch / us, err=err))
    res.sort(key=lambda r: r["us"])
    print(f"{K}->{N} torch {t_torch:.2f} us ({nbytes/(t_torch*1e-6)/bw:.3f})", flush=True)
    for r in res[:6]:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    rows += res
    del ws
json.dump({"device": torch.cuda.get_device_name(), "copy_Bps": bw, "rows": rows},
          open(os.path.join(os.environ.get("OUT", "."), "skinny_sweep.json"), "w"), indent=1)
