"""Dependencies and events for large graphs, without enumerating every edge.

A decode step has tens of thousands of tiles, and a matrix-vector tile (one of
:mod:`mk.tasks`' ops) reads all of its input:
each of the 4096 tiles of one 8192-row layer depends on all 4096 tiles of the layer
before, 16 million edges per layer boundary. Listing them is not an option, so here
dependencies are *intervals of task indices* and events are found by a sweep:

* :class:`RegionIndex` keeps, per buffer, the regions that tasks touched as *runs*:
  the same region again and again (every tile reading all of x), or boxes that tile one
  axis in order (the tiles of a layer writing their columns of y). A query bisects each
  run, so the tasks that touch a region come back as a few ``(first, end)`` intervals.
* :func:`group_events` gives producers with the same consumer set one event, as the
  lowering requires ("count reached" then means exactly "inputs ready"). Sweeping over
  the consumers' interval endpoints, each stretch of producers between two endpoints has
  one consumer set; stretches are matched by a hash of that set (a XOR of random 64-bit
  keys, one per consumer, with the set's size), never by building it.
* A graph that repeats itself (a model's layers: each the one before with its buffers
  renamed one to one) is derived from its first :data:`REDUCED_PERIODS` periods and what
  follows them (:func:`periodic_run`, :func:`reduce_run`). Once the last two kept periods
  wait alike, every later one waits as the last does, moved by its distance
  (:func:`expand_run`); where they do not, the whole graph is derived. An 8B step's
  32 layers cost five.

The cost is about (tasks + intervals + runs touched) × log, not edges.
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict
from dataclasses import dataclass, replace

from mk.tasks._spec import Region

Interval = tuple[int, int]  # task indices [first, end)


class _Run:
    """Boxes of one buffer touched by nondecreasing task indices, searchable by bisect.

    kind ``same``: one box repeated. ``cols`` / ``rows``: disjoint boxes in increasing
    order along that axis, all with the same extent across it. Boxes are ``(r0, r1, c0,
    c1)`` tuples (the fields of a :class:`~mk.tasks.Region`).
    """

    __slots__ = ("kind", "first", "starts", "ends", "tasks", "consecutive", "listed")

    def __init__(self, box: tuple, task: int) -> None:
        self.kind = "one"
        self.first = box
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.tasks = [task]
        self.consecutive = True
        self.listed = False  # on its buffer's list of cols runs (_Shelf)

    def extend(self, box: tuple, task: int) -> bool:
        """Append (box, task) if the run stays searchable; False if it does not. Along a
        run's axis a box may also repeat the last one (consecutive tiles that read the same
        box: starts and ends stay sorted, so bisect still finds every box that intersects)."""
        if task == self.tasks[-1]:
            return False  # a task's own boxes go to runs across its neighbours' (see RegionIndex)
        r0, r1, c0, c1 = box
        f0, f1, g0, g1 = self.first
        kind = self.kind
        if kind == "one" or kind == "same":
            if box == self.first:
                self.kind = "same"
            elif r0 == f0 and r1 == f1 and c0 >= g1:
                n = len(self.tasks)
                self.kind, self.starts, self.ends = "cols", [g0] * n + [c0], [g1] * n + [c1]
            elif c0 == g0 and c1 == g1 and r0 >= f1:
                n = len(self.tasks)
                self.kind, self.starts, self.ends = "rows", [f0] * n + [r0], [f1] * n + [r1]
            else:
                return False
        elif kind == "cols":
            if r0 != f0 or r1 != f1 or (c0 < self.ends[-1] and (c0 != self.starts[-1] or c1 != self.ends[-1])):
                return False
            self.starts.append(c0)
            self.ends.append(c1)
        else:
            if c0 != g0 or c1 != g1 or (r0 < self.ends[-1] and (r0 != self.starts[-1] or r1 != self.ends[-1])):
                return False
            self.starts.append(r0)
            self.ends.append(r1)
        tasks = self.tasks
        if self.consecutive and task != tasks[-1] + 1:
            self.consecutive = False
        tasks.append(task)
        return True

    def query(self, r0: int, r1: int, c0: int, c1: int) -> list[Interval]:
        """Task intervals of the run's boxes that intersect the (non-empty) box."""
        f0, f1, g0, g1 = self.first
        kind = self.kind
        if kind == "cols":
            # Across the run's axis every box has the first's extent; along it, bisect.
            if not (f0 < r1 and r0 < f1):
                return []
            lo = bisect.bisect_right(self.ends, c0)  # first box ending after c0
            hi = bisect.bisect_left(self.starts, c1)  # first box starting at or after c1
            if lo >= hi:
                return []
        elif kind == "rows":
            if not (g0 < c1 and c0 < g1):
                return []
            lo = bisect.bisect_right(self.ends, r0)
            hi = bisect.bisect_left(self.starts, r1)
            if lo >= hi:
                return []
        else:
            if not (f0 < r1 and r0 < f1 and g0 < c1 and c0 < g1):
                return []
            lo, hi = 0, len(self.tasks)
        if self.consecutive:
            return [(self.tasks[lo], self.tasks[hi - 1] + 1)]
        return merge_intervals([(t, t + 1) for t in self.tasks[lo:hi]])


