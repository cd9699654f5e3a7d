"""The cost model: predicted time of each op of a decode step under a tiling choice.

For one op and its :class:`OpChoice` the model counts the tasks the choice makes and the
bytes and flops they move (the tasks' own cost hooks, split-K workspace included). An op
is one or more dependency phases (a split-K linear: partials, then reduces); each costs

    wait + sum over waves of (task overhead + task bytes / min(worker rate, bandwidth / busy workers))

where the waves are the tasks the busiest worker runs one after another, ``busy`` how many
workers have a task in that wave (a last, partial wave shares DRAM among fewer: see
:func:`wave_groups`), and the worker rate what one worker streams when DRAM is not the
limit (a few wide tiles cannot pull the whole bandwidth). A decode step at batch 1 is a chain
(every op needs its predecessor's whole output), so the step is the launch plus the sum
over ops. The constants (bandwidths, overheads) are the
:class:`~mk.planner.device.DeviceSpec`'s, measured by ``python -m mk calibrate``;
presets carry placeholders.

Fused ops (an RMSNorm folded into the next linear's prologue, SiLU·mul or a residual add
into a linear's epilogue) cost no task and no hop of their own; the host op reads what the
fused op read from outside and no longer reads the intermediate tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import torch

from mk.tasks.all_reduce import all_reduce_block_n, all_reduce_remote_bytes
from mk.tasks.argmax import argmax_block_v
from mk.tasks.embedding import embedding_block_h
from mk.tasks.decode_attention import decode_attention_config, decode_attention_smem_bytes, live_splits
from mk.tasks.linear import (DOT_MIN, SKINNY_MAX_M, LinearConfig, _tile_rows, dot_waits_in_stream, linear_config,
                             linear_cost, gemv_stream, weight_major)

from .device import DeviceSpec
from .graph import OpGraph, OpNode


@dataclass(frozen=True)
class OpChoice:
    """What the search picks for one op.

    block_n, block_k, split_k, stages, num_warps: tile of a linear (block_m follows M).
    kv_splits: KV-length splits of decode attention.
    fuse: names of ops folded into this one (they then have no task of their own).
    tma_stages: GEMV tiles only: depth of the shared-memory ring the TMA unit streams the
        weights through (0: the register path). :func:`whole_range_stages` makes the ring
        hold the task's whole K range, which is where split-K saves shared memory.
    tiles_per_task: a linear task is a run of this many adjacent tiles along N, streamed as
        one (:func:`mk.tasks.linear.linear_run`): a worker with several tiles of an op pays
        a task's overhead (setup, the stream's ramp) once. The split-K reduces stay one
        tile a task.
    reduce_block_n: split-K only: the width of the reduce tasks' tiles, a divisor of
        block_n (0: block_n). A reduce reads its tile's float32 partials from L2 on the
        layer's critical path; narrower tiles spread that over more (idle) workers.
    """

    block_n: int = 0
    block_k: int = 0
    split_k: int = 1
    stages: int = 1
    num_warps: int = 4
    kv_splits: int = 1
    fuse: tuple[str, ...] = ()
    tma_stages: int = 0
    tiles_per_task: int = 1
    reduce_block_n: int = 0

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
    """Predicted decode step: per-op estimates in program order; the step is the launch plus their sum."""

    ops: list[OpEstimate] = field(default_factory=list)
    launch_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.launch_s + sum(o.seconds for o in self.ops)

    @property
    def tasks(self) -> int:
        return sum(o.tasks for o in self.ops)

    @property
    def peak_smem_bytes(self) -> int:
        return max((o.smem_bytes for o in self.ops), default=0)


@functools.lru_cache(maxsize=None)
def _tile_rows_for(M: int, block_n: int = DOT_MIN) -> int:
    """Rows of x per tile of ``block_n`` weight rows, by the launcher's own rule (1 for the
    GEMV body, else tl.dot tiles: 8 for weight-major ones). Cached: the search asks it of
    every candidate, and each answer builds a config (a third of a batch-8 search's time)."""
    base = linear_config(M, DOT_MIN, DOT_MIN, torch.bfloat16)
    return _tile_rows(LinearConfig(base.block_m, max(block_n, DOT_MIN), base.block_k), M)


def op_tasks(node: OpNode, choice: OpChoice) -> int:
    """Tasks the choice cuts the op into (split-K reduce tasks included)."""
    return sum(tasks for tasks, _ in op_phases(node, choice))


def _attention_workspace(d: dict, kv_splits: int) -> int:
    """Bytes of decode attention's float32 partials (outputs and log-sum-exps), written once."""
    return d["batch"] * d["heads"] * kv_splits * (d["head_dim"] + 1) * 4


def attention_live_splits(d: dict, kv_splits: int) -> int:
    """KV splits of decode attention that hold a key at the op's planned length ``kv_len``,
    as the kernel cuts them (:func:`mk.tasks.decode_attention.decode_live_splits`): each
    split ceil(kv_len / kv_splits) keys rounded up to whole KV blocks, so at a short length
    the last splits hold none (they still run a task each, and return at once)."""
    block_n = decode_attention_config(d["heads"], d["kv_heads"], d["head_dim"]).block_n
    return live_splits(d["kv_len"], kv_splits, block_n)


def op_bytes_flops(node: OpNode, choice: OpChoice) -> tuple[int, int]:
    """Bytes and flops of the op under the choice (split-K workspace traffic included)."""
    if node.kind == "linear" and choice.split_k > 1:
        d = node.dims
        plain, split = linear_cost(d["M"], d["N"], d["K"]), linear_cost(d["M"], d["N"], d["K"], split_k=choice.split_k)
        return node.bytes + split.bytes - plain.bytes, node.flops + split.flops - plain.flops
    if node.kind == "attention":  # several live splits merge their partials through the workspace
        live = attention_live_splits(node.dims, choice.kv_splits)
        return node.bytes + (2 * _attention_workspace(node.dims, live) if live > 1 else 0), node.flops
    return node.bytes, node.flops


def whole_range_stages(K: int, block_k: int, split_k: int = 1) -> int:
    """Ring depth that holds a task's whole K range (K / split_k) in BLOCK_K chunks."""
    return math.ceil(math.ceil(K / split_k) / block_k)


#: Operand buffers a tl.dot loop gets inside the megakernel. The megakernel is compiled
#: with Triton's default software pipelining (num_stages=3: two buffers in flight), whatever
#: the tile's own ``stages``; checked against the compiled kernel (tests/planner, GPU).
MEGAKERNEL_DOT_BUFFERS = 2
#: Shared memory of the small tasks (embedding, RMSNorm, RoPE, merges, reduces, argmax):
#: cross-warp reduction scratch, at most 2 KiB in the compiled megakernel.
SMALL_TASK_SMEM = 2 * 1024
#: Scratch beside a GEMV task's TMA ring (S > 1): its cross-warp reduction, 512 B for
#: 128- and 256-wide chunks in the compiled megakernel (64 B for 64-wide: this bounds it).
GEMV_RING_SCRATCH = 512


#: Bytes of an activation element: the lowering keeps every activation float32 (see
#: :mod:`mk.planner.lower`), whatever the weights' dtype.
ACTIVATION_BYTES = 4


def op_smem_bytes(node: OpNode, choice: OpChoice, dtype_bytes: int = 2) -> int:
    """Shared memory one task of the op takes in the megakernel (Triton 3.6 on sm_90), from
    the 3-D tile (rows x block_n x block_k) x buffers x dtype bytes:

    * TMA GEMV (M = 1, ``tma_stages`` = S): S - 1 buffers in flight (at least one), each a
      [block_n, block_k] weight chunk and an 8-byte barrier, plus, pipelined beside it
      (S > 1), the RMSNorm weight's chunk when fused, and x's chunk, or instead of it
      :data:`GEMV_RING_SCRATCH` when the task waits for x inside its stream
      (:func:`mk.tasks.linear.gemv_stream`: x then comes to registers, not pipelined), and
      a grouped stream's ring holds its groups in flight instead of S - 1 chunks;
    * register GEMV (M = 1): the weights go to registers; what remains is the cross-warp
      reduction (64 B a weight row bounds it);
    * tl.dot tiles (M > 1): :data:`MEGAKERNEL_DOT_BUFFERS` x (x chunk [rows, block_k] + weight
      chunk [block_n, block_k]); a float32 x against 16-bit weights goes to the tensor cores
      as two 16-bit halves (:func:`mk.tasks._dot.mma`), each staged through a [rows, block_k]
      buffer (+1 KiB of layout padding without the TMA ring); through a TMA ring, S - 1 x
      chunks beside S - 1 weight chunks (no halves staged), and weight-major tiles
      (:func:`mk.tasks.linear.weight_major`) all S weight chunks (wgmma reads them in place)
      and the halves once, x itself in registers; a fused RMSNorm adds S - 1 of its chunks.

    Split-K needs nothing more: the partial is stored after the ring is dead and reuses it.
    Decode attention takes :func:`~mk.tasks.decode_attention.decode_attention_smem_bytes`; the
    other tasks at most :data:`SMALL_TASK_SMEM`. The megakernel's shared memory is the most
    any task takes (the task bodies are branches of one program and share the allocation).
    """
    if node.kind == "linear":
        x_bytes = ACTIVATION_BYTES
        norm = any(f.endswith("norm") for f in choice.fuse)
        halves = x_bytes != dtype_bytes  # x meets the weights as hi + lo halves
        if node.dims["M"] == 1 and choice.tma_stages:
            chunk = choice.block_n * choice.block_k * dtype_bytes
            if choice.tma_stages == 1:
                return chunk + 8
            stream = _gemv_stream(node, choice, dtype_bytes)  # waiting in it, x comes to registers
            side = (0 if stream.waits else choice.block_k * x_bytes) + (choice.block_k * dtype_bytes if norm else 0) + 8
            return stream.chunks_in_flight * (chunk + side) + (GEMV_RING_SCRATCH if stream.waits else 0)
        if node.dims["M"] == 1:
            return 64 * choice.block_n
        rows = _tile_rows_for(node.dims["M"], choice.block_n)
        # x's two halves, each staged as a [rows, block_k] tensor-core operand (compiled: H200).
        staged = 2 * rows * choice.block_k * dtype_bytes if halves else 0
        # A fused RMSNorm's weight chunks are pipelined beside the ring's, tma_stages - 1 of
        # them (Triton 3.6: 256 B less for some 256-byte chunks, within the test's slack).
        norm_chunks = max(choice.tma_stages - 1, 1) * choice.block_k * dtype_bytes if norm else 0
        if choice.tma_stages and weight_major(rows, choice.block_n):
            # wgmma reads the weight chunk where TMA put it: the ring holds all tma_stages
            # chunks (one is being multiplied); x comes to registers, and [hi; lo] is staged
            # once as the MMA's other operand (compiled, sm_90: 8 rows x 128, ring 3: 102424 B).
            chunk = choice.block_n * choice.block_k * dtype_bytes + 8
            return choice.tma_stages * chunk + staged + norm_chunks
        if choice.tma_stages:
            # The TMA ring as for a GEMV, with [rows, block_k] x chunks beside each weight chunk.
            # mma.sync takes x's halves to registers straight from the ring's x chunk, a normed
            # x too (compiled, sm_90: 16 rows, 64 x 128, ring 3: 49168 B; with the norm 49424).
            chunk = choice.block_n * choice.block_k * dtype_bytes
            side = rows * choice.block_k * x_bytes + 8
            return max(choice.tma_stages - 1, 1) * (chunk + side) + norm_chunks
        ring = MEGAKERNEL_DOT_BUFFERS * (rows * x_bytes + choice.block_n * dtype_bytes) * choice.block_k
        return ring + (staged + 1024 if halves else 0)
    if node.kind == "attention":
        d = node.dims
        return decode_attention_smem_bytes(decode_attention_config(d["heads"], d["kv_heads"], d["head_dim"],
                                                                   d["kv_dtype_bytes"]),
                                           q_bytes=ACTIVATION_BYTES)
    return SMALL_TASK_SMEM


def _x_task_bytes(node: OpNode, choice: OpChoice) -> int:
    """Bytes of x one task of a linear reads (float32, its rows over its K range, padded to
    the tensor-core tile's rows, once for each tile of its run)."""
    d = node.dims
    return (_tile_rows_for(d["M"], choice.block_n) * math.ceil(d["K"] / choice.split_k) * ACTIVATION_BYTES
            * choice.tiles_per_task)


def ring_seconds_per_byte(node: OpNode, choice: OpChoice, device: DeviceSpec, dtype_bytes: int = 2) -> float:
    """The least time a linear's TMA ring spends per weight byte
    (:meth:`DeviceSpec.ring_seconds_per_byte`: tma_stages - 1 chunks in flight, one with a
    1-deep ring); 0 without the ring."""
    if node.kind != "linear" or not choice.tma_stages:
        return 0.0
    chunk = choice.block_n * choice.block_k * dtype_bytes
    in_flight = _gemv_stream(node, choice, dtype_bytes).chunks_in_flight if node.dims["M"] == 1 else \
        max(choice.tma_stages - 1, 1)
    return device.ring_seconds_per_byte(in_flight * chunk, chunk)


def _gemv_stream(node: OpNode, choice: OpChoice, dtype_bytes: int = 2):
    """How a GEMV linear's tasks stream under the choice (:func:`mk.tasks.linear.gemv_stream`)."""
    return gemv_stream(1, choice.tma_stages, node.dims["K"], choice.block_k, choice.block_n, dtype_bytes,
                       choice.split_k, choice.tiles_per_task)


def exposed_chunk_seconds(node: OpNode, choice: OpChoice, device: DeviceSpec, task_bytes: float,
                          dtype_bytes: int = 2) -> float:
    """What a task of ``task_bytes`` weight bytes spends on its TMA ring beyond its stream:
    where it waits for its inputs before its stream (not inside it), the first chunk's
    :attr:`DeviceSpec.load_latency_s`, which a wait inside the stream overlaps; and for a
    GEMV task :attr:`DeviceSpec.chunk_exposed_s` a chunk (measured on GEMV rings; tl.dot
    tiles' rates carry their work a chunk). Decode tl.dot tiles wait inside their stream
    when weight-major (:func:`dot_tile_waits_in_stream`)."""
    if node.kind != "linear" or not choice.tma_stages:
        return 0.0
    if decode_dot_tile(node):
        # A ring of one has nothing in flight before the wait (its prologue is empty).
        return 0.0 if dot_tile_waits_in_stream(node, choice) and choice.tma_stages > 1 else device.load_latency_s
    if node.dims["M"] != 1:
        return 0.0
    ramp = 0.0 if _gemv_stream(node, choice, dtype_bytes).waits else device.load_latency_s
    return task_bytes / (choice.block_n * choice.block_k * dtype_bytes) * device.chunk_exposed_s + ramp


def dot_tile_waits_in_stream(node: OpNode, choice: OpChoice) -> bool:
    """Whether a linear's decode tl.dot tiles wait for x inside their TMA weight loop, the
    ring's prologue in flight during the wait (:func:`mk.tasks.linear.dot_waits_in_stream`).
    Measured in the 1B batch-8 step on an H200, weight-major
    partials after their wait: QKV 5.6 -> 4.2 us, O projection 5.0 -> 3.6, gate/up 19.4 ->
    17.5, down 12.8 -> 12.0."""
    return decode_dot_tile(node) and dot_waits_in_stream(_tile_rows_for(node.dims["M"], choice.block_n),
                                                         choice.block_n, choice.tma_stages, choice.tiles_per_task)


def decode_dot_tile(node: OpNode) -> bool:
    """Whether a linear runs decode tl.dot tiles: a batch of 2..SKINNY_MAX_M rows."""
    return node.kind == "linear" and 1 < node.dims["M"] <= SKINNY_MAX_M


def xmajor_decode_tile(node: OpNode, choice: OpChoice) -> bool:
    """Whether a linear's tasks are x-major decode tl.dot tiles (:attr:`DeviceSpec.xmajor_dot_bandwidth`):
    a decode batch in boxes too narrow for weight-major (else :attr:`DeviceSpec.dot_worker_bandwidth`)."""
    return decode_dot_tile(node) and not weight_major(_tile_rows_for(node.dims["M"], choice.block_n), choice.block_n)


def linear_tiles_n(node: OpNode, choice: OpChoice) -> tuple[int, int]:
    """(row blocks, tiles along N) of a linear under the choice."""
    d = node.dims
    if choice.block_n < 1:
        raise ValueError(f"op {node.name}: a linear needs block_n >= 1, got {choice.block_n}")
    if choice.tiles_per_task < 1:
        raise ValueError(f"op {node.name}: tiles_per_task must be >= 1, got {choice.tiles_per_task}")
    return math.ceil(d["M"] / _tile_rows_for(d["M"], choice.block_n)), math.ceil(d["N"] / choice.block_n)


def reduce_width(node: OpNode, choice: OpChoice) -> int:
    """Columns of a split-K linear's reduce tiles (:attr:`OpChoice.reduce_block_n`)."""
    width = choice.reduce_block_n or choice.block_n
    if width < 1 or choice.block_n % width:
        raise ValueError(f"op {node.name}: reduce_block_n must divide block_n={choice.block_n}, "
                         f"got {choice.reduce_block_n}")
    return width


def op_phases(node: OpNode, choice: OpChoice, nbytes: int = 0, fused: list[OpNode] = ()) -> list[tuple[int, int]]:
    """The op's dependency phases as (tasks, bytes of ``nbytes``): tasks of one phase run in
    parallel and the next phase waits for them. A split-K linear is its partial tiles, then
    the reduces (reading the float32 workspace back); decode attention one phase, its KV
    splits (each group's last split merges the group: :func:`phase_costs` prices that);
    argmax its chunk partials, the row reduce, and the token append. An argmax in ``fused``
    (folded into one word a row by the LM head's epilogue) leaves the token append."""
    d = node.dims
    if node.kind == "linear":
        blocks, tiles_n = linear_tiles_n(node, choice)
        tasks = blocks * math.ceil(tiles_n / choice.tiles_per_task)  # runs of tiles along N
        # The folded argmax's token append; over ranks, the candidates published, then the choice.
        argmax = next((f for f in fused if f.kind == "argmax"), None)
        tail = [] if argmax is None else [(d["M"], 0)] * (2 if argmax.dims.get("world", 1) > 1 else 1)
        if choice.split_k == 1:
            return [(tasks, nbytes)] + tail
        workspace = d["M"] * d["N"] * choice.split_k * 4
        reduces = blocks * math.ceil(d["N"] / reduce_width(node, choice))
        return [(tasks * choice.split_k, nbytes - workspace), (reduces, workspace)] + tail
    if node.kind == "attention":
        return [(d["batch"] * d["kv_heads"] * choice.kv_splits, nbytes)]
    if node.kind == "all_reduce":  # one task a column block, every rank's rows in it
        return [(math.ceil(d["n"] / all_reduce_block_n(d["rows"], d["n"])), nbytes)]
    if node.kind == "argmax":
        rows = d["rows"]
        return [(rows * math.ceil(d["v"] / argmax_block_v(d["v"])), nbytes), (rows, 0), (rows, 0)]
    # The row-wise ops run one task a row (a sequence for RoPE), as the runtime tiles them;
    # the embedding also splits rows wider than its column block.
    rows = d.get("rows", d.get("batch", 1))
    if node.kind == "embedding":
        rows *= math.ceil(d["hidden"] / embedding_block_h(d["hidden"]))
    return [(rows, nbytes)]


@dataclass(frozen=True)
class PhaseCost:
    """One dependency phase of an op: ``tasks`` tasks of ``task_s`` seconds each (overhead
    included), which start after one wait of ``wait_s`` once their inputs are ready.
    ``early_s`` of a task's time does not need its inputs: a worker that reaches the task
    before they are ready does that part while it waits (the TMA ring's prologue, issued
    before the dependency wait: :func:`prologue_seconds`)."""

    tasks: int
    task_s: float
    wait_s: float
    early_s: float = 0.0

    def seconds(self, workers: int) -> float:
        """The phase alone on ``workers`` workers: one wait, in which the first tasks do their
        early part, then its busiest worker's tasks."""
        return self.wait_s + math.ceil(self.tasks / workers) * self.task_s - min(self.early_s, self.wait_s)


def idle_wait_ops(graph) -> set[str]:
    """Ops that read the output of an op streaming no weights (decode attention): their tasks
    wait on a latency-bound chain while DRAM idles, so what they ask for before their wait
    arrives during it (:func:`prologue_seconds`). After a weight-streaming op the wait
    overlaps that op's tail, which still has DRAM busy: a 56 KiB QKV prologue after the
    down projection measured no faster than 24 KiB (1B, H100)."""
    producers = graph.producers()
    kinds = {n.name: n.kind for n in graph.nodes}
    return {n.name for n in graph.nodes
            if any(kinds.get(producers.get(t, ""), "") == "attention" for t in n.inputs)}


def prologue_seconds(node: OpNode, choice: OpChoice, device: DeviceSpec, stream_s: float,
                     dtype_bytes: int = 2) -> float:
    """The part of a task's weight stream (``stream_s`` seconds) that arrives while it
    waits for its inputs, where DRAM idles then (:func:`idle_wait_ops`): a GEMV
    task that waits inside its TMA stream has the ring's first chunks in flight before the
    wait (:func:`mk.tasks.linear.gemv_stream`), a whole-range ring all of them, and so does
    a weight-major decode tl.dot tile (:func:`dot_tile_waits_in_stream`). Where chunks
    are left to ask for, the next is asked for only after the wait (when the first frees its
    slot), so at least one :attr:`DeviceSpec.load_latency_s` stays after the wait. 0 for
    other tasks. Measured (1B on an H100): the O projection's
    tasks after attention took 4.2 us with 3 of their 8 chunks in flight before the wait,
    3.9 with 7, 3.1 with all 8."""
    if node.kind != "linear" or not choice.tma_stages:
        return 0.0
    if dot_tile_waits_in_stream(node, choice):
        chunks = choice.tma_stages - 1  # Triton's pipeliner issues stages - 1 loads ahead
        if chunks == 0:
            return 0.0
    elif node.dims["M"] == 1 and _gemv_stream(node, choice, dtype_bytes).waits:
        chunks = _gemv_stream(node, choice, dtype_bytes).chunks_in_flight
    else:
        return 0.0
    in_flight = chunks * choice.block_n * choice.block_k * dtype_bytes
    weights = choice.block_n * choice.tiles_per_task * -(-node.dims["K"] // choice.split_k) * dtype_bytes
    if in_flight >= weights:
        return stream_s
    return max(0.0, min(stream_s * in_flight / weights, stream_s - device.load_latency_s))


def _op_traffic(node: OpNode, choice: OpChoice, fused: list[OpNode]) -> tuple[int, int]:
    """Bytes and flops of ``node`` with ``fused`` folded into it."""
    nbytes, flops = op_bytes_flops(node, choice)
    for f in fused:
        # What changes in memory traffic when f runs inside the host's tile:
        # - an RMSNorm prologue: the host reads x and the norm weight instead of h (same size
        #   as x), so + the weight = f's reads - f's writes;
        # - a residual add epilogue: the host also reads the residual and writes the sum
        #   instead of its own output (same size), so + the residual = reads - writes;
        # - SiLU·mul: the host writes the I-wide product instead of the 2I-wide gate/up,
        #   so - I = writes - reads;
        # - RoPE + KV append: the host writes rotated q and the cache rows instead of q/k/v
        #   (the same elements), so about + 0 = reads - writes;
        # - the argmax: the host folds its tiles into a word a row (atomics, in L2) and
        #   nothing reads the logits back, so - what the argmax reads and writes.
        # - a tensor-parallel all-reduce: the host still writes its partial, then reads every
        #   rank's and the residual and writes the sum, so + what the all-reduce moves.
        if f.kind == "silu_mul":
            nbytes += f.bytes_written - f.bytes_read
        elif f.kind == "all_reduce":
            nbytes += f.bytes_read + f.bytes_written
        elif f.kind != "argmax":
            nbytes += f.bytes_read - f.bytes_written
        flops += f.flops
    return max(nbytes, 0), flops


def wave_groups(tasks: int, workers: int) -> tuple[tuple[int, int], ...]:
    """The waves of a phase of ``tasks`` dealt over ``workers``, as (waves, busy workers in
    each): the full waves, then a last one of the remaining tasks. The last wave shares DRAM
    among fewer workers, so each of its tasks streams faster: the 8B gate/up over two H200s
    as 448 tiles of 32 rows (one full wave of 264, then 184) ran a step 2.6% faster than as
    256 runs of split-K partials and a reduce, which pricing every wave as full had ranked
    1.7% slower."""
    if tasks <= 0:
        return ()
    full, rest = divmod(tasks, workers)
    return tuple(g for g in ((full, workers), (1, rest)) if g[0] and g[1])


def phase_costs(node: OpNode, choice: OpChoice, device: DeviceSpec, workers: int,
                fused: list[OpNode] = (), dtype_bytes: int = 2, idle_wait: bool = False) -> list[PhaseCost]:
    """The op's phases (:func:`op_phases`) with the time of one task of each.

    A task streams its share of the phase's bytes at the lesser of what one worker streams
    alone (:meth:`DeviceSpec.worker_rate`, x re-read included), an even share of DRAM among
    the workers busy in its wave (:func:`wave_groups`), and what a TMA ring delivers of weights
    (:func:`ring_seconds_per_byte`), plus the task overhead; where the op's flops outweigh its bytes (prefill-sized
    M) the streaming part stretches to the compute time. ``idle_wait`` (the op is in
    :func:`idle_wait_ops`): the ring's prologue counts as the tasks' early part. An attention split is priced as
    the last of its KV group, which then reads the group's partials back to merge them: exact
    when the splits run in one wave, as they do in decode.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    nbytes, flops = _op_traffic(node, choice, fused)
    rate = device.worker_rate(tma=node.kind == "linear" and choice.tma_stages > 0)
    # The weights' own limit in a TMA ring (bytes in flight, chunks): the partials' stream only.
    ring_s = ring_seconds_per_byte(node, choice, device, dtype_bytes)
    streams = []
    # An all-reduce the tiles run themselves is the last phase's tail, after its stream (below).
    ranks = [f for f in fused if f.kind == "all_reduce"]
    ranks_bytes = sum(f.bytes_read + f.bytes_written for f in ranks)
    phases = op_phases(node, choice, nbytes - ranks_bytes, fused)
    for i, (phase_tasks, phase_bytes) in enumerate(phases):
        waves, busy = math.ceil(phase_tasks / workers), min(phase_tasks, workers)
        task_bytes = max(phase_bytes, 0) / phase_tasks
        if node.kind == "linear" and i == 0 and choice.tiles_per_task > 1:
            # A full run's bytes (the last run of a row block may be shorter).
            blocks, tiles_n = linear_tiles_n(node, choice)
            task_bytes = max(phase_bytes, 0) * choice.tiles_per_task / (blocks * tiles_n * choice.split_k)
        # A linear tile also streams its x rows over its K range (from L2, not DRAM), through
        # the same worker: at batch 8 a [16, 256] float32 x chunk is as big as a 32-row bf16
        # weight chunk, which halved what each worker's ring carried of weights (1B: 2.19 ms
        # with 32-row tiles, 1.51 with 128-row; 8B: 15.8 and 6.2).
        reread = _x_task_bytes(node, choice) if node.kind == "linear" and i == 0 else 0
        if node.kind == "attention":
            # The live splits carry the bytes (a split past the length returns at once, but is
            # priced as a live one: its task still takes a worker's turn); the group's merging
            # split reads the live partials back.
            d = node.dims
            live = attention_live_splits(d, choice.kv_splits)
            task_bytes = max(phase_bytes, 0) / (d["batch"] * d["kv_heads"] * live)
            reread = _attention_workspace(d, live) // (d["batch"] * d["kv_heads"]) if live > 1 else 0
        # A task's stream, averaged over the busiest worker's waves (the last may be partial).
        stream = sum(n * max(task_bytes / (device.dram_bandwidth / b), (task_bytes + reread) / rate,
                             task_bytes * ring_s if i == 0 else 0.0)
                     for n, b in wave_groups(phase_tasks, workers)) / waves
        if i == 0 and decode_dot_tile(node):
            dot_rate = device.xmajor_dot_bandwidth if xmajor_decode_tile(node, choice) else device.dot_worker_bandwidth
            stream = max(stream, task_bytes / dot_rate) if dot_rate else stream
        if node.kind == "all_reduce":
            # The tile's words go to its peers over the GPU link; theirs come back a hop later.
            remote = all_reduce_remote_bytes(node.dims["rows"], node.dims["n"], node.dims["world"]) / phase_tasks
            stream = max(stream, remote / (device.link_bandwidth / busy)) + device.hop_seconds(
                node.dims["world"], busy)
        early = prologue_seconds(node, choice, device, stream, dtype_bytes) if i == 0 and idle_wait else 0.0
        if i == 0:
            stream += exposed_chunk_seconds(node, choice, device, task_bytes, dtype_bytes)
        for f in ranks if i == len(phases) - 1 else ():
            # Each task, its partial stored, pushes it to every rank (over the GPU link to
            # its peers), then reads every rank's words of its box and the residual and
            # writes the sum: after its inputs, never early.
            moved = (f.bytes_read + f.bytes_written) / phase_tasks
            remote = all_reduce_remote_bytes(f.dims["rows"], f.dims["n"], f.dims["world"]) / phase_tasks
            stream += max(moved / (device.dram_bandwidth / busy), remote / (device.link_bandwidth / busy))
            stream += device.hop_seconds(f.dims["world"], busy)
        streams.append((phase_tasks, waves, stream, early))
    memory_s = sum(waves * s for _, waves, s, _ in streams)
    stretch = max(1.0, flops / device.bf16_flops / memory_s) if memory_s > 0 else 1.0
    return [PhaseCost(tasks, device.task_overhead_s + s * stretch, device.wait_overhead_s, early)
            for tasks, _, s, early in streams]


def estimate_op(node: OpNode, choice: OpChoice, device: DeviceSpec, workers: int,
                fused: list[OpNode] = (), dtype_bytes: int = 2, idle_wait: bool = False) -> OpEstimate:
    """Predicted time of ``node`` (with ``fused`` folded into it) on ``workers`` workers.

    Each phase (:func:`phase_costs`) costs one dependency wait plus, on its busiest worker,
    ``waves`` tasks; the op is the sum of its phases. ``idle_wait``: as :func:`phase_costs`.
    """
    nbytes, flops = _op_traffic(node, choice, fused)
    phases = phase_costs(node, choice, device, workers, fused, dtype_bytes, idle_wait)
    overhead_s = sum(p.wait_s + math.ceil(p.tasks / workers) * device.task_overhead_s for p in phases)
    seconds = sum(p.seconds(workers) for p in phases)
    return OpEstimate(node.name, node.kind, sum(p.tasks for p in phases), nbytes, flops,
                      op_smem_bytes(node, choice, dtype_bytes), seconds - overhead_s, flops / device.bf16_flops,
                      overhead_s, seconds)


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
    step = StepEstimate(launch_s=device.launch_overhead_s)
    idle = idle_wait_ops(graph)
    for node in graph.nodes:
        if node.name in fused_into:
            continue
        if node.name not in plan:
            raise ValueError(f"op {node.name} ({node.kind}) has no choice in the plan")
        choice = plan[node.name]
        step.ops.append(estimate_op(node, choice, device, workers, [nodes[f] for f in choice.fuse],
                                    graph.dtype_bytes, node.name in idle))
    return step


def naive_plan(graph: OpGraph) -> dict[str, OpChoice]:
    """A fixed, unfused configuration: every linear 16 x 256-column tiles, no split-K, no
    KV split. The baseline the search must beat."""
    plan = {}
    for node in graph.nodes:
        if node.kind == "linear":
            plan[node.name] = OpChoice(block_n=16, block_k=256, num_warps=4)
        else:
            plan[node.name] = OpChoice()
    return plan
