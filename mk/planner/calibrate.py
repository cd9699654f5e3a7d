"""Calibration: measure the cost model's constants on the live GPU (``python -m mk calibrate``).

The planner's :class:`~mk.planner.device.DeviceSpec` carries the measured figures of
:data:`~mk.planner.device.CALIBRATED_FIELDS`. They come from micro-benchmarks, each a
megakernel replayed from a CUDA graph so that no host time is counted:

* ``dram_bandwidth``: a device-to-device copy far larger than L2 (:func:`mk.timing.copy_bandwidth`).
* ``bf16_flops``: a large bf16 ``torch.mm``.
* ``launch_overhead_s``: megakernels of tiny GEMV tasks (a few KiB of weights), every
  worker running 1 or :data:`SPREAD_TASKS` independent tasks: the one-task launch less one
  (bare) task is the launch, ramp-up and tail.
* ``link_latency_s``, ``link_crowd_s`` and ``link_bandwidth`` (under torchrun, several
  GPUs): one hop of a sum over the ranks, from :data:`LINK_HOPS` of them back to back in
  one launch (:func:`mk.tasks.all_reduce.rank_hops`); what it gains among
  :data:`LINK_CROWD` programs exchanging at once (a projection's tiles that each sum over
  the ranks), for each other program and each peer; the bytes a GPU pushes to its peers a
  second, from the megakernel's all-reduce over :data:`LINK_BYTES` of partial sums
  (:func:`measure_link`).
* ``task_overhead_s``, ``wait_overhead_s``, ``tma_worker_bandwidth``, ``worker_bandwidth``:
  chains of square GEMV layers (:data:`CHAINS`), each layer's tiles reading the whole
  output of the layer before (so a layer is one dependency phase, as an op of a decode
  step is), with weights far larger than L2, tiled so that some chains are limited by
  what one worker streams (few wide tiles), some by DRAM (every worker busy), some run two
  waves, through the TMA ring and through registers. The cost model's own phase formula
  (:func:`mk.planner.cost.estimate_op`) is then fitted to the time a layer takes, by least
  squares: the constants are what makes the model reproduce these chains.

:func:`fit_constants` turns timings into constants (a pure function, tested on the CPU);
:func:`calibrate` measures and fits; ``python -m mk calibrate`` also saves them where
``DeviceSpec.from_gpu()`` loads them (:func:`~mk.planner.device.calibration_path`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from .device import DeviceSpec

#: Rows and columns of one tiny GEMV task: 16 x 64 bf16 weights = 2 KiB.
TINY_ROWS, TINY_K = 16, 64
#: Tasks per worker in the "many tasks" spread.
SPREAD_TASKS = 9
#: The matrix-rate benchmark: one n x n x n bf16 product.
MM_N = 8192
#: Bytes of weights a chain streams per launch, at least: well past any L2, so that every
#: replay reads them from DRAM.
CHAIN_BYTES = 256 * 2**20
#: The GPU link: hops of a sum over the ranks timed back to back, and the bytes of the
#: partial sums of the all-reduce whose pushes give the link's bandwidth (enough that the
#: launch and the ranks' start skew are a few percent of it).
LINK_HOPS = 2000
LINK_BYTES = 32 * 2**20
#: Programs exchanging at once in the crowded case (as many as a projection's tiles at
#: batch 1), and the hops each makes back to back.
LINK_CROWD = 256
LINK_CROWD_HOPS = 200


@dataclass(frozen=True)
class ChainConfig:
    """One calibration chain: square ``n x n`` GEMV layers cut into ``block_n``-row tiles
    (``tma_stages`` > 0: streamed through the TMA ring; else ``block_k``-column register
    chunks), split ``split_k`` ways along K."""

    n: int
    block_n: int
    block_k: int = 256
    tma_stages: int = 0
    split_k: int = 1

    @property
    def layers(self) -> int:
        return max(4, math.ceil(CHAIN_BYTES / (self.n * self.n * 2)))


#: Few wide tiles (worker-limited), every worker busy (DRAM-limited), two waves; TMA and
#: register paths; one split-K chain (partials, then reduces). Task counts are for 264 workers.
CHAINS = (
    ChainConfig(2048, 32, tma_stages=4),  # 64 tasks of 128 KiB
    ChainConfig(2048, 16, tma_stages=4),  # 128 tasks of 64 KiB
    ChainConfig(4096, 16, tma_stages=4),  # 256 tasks of 128 KiB
    ChainConfig(8192, 16, tma_stages=4),  # 512 tasks: two waves
    ChainConfig(4096, 32, tma_stages=4, split_k=2),  # 256 partials of 128 KiB, 128 reduces
    # Register path, tiles of one chunk (those of several chunks run far slower than the
    # model allows: a 2048^2 layer of 16 x 1024 tiles 55 us, an 8192^2 layer of 8 x 2048
    # tiles 612 us on an H200).
    ChainConfig(1024, 8, block_k=1024),  # 128 tasks of 16 KiB
    ChainConfig(2048, 8, block_k=2048),  # 256 tasks of 32 KiB
)


@dataclass(frozen=True)
class ChainTiming:
    config: ChainConfig
    layers: int
    seconds: float  # one launch of the whole chain


@dataclass(frozen=True)
class Timings:
    """Raw micro-benchmark results (seconds per launch, bytes/s, flop/s)."""

    workers: int
    sm_count: int
    spread_one_s: float  # every worker runs 1 tiny task
    spread_many_s: float  # every worker runs spread_tasks tiny tasks
    spread_tasks: int
    copy_Bps: float
    mm_flops: float
    chains: tuple[ChainTiming, ...] = field(default=())

    def to_dict(self) -> dict:
        return asdict(self)


def _chain_graph_op(config: ChainConfig):
    """The chain's layer as the planner sees it: an op node and its choice."""
    from mk.tasks import OpChoice
    from mk.tasks.linear import linear_cost

    from .graph import OpNode

    n = config.n
    c = linear_cost(1, n, n)
    node = OpNode("layer", "linear", ("x",), ("y",), {"M": 1, "N": n, "K": n}, c.bytes_read, c.bytes_written, c.flops)
    choice = OpChoice(block_n=config.block_n, block_k=config.block_k, split_k=config.split_k,
                      tma_stages=config.tma_stages)
    return node, choice