#: Runs of one shape a region may continue (the latest): a rotary tile writes two boxes of
#: a cache row band (each head's halves), and its neighbour the next two.
OPEN_RUNS = 4


class RegionIndex:
    """Per buffer, the regions touched so far (as runs) and by which tasks.

    A region extends the run it continues, which need not be the buffer's latest: a
    split-K partial writes its tile of the workspace and its column of x**2 sums, and its
    neighbour the next tile and the next column, so the tiles make one run and the columns
    another (every region a run of its own would make each query scan the whole op); and
    a run takes one box a task, so that the boxes a reduce reads from every split join the
    runs of its neighbours' boxes in those splits rather than make a run of their own.
    Which run a region may continue is looked up by its shape (``_open``): the same box
    again, the next box as wide in its row band, or as high in its column band (the
    latest :data:`OPEN_RUNS` runs of each).
    """

    def __init__(self) -> None:
        self._runs: dict[str, _Shelf] = {}
        self._open: dict[tuple, list[_Run]] = {}

    def add(self, region: Region, task: int) -> None:
        buffer, r0, r1, c0, c1 = region
        if r1 <= r0 or c1 <= c0:
            return
        box = (r0, r1, c0, c1)
        shelf = self._runs.get(buffer)
        if shelf is None:
            shelf = self._runs[buffer] = _Shelf()
        last = shelf.last
        if last is not None and last.extend(box, task):
            shelf.placed(last)
            return
        # The same box, the next box of this width in its row band, of this height in its column band.
        keys = ((buffer, 0, box), (buffer, 1, r0, r1, c1 - c0), (buffer, 2, c0, c1, r1 - r0))
        opened = self._open
        for key in keys:
            for run in opened.get(key, ()):
                if run.extend(box, task):
                    shelf.placed(run)
                    return
        run = _Run(box, task)
        shelf.add(run)
        for key in keys:
            candidates = opened.setdefault(key, [])
            if len(candidates) == OPEN_RUNS:
                del candidates[0]
            candidates.append(run)

    def query(self, region: Region) -> list[Interval]:
        """Intervals of the tasks whose regions intersect ``region`` (unmerged)."""
        buffer, r0, r1, c0, c1 = region
        if r1 <= r0 or c1 <= c0:
            return []
        shelf = self._runs.get(buffer)
        if shelf is None:
            return []
        out: list[Interval] = []
        for run in shelf.candidates(r0, r1, c0, c1):
            # Across its axis a run keeps its first box's extent: most candidates (every
            # earlier layer's, where layers share the buffer) fail here, without a call.
            f0, f1, g0, g1 = run.first
            kind = run.kind
            if (kind != "rows" and (f1 <= r0 or r1 <= f0)) or (kind != "cols" and (g1 <= c0 or c1 <= g0)):
                continue
            found = run.query(r0, r1, c0, c1)
            if found:
                out.extend(found)
        return out


class _Shelf:
    """One buffer's runs, found by the axis they keep fixed: every run but a ``cols`` run
    keeps its first box's columns, a ``cols`` run its rows. Each kind is kept sorted by
    where that extent starts, so a query bisects to the runs starting less than the widest
    (tallest) such extent before its own columns (rows), not every run of the buffer."""

    __slots__ = ("by_cols", "by_rows", "last")

    def __init__(self) -> None:
        self.by_cols = _Sorted()  # runs that keep their columns
        self.by_rows = _Sorted()  # cols runs: they keep their rows
        self.last: _Run | None = None  # the latest run created

    def add(self, run: _Run) -> None:
        _, _, c0, c1 = run.first
        self.by_cols.add(c0, c1, run)
        self.last = run

    def placed(self, run: _Run) -> None:
        """``run`` took a box: one that became a ``cols`` run is found by its rows from now on."""
        if run.kind == "cols" and not run.listed:
            run.listed = True
            r0, r1, _, _ = run.first
            self.by_rows.add(r0, r1, run)

    def candidates(self, r0: int, r1: int, c0: int, c1: int) -> list[_Run]:
        found = [r for r in self.by_cols.overlapping(c0, c1) if r.kind != "cols"]
        if self.by_rows.runs:
            found += self.by_rows.overlapping(r0, r1)
        return found


