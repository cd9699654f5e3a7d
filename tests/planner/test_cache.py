"""The plan cache: a hit returns the same plan, any change of key misses, corrupt files re-plan."""

import pytest

from mk.planner.cache import cached_plan, plan_dir, schedule_variants
from mk.planner.device import DeviceSpec
from mk.models.blocks import ModelShape, decode_graph
from mk.planner.search import Plan
from mk.planner.simulate import simulate_step


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("MK_CACHE_DIR", str(tmp_path))


def test_hit_miss_and_corrupt_file():
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), 1, 128)
    h200 = DeviceSpec.preset("h200")
    first, hit = cached_plan(g, h200)
    assert not hit
    again, hit = cached_plan(g, h200)
    assert hit and again.choices == first.choices and again.predicted_s == first.predicted_s
    # A different batch, budget or device is a different plan.
    assert not cached_plan(decode_graph(ModelShape.preset("llama-3.2-1b"), 8, 128), h200)[1]
    assert not cached_plan(g, h200.with_smem_budget("99KiB"))[1]
    assert not cached_plan(g, DeviceSpec.preset("l40s"))[1]
    # A corrupt file is planned again and replaced.
    files = sorted(plan_dir().glob("*.json"))
    assert len(files) == 4
    for f in files:
        f.write_text("{broken")
    plan, hit = cached_plan(g, h200)
    assert not hit and plan.choices == first.choices
    assert cached_plan(g, h200)[1]


def test_plan_json_round_trip_with_estimates():
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), 2, 64)
    h200 = DeviceSpec.preset("h200")
    plan, _ = cached_plan(g, h200)
    back = Plan.from_json(plan.to_json(), g, h200)
    assert back.choices == plan.choices and len(back.estimates) == len(plan.choices)
    assert (back.predicted_s, back.schedule, back.schedule_s) == (plan.predicted_s, plan.schedule, plan.schedule_s)
    # The prediction is the simulated step under the plan's schedule; the per-op estimates
    # (each phase spread evenly over the workers) sum to no less.
    sim = simulate_step(g, back.choices, h200, back.workers, back.schedule)
    assert sim.seconds == pytest.approx(plan.predicted_s, rel=1e-9)
    assert h200.launch_overhead_s + sum(e.seconds for e in back.estimates) >= sim.seconds


def test_measure_mode_keeps_the_fastest_measured_plan_and_caches_it():
    """measure mode times the search's top plans and keeps the fastest measured one, even
    when it is not the cheapest predicted; the pick is cached apart from predicted plans."""
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), 1, 256)
    h200 = DeviceSpec.preset("h200")
    predicted, _ = cached_plan(g, h200)
    timed = []

    def fake_timer(plan):  # the predicted order reversed
        timed.append(plan.predicted_s)
        return 1.0 / plan.predicted_s

    picked, hit = cached_plan(g, h200, measure=fake_timer, top_k=3)
    variants = schedule_variants(predicted)  # the best plan under near-tie schedules, timed last
    assert not hit and len(timed) == 3 + len(variants) and timed[:3] == sorted(timed[:3])
    assert picked.predicted_s == max(timed) and picked.measured_s == pytest.approx(1 / max(timed))
    assert picked.choices != predicted.choices
    again, hit = cached_plan(g, h200, measure=lambda p: pytest.fail("a cached pick is not timed again"), top_k=3)
    assert hit and again.choices == picked.choices and again.measured_s == picked.measured_s
    assert cached_plan(g, h200)[0].choices == predicted.choices  # predicted plans unaffected
    assert "measured" in again.explain().splitlines()[0]


def test_measure_mode_lets_the_gpu_pick_between_near_tie_schedules():
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), 1, 256)
    h200 = DeviceSpec.preset("h200")
    predicted, _ = cached_plan(g, h200)
    # At batch 1 every phase waits for the one before: list and round-robin simulate equal,
    # zig-zag (which doubles up workers where a phase turns a lap) well behind.
    assert predicted.schedule_s["list"] == pytest.approx(predicted.schedule_s["round_robin"])
    assert predicted.schedule_s["zigzag"] > 1.05 * predicted.predicted_s
    assert [(v.schedule, v.choices) for v in schedule_variants(predicted)] == [("list", predicted.choices)]
    timed = []

    def list_wins(plan):
        timed.append(plan.schedule)
        return 0.5 if plan.schedule == "list" else 1.0

    picked, _ = cached_plan(g, h200, measure=list_wins, top_k=2)
    assert timed == [predicted.schedule, predicted.schedule, "list"]  # two plans, then the variant
    assert (picked.schedule, picked.measured_s, picked.choices) == ("list", 0.5, predicted.choices)
    assert cached_plan(g, h200, measure=list_wins, top_k=2)[0].schedule == "list"  # cached with its schedule


def test_pick_measured_refuses_a_bad_timing():
    from mk.planner.search import pick_measured, search

    plans = search(decode_graph(ModelShape.preset("llama-3.2-1b"), 1, 64), DeviceSpec.preset("h200"), top_k=2)
    with pytest.raises(ValueError, match="must be positive"):
        pick_measured(plans, lambda p: 0.0)
    with pytest.raises(ValueError, match="at least one"):
        pick_measured([], lambda p: 1.0)