def _phase_rows(config: ChainConfig, workers: int, device: DeviceSpec):
    """The phases of one layer as rows of (waves, task bytes, x bytes a task re-reads, busy
    workers, tma, the ring's least seconds per weight byte, a task's exposed chunk seconds),
    a row for each of a phase's groups of waves (:func:`mk.planner.cost.wave_groups`; the
    phase's one wait on its first) - what the cost model sees
    (:func:`mk.planner.cost.phase_costs`)."""
    from mk.tasks import op_kind

    from .cost import op_bytes_flops, op_phases, wave_groups

    node, choice = _chain_graph_op(config)
    kind = op_kind(node.kind)
    nbytes, _ = op_bytes_flops(node, choice)
    rows = []
    for i, (tasks, phase_bytes) in enumerate(op_phases(node, choice, nbytes)):
        terms = kind.phase_terms(node, choice, device, i, tasks, phase_bytes)
        task_bytes = max(phase_bytes, 0) / tasks if terms.task_bytes is None else terms.task_bytes
        exposed = kind.exposed_seconds(node, choice, device, task_bytes) if i == 0 else 0.0  # the weights' stream
        for j, (waves, busy) in enumerate(wave_groups(tasks, workers)):
            rows.append((waves, task_bytes, terms.reread, busy, terms.tma, terms.ring_s, exposed, j == 0))
    return rows


