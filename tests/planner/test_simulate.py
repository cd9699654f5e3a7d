"""The simulated schedule: checked against a plain run over the lowered step's dependencies.

The simulation runs the lowered tasks (the dependencies their regions give) with the cost
model's time of each phase, dealing them to queues as it goes; the reference below takes
the dealt queues and runs them task by task, expanding every dependency interval. The two
must agree on the step's end and every phase's end, for random model shapes, batches,
tilings (split-K, KV splits, an unfused norm or RoPE) and worker counts; the cost model and
the lowering must agree on every phase's tasks. The search must then pick the schedule
whose simulated step is shortest.
"""

import random
from dataclasses import replace

import pytest
import torch

from mk.persistent.deps import drop_implied
from mk.persistent.graph import SCHEDULES, assign_workers, lower
from mk.planner.cost import OpChoice
from mk.planner.device import DeviceSpec
from mk.models.blocks import ModelShape, decode_graph
from mk.planner.lower import lower_decode_step, meta_buffers
from mk.planner.simulate import step_queues
from mk.planner.search import Plan, search
from mk.planner.cost import PhaseCost
from mk.planner.simulate import phase_task_costs, simulate, simulate_step, step_costs


def run_exact(step_graph, queues, cost, wait_s, early=None):
    """Each worker runs its queue in order; a task starts when its worker is free and, one
    wait after, every task it depends on (from the lowered regions) has finished; its
    ``early`` part runs from when its worker is free, inputs or not."""
    deps = drop_implied(step_graph.dependency_intervals())
    worker = {i: w for w, q in enumerate(queues) for i in q}
    free = [0.0] * len(queues)
    early = early or [0.0] * len(cost)
    finish = []
    for i in range(len(step_graph.tasks)):  # program order: dependencies and queue order both respected
        ready = max((finish[t] + wait_s for a, b in deps[i] for t in range(a, b)), default=0.0)
        at = free[worker[i]]
        pre = min(early[i], max(0.0, ready - at))  # done while waiting for the inputs
        finish.append(max(at, ready) + cost[i] - pre)
        free[worker[i]] = finish[-1]
    return finish


def random_case(rng):
    heads, kv_heads = rng.choice([(2, 2), (4, 1), (4, 2), (8, 2)])  # o_proj's K = heads x 32 >= 64
    shape = ModelShape("rand", hidden=rng.choice([64, 128]), intermediate=rng.choice([96, 192]), layers=2,
                       heads=heads, kv_heads=kv_heads, head_dim=32,
                       vocab=rng.choice([61, 203]), dtype_bytes=4)
    batch, max_seq = rng.choice([1, 3]), 16
    graph = decode_graph(shape, batch, max_seq)
    spec = DeviceSpec.preset(rng.choice(["h100", "h200"]))
    plan = search(graph, spec, top_k=1)[0]
    choices = dict(plan.choices)
    for name, c in list(choices.items()):
        kind = graph.node(name).kind
        if kind == "linear" and rng.random() < 0.5:
            # A split-K QKV carries RoPE in its reduce tiles, or (half the time) RoPE runs as
            # its own task; the reduce tiles as wide as the partials' or half as wide.
            ropes = [f for f in c.fuse if graph.node(f).kind == "rope_kv" and rng.random() < 0.5]
            choices[name] = replace(c, block_n=32, block_k=16, split_k=rng.choice([2, 3]), tma_stages=0,
                                    fuse=tuple(f for f in c.fuse if f not in ropes),
                                    reduce_block_n=rng.choice([0, 16]))
            choices.update({f: OpChoice() for f in ropes})
        elif kind == "attention":
            choices[name] = OpChoice(kv_splits=rng.choice([1, 2, 3]))
        if kind == "linear" and rng.random() < 0.5:  # tasks that are runs of 2 or 3 tiles
            choices[name] = replace(choices[name], tiles_per_task=rng.choice([2, 3]))
    if rng.random() < 0.5:  # l1's attention norm as its own tasks
        choices["l1.qkv"] = replace(choices["l1.qkv"],
                                    fuse=tuple(f for f in choices["l1.qkv"].fuse if f == "l1.rope_kv"))
        choices["l1.attn_norm"] = OpChoice()
    head = choices["lm_head"]
    assert "argmax" in head.fuse, "the search puts the argmax partials in the LM head"
    if head.split_k > 1 or rng.random() < 0.5:  # (a split-K LM head must) leave them to their own tasks
        choices["lm_head"] = replace(head, fuse=tuple(f for f in head.fuse if f != "argmax"))
        choices["argmax"] = OpChoice()
    return graph, spec, replace(plan, choices=choices), max_seq


@pytest.mark.parametrize("case", range(6))
def test_simulation_matches_a_run_over_the_exact_dependencies(case):
    rng = random.Random(torch.initial_seed() + case)
    graph, spec, plan, max_seq = random_case(rng)
    next_token = rng.choice(["argmax", "sample", "logits"])
    step = lower_decode_step(plan, graph, meta_buffers(graph, max_seq), eps=1e-5, next_token=next_token)
    workers = rng.choice([1, 3, 7, 40])
    phases = step_costs(graph, plan.choices, spec, workers, next_token)
    tasks = phase_task_costs(phases, step.phases)
    cost = [p.task_s for p in tasks]
    early = [p.early_s for p in tasks]
    assert len(cost) == len(step.graph.tasks)
    deps = step.graph.events()[0]
    for schedule in SCHEDULES:
        sim = simulate(phases, deps, workers, schedule)
        finish = run_exact(step.graph, sim.queues(), cost, spec.wait_overhead_s, early)
        assert sim.seconds == pytest.approx(max(finish), rel=1e-12), (schedule, workers)
        ends, i = [], 0
        for _, p in phases:
            ends.append(max(finish[i:i + p.tasks]))
            i += p.tasks
        assert sim.phase_end == pytest.approx(ends, rel=1e-12), (schedule, workers)
        if schedule != "list":  # the same queues as the runtime's own dealing
            deps = drop_implied(step.graph.dependency_intervals())
            assert sim.queues() == assign_workers(len(cost), deps, workers, schedule)
        # The lowered step's queues are the simulated ones.
        step.plan = replace(plan, schedule=schedule)
        assert step_queues(step, graph, spec, workers) == sim.queues()
        lower(step.graph, workers, queues=sim.queues())


