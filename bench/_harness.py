"""Helpers for the benchmark files (imported as `_harness`: bench/ is on sys.path)."""

from __future__ import annotations

import torch


def bench_graph(benchmark, calls, rounds: int = 30):
    """Time a list of calls replayed from one CUDA graph; returns the per-call µs (events).

    pytest-benchmark times whole replays (for --benchmark-compare); the returned figure
    is the median per-call time from CUDA events, which goes into the results JSON.
    """
    from mk.timing import capture_graph

    graph = capture_graph(calls)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(replay, rounds=rounds, warmup_rounds=3)
    us = graph_us(graph, len(calls))
    benchmark.extra_info["us_per_call"] = us
    return us


def graph_us(graph_or_calls, calls: int | None = None) -> float:
    """Median µs of one call on the GPU alone: a captured graph of ``calls`` calls (or the
    list of calls, captured here) replayed and timed with CUDA events, so the host's launch
    time is out of it."""
    from mk.timing import capture_graph, event_time_us

    if isinstance(graph_or_calls, (list, tuple)):
        graph, calls = capture_graph(graph_or_calls), len(graph_or_calls)
    else:
        graph = graph_or_calls
    return event_time_us(graph.replay, reps=20, warmup=2) / calls


def back_to_back_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Mean ms of ``fn()`` called ``reps`` times back to back (one pair of CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def gemv_chain(layers: int, n: int, *, weights=None, x=None, **linear_kw):
    """A TaskGraph of ``layers`` chained n x n GEMVs (h[l+1] = W[l] @ h[l], bf16, M=1), one
    task per output tile: each tile of layer l+1 waits for all tiles of layer l (it reads
    all of h[l+1]). Returns (graph, weights, x, out); ``linear_kw`` go to the linear op."""
    from mk.persistent.graph import TaskGraph
    from mk.tasks import make_op
    from mk.tasks.linear import linear_tiles

    bf16 = torch.bfloat16
    if weights is None:
        weights = [torch.randn(n, n, device="cuda", dtype=bf16) / n**0.5 for _ in range(layers)]
    if x is None:
        x = torch.randn(1, n, device="cuda", dtype=bf16)
    g = TaskGraph()
    g.buffer("h0", x)
    for layer in range(layers):
        g.buffer(f"w{layer}", weights[layer])
        g.buffer(f"h{layer + 1}", torch.zeros(1, n, device="cuda", dtype=bf16))
    op = make_op("linear", M=1, N=n, K=n, dtype=bf16, **linear_kw)
    tiles = linear_tiles(op)
    for layer in range(layers):
        for a in tiles:
            g.add(op, x=f"h{layer}", w=f"w{layer}", out=f"h{layer + 1}", **a)
    return g, weights, x, g.buffers[f"h{layers}"]


def gemv_chain_ref(weights, x):
    """The chain in torch, rounding to bf16 after every layer as the kernels do."""
    h = x.float()
    for w in weights:
        h = (h @ w.float().T).to(torch.bfloat16).float()
    return h


#: What the generate benchmarks ask for: a prompt of PROMPT tokens and NEW new ones.
PROMPT, NEW = 64, 256


def prompts(batch: int, vocab: int, length: int = PROMPT) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens, distinct rows, the same on every run."""
    return [[(31 * b + 7 * t + 1) % vocab for t in range(length)] for b in range(batch)]


def measure_generate(benchmark, model, batch: int, copy_Bps: float) -> dict:
    """What a user of ``model.generate`` gets at ``batch`` (PROMPT tokens in, NEW out), as a
    results row: per token and tokens/s through ``generate`` (median of three runs after a
    warm one), its time to first token, the same step's kernel launched back to back from the
    same positions, the copy floor of the bytes it reads, and the GPU memory the runs added
    beyond weights and KV cache."""
    from mk.timing import event_time_us

    ids = prompts(batch, model.config.vocab_size)
    model.generate(ids, max_new_tokens=NEW)  # plan, compile, warm
    fp = model.footprint()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    runs = []

    def run():
        out = model.generate(ids, max_new_tokens=NEW)
        runs.append(dict(model.last_stats))
        assert all(len(o) == PROMPT + NEW for o in out)  # no EOS in these configs: every token decoded

    benchmark.pedantic(run, rounds=3, warmup_rounds=0)
    extra_mib = (torch.cuda.max_memory_allocated() - before) / 2**20
    decode_s = sorted(r["decode_s"] for r in runs)[len(runs) // 2]
    prefill_s = sorted(r["prefill_s"] for r in runs)[len(runs) // 2]
    per_token_ms = decode_s / (NEW - 1) * 1e3  # the prefill chose the first token

    dec = model.last_decoder
    start = torch.full((batch,), PROMPT, dtype=torch.int32, device="cuda")

    def steps():
        dec.state["pos"].copy_(start)
        for _ in range(NEW - 1):
            dec.kernel.launch()

    kernel_ms = event_time_us(steps, reps=3, warmup=1) / (NEW - 1) / 1e3
    dec.kernel.check()
    floor_ms = model.shape.weight_bytes / copy_Bps * 1e3
    return dict(op="generate", batch=batch, prompt=PROMPT, new_tokens=NEW, generate_ms_per_token=per_token_ms,
                kernel_ms_per_step=kernel_ms, gap=per_token_ms / kernel_ms, tokens_per_s=batch * (NEW - 1) / decode_s,
                time_to_first_token_ms=prefill_s * 1e3, floor_ms=floor_ms, kernel_of_floor=floor_ms / kernel_ms,
                extra_mib=extra_mib, weights_gib=fp["weights"] / 2**30, kv_cache_gib=fp["kv_cache"] / 2**30,
                workers=dec.kernel.program.num_workers, tasks=len(dec.step.graph.tasks),
                predicted_ms=dec.step.plan.predicted_s * 1e3)