def fit_constants(t: Timings, device: DeviceSpec) -> dict[str, float]:
    """The cost-model constants that the timings imply.

    launch = the one-task spread minus one bare task (the spread's slope). The chains fit
    ``per layer = sum over its phases of [wait + sum over its waves of (task + max(bytes /
    (bandwidth / busy), (bytes + x re-read) / worker rate of the path, bytes x the ring's
    least seconds a byte) + the exposed chunk seconds)]``:
    a least-squares fit of task, wait and the two inverse worker rates, repeated until the
    set of worker-limited phases settles. The ring's limits (load latency, chunk overhead,
    exposed chunk time) are ``device``'s, not fitted. A worker rate no chain
    is limited by stays 0 (unmeasured); overheads are never below zero.
    """
    if t.spread_tasks < 2:
        raise ValueError("fit_constants needs a spread of at least 2 tasks a worker")
    bare_task = max((t.spread_many_s - t.spread_one_s) / (t.spread_tasks - 1), 0.0)
    launch = max(t.spread_one_s - bare_task, 0.0)
    out = {"dram_bandwidth": float(t.copy_Bps), "bf16_flops": float(t.mm_flops), "launch_overhead_s": launch,
           "task_overhead_s": bare_task, "wait_overhead_s": 0.0, "tma_worker_bandwidth": 0.0, "worker_bandwidth": 0.0}
    if not t.chains:
        return out
    share = t.copy_Bps / t.sm_count  # first guess of a worker's rate
    inv = {True: 1 / share, False: 1 / share}  # inverse worker rates by path (tma?)
    limited = None
    for _ in range(20):
        A, b, now = [], [], []
        for ch in t.chains:
            row, rhs = [0.0, 0.0, 0.0, 0.0], (ch.seconds - launch) / ch.layers
            for waves, task_bytes, reread, busy, tma, ring_s, exposed, waits in _phase_rows(ch.config, t.workers,
                                                                                             device):
                row[0] += waves
                row[1] += waits
                rhs -= waves * exposed
                # The fixed limits of a task's stream: DRAM's share, and what the ring delivers.
                fixed = max(task_bytes * busy / t.copy_Bps, task_bytes * ring_s)
                worker_limited = (task_bytes + reread) * inv[tma] > fixed
                now.append(worker_limited)
                if worker_limited:
                    row[2 if tma else 3] += waves * (task_bytes + reread)
                else:
                    rhs -= waves * fixed
            A.append(row)
            b.append(rhs)
        A, b = np.array(A), np.array(b)
        used = [j for j in range(4) if A[:, j].any()]
        sol = np.zeros(4)
        sol[used] = np.linalg.lstsq(A[:, used], b, rcond=None)[0]
        for j, tma in ((2, True), (3, False)):
            if j in used and sol[j] > 0:
                inv[tma] = sol[j]
        if now == limited:
            break
        limited = now
    out["task_overhead_s"] = max(float(sol[0]), 0.0)
    out["wait_overhead_s"] = max(float(sol[1]), 0.0)
    out["tma_worker_bandwidth"] = 1 / float(sol[2]) if sol[2] > 0 else 0.0
    out["worker_bandwidth"] = 1 / float(sol[3]) if sol[3] > 0 else 0.0
    return out


def chain_residuals(t: Timings, spec) -> list[dict]:
    """Per chain: measured and modelled µs a layer with ``spec``'s constants (how well the fit holds)."""
    from .cost import estimate_op

    out = []
    for ch in t.chains:
        node, choice = _chain_graph_op(ch.config)
        model = estimate_op(node, choice, spec, t.workers).seconds
        measured = (ch.seconds - spec.launch_overhead_s) / ch.layers
        out.append({**asdict(ch.config), "measured_us": measured * 1e6, "model_us": model * 1e6})
    return out


def _tiny_linear_graph(tasks: int, device: torch.device):
    """A TaskGraph of ``tasks`` independent tiny GEMV tiles (one op reading one x)."""
    from mk.persistent.graph import TaskGraph
    from mk.tasks import make_op
    from mk.tasks.linear import linear_tiles

    bf16 = torch.bfloat16
    g = TaskGraph()
    n = TINY_ROWS * tasks
    op = make_op("linear", M=1, N=n, K=TINY_K, block_n=TINY_ROWS, dtype=bf16)
    g.buffer("x", torch.randn(1, TINY_K, device=device, dtype=bf16))
    g.buffer("w", torch.randn(n, TINY_K, device=device, dtype=bf16))
    g.buffer("y", torch.empty(1, n, device=device, dtype=bf16))
    for a in linear_tiles(op):
        g.add(op, x="x", w="w", out="y", **a)
    return g


