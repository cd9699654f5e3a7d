"""GPU probe: how fast the megakernel streams one wide GEMV (the 1B LM head's shape,
128256 x 2048 bf16, 525 MB) under each TMA box and ring, with one tile a task or runs of
adjacent tiles (one run a worker). Aggregate GB/s against the copy bandwidth of the same
run; each output checked against torch. Env: PROBE_N, PROBE_K, PROBE_M (x rows: 1 the GEMV
body, 2..16 the decode tl.dot tiles), PROBE_WARPS (default: linear_config's), PROBE_NORM=1 (an RMSNorm prologue, as the LM head
has), PROBE_CASES (indices into CASES, comma list) or PROBE_SPEC (cases as
``BNxBKrRING[run]``, comma list, e.g. ``64x128r4,64x128r4run``). Writes
$OUT/run_stream_probe.json and prints a table last."""
import json, os, sys, time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _harness import back_to_back_ms  # noqa: E402
from mk.persistent.graph import TaskGraph, lower  # noqa: E402
from mk.persistent.ops import make_op  # noqa: E402
from mk.persistent.runtime import Megakernel  # noqa: E402
from mk.persistent.taskops import linear_tiles  # noqa: E402
from mk.timing import copy_bandwidth  # noqa: E402

N, K = int(os.environ.get("PROBE_N", 128256)), int(os.environ.get("PROBE_K", 2048))
M = int(os.environ.get("PROBE_M", 1))
WARPS = int(os.environ["PROBE_WARPS"]) if os.environ.get("PROBE_WARPS") else None
# (block_n, block_k, ring, runs)
CASES = [(32, 256, 4, False), (16, 256, 4, False), (8, 256, 4, False),
         (32, 256, 4, True), (16, 256, 4, True), (8, 256, 4, True), (64, 256, 3, True), (64, 128, 4, True),
         (128, 64, 4, True), (16, 256, 8, True), (8, 256, 8, True), (32, 128, 6, True)]


NORM = os.environ.get("PROBE_NORM", "0") == "1"
if os.environ.get("PROBE_CASES"):
    CASES = [CASES[int(i)] for i in os.environ["PROBE_CASES"].split(",")]
if os.environ.get("PROBE_SPEC"):
    CASES = []
    for spec in os.environ["PROBE_SPEC"].split(","):
        box, ring = spec.removesuffix("run").split("r")
        bn, bk = box.split("x")
        CASES.append((int(bn), int(bk), int(ring), spec.endswith("run")))


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    workers = 2 * sms
    bw = copy_bandwidth()["copy_Bps"]
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, K, device="cuda", dtype=torch.float32)
    nw = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.float() if NORM else x
    ref = h.double() @ w.double().T
    rows = []
    for bn, bk, ring, runs in CASES:
        t0 = time.time()
        try:
            tiles = -(-N // bn)
            run = -(-tiles // workers) if runs else 1
            g = TaskGraph()
            g.buffer("x", x), g.buffer("w", w), g.buffer("y", torch.full((M, N), float("nan"), device="cuda"))
            g.buffer("nw", nw)
            op = make_op("linear", M=M, N=N, K=K, block_m=1 if M == 1 else 16, block_n=bn, block_k=bk, tma_stages=ring, tiles_per_task=run,
                         num_warps=WARPS, norm=NORM, eps=1e-5, dtype=torch.bfloat16)
            for a in linear_tiles(op):
                g.add(op, x="x", w="w", out="y", **({"norm_w": "nw"} if NORM else {}), **a)
            k = Megakernel(lower(g, workers))
            k.run()
            torch.cuda.synchronize()
            err = ((g.buffers["y"].double() - ref).norm() / ref.norm()).item()
            ms = back_to_back_ms(k.launch, reps=20, warmup=3)
            k.check()
            res = k.residency()
            r = dict(block_n=bn, block_k=bk, ring=ring, tiles_per_task=run, tasks=len(g.tasks), ms=ms,
                     GBps=N * K * 2 / ms / 1e6, frac_of_copy=N * K * 2 / (ms * 1e-3) / bw, err=err,
                     regs=res.n_regs, spills=res.n_spills, smem=res.shared_bytes, build_s=time.time() - t0)
            del k, g
        except Exception as e:  # noqa: BLE001
            r = dict(block_n=bn, block_k=bk, ring=ring, runs=runs, error=repr(e)[-600:])
        rows.append(r)
        print({a: round(b, 4) if isinstance(b, float) else b for a, b in r.items()}, flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("MK_COMMIT"),
               "M": M, "N": N, "K": K, "norm": NORM, "workers": workers, "copy_Bps": bw, "rows": rows},
              open(os.path.join(os.environ.get("OUT", "."), "run_stream_probe.json"), "w"), indent=1)
    print(f"\n{M} x {N}x{K} bf16 linear{' with RMSNorm' if NORM else ''}, {workers} workers, copy {bw / 1e12:.2f} TB/s")
    print("box      ring run  tasks   ms      frac  err")
    for r in rows:
        if "error" in r:
            print(r["block_n"], r["block_k"], r["ring"], "ERROR", r["error"][-200:])
            continue
        print(f"{r['block_n']:>3}x{r['block_k']:<4} {r['ring']:>3} {r['tiles_per_task']:>3} {r['tasks']:>6} "
              f"{r['ms']:.4f} {r['frac_of_copy']:.3f} {r['err']:.1e}")


if __name__ == "__main__":
    main()
