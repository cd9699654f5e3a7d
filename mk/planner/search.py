"""Beam search over each op's tiling and fusion choices, in DAG order.

A state is a partial plan over the ops seen so far. For each op the search tries every
candidate :class:`~mk.planner.cost.OpChoice` that fits the shared-memory budget, and the
fusions the kernels support (an RMSNorm into the next linear's prologue, SiLU·mul into the
gate/up linear's epilogue, a residual add into the O-proj or down linear's epilogue); it
keeps the ``beam_width`` cheapest partial plans by predicted time (peak shared memory
breaks ties, then the choices themselves, so the result is deterministic). The search
returns its ``top_k`` complete plans, cheapest first.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Callable

from mk.persistent.graph import collector_paused
from mk.tasks.linear import X_GROUP, gemv_stream
from mk.tasks.linear.config import DOT_MIN
from mk.tasks.qkv_rope import check_qkv_rope_tile

from .cost import (OpChoice, decode_dot_tile, estimate_op, estimate_step, idle_wait_ops, linear_tiles_n,
                   reduce_width, whole_range_stages, xmajor_decode_tile)
from .device import DeviceSpec
from .graph import OpGraph, OpNode
from .simulate import SCHEDULES, simulate_schedules

#: (kind of the fused op, kind of its host): what the task bodies can do in one tile. RoPE
#: + KV append fuses into a QKV linear's tiles, or its split-K reduce (:mod:`mk.tasks.qkv_rope`);
#: the argmax into the LM head's whole-K tiles, which fold each row's best into one word
#: (:func:`mk.tasks.argmax.argmax_tile_into`), leaving only the token append; a tensor-parallel
#: all-reduce into the whole-K tiles of the projection whose partials it sums (each task meets
#: the other ranks on its own columns) or split-K reduce tiles, or it runs as its own tiles after them.
SUPPORTED_FUSIONS = {("rmsnorm", "linear"), ("silu_mul", "linear"), ("add", "linear"), ("rope_kv", "linear"),
                     ("argmax", "linear"), ("all_reduce", "linear")}

#: Kinds that have no task of their own in a decode step and so must fuse into their host:
#: the residual add (the runtime's epilogue), and SiLU·mul (the gate/up weights are
#: interleaved, which only the linear epilogue reads).
MUST_FUSE = {"add", "silu_mul"}


@dataclass
class Plan:
    """A complete plan: one choice per op that is not fused, the workers' queue schedule,
    what the model predicts, and (``measure`` mode, :func:`pick_measured`) the step time
    measured on the GPU.

    ``predicted_s`` is the simulated step under ``schedule``
    (:mod:`mk.planner.simulate`); ``schedule_s`` the simulated step under each schedule.
    """

    model: str
    batch: int
    kv_len: int
    device: str
    workers: int
    choices: dict[str, OpChoice]
    predicted_s: float
    peak_smem_bytes: int
    estimates: list = field(default_factory=list, repr=False)
    measured_s: float | None = None
    schedule: str = "round_robin"
    schedule_s: dict[str, float] = field(default_factory=dict)

    def __repr__(self) -> str:  # (the choices, one per op, are what explain() lists)
        return (f"Plan({self.model}, batch {self.batch}, KV {self.kv_len}, on {self.device}, {self.workers} workers: "
                f"{self.predicted_s * 1e3:.3f} ms predicted, {len(self.choices)} op choices; explain() lists them)")

    def explain(self) -> str:
        """One line per op: its tile, tasks, shared memory and predicted µs."""
        lines = [f"plan for {self.model}, batch {self.batch}, KV {self.kv_len}, on {self.device} "
                 f"({self.workers} workers): {self.predicted_s * 1e3:.3f} ms predicted"
                 + (f", {self.measured_s * 1e3:.3f} ms measured" if self.measured_s is not None else "")
                 + f", peak shared memory {self.peak_smem_bytes / 1024:.1f} KiB"]
        if self.schedule_s:
            lines.append(f"  queues: {self.schedule} (simulated: "
                         + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.schedule_s.items()) + ")")
        for e in self.estimates:
            c = self.choices[e.name]
            tile = (f"BN={c.block_n} BK={c.block_k} split_k={c.split_k} "
                    + (f"tma_ring={c.tma_stages}" if c.tma_stages else f"stages={c.stages}") + f" warps={c.num_warps}"
                    + (f" run={c.tiles_per_task}" if c.tiles_per_task > 1 else "")
                    + (f" reduce_bn={c.reduce_block_n}" if c.reduce_block_n else "")
                    if e.kind == "linear" else f"kv_splits={c.kv_splits}" if e.kind == "attention"
                    else "the op's column tiles, over the ranks" if e.kind == "all_reduce"
                    else "the runtime's row tiles")
            fused = f" + fused {', '.join(c.fuse)}" if c.fuse else ""
            lines.append(f"  {e.name:<20} {e.kind:<9} {tile:<48} {e.tasks:>6} tasks "
                         f"{e.smem_bytes / 1024:6.1f} KiB {e.seconds * 1e6:8.2f} us{fused}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "batch": self.batch, "kv_len": self.kv_len, "device": self.device,
                           "workers": self.workers, "predicted_s": self.predicted_s,
                           "measured_s": self.measured_s, "peak_smem_bytes": self.peak_smem_bytes,
                           "schedule": self.schedule, "schedule_s": self.schedule_s,
                           "choices": {k: v.to_dict() for k, v in self.choices.items()}}, indent=1)

    @classmethod
    def from_json(cls, text: str, graph: OpGraph | None = None, device: DeviceSpec | None = None) -> "Plan":
        """Read :meth:`to_json`'s output; with the graph and device, the per-op estimates too."""
        d = json.loads(text)
        choices = {k: OpChoice(**{**v, "fuse": tuple(v["fuse"])}) for k, v in d["choices"].items()}
        plan = cls(d["model"], d["batch"], d["kv_len"], d["device"], d["workers"], choices, d["predicted_s"],
                   d["peak_smem_bytes"], measured_s=d.get("measured_s"), schedule=d["schedule"],
                   schedule_s=d["schedule_s"])
        if plan.schedule not in SCHEDULES:
            raise ValueError(f"plan JSON: unknown schedule {plan.schedule!r}")
        if graph is not None and device is not None:
            plan.estimates = estimate_step(graph, choices, device, plan.workers).ops
        return plan