def _chain_graph(config: ChainConfig, device: torch.device, layers: int | None = None):
    """A TaskGraph of ``layers`` square GEMV layers, h[i + 1] = W[i] @ h[i], cut as ``config``
    says (split-K layers: float32 partials, then a reduce per tile)."""
    from mk.persistent.graph import TaskGraph
    from mk.tasks import make_op, op_tiles

    from mk.tasks.linear.planning import PREFETCH_K

    bf16, n = torch.bfloat16, config.n
    layers = layers or config.layers
    g = TaskGraph()
    # Activations float32, as the decode step's lowering keeps them.
    # As the decode step's lowering does: L2 prefetch ahead of register tiles only.
    kw = dict(M=1, N=n, K=n, block_n=config.block_n, block_k=config.block_k, tma_stages=config.tma_stages,
              prefetch_k=0 if config.tma_stages else min(PREFETCH_K, n), dtype=bf16)
    for i in range(layers + 1):
        g.buffer(f"h{i}", torch.randn(1, n, device=device, dtype=torch.float32))
    for i in range(layers):
        g.buffer(f"w{i}", torch.randn(n, n, device=device, dtype=bf16) / n ** 0.5)
        if config.split_k == 1:
            op = make_op("linear", **kw)
            for a in op_tiles(op):
                g.add(op, x=f"h{i}", w=f"w{i}", out=f"h{i + 1}", **a)
        else:
            part = make_op("linear_partial", split_k=config.split_k, **kw)
            red = make_op("linear_reduce", M=1, N=n, K=n, block_n=config.block_n, split_k=config.split_k, dtype=bf16)
            g.buffer(f"ws{i}", torch.empty(config.split_k, 1, n, device=device, dtype=torch.float32))
            for a in op_tiles(part):
                g.add(part, x=f"h{i}", w=f"w{i}", ws=f"ws{i}", **a)
            for a in op_tiles(red):
                g.add(red, ws=f"ws{i}", out=f"h{i + 1}", **a)
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
    if not torch.cuda.is_available():
        raise RuntimeError("calibrate measures the GPU: it needs a CUDA GPU")


