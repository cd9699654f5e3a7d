"""A simulated run of a lowered decode step on the persistent workers, under a queue schedule.

There is one description of a step's tasks and of what each waits for: the lowering's
(:func:`mk.planner.lower.lower_decode_step`, whose task graph derives every dependency
from the regions the tasks read and write, :mod:`mk.persistent.deps`). This module adds
only time: the cost model prices each dependency phase of an op as if its tasks were spread
evenly (:func:`~mk.planner.cost.estimate_op`); here the same tasks, each with its phase's
predicted time (:func:`~mk.planner.cost.phase_costs`, listed in the lowered order by
:func:`step_costs`), are dealt to the workers' static queues by a schedule and run in
order over the lowered graph's dependencies: each worker takes its next task when it is
free, after its inputs are ready and one dependency wait (a task's early part, its TMA
ring's prologue, runs from when the worker reaches it). The step is the launch plus the last
finish. What this adds to the sum over phases is load imbalance across phases: a schedule
that leaves one worker with more tasks than ``ceil(tasks / workers)``, and tasks that wait
only for *their* producers (a split-K reduce for its tile's partials, an O projection's K
range for the attention splits of the heads in it), which start while others still run.

The lowering lists its phases (:attr:`~mk.planner.lower.DecodeStep.phases`: each op's
tasks of one kind, in program order) and the cost model lists the same phases in the same
order (:func:`~mk.planner.cost.op_phases`); :func:`phase_task_costs` checks that they agree
task for task before pricing the tasks.

Schedules (one per worker queue, each in program order, so no queue waits on itself):

* ``round_robin``: task i (in program order, over the whole step) to worker i mod W;
* ``zigzag``: the same, with every other pass over the workers reversed;
* ``list``: each task, in program order, to the worker that can start it earliest; among
  workers that can start it equally early, the one free longest (so consecutive phases
  rotate over the workers rather than piling onto the first ones).

These are :func:`mk.persistent.graph.assign_workers`'s schedules, with the tasks' predicted
times as the list schedule's costs. The queues a simulation deals are the ones the step
runs (:meth:`Simulation.queues` -> :func:`mk.persistent.graph.lower`).

The search (:mod:`mk.planner.search`) prices candidate plans with the cost model alone,
and simulates its few finalists as lowered here (:func:`simulate_step`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from mk.persistent.deps import RangeMax
from mk.persistent.graph import SCHEDULES  # the planner chooses between them (ties: the first)
from mk.tasks import GREEDY, LOGITS, OpChoice, op_kind

from .cost import PhaseCost, idle_wait_ops, phase_costs
from .device import DeviceSpec
from .graph import OpGraph
from .lower import lowered_phases


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


def step_costs(graph: OpGraph, plan: dict, device: DeviceSpec, workers: int,
               next_token: str = GREEDY) -> list[tuple[str, PhaseCost]]:
    """Every phase of the decode step of ``graph`` under ``plan`` (op name -> OpChoice) as
    (op, its cost), in the lowered program's order; ``next_token="logits"`` ends at the LM
    head, as the lowering does."""
    nodes = {n.name: n for n in graph.nodes}
    fused = {f for c in plan.values() for f in c.fuse}
    idle = idle_wait_ops(graph)
    phases: list[tuple[str, PhaseCost]] = []
    for node in graph.nodes:
        chooses = op_kind(node.kind).chooses_token
        if chooses and next_token == LOGITS:
            continue
        # The token's choice folded into the LM head is its own op again where the step
        # samples (the lowering runs the sampler's partial tasks then).
        unfused_choice = chooses and next_token != GREEDY
        if node.name in fused and not unfused_choice:
            continue
        choice = plan.get(node.name, OpChoice()) if unfused_choice else plan[node.name]
        host_fused = [nodes[f] for f in choice.fuse
                      if next_token == GREEDY or not op_kind(nodes[f].kind).chooses_token]
        costs = phase_costs(node, choice, device, workers, host_fused, graph.dtype_bytes, node.name in idle)
        phases += [(node.name, c) for c in costs]
    return phases


def phase_task_costs(phases: list[tuple[str, PhaseCost]], lowered: list[tuple[str, int]]) -> list[PhaseCost]:
    """Each lowered task's phase cost: ``phases`` (:func:`step_costs`) matched, phase by
    phase, to the lowering's (``lowered``: (op, tasks), :attr:`~mk.planner.lower.DecodeStep.phases`).
    Raises RuntimeError naming the first phase where the two disagree on the tasks."""
    if [p.tasks for _, p in phases] != [n for _, n in lowered]:
        bad = next((i for i, ((_, p), (_, n)) in enumerate(zip(phases, lowered)) if p.tasks != n),
                   min(len(phases), len(lowered)))
        have = f"{phases[bad][0]} with {phases[bad][1].tasks} tasks" if bad < len(phases) else "nothing"
        got = f"{lowered[bad][0]} with {lowered[bad][1]} tasks" if bad < len(lowered) else "nothing"
        raise RuntimeError(f"the cost model's phase {bad} is {have}, the lowered step's {got}: the two "
                           f"disagree on an op's tasks")
    return [p for _, p in phases for _ in range(p.tasks)]


def simulate(phases: list[tuple[str, PhaseCost]], deps: list[list[tuple[int, int]]], workers: int, schedule: str,
             launch_s: float = 0.0) -> Simulation:
    """Deal the tasks of ``phases`` ((op, cost) in program order, each phase ``cost.tasks``
    tasks) to ``workers`` queues by ``schedule`` and run them over ``deps`` (each task's
    producers as [first, end) intervals: the lowered graph's, :meth:`mk.persistent.graph.TaskGraph.events`;
    see the module docstring). A task that waits for nothing starts without a wait."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    total = sum(p.tasks for _, p in phases)
    if len(deps) != total:
        raise ValueError(f"simulate: {len(deps)} tasks' dependencies for phases of {total} tasks")
    free = [0.0] * workers
    idle: list[tuple[float, int]] = [(0.0, w) for w in range(workers)]  # list: (free at, worker) heap
    worker_of: list[int] = [0] * total
    phase_end: list[float] = []
    finish = RangeMax(total)
    # When each producer set is done: the tiles of one op mostly share theirs, and a
    # producer's finish never changes once set (producers come first).
    inputs_at: dict[tuple, float] = {}
    listed, zigzag = schedule == "list", schedule == "zigzag"
    pop, push, set_finish = heapq.heappop, heapq.heappush, finish.set
    first = 0
    for _, p in phases:
        end = 0.0
        task_s, wait_s, early = p.task_s, p.wait_s, p.task_s - p.early_s
        for index in range(first, first + p.tasks):
            intervals = deps[index]
            if listed:
                # Workers free by the time the task is ready all start it then: take the
                # one free longest; else the one free soonest.
                at, w = pop(idle)
            else:
                lap, w = divmod(index, workers)
                if zigzag and lap % 2:
                    w = workers - 1 - w
                at = free[w]
            # What does not need the inputs (the ring's prologue) runs from when the worker
            # reaches the task: PhaseCost.early_s. A task that waits for nothing starts
            # without a wait.
            done = at + task_s
            if intervals:
                key = tuple(intervals)
                inputs = inputs_at.get(key)
                if inputs is None:
                    inputs = inputs_at[key] = max([finish.max(a, b) for a, b in intervals])
                late = inputs + wait_s + early
                if late > done:
                    done = late
            if listed:
                push(idle, (done, w))
            else:
                free[w] = done
            worker_of[index] = w
            set_finish(index, done)
            if done > end:
                end = done
        first += p.tasks
        phase_end.append(end)
    seconds = launch_s + (max(phase_end) if phase_end else 0.0)
    return Simulation(schedule, workers, seconds, worker_of, [op for op, _ in phases], phase_end)


