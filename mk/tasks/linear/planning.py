"""How the planner plans a linear op of a decode step (:class:`LinearKind`): its tile
candidates (GEMV streams, tensor-core tiles, split-K, runs of tiles), the shared memory a
task takes inside the megakernel, what prices its tasks (a TMA ring's rate and ramp, the x
rows a tile re-reads, a one-byte GEMV chunk's x reads, a decode tile's tensor-core rate, the
ring's prologue during the wait), the fusions its tiles carry (an RMSNorm prologue; a
residual add, SiLU·mul, RoPE + KV append, the argmax, an all-reduce over tensor-parallel
ranks in its epilogue), and its lowering to the megakernel's linear ops (:mod:`mk.tasks.linear.spec`, :mod:`mk.tasks.qkv_rope`).

The residual add of a decode step runs only as a linear's epilogue: its kind (:data:`ADD`)
lives here too.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from .._planning import ACTIVATION_BYTES, GREEDY, FusedOnlyKind, OpChoice, OpKind, PhaseTerms, register_kind
from .._spec import make_op
from .config import (DOT_MIN, SKINNY_MAX_M, X_GROUP, LinearConfig, MegakernelTile, dot_waits_in_stream, gemv_stream,
                     linear_config, linear_cost, linear_smem_bytes, tile_rows, weight_major)
from .format import SCALE_BLOCK, WeightFormat, weight_format

#: Register bytes per thread a GEMV tile's weight chunk may take. The register path keeps
#: two chunks in flight (double buffering), and every op of the megakernel shares one
#: register allocation, the largest any variant needs: a 32 x 1024 bf16 chunk (256
#: registers a thread for two) made the 1B step spill 546 registers and run 5x its floor.
GEMV_REG_CHUNK_BYTES = 256
#: Runs of tiles (OpChoice.tiles_per_task) must keep at least this share of the workers busy.
RUN_MIN_BUSY = 0.95
#: Warps of the GEMV tiles (the megakernel runs all its ops with the widest variant's warps).
GEMV_WARPS = 4
#: The narrowest split-K reduce tile (columns): [8 rows, 32 columns] is two floats a thread.
REDUCE_MIN_COLS = 32
#: L2 prefetch ahead of a register GEMV tile's dependency wait, in weight columns (never under
#: the interpreter): bench/test_persistent.py's 8192 chain runs best with 1024. Not for tiles
#: that stream through the TMA ring: issued one task ahead it slowed the 1B step on an H200
#: (1.087 ms without, 1.175 with 1024 columns, 1.34 with whole rows), and issued just before
#: the task's own wait too (1.009 -> 1.106 ms; 8B 4.57 -> 5.50; H200).
PREFETCH_K = 1024
#: The least time of a GEMV chunk of one-byte weights (batch 1) while two workers share its
#: SM, in the device's ``chunk_overhead_s`` (:func:`one_byte_x_floor`). Measured (FP8 GEMV
#: probe, H200, e4m3 boxes of 256 columns streamed by 264 workers): 0.46 us a chunk for 8- and
#: 16-row boxes alike (0.29 and 0.60 of the copy bandwidth), against 0.28 for the 16-bit
#: 8-row chunks ``chunk_overhead_s`` was measured on.
ONE_BYTE_SHARED_CHUNK = 1.65


# --------------------------------------------------------------------------- tile geometry


@functools.lru_cache(maxsize=None)
def _block_m(M: int) -> int:
    """The launcher's block_m for M rows (1: the GEMV body). Cached: the search asks it of
    every candidate, and each answer builds a config (a third of a batch-8 search's time)."""
    return linear_config(M, DOT_MIN, DOT_MIN, torch.bfloat16).block_m


@functools.lru_cache(maxsize=None)
def _tile_rows_for(M: int, block_n: int = DOT_MIN) -> int:
    """Rows of x per tile of ``block_n`` weight rows, by the launcher's own rule (1 for the
    GEMV body, else tl.dot tiles: 8 for weight-major ones)."""
    return tile_rows(LinearConfig(_block_m(M), max(block_n, DOT_MIN), DOT_MIN), M)


def _pow2s(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def whole_range_stages(K: int, block_k: int, split_k: int = 1) -> int:
    """Ring depth that holds a task's whole K range (K / split_k) in BLOCK_K chunks."""
    return math.ceil(math.ceil(K / split_k) / block_k)


def gemv_chunk_fits(block_n: int, block_k: int, dtype_bytes: int = 2, num_warps: int = GEMV_WARPS) -> bool:
    """Whether a register-path GEMV chunk of ``block_n x block_k`` stays within
    :data:`GEMV_REG_CHUNK_BYTES` a thread."""
    return block_n * block_k * dtype_bytes <= GEMV_REG_CHUNK_BYTES * 32 * num_warps


def linear_tiles_n(node, choice: OpChoice) -> tuple[int, int]:
    """(row blocks, tiles along N) of a linear under the choice."""
    d = node.dims
    if choice.block_n < 1:
        raise ValueError(f"op {node.name}: a linear needs block_n >= 1, got {choice.block_n}")
    if choice.tiles_per_task < 1:
        raise ValueError(f"op {node.name}: tiles_per_task must be >= 1, got {choice.tiles_per_task}")
    return math.ceil(d["M"] / _tile_rows_for(d["M"], choice.block_n)), math.ceil(d["N"] / choice.block_n)


def reduce_width(node, choice: OpChoice) -> int:
    """Columns of a split-K linear's reduce tiles (:attr:`OpChoice.reduce_block_n`)."""
    width = choice.reduce_block_n or choice.block_n
    if width < 1 or choice.block_n % width:
        raise ValueError(f"op {node.name}: reduce_block_n must divide block_n={choice.block_n}, "
                         f"got {choice.reduce_block_n}")
    return width


def node_format(node) -> WeightFormat:
    """The format of a linear op's weight (its dims' ``w_format``; plain without one)."""
    return weight_format(node.dims.get("w_format", "plain"))


def weight_element_bytes(node, dtype_bytes: int) -> int:
    """Bytes of an element of the op's stored weight (the model's ``dtype_bytes``, or its format's)."""
    return node_format(node).element_bytes(dtype_bytes)


def decode_dot_tile(node) -> bool:
    """Whether a linear runs decode tl.dot tiles: a batch of 2..SKINNY_MAX_M rows."""
    return node.kind == "linear" and 1 < node.dims["M"] <= SKINNY_MAX_M


def xmajor_decode_tile(node, choice: OpChoice) -> bool:
    """Whether a linear's tasks are x-major decode tl.dot tiles (the device's ``xmajor_dot_bandwidth``):
    a decode batch in boxes too narrow for weight-major (else ``dot_worker_bandwidth``)."""
    return decode_dot_tile(node) and not weight_major(_tile_rows_for(node.dims["M"], choice.block_n), choice.block_n)


def dot_tile_waits_in_stream(node, choice: OpChoice) -> bool:
    """Whether a linear's decode tl.dot tiles wait for x inside their TMA weight loop, the
    ring's prologue in flight during the wait (:func:`mk.tasks.linear.dot_waits_in_stream`).
    Measured in the 1B batch-8 step on an H200, weight-major
    partials after their wait: QKV 5.6 -> 4.2 us, O projection 5.0 -> 3.6, gate/up 19.4 ->
    17.5, down 12.8 -> 12.0."""
    return decode_dot_tile(node) and dot_waits_in_stream(_tile_rows_for(node.dims["M"], choice.block_n),
                                                         choice.block_n, choice.tma_stages, choice.tiles_per_task)


def _gemv_stream(node, choice: OpChoice, dtype_bytes: int = 2):
    """How a GEMV linear's tasks stream under the choice (:func:`mk.tasks.linear.gemv_stream`)."""
    return gemv_stream(1, choice.tma_stages, node.dims["K"], choice.block_k, choice.block_n, dtype_bytes,
                       choice.split_k, choice.tiles_per_task)


def one_byte_x_floor(node, choice: OpChoice, device, busy: int) -> float:
    """The least seconds a GEMV task (batch 1) of one-byte weights takes for its chunks' x
    reads; 0 for other tasks, and while no two of the ``busy`` workers share an SM.

    Why: a thread holds 16-byte vectors of a chunk's rows, 16 one-byte weights a vector, so
    it reads 16 float32 x values a chunk (a 16-bit weight's thread 8), however many rows the
    box has. Two workers of an SM take turns at those reads: a chunk then takes
    :data:`ONE_BYTE_SHARED_CHUNK` x ``chunk_overhead_s`` however few rows it carries. The FP8
    GEMV probe (H200, fraction of the copy bandwidth with 264 workers): 8 x 256 boxes 0.29,
    16 x 256 0.54-0.60, 32 x 256 0.92-0.98, 64 x 256 0.98-1.02; 16 x 256 with x out of the loop
    1.00. One worker an SM streamed 16 x 256 boxes at 13 GB/s, 64 x 256 at 30.5, which the
    ring's own limits (load latency, chunk overhead, worker rate) already price."""
    d = node.dims
    if d["M"] != 1 or weight_element_bytes(node, 2) != 1 or busy <= device.sm_count:
        return 0.0
    chunks = math.ceil(math.ceil(d["K"] / choice.split_k) / choice.block_k) * choice.tiles_per_task
    return chunks * ONE_BYTE_SHARED_CHUNK * device.chunk_overhead_s


def _x_task_bytes(node, choice: OpChoice) -> int:
    """Bytes of x one task of a linear reads (float32, its rows over its K range, padded to
    the tensor-core tile's rows, once for each tile of its run)."""
    d = node.dims
    return (_tile_rows_for(d["M"], choice.block_n) * math.ceil(d["K"] / choice.split_k) * ACTIVATION_BYTES
            * choice.tiles_per_task)


# --------------------------------------------------------------------------- candidates


def _narrow_reduce(node, c: OpChoice, workers: int) -> OpChoice | None:
    """A split-K choice with its reduce tiles as narrow as one wave of ``workers`` allows
    (:attr:`OpChoice.reduce_block_n`, down to :data:`REDUCE_MIN_COLS`), or None where they
    cannot be narrower. A reduce reads split_k float32 partials a column: the 1B batch-8
    O projection's 16 reduce tasks of 128 columns (split 16, 64 KiB each) took 2.9 us, the
    gate_up's 128 of 64 (split 2) 1.4 (H200 trace)."""
    if c.split_k == 1:
        return None
    blocks = linear_tiles_n(node, c)[0]
    width = c.block_n
    while (width // 2 >= REDUCE_MIN_COLS and c.block_n % (width // 2) == 0
           and blocks * math.ceil(node.dims["N"] / (width // 2)) <= workers):
        width //= 2
    return replace(c, reduce_block_n=width) if width < c.block_n else None


def _single_tiles(node, device, dtype_bytes: int) -> list[OpChoice]:
    """The tiles the search tries for a linear, one tile a task."""
    d = node.dims
    out = []
    skinny = d["M"] > 1
    # GEMV weights stream through the TMA ring where there is one (Hopper on): in the
    # whole 1B step on an H200, register-path tiles ran at 4-7 GB/s a worker against
    # 25-28 GB/s for TMA 32 x 256 tiles (H200).
    # Skinny tl.dot tiles (batch > 1) too: pipelined plain loads kept a worker near 10 GB/s,
    # the batch-8 step 2-3x its batch-1 time.
    tma = device.compute_capability >= (9, 0) and (d["K"] * dtype_bytes) % 16 == 0
    register_block_ns = [] if tma else _pow2s(16 if skinny else 2, 64 if skinny else 32)
    for block_n in register_block_ns:
        for block_k in _pow2s(128 if skinny else 256, 256 if skinny else 2048):
            if block_k > 2 * d["K"]:
                continue
            if not skinny and not gemv_chunk_fits(block_n, block_k, dtype_bytes):
                continue
            for split_k in (1, 2, 4):
                if math.ceil(d["K"] / block_k) < split_k:
                    continue
                for stages in ((2, 3, 4) if skinny else (1,)):
                    out.append(OpChoice(block_n=block_n, block_k=block_k, split_k=split_k, stages=stages,
                                        num_warps=2 if skinny else GEMV_WARPS))
    if tma:  # TMA-streamed tiles: a 4-deep ring, or the task's whole K range
        # 64-row boxes measured 17.5 GB/s a worker on the 1B LM head, 32-row 28 GB/s.
        # Decode batches (skinny) take wider boxes: each tile re-reads its float32 x rows
        # ([16, block_k] a chunk), so more weight rows a chunk carry them further; a
        # 3-deep ring is what fits a 99 KiB budget, 6 deep keeps narrow-K chunks in flight.
        # 8-row GEMV boxes give the 2048-row projections of a 1B-sized layer 256 tasks
        # instead of 128 (1B step 1.009 -> 0.998 ms on an H200).
        shapes = ([(64, 128), (64, 256), (128, 64), (128, 128), (256, 64)] if skinny
                  else [(8, 256), (16, 256), (32, 256)])
        if not skinny and dtype_bytes == 1:
            # A box is at most 256 elements a side: one-byte weights keep a chunk's bytes in
            # taller boxes.
            shapes += [(64, 256)]
        # A box no wider than K (a wider one only moves zeros; the op then streams without TMA).
        narrow = max(16, 1 << (d["K"].bit_length() - 1))  # the widest power of two within K
        shapes = list(dict.fromkeys((bn, min(bk, narrow)) for bn, bk in shapes))
        for block_n, block_k in shapes:
            # Decode batches split K up to 16 ways: a 2048-row projection has only 16
            # weight-major tiles (1B batch-8 down, split 8 -> 16: 1.307 -> 1.276 ms on an H100).
            for split_k in ((1, 2, 4, 8, 16) if skinny else (1, 2, 4, 8)):
                if math.ceil(d["K"] / block_k) < split_k:
                    continue
                # (GEMV rings of 8 measured slower in the 1B step than 4 for the 8-row o_proj/down
                # tiles, though a lone 128256 x 2048 GEMV of 8-row boxes
                # streamed at 0.96 of the copy bandwidth with 8 against 0.81 with 4.)
                rings = (3, 4, 6) if skinny else (4,)
                # Grouped GEMV streams (mk.tasks.linear.gemv_stream): two groups in flight.
                grouped = 1 + 2 * X_GROUP
                if not skinny and gemv_stream(1, grouped, d["K"], block_k, block_n, dtype_bytes, split_k).group > 1:
                    rings = (4, grouped)
                whole = whole_range_stages(d["K"], block_k, split_k)  # saves shared memory on short ranges
                for ring in sorted({*rings, whole} if skinny or whole < max(rings) else set(rings)):
                    out.append(OpChoice(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=GEMV_WARPS,
                                        tma_stages=ring))
    fmt = node_format(node)
    if fmt.scales == "block":  # a chunk within one 128-column block of scales
        out = list(dict.fromkeys(replace(c, block_k=min(c.block_k, SCALE_BLOCK)) for c in out))
    if fmt.quantized and not skinny:  # an e4m3 GEMV multiplies on the tensor cores: 16 rows at least
        out = [c for c in out if c.block_n >= 16]
    if fmt.quantized and skinny:
        # x-major tiles would widen each FP8 weight chunk to bfloat16 through shared memory
        # for the MMA's right operand, which the shared-memory model does not count: only
        # weight-major tiles (the chunk the MMA's left operand, widened in registers).
        out = [c for c in out if not xmajor_decode_tile(node, c)]
    return out


# --------------------------------------------------------------------------- the kind


class LinearKind(OpKind):
    """A linear ``y = x @ W.T`` of a decode step, with what its tiles carry (module docstring)."""

    kind = "linear"

    def candidates(self, node, device, dtype_bytes: int = 2, workers: int | None = None) -> list[OpChoice]:
        dtype_bytes = weight_element_bytes(node, dtype_bytes)
        """Every tile the search tries (before the shared-memory check). With ``workers``, a
        TMA-fed GEMV (M = 1) with more tasks than workers also gets each tile as runs of
        adjacent tiles (:attr:`OpChoice.tiles_per_task`), one run a worker. (A run of
        register tiles has no double buffering, so only the ring's tiles get runs. Runs of
        tl.dot tiles work too, but measured no gain at batch 8: the 1B LM head as runs of
        four 128-row tiles, 1.382 ms a step against 1.363 one tile a task; H200.)"""
        d = node.dims
        singles = _single_tiles(node, device, dtype_bytes)
        if workers is None:
            return singles
        singles += [n for n in (_narrow_reduce(node, c, workers) for c in singles) if n is not None]
        if d["M"] > 1:
            return singles
        runs = []
        for c in singles:
            tiles = math.ceil(d["N"] / c.block_n)
            if not c.tma_stages or tiles * c.split_k <= workers:
                continue
            run = math.ceil(tiles * c.split_k / workers)
            # Runs are there to give every worker one even share; a run length that leaves
            # workers idle streams slower than the model's share of DRAM says (8B gate_up as
            # 224 runs of four 32-row tiles: +6 us a layer against 256 runs of seven 16-row
            # tiles, H200).
            if math.ceil(tiles / run) * c.split_k >= RUN_MIN_BUSY * workers:
                runs.append(replace(c, tiles_per_task=run))
        return singles + runs

    def naive_choice(self, node) -> OpChoice:
        return OpChoice(block_n=16, block_k=256, num_warps=4)

    def smem_bytes(self, node, choice: OpChoice, dtype_bytes: int = 2) -> int:
        """One task's, in the megakernel (:func:`mk.tasks.linear.linear_smem_bytes`): with a
        fused RMSNorm its weight chunks ride beside the ring's."""
        dtype_bytes = weight_element_bytes(node, dtype_bytes)
        d = node.dims
        config = LinearConfig(_block_m(d["M"]), max(choice.block_n, 1), max(choice.block_k, 1),
                              split_k=choice.split_k, num_warps=choice.num_warps)
        task = MegakernelTile(d["K"], choice.tma_stages, any(f.endswith("norm") for f in choice.fuse),
                              choice.split_k, choice.tiles_per_task, ACTIVATION_BYTES)
        return linear_smem_bytes(config, d["M"], dtype_bytes, task)

    def describe(self, c: OpChoice) -> str:
        return (f"BN={c.block_n} BK={c.block_k} split_k={c.split_k} "
                + (f"tma_ring={c.tma_stages}" if c.tma_stages else f"stages={c.stages}") + f" warps={c.num_warps}"
                + (f" run={c.tiles_per_task}" if c.tiles_per_task > 1 else "")
                + (f" reduce_bn={c.reduce_block_n}" if c.reduce_block_n else ""))

    def slows_kernel(self, node, choice: OpChoice) -> bool:
        return xmajor_decode_tile(node, choice)

    def may_slow_kernel(self, node) -> bool:
        return decode_dot_tile(node)

    # ------------------------------------------------------------------ cost

    def bytes_flops(self, node, choice: OpChoice) -> tuple[int, int]:
        if choice.split_k > 1:  # the float32 workspace, written then read back
            d = node.dims
            plain, split = linear_cost(d["M"], d["N"], d["K"]), linear_cost(d["M"], d["N"], d["K"],
                                                                               split_k=choice.split_k)
            return node.bytes + split.bytes - plain.bytes, node.flops + split.flops - plain.flops
        return node.bytes, node.flops

    def phases(self, node, choice: OpChoice, nbytes: int = 0, fused: list = ()) -> list[tuple[int, int]]:
        """The tiles (or runs of tiles) one phase; split-K: the partials, then the reduces
        reading the float32 workspace back; then what fused ops add after (the argmax's
        token append)."""
        counts = _spec_counts(self, node, choice, fused)
        tail = [p for f in fused for p in _kind(f).host_tail_phases(f)]
        if choice.split_k == 1:
            return [(counts[0], nbytes)] + tail
        d = node.dims
        workspace = d["M"] * d["N"] * choice.split_k * 4
        return [(counts[0], nbytes - workspace), (counts[1], workspace)] + tail

    def phase_terms(self, node, choice: OpChoice, device, phase: int, phase_tasks: int, phase_bytes: int,
                    dtype_bytes: int = 2) -> PhaseTerms:
        dtype_bytes = weight_element_bytes(node, dtype_bytes)
        tma = choice.tma_stages > 0
        if phase != 0:
            return PhaseTerms(tma=tma)
        task_bytes = None
        if choice.tiles_per_task > 1:
            # A full run's bytes (the last run of a row block may be shorter).
            blocks, tiles_n = linear_tiles_n(node, choice)
            task_bytes = max(phase_bytes, 0) * choice.tiles_per_task / (blocks * tiles_n * choice.split_k)
        # A linear tile also streams its x rows over its K range (from L2, not DRAM), through
        # the same worker: at batch 8 a [16, 256] float32 x chunk is as big as a 32-row bf16
        # weight chunk, which halved what each worker's ring carried of weights (1B: 2.19 ms
        # with 32-row tiles, 1.51 with 128-row; 8B: 15.8 and 6.2).
        return PhaseTerms(task_bytes=task_bytes, reread=_x_task_bytes(node, choice),
                          ring_s=self.ring_seconds_per_byte(node, choice, device, dtype_bytes), tma=tma)

    def ring_seconds_per_byte(self, node, choice: OpChoice, device, dtype_bytes: int = 2) -> float:
        """The least time the TMA ring spends per weight byte (the device's
        ``ring_seconds_per_byte``: tma_stages - 1 chunks in flight, one with a 1-deep ring);
        0 without the ring."""
        if not choice.tma_stages:
            return 0.0
        chunk = choice.block_n * choice.block_k * dtype_bytes
        in_flight = _gemv_stream(node, choice, dtype_bytes).chunks_in_flight if node.dims["M"] == 1 else \
            max(choice.tma_stages - 1, 1)
        return device.ring_seconds_per_byte(in_flight * chunk, chunk)

    def stream_floor(self, node, choice: OpChoice, device, phase: int, stream: float, task_bytes: float,
                     phase_tasks: int, busy: int) -> float:
        """A decode tl.dot tile's partials stream no faster than its tensor-core rate; a GEMV
        task of one-byte weights no faster than its x reads (:func:`one_byte_x_floor`)."""
        if phase == 0 and decode_dot_tile(node):
            dot_rate = device.xmajor_dot_bandwidth if xmajor_decode_tile(node, choice) else device.dot_worker_bandwidth
            return max(stream, task_bytes / dot_rate) if dot_rate else stream
        if phase == 0:
            return max(stream, one_byte_x_floor(node, choice, device, busy))
        return stream

    def prologue_seconds(self, node, choice: OpChoice, device, stream_s: float, dtype_bytes: int = 2) -> float:
        """The part of a task's weight stream (``stream_s`` seconds) that arrives while it
        waits for its inputs, where DRAM idles then: a GEMV task that waits inside its TMA
        stream has the ring's first chunks in flight before the wait
        (:func:`mk.tasks.linear.gemv_stream`), a whole-range ring all of them, and so does a
        weight-major decode tl.dot tile (:func:`dot_tile_waits_in_stream`). Where chunks are
        left to ask for, the next is asked for only after the wait (when the first frees its
        slot), so at least one ``load_latency_s`` stays after the wait. 0 for other tasks.
        Measured (1B on an H100): the O projection's tasks after attention took 4.2 us with
        3 of their 8 chunks in flight before the wait, 3.9 with 7, 3.1 with all 8."""
        dtype_bytes = weight_element_bytes(node, dtype_bytes)
        if not choice.tma_stages:
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

    def exposed_seconds(self, node, choice: OpChoice, device, task_bytes: float, dtype_bytes: int = 2) -> float:
        """What a task of ``task_bytes`` weight bytes spends on its TMA ring beyond its
        stream: where it waits for its inputs before its stream (not inside it), the first
        chunk's ``load_latency_s``, which a wait inside the stream overlaps; and for a GEMV
        task ``chunk_exposed_s`` a chunk (measured on GEMV rings; tl.dot tiles' rates carry
        their work a chunk). Decode tl.dot tiles wait inside their stream when weight-major
        (:func:`dot_tile_waits_in_stream`)."""
        dtype_bytes = weight_element_bytes(node, dtype_bytes)
        if not choice.tma_stages:
            return 0.0
        if decode_dot_tile(node):
            # A ring of one has nothing in flight before the wait (its prologue is empty).
            return 0.0 if dot_tile_waits_in_stream(node, choice) and choice.tma_stages > 1 else device.load_latency_s
        if node.dims["M"] != 1:
            return 0.0
        ramp = 0.0 if _gemv_stream(node, choice, dtype_bytes).waits else device.load_latency_s
        return task_bytes / (choice.block_n * choice.block_k * dtype_bytes) * device.chunk_exposed_s + ramp

    # ------------------------------------------------------------------ specs and lowering

    def specs(self, node, choice: OpChoice, fused: list = ()) -> list[tuple[object, int | None]]:
        # (A QKV with a bias lowers only with its RoPE fused; the search prices it alone first.)
        return [(spec, None) for spec in self._specs(node, choice, fused, torch.bfloat16, 1e-5, 1, first_rope=False,
                                                       greedy=True, lowering=False)]

    def _specs(self, node, choice: OpChoice, fused: list, dtype, eps: float, max_seq: int, first_rope: bool,
               greedy: bool, lowering: bool = True) -> list:
        """The specs of the op with ``fused`` folded in: one (whole-K tiles, or with RoPE +
        KV append fused, qkv_rope_kv tiles), or split-K partials and their reduce
        (qkv_rope_kv_reduce with RoPE); an LM head with the argmax fused (``greedy``) folds
        each row's argmax into one word a row. ``lowering`` False: for their tiles only (a
        projection's bias is then no reason to refuse)."""
        d = node.dims
        M, N, K = d["M"], d["N"], d["K"]
        kinds = {f.kind: f for f in fused}
        norm, add, silu, rope, ar = (kinds.get(k) for k in ("rmsnorm", "add", "silu_mul", "rope_kv", "all_reduce"))
        argmax = greedy and "argmax" in kinds
        others = [f.name for f in fused if f.kind != "argmax"]
        if rope is not None and (add is not None or silu is not None):
            raise ValueError(f"lower_decode_step: op {node.name} fuses {rope.name} and {others}: "
                             f"RoPE fuses only into a QKV linear, beside its RMSNorm")
        if lowering and rope is None and "bias" in node.buffers:
            raise ValueError(f"lower_decode_step: op {node.name} has a bias, which only the QKV tiles with RoPE "
                             f"fused add (the plan must fuse its RoPE)")
        if argmax and (choice.split_k != 1 or rope is not None):
            raise ValueError(f"lower_decode_step: op {node.name} fuses the argmax with split_k={choice.split_k}"
                             f"{' and RoPE' if rope is not None else ''}: only whole-K LM head tiles fold "
                             f"the argmax")
        tiles = dict(block_n=choice.block_n, block_k=choice.block_k, num_warps=choice.num_warps, dtype=dtype,
                     w_scale=node_format(node).scale_code)
        # How a tile streams its weights: the choice's TMA ring; register GEMV tiles (M = 1)
        # also prefetch PREFETCH_K columns into L2 ahead of their wait.
        gemv = (dict(tma_stages=0, prefetch_k=min(PREFETCH_K, K)) if M == 1 and not choice.tma_stages
                else dict(tma_stages=choice.tma_stages))
        run = dict(tiles_per_task=choice.tiles_per_task)  # the reduces stay one tile a task
        norm_kw = dict(norm=norm is not None, eps=eps)
        heads = {}
        if rope is not None:
            r = rope.dims
            heads = dict(num_q_heads=r["heads"], num_kv_heads=r["kv_heads"], head_dim=r["head_dim"], K=K,
                         max_seq=max_seq, write_seqlens=first_rope)
            # The family options: the projection's bias, the q / k norm before the rotation.
            heads |= {"bias": True} if "bias" in node.buffers else {}
            heads |= {"qk_norm": True, "qk_eps": eps} if r.get("qk_norm") else {}
        flags = dict(residual=add is not None, silu_mul=silu is not None)
        if ar is not None:
            flags["all_reduce"] = ar.dims["world"]
        if argmax:
            flags["argmax"] = True
        try:
            if choice.split_k == 1:
                return [make_op("qkv_rope_kv", batch=M, **heads, **norm_kw, **tiles, **gemv, **run) if rope is not None
                        else make_op("linear", M=M, N=N, K=K, **flags, **norm_kw, **tiles, **gemv, **run)]
            # Split-K: the partials, then reduce tiles that run the epilogue (RoPE's too).
            part = make_op("linear_partial", M=M, N=N, K=K, split_k=choice.split_k, **norm_kw, **tiles, **gemv,
                           **run)
            # (NORM_SQ partials hand the RMSNorm's rstd to the reduce, with their x**2 sums in ws.)
            sq = dict(norm_sq=bool(part.constexprs["NORM_SQ"]), eps=eps)
            # (Reduce tiles may be narrower than the partials': several a partial tile.)
            red_tiles = dict(tiles, block_n=reduce_width(node, choice), part_block_n=choice.block_n)
            del red_tiles["w_scale"]  # (the partials finish their products; the reduce sums them)
            red = (make_op("qkv_rope_kv_reduce", batch=M, **heads, split_k=choice.split_k, **sq, **red_tiles)
                   if rope is not None else
                   make_op("linear_reduce", M=M, N=N, K=K, split_k=choice.split_k, **flags, **sq, **red_tiles))
            return [part, red]
        except ValueError as err:
            raise ValueError(f"lower_decode_step: op {node.name} ({M}x{N}x{K}) with {choice}: {err}") from None

    def buffer_shape(self, node, role: str, max_seq: int):
        d, fmt = node.dims, node_format(node)
        if role == "w":  # (FP8 as on a GPU: the meta buffers describe a GPU's step)
            return (d["N"], d["K"]), torch.float8_e4m3fn if fmt.quantized else "weight"
        if role == "w_scale":
            return fmt.scale_shape(d["N"], d["K"]), torch.float32
        if role == "bias":
            return (d["N"],), "weight"
        return super().buffer_shape(node, role, max_seq)

    def lower(self, node, choice: OpChoice | None, ctx) -> None:
        """The tiles of the op and of what is fused into it (:meth:`_specs`), bound to the
        step's buffers."""
        d = node.dims
        M, N = d["M"], d["N"]
        nodes = ctx.nodes
        fused_all = [nodes[f] for f in choice.fuse]
        fused = [f for f in fused_all if f.kind != "argmax"]
        kinds = {f.kind: f for f in fused}
        norm, add, silu, rope, ar = (kinds.get(k) for k in ("rmsnorm", "add", "silu_mul", "rope_kv", "all_reduce"))
        greedy = ctx.next_token == GREEDY
        argmax = greedy and any(f.kind == "argmax" for f in fused_all)
        x = norm.inputs[0] if norm is not None else node.inputs[0]
        out_name, out_cols = node.outputs[0], N
        if silu is not None:
            out_name, out_cols = silu.outputs[0], N // 2
        if add is not None:
            out_name = add.outputs[0]
        bind = {"x": x, "w": node.buffers["w"]} | ({"w_scale": node.buffers["w_scale"]} if "w_scale" in node.buffers
                                                    else {})
        if norm is not None:
            bind["norm_w"] = norm.buffers["w"]
        first = rope is not None and ctx.first(rope)
        specs = self._specs(node, choice, fused_all if greedy else fused, ctx.dtype(node.buffers["w"]), ctx.eps,
                            ctx.max_seq, first, greedy)
        # What the tile's epilogue (or, split-K, the reduce's) writes and reads besides x and w.
        epilogue = {}
        if rope is not None:
            r = rope.dims
            epilogue.update(pos="pos", inv_freq=rope.buffers["inv_freq"],
                            q=ctx.activation(rope.outputs[0], M, r["heads"] * r["head_dim"]),
                            k_cache=rope.buffers["k_cache"], v_cache=rope.buffers["v_cache"])
            epilogue |= {"bias": node.buffers["bias"]} if "bias" in node.buffers else {}
            epilogue |= {role: rope.buffers[role] for role in ("q_norm", "k_norm") if role in rope.buffers}
            if first:
                epilogue["seqlens"] = ctx.activation("seqlens", M, dt=torch.int32)
        else:
            if add is not None:
                epilogue["res"] = next(t for t in add.inputs if t not in node.outputs)
            epilogue["out"] = ctx.activation(out_name, M, out_cols)
            if ar is not None:  # the tiles (split-K: the reduces) store their partials, then sum them over the ranks
                epilogue.update(res=ar.inputs[1], total=ctx.activation(ar.outputs[0], M, N), recv=ar.buffers["recv"],
                                peers=ar.buffers["peers"])
        if argmax:
            epilogue["best"] = ctx.activation("argmax.best", M, dt=torch.int64)
        numbered = {"hop": ar} if ar is not None else None  # (the tiles that sum over the ranks)
        if len(specs) == 1:
            ctx.add(node.name, specs[0], numbered=numbered, **bind, **epilogue)
            return
        part, red = specs
        ws = ctx.activation(f"{node.name}.ws", choice.split_k, M, part.constexprs["WS_N"])
        ctx.add(node.name, part, **bind, ws=ws)  # (the scales bind to the partials)
        ctx.add(node.name, red, numbered=numbered, ws=ws, **epilogue)


LINEAR = register_kind(LinearKind())


class AddKind(FusedOnlyKind):
    """The residual add of a decode step: only ever a linear's epilogue."""

    kind = "add"
    hosts = frozenset({"linear"})


ADD = register_kind(AddKind())


def _kind(node) -> OpKind:
    from .._planning import op_kind

    return op_kind(node.kind)


def _spec_counts(kind: OpKind, node, choice: OpChoice, fused: list) -> list[int]:
    from .._planning import spec_task_counts

    return spec_task_counts(kind, node, choice, fused)
