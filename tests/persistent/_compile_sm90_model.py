"""Compile a decoder-layer megakernel (embedding, rope_kv, the fused QKV + RoPE, split-KV
attention, argmax, the LM head folding the argmax, the token append and the linear ops) for
sm_90 in bfloat16 without a GPU. Run by tests/tasks/test_decode_ops.py in a subprocess,
because the interpreter switch is read when Triton decorates kernels."""

import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from mk.persistent.codegen import compile_for_target  # noqa: E402
from mk.persistent.graph import TaskGraph, lower  # noqa: E402
from mk.tasks import make_op, op_tiles  # noqa: E402

BF16 = torch.bfloat16


def decoder_graph(B=2, H=256, HQ=8, HKV=2, D=64, I=512, V=1000, S=128, splits=4) -> TaskGraph:
    g = TaskGraph()
    z = lambda *s, dt=BF16: torch.zeros(*s, dtype=dt)  # noqa: E731
    qkv_n = (HQ + 2 * HKV) * D
    for name, t in (("ids", z(B, dt=torch.int64)), ("pos", z(B, dt=torch.int32)), ("emb", z(V, H)), ("ln", z(H)),
                    ("x", z(B, H)), ("xn", z(B, H)), ("wqkv", z(qkv_n, H)), ("qkv", z(B, qkv_n)),
                    ("inv_freq", z(D // 2, dt=torch.float32)), ("q", z(B, HQ * D)), ("kc", z(B, HKV, S, D)),
                    ("vc", z(B, HKV, S, D)), ("seqlens", z(B, dt=torch.int32)),
                    ("o_part", z(B, HQ, splits * D, dt=torch.float32)), ("lse", z(B, HQ, splits, dt=torch.float32)),
                    ("attn", z(B, HQ * D)), ("wo", z(H, HQ * D)), ("h1", z(B, H)), ("h1n", z(B, H)),
                    ("wgu", z(2 * I, H)), ("act", z(B, I)), ("wd", z(H, I)), ("ws", z(2, B, H, dt=torch.float32)),
                    ("h2", z(B, H)), ("h2n", z(B, H)), ("wlm", z(V, H)), ("logits", z(B, V)),
                    ("pv", z(B, 4, dt=torch.float32)), ("pi", z(B, 4, dt=torch.int32)),
                    ("val", z(B, dt=torch.float32)), ("arrivals", z(B * HKV, dt=torch.int32)),
                    ("wsq", z(2, B, qkv_n, dt=torch.float32)), ("best", z(B, dt=torch.int64)),
                    ("tokens", z(B, S, dt=torch.int32))):
        g.buffer(name, t)

    def add(op, **bind):
        for a in op_tiles(op, B):
            g.add(op, **bind, **a)

    rms = make_op("rmsnorm", n=H)
    add(make_op("embedding", rows=B, vocab=V, hidden=H), ids="ids", table="emb", out="x")
    add(rms, x="x", w="ln", out="xn")
    add(make_op("linear", M=B, N=qkv_n, K=H, dtype=BF16), x="xn", w="wqkv", out="qkv")
    add(make_op("rope_kv", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_seq=S),
        qkv="qkv", pos="pos", inv_freq="inv_freq", q="q", k_cache="kc", v_cache="vc", seqlens="seqlens")
    # The fused QKV + RoPE + KV append (the decode step's QKV task), TMA-fed, after the unfused pair.
    add(make_op("qkv_rope_kv", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, K=H, max_seq=S,
                block_n=64, block_k=64, norm=True, tma_stages=3, dtype=BF16),
        x="x", w="wqkv", norm_w="ln", pos="pos", inv_freq="inv_freq", q="q", k_cache="kc", v_cache="vc")
    add(make_op("decode_attention_partial", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_seq=S,
                num_splits=splits), q="q", k_cache="kc", v_cache="vc", seqlens="seqlens", o_part="o_part", lse="lse")
    add(make_op("decode_attention_merge", batch=B, num_q_heads=HQ, head_dim=D, num_splits=splits),
        o_part="o_part", lse="lse", out="attn")
    # A split-K QKV whose reduce tiles rotate and append (the decode batches' QKV task).
    add(make_op("linear_partial", M=B, N=qkv_n, K=H, split_k=2, norm=True, dtype=BF16), x="x", w="wqkv", norm_w="ln",
        ws="wsq")
    add(make_op("qkv_rope_kv_reduce", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, K=H, max_seq=S,
                split_k=2, dtype=BF16), ws="wsq", pos="pos", inv_freq="inv_freq", q="q", k_cache="kc", v_cache="vc")
    # As the decode batches run it: tl.dot partials through the TMA ring leave the RMSNorm's
    # rstd to their reduces (NORM_SQ), whose tiles are narrower than theirs (PART_BLOCK_N).
    part = make_op("linear_partial", M=B, N=qkv_n, K=H, split_k=2, norm=True, block_n=128, block_k=64,
                   tma_stages=3, dtype=BF16)
    assert part.constexprs["NORM_SQ"] == 1
    g.buffer("wsn", z(2, B, part.constexprs["WS_N"], dt=torch.float32))
    add(part, x="x", w="wqkv", norm_w="ln", ws="wsn")
    add(make_op("qkv_rope_kv_reduce", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, K=H, max_seq=S,
                split_k=2, norm_sq=True, block_n=32, part_block_n=128, dtype=BF16),
        ws="wsn", pos="pos", inv_freq="inv_freq", q="q", k_cache="kc", v_cache="vc")
    add(make_op("linear_reduce", M=B, N=qkv_n, K=H, split_k=2, norm_sq=True, residual=True, block_n=32,
                part_block_n=128, dtype=BF16), ws="wsn", res="qkv", out="qkv")
    # The one-phase attention (each KV group's last split merges it), after the two-phase pair.
    add(make_op("decode_attention", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_seq=S,
                num_splits=splits), q="q", k_cache="kc", v_cache="vc", seqlens="seqlens", o_part="o_part", lse="lse",
        arrivals="arrivals", out="attn")
    # As the decode step binds it: each length from the positions, read before the wait.
    add(make_op("decode_attention", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_seq=S,
                num_splits=splits, from_positions=True), q="q", k_cache="kc", v_cache="vc", pos="pos",
        o_part="o_part", lse="lse", arrivals="arrivals", out="attn")
    # ... with the RoPE (Qwen3's q/k norm, the first layer's seqlens) folded into its splits.
    from mk.tasks.rope import rope_kv_attention_prologue

    g.buffer("qn", z(D)), g.buffer("kn", z(D))
    add(make_op("decode_attention", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_seq=S,
                num_splits=splits, from_positions=True,
                prologue=rope_kv_attention_prologue(B, HQ, HKV, D, S, write_seqlens=True, qk_norm=True)),
        q="q", k_cache="kc", v_cache="vc", pos="pos", o_part="o_part", lse="lse", arrivals="arrivals", out="attn",
        qkv="qkv", inv_freq="inv_freq", q_norm="qn", k_norm="kn", seqlens="seqlens")
    add(make_op("linear", M=B, N=H, K=HQ * D, residual=True, dtype=BF16), x="attn", w="wo", res="x", out="h1")
    add(rms, x="h1", w="ln", out="h1n")
    add(make_op("linear", M=B, N=2 * I, K=H, silu_mul=True, dtype=BF16), x="h1n", w="wgu", out="act")
    add(make_op("linear_partial", M=B, N=H, K=I, split_k=2, dtype=BF16), x="act", w="wd", ws="ws")
    add(make_op("linear_reduce", M=B, N=H, K=I, split_k=2, residual=True, dtype=BF16), ws="ws", res="h1", out="h2")
    add(rms, x="h2", w="ln", out="h2n")
    add(make_op("linear", M=B, N=V, K=H, dtype=BF16), x="h2n", w="wlm", out="logits")
    add(make_op("argmax_partial", rows=B, vocab=V, block_v=256), logits="logits", part_val="pv", part_idx="pi")
    add(make_op("argmax_reduce", rows=B, vocab=V, block_v=256), part_val="pv", part_idx="pi", out_idx="ids",
        out_val="val")
    add(make_op("append_token", batch=B, max_seq=S), next_ids="ids", pos="pos", tokens="tokens")
    # The LM head folding each row's argmax into one word (tl.dot tiles; a GEMV run through
    # the TMA ring), which the token append then takes.
    add(make_op("linear", M=B, N=V, K=H, block_n=128, tma_stages=3, argmax=True, dtype=BF16), x="h2n", w="wlm",
        out="logits", best="best")
    add(make_op("linear", M=1, N=V, K=H, block_n=32, block_k=128, tma_stages=3, tiles_per_task=4, argmax=True,
                dtype=BF16), x="h2n", w="wlm", out="logits", best="best")
    add(make_op("append_token", batch=B, max_seq=S, from_best=True), next_ids="ids", pos="pos", tokens="tokens",
        best="best")
    # Tensor parallelism: O projections whose tiles (whole-K; split-K: the reduces) sum their
    # columns over two ranks, pushing their words into (here: stand-in) symmetric memory.
    for name, t in (("part", z(B, H, dt=torch.float32)), ("total", z(B, H, dt=torch.float32)),
                    ("recv", z(2, B, H, dt=torch.int64)), ("peers", z(2, dt=torch.int64)),
                    ("wso", z(2, B, H, dt=torch.float32))):
        g.buffer(name, t)
    ranks = dict(res="h1", total="total", recv="recv", peers="peers", rank=0, hop=0)
    add(make_op("linear", M=B, N=H, K=HQ * D, block_n=16, tma_stages=3, tiles_per_task=2, all_reduce=2, dtype=BF16),
        x="attn", w="wo", out="part", **ranks)
    add(make_op("linear_partial", M=B, N=H, K=HQ * D, split_k=2, dtype=BF16), x="attn", w="wo", ws="wso")
    add(make_op("linear_reduce", M=B, N=H, K=HQ * D, split_k=2, all_reduce=2, dtype=BF16), ws="wso", out="part",
        **ranks)
    # ... and an all-reduce in tiles of its own.
    add(make_op("all_reduce", M=B, N=H, world=2), part="part", res="h1", out="total", recv="recv", peers="peers",
        rank=0, hop=1)
    return g


def standalone_all_reduce_ptx(block_m: int = 8, block_n: int = 64, num_warps: int = 4) -> str:
    """The standalone all-reduce's kernel (the megakernel's tiles run the same device code)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from mk.tasks.all_reduce import _all_reduce_kernel

    sig = {"part_ptr": "*fp32", "res_ptr": "*fp32", "out_ptr": "*fp32", "recv_ptr": "*i64", "peers_ptr": "*i64",
           "error_ptr": "*i32", "rank": "i32", "M": "i32", "N": "i32", "epoch": "i32", "timeout": "i64"}
    cx = dict(BLOCK_M=block_m, BLOCK_N=block_n, WORLD=2, RESIDUAL=1, USE_TIMER=1, ALIGN=16)
    src = triton.compiler.ASTSource(fn=_all_reduce_kernel, signature={**sig, **{k: "constexpr" for k in cx}},
                                    constexprs=cx, attrs={(k,): [["tt.divisibility", 16]] for k in range(5)})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def loops(ptx: str) -> list[list[str]]:
    """The lines of each loop of ``ptx``: from a label to a branch back to it."""
    lines = ptx.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*(\$L__BB\d+_\d+):", line)
        if m:
            labels[m.group(1)] = i
    found = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i + 1) < i:
            found.append(lines[labels[m.group(1)]:i + 1])
    return found


def main() -> None:
    program = lower(decoder_graph(), num_workers=8)
    names = {spec.name for spec, _ in program.variants}
    assert {"linear_reduce", "embedding", "rope_kv", "qkv_rope_kv", "qkv_rope_kv_reduce", "decode_attention_partial", "decode_attention_merge",
            "decode_attention", "argmax_partial", "argmax_reduce", "append_token"} <= names, names
    assert sum(spec.name == "append_token" for spec, _ in program.variants) == 2  # with and without the argmax word
    compiled = compile_for_target(program, num_warps=4)
    ptx = compiled.asm["ptx"]
    # Attention's bf16 dots on the tensor cores (mma.sync or wgmma), the acquire of the waits,
    # the arrival count of the one-phase attention and its merge's loads from L2.
    # The LM head's argmax words: 64-bit atomic max, and the append's exchange.
    # The sums over the ranks: every rank's words polled with volatile loads.
    for needle in ("mma", "ld.global.acquire.gpu", "atom.global.acq_rel.gpu", "ld.global.cg", "max.s64", "exch.b64",
                   "ld.volatile.global"):
        assert needle in ptx, f"{needle} missing from the compiled megakernel"
    # An all-reduce: its words pushed whole (64-bit stores) and polled with volatile 64-bit
    # loads, with no fence anywhere (each word vouches for itself).
    ptx = standalone_all_reduce_ptx()
    for needle in ("st.global.b64", "ld.volatile.global.b64"):
        assert needle in ptx, f"{needle} missing from the compiled all-reduce"
    for needle in ("fence", "membar"):
        assert needle not in ptx, f"the compiled all-reduce has a {needle}"
    # A box smaller than the block (one row of 16 words, 4 warps): every warp holds a copy and
    # polls it on its own, so the poll loop must hold no block barrier (a warp that left it
    # would meet the barrier of a warp still polling).
    # (The megakernel's warps are its widest op's: 4 or 8.)
    for block_n, warps in ((16, 4), (32, 4), (16, 8), (32, 8)):
        polls = [body for body in loops(standalone_all_reduce_ptx(1, block_n, warps))
                 if any("ld.volatile.global.b64" in x for x in body)]
        assert polls and not any("bar.sync" in x for body in polls for x in body), \
            f"the poll loop of a 1 x {block_n} box in {warps} warps holds a block barrier"
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
