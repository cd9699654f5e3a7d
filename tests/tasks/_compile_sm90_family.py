"""Compile the family options of the ops for sm_90 without a GPU (run by test_family_compile.py in
a subprocess, because the interpreter switch is read when Triton decorates kernels): Mistral's
sliding window in decode and prefill attention, Qwen3's q/k norm in rope_kv and the fused QKV
tiles, Qwen2's bias in the linear and QKV epilogues, and the run epilogues' trailing args.
The interpreter never compiles, so type and layout errors of these paths show only here."""
import os
os.environ["TRITON_INTERPRET"] = "0"
import importlib, inspect
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
da, pa, rope, qkv_rope, linear = (importlib.import_module("mk.tasks." + m) for m in
                                  ("decode_attention", "prefill_attention", "rope", "qkv_rope", "linear"))


def build(fn, cx, types):
    """The kernel's signature: ``types`` where given, else bf16 pointers, fp32 scales, i32 ints."""
    sig = {}
    for p in inspect.signature(fn.fn).parameters.values():
        if p.name in cx:
            continue
        sig[p.name] = types.get(p.name, "*bf16" if p.name.endswith("_ptr") else
                                "fp32" if p.name in ("sm_scale", "scale", "eps", "norm_eps", "qk_eps") else "i32")
    return sig


def comp(fn, cx, types):
    sig = build(fn, cx, types)
    src = triton.compiler.ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in cx}}, constexprs=cx)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


DA = {"o_ptr": "*fp32", "lse_ptr": "*fp32", "seqlens_ptr": "*i32", "arrivals_ptr": "*i32"}
comp(da.decode_attention_kernel, dict(GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, BLOCK_S=4,
                                      BLOCK_GROUP=4, WINDOW=4096), DA)
comp(da.decode_attention_partial_kernel, dict(GROUP=4, HEAD_DIM=64, BLOCK_G=16, BLOCK_N=64, BLOCK_D=64, WINDOW=4096), DA)
comp(pa.prefill_attention_kernel, dict(GROUP=4, HAS_SEQLENS=True, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, WINDOW=4096),
     {"seqlens_ptr": "*i32"})
comp(rope.rope_kv_kernel, dict(HALF=64, BLOCK_H=16, BLOCK_HALF=64, INTERLEAVED=True, HAS_ROWS=True),
     {"pos_ptr": "*i32", "rows_ptr": "*i32", "inv_freq_ptr": "*fp32"})
Q = {"pos_ptr": "*i32", "seqlens_ptr": "*i32", "inv_freq_ptr": "*fp32", "q_ptr": "*fp32", "ws_ptr": "*fp32"}
for bm, bn in ((1, 128), (16, 256)):
    comp(qkv_rope.qkv_rope_kv_kernel, dict(HQ=16, HKV=8, HEAD_DIM=128, HAS_NORM=True, WRITE_SEQLENS=True, BLOCK_M=bm,
                                           BLOCK_N=bn, BLOCK_K=64), Q)
comp(qkv_rope.qkv_rope_kv_reduce_kernel, dict(split_k=2, HQ=16, HKV=8, HEAD_DIM=128, WRITE_SEQLENS=False, BLOCK_M=16,
                                              BLOCK_N=128), Q)
comp(linear.linear_kernel, dict(HAS_NORM=False, HAS_RESIDUAL=False, SILU_MUL=False, BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048,
                                GROUP_M=8, PREFETCH_LINES=8, LINE=64, PDL=True, PREFETCH_BULK=True), {})
comp(linear.linear_splitk_reduce_kernel, dict(split_k=2, HAS_RESIDUAL=True, SILU_MUL=False, BLOCK_M=16, BLOCK_N=64,
                                              PDL=False), {"ws_ptr": "*fp32"})


@triton.jit
def runs_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, pos_ptr, inv_freq_ptr, q_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr, M, N, K,
                qk_eps, seqlen_ptr, lens_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # The device functions a megakernel spec calls, with the new operands.
    linear.linear_run(x_ptr, w_ptr, w_ptr, 0, tl.program_id(0) * 2, 2, M, N, K, 0, K, K, K, 0.0,
                      linear.linear_store_epilogue, (out_ptr, out_ptr, M, N, N, N, bias_ptr), (False, False),
                      HAS_NORM=False, BLOCK_M=1, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    linear.linear_run(x_ptr, w_ptr, w_ptr, 0, tl.program_id(0) * 2, 2, M, N, K, 0, K, K, K, 0.0,
                      qkv_rope.qkv_rope_kv_run_epilogue,
                      (pos_ptr, inv_freq_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, M, 16, pos_ptr, bias_ptr, qn_ptr, kn_ptr,
                       qk_eps), (16, 8, 128, False, False, True, True), HAS_NORM=False, BLOCK_M=1, BLOCK_N=BLOCK_N,
                      BLOCK_K=BLOCK_K)
    n = tl.load(lens_ptr)
    da.decode_attention_prefetch(kc_ptr, vc_ptr, n, 0, 1, 2, 4, 8192, 1, 1, 1, 1, 1, 1, HEAD_DIM=128, BLOCK_N=64,
                                 BLOCK_D=128, WINDOW=4096)
    tl.store(seqlen_ptr, da.decode_live_splits(n, 4, BLOCK_N=64, WINDOW=4096))


ptx = comp(runs_kernel, dict(BLOCK_N=128, BLOCK_K=128), {"inv_freq_ptr": "*fp32", "q_ptr": "*fp32", "pos_ptr": "*i32",
                                                        "seqlen_ptr": "*i32", "lens_ptr": "*i32"})
assert "prefetch.global.L2" in ptx
print("ok")