class _Sorted:
    """Runs by the start of an extent they keep, with the longest such extent."""

    __slots__ = ("starts", "runs", "longest")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.runs: list[_Run] = []
        self.longest = 0

    def add(self, a: int, b: int, run: _Run) -> None:
        k = bisect.bisect_right(self.starts, a)
        self.starts.insert(k, a)
        self.runs.insert(k, run)
        if b - a > self.longest:
            self.longest = b - a

    def overlapping(self, a: int, b: int) -> list[_Run]:
        """The runs whose extent may meet [a, b) (a superset: the caller checks)."""
        lo = bisect.bisect_right(self.starts, a - self.longest)
        return self.runs[lo:bisect.bisect_left(self.starts, b)]


def merge_intervals(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint, non-adjacent union of half-open intervals."""
    merged: list[Interval] = []
    for a, b in sorted(intervals):
        if a >= b:
            continue
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def remove_index(intervals: list[Interval], i: int) -> list[Interval]:
    """``intervals`` without index ``i``."""
    out: list[Interval] = []
    for a, b in intervals:
        if a <= i < b:
            out.extend(iv for iv in ((a, i), (i + 1, b)) if iv[0] < iv[1])
        else:
            out.append((a, b))
    return out


def dependency_intervals(tasks) -> list[list[Interval]]:
    """For each task (in program order), the earlier tasks it depends on, as intervals.

    Read after write, write after read and write after write, as
    :meth:`~mk.persistent.graph.TaskGraph.dependencies` defines them (never on an earlier
    member of the task's own team).
    """
    written, read = RegionIndex(), RegionIndex()
    deps: list[list[Interval]] = []
    for task in tasks:
        r_regions, w_regions = task.reads(), task.writes()
        found: list[Interval] = []
        for region in r_regions:
            found += written.query(region)
        for region in w_regions:
            found += read.query(region)
            found += written.query(region)
        mine = merge_intervals(found)
        if task.team_start < task.index:  # a team synchronises itself
            mine = subtract_intervals(mine, [(task.team_start, task.index)])
        deps.append(remove_index(mine, task.index))
        for region in r_regions:
            read.add(region, task.index)
        for region in w_regions:
            written.add(region, task.index)
    return deps


def subtract_intervals(intervals: list[Interval], remove: list[Interval]) -> list[Interval]:
    """``intervals`` minus ``remove`` (both sorted and disjoint)."""
    out: list[Interval] = []
    k = 0
    for a, b in intervals:
        while k < len(remove) and remove[k][1] <= a:
            k += 1
        j = k
        while a < b and j < len(remove) and remove[j][0] < b:
            ra, rb = remove[j]
            if ra > a:
                out.append((a, ra))
            a = max(a, rb)
            j += 1
        if a < b:
            out.append((a, b))
    return out


def drop_implied(deps: list[list[Interval]], max_intervals: int = 64, full_span: int = 1024) -> list[list[Interval]]:
    """Dependencies without those that another dependency already implies.

    A task that depends on p and on w, where w (transitively) depends on p, need not
    wait for p: w cannot finish before p. Without this, in a decode step of mk.tasks' ops,
    a layer's O-projection tile that reads one column block of the residual (written by one
    down-projection tile of the layer before) gives every down-projection tile its own
    consumer set, and the next layer's first tiles then wait on one event per
    down-projection tile (hundreds of waits, each a branch of generated code) instead of one.

    Ancestors are tracked as interval lists, under-approximated so that this stays cheap:
    a task's ancestors are its dependencies plus the ancestors of every task of each
    dependency interval (of its first and last task only, for intervals longer than
    ``full_span``), keeping the latest ``max_intervals`` intervals; unions are cached
    per interval, since the tiles of one op share theirs. Dropping only what is in a
    dependency's ancestors is sound whatever is left out.
    """
    ancestors: list[list[Interval]] = []
    span_cache: dict[Interval, list[Interval]] = {}

    def span_ancestors(a: int, b: int) -> list[Interval]:
        got = span_cache.get((a, b))
        if got is None:
            tasks = range(a, b) if b - a <= full_span else (a, b - 1)
            got = span_cache[(a, b)] = merge_intervals([iv for w in tasks for iv in ancestors[w]])
        return got

    out: list[list[Interval]] = []
    for intervals in deps:
        implied = merge_intervals([iv for a, b in intervals for iv in span_ancestors(a, b)])
        out.append(subtract_intervals(intervals, implied) if implied else intervals)
        ancestors.append(merge_intervals(implied + intervals)[-max_intervals:])
    return out


@dataclass
class Events:
    """Producers grouped by consumer set: what each task signals and waits on."""

    task_signal: list[int]  # event a task signals, -1 if nothing consumes its output
    event_counts: list[int]  # producers per event (signals per launch)
    event_signallers: list[list[int]]
    task_waits: list[list[tuple[int, int]]]  # (event, count) per task, events sorted


def group_events(num_tasks: int, deps: list[list[Interval]], seed: int = 0x6D6B) -> Events:
    """One event per distinct consumer set; see the module docstring."""
    rng = random.Random(seed)
    key_delta: dict[int, int] = defaultdict(int)
    count_delta: dict[int, int] = defaultdict(int)
    for c, intervals in enumerate(deps):
        if not intervals:
            continue
        key = rng.getrandbits(64)
        for a, b in intervals:
            key_delta[a] ^= key
            key_delta[b] ^= key
            count_delta[a] += 1
            count_delta[b] -= 1
    points = sorted(set(key_delta) | set(count_delta))
    # Segment k = producers [points[k], points[k+1]): one consumer set, one event (or none).
    seg_event: list[int] = []
    event_of: dict[tuple[int, int], int] = {}
    task_signal = [-1] * num_tasks
    event_signallers: list[list[int]] = []
    h, n = 0, 0
    for k, p in enumerate(points):
        h ^= key_delta.get(p, 0)
        n += count_delta.get(p, 0)
        end = points[k + 1] if k + 1 < len(points) else p
        if n == 0 or end <= p:
            seg_event.append(-1)
            continue
        ev = event_of.setdefault((h, n), len(event_signallers))
        if ev == len(event_signallers):
            event_signallers.append([])
        seg_event.append(ev)
        event_signallers[ev].extend(range(p, end))
        task_signal[p:end] = [ev] * (end - p)
    event_counts = [len(s) for s in event_signallers]
    task_waits: list[list[tuple[int, int]]] = []
    waits_of: dict[tuple, list[tuple[int, int]]] = {}  # the tiles of one op share their intervals
    for intervals in deps:
        key = tuple(intervals)
        waits = waits_of.get(key)
        if waits is None:
            evs: set[int] = set()
            for a, b in intervals:
                k = bisect.bisect_left(points, a)
                while k < len(points) and points[k] < b:
                    evs.add(seg_event[k])
                    k += 1
            evs.discard(-1)
            waits = waits_of[key] = [(ev, event_counts[ev]) for ev in sorted(evs)]
        task_waits.append(list(waits))
    return Events(task_signal, event_counts, event_signallers, task_waits)


class RangeMax:
    """Maximum of a growing list of nonnegative values over index ranges, in O(sqrt n) per
    query (list schedules, :mod:`mk.planner.simulate`)."""

    BLOCK = 256

    def __init__(self, n: int) -> None:
        self.values = [0.0] * n
        self.blocks = [0.0] * (n // self.BLOCK + 1)

    def set(self, i: int, v: float) -> None:
        self.values[i] = v
        b = i // self.BLOCK
        if v > self.blocks[b]:
            self.blocks[b] = v

    def max(self, a: int, b: int) -> float:
        """The most of values [a, b) (0 when empty): whole blocks from their maxima, the
        ragged ends as slices."""
        if b - a <= 2 * self.BLOCK:
            return max(self.values[a:b], default=0.0)
        first, last = -(-a // self.BLOCK), b // self.BLOCK
        return max(max(self.values[a:first * self.BLOCK], default=0.0), max(self.blocks[first:last]),
                   max(self.values[last * self.BLOCK:b], default=0.0))


#: Periods of a repeating run whose dependencies are derived (:func:`reduce_run`): the
#: first's may differ from the rest (its waits on what came before the run), the last two
#: show whether the rest repeat.
REDUCED_PERIODS = 4


def _congruent(tasks, a: int, b: int, length: int) -> bool:
    """Whether tasks [b, b + length) are tasks [a, a + length) with their buffers renamed
    one to one: the same ops, arguments and teams, in the same order."""
    fwd: dict[str, str] = {}
    back: dict[str, str] = {}
    pair = None  # the last pair of bindings checked (the tiles of one op share theirs)
    for t, u in zip(tasks[a:a + length], tasks[b:b + length]):
        if ((t.op is not u.op and t.op.key != u.op.key) or t.args != u.args
                or t.team_start - t.index != u.team_start - u.index):
            return False
        if pair is not None and t.bind is pair[0] and u.bind is pair[1]:
            continue
        pair = (t.bind, u.bind)
        if t.bind.keys() != u.bind.keys():
            return False
        for role, name in t.bind.items():
            other = u.bind[role]
            if fwd.setdefault(name, other) != other or back.setdefault(other, name) != name:
                return False
    return True


def periodic_run(tasks, periods: list[Interval]) -> tuple[int, int, int] | None:
    """The longest run of consecutive, equally long ``periods`` (task ranges), each the one
    before with its buffers renamed one to one (:func:`_congruent`), as (first task,
    period length, periods); None if no run is long enough to be worth reducing."""
    best, start = None, 0
    for k in range(1, len(periods) + 1):
        a, b = periods[k - 1]
        if (k < len(periods) and periods[k][0] == b and periods[k][1] - periods[k][0] == b - a
                and _congruent(tasks, a, b, b - a)):
            continue
        count = k - start
        first, end = periods[start]
        if count >= REDUCED_PERIODS + 2 and end > first and (best is None or count > best[2]):
            best = (first, end - first, count)
        start = k
    return best


def reduce_run(tasks, run: tuple[int, int, int]) -> tuple[list, tuple] | None:
    """The graph with the run cut to its first :data:`REDUCED_PERIODS` periods, and what is
    after the run renamed from the last period's buffers to the kept last's, with the run;
    None where that would not keep every conflict (a task after the run binds a buffer of
    a period cut out, or a team crosses the run's end)."""
    s, length, n = run
    end, keep = s + n * length, s + REDUCED_PERIODS * length
    last, kept_last = s + (n - 1) * length, keep - length
    rename: dict[str, str] = {}
    for t, u in zip(tasks[last:end], tasks[kept_last:keep]):
        for role, name in t.bind.items():
            rename[name] = u.bind[role]
    cut = {name for t in tasks[keep:last] for name in t.bind.values()}
    shift = (n - REDUCED_PERIODS) * length
    after = []
    for t in tasks[end:]:
        if t.team_start < end or any(b in cut and b not in rename for b in t.bind.values()):
            return None
        after.append(replace(t, index=t.index - shift, team_start=t.team_start - shift,
                             bind={role: rename.get(b, b) for role, b in t.bind.items()}))
    return list(tasks[:keep]) + after, run


def _shift(intervals: list[Interval], at: int, by: int, below: int) -> list[Interval] | None:
    """``intervals`` with those at or after ``at`` moved by ``by``; those ending by
    ``below`` kept; None if any other (the run is not periodic where it matters)."""
    out = []
    for a, b in intervals:
        if a >= at:
            out.append((a + by, b + by))
        elif b <= below:
            out.append((a, b))
        else:
            return None
    return out


def expand_run(deps: list[list[Interval]], run: tuple[int, int, int], num_tasks: int
               ) -> list[list[Interval]] | None:
    """The dependencies of the whole graph from those of its reduced graph
    (:func:`reduce_run`): every period after the kept ones waits as the kept last does,
    moved by its distance; tasks after the run as in the reduced graph, moved to the run's
    end. None unless the kept last two periods wait alike, moved by one period (on their
    own run, and on what is before it), and what is after the run waits only on the last
    period and on what is before the run's second period (the caller derives it all then)."""
    s, length, n = run
    R = REDUCED_PERIODS
    second, kept_last = s + length, s + (R - 1) * length
    for j in range(length):
        if _shift(deps[kept_last - length + j], second, length, second) != deps[kept_last + j]:
            return None
    out = deps[:s + R * length]
    for k in range(R, n):
        by = (k - R + 1) * length
        for j in range(length):
            out.append(_shift(deps[kept_last + j], second, by, second))
    shift = (n - R) * length
    for d in deps[s + R * length:]:
        moved = _shift(d, kept_last, shift, second)
        if moved is None:
            return None
        out.append(moved)
    return out if len(out) == num_tasks else None
