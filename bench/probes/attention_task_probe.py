"""GPU probe: how long one decode-attention task's body takes on its own, by variant.

In the 1B batch-1 step a live attention task runs ~3.7 us after its wait (H100 trace,
session 28) for 4 query heads against <= 64 cached keys: on the layer's critical path.
Here 8 programs (the 1B's KV groups) run the body with q, K and V already in L2, as in the
step (q just written by the QKV tiles, K/V prefetched before the wait), and each times
itself with the global timer from its start to its signal (a release add, as a task's).
Variants: ``group`` (the megakernel's body: tl.dot through hi/lo halves of float32 q),
``group_bf16q`` (q in bf16: one MMA a product), ``head`` (one program a query head, 32 of
them, float32 FMAs and reductions, no tl.dot), ``empty`` (q's load, the store and the
signal only), ``group_second`` (the group body timed the second time it runs in the
launch: its instructions then come from the SM's caches). With PROBE_BETWEEN=1 the 1B
step's megakernel (~120 KB of code) runs between the probe's launches, so whatever the SMs'
instruction caches kept of the body from the last launch is gone. Env: PROBE_KEYS (default 40), PROBE_OUT.
"""
import json
import os
import statistics as st
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from mk.persistent.sync import now_ns  # noqa: E402
from mk.tasks.decode_attention import decode_attention_tile  # noqa: E402

HQ, HKV, D, S_MAX = 32, 8, 64, 1024


@triton.jit
def _attend_head(q_ptr, k_base, v_base, out_ptr, seqlen, stride_s, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + offs_d).to(tl.float32) * (0.125 * 1.4426950408889634)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for n0 in range(0, seqlen, BLOCK_N):
        offs = n0 + offs_n
        mask_n = offs < seqlen
        k = tl.load(k_base + offs[:, None] * stride_s + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_base + offs[:, None] * stride_s + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        s = tl.where(mask_n, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    tl.store(out_ptr + offs_d, acc / l_i)


@triton.jit
def _group_body(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, arr_ptr, out_ptr, seqlen, kv_head,
                HQ: tl.constexpr, HKV: tl.constexpr, S_MAX: tl.constexpr, D: tl.constexpr):
    """The megakernel's attention body for KV group ``kv_head`` (one split, sequence 0)."""
    decode_attention_tile(q_ptr, k_ptr, v_ptr, seqlen, o_ptr, lse_ptr, arr_ptr, out_ptr, 0, kv_head, 0, HKV, 1, 0.125,
                          HQ * D, D, HKV * S_MAX * D, S_MAX * D, D, HKV * S_MAX * D, S_MAX * D, D,
                          HQ * D, D, D, HQ, 1, 1, HQ * D, D,
                          GROUP=HQ // HKV, HEAD_DIM=D, BLOCK_G=16, BLOCK_N=64, BLOCK_D=D, BLOCK_S=2,
                          BLOCK_GROUP=HQ // HKV)


@triton.jit
def task_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, arr_ptr, out_ptr, sig_ptr, times_ptr, seqlen,
                MODE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, S_MAX: tl.constexpr, D: tl.constexpr):
    q_ptr = tl.multiple_of(q_ptr, 16)
    k_ptr = tl.multiple_of(k_ptr, 16)
    v_ptr = tl.multiple_of(v_ptr, 16)
    out_ptr = tl.multiple_of(out_ptr, 16)
    pid = tl.program_id(0)
    if MODE == 3:  # the group body once untimed, so that its code is in the SM's caches
        _group_body(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, arr_ptr, out_ptr, seqlen, pid, HQ, HKV, S_MAX, D)
    tl.debug_barrier()
    t0 = now_ns(True)
    if (MODE == 0) | (MODE == 3):  # the megakernel's body (its group of 4 heads)
        _group_body(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, arr_ptr, out_ptr, seqlen, pid, HQ, HKV, S_MAX, D)
    elif MODE == 1:  # one query head a program
        kv = pid // (HQ // HKV)
        _attend_head(q_ptr + pid * D, k_ptr + kv * S_MAX * D, v_ptr + kv * S_MAX * D, out_ptr + pid * D, seqlen, D,
                     HEAD_DIM=D, BLOCK_N=64)
    else:  # q in, out: no attention
        offs = tl.arange(0, 4 * D)
        tl.store(out_ptr + pid * 4 * D + offs, tl.load(q_ptr + pid * 4 * D + offs).to(tl.float32) * 2.0)
    tl.debug_barrier()
    tl.atomic_add(sig_ptr, 1, sem="release", scope="gpu")
    t1 = now_ns(True)
    tl.store(times_ptr + pid, t1 - t0)


def main():
    keys = int(os.environ.get("PROBE_KEYS", "40"))
    dev = "cuda"
    k = torch.randn(1, HKV, S_MAX, D, device=dev).bfloat16()
    v = torch.randn(1, HKV, S_MAX, D, device=dev).bfloat16()
    q32 = torch.randn(1, HQ, D, device=dev)
    o = torch.zeros(1, HQ, 1, D, device=dev)
    lse = torch.zeros(1, HQ, 1, device=dev)
    arr = torch.zeros(HKV, dtype=torch.int32, device=dev)
    sig = torch.zeros(1, dtype=torch.int32, device=dev)
    ref = torch.softmax(torch.einsum("hd,hsd->hs", q32[0], k[0, :, :keys].float().repeat_interleave(4, 0)) * 0.125, -1)
    ref = torch.einsum("hs,hsd->hd", ref, v[0, :, :keys].float().repeat_interleave(4, 0))
    res = {"device": torch.cuda.get_device_name(), "keys": keys, "variants": {}}
    between = None
    if os.environ.get("PROBE_BETWEEN") == "1":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from _llama_shapes import SHAPES, random_model
        from mk.models import Llama, LlamaConfig

        cfg = LlamaConfig(**SHAPES["1b"])
        model = Llama(cfg, random_model(cfg), device=dev, dtype=torch.bfloat16, max_batch_size=1, max_seq_len=1024)
        model.generate([[128000, 791, 6864, 315]], max_new_tokens=2)
        between = model.last_decoder.kernel
        res["between"] = "1B decode step"
    for name, mode, q, programs in (("group", 0, q32, HKV), ("group_second", 3, q32, HKV),
                                    ("group_bf16q", 0, q32.bfloat16(), HKV),
                                    ("head", 1, q32, HQ), ("empty", 2, q32, HKV)):
        out = torch.zeros(1, HQ, D, device=dev)
        times = torch.zeros(programs, dtype=torch.int64, device=dev)
        per = []
        for it in range(60):
            if between is not None:
                between.launch()
            task_kernel[(programs,)](q, k, v, o, lse, arr, out, sig, times, keys, MODE=mode, HQ=HQ, HKV=HKV,
                                     S_MAX=S_MAX, D=D)
            torch.cuda.synchronize()
            if it >= 10:
                per.append(st.median(times.tolist()) / 1e3)
        err = float((out[0] - ref).abs().max()) if mode != 2 else 0.0
        res["variants"][name] = {"task_us_median": st.median(per), "task_us_min": min(per), "max_abs_err": err}
        print(name, res["variants"][name], flush=True)
    if os.environ.get("PROBE_OUT"):
        json.dump(res, open(os.environ["PROBE_OUT"], "w"), indent=1)


if __name__ == "__main__":
    main()
