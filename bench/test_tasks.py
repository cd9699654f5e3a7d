"""Each task op against its torch equivalent, on the GPU, in one run (bf16).

The GEMV at Llama-3-8B shapes (M=1) must stream its weights at >= 85% of the
device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from _harness import bench_graph
from mk.tasks.decode_attention import decode_attention
from mk.tasks.embedding import embedding
from mk.tasks.linear import linear
from mk.tasks.prefill_attention import prefill_attention
from mk.tasks.rmsnorm import rmsnorm
from mk.tasks.rope import rope_inv_freq, rope_kv
from mk.tasks.silu_mul import silu_mul
from mk.tasks.argmax import argmax

BF16 = torch.bfloat16
PROVIDERS = ["mk", "torch"]
GEMV_SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096)]  # (K, N) of Llama-3-8B
GEMV_FLOOR = 0.85


def _copies(nbytes: int) -> int:
    """Weight copies to rotate over so that L2 (tens of MB) never serves a repeat."""
    return max(2, math.ceil(400e6 / nbytes))


@pytest.mark.parametrize("provider", ["mk", "torch"])
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("K,N", GEMV_SHAPES)
def test_linear(benchmark, record, gpu_env, provider, M, K, N):
    """mk (programmatic dependent launch on Hopper) against torch."""
    nbytes = N * K * 2
    ws = [torch.randn(N, K, device="cuda", dtype=BF16) for _ in range(_copies(nbytes))]
    x = torch.randn(M, K, device="cuda", dtype=BF16)
    y = linear(x, ws[0])
    ref = x.float() @ ws[0].float().T
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    if provider.startswith("mk"):
        calls = [lambda w=w: linear(x, w) for w in ws] * (40 // len(ws) + 1)
    elif M == 1:
        calls = [lambda w=w: torch.mv(w, x[0]) for w in ws] * (40 // len(ws) + 1)
    else:
        calls = [lambda w=w: F.linear(x, w) for w in ws] * (40 // len(ws) + 1)
    us = bench_graph(benchmark, calls)
    bw = (nbytes + M * (K + N) * 2) / (us * 1e-6)
    frac = bw / gpu_env["copy_Bps"]
    record("tasks", op="linear", provider=provider, M=M, K=K, N=N, us=us, GBps=bw / 1e9, frac_of_copy=frac)
    if provider == "mk" and M == 1:
        assert frac >= GEMV_FLOOR, f"GEMV {K}->{N} at {frac:.3f} of copy bandwidth (< {GEMV_FLOOR})"


def _rmsnorm_torch(x, w, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("M", [1, 8])
def test_rmsnorm(benchmark, record, provider, M):
    x = torch.randn(M, 4096, device="cuda", dtype=BF16)
    w = torch.randn(4096, device="cuda", dtype=BF16)
    fn = (lambda: rmsnorm(x, w, 1e-5)) if provider == "mk" else (lambda: _rmsnorm_torch(x, w))
    us = bench_graph(benchmark, [fn] * 20)
    record("tasks", op="rmsnorm", provider=provider, M=M, N=4096, us=us)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_silu_mul(benchmark, record, provider):
    g = torch.randn(8, 14336, device="cuda", dtype=BF16)
    u = torch.randn(8, 14336, device="cuda", dtype=BF16)
    fn = (lambda: silu_mul(g, u)) if provider == "mk" else (lambda: F.silu(g) * u)
    us = bench_graph(benchmark, [fn] * 20)
    record("tasks", op="silu_mul", provider=provider, M=8, I=14336, us=us)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_embedding(benchmark, record, provider):
    table = torch.randn(128256, 4096, device="cuda", dtype=BF16)
    ids = torch.randint(0, 128256, (8,), device="cuda")
    fn = (lambda: embedding(ids, table)) if provider == "mk" else (lambda: F.embedding(ids, table))
    us = bench_graph(benchmark, [fn] * 20)
    record("tasks", op="embedding", provider=provider, B=8, H=4096, us=us)


def _rope_torch(q, k, v, pos, inv_freq, kc, vc):
    ang = pos.float()[..., None] * inv_freq
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]

    def rot(t):
        t1, t2 = t.float().chunk(2, -1)
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1).to(t.dtype)

    b = torch.arange(q.shape[0], device=q.device)
    kc[b, :, pos[:, 0]] = rot(k)[:, 0]
    vc[b, :, pos[:, 0]] = v[:, 0]
    return rot(q)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_rope_kv(benchmark, record, provider):
    B, Hq, Hkv, D, S = 8, 32, 8, 128, 4096
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=BF16)
    k = torch.randn(B, 1, Hkv, D, device="cuda", dtype=BF16)
    v = torch.randn(B, 1, Hkv, D, device="cuda", dtype=BF16)
    kc = torch.zeros(B, Hkv, S, D, device="cuda", dtype=BF16)
    vc = torch.zeros_like(kc)
    pos = torch.randint(0, S, (B, 1), device="cuda")
    inv = rope_inv_freq(D, 500000.0).cuda()
    if provider == "mk":
        fn = lambda: rope_kv(q, k, v, pos, inv, kc, vc)
    else:
        fn = lambda: _rope_torch(q, k, v, pos, inv, kc, vc)
    us = bench_graph(benchmark, [fn] * 20)
    record("tasks", op="rope_kv", provider=provider, B=B, Hq=Hq, Hkv=Hkv, D=D, us=us)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("B", [1, 8])
def test_decode_attention(benchmark, record, provider, B):
    Hq, Hkv, D, S = 32, 8, 128, 4096
    q = torch.randn(B, Hq, D, device="cuda", dtype=BF16)
    kc = torch.randn(B, Hkv, S, D, device="cuda", dtype=BF16)
    vc = torch.randn_like(kc)
    seqlens = torch.full((B,), S, device="cuda", dtype=torch.int32)
    if provider == "mk":
        fn = lambda: decode_attention(q, kc, vc, seqlens)
    else:
        fn = lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True)
    us = bench_graph(benchmark, [fn] * 10)
    nbytes = 2 * B * Hkv * S * D * 2
    record("tasks", op="decode_attention", provider=provider, B=B, S=S, us=us, GBps=nbytes / (us * 1e-6) / 1e9)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_prefill_attention(benchmark, record, provider):
    B, T, Hq, Hkv, D = 1, 2048, 32, 8, 128
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=BF16)
    k = torch.randn(B, T, Hkv, D, device="cuda", dtype=BF16)
    v = torch.randn_like(k)
    if provider == "mk":
        fn = lambda: prefill_attention(q, k, v)
    else:
        fn = lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    is_causal=True, enable_gqa=True)
    us = bench_graph(benchmark, [fn] * 5)
    flops = 4 * B * Hq * T * T * D / 2
    record("tasks", op="prefill_attention", provider=provider, T=T, us=us, TFLOPs=flops / (us * 1e-6) / 1e12)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("B", [1, 8])
def test_argmax(benchmark, record, provider, B):
    logits = torch.randn(B, 128256, device="cuda", dtype=torch.float32)
    fn = (lambda: argmax(logits)) if provider == "mk" else (lambda: torch.argmax(logits, -1))
    us = bench_graph(benchmark, [fn] * 20)
    record("tasks", op="argmax", provider=provider, B=B, V=128256, us=us)