def test_the_key_covers_the_task_rules_the_cost_model_reads(tmp_path, monkeypatch):
    """A plan is priced with the tasks' own rules (mk.tasks.linear.gemv_stream, shared-memory
    sizes): editing a task module, one of a task package too, must give a new key, as editing
    the planner does."""
    import mk.planner.cache as cache

    g = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=1, kv_len=64)
    spec = DeviceSpec.preset("h200")
    names = {p.relative_to(p.parent.parent).as_posix() for p in cache._planner_sources()}
    assert {"planner/cost.py", "linear/config.py", "tasks/decode_attention.py"} <= names
    before = cache.plan_key(g, spec, 264, 6)
    linear = next(p for p in cache._planner_sources() if p.name == "config.py" and p.parent.name == "linear")
    edited = tmp_path / "config.py"
    edited.write_bytes(linear.read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(cache, "_planner_sources",
                        lambda real=cache._planner_sources: [edited if p == linear else p for p in real()])
    cache._planner_source_hash.cache_clear()  # (hashed once a process: as a new process would see it)
    try:
        assert cache.plan_key(g, spec, 264, 6) != before
    finally:
        monkeypatch.undo()
        cache._planner_source_hash.cache_clear()


def test_measure_mode_over_ranks_times_rank_0_s_candidates_with_the_sums_in_tiles_of_their_own():
    from mk.planner.search import own_all_reduces

    g = decode_graph(ModelShape.preset("llama-3-8b").shard(2), 8, 256)
    h200 = DeviceSpec.preset("h200")
    predicted, _ = cached_plan(g, h200)
    kinds = {n.name: n.kind for n in g.nodes}

    def sums_in_tiles(plan):
        return [f for c in plan.choices.values() for f in c.fuse if kinds[f] == "all_reduce"]

    # The variant: every all-reduce the projections' tiles ran gets tiles of its own, the
    # rest as it was, simulated anew.
    own = own_all_reduces(predicted, g, h200)
    assert sums_in_tiles(predicted) and not sums_in_tiles(own)
    assert all(name in own.choices for name in sums_in_tiles(predicted))
    assert all(own.choices[n].block_n == c.block_n and own.choices[n].split_k == c.split_k
               for n, c in predicted.choices.items())
    assert own.predicted_s == pytest.approx(simulate_step(g, own.choices, h200, own.workers, own.schedule).seconds)
    assert own_all_reduces(own, g, h200) is None

    class Ranks:  # one rank's view of the others: whether all hit, and what rank 0 shares
        def __init__(self, lead: bool, others_hit: bool = True, rank_0_sends=None):
            self.lead, self.others_hit, self.rank_0_sends, self.sent = lead, others_hit, rank_0_sends, []

        def all(self, flag):
            return flag and self.others_hit

        def share(self, obj):
            self.sent.append(obj)
            return obj if self.lead else self.rank_0_sends

    timed = []

    def own_wins(plan):
        timed.append(plan.to_json())
        return 1.0 if sums_in_tiles(plan) else 0.5

    # Rank 0 searches and sends its candidates, the own-tiles variant among them.
    rank_0 = Ranks(lead=True)
    picked, hit = cached_plan(g, h200, measure=own_wins, top_k=2, ranks=rank_0)
    (sent,) = rank_0.sent
    assert not hit and timed == sent
    assert not sums_in_tiles(picked) and picked.measured_s == 0.5
    # Another rank does not search: it times what rank 0 sent, in its order, even with this
    # rank's cache hit where another rank missed.
    timed.clear()
    rank_1 = Ranks(lead=False, others_hit=False, rank_0_sends=sent[::-1])
    again, hit = cached_plan(g, h200, measure=own_wins, top_k=2, ranks=rank_1)
    assert not hit and rank_1.sent == [None] and timed == sent[::-1] and again.choices == picked.choices
    again, hit = cached_plan(g, h200, measure=lambda p: pytest.fail("every rank hit"), top_k=2,
                             ranks=Ranks(lead=False))
    assert hit and again.choices == picked.choices
    # Rank 0's search failed: every rank raises, none times.
    with pytest.raises(RuntimeError, match="planning failed on rank 0: ValueError: no tile fits"):
        cached_plan(g, h200, measure=own_wins, top_k=3, ranks=Ranks(lead=False, rank_0_sends="ValueError: no tile fits"))


def test_a_failed_search_on_rank_0_is_sent_to_the_other_ranks_before_it_raises(monkeypatch):
    import mk.planner.cache as cache

    def fails(*a, **k):
        raise ValueError("op l0.qkv: no tile fits")

    monkeypatch.setattr(cache, "search", fails)

    class Rank0:
        lead, sent = True, []

        def all(self, flag):
            return flag

        def share(self, obj):
            self.sent.append(obj)
            return obj

    rank_0 = Rank0()
    g = decode_graph(ModelShape.preset("llama-3.2-1b").shard(2), 1, 64)
    with pytest.raises(ValueError, match="no tile fits"):
        cached_plan(g, DeviceSpec.preset("h200"), measure=lambda p: pytest.fail("nothing to time"), ranks=rank_0)
    assert rank_0.sent == ["ValueError: op l0.qkv: no tile fits"]
