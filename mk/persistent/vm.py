"""A Python VM that runs a lowered program's descriptors with torch ops.

It executes the same descriptor table and event counters as the megakernel, with any
number of workers interleaved (in turn, or at random from a seed). It proves schedules
that the interpreter cannot run (one program at a time there): no deadlock, no task
reading a region before every earlier task that writes it has run, and no task
overwriting a region before every earlier task that reads it has run (checked on the
data, element by element, not through the events under test).
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

    # Data-flow check, independent of the events: per element of memory (buffers that are
    # the same tensor, as layers' activations are, count as one), how many tasks (in program
    # order) write it and read it. A task's read of an element needs every earlier writer
    # of it done; its write needs every earlier reader done (else it clobbers data they
    # still need: a step's inputs, such as the token ids, are overwritten by the step).
    memory = _same_memory(buffers)
    written_by_someone = {memory[r.buffer] for t in tasks for r in t.writes()}
    writes_done = {n: torch.zeros(_view2d(buffers[n]).shape, dtype=torch.int32) for n in written_by_someone}
    reads_done = {n: torch.zeros_like(c) for n, c in writes_done.items()}
    need_writes: dict = {}  # (task, region index) -> writes each element needs first
    need_reads: dict = {}
    if check_reads:
        writes_so_far = {n: torch.zeros_like(c) for n, c in writes_done.items()}
        reads_so_far = {n: torch.zeros_like(c) for n, c in writes_done.items()}
        team: list = []  # (reads, writes) of the current team: counted once it ends, since
        # its members need nothing of one another (OpSpec.team)
        for i, t in enumerate(tasks):
            if t.team_start == i:
                for reads, writes in team:
                    for r in reads:
                        reads_so_far[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] += 1
                    for r in writes:
                        writes_so_far[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] += 1
                team = []
            reads = [r for r in t.reads() if memory[r.buffer] in writes_done]
            writes = t.writes()
            for k, r in enumerate(reads):
                need_writes[i, k] = writes_so_far[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1].clone()
            for k, r in enumerate(writes):
                need_reads[i, k] = reads_so_far[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1].clone()
            team.append((reads, writes))
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
        reads = [r for r in task.reads() if memory[r.buffer] in writes_done]
        if check_reads:
            for k, r in enumerate(reads):
                if bool((writes_done[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] < need_writes[i, k]).any()):
                    raise EarlyRead(f"task {i} ({task.name}) on worker {w} reads {r} before its producers "
                                    f"signalled")
            for k, r in enumerate(task.writes()):
                if bool((reads_done[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] < need_reads[i, k]).any()):
                    raise EarlyRead(f"task {i} ({task.name}) on worker {w} writes {r} before every earlier "
                                    f"task that reads it has run")
        if execute:
            roles = {role: buffers[name] for role, name in task.bind.items()}
            task.op.run(roles, dict(task.args))
        for r in reads:
            reads_done[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] += 1
        for r in task.writes():
            writes_done[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] += 1
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


def _same_memory(buffers: dict[str, torch.Tensor]) -> dict[str, str]:
    """Buffer name -> the first name of the same memory: buffers that are the same tensor
    (storage, offset, shape, strides, dtype) are checked as one."""
    first: dict[tuple, str] = {}
    memory = {}
    for name, t in buffers.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        memory[name] = first.setdefault(key, name)
    return memory


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