def test_the_search_picks_the_shortest_simulated_schedule():
    spec = DeviceSpec.preset("h200")
    for name, batch in [("llama-3.2-1b", 1), ("llama-3-8b", 8)]:
        graph = decode_graph(ModelShape.preset(name), batch, 1024)
        for plan in search(graph, spec, top_k=2):
            assert set(plan.schedule_s) == set(SCHEDULES)
            assert plan.predicted_s == plan.schedule_s[plan.schedule] == min(plan.schedule_s.values())
            # The search simulates its finalists as lowered, the whole step.
            for schedule in SCHEDULES:
                full = simulate_step(graph, plan.choices, spec, plan.workers, schedule).seconds
                assert plan.schedule_s[schedule] == pytest.approx(full, rel=1e-12)
            assert "queues: " + plan.schedule in plan.explain()
            again = Plan.from_json(plan.to_json())
            assert (again.schedule, again.schedule_s) == (plan.schedule, plan.schedule_s)


def test_zigzag_doubles_up_workers_where_a_phase_turns_a_lap():
    # Two phases of 6 tasks on 8 workers: round-robin deals the second to workers 6, 7, 0..3,
    # all idle; zig-zag's second lap turns back over 7 and 6, which already have one task.
    phases = [("a", PhaseCost(6, 1.0, 0.0)), ("b", PhaseCost(6, 1.0, 0.0))]
    deps = [[]] * 6 + [[(0, 6)]] * 6  # b reads all of a
    rr, zz = simulate(phases, deps, 8, "round_robin"), simulate(phases, deps, 8, "zigzag")
    assert rr.worker_of[6:] == [6, 7, 0, 1, 2, 3] and rr.seconds == 2.0
    assert zz.worker_of[6:] == [6, 7, 7, 6, 5, 4] and zz.seconds == 3.0
    assert simulate(phases, deps, 8, "list").seconds == 2.0
    # A task of b that reads only its own producer starts as soon as that one ends.
    own = [[]] * 6 + [[(j, j + 1)] for j in range(6)]
    assert simulate([("a", PhaseCost(6, 1.0, 0.0)), ("b", PhaseCost(6, 1.0, 0.5))], own, 4,
                    "round_robin").phase_end == [2.0, 3.5]


def test_bad_queues_and_schedules_are_refused():
    phases = [("a", PhaseCost(2, 1.0, 0.0))]
    with pytest.raises(ValueError, match="schedule must be one of"):
        simulate(phases, [[], []], 8, "random")
    with pytest.raises(ValueError, match="1 tasks' dependencies for phases of 2 tasks"):
        simulate(phases, [[]], 8, "list")
    # The cost model and the lowering must agree on every phase's tasks.
    with pytest.raises(RuntimeError, match="phase 1 is b with 3 tasks, the lowered step's lm_head with 4"):
        phase_task_costs(phases + [("b", PhaseCost(3, 1.0, 0.0))], [("qkv", 2), ("lm_head", 4)])
    from mk.persistent.graph import check_queues

    with pytest.raises(ValueError, match="not in program order"):
        check_queues([[1, 0], [2]], 3, 2)
    with pytest.raises(ValueError, match="queued twice"):
        check_queues([[0, 1], [1, 2]], 3, 2)
    with pytest.raises(ValueError, match="task 2 is in no queue"):
        check_queues([[0], [1]], 3, 2)
    with pytest.raises(ValueError, match="3 queues for 2 workers"):
        check_queues([[0], [1], [2]], 3, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        bad = search(decode_graph(ModelShape.preset("llama-3.2-1b"), 1, 64), DeviceSpec.preset("h200"))[0]
        Plan.from_json(replace(bad, schedule="spiral").to_json())


def test_a_task_does_its_early_part_while_it_waits():
    # Phase a: one 5 s task on worker 0. Phase b: two tasks of 2 s, 1.5 s of which (the TMA
    # ring's prologue) need no inputs, one wait of 1 s after a. Worker 1, idle since 0, is
    # done 0.5 s after its inputs arrive (at 6); worker 0 reaches its b task only at 5, so
    # only the wait's second overlaps: done at 7. Without the early part both end at 8.
    phases = [("a", PhaseCost(1, 5.0, 0.0)), ("b", PhaseCost(2, 2.0, 1.0, early_s=1.5))]
    deps = [[], [(0, 1)], [(0, 1)]]
    sim = simulate(phases, deps, 2, "round_robin")
    assert sim.worker_of == [0, 1, 0] or sim.worker_of == [0, 1, 1]
    assert sim.seconds == pytest.approx(7.0) and sim.phase_end == pytest.approx([5.0, 7.0])
    plain = [phases[0], ("b", PhaseCost(2, 2.0, 1.0))]
    assert simulate(plain, deps, 2, "round_robin").seconds == pytest.approx(8.0)
    # The phase alone: one wait, of which the early part takes what it can, then a task.
    assert phases[1][1].seconds(2) == pytest.approx(1.0 + 2.0 - 1.0)
