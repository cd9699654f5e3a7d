"""``python -m mk demo``: every task op on random inputs against its torch reference."""

from __future__ import annotations

import time

import torch

from . import tasks
from .tasks import default_device, default_dtype, interpreting


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_demo(seed: int = 0) -> int:
    """Run each op once (after a warm-up), print its relative error and time; 0 if all pass.
    ``seed`` (an int in [0, 2**63), the sampler's too) is checked before any op runs."""
    from .tasks.sample import _check_counter

    try:
        _check_counter("seed", seed)
    except (TypeError, ValueError) as e:
        raise type(e)(f"--seed: {e}") from None
    torch.manual_seed(seed)
    dev, dt = default_device(), default_dtype()
    tol = 1e-5 if dt == torch.float32 else 2e-2
    where = "CPU via the Triton interpreter" if interpreting(dev) else torch.cuda.get_device_name(dev)
    print(f"mk {__import__('mk').__version__}: task ops on {where}, {str(dt).replace('torch.', '')}")

    def rnd(*shape, dtype=dt):
        return torch.randn(*shape, device=dev).to(dtype)

    B, H, I, V, Hq, Hkv, D, S = 3, 200, 320, 1000, 4, 2, 64, 37
    x, w_norm, res = rnd(B, H), rnd(H), rnd(B, H)
    w, w_gate, w_up = rnd(V, H), rnd(I, H), rnd(I, H)
    w_gu = tasks.interleave_gate_up(w_gate, w_up)
    q, kc, vc = rnd(B, Hq, D), rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)
    seqlens = torch.tensor([S, 20, 1], device=dev, dtype=torch.int32)
    qp, kp, vp = rnd(B, 16, Hq, D), rnd(B, 16, Hkv, D), rnd(B, 16, Hkv, D)
    pos = torch.tensor([[5], [17], [30]], device=dev)
    inv_freq = tasks.rope_inv_freq(D, 10000.0).to(dev)
    ids = torch.randint(0, V, (B,), device=dev)
    logits = torch.randn(B, V, device=dev)
    kc2, vc2 = kc.clone(), vc.clone()

    cases = [
        ("rmsnorm", lambda: tasks.rmsnorm(x, w_norm, 1e-5, residual=res)[0],
         lambda: tasks.rmsnorm_ref(x, w_norm, 1e-5, residual=res)[0]),
        ("linear (GEMV, M=3)", lambda: tasks.linear(x, w), lambda: tasks.linear_ref(x, w)),
        ("linear + norm + SiLU·mul", lambda: tasks.linear(x, w_gu, norm_weight=w_norm, silu_mul=True),
         lambda: tasks.linear_ref(x, w_gu, norm_weight=w_norm, silu_mul=True)),
        ("linear split-K=3", lambda: tasks.linear(x, w, split_k=3), lambda: tasks.linear_ref(x, w)),
        ("silu_mul", lambda: tasks.silu_mul(x, res), lambda: tasks.silu_mul_ref(x, res)),
        ("embedding", lambda: tasks.embedding(ids, w), lambda: tasks.embedding_ref(ids, w)),
        ("rope + KV append", lambda: tasks.rope_kv(q[:, None], kc[:, :, :1].transpose(1, 2).contiguous(),
                                                   vc[:, :, :1].transpose(1, 2).contiguous(), pos, inv_freq, kc2, vc2),
         lambda: tasks.rope_kv_ref(q[:, None], kc[:, :, :1].transpose(1, 2).contiguous(),
                                   vc[:, :, :1].transpose(1, 2).contiguous(), pos, inv_freq, kc, vc)[0]),
        ("decode_attention (GQA 2:1)", lambda: tasks.decode_attention(q, kc, vc, seqlens),
         lambda: tasks.decode_attention_ref(q, kc, vc, seqlens)),
        ("prefill_attention (causal)", lambda: tasks.prefill_attention(qp, kp, vp),
         lambda: tasks.prefill_attention_ref(qp, kp, vp)),
        ("argmax", lambda: tasks.argmax(logits).float(), lambda: tasks.argmax_ref(logits).float()),
        ("sample (T=0.8, top-k 50, top-p 0.9)",
         lambda: tasks.sample(logits, temperature=0.8, top_k=50, top_p=0.9, seed=seed).float(),
         lambda: tasks.sample_ref(logits, 0.8, 50, 0.9, tasks.gumbel_noise(seed, 0, B, V, device=dev)).float()),
    ]
    failures = 0
    print(f"{'op':38s} {'rel. error':>11s} {'ms':>9s}")
    for name, fn, ref_fn in cases:
        fn()  # warm-up: compile
        if not interpreting(dev):
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        if not interpreting(dev):
            torch.cuda.synchronize(dev)
        ms = (time.perf_counter() - t0) * 1e3
        err = _rel(out, ref_fn())
        ok = err <= tol
        failures += not ok
        print(f"{name:38s} {err:11.2e} {ms:9.3f}{'' if ok else '  FAILED'}")
    print("all ops match their references" if not failures else f"{failures} op(s) off their reference")
    return 1 if failures else 0
