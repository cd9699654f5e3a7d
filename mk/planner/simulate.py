"""A simulated run of a plan's tasks on the persistent workers, under a queue schedule.

The cost model prices each dependency phase of an op as if its tasks were spread evenly
(:func:`~mk.planner.cost.estimate_op`). Here the same tasks, with the same predicted
times (:func:`~mk.planner.cost.phase_costs`), are dealt to the workers' static queues by
a schedule and run in order: each worker takes its next task when it is free, after its
inputs are ready and one dependency wait (a task's early part, its TMA ring's prologue,
runs from when the worker reaches it). The step is the launch plus the last finish.
What this adds to the sum over phases is load imbalance across phases: a schedule that
leaves one worker with more tasks than ``ceil(tasks / workers)``, and phases whose tasks
wait only for *their* producers (a split-K reduce for its tile's partials, the argmax
reduce for its row's chunks, an O projection's K range for the attention splits of the
heads in it), which start while the other groups still run.

Schedules (one per worker queue, each in program order, so no queue waits on itself):

* ``round_robin``: task i (in program order, over the whole step) to worker i mod W;
* ``zigzag``: the same, with every other pass over the workers reversed;
* ``list``: each task, in program order, to the worker that can start it earliest; among
  workers that can start it equally early, the one free longest (so consecutive phases
  rotate over the workers rather than piling onto the first ones).

These are :func:`mk.persistent.graph.assign_workers`'s schedules, with the phases'
predicted task times as the list schedule's costs.

The queues a simulation deals are exactly the ones the lowering runs
(:meth:`Simulation.queues` -> :func:`mk.persistent.graph.lower`), in the lowered step's
task order (:func:`mk.planner.lower.lower_decode_step` adds each op's phases in the same
order as :func:`~mk.planner.cost.op_phases`).

Between ops, a phase waits for the tasks of the previous phase whose output it reads, at
tile granularity as the lowering's dependencies do: a split-K partial for the tiles
that wrote its K range of x (all of them with an RMSNorm prologue, which needs whole
rows), an argmax chunk for the LM-head tiles of its vocabulary range, sequence b's
attention splits for b's RoPE task (or, RoPE fused into QKV, a KV group's splits for the
QKV tiles of its heads); every other op reads all of its input.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from mk.persistent.graph import SCHEDULES  # the planner chooses between them (ties: the first)

from mk.tasks.argmax import argmax_block_v
from mk.tasks.linear import linear_k_splits

from .cost import (OpChoice, PhaseCost, _tile_rows_for, idle_wait_ops, linear_tiles_n, phase_costs,
                   reduce_width)
from .device import DeviceSpec
from .graph import OpGraph


@dataclass(frozen=True)
class SimPhase:
    """A phase of one op: its cost, which tasks of the previous phase its task j waits for,
    and which columns of its output each of its own tasks writes.

    Waits: ``group`` ``(consumers, producers)``: the previous phase's tasks
    ``[g * producers, (g + 1) * producers)`` where ``g = j // consumers``; else ``reads``
    (task j reads the column ranges ``reads[j % len(reads)]``, a tuple of ``(c0, c1)``, of
    every row): the previous phase's tasks that wrote those columns; else all of them.
    ``writes`` ``(width, columns)``: the ``writers`` consecutive tasks from ``t * writers``
    together write columns ``[c * width, (c + 1) * width)`` with ``c = t mod ceil(columns /
    width)`` (of one row block); None: not column tiles. (Attention's KV splits write their
    group's heads together: the last of them merges.)
    """

    op: str
    cost: PhaseCost
    group: tuple[int, int] | None = None
    reads: tuple[tuple[int, int], ...] | None = None
    writes: tuple[int, int] | None = None
    writers: int = 1


@dataclass
class Simulation:
    """The outcome: seconds of the step (launch included), each task's worker, and per phase
    its op and the time its last task finished (after the launch)."""

    schedule: str
    workers: int
    seconds: float
    worker_of: list[int]
    phase_ops: list[str]
    phase_end: list[float]

    def queues(self) -> list[list[int]]:
        """Task indices per worker, in program order (what :func:`mk.persistent.graph.lower` takes)."""
        out: list[list[int]] = [[] for _ in range(self.workers)]
        for task, w in enumerate(self.worker_of):
            out[w].append(task)
        return out


def step_phases(graph: OpGraph, plan: dict, device: DeviceSpec, workers: int,
                next_token: str = "argmax") -> list[SimPhase]:
    """Every phase of the decode step of ``graph`` under ``plan`` (op name -> OpChoice), in
    the lowered program's order; ``next_token="logits"`` ends at the LM head, as the
    lowering does."""
    nodes = {n.name: n for n in graph.nodes}
    fused = {f for c in plan.values() for f in c.fuse}
    idle = idle_wait_ops(graph)
    phases: list[SimPhase] = []
    for node in graph.nodes:
        if node.kind == "argmax" and next_token == "logits":
            continue
        # An argmax fused into the LM head is its own op again where the step samples
        # (the lowering runs the sampler's partial tasks then: lower.argmax_in_lm_head).
        unfused_argmax = node.kind == "argmax" and next_token != "argmax"
        if node.name in fused and not unfused_argmax:
            continue
        choice = plan.get(node.name, OpChoice()) if unfused_argmax else plan[node.name]
        host_fused = [nodes[f] for f in choice.fuse if next_token == "argmax" or nodes[f].kind != "argmax"]
        costs = phase_costs(node, choice, device, workers, host_fused, graph.dtype_bytes, node.name in idle)
        d = node.dims
        if node.kind == "linear":
            silu = any(nodes[f].kind == "silu_mul" for f in choice.fuse)
            run = choice.tiles_per_task  # a task writes its run of tiles
            if run > 1 and linear_tiles_n(node, choice)[0] > 1:
                raise ValueError(f"op {node.name}: runs of tiles need one row block (M <= the tile's rows)")
            width, columns = (choice.block_n // 2, d["N"] // 2) if silu else (choice.block_n, d["N"])
            if any(f.kind == "argmax" for f in host_fused):
                # The LM head's tiles fold each row's argmax into a word: the token append of
                # row b waits for every task of b's row block.
                if choice.split_k != 1:
                    raise ValueError(f"op {node.name}: the argmax fuses into whole-K tiles only, got split_k="
                                     f"{choice.split_k}")
                tasks_per_block = -(-linear_tiles_n(node, choice)[1] // run)
                phases += [SimPhase(node.name, costs[0], writes=(width * run, columns)),
                           SimPhase(node.name, costs[1], group=(_tile_rows_for(d["M"], choice.block_n),
                                                                tasks_per_block))]
                continue
            if choice.split_k == 1:
                phases.append(SimPhase(node.name, costs[0], writes=(width * run, columns)))
                continue
            # A split reads only its K range of x, unless an RMSNorm prologue needs whole rows.
            # Reduce tile j waits for the splits of the run holding it (tasks run-major).
            norm = any(nodes[f].kind == "rmsnorm" for f in choice.fuse)
            ranges = None if norm else tuple((r,) for r in linear_k_splits(d["K"], choice.block_k, choice.split_k))
            # A partial tile may have several (narrower) reduce tiles.
            per_tile = choice.block_n // reduce_width(node, choice)
            phases += [SimPhase(node.name, costs[0], reads=ranges),
                       SimPhase(node.name, costs[1], group=(run * per_tile, choice.split_k),
                                writes=(width // per_tile, columns))]
        elif node.kind == "attention":
            # Sequence b's splits wait for b's RoPE task, or, with RoPE in the QKV tiles, KV
            # group g's splits for the tiles of g's q, k and v heads (and in the layer that
            # publishes the lengths, for tile 0). A group's splits write its heads together.
            prev = nodes[phases[-1].op] if phases else None
            first = reads = None
            if prev is not None and prev.kind == "rope_kv":
                first = (d["kv_heads"] * choice.kv_splits, 1)
            elif prev is not None and any(nodes[f].kind == "rope_kv" for f in plan[prev.name].fuse):
                reads = _attention_reads(d, choice.kv_splits, with_lengths=node.layer == 0)
            phases.append(SimPhase(node.name, costs[0], group=first, reads=reads,
                                   writes=(d["heads"] // d["kv_heads"] * d["head_dim"], d["heads"] * d["head_dim"]),
                                   writers=choice.kv_splits))
        elif node.kind == "argmax":
            width = argmax_block_v(d["v"])
            chunks = tuple(((c, min(c + width, d["v"])),) for c in range(0, d["v"], width))
            phases += [SimPhase(node.name, costs[0], reads=chunks), SimPhase(node.name, costs[1], group=(1, len(chunks))),
                       SimPhase(node.name, costs[2], group=(1, 1))]
        else:
            phases.append(SimPhase(node.name, costs[0]))
    return phases


def _attention_reads(d: dict, kv_splits: int, with_lengths: bool) -> tuple:
    """The QKV columns each attention split reads, in task order (KV group-major): its
    group's q heads, k head and v head, and with_lengths column 0 (the tile writing the
    sequence lengths, :func:`mk.planner.lower.lower_decode_step`)."""
    hq, hkv, D = d["heads"], d["kv_heads"], d["head_dim"]
    per_group = hq // hkv
    out = []
    for g in range(hkv):
        cols = ((g * per_group * D, (g + 1) * per_group * D), ((hq + g) * D, (hq + g + 1) * D),
                ((hq + hkv + g) * D, (hq + hkv + g + 1) * D)) + (((0, 1),) if with_lengths else ())
        out += [cols] * kv_splits
    return tuple(out)


def _ready(p: SimPhase, prev: SimPhase | None, prev_finish: list[float]) -> list[float]:
    """When each task of ``p`` has its inputs (before its wait), from the previous phase's finishes."""
    n = p.cost.tasks
    if prev is None:
        return [0.0] * n  # the first phase waits for nothing
    if p.group is not None:
        consumers, producers = p.group
        group_ready = [max(prev_finish[g:g + producers]) for g in range(0, len(prev_finish), producers)]
        return [group_ready[j // consumers] for j in range(n)]
    if p.reads is not None and prev.writes is not None:
        width, columns = prev.writes
        k = prev.writers
        per_block = -(-columns // width) * k
        blocks = range(0, len(prev_finish), per_block)
        at = [max(max(prev_finish[b + c0 // width * k:b + -(-c1 // width) * k]) for b in blocks for c0, c1 in ranges)
              for ranges in p.reads]
        return [at[j % len(at)] for j in range(n)]
    return [max(prev_finish)] * n


def simulate(phases: list[SimPhase], workers: int, schedule: str, launch_s: float = 0.0) -> Simulation:
    """Deal the phases' tasks to ``workers`` queues by ``schedule`` and run them (module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    free = [0.0] * workers
    idle: list[tuple[float, int]] = [(0.0, w) for w in range(workers)]  # list: (free at, worker) heap
    worker_of: list[int] = []
    phase_end: list[float] = []
    prev, prev_finish = None, []
    for p in phases:
        ready = _ready(p, prev, prev_finish)
        wait_s = p.cost.wait_s if prev is not None else 0.0
        finish = []
        for j in range(p.cost.tasks):
            index = len(worker_of)
            if schedule == "list":
                # Workers free by the time the task is ready all start it then: take the
                # one free longest; else the one free soonest.
                at, w = heapq.heappop(idle)
            else:
                lap, pos = divmod(index, workers)
                w = pos if schedule == "round_robin" or lap % 2 == 0 else workers - 1 - pos
                at = free[w]
            # What does not need the inputs (the ring's prologue) runs from when the worker
            # reaches the task: PhaseCost.early_s.
            done = max(at + p.cost.task_s, ready[j] + wait_s + p.cost.task_s - p.cost.early_s)
            free[w] = done
            if schedule == "list":
                heapq.heappush(idle, (done, w))
            worker_of.append(w)
            finish.append(done)
        prev, prev_finish = p, finish
        phase_end.append(max(finish))
    seconds = launch_s + (max(phase_end) if phase_end else 0.0)
    return Simulation(schedule, workers, seconds, worker_of, [p.op for p in phases], phase_end)


def simulate_step(graph: OpGraph, plan: dict, device: DeviceSpec, workers: int, schedule: str,
                  next_token: str = "argmax") -> Simulation:
    """:func:`simulate` of the decode step of ``graph`` under ``plan``, launch included."""
    return simulate(step_phases(graph, plan, device, workers, next_token), workers, schedule,
                    device.launch_overhead_s)