def _ranks() -> int:
    """Ranks of torch.distributed's world (1 when it is not set up)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def steps() -> int:
    """How many micro-benchmarks :func:`calibrate` runs (for a progress bar)."""
    return 4 + len(CHAINS) + (_ranks() > 1)


def measure_link(hops: int = LINK_HOPS, nbytes: int = LINK_BYTES) -> dict[str, float]:
    """``link_latency_s``, ``link_crowd_s`` and ``link_bandwidth`` of the GPU link between
    torch.distributed's ranks (a collective: every rank calls it at once, each on its own
    GPU). The latency is one hop of a sum over the ranks (the best of two launches of
    ``hops``); the crowd is what a hop gains among :data:`LINK_CROWD` at once, for each
    other one and each peer (:meth:`~mk.planner.device.DeviceSpec.hop_seconds`; the best of
    two launches); the bandwidth is what a GPU pushes to its peers over the time of an
    all-reduce of ``nbytes`` of partial sums (the best of three), as the planner prices the
    all-reduce."""
    import torch.distributed as dist

    from mk.persistent.symmetric import symmetric_workspace
    from mk.tasks.all_reduce import HOP_COLS, all_reduce, all_reduce_remote_bytes, check_hops, rank_hops

    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise RuntimeError("measure_link needs several ranks: run it under torchrun --nproc-per-node N")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = 8
    cols = max(nbytes // (4 * rows), 1)
    meta = {"part": torch.empty(rows, cols, device="meta"),
            "recv": torch.empty(world, rows, cols, dtype=torch.int64, device="meta"),
            "hops": torch.empty(2 * world * LINK_CROWD * HOP_COLS, dtype=torch.int64, device="meta"),
            "peers": torch.empty(world, dtype=torch.int64, device="meta")}
    ws = symmetric_workspace(meta, device, peers="peers")
    try:
        ws["part"].normal_()
        out = torch.empty_like(ws["part"])

        def timed(fn) -> tuple[float, object]:
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3, result

        def together(fn):
            """fn() on every rank; when it raised on any, every rank raises (a rank that
            stopped alone would leave its peers waiting in the next collective)."""
            try:
                out, err = fn(), None
            except RuntimeError as e:
                out, err = None, e
            failed = torch.tensor([int(err is not None)], dtype=torch.int32, device=device)
            dist.all_reduce(failed)
            if err is not None:
                raise err
            if int(failed):
                raise RuntimeError(f"measure_link: {int(failed)} peer(s) failed; their errors name the cause")
            return out

        def hop_s(n: int, programs: int) -> float:
            """One hop of ``n`` back to back in each of ``programs`` programs at once: the
            best of two launches after an untimed one (it compiles; Triton specialises an
            int argument that is 1 or a multiple of 16, so the counts timed are past those)."""
            best = float("inf")
            for i in range(3):
                def run() -> float:
                    seconds, error = timed(lambda: rank_hops(ws["hops"], ws["peers"], rank, n, programs=programs))
                    check_hops(error, rank)
                    return seconds
                seconds = together(run)
                if i:
                    best = min(best, seconds / n)
                dist.barrier()  # every rank past its last hop before the words restart
                ws["hops"].zero_()
                torch.cuda.synchronize()
                dist.barrier()
            return best

        latency = hop_s(hops, 1)
        crowd = max(hop_s(LINK_CROWD_HOPS, LINK_CROWD) - latency, 0.0) / ((world - 1) * (LINK_CROWD - 1))
        times = [together(lambda: timed(lambda: all_reduce(ws["part"], out, ws["recv"], ws["peers"], rank,
                                                           epoch=e))[0])
                 for e in range(6)]
        seconds = min(times[3:])
        return {"link_latency_s": latency, "link_crowd_s": crowd,
                "link_bandwidth": all_reduce_remote_bytes(rows, cols, world) / seconds}
    finally:
        torch.cuda.synchronize()
        dist.barrier()  # no rank reads this one's workspace any more: it goes on return


def measure(workers: int | None = None, progress: Callable[[str], None] | None = None) -> Timings:
    """Run the micro-benchmarks on the current CUDA device (``workers``: the planner's
    default, two an SM, when None)."""
    _require_gpu()
    from mk.planner.search import WORKERS_PER_SM
    from mk.timing import copy_bandwidth

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    workers = workers or WORKERS_PER_SM * sms
    say = progress or (lambda _msg: None)
    say("copy bandwidth")
    copy_bps = copy_bandwidth()["copy_Bps"]
    say("bf16 matrix rate")
    flops = _mm_flops()
    say("one task a worker")
    one = _launch_seconds(_tiny_linear_graph(workers, device), workers)
    say(f"{SPREAD_TASKS} tasks a worker")
    many = _launch_seconds(_tiny_linear_graph(SPREAD_TASKS * workers, device), workers)
    chains = []
    for config in CHAINS:
        say(f"chain {config.n}x{config.n} / {config.block_n} rows" + (" TMA" if config.tma_stages else "")
            + (f" split {config.split_k}" if config.split_k > 1 else ""))
        graph = _chain_graph(config, device)
        chains.append(ChainTiming(config, config.layers, _launch_seconds(graph, workers, replays=5)))
        del graph
        torch.cuda.empty_cache()
    return Timings(workers=workers, sm_count=sms, spread_one_s=one, spread_many_s=many, spread_tasks=SPREAD_TASKS,
                   copy_Bps=copy_bps, mm_flops=flops, chains=tuple(chains))


def calibrate(workers: int | None = None, progress: Callable[[str], None] | None = None):
    """Measure and fit on the live GPU: ``(spec, timings)`` with ``spec`` the device's
    :class:`~mk.planner.device.DeviceSpec` carrying the measured constants (not yet saved:
    :func:`~mk.planner.device.save_calibration` does that)."""
    timings = measure(workers, progress)
    base = DeviceSpec.from_gpu(load_calibration=False)
    constants = fit_constants(timings, base)
    if _ranks() > 1:
        if progress is not None:
            progress("GPU link")
        constants.update(measure_link())
    spec = base.with_calibration(constants)
    return spec, timings


def run_calibrate(save: bool = True) -> int:
    """``python -m mk calibrate``: measure, print the constants, save them for the planner.
    Under ``torchrun --nproc-per-node N`` every rank measures its own GPU and the ranks the
    link between them; rank 0 prints and saves."""
    import json
    import sys

    from tqdm.auto import tqdm

    from .device import CALIBRATED_FIELDS, LINK_FIELDS, save_calibration

    from mk.persistent.symmetric import join_ranks, launch_env

    _require_gpu()  # before the progress bar, so that the refusal is one clean line
    rank = 0
    if launch_env()[0] > 1:
        rank, _ = join_ranks("calibrate")
    bar = tqdm(total=steps(), desc="calibrate", file=sys.stderr, disable=rank != 0)

    def step(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(1)

    spec, timings = calibrate(progress=step)
    bar.close()
    if rank != 0:
        return 0
    link = _ranks() > 1
    constants = {f: getattr(spec, f) for f in CALIBRATED_FIELDS + (LINK_FIELDS if link else ())}
    print(json.dumps({"device": spec.name, "constants": constants, "timings": timings.to_dict(),
                      "chains": chain_residuals(timings, spec)}, indent=2))
    if save:
        print(f"saved to {save_calibration(spec, link=link)}")
    return 0
