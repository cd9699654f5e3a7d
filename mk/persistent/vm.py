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
    return run_vm_ranks([program], interleave=interleave, seed=seed, execute=execute, check_reads=check_reads,
                        defer_signals=defer_signals)[0]


def run_vm_ranks(programs: list[Program], *, interleave: str = "round_robin", seed: int = 0, execute: bool = True,
                 check_reads: bool = True, defer_signals: bool = True) -> list[VMReport]:
    """:func:`run_vm` of one step on several ranks at once (a tensor-parallel step: one
    program per rank, the same tasks in the same order, each over its own buffers), their
    workers interleaved together. A task of an op with peer operands
    (:attr:`~mk.tasks.OpSpec.peer_operands`) meets its peers: it runs only once the same
    task's waits are met on every rank (each rank has published its part), as its peers'
    pushed words or flags make it wait on the GPU, and reads every rank's copy of those
    operands. Raises
    :class:`Deadlock` (naming the rank) when no worker of any rank can run."""
    if interleave not in ("round_robin", "random"):
        raise ValueError(f"interleave must be 'round_robin' or 'random', got {interleave!r}")
    if not programs:
        raise ValueError("run_vm_ranks: no programs")
    keys = [[t.op.key for t in p.graph.tasks] for p in programs]
    if any(k != keys[0] for k in keys[1:]):
        raise ValueError("run_vm_ranks: the ranks' programs have different tasks; every rank must run the same step")
    ranks = [_Rank(p, check_reads) for p in programs]
    rng = random.Random(seed)
    slots = [(r, w) for r, rank in enumerate(ranks) for w in range(rank.program.num_workers)]
    turn = 0

    def can_run(r: int, w: int) -> bool:
        rank = ranks[r]
        i = rank.next_task(w)
        if i is None or not rank.waits_met(i):
            return False
        return not rank.program.graph.tasks[i].op.peer_operands or all(other.waits_met(i) for other in ranks)

    while True:
        live = [(r, w) for r, w in slots if ranks[r].next_task(w) is not None]
        if not live:
            break
        ready = [(r, w) for r, w in live if can_run(r, w)]
        for rank in ranks:
            rank.max_conc = max(rank.max_conc, sum(1 for r, _ in ready if ranks[r] is rank))
        if not ready:
            message = [f"rank {r}: " + _deadlock_message(rank.program, rank.heads, rank.counters,
                                                          [w for q, w in live if q == r])
                       for r, rank in enumerate(ranks) if any(q == r for q, _ in live)]
            raise Deadlock("\n".join(message) if len(ranks) > 1 else message[0][len("rank 0: "):])
        if interleave == "random":
            r, w = rng.choice(ready)
        else:
            ready_set = set(ready)
            while slots[turn % len(slots)] not in ready_set:
                turn += 1
            r, w = slots[turn % len(slots)]
            turn += 1
        ranks[r].step(w, ranks, execute, check_reads, defer_signals)
    return [VMReport(steps=rank.steps, order=rank.order, max_concurrency=rank.max_conc, signals=rank.signals)
            for rank in ranks]


class _Rank:
    """One rank's program as the VM runs it: counters, queue heads, and the data-flow check."""

    def __init__(self, program: Program, check_reads: bool) -> None:
        self.program = program
        graph = program.graph
        tasks = graph.tasks
        self.counters = [0] * max(program.num_events, 1)
        self.heads = [0] * program.num_workers
        self.pending = [0] * program.num_workers
        self.signals = self.steps = self.max_conc = 0
        self.order: list[int] = []
        self.buffers = graph.buffers
        # Data-flow check, independent of the events: per element of memory (buffers that are
        # the same tensor, as layers' activations are, count as one), how many tasks (in program
        # order) write it and read it. A task's read of an element needs every earlier writer
        # of it done; its write needs every earlier reader done (else it clobbers data they
        # still need: a step's inputs, such as the token ids, are overwritten by the step).
        memory = self.memory = _same_memory(self.buffers)
        written_by_someone = {memory[r.buffer] for t in tasks for r in t.writes()}
        self.writes_done = {n: torch.zeros(_view2d(self.buffers[n]).shape, dtype=torch.int32)
                            for n in written_by_someone}
        self.reads_done = {n: torch.zeros_like(c) for n, c in self.writes_done.items()}
        self.need_writes: dict = {}  # (task, region index) -> writes each element needs first
        self.need_reads: dict = {}
        if check_reads:
            writes_so_far = {n: torch.zeros_like(c) for n, c in self.writes_done.items()}
            reads_so_far = {n: torch.zeros_like(c) for n, c in self.writes_done.items()}
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
                reads = [r for r in t.reads() if memory[r.buffer] in self.writes_done]
                writes = t.writes()
                for k, r in enumerate(reads):
                    self.need_writes[i, k] = writes_so_far[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1].clone()
                for k, r in enumerate(writes):
                    self.need_reads[i, k] = reads_so_far[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1].clone()
                team.append((reads, writes))

    def next_task(self, w: int) -> int | None:
        q = self.program.queues[w]
        return q[self.heads[w]] if self.heads[w] < len(q) else None

    def waits_met(self, i: int) -> bool:
        return all(self.counters[ev] >= cnt for ev, cnt in self.program.task_waits[i])

    def step(self, w: int, ranks: list["_Rank"], execute: bool, check_reads: bool, defer_signals: bool) -> None:
        program, memory = self.program, self.memory
        i = program.queues[w][self.heads[w]]
        task = program.graph.tasks[i]
        reads = [r for r in task.reads() if memory[r.buffer] in self.writes_done]
        if check_reads:
            for k, r in enumerate(reads):
                if bool((self.writes_done[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] < self.need_writes[i, k]).any()):
                    raise EarlyRead(f"task {i} ({task.name}) on worker {w} reads {r} before its producers "
                                    f"signalled")
            for k, r in enumerate(task.writes()):
                if bool((self.reads_done[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] < self.need_reads[i, k]).any()):
                    raise EarlyRead(f"task {i} ({task.name}) on worker {w} writes {r} before every earlier "
                                    f"task that reads it has run")
        if execute:
            roles = {role: self.buffers[name] for role, name in task.bind.items()}
            for role in task.op.peer_operands:
                roles["@" + role] = [other.buffers[task.bind[role]] for other in ranks]
            task.op.run(roles, dict(task.args))
        for r in reads:
            self.reads_done[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] += 1
        for r in task.writes():
            self.writes_done[memory[r.buffer]][r.r0:r.r1, r.c0:r.c1] += 1
        ev = program.task_signal[i]
        self.heads[w] += 1
        if ev >= 0:
            q = program.queues[w]
            if defer_signals and self.heads[w] < len(q) and program.task_signal[q[self.heads[w]]] == ev:
                self.pending[w] += 1  # the megakernel signals a run of same-event tasks once, at its end
            else:
                self.counters[ev] += self.pending[w] + 1
                self.pending[w] = 0
                self.signals += 1
        self.order.append(i)
        self.steps += 1


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
