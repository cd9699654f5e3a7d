"""Interval dependencies and sweep-grouped events against brute force on random regions."""

import random
from dataclasses import dataclass

import pytest

from mk.persistent.deps import (
    RangeMax,
    dependency_intervals,
    drop_implied,
    group_events,
    merge_intervals,
    subtract_intervals,
)
from mk.tasks import Region


@dataclass
class FakeTask:
    index: int
    r: list
    w: list
    team_start: int = -1

    def __post_init__(self):
        if self.team_start < 0:
            self.team_start = self.index

    def reads(self):
        return self.r

    def writes(self):
        return self.w


def brute_force_deps(tasks):
    deps = []
    for t in tasks:
        mine = set()
        for u in tasks[: t.index]:
            if u.index >= t.team_start:
                continue  # an earlier member of t's team: teams synchronise themselves
            if (any(a.intersects(b) for a in t.reads() for b in u.writes())
                    or any(a.intersects(b) for a in t.writes() for b in u.reads() + u.writes())):
                mine.add(u.index)
        deps.append(sorted(mine))
    return deps


def random_tasks(rng: random.Random, n: int):
    """Tasks whose regions mix the structured runs (repeats, column and row tilings) with
    random boxes, over three small buffers."""
    tasks = []
    while len(tasks) < n:
        buf = rng.choice("abc")
        kind = rng.random()
        if kind < 0.3:  # a layer: tiles along columns write, each reads a whole other buffer
            src = rng.choice("abc")
            width = rng.randint(1, 4)
            for j in range(rng.randint(1, 5)):
                tasks.append(FakeTask(len(tasks), [Region(src, 0, 2, 0, 12)],
                                      [Region(buf, 0, 2, j * width, (j + 1) * width)]))
        elif kind < 0.45:  # row tiling
            for j in range(rng.randint(1, 4)):
                tasks.append(FakeTask(len(tasks), [Region(buf, j, j + 1, 0, 12)], [Region(rng.choice("abc"), j, j + 1, 0, 6)]))
        else:
            def box(b):
                r0, c0 = rng.randint(0, 3), rng.randint(0, 11)
                return Region(b, r0, rng.randint(r0, 4), c0, rng.randint(c0, 12))
            tasks.append(FakeTask(len(tasks), [box(rng.choice("abc")) for _ in range(rng.randint(0, 2))],
                                  [box(rng.choice("abc")) for _ in range(rng.randint(0, 2))]))
    return tasks[:n]


@pytest.mark.parametrize("seed", range(20))
def test_intervals_equal_brute_force(seed):
    rng = random.Random(seed)
    tasks = random_tasks(rng, rng.randint(1, 60))
    got = [[t for a, b in ivs for t in range(a, b)] for ivs in dependency_intervals(tasks)]
    assert got == brute_force_deps(tasks)


@pytest.mark.parametrize("seed", range(10))
def test_team_members_never_depend_on_one_another(seed):
    rng = random.Random(300 + seed)
    tasks = random_tasks(rng, rng.randint(10, 60))
    i = 0
    while i < len(tasks):  # random runs of consecutive tasks become teams
        n = rng.randint(1, 4)
        for t in tasks[i:i + n]:
            t.team_start = i
        i += n
    got = [[t for a, b in ivs for t in range(a, b)] for ivs in dependency_intervals(tasks)]
    assert got == brute_force_deps(tasks)
    # ... and without the teams some members would have depended on one another
    starts = [t.team_start for t in tasks]
    for t in tasks:
        t.team_start = t.index
    assert any(starts[c] <= p for c, d in enumerate(brute_force_deps(tasks)) for p in d)


@pytest.mark.parametrize("seed", range(20))
def test_events_group_exactly_the_producers_with_one_consumer_set(seed):
    rng = random.Random(100 + seed)
    tasks = random_tasks(rng, rng.randint(1, 60))
    ivs = dependency_intervals(tasks)
    deps = [[t for a, b in iv for t in range(a, b)] for iv in ivs]
    ev = group_events(len(tasks), ivs)
    consumers = {i: frozenset(c for c, d in enumerate(deps) if i in d) for i in range(len(tasks))}
    for i, cs in consumers.items():
        assert (ev.task_signal[i] == -1) == (not cs)
    for i in range(len(tasks)):
        for j in range(len(tasks)):
            if consumers[i] and consumers[j]:
                assert (ev.task_signal[i] == ev.task_signal[j]) == (consumers[i] == consumers[j])
    for c, d in enumerate(deps):
        waited = sorted(t for e, cnt in ev.task_waits[c] for t in ev.event_signallers[e])
        assert waited == d  # exactly its producers, no more
        assert all(cnt == len(ev.event_signallers[e]) for e, cnt in ev.task_waits[c])