def simulate_step(graph: OpGraph, plan: dict, device: DeviceSpec, workers: int, schedule: str,
                  next_token: str = GREEDY) -> Simulation:
    """:func:`simulate` of the decode step of ``graph`` under ``plan`` (op name -> choice),
    launch included: the step lowered on ``meta`` buffers (:func:`mk.planner.lower.lowered_phases`)."""
    return simulate_schedules(graph, plan, device, workers, (schedule,), next_token)[schedule]


def simulate_schedules(graph: OpGraph, plan: dict, device: DeviceSpec, workers: int, schedules=SCHEDULES,
                       next_token: str = GREEDY) -> dict[str, Simulation]:
    """:func:`simulate_step` under each of ``schedules``, the step lowered once."""
    lowered, deps = lowered_phases(graph, plan, next_token)
    phases = step_costs(graph, plan, device, workers, next_token)
    phase_task_costs(phases, lowered)
    return {s: simulate(phases, deps, workers, s, device.launch_overhead_s) for s in schedules}


def step_queues(step, graph: OpGraph, device: DeviceSpec, workers: int) -> list[list[int]]:
    """The workers' queues of the lowered ``step`` (:class:`~mk.planner.lower.DecodeStep`)
    under its plan's schedule, for :func:`mk.persistent.graph.lower`'s ``queues``: its tasks,
    with the cost model's time of each, simulated over the task graph's own dependencies."""
    phases = step_costs(graph, step.plan.choices, device, workers, step.next_token)
    phase_task_costs(phases, step.phases)
    deps = step.graph.direct_dependencies()
    return simulate(phases, deps, workers, step.plan.schedule).queues()
