"""Task graphs and their lowering to per-worker queues of int32 descriptors.

A :class:`TaskGraph` is a list of tasks in program order; each task is an :class:`OpSpec`
bound to named buffers plus integer arguments. Dependencies are derived, not declared:
a task depends on every earlier task whose writes intersect its reads (read after
write), or whose reads or writes intersect its writes (write after read / write),
except on the earlier members of its own team (:attr:`OpSpec.team`). They are exact at
tile granularity because the regions are tiles.

:func:`lower` turns a graph into a :class:`Program`: events (counters), waits with
per-launch counts, static per-worker queues, and the descriptor table the megakernel and
the VM both execute.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch

from mk.tasks._cache import cache_dir, sources_hash
from mk.tasks._spec import TL_DTYPES, OpSpec, Region

from .deps import (Events, RangeMax, dependency_intervals, drop_implied, expand_run, group_events, periodic_run,
                   reduce_run)

#: Descriptor header: opcode, signal event (-1: none), number of waits, task index.
HEADER_WORDS = 4


@dataclass(slots=True)
class Task:
    index: int
    op: OpSpec
    bind: dict[str, str]
    args: dict[str, int]
    label: str = ""  # the caller's name for it; "" names it after its op and index
    team_start: int = -1  # index of the first task of its team (OpSpec.team); its own index if none

    def __post_init__(self) -> None:
        if self.team_start < 0:
            self.team_start = self.index

    @property
    def name(self) -> str:
        return self.label or f"{self.op.name}#{self.index}"

    def reads(self) -> list[Region]:
        return self.op.reads(self.args, self.bind) if self.op.reads else []

    def writes(self) -> list[Region]:
        return self.op.writes(self.args, self.bind) if self.op.writes else []


class TaskGraph:
    """Buffers (named tensors) and tasks in program order."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.tasks: list[Task] = []
        self._deps: list | None = None  # direct_dependencies(), until a task is added
        self._events: tuple | None = None  # events(), likewise
        #: Task ranges [first, end) that may repeat one another with their buffers renamed
        #: (a model's layers): a hint that lets :meth:`events` derive a long graph from a
        #: short one (:func:`periodic_run`). Wrong hints cost time, never correctness.
        self.periods: list[tuple[int, int]] = []

    def buffer(self, name: str, tensor: torch.Tensor) -> str:
        """Add (or replace) a named buffer; returns its name."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"buffer {name!r} must be a tensor")
        if tensor.dtype not in TL_DTYPES:
            raise TypeError(f"buffer {name!r} has unsupported dtype {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"buffer {name!r} must be contiguous")
        if tensor.data_ptr() % 16:
            # Vector loads and TMA bulk prefetches assume it (torch's allocations are).
            raise ValueError(f"buffer {name!r} must start at a 16-byte aligned address (is it an offset view?)")
        self.buffers[name] = tensor
        return name

    def add(self, op: OpSpec, name: str | None = None, **bindings_and_args) -> int:
        """Append a task: every operand role of ``op`` bound to a buffer name, every arg an int."""
        args = {a: bindings_and_args.pop(a) for a in op.args if a in bindings_and_args}
        return self.add_tiles(op, [args], name, **bindings_and_args)

    def add_tiles(self, op: OpSpec, tiles: list[dict[str, int]], name: str | None = None, **bindings) -> int:
        """Append one task of ``op`` per entry of ``tiles`` (its args, e.g. :func:`mk.tasks.op_tiles`),
        all with the same operand ``bindings``; returns the first's index. Consecutive tasks
        of one team (:attr:`OpSpec.team`) are marked as such."""
        label = name or op.name
        bind = {}
        for role in op.operands:
            if role not in bindings:
                raise ValueError(f"task {label}: operand {role!r} not bound")
            buf = bindings.pop(role)
            if buf not in self.buffers:
                raise ValueError(f"task {label}: operand {role!r} names unknown buffer {buf!r}")
            bind[role] = buf
        if bindings:
            raise ValueError(f"task {label}: unexpected {sorted(bindings)}")
        first = len(self.tasks)
        prev = self.tasks[-1] if self.tasks else None
        same_op = prev is not None and (prev.op is op or prev.op == op) and prev.bind == bind
        for tile in tiles:
            if len(tile) != len(op.args) or any(a not in tile for a in op.args):
                missing = [a for a in op.args if a not in tile]
                raise ValueError(f"task {label}: " + (f"argument {missing[0]!r} missing" if missing else
                                                      f"unexpected {sorted(set(tile) - set(op.args))}"))
            args = {a: tile[a] for a in op.args}
            for arg, value in args.items():
                if isinstance(value, bool) or not isinstance(value, int) or not -2**31 <= value < 2**31:
                    raise ValueError(f"task {label}: argument {arg!r} must be an int32, got {value!r}")
            index = len(self.tasks)
            team_start = index
            if op.team is not None and same_op and op.team(prev.args) == op.team(args):
                team_start = prev.team_start
            prev = Task(index, op, bind, args, name or "", team_start)
            self.tasks.append(prev)
            same_op = True
        self._deps = self._events = None
        return first

    def repeat(self, first: int, end: int, rename: dict[str, str], args=None) -> int:
        """Append a copy of tasks [first, end): the same ops, arguments and teams, each
        operand's buffer renamed by ``rename`` (a name not in it kept), each task's args
        through ``args`` (a function of the args dict; None: the same); returns the first
        copy's index. What a caller would add again with other buffers, without building
        and checking each task again."""
        if not 0 <= first <= end <= len(self.tasks):
            raise ValueError(f"repeat: tasks [{first}, {end}) are not in the graph's {len(self.tasks)}")
        unknown = sorted(n for n in set(rename.values()) if n not in self.buffers)
        if unknown:
            raise ValueError(f"repeat: renamed to unknown buffers {unknown}")
        start = len(self.tasks)
        by = start - first
        binds: dict[int, dict[str, str]] = {}  # the tasks of one op share their binding
        for t in self.tasks[first:end]:
            bind = binds.get(id(t.bind))
            if bind is None:
                bind = binds[id(t.bind)] = {role: rename.get(b, b) for role, b in t.bind.items()}
            index = t.index + by
            self.tasks.append(Task(index, t.op, bind, t.args if args is None else args(t.args), "",
                                   t.team_start + by if t.team_start >= first else t.team_start))
        self._deps = self._events = None
        return start

    def dependencies(self) -> list[list[int]]:
        """For each task, the earlier tasks it must wait for (sorted).

        Expanded from :meth:`dependency_intervals`; use that on large graphs.
        """
        return [[t for a, b in ivs for t in range(a, b)] for ivs in self.dependency_intervals()]

    def dependency_intervals(self) -> list[list[tuple[int, int]]]:
        """For each task, the earlier tasks it must wait for, as sorted [first, end) intervals."""
        return dependency_intervals(self.tasks)

    def structure_key(self) -> str:
        """A hash of what the graph's dependencies follow from: each task's op (its key holds
        every static parameter), bindings, arguments and team, the buffers' shapes and
        dtypes, and mk's engine and task sources. Buffer contents and addresses are not in it."""
        return self._structure_key(self.tasks, ())

    def _structure_key(self, tasks: list[Task], run: tuple) -> str:
        h = hashlib.sha256(_engine_source_hash().encode())
        h.update(repr((run, sorted((n, tuple(t.shape), str(t.dtype)) for n, t in self.buffers.items()))).encode())
        for t in tasks:
            h.update(repr((t.op.key, sorted(t.bind.items()), sorted(t.args.items()), t.team_start)).encode())
        return h.hexdigest()[:32]

    def direct_dependencies(self) -> list[list[tuple[int, int]]]:
        """Each task's producers as sorted [first, end) intervals, those another producer
        already implies dropped (:func:`~mk.persistent.deps.drop_implied`): what the queue
        simulation (:mod:`mk.planner.simulate`) and the events follow. Deriving them is most
        of the time to lower a large graph, so they are kept on the graph and on disk, under
        the graph's :meth:`structure_key` (a graph that repeats itself: its reduced graph's,
        with only the reduced graph's dependencies, :func:`~mk.persistent.deps.reduce_run`)."""
        if self._deps is None or len(self._deps) != len(self.tasks):
            self._deps = self._derive_deps()
        return self._deps

    def events(self) -> tuple[list[list[tuple[int, int]]], Events]:
        """:meth:`direct_dependencies` and the graph's events: producers with the same set of
        consumers share one, since every consumer of the event needs all of its producers
        ("count reached" then means exactly "inputs ready")."""
        if self._events is None or len(self._events[0]) != len(self.tasks):
            deps = self.direct_dependencies()
            self._events = (deps, group_events(len(self.tasks), deps))
        return self._events

    def _derive_deps(self) -> list[list[tuple[int, int]]]:
        run = periodic_run(self.tasks, self.periods)
        reduced = reduce_run(self.tasks, run) if run else None
        key = self._structure_key(*reduced) if reduced else self.structure_key()
        path = cache_dir("deps") / f"{key}.pkl"
        try:
            with open(path, "rb") as f:
                kind, stored = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError):
            kind, stored = None, None  # absent or unreadable: derive again
        if kind == "full" and len(stored) == len(self.tasks):
            return stored
        if reduced and kind == "reduced" and len(stored) == len(reduced[0]):
            deps = expand_run(stored, run, len(self.tasks))
            if deps is not None:
                return deps
        kind, deps = None, None
        if reduced:
            stored = drop_implied(dependency_intervals(reduced[0]))
            deps = expand_run(stored, run, len(self.tasks))
            kind = "reduced"
        if deps is None:  # (the run's later periods do not wait alike)
            kind, stored = "full", drop_implied(self.dependency_intervals())
            deps = stored
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                pickle.dump((kind, stored), f, protocol=pickle.HIGHEST_PROTOCOL)
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache costs time, not correctness
        return deps


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for a stretch of host work that allocates
    tens of thousands of small objects and frees none in cycles (lowering a step, the plan
    search): its passes over them took a third to a half of the time (8B step: 0.9 ->
    0.5 s). Nested uses keep it off until the outermost ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@functools.lru_cache(maxsize=1)