def test_a_long_gemv_chain_is_one_event_per_layer():
    """16 layers x 4096 tiles: 16.7 million edges per boundary if listed, one event here."""
    tiles, layers = 4096, 16
    tasks = []
    for layer in range(layers):
        for j in range(tiles):
            tasks.append(FakeTask(len(tasks), [Region(f"h{layer}", 0, 1, 0, 2 * tiles)],
                                  [Region(f"h{layer + 1}", 0, 1, 2 * j, 2 * j + 2)]))
    ivs = dependency_intervals(tasks)
    assert ivs[tiles] == [(0, tiles)] and ivs[-1] == [((layers - 2) * tiles, (layers - 1) * tiles)]
    ev = group_events(len(tasks), ivs)
    assert ev.event_counts == [tiles] * (layers - 1)
    assert ev.task_waits[-1] == [(layers - 2, tiles)] and ev.task_waits[0] == []


def closure(deps):
    """Transitive predecessors of each task, by brute force."""
    anc = []
    for d in deps:
        mine = set(d)
        for w in d:
            mine |= anc[w]
        anc.append(mine)
    return anc


@pytest.mark.parametrize("seed", range(20))
def test_dropping_implied_dependencies_keeps_the_same_order(seed):
    rng = random.Random(300 + seed)
    tasks = random_tasks(rng, rng.randint(1, 80))
    ivs = dependency_intervals(tasks)
    expand = lambda iv: [[t for a, b in x for t in range(a, b)] for x in iv]  # noqa: E731
    kept = drop_implied(ivs, max_intervals=rng.choice([1, 2, 64]), full_span=rng.choice([1, 3, 1024]))
    full, kept = expand(ivs), expand(kept)
    assert all(set(k) <= set(f) for k, f in zip(kept, full))
    assert closure(kept) == closure(full)  # same happens-before: nothing needed was dropped


def test_a_residual_read_does_not_split_the_layer_event():
    """Down-projection tiles write x columns; the next layer's norm+QKV tiles read all of x,
    its O-projection tiles read their x columns as the residual, after attention (which
    waits on the QKV tiles). The residual reads are implied, so the down tiles share one
    event and every QKV tile waits once."""
    tiles = 64
    tasks = []
    for j in range(tiles):  # down projection
        tasks.append(FakeTask(len(tasks), [Region("act", 0, 1, 0, 8)], [Region("x", 0, 1, 2 * j, 2 * j + 2)]))
    for j in range(tiles):  # qkv (norm prologue reads all of x)
        tasks.append(FakeTask(len(tasks), [Region("x", 0, 1, 0, 2 * tiles)], [Region("qkv", 0, 1, j, j + 1)]))
    for h in range(4):  # attention heads, through a merge
        tasks.append(FakeTask(len(tasks), [Region("qkv", 0, 1, 16 * h, 16 * h + 16)], [Region("part", h, h + 1, 0, 4)]))
    tasks.append(FakeTask(len(tasks), [Region("part", 0, 4, 0, 4)], [Region("attn", 0, 1, 0, 8)]))
    for j in range(tiles):  # O projection + residual
        tasks.append(FakeTask(len(tasks), [Region("attn", 0, 1, 0, 8), Region("x", 0, 1, 2 * j, 2 * j + 2)],
                              [Region("h", 0, 1, 2 * j, 2 * j + 2)]))
    full = dependency_intervals(tasks)
    assert len(group_events(len(tasks), full).task_waits[tiles]) == tiles  # one event per down tile
    ev = group_events(len(tasks), drop_implied(full))
    assert ev.task_waits[tiles] == [(ev.task_signal[0], tiles)]
    assert all(len(w) == 1 for w in ev.task_waits[tiles:])


