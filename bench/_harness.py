"""Helpers for the benchmark files (imported as `_harness`: bench/ is on sys.path)."""

from __future__ import annotations

import torch


def bench_graph(benchmark, calls, rounds: int = 30):
    """Time a list of calls replayed from one CUDA graph; returns the per-call µs (events).

    pytest-benchmark times whole replays (for --benchmark-compare); the returned figure
    is the median per-call time from CUDA events, which goes into the results JSON.
    """
    from mk.timing import capture_graph, event_time_us

    graph = capture_graph(calls)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(replay, rounds=rounds, warmup_rounds=3)
    us = event_time_us(graph.replay, reps=20, warmup=2) / len(calls)
    benchmark.extra_info["us_per_call"] = us
    return us
