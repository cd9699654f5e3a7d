"""GPU probe: shared memory of x-major batch-8 TMA linear tiles as compiled in the megakernel.

x-major decode tiles (fewer than 128 weight rows: the batch's rows are the MMA's M) stream
weights through a TMA ring with an x chunk beside each weight chunk. This compiles one
megakernel per (block_n, block_k, ring, split_k, RMSNorm prologue, residual) at the 1B
down projection's shape (8 x 2048 x 8192) and prints the shared memory each takes, against
which ``mk.planner.cost.op_smem_bytes`` is modelled (bench/NOTES.md, session 17: x's
halves are staged again only when the norm scales x in registers).
Writes $OUT/smem_xmajor.json.
"""
import json
import os

import torch

from mk.persistent.graph import TaskGraph, lower
from mk.persistent.ops import make_op
from mk.persistent.runtime import Megakernel
from mk.persistent.taskops import op_tiles

BF16 = torch.bfloat16
M, N, K = 8, 2048, 8192
# (block_n, block_k, ring, split_k, norm, residual)
CASES = [(64, 128, 3, 8, False, False), (64, 128, 2, 8, False, False), (64, 256, 4, 2, False, False),
         (32, 256, 2, 1, False, False), (64, 64, 3, 8, False, False), (64, 128, 3, 1, False, True),
         (64, 128, 3, 2, True, False), (32, 128, 3, 4, False, False)]


def compiled_smem(bn, bk, ring, split, norm, residual) -> int:
    kw = dict(M=M, N=N, K=K, dtype=BF16, block_n=bn, block_k=bk, tma_stages=ring, norm=norm)
    op = make_op("linear_partial", split_k=split, **kw) if split > 1 else make_op("linear", residual=residual, **kw)
    bufs = {"x": torch.zeros(M, K, device="cuda"), "w": torch.zeros(N, K, dtype=BF16, device="cuda")}
    if norm:
        bufs["norm_w"] = torch.zeros(K, dtype=BF16, device="cuda")
    if split > 1:
        bufs["ws"] = torch.zeros(split, M, N, device="cuda")
    else:
        bufs["out"] = torch.zeros(M, N, device="cuda")
    if residual:
        bufs["res"] = torch.zeros(M, N, device="cuda")
    g = TaskGraph()
    for name, t in bufs.items():
        g.buffer(name, t)
    for a in op_tiles(op, None):
        g.add(op, **{k: k for k in bufs}, **a)
    return Megakernel(lower(g, num_workers=8)).residency().shared_bytes


def main():
    results = []
    for case in CASES:
        r = dict(zip(("bn", "bk", "ring", "split", "norm", "residual"), case), shared=compiled_smem(*case))
        print(r, flush=True)
        results.append(r)
    json.dump(results, open(os.path.join(os.environ.get("OUT", "."), "smem_xmajor.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
