"""Calibration: measure the cost model's constants on the live GPU (``python -m mk calibrate``).

The planner's :class:`~mk.planner.device.DeviceSpec` carries five measured figures
(:data:`~mk.planner.device.CALIBRATED_FIELDS`). Each comes from a micro-benchmark here:

* ``dram_bandwidth``: a device-to-device copy far larger than L2 (:func:`mk.timing.copy_bandwidth`).
* ``bf16_flops``: a large bf16 ``torch.mm``.
* ``launch_overhead_s``, ``task_overhead_s``, ``wait_overhead_s``: megakernels of tiny GEMV
  tasks (a few KiB of weights each, so their bytes cost next to nothing), replayed from a
  CUDA graph so no host time is counted:

  - *spread*: every worker runs ``k`` independent tasks, for ``k = 1`` and ``k = K``; the
    slope is the cost of one task, the rest of the ``k = 1`` launch is the launch cost;
  - *chain*: ``L`` tasks, each waiting for the one before, dealt round-robin so that every
    hop crosses workers; what a link costs beyond a task is one dependency hop.

:func:`fit_constants` turns those timings into constants (a pure function, tested on the
CPU); :func:`calibrate` measures and fits; ``python -m mk calibrate`` also saves them where
``DeviceSpec.from_gpu()`` loads them (:func:`~mk.planner.device.calibration_path`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch

#: Rows and columns of one tiny GEMV task: 16 x 64 bf16 weights = 2 KiB.
TINY_ROWS, TINY_K = 16, 64
#: Tasks per worker in the "many tasks" spread; links in the chain.
SPREAD_TASKS, CHAIN_LINKS = 9, 128
#: The matrix-rate benchmark: one n x n x n bf16 product.
MM_N = 8192


@dataclass(frozen=True)
class Timings:
    """Raw micro-benchmark results (seconds per launch, bytes/s, flop/s)."""

    workers: int
    spread_one_s: float  # every worker runs 1 task
    spread_many_s: float  # every worker runs SPREAD_TASKS tasks
    spread_tasks: int
    chain_s: float  # CHAIN_LINKS dependent tasks, round-robin over the workers
    chain_links: int
    copy_Bps: float
    mm_flops: float


def fit_constants(t: Timings) -> dict[str, float]:
    """The cost-model constants that the timings imply.

    task = slope of the spread over tasks per worker; launch = the one-task spread minus
    one task; wait = what a chain link costs beyond a task (never below zero: a hop can
    hide behind the task's own latency).
    """
    if t.spread_tasks < 2 or t.chain_links < 1:
        raise ValueError("fit_constants needs a spread of at least 2 tasks a worker and a chain of at least 1 link")
    task = max((t.spread_many_s - t.spread_one_s) / (t.spread_tasks - 1), 0.0)
    launch = max(t.spread_one_s - task, 0.0)
    wait = max((t.chain_s - launch) / t.chain_links - task, 0.0)
    return {"dram_bandwidth": float(t.copy_Bps), "bf16_flops": float(t.mm_flops), "task_overhead_s": task,
            "wait_overhead_s": wait, "launch_overhead_s": launch}


def _tiny_linear_graph(tasks: int, chain: bool, device: torch.device):
    """A TaskGraph of ``tasks`` tiny GEMV tiles: independent (one op of ``tasks`` tiles
    reading one x), or a chain (tile i reads what tile i-1 wrote)."""
    from mk.persistent.graph import TaskGraph
    from mk.persistent.ops import make_op
    from mk.persistent.taskops import linear_tiles

    bf16 = torch.bfloat16
    g = TaskGraph()
    if chain:
        # Square TINY_ROWS x TINY_ROWS layers: h[i + 1] = W[i] @ h[i], one tile each.
        op = make_op("linear", M=1, N=TINY_ROWS, K=TINY_ROWS, block_n=TINY_ROWS, dtype=bf16)
        g.buffer("w", torch.randn(TINY_ROWS, TINY_ROWS, device=device, dtype=bf16) / TINY_ROWS ** 0.5)
        for i in range(tasks + 1):
            g.buffer(f"h{i}", torch.randn(1, TINY_ROWS, device=device, dtype=bf16))
        (tile,) = linear_tiles(op)
        for i in range(tasks):
            g.add(op, x=f"h{i}", w="w", out=f"h{i + 1}", **tile)
    else:
        n = TINY_ROWS * tasks
        op = make_op("linear", M=1, N=n, K=TINY_K, block_n=TINY_ROWS, dtype=bf16)
        g.buffer("x", torch.randn(1, TINY_K, device=device, dtype=bf16))
        g.buffer("w", torch.randn(n, TINY_K, device=device, dtype=bf16))
        g.buffer("y", torch.empty(1, n, device=device, dtype=bf16))
        for a in linear_tiles(op):
            g.add(op, x="x", w="w", out="y", **a)
    return g


def _launch_seconds(graph, workers: int, replays: int = 20) -> float:
    """Seconds per launch of ``graph``'s megakernel, replayed back to back from a CUDA graph."""
    from mk.persistent.graph import lower
    from mk.persistent.runtime import Megakernel
    from mk.timing import graph_time_us

    kernel = Megakernel(lower(graph, num_workers=workers))
    kernel.run()
    us = graph_time_us([kernel.launch] * replays, reps=10)
    kernel.check()
    return us * 1e-6


def _mm_flops(n: int = MM_N) -> float:
    from mk.timing import event_time_us

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = event_time_us(lambda: torch.mm(a, b), reps=10, warmup=3)
    return 2 * n ** 3 / (us * 1e-6)


def _require_gpu() -> None:
    from mk.tasks._device import INTERPRET

    if INTERPRET or not torch.cuda.is_available():
        raise RuntimeError("calibrate measures the GPU: it needs CUDA and compiled kernels (TRITON_INTERPRET unset)")


def measure(workers: int | None = None, progress: Callable[[str], None] | None = None) -> Timings:
    """Run the micro-benchmarks on the current CUDA device (``workers``: the planner's
    default, two an SM, when None)."""
    _require_gpu()
    from mk.planner.search import WORKERS_PER_SM
    from mk.timing import copy_bandwidth

    device = torch.device("cuda")
    workers = workers or WORKERS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    say = progress or (lambda _msg: None)
    steps = [("copy bandwidth", lambda: copy_bandwidth()["copy_Bps"]),
             ("bf16 matrix rate", _mm_flops),
             ("one task a worker", lambda: _launch_seconds(_tiny_linear_graph(workers, False, device), workers)),
             (f"{SPREAD_TASKS} tasks a worker",
              lambda: _launch_seconds(_tiny_linear_graph(SPREAD_TASKS * workers, False, device), workers)),
             (f"a chain of {CHAIN_LINKS}", lambda: _launch_seconds(_tiny_linear_graph(CHAIN_LINKS, True, device),
                                                                    workers))]
    got = []
    for what, fn in steps:
        say(what)
        got.append(fn())
    copy_bps, flops, one, many, chain = got
    return Timings(workers=workers, spread_one_s=one, spread_many_s=many, spread_tasks=SPREAD_TASKS,
                   chain_s=chain, chain_links=CHAIN_LINKS, copy_Bps=copy_bps, mm_flops=flops)


def calibrate(workers: int | None = None, progress: Callable[[str], None] | None = None):
    """Measure and fit on the live GPU: ``(spec, timings)`` with ``spec`` the device's
    :class:`~mk.planner.device.DeviceSpec` carrying the measured constants (not yet saved:
    :func:`~mk.planner.device.save_calibration` does that)."""
    from .device import DeviceSpec

    timings = measure(workers, progress)
    spec = DeviceSpec.from_gpu(load_calibration=False).with_calibration(fit_constants(timings))
    return spec, timings


def run_calibrate(save: bool = True) -> int:
    """``python -m mk calibrate``: measure, print the constants, save them for the planner."""
    import json
    import sys

    from tqdm.auto import tqdm

    from .device import CALIBRATED_FIELDS, save_calibration

    _require_gpu()  # before the progress bar, so that the refusal is one clean line
    bar = tqdm(total=5, desc="calibrate", file=sys.stderr)

    def step(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(1)

    spec, timings = calibrate(progress=step)
    bar.close()
    print(json.dumps({"device": spec.name, "constants": {f: getattr(spec, f) for f in CALIBRATED_FIELDS},
                      "timings": asdict(timings)}, indent=2))
    if save:
        print(f"saved to {save_calibration(spec)}")
    return 0
