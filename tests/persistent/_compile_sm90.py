"""Compile megakernels for sm_90 without a GPU (run by test_compile_sm90.py in a subprocess,
because the interpreter switch is read when Triton decorates kernels)."""

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from mk.persistent.codegen import compile_for_target  # noqa: E402
from mk.persistent.graph import TaskGraph, lower  # noqa: E402
from mk.tasks import make_op  # noqa: E402
from mk.tasks.linear import interleave_gate_up, linear_kernel, linear_tiles  # noqa: E402

BF16 = torch.bfloat16


def block_graph(n: int = 256, inter: int = 512) -> TaskGraph:
    """A Llama MLP block with every linear variant: norm prologue + silu_mul epilogue (preloaded
    weights, bulk prefetch), split-K down projection with a residual, plain GEMVs."""
    g = TaskGraph()
    z = lambda *s: torch.zeros(*s, dtype=BF16)  # noqa: E731
    for name, t in (("x", z(1, n)), ("nw", z(n)), ("wgu", interleave_gate_up(z(inter, n), z(inter, n))),
                    ("act", z(1, inter)), ("wd", z(n, inter)), ("ws", torch.zeros(2, 1, n)), ("y", z(1, n)),
                    ("h", z(1, n)), ("w2", z(n, n)), ("out", z(1, n))):
        g.buffer(name, t)
    gu = make_op("linear", M=1, N=2 * inter, K=n, norm=True, silu_mul=True, dtype=BF16, prefetch_k=128)
    for a in linear_tiles(gu):
        g.add(gu, x="x", w="wgu", norm_w="nw", out="act", **a)
    part = make_op("linear_partial", M=1, N=n, K=inter, split_k=2, dtype=BF16, prefetch_k=128)
    red = make_op("linear_reduce", M=1, N=n, K=inter, split_k=2, residual=True, dtype=BF16)
    for a in linear_tiles(part):
        g.add(part, x="act", w="wd", ws="ws", **a)
    for a in linear_tiles(red):
        g.add(red, ws="ws", res="x", out="y", **a)
    g.add(make_op("rmsnorm", n=n), x="y", w="nw", out="h", row=0)
    plain = make_op("linear", M=1, N=n, K=n, dtype=BF16, block_k=64)
    for a in linear_tiles(plain):
        g.add(plain, x="h", w="w2", out="out", **a)
    g.buffer("out2", z(1, n))
    streamed = make_op("linear", M=1, N=n, K=n, dtype=BF16, block_n=16, block_k=128, tma_stages=4)
    for a in linear_tiles(streamed):
        g.add(streamed, x="out", w="w2", out="out2", **a)
    return g


def main() -> None:
    program = lower(block_graph(), num_workers=4)
    for trace, backoff, defer in ((True, 0, True), (False, 200, False)):
        ptx = compile_for_target(program, trace=trace, backoff_ns=backoff, defer_signals=defer).asm["ptx"]
        for needle in ("cp.async.bulk.prefetch.L2", "ld.global.acquire.gpu", "globaltimer", "cp.async.bulk.tensor"):
            assert needle in ptx, f"{needle} missing from the compiled megakernel"
    # A chain of TMA-fed GEMV tasks that wait inside their streams: the ring's first chunks
    # are requested before the wait (its acquire), not after it.
    streamed = make_op("linear", M=1, N=256, K=256, dtype=BF16, block_n=16, block_k=128, tma_stages=4)
    chain = TaskGraph()
    for name, t in (("x", torch.zeros(1, 256, dtype=BF16)), ("w", torch.zeros(256, 256, dtype=BF16)),
                    ("h", torch.zeros(1, 256)), ("y", torch.zeros(1, 256))):
        chain.buffer(name, t)
    for x, out in (("x", "h"), ("h", "y")):
        for a in linear_tiles(streamed):
            chain.add(streamed, x=x, w="w", out=out, **a)
    assert streamed.waits_in_body
    ptx = compile_for_target(lower(chain, num_workers=2)).asm["ptx"]
    assert ptx.index("cp.async.bulk.tensor") < ptx.index("ld.global.acquire.gpu"), "ring prologue after the wait"
    # A grouped stream (ring 9: two groups of 4 chunks in flight) issues both groups first.
    grouped = make_op("linear", M=1, N=256, K=2048, dtype=BF16, block_n=16, block_k=256, tma_stages=9)
    assert grouped.waits_in_body and grouped.constexprs["X_GROUP"] == 4
    chain = TaskGraph()
    for name, t in (("x", torch.zeros(1, 2048)), ("w", torch.zeros(256, 2048, dtype=BF16)), ("y", torch.zeros(1, 256))):
        chain.buffer(name, t)
    for a in linear_tiles(grouped):
        chain.add(grouped, x="x", w="w", out="y", **a)
    ptx = compile_for_target(lower(chain, num_workers=2)).asm["ptx"]
    before = ptx[:ptx.index("ld.global.acquire.gpu")].count("cp.async.bulk.tensor")
    assert before == 8, f"{before} chunks requested before the wait, not 8"
    # The standalone GEMV launch: PDL (gdc wait/launch) and the TMA bulk prefetch before it.
    # (No bias: a None pointer is a constexpr, as the launcher passes it.)
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "norm_w_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16",
           "bias_ptr": "constexpr", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
           "stride_rm": "i32", "stride_om": "i32", "eps": "fp32", "w_scale_ptr": "constexpr"}
    cx = dict(bias_ptr=None, HAS_NORM=True, HAS_RESIDUAL=False, SILU_MUL=True, BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048,
              GROUP_M=8, PREFETCH_LINES=8, LINE=64, PDL=True, PREFETCH_BULK=True, w_scale_ptr=None, W_SCALE=0)
    src = triton.compiler.ASTSource(fn=linear_kernel, signature={**sig, **{k: "constexpr" for k in cx}}, constexprs=cx)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2}).asm["ptx"]
    for needle in ("griddepcontrol.wait", "griddepcontrol.launch_dependents", "cp.async.bulk.prefetch.L2"):
        assert needle in ptx, f"{needle} missing from the compiled GEMV"
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
