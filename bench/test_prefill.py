"""Prefill on the GPU: mk against a torch.compile peer of the same model, same run.

Random bf16 weights at the Llama-3.2-1B and Llama-3-8B shapes. Three requests: one
2048-token prompt, 8 ragged prompts of 64 to 1024 tokens, one 8192-token prompt. mk runs
each in its fast precision (the default) and its exact one; the peer is the same model in
bf16 PyTorch (gpt-fast style: cuBLAS GEMMs, SDPA attention) under torch.compile with
static shapes, warm, padding a ragged batch to its longest prompt as static shapes must.
Then what users see: time to first token and tokens/s through ``generate``. And the ops
alone: mk's Triton linear tile and prefill attention against torch.matmul and SDPA at
these shapes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from _harness import back_to_back_ms, graph_us
from _llama_peer import TorchLlamaStep
from _llama_shapes import shape_model

LONG = 8192
RAGGED = [64 + (1024 - 64) * i // 7 for i in range(8)]  # 64 .. 1024
REQUESTS = {"2048": [2048], "ragged8": RAGGED, "8192": [LONG]}


@pytest.fixture(scope="module", params=["1b", "8b"])
def long_llama(request):
    model = shape_model(request.param, max_seq_len=LONG + 256, max_batch_size=8)
    yield request.param, model
    del model
    torch.cuda.empty_cache()


def _prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("request_name", list(REQUESTS))
def test_prefill(benchmark, record, long_llama, request_name):
    key, model = long_llama
    lengths = REQUESTS[request_name]
    prompts = _prompts(lengths, model.config.vocab_size)
    ids, lengths = model._check_prompts(prompts, 0)
    with torch.no_grad():
        reps = 3 if key == "8b" else 5
        benchmark.pedantic(lambda: (model.prefiller.run(ids, lengths), torch.cuda.synchronize()), rounds=reps,
                           warmup_rounds=1)
        fast_ms = back_to_back_ms(lambda: model.prefiller.run(ids, lengths), reps=reps, warmup=1)
        fast = model.prefiller.run(ids, lengths)
        model.prefill_precision = "exact"
        try:
            exact_ms = back_to_back_ms(lambda: model.prefiller.run(ids, lengths), reps=2, warmup=1)
            exact = model.prefiller.run(ids, lengths)
        finally:
            model.prefill_precision = "fast"
        # The peer: static shapes, so the ragged batch is padded to its longest prompt at
        # the end (causal attention keeps each prompt's tokens exact).
        peer = TorchLlamaStep(model, len(lengths))
        padded = ids.long()
        compiled = torch.compile(peer.prefill, dynamic=False)
        compile_ms = back_to_back_ms(lambda: compiled(padded), reps=reps, warmup=2)
        eager_ms = back_to_back_ms(lambda: peer.prefill(padded), reps=reps, warmup=1)
        # Each row's logits at its own last token: the padded peer's only for full rows.
        full = [b for b, n in enumerate(lengths) if n == ids.shape[1]]
        peer_err = _rel(fast[full], compiled(padded)[full])
        del peer, compiled
    tokens = sum(lengths)
    c = model.config
    layer_weights = sum(n * k for n, k in _linear_shapes(model).values())
    attn_pairs = sum(n * (n + 1) // 2 for n in lengths)
    flops = c.num_hidden_layers * (2 * tokens * layer_weights + 4 * c.head_dim * c.num_attention_heads * attn_pairs)
    record("prefill", op="prefill", model=key, request=request_name, tokens=tokens, padded_tokens=ids.numel(),
           mk_fast_ms=fast_ms, mk_exact_ms=exact_ms, torch_compile_ms=compile_ms, torch_eager_ms=eager_ms,
           fast_vs_compile=fast_ms / compile_ms, mk_fast_tflops=flops / fast_ms / 1e9,
           fast_vs_exact_logits_rel_err=_rel(fast, exact), fast_vs_peer_logits_rel_err=peer_err,
           chunk_tokens=model.prefill_budget.chunk_tokens, workspace_mib=model.footprint()["prefill_workspace"] / 2**20)
    # bf16 operands move random-weight logits by a few percent (8B: ~6% vs exact); a wrong
    # model would be off by order one.
    assert _rel(fast, exact) < 0.1 and peer_err < 0.1, "fast prefill is not the same model"


def test_generate_time_to_first_token(record, long_llama):
    """What users see: a 2048-token prompt and 128 new tokens through generate (warm)."""
    key, model = long_llama
    prompt = _prompts([2048], model.config.vocab_size, seed=1)
    model.generate(prompt, max_new_tokens=128)  # plan, compile, warm
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        out = model.generate(prompt, max_new_tokens=128)
        runs.append(dict(model.last_stats))
        assert len(out[0]) == 2048 + 128
    mid = sorted(runs, key=lambda r: r["prefill_s"])[1]
    # A prompt length not seen before runs eagerly and captures its chunk's graph; the next
    # request of that length (rounded up to 128 tokens) replays it.
    import time

    fresh = _prompts([1900], model.config.vocab_size, seed=2)
    ids, lengths = model._check_prompts(fresh, 0)
    first_and_next = []
    with torch.no_grad():
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.prefiller.run(ids, lengths)
            torch.cuda.synchronize()
            first_and_next.append((time.perf_counter() - t) * 1e3)
    record("prefill", op="generate", model=key, prompt=2048, new_tokens=128,
           time_to_first_token_ms=mid["prefill_s"] * 1e3, tokens_per_s=127 / mid["decode_s"],
           ms_per_token=mid["decode_s"] / 127 * 1e3, new_length_prefill_first_ms=first_and_next[0],
           new_length_prefill_next_ms=first_and_next[1])


def _graph_ms(fn, calls: int = 10) -> float:
    """ms of one ``fn()`` from CUDA-graph replays (the ops' throughput without the host's
    launch time, for mk and its peer alike)."""
    return graph_us([fn] * calls) / 1e3


def _linear_shapes(model):
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size), "o_proj": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}


@pytest.mark.parametrize("tokens", [2048, LONG])
def test_linear_throughput(record, long_llama, tokens):
    """mk's Triton linear tile (bf16 operands: the persistent TMA GEMM on Hopper) against
    torch.matmul (cuBLAS), both replayed from CUDA graphs; and gate/up with mk's fused
    SiLU·mul epilogue against cuBLAS followed by mk's SiLU·mul."""
    from mk.tasks.silu_mul import silu_mul
    from mk.tasks.linear import linear

    key, model = long_llama
    for name, (N, K) in _linear_shapes(model).items():
        x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16)
        w = model.weights[f"w.l0.{name}"]
        flops = 2 * tokens * N * K
        mm_ms = _graph_ms(lambda: torch.mm(x, w.t()))
        mk_ms = _graph_ms(lambda: linear(x, w))
        err = _rel(linear(x, w), torch.mm(x, w.t()))
        fused = {}
        if name == "gate_up":
            fused = dict(fused_silu_ms=_graph_ms(lambda: linear(x, w, silu_mul=True)),
                         cublas_then_silu_ms=_graph_ms(lambda: silu_mul((g := torch.mm(x, w.t()))[:, 0::2], g[:, 1::2])))
        record("prefill", op="linear", model=key, name=name, M=tokens, N=N, K=K, mk_tflops=flops / mk_ms / 1e9,
               torch_mm_tflops=flops / mm_ms / 1e9, mk_of_torch=mm_ms / mk_ms, **fused)
        assert err < 0.02


@pytest.mark.parametrize("tokens", [2048, LONG])
def test_attention_throughput(record, long_llama, tokens):
    """mk's prefill attention against SDPA (its default backend, and flash forced): causal,
    GQA, each replayed from a CUDA graph."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mk.tasks.prefill_attention import prefill_attention

    key, model = long_llama
    c = model.config
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = torch.randn(1, tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    flops = 4 * d * hq * tokens * (tokens + 1) / 2

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    mk_ms = _graph_ms(lambda: prefill_attention(q, k, v, check_values=False))
    default_ms = _graph_ms(sdpa)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash_ms = _graph_ms(sdpa)
    err = _rel(prefill_attention(q, k, v), sdpa().transpose(1, 2))
    record("prefill", op="attention", model=key, T=tokens, heads=f"{hq}/{hkv}", head_dim=d,
           mk_tflops=flops / mk_ms / 1e9, sdpa_default_tflops=flops / default_ms / 1e9,
           sdpa_flash_tflops=flops / flash_ms / 1e9, mk_of_flash=flash_ms / mk_ms, mk_of_default=default_ms / mk_ms)
    assert err < 0.02 and math.isfinite(mk_ms)
