"""The cost model: predicted time of each op of a decode step under a tiling choice.

For one op and its :class:`OpChoice` the model counts the tasks the choice makes and the
bytes and flops they move (the tasks' own cost hooks, split-K workspace included), then

    time = max(bytes / bandwidth, flops / rate) + waves x task overhead + wait

where ``waves`` is the number of tasks the busiest worker runs (whole tasks over
``workers``) and ``wait`` is one dependency hop from the op's producers. A decode step at batch 1 is a
chain (every op needs its predecessor's whole output), so the step is the sum over ops.
(with the busiest worker's streaming rate capped, see WORKER_BURST). The constants
(bandwidth, rate, overheads) are the :class:`~mk.planner.device.DeviceSpec`'s,
measured by calibration on the GPU; presets carry spec-sheet placeholders.

Fused ops (an RMSNorm folded into the next linear's prologue, SiLU·mul or a residual add
into a linear's epilogue) cost no task and no hop of their own; the host op reads what the
fused op read from outside and no longer reads the intermediate tensor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from mk.tasks.argmax import argmax_block_v
from mk.tasks.linear import DOT_MIN, LinearConfig, _tile_rows, linear_config, linear_cost, linear_smem_bytes

from .device import DeviceSpec
from .graph import OpGraph, OpNode


@dataclass(frozen=True)
class OpChoice:
    """What the search picks for one op.

    block_n, block_k, split_k, stages, num_warps: tile of a linear (block_m follows M).
    rows_per_task: rows (or row blocks) per task of a row-wise op (norm, add, silu_mul).
    kv_splits: KV-length splits of decode attention.
    fuse: names of ops folded into this one (they then have no task of their own).
    tma_stages: GEMV tiles only: depth of the shared-memory ring the TMA unit streams the
        weights through (0: the register path). :func:`whole_range_stages` makes the ring
        hold the task's whole K range, which is where split-K saves shared memory.
    """

    block_n: int = 0
    block_k: int = 0
    split_k: int = 1
    stages: int = 1
    num_warps: int = 4
    rows_per_task: int = 1
    kv_splits: int = 1
    fuse: tuple[str, ...] = ()
    tma_stages: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class OpEstimate:
    """Predicted cost of one op (fused ops appear only inside their host)."""

    name: str
    kind: str
    tasks: int
    bytes: int
    flops: int
    smem_bytes: int
    memory_s: float
    compute_s: float
    overhead_s: float
    seconds: float


@dataclass
class StepEstimate:
    """Predicted decode step: per-op estimates in program order and their sum."""

    ops: list[OpEstimate] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(o.seconds for o in self.ops)

    @property
    def tasks(self) -> int:
        return sum(o.tasks for o in self.ops)

    @property
    def peak_smem_bytes(self) -> int:
        return max((o.smem_bytes for o in self.ops), default=0)


def _tile_rows_for(M: int) -> int:
    """Rows of x per tile, by the launcher's own rule (1 for the GEMV body, else tl.dot tiles)."""
    return _tile_rows(linear_config(M, DOT_MIN, DOT_MIN, torch.bfloat16), M)


def _linear_config(node: OpNode, choice: OpChoice) -> LinearConfig:
    return LinearConfig(_tile_rows_for(node.dims["M"]), choice.block_n, choice.block_k, choice.split_k,
                        choice.num_warps, choice.stages)


def op_tasks(node: OpNode, choice: OpChoice) -> int:
    """Tasks the choice cuts the op into (split-K reduce tasks and attention merges included)."""
    d = node.dims
    if node.kind == "linear":
        if choice.block_n < 1:
            raise ValueError(f"op {node.name}: a linear needs block_n >= 1, got {choice.block_n}")
        tiles = math.ceil(d["M"] / _tile_rows_for(d["M"])) * math.ceil(d["N"] / choice.block_n)
        return tiles * choice.split_k + (tiles if choice.split_k > 1 else 0)
    if node.kind == "attention":
        # The lowering always merges (the merge also casts the float32 partial to the dtype).
        return d["batch"] * d["kv_heads"] * choice.kv_splits + d["batch"] * d["heads"]
    if node.kind == "argmax":
        # Chunk partials and one reduce per row (and the step's append_token per row).
        return d["rows"] * (math.ceil(d["v"] / argmax_block_v(d["v"])) + 2)
    rows = d.get("rows", d.get("batch", 1))
    return max(1, math.ceil(rows / max(choice.rows_per_task, 1)))


def op_bytes_flops(node: OpNode, choice: OpChoice) -> tuple[int, int]:
    """Bytes and flops of the op under the choice (split-K workspace traffic included)."""
    if node.kind == "linear" and choice.split_k > 1:
        d = node.dims
        plain, split = linear_cost(d["M"], d["N"], d["K"]), linear_cost(d["M"], d["N"], d["K"], split_k=choice.split_k)
        return node.bytes + split.bytes - plain.bytes, node.flops + split.flops - plain.flops
    if node.kind == "attention" and choice.kv_splits > 1:
        d = node.dims
        workspace = 2 * d["batch"] * d["heads"] * choice.kv_splits * (d["head_dim"] + 1) * 4
        return node.bytes + workspace, node.flops
    return node.bytes, node.flops


