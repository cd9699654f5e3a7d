"""A Python VM that runs a lowered program's descriptors with torch ops.

It executes the same descriptor table and event counters as the megakernel, with any
number of workers interleaved (in turn, or at random from a seed). It proves schedules
that the interpreter cannot run (one program at a time there): no deadlock, and no
task reading a region before every task that writes it has signalled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .graph import Program


class VMError(AssertionError):
    """The schedule is wrong: a deadlock or an early read."""


class Deadlock(VMError):
    pass


class EarlyRead(VMError):
    pass


@dataclass
class VMReport:
    steps: int
    order: list[int]  # task indices in execution order
    max_concurrency: int
    signals: int = 0  # counter updates (atomics on the GPU)


def _view2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1) if t.dim() < 2 else t.reshape(-1, t.shape[-1])


def run_vm(program: Program, *, interleave: str = "round_robin", seed: int = 0, execute: bool = True,
           check_reads: bool = True, defer_signals: bool = True) -> VMReport:
    """Run ``program`` on its graph's buffers (tensors are updated in place when ``execute``).

    interleave: ``round_robin`` (workers take turns) or ``random`` (a runnable worker
    drawn from ``seed`` each step). ``defer_signals``: like the megakernel, a worker signals
    a run of consecutive tasks with the same event once, after the run's last task. Raises
    :class:`Deadlock` naming the stuck tasks and what they wait for, or :class:`EarlyRead`
    naming the task and region.
    """
    if interleave not in ("round_robin", "random"):
        raise ValueError(f"interleave must be 'round_robin' or 'random', got {interleave!r}")
    graph = program.graph
    tasks = graph.tasks
    rng = random.Random(seed)
    counters = [0] * max(program.num_events, 1)
    heads = [0] * program.num_workers
    pending = [0] * program.num_workers
    signals = 0
    buffers = graph.buffers

    # Published[buffer]: which elements hold data the current step may read. Buffers no
    # task writes are inputs, published from the start.
    written_by_someone = {r.buffer for t in tasks for r in t.writes()}
    published = {name: torch.full(_view2d(buf).shape, name not in written_by_someone, dtype=torch.bool)
                 for name, buf in buffers.items()}
    order: list[int] = []
    max_conc = 0

    def runnable(w: int) -> bool:
        q = program.queues[w]
        if heads[w] >= len(q):
            return False
        return all(counters[ev] >= cnt for ev, cnt in program.task_waits[q[heads[w]]])

    turn = 0
    steps = 0
    while True:
        live = [w for w in range(program.num_workers) if heads[w] < len(program.queues[w])]
        if not live:
            break
        ready = [w for w in live if runnable(w)]
        max_conc = max(max_conc, len(ready))
        if not ready:
            raise Deadlock(_deadlock_message(program, heads, counters, live))
        if interleave == "random":
            w = rng.choice(ready)
        else:
            ready_set = set(ready)
            while turn % program.num_workers not in ready_set:
                turn += 1
            w = turn % program.num_workers
            turn += 1
        i = program.queues[w][heads[w]]
        task = tasks[i]
        if check_reads:
            for region in task.reads():
                view = published[region.buffer][region.r0:region.r1, region.c0:region.c1]
                if not bool(view.all()):
                    raise EarlyRead(f"task {i} ({task.name}) on worker {w} reads {region} before its producers "
                                    f"signalled")
        if execute:
            roles = {role: buffers[name] for role, name in task.bind.items()}
            task.op.run(roles, dict(task.args))
        for region in task.writes():
            published[region.buffer][region.r0:region.r1, region.c0:region.c1] = True
        ev = program.task_signal[i]
        heads[w] += 1
        if ev >= 0:
            q = program.queues[w]
            if defer_signals and heads[w] < len(q) and program.task_signal[q[heads[w]]] == ev:
                pending[w] += 1  # the megakernel signals a run of same-event tasks once, at its end
            else:
                counters[ev] += pending[w] + 1
                pending[w] = 0
                signals += 1
        order.append(i)
        steps += 1
    return VMReport(steps=steps, order=order, max_concurrency=max_conc, signals=signals)


def _deadlock_message(program: Program, heads, counters, live) -> str:
    lines = ["deadlock: no worker can run"]
    tasks = program.graph.tasks
    for w in live[:8]:
        i = program.queues[w][heads[w]]
        missing = [(ev, cnt) for ev, cnt in program.task_waits[i] if counters[ev] < cnt]
        for ev, cnt in missing[:2]:
            queued = {t for q in program.queues for t in q}
            signallers = program.event_signallers[ev] if ev < len(program.event_signallers) else []
            missing_producers = [s for s in signallers if s not in queued]
            if missing_producers:
                who = "missing producer: " + ", ".join(f"task {s} ({tasks[s].name}) is in no queue"
                                                       for s in missing_producers[:4])
            elif signallers:
                who = ", ".join(tasks[s].name for s in signallers[:4]) + ("..." if len(signallers) > 4 else "")
            else:
                who = "no task (missing producer)"
            lines.append(f"  worker {w}: task {i} ({tasks[i].name}) waits on event {ev}: {counters[ev]} of {cnt}; "
                         f"signalled by {who}")
    if len(live) > 8:
        lines.append(f"  ... and {len(live) - 8} more workers")
    return "\n".join(lines)