def _engine_source_hash() -> str:
    package = Path(__file__).parent.parent
    # (rglob: a big op's home in mk/tasks is a package)
    return sources_hash(sorted([*(package / "persistent").glob("*.py"), *(package / "tasks").rglob("*.py")]))


@dataclass
class Program:
    """A lowered graph: what one megakernel launch executes.

    ``desc`` rows are in queue order (worker 0's queue, then worker 1's, ...);
    ``queue_starts[w]:queue_starts[w+1]`` is worker w's slice. Each row: opcode, signal
    event, number of waits, task index, (event, count) × max_waits, buffer slots, args.
    A wait is satisfied when ``counters[event] >= count * (launches so far + 1)``.
    """

    graph: TaskGraph
    variants: list[tuple[OpSpec, tuple[torch.dtype, ...]]]
    buffer_names: list[str]
    desc: torch.Tensor
    queue_starts: torch.Tensor
    num_workers: int
    num_events: int
    event_counts: list[int]
    event_signallers: list[list[int]]
    task_waits: list[list[tuple[int, int]]]
    task_signal: list[int]
    queues: list[list[int]]
    max_waits: int
    max_slots: int
    max_args: int
    meta: dict = field(default_factory=dict)

    @property
    def desc_words(self) -> int:
        return self.desc.shape[1]

    @property
    def slot_base(self) -> int:
        return HEADER_WORDS + 2 * self.max_waits

    @property
    def arg_base(self) -> int:
        return self.slot_base + self.max_slots

    def summary(self) -> dict:
        return {"tasks": len(self.graph.tasks), "workers": self.num_workers, "events": self.num_events,
                "max_waits": self.max_waits, "desc_words": self.desc_words,
                "variants": [spec.key for spec, _ in self.variants], **self.meta}

    def schedule_digest(self, skip_args: tuple[str, ...] = ()) -> str:
        """A hash of what a launch executes, in the order it does: every worker's queue of
        descriptors (each task's op, waits, signal, buffer slots and args), the buffers'
        names, the ops' variants and the events' counts; not addresses. Args named in
        ``skip_args`` are left out (a rank's own index: ranks of one tensor-parallel step
        must run the same schedule, and differ only there)."""
        desc = self.desc.cpu().clone()
        for opcode, (spec, _) in enumerate(self.variants):
            for a in skip_args:
                if a in spec.args:
                    desc[desc[:, 0] == opcode, self.arg_base + spec.args.index(a)] = 0
        h = hashlib.sha256(desc.numpy().tobytes())
        h.update(self.queue_starts.cpu().numpy().tobytes())
        h.update(repr((self.buffer_names, [(spec.key, str(dtypes)) for spec, dtypes in self.variants],
                       self.event_counts)).encode())
        return h.hexdigest()[:32]

    def to_json(self) -> str:
        return json.dumps({**self.summary(), "queues": self.queues,
                           "tasks": [{"name": t.name, "op": t.op.key, "args": t.args, "bind": t.bind,
                                      "waits": self.task_waits[t.index], "signal": self.task_signal[t.index]}
                                     for t in self.graph.tasks]}, indent=1)