def whole_range_stages(K: int, block_k: int, split_k: int = 1) -> int:
    """Ring depth that holds a task's whole K range (K / split_k) in BLOCK_K chunks."""
    return math.ceil(math.ceil(K / split_k) / block_k)


def op_smem_bytes(node: OpNode, choice: OpChoice, dtype_bytes: int = 2) -> int:
    """Shared memory of one task: the linear's 3-D tile model (tile rows x block_n x block_k
    x stages x dtype, plus split-K staging; or the TMA ring), a small scratch otherwise."""
    if node.kind == "linear":
        base = linear_smem_bytes(_linear_config(node, choice), node.dims["M"], dtype_bytes)
        if choice.tma_stages and node.dims["M"] == 1:
            base += choice.tma_stages * choice.block_n * choice.block_k * dtype_bytes
        return base
    return 4 * choice.num_warps * 32  # cross-warp reduction scratch of the row-wise tasks


#: How many times its even share of DRAM bandwidth one worker can pull when the others are
#: idle: it bounds ops with fewer tasks than workers, and the tail of ops whose tasks do not
#: divide evenly. Measured in the 1B step on an H200 (bench/NOTES.md, session 4): a TMA GEMV
#: worker streams 25-28 GB/s whether 64 or all 132 workers are busy, about 0.85x its even
#: share of the copy bandwidth, so a lone worker gets no burst at all.
WORKER_BURST = 1.0


def estimate_op(node: OpNode, choice: OpChoice, device: DeviceSpec, workers: int,
                fused: list[OpNode] = (), dtype_bytes: int = 2) -> OpEstimate:
    """Predicted time of ``node`` (with ``fused`` folded into it) on ``workers`` workers."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    tasks = op_tasks(node, choice)
    nbytes, flops = op_bytes_flops(node, choice)
    for f in fused:
        # What changes in memory traffic when f runs inside the host's tile:
        # - an RMSNorm prologue: the host reads x and the norm weight instead of h (same size
        #   as x), so + the weight = f's reads - f's writes;
        # - a residual add epilogue: the host also reads the residual and writes the sum
        #   instead of its own output (same size), so + the residual = reads - writes;
        # - SiLU·mul: the host writes the I-wide product instead of the 2I-wide gate/up,
        #   so - I = writes - reads.
        nbytes += (f.bytes_written - f.bytes_read) if f.kind == "silu_mul" else (f.bytes_read - f.bytes_written)
        flops += f.flops
    nbytes = max(nbytes, 0)
    waves = math.ceil(tasks / workers)
    # All workers together stream at the device's bandwidth; the busiest one streams its
    # `waves` tasks at most WORKER_BURST times its even share.
    worker_bandwidth = device.dram_bandwidth / workers * WORKER_BURST
    memory_s = max(nbytes / device.dram_bandwidth, waves * (nbytes / tasks) / worker_bandwidth)
    compute_s = flops / device.bf16_flops
    overhead_s = waves * device.task_overhead_s + device.wait_overhead_s
    seconds = max(memory_s, compute_s) + overhead_s
    return OpEstimate(node.name, node.kind, tasks, nbytes, flops, op_smem_bytes(node, choice, dtype_bytes),
                      memory_s, compute_s, overhead_s, seconds)


def estimate_step(graph: OpGraph, plan: dict[str, OpChoice], device: DeviceSpec, workers: int) -> StepEstimate:
    """Predicted decode step of ``graph`` under ``plan`` (op name -> choice; ops fused into
    another op's choice are skipped). Raises if an op has no choice or is fused twice."""
    fused_into: dict[str, str] = {}
    for host, choice in plan.items():
        for name in choice.fuse:
            if name in fused_into:
                raise ValueError(f"op {name} fused into both {fused_into[name]} and {host}")
            fused_into[name] = host
    nodes = {n.name: n for n in graph.nodes}
    step = StepEstimate()
    for node in graph.nodes:
        if node.name in fused_into:
            continue
        if node.name not in plan:
            raise ValueError(f"op {node.name} ({node.kind}) has no choice in the plan")
        choice = plan[node.name]
        step.ops.append(estimate_op(node, choice, device, workers, [nodes[f] for f in choice.fuse],
                                    graph.model.dtype_bytes))
    return step


def naive_plan(graph: OpGraph) -> dict[str, OpChoice]:
    """A fixed, unfused configuration: every linear 16 x 256-column tiles, no split-K, one
    task per row for the row-wise ops, no KV split. The baseline the search must beat."""
    plan = {}
    for node in graph.nodes:
        if node.kind == "linear":
            plan[node.name] = OpChoice(block_n=16, block_k=256, num_warps=4)
        else:
            plan[node.name] = OpChoice()
    return plan
