"""Compile megakernels of FP8 linear tiles for sm_90 without a GPU (run by test_linear_format.py in
a subprocess: the interpreter switch is read when Triton decorates kernels). On the CPU FP8
weights are held in float32, so only a real compile checks the e4m3 loads, their TMA boxes and
their widening (to float32 in GEMV tiles, to float16 before the tensor cores): GEMV streams
(rings, runs, grouped waits), split-K partials, weight-major decode tiles, SiLU·mul, residual
and argmax epilogues, the fused QKV + RoPE tiles, with scales per output channel and per 128
columns."""
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from mk.persistent.codegen import compile_for_target  # noqa: E402
from mk.persistent.graph import TaskGraph, lower  # noqa: E402
from mk.tasks import make_op, op_tiles  # noqa: E402

F8, F32 = torch.float8_e4m3fn, torch.float32


def graph(B: int, H: int = 256, I: int = 512, HQ: int = 4, HKV: int = 2, D: int = 64, S: int = 64) -> TaskGraph:
    g = TaskGraph()
    qkv_n = (HQ + 2 * HKV) * D
    for name, shape, dt in (("x", (B, H), F32), ("w", (I, H), F8), ("s", (I,), F32), ("sb", (I, 2), F32),
                            ("y", (B, I), F32), ("ln", (H,), torch.bfloat16), ("ws", (2, B, I), F32),
                            ("best", (B,), torch.int64), ("wd", (H, I), F8), ("sd", (H,), F32),
                            ("act", (B, I // 2), F32), ("h", (B, H), F32), ("wqkv", (qkv_n, H), F8),
                            ("sqkv", (qkv_n, 2), F32), ("pos", (B,), torch.int32), ("inv_freq", (D // 2,), F32),
                            ("q", (B, HQ * D), F32), ("kc", (B, HKV, S, D), torch.bfloat16),
                            ("vc", (B, HKV, S, D), torch.bfloat16)):
        g.buffer(name, torch.zeros(shape, dtype=dt))

    def add(op, **bind):
        for a in op_tiles(op, B):
            g.add(op, **bind, **a)

    rope = dict(pos="pos", inv_freq="inv_freq", q="q", k_cache="kc", v_cache="vc")
    if B == 1:  # GEMV streams
        add(make_op("linear", M=1, N=I, K=H, block_n=16, block_k=256, tma_stages=4, dtype=F8, w_scale=1, norm=True),
            x="x", w="w", w_scale="s", norm_w="ln", out="y")
        add(make_op("linear", M=1, N=I, K=H, block_n=16, block_k=128, tma_stages=9, dtype=F8, w_scale=2,
                    tiles_per_task=2), x="x", w="w", w_scale="sb", out="y")
        add(make_op("linear", M=1, N=I, K=H, block_n=32, block_k=64, tma_stages=3, dtype=F8, w_scale=1,
                    silu_mul=True), x="x", w="w", w_scale="s", out="act")
        add(make_op("linear_partial", M=1, N=I, K=H, split_k=2, block_n=16, block_k=128, tma_stages=4, dtype=F8,
                    w_scale=2), x="x", w="w", w_scale="sb", ws="ws")
        add(make_op("linear", M=1, N=I, K=H, block_n=32, block_k=128, tma_stages=3, tiles_per_task=4, argmax=True,
                    dtype=F8, w_scale=1), x="x", w="w", w_scale="s", out="y", best="best")
        add(make_op("qkv_rope_kv", batch=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, K=H, max_seq=S,
                    block_n=32, block_k=128, tma_stages=4, dtype=F8, w_scale=2), x="x", w="wqkv", w_scale="sqkv",
            **rope)
    else:  # decode batches: tensor-core tiles, weight-major
        add(make_op("linear", M=B, N=I, K=H, block_n=128, block_k=64, tma_stages=3, dtype=F8, w_scale=1, norm=True),
            x="x", w="w", w_scale="s", norm_w="ln", out="y")
        add(make_op("linear", M=B, N=I, K=H, block_n=128, block_k=128, tma_stages=3, dtype=F8, w_scale=2), x="x",
            w="w", w_scale="sb", out="y")
        add(make_op("linear_partial", M=B, N=I, K=H, split_k=2, block_n=128, block_k=64, tma_stages=3, dtype=F8,
                    w_scale=1), x="x", w="w", w_scale="s", ws="ws")
        add(make_op("linear", M=B, N=H, K=I, block_n=128, block_k=64, tma_stages=3, dtype=F8, w_scale=1,
                    residual=True), x="y", w="wd", w_scale="sd", res="h", out="h")
        add(make_op("qkv_rope_kv", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, K=H, max_seq=S,
                    block_n=128, block_k=64, tma_stages=3, dtype=F8, w_scale=2), x="x", w="wqkv", w_scale="sqkv",
            **rope)
    return g


def main() -> None:
    for batch in (1, 8):
        ptx = compile_for_target(lower(graph(batch), num_workers=8), num_warps=4).asm["ptx"]
        # e4m3 weights widen a pair an instruction (e4m3x2 -> f16x2); batches multiply on the
        # tensor cores.
        assert "f16x2.e4m3x2" in ptx, f"batch {batch}: the e4m3 weights are not widened in pairs"
        if batch > 1:
            assert "mma" in ptx, f"batch {batch}: the FP8 tiles do not reach the tensor cores"
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
