"""GPU timing shared by benchmarks and calibration: CUDA events and CUDA-graph replays.

Everything here times device work with CUDA events after a warm-up and reports the
median, as the GPU method asks: host clocks and single launches mislead.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("timing needs a CUDA GPU")


def event_time_us(fn: Callable[[], object], reps: int = 50, warmup: int = 5) -> float:
    """Median µs of one ``fn()`` call, each timed alone with CUDA events."""
    _require_cuda()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def capture_graph(fns: Sequence[Callable[[], object]], warmup: int = 1) -> torch.cuda.CUDAGraph:
    """Capture the calls ``fns`` (in order) into one CUDA graph, after warm-up runs on a side stream."""
    _require_cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_time_us(fns: Sequence[Callable[[], object]], reps: int = 20) -> float:
    """Median µs per call when the calls ``fns`` are replayed back to back from one CUDA graph.

    This is how a decode loop runs in production (no launch overhead from Python); to keep
    L2 from serving repeated reads, pass calls that rotate over several copies of the data.
    """
    graph = capture_graph(fns)
    return event_time_us(graph.replay, reps=reps, warmup=2) / len(fns)


def copy_bandwidth(nbytes: int = 1 << 31) -> dict:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    Measured two ways on a buffer far larger than L2: ``copy_`` timed alone with events,
    and a copy kernel (``torch.add(a, 0)``, which never becomes a DMA transfer) replayed
    from a graph. The faster counts: it is the bar the kernels are held to.
    """
    _require_cuda()
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()
    eager_us = event_time_us(lambda: dst.copy_(src), reps=20)
    kernel_us = graph_time_us([lambda: torch.add(src, 0, out=dst)] * 4)
    del src, dst
    torch.cuda.empty_cache()
    figures = {"copy_eager_Bps": moved / (eager_us * 1e-6), "copy_kernel_graph_Bps": moved / (kernel_us * 1e-6)}
    figures["copy_Bps"] = max(figures.values())
    return figures