def _pow2s(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


#: Register bytes per thread a GEMV tile's weight chunk may take. The register path keeps
#: two chunks in flight (double buffering), and every op of the megakernel shares one
#: register allocation, the largest any variant needs: a 32 x 1024 bf16 chunk (256
#: registers a thread for two) made the 1B step spill 546 registers and run 5x its floor.
GEMV_REG_CHUNK_BYTES = 256
#: Persistent workers per SM when the caller does not fix the count.
WORKERS_PER_SM = 2
#: Runs of tiles (OpChoice.tiles_per_task) must keep at least this share of the workers busy.
RUN_MIN_BUSY = 0.95
#: Warps of the GEMV tiles (the megakernel runs all its ops with the widest variant's warps).
GEMV_WARPS = 4


def gemv_chunk_fits(block_n: int, block_k: int, dtype_bytes: int = 2, num_warps: int = GEMV_WARPS) -> bool:
    """Whether a register-path GEMV chunk of ``block_n x block_k`` stays within
    :data:`GEMV_REG_CHUNK_BYTES` a thread."""
    return block_n * block_k * dtype_bytes <= GEMV_REG_CHUNK_BYTES * 32 * num_warps


#: The narrowest split-K reduce tile (columns): [8 rows, 32 columns] is two floats a thread.
REDUCE_MIN_COLS = 32


def _narrow_reduce(node: OpNode, c: OpChoice, workers: int) -> OpChoice | None:
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


def candidates(node: OpNode, device: DeviceSpec, dtype_bytes: int = 2, workers: int | None = None) -> list[OpChoice]:
    """Every choice the search tries for ``node`` (before the shared-memory check). With
    ``workers``, a TMA-fed GEMV (M = 1) with more tasks than workers also gets each tile as
    runs of adjacent tiles (:attr:`OpChoice.tiles_per_task`), one run a worker. (A run of
    register tiles has no double buffering, so only the ring's tiles get runs. Runs of tl.dot
    tiles work too, but measured no gain at batch 8: the 1B LM head as runs of four
    128-row tiles, 1.382 ms a step against 1.363 one tile a task; H200.)"""
    d = node.dims
    if node.kind == "linear":
        singles = _linear_candidates(node, device, dtype_bytes)
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
    if node.kind == "attention":
        return [OpChoice(kv_splits=s) for s in (1, 2, 4, 8, 16) if s <= max(1, d["kv_len"] // 32)]
    return [OpChoice()]  # row-wise ops: one task a row (the runtime's tiles), nothing to choose


def _linear_candidates(node: OpNode, device: DeviceSpec, dtype_bytes: int) -> list[OpChoice]:
    """The tiles :func:`candidates` tries for a linear, one tile a task."""
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
                # tiles, sessions 9 and 11, though a lone 128256 x 2048 GEMV of 8-row boxes
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
    return out


@dataclass(frozen=True)
class _State:
    cost: float
    peak_smem: int
    choices: tuple  # ((op name, OpChoice), ...) in DAG order
    pending: tuple = ()  # ops waiting to be fused into a later linear (RMSNorm prologues)
    order: tuple = ()  # the option index taken at each op: a deterministic tie-break

    def key(self):
        return (self.cost, self.peak_smem, self.order)


def _find(choices: tuple, name: str):
    """The choice of op ``name`` (hosts are a few ops back: scan from the end)."""
    for n, c in reversed(choices):
        if n == name:
            return c
    return None


def search(graph: OpGraph, device: DeviceSpec, *, workers: int | None = None, beam_width: int = 6,
           top_k: int = 3, progress: bool = False) -> list[Plan]:
    """The ``top_k`` cheapest plans for ``graph`` on ``device`` (see module docstring).

    ``workers`` None: two workers an SM where every op has a tile that fits half the SM's
    shared memory, else one an SM. Raises ValueError naming the op when no candidate of an
    op fits the shared-memory budget.
    """
    if beam_width < 1 or top_k < 1:
        raise ValueError(f"beam_width and top_k must be >= 1, got {beam_width}, {top_k}")
    with collector_paused():
        return _search_plans(graph, device, workers, beam_width, top_k, progress)


def _search_plans(graph: OpGraph, device: DeviceSpec, workers: int | None, beam_width: int, top_k: int,
                  progress: bool) -> list[Plan]:
    template = _layer_template(graph)
    # Every layer has the same ops and shapes: plan one layer (with the ops around the
    # layers) and give every layer its choices. The cost is a sum over ops, so the best
    # layer plan is the best for each layer; the top plans then differ in what they do to
    # every layer, not in one late layer's tie.
    planned = template if template is not None else graph
    # An x-major decode tile slows the whole kernel (DeviceSpec.xmajor_kernel_slowdown), which
    # a sum over ops cannot see: plans without one are searched for on their own too, and
    # plans with one pay the slowdown on their whole step.
    found = _search_workers(planned, device, workers, beam_width, top_k, progress)
    if device.xmajor_kernel_slowdown > 0 and any(decode_dot_tile(n) for n in planned.nodes):
        try:
            found += _search_workers(planned, device, workers, beam_width, top_k, progress, xmajor=False)
        except ValueError:  # some op has only x-major tiles that fit
            pass
    out, seen = [], set()
    for choices, n_workers in found:
        key = (n_workers, tuple(sorted(choices.items(), key=lambda kv: kv[0])))
        if key in seen:
            continue
        seen.add(key)
        # The finalists are simulated as lowered, over the whole step (one layer does not
        # stand for the others: zig-zag deals each from a different place in its pass over
        # the workers; 8B batch 8: 6.5 ms from one layer, 9.0 simulated whole).
        out.append(_finalist(graph, _expand(choices, graph) if template is not None else choices, device, n_workers))
    return sorted(out, key=lambda p: (p.predicted_s, p.peak_smem_bytes))[:top_k]


def _finalist(graph: OpGraph, choices: dict[str, OpChoice], device: DeviceSpec, workers: int) -> Plan:
    """The plan of ``choices``, simulated as lowered under every schedule, the fastest kept."""
    times = {s: sim.seconds for s, sim in simulate_schedules(graph, choices, device, workers).items()}
    best = SCHEDULES[0]  # ties go to the first schedule
    for sched in SCHEDULES[1:]:
        if times[sched] < times[best] * (1 - 1e-9):
            best = sched
    if any(xmajor_decode_tile(graph.node(n), c) for n, c in choices.items()):
        times = {k: v * (1 + device.xmajor_kernel_slowdown) for k, v in times.items()}
    step = estimate_step(graph, choices, device, workers)
    return Plan(graph.name, graph.batch, graph.kv_len, device.name, workers, choices, times[best],
                step.peak_smem_bytes, step.ops, schedule=best, schedule_s=times)


def own_all_reduces(plan: Plan, graph: OpGraph, device: DeviceSpec) -> Plan | None:
    """``plan`` with every all-reduce that a projection's tiles run (each tile pushing to the
    ranks and summing its own box) moved to tiles of its own, the rest unchanged, simulated
    anew; None when it has no such all-reduce. The two ways trade places with the batch
    (docs/PERFORMANCE.md, tensor parallelism), closer than the cost model tells apart, so
    ``measure`` mode times both (:func:`mk.planner.cache.cached_plan`)."""
    kinds = {n.name: n.kind for n in graph.nodes}
    choices = dict(plan.choices)
    for name, c in plan.choices.items():
        sums = tuple(f for f in c.fuse if kinds.get(f) == "all_reduce")
        if sums:
            choices[name] = replace(c, fuse=tuple(f for f in c.fuse if f not in sums))
            choices.update({f: OpChoice() for f in sums})
    return None if choices == plan.choices else _finalist(graph, choices, device, plan.workers)


def _search_workers(graph: OpGraph, device: DeviceSpec, workers: int | None, beam_width: int, top_k: int,
                    progress: bool, xmajor: bool = True) -> list[tuple[dict[str, OpChoice], int]]:
    """:func:`_search` with the worker count fixed, or chosen as :func:`search` says."""
    if workers is not None:
        return _search(graph, device, workers, device.smem_per_block, beam_width, top_k, progress, xmajor)
    # Two workers an SM keep twice the weight bytes in flight: measured on an H200: 1B step 1.32 -> 1.24 ms, 8B 5.55 -> 5.13 ms. Both must fit in
    # the SM's shared memory, so each gets at most half of it, less what is left to L1
    # (DeviceSpec.l1_reserve_per_sm; on a 100 KiB Ada SM the 8B shape's attention tile
    # does not fit: one worker an SM there).
    shared = device.smem_per_sm - device.l1_reserve_per_sm
    try:
        return _search(graph, device, device.sm_count * WORKERS_PER_SM,
                       min(device.smem_per_block, shared // WORKERS_PER_SM - device.reserved_smem_per_block),
                       beam_width, top_k, progress, xmajor)
    except ValueError:
        return _search(graph, device, device.sm_count, device.smem_per_block, beam_width, top_k, progress, xmajor)


def _whole_heads(node: OpNode, host: OpNode, choice: OpChoice) -> bool:
    """Whether the QKV tiles (and, split-K, reduce tiles) of ``choice`` can carry the RoPE
    ``node`` by the op's own rule (:func:`mk.tasks.qkv_rope.check_qkv_rope_tile`: a q/k norm
    needs whole heads). Every other fusion fits any tile."""
    if node.kind != "rope_kv":
        return True
    widths = [choice.block_n] + ([reduce_width(host, choice)] if choice.split_k > 1 else [])
    try:
        for width in widths:
            check_qkv_rope_tile(width, node.dims["head_dim"], bool(node.dims.get("qk_norm")))
    except ValueError:
        return False
    return True


def _layer_key(node: OpNode):
    def strip(name: str) -> str:  # the op's role in its layer
        return name[len(node.scope):] if name.startswith(node.scope) else name

    return (strip(node.name), node.kind, tuple(sorted(node.dims.items())), node.bytes_read, node.bytes_written,
            node.flops, strip(node.fuse_into) if node.fuse_into else None)


def _layer_template(graph: OpGraph) -> OpGraph | None:
    """The graph cut to its first layer (and the ops outside the layers) when every layer
    has the same ops with the same shapes; None when there is one layer or they differ."""
    by_layer: dict[int, list[OpNode]] = {}
    for n in graph.nodes:
        by_layer.setdefault(n.layer, []).append(n)
    layers = sorted(k for k in by_layer if k >= 0)
    if len(layers) < 2 or layers != list(range(len(layers))):
        return None
    first = [_layer_key(n) for n in by_layer[0]]
    if any([_layer_key(n) for n in by_layer[L]] != first for L in layers[1:]):
        return None
    return replace(graph, nodes=[n for n in graph.nodes if n.layer in (-1, 0)])


def _expand(choices: dict[str, OpChoice], graph: OpGraph) -> dict[str, OpChoice]:
    """Layer 0's choices (from :func:`_layer_template`'s plan) given to every layer of ``graph``."""
    out = {}
    first = next(n.scope for n in graph.nodes if n.layer == 0)
    for n in graph.nodes:
        if n.layer <= 0:
            if n.name in choices:
                out[n.name] = choices[n.name]
            continue
        src = first + n.name[len(n.scope):]
        if src in choices:
            c = choices[src]
            out[n.name] = replace(c, fuse=tuple(n.scope + f[len(first):] for f in c.fuse))
    return out


def _search(graph: OpGraph, device: DeviceSpec, workers: int, budget: int, beam_width: int, top_k: int,
            progress: bool, xmajor: bool = True) -> list[tuple[dict[str, OpChoice], int]]:
    """The beam's ``top_k`` complete plans as (op name -> choice, workers), in beam order;
    ``xmajor`` False leaves x-major decode tiles out of the candidates."""
    beam = [_State(0.0, 0, ())]
    nodes = {n.name: n for n in graph.nodes}
    cache: dict = {}
    iterator = graph.nodes
    if progress:
        from tqdm import tqdm

        iterator = tqdm(graph.nodes, desc="planning", unit="op", leave=False, disable=None)  # (None: a terminal only)

    def shape(node):
        return (node.kind, tuple(sorted(node.dims.items())), node.bytes_read, node.bytes_written, node.flops)

    idle = idle_wait_ops(graph)

    def cost_of(node, choice, fused_names):
        # Keyed by shapes, not names: the layers of a model repeat, so most lookups hit.
        key = (shape(node), node.name in idle, choice, tuple(shape(nodes[f]) for f in fused_names))
        if key not in cache:
            cache[key] = estimate_op(node, replace(choice, fuse=fused_names), device, workers,
                                     [nodes[f] for f in fused_names], graph.dtype_bytes, node.name in idle)
        return cache[key]

    ranked_of: dict = {}
    # Hosts of an argmax that must fold into them (over tensor-parallel ranks): whole-K tiles only.
    whole_k = {n.fuse_into for n in graph.nodes if n.kind == "argmax" and n.dims.get("world", 1) > 1}

    for node in iterator:
        rank_key = (shape(node), node.name in idle, node.name in whole_k)
        if rank_key not in ranked_of:
            options = [c for c in candidates(node, device, graph.dtype_bytes, workers)
                       if cost_of(node, c, ()).smem_bytes <= budget and (xmajor or not xmajor_decode_tile(node, c))
                       and (node.name not in whole_k or c.split_k == 1)]
            if not options:
                raise ValueError(f"op {node.name} ({node.kind} {node.dims}): no tile fits the shared-memory "
                                 f"budget of {budget} bytes")
            # Keep only the cheapest few tiles of this op (ops are independent but for fusion),
            # and none that another tile beats on both time and shared memory (a deeper ring
            # that streams no faster would only crowd the beam with equal plans).
            kept: list[OpChoice] = []
            for c in sorted(options, key=lambda c: (cost_of(node, c, ()).seconds, cost_of(node, c, ()).smem_bytes,
                                                    repr(c))):
                if not any(cost_of(node, k, ()).smem_bytes <= cost_of(node, c, ()).smem_bytes for k in kept):
                    kept.append(c)
            ranked_of[rank_key] = kept[:beam_width]
        ranked = ranked_of[rank_key]
        new_beam: list[_State] = []
        host = node.fuse_into
        for state in beam:
            # 1. Fuse this op into its host, already chosen (epilogue fusions), budget permitting.
            hc = _find(state.choices, host) if host is not None else None
            if (hc is not None and (node.kind, nodes[host].kind) in SUPPORTED_FUSIONS and node.kind != "rmsnorm"
                    and (node.kind != "argmax" or hc.split_k == 1)
                    # (a tile's tail polls its whole box of every rank's pushed words, whole-K or
                    # reduce: one row block of at most 16 rows; tiles of 16 columns or more, the
                    # limit the GPU runs measured, set when each task had a flag word)
                    and (node.kind != "all_reduce"
                         or (nodes[host].dims["M"] <= DOT_MIN and reduce_width(nodes[host], hc) >= DOT_MIN))
                    and _whole_heads(node, nodes[host], hc)):
                old = cost_of(nodes[host], replace(hc, fuse=()), hc.fuse)
                new = cost_of(nodes[host], replace(hc, fuse=()), hc.fuse + (node.name,))
                choices = tuple((n, replace(c, fuse=c.fuse + (node.name,)) if n == host else c)
                                for n, c in state.choices)
                if new.smem_bytes <= budget:
                    new_beam.append(_State(state.cost - old.seconds + new.seconds,
                                           max(state.peak_smem, new.smem_bytes), choices, state.pending,
                                           state.order + (-1,)))
            # 2. Defer an RMSNorm into the next linear's prologue.
            if node.kind == "rmsnorm" and host is not None and (node.kind, nodes[host].kind) in SUPPORTED_FUSIONS:
                new_beam.append(_State(state.cost, state.peak_smem, state.choices, state.pending + (node.name,),
                                       state.order + (-2,)))
            # 3. Run it on its own (a linear takes the RMSNorms waiting for it). A RoPE after a
            # QKV with a bias fuses: the bias is added in the QKV + RoPE tiles' epilogue.
            if node.kind in MUST_FUSE and host is not None:
                continue
            if node.kind == "rope_kv" and host is not None and "bias" in nodes[host].buffers:
                continue
            # Over tensor-parallel ranks the token is chosen from each rank's folded argmax.
            if node.kind == "argmax" and node.dims.get("world", 1) > 1 and host is not None:
                continue
            takes = tuple(p for p in state.pending if nodes[p].fuse_into == node.name)
            rest = tuple(p for p in state.pending if p not in takes)
            for i, c in enumerate(ranked):
                est = cost_of(node, c, takes)
                if est.smem_bytes > budget:  # fusions change a tile's buffers (a norm weight chunk)
                    continue
                new_beam.append(_State(state.cost + est.seconds, max(state.peak_smem, est.smem_bytes),
                                       state.choices + ((node.name, replace(c, fuse=takes)),), rest,
                                       state.order + (i,)))
        # A pending RMSNorm whose host has passed can no longer fuse: drop such states.
        new_beam = [s for s in new_beam if all(_find(s.choices, nodes[p].fuse_into) is None for p in s.pending)]
        new_beam.sort(key=_State.key)
        beam = new_beam[:beam_width]
    return [(dict(state.choices), workers) for state in beam[:top_k] if not state.pending]


def pick_measured(plans: list[Plan], time_plan: Callable[[Plan], float]) -> list[Plan]:
    """``measure`` mode: time every plan on the GPU (``time_plan`` returns seconds a step)
    and return them fastest first, each with ``measured_s`` set (ties: the predicted order)."""
    if not plans:
        raise ValueError("pick_measured needs at least one plan")
    timed = []
    for rank, plan in enumerate(plans):
        seconds = float(time_plan(plan))
        if not seconds > 0:
            raise ValueError(f"time_plan returned {seconds} s for plan {rank}: a step time must be positive")
        timed.append((seconds, rank, replace(plan, measured_s=seconds)))
    return [p for _, _, p in sorted(timed, key=lambda t: t[:2])]