SCHEDULES = ("round_robin", "zigzag", "list")


def assign_workers(num_tasks: int, deps: list[list[tuple[int, int]]], num_workers: int, schedule: str,
                   cost: list[float] | None = None) -> list[list[int]]:
    """Static queues: each worker's tasks in program order (so no queue waits on itself).

    round_robin: task i → worker i mod W. zigzag: W-1..0 on odd passes. list: greedy list
    scheduling, each task to the worker that can start it earliest given its producers'
    finish times under ``cost`` (unit cost by default); among workers that can start it
    equally early, the one free longest, then the lowest. ``deps`` are [first, end)
    intervals of producer indices per task (:meth:`TaskGraph.dependency_intervals`).
    The planner simulates the same three (:mod:`mk.planner.simulate`).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    queues: list[list[int]] = [[] for _ in range(num_workers)]
    if schedule == "round_robin":
        for i in range(num_tasks):
            queues[i % num_workers].append(i)
    elif schedule == "zigzag":
        for i in range(num_tasks):
            lap, pos = divmod(i, num_workers)
            queues[pos if lap % 2 == 0 else num_workers - 1 - pos].append(i)
    else:
        cost = cost or [1.0] * num_tasks
        free_at = [0.0] * num_workers
        finish = RangeMax(num_tasks)
        for i in range(num_tasks):
            ready = max((finish.max(a, b) for a, b in deps[i]), default=0.0)
            w = min(range(num_workers), key=lambda k: (max(free_at[k], ready), free_at[k], k))
            done = max(free_at[w], ready) + cost[i]
            finish.set(i, done)
            free_at[w] = done
            queues[w].append(i)
    return queues


def check_queues(queues: list[list[int]], num_tasks: int, num_workers: int) -> None:
    """Raise ValueError unless ``queues`` gives every task to exactly one of ``num_workers``
    queues, each in program order (a queue out of order could wait on its own later task)."""
    if len(queues) != num_workers:
        raise ValueError(f"queues: {len(queues)} queues for {num_workers} workers")
    seen = [False] * num_tasks
    for w, q in enumerate(queues):
        if any(b <= a for a, b in zip(q, q[1:])):
            raise ValueError(f"queues: worker {w}'s queue is not in program order")
        for i in q:
            if not 0 <= i < num_tasks or seen[i]:
                raise ValueError(f"queues: task {i} is out of range or queued twice")
            seen[i] = True
    if not all(seen):
        raise ValueError(f"queues: task {seen.index(False)} is in no queue")


def lower(graph: TaskGraph, num_workers: int, schedule: str = "round_robin",
          cost: list[float] | None = None, queues: list[list[int]] | None = None) -> Program:
    """Lower ``graph`` to a :class:`Program` for ``num_workers`` workers.

    The workers' queues come from ``schedule`` (:func:`assign_workers`), or are given as
    ``queues`` (task indices per worker, each in program order: the planner's simulated
    schedule, :meth:`mk.planner.simulate.Simulation.queues`).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if queues is not None:
        check_queues(queues, len(graph.tasks), num_workers)
    tasks = graph.tasks
    deps, events = graph.events()
    task_signal, task_waits = events.task_signal, events.task_waits
    event_counts, event_signallers = events.event_counts, events.event_signallers

    variants: list[tuple[OpSpec, tuple[torch.dtype, ...]]] = []
    variant_of: dict = {}
    buffer_names = list(graph.buffers)
    slot_of = {n: i for i, n in enumerate(buffer_names)}
    max_waits = max([len(w) for w in task_waits] + [1])
    max_slots = max([len(t.op.operands) for t in tasks] + [1])
    max_args = max([len(t.op.args) for t in tasks] + [1])
    words = HEADER_WORDS + 2 * max_waits + max_slots + max_args
    # (opcode, buffer slots) of each op object and binding: the tiles of one op share them.
    group_of: dict[tuple, tuple[int, list[int]]] = {}
    groups = []
    for t in tasks:
        gkey = (id(t.op), *t.bind.values())
        group = group_of.get(gkey)
        if group is None:
            dtypes = tuple(graph.buffers[t.bind[r]].dtype for r in t.op.operands)
            key = (t.op.key, dtypes)
            if key in variant_of and variants[variant_of[key]][0] != t.op:
                # One key means one generated branch: code that differs outside the
                # constexprs (an eps baked into the body, say) would silently run the wrong one.
                raise ValueError(f"task {t.name}: op {t.op.key} differs from another op with the same key; "
                                 f"put every static parameter that changes its code into constexprs")
            if key not in variant_of:
                variant_of[key] = len(variants)
                variants.append((t.op, dtypes))
            slots = [slot_of[t.bind[r]] for r in t.op.operands]
            group = group_of[gkey] = (variant_of[key], slots + [0] * (max_slots - len(slots)))
        groups.append(group)

    if queues is None:
        queues = assign_workers(len(tasks), deps, num_workers, schedule, cost)
    else:
        schedule = "given"
    order = [i for q in queues for i in q]
    rows = []
    no_waits = [0, 0] * max_waits
    for i in order:
        t = tasks[i]
        opcode, slots = groups[i]
        waits = task_waits[i]
        rec = [opcode, task_signal[i], len(waits), i]
        for ev, cnt in waits:
            rec += (ev, cnt)
        rec += no_waits[2 * len(waits):]
        rec += slots
        args = t.args
        rec += [args[a] for a in t.op.args]
        rec += [0] * (max_args - len(args))
        rows.append(rec)
    desc = torch.from_numpy(numpy.array(rows or [[0] * words], dtype=numpy.int32))
    starts = [0]
    for q in queues:
        starts.append(starts[-1] + len(q))
    return Program(graph=graph, variants=variants, buffer_names=buffer_names, desc=desc,
                   queue_starts=torch.tensor(starts, dtype=torch.int32), num_workers=num_workers,
                   num_events=len(event_signallers), event_counts=event_counts,
                   event_signallers=event_signallers, task_waits=task_waits, task_signal=task_signal,
                   queues=queues, max_waits=max_waits, max_slots=max_slots, max_args=max_args,
                   meta={"schedule": schedule})
