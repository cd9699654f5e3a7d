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