def test_subtract_intervals():
    rng = random.Random(1)
    for _ in range(200):
        def ivs():
            return merge_intervals([(a, a + rng.randint(1, 5)) for a in rng.sample(range(30), rng.randint(0, 6))])
        x, y = ivs(), ivs()
        want = sorted({t for a, b in x for t in range(a, b)} - {t for a, b in y for t in range(a, b)})
        got = subtract_intervals(x, y)
        assert [t for a, b in got for t in range(a, b)] == want
        assert got == merge_intervals(got) or all(got[i][1] <= got[i + 1][0] for i in range(len(got) - 1))


def test_merge_and_range_max():
    assert merge_intervals([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    rng = random.Random(0)
    vals = [rng.random() for _ in range(1000)]
    rm = RangeMax(len(vals))
    for i, v in enumerate(vals):
        rm.set(i, v)
    for _ in range(200):
        a = rng.randint(0, 999)
        b = rng.randint(a, 1000)
        assert rm.max(a, b) == (max(vals[a:b]) if b > a else 0.0)


def test_lowered_dependencies_are_cached_by_the_graphs_structure(tmp_path, monkeypatch):
    # A graph lowered again loads its dependencies and events from disk, and gets the same
    # program; a graph that differs in one task (a tile argument) gets its own entry; an
    # unreadable entry is derived again.
    import torch

    from mk.persistent.graph import TaskGraph, lower
    from mk.tasks._cache import cache_dir
    from mk.tasks import make_op
    from mk.tasks.linear import linear_tiles

    monkeypatch.setenv("MK_CACHE_DIR", str(tmp_path))

    def graph(last_pid_n):
        g = TaskGraph()
        g.buffer("x", torch.randn(1, 64)), g.buffer("w", torch.randn(96, 64)), g.buffer("y", torch.empty(1, 96))
        g.buffer("w2", torch.randn(32, 96)), g.buffer("z", torch.empty(1, 32))
        op = make_op("linear", M=1, N=96, K=64, block_n=16, dtype=torch.float32)
        for tile in linear_tiles(op):
            g.add(op, x="x", w="w", out="y", **tile)
        op2 = make_op("linear", M=1, N=32, K=96, block_n=16, dtype=torch.float32)
        g.add(op2, x="y", w="w2", out="z", pid_m=0, pid_n=0)
        g.add(op2, x="y", w="w2", out="z", pid_m=0, pid_n=last_pid_n)
        return g

    first = lower(graph(1), num_workers=3)
    files = list(cache_dir("deps").glob("*.pkl"))
    assert len(files) == 1
    import mk.persistent.graph as graph_module

    def derive(*a, **k):
        raise AssertionError("derived again")

    with monkeypatch.context() as m:
        m.setattr(graph_module, "drop_implied", derive)
        again = lower(graph(1), num_workers=3)
    assert again.task_waits == first.task_waits and torch.equal(again.desc, first.desc)
    assert graph(1).structure_key() != graph(0).structure_key()
    other = lower(graph(0), num_workers=3)  # the last task now rewrites tile 0: it waits on the one before
    assert len(list(cache_dir("deps").glob("*.pkl"))) == 2 and other.task_waits != first.task_waits
    files[0].write_bytes(b"not a pickle")
    assert lower(graph(1), num_workers=3).task_waits == first.task_waits


def test_a_schedule_digest_follows_queues_and_args_except_those_skipped():
    # Ranks of a tensor-parallel step compare their schedules by it (they differ only in
    # their own index): the same lowering gives the same digest, other queues or another
    # argument another, and a skipped argument none.
    import torch

    from mk.persistent.graph import TaskGraph, lower
    from mk.tasks import make_op, op_tiles

    def program(rank, schedule="round_robin"):
        g = TaskGraph()
        g.buffer("ids", torch.tensor([1, 5, 7, 4, 0], dtype=torch.int32))
        g.buffer("table", torch.randn(4, 48)), g.buffer("out", torch.zeros(5, 48))
        spec = make_op("embedding", rows=5, vocab=4, hidden=48, ranks=2, block_h=16)
        g.add_tiles(spec, [dict(t, rank=rank) for t in op_tiles(spec)], ids="ids", table="table", out="out")
        return lower(g, num_workers=2, schedule=schedule)

    first = program(0)
    assert first.schedule_digest() == program(0).schedule_digest()
    assert first.schedule_digest() != program(1).schedule_digest()
    assert first.schedule_digest(skip_args=("rank",)) == program(1).schedule_digest(skip_args=("rank",))
    zigzag = program(0, "zigzag")
    assert zigzag.queues != first.queues and zigzag.schedule_digest() != first.schedule_digest()
