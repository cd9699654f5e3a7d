"""The beam search: budgets respected, better than the naive plan, deterministic, explained."""

import json

import pytest

from mk.planner.cost import estimate_step, naive_plan
from mk.planner.device import DeviceSpec
from mk.models.blocks import ModelShape, decode_graph
from mk.planner.search import search
from mk.planner.simulate import simulate_step


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3-8b"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("device", ["h200", "l40s"])
def test_plans_fit_the_budget_and_beat_the_naive_plan(name, batch, device):
    spec = DeviceSpec.preset(device)
    g = decode_graph(ModelShape.preset(name), batch, 512)
    plans = search(g, spec, beam_width=4, top_k=3)
    assert plans and [p.predicted_s for p in plans] == sorted(p.predicted_s for p in plans)
    best = plans[0]
    # (The naive plan leaves the residual adds unfused: it prices, but no step runs it.)
    naive = estimate_step(g, naive_plan(g), spec, best.workers).seconds
    assert best.predicted_s < naive  # strictly better under the same cost model
    assert best.peak_smem_bytes <= spec.smem_per_block
    # The plan's own estimate is the simulated step of its choices under its schedule, and
    # no more than the sum of its ops' estimates (each phase spread evenly).
    assert simulate_step(g, best.choices, spec, best.workers, best.schedule).seconds == pytest.approx(best.predicted_s)
    assert best.predicted_s <= estimate_step(g, best.choices, spec, best.workers).seconds * (1 + 1e-12)
    # Every op is either chosen or fused into exactly one chosen op.
    fused = [f for c in best.choices.values() for f in c.fuse]
    assert sorted(list(best.choices) + fused) == sorted(n.name for n in g.nodes)


def test_a_99_kib_budget_still_plans_and_a_tiny_one_names_the_op():
    g = decode_graph(ModelShape.preset("llama-3-8b"), 8, 512)
    tight = DeviceSpec.preset("h200").with_smem_budget("99KiB")
    plan = search(g, tight)[0]
    assert plan.peak_smem_bytes <= 99 * 1024
    with pytest.raises(ValueError, match=r"op l0\.qkv .*no tile fits the shared-memory budget of 4096"):
        search(g, DeviceSpec.preset("h200").with_smem_budget(4096))


def test_search_is_deterministic_and_explains_itself():
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), 1, 128)
    spec = DeviceSpec.preset("h200")
    a, b = search(g, spec), search(g, spec)
    assert [p.choices for p in a] == [p.choices for p in b]
    text = a[0].explain()
    assert "l15.down" in text and "fused l0.attn_norm" in text and " us" in text
    data = json.loads(a[0].to_json())
    assert data["choices"]["l0.qkv"]["fuse"] == ["l0.attn_norm", "l0.rope_kv"]
    with pytest.raises(ValueError, match="beam_width"):
        search(g, spec, beam_width=0)


def test_h100_batch_8_streams_the_1b_gate_up_in_weight_major_tiles():
    """On the H100 preset (its x-major rate measured there, session 23) the 1B batch-8
    gate_up takes 128-row weight-major tiles with its RMSNorm fused, the plan that measured
    2-3% faster a step than 64-row x-major tiles; batch 1 keeps its GEMV runs."""
    spec = DeviceSpec.preset("h100")
    g8 = decode_graph(ModelShape.preset("llama-3.2-1b"), 8, 1024)
    plan = search(g8, spec)[0]
    gate_up = plan.choices["l1.gate_up"]
    assert (gate_up.block_n, gate_up.block_k) == (128, 64) and "l1.mlp_norm" in gate_up.fuse
    assert plan.workers == 2 * spec.sm_count
    g1 = decode_graph(ModelShape.preset("llama-3.2-1b"), 1, 1024)
    assert search(g1, spec)[0].choices["l1.gate_up"].block_n == 32


def test_batch_8_plans_pay_for_x_major_tiles_on_the_whole_step():
    """An x-major decode tile makes the megakernel spill, which slows every task
    (DeviceSpec.xmajor_kernel_slowdown): a plan holding one is priced that much slower on its
    whole step, and the search also looks for plans without one. The 1B batch-8 plan on an
    H200 takes weight-major tiles for every linear, the down projection split 16 ways."""
    from dataclasses import replace

    from mk.tasks.linear.planning import xmajor_decode_tile

    g = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=8, kv_len=1024)
    spec = DeviceSpec.preset("h200")
    assert spec.xmajor_kernel_slowdown > 0
    holds_xmajor = lambda p: any(xmajor_decode_tile(g.node(n), c) for n, c in p.choices.items())  # noqa: E731
    plans = search(g, spec, top_k=12)
    assert not holds_xmajor(plans[0])
    # The down projection's 16 weight-major tiles a K split fill the workers at split 16
    # (measured on an H100: 1.307 -> 1.276 ms against split 8).
    assert plans[0].choices["l3.down"].split_k == 16
    free = {tuple(sorted(p.choices.items())): p.predicted_s
            for p in search(g, replace(spec, xmajor_kernel_slowdown=0.0), top_k=12)}
    mixed = [p for p in plans if holds_xmajor(p) and tuple(sorted(p.choices.items())) in free]
    unmixed = [p for p in plans if not holds_xmajor(p) and tuple(sorted(p.choices.items())) in free]
    assert mixed and unmixed
    for p in mixed:
        assert p.predicted_s == pytest.approx(free[tuple(sorted(p.choices.items()))] * (1 + spec.xmajor_kernel_slowdown))
    for p in unmixed:
        assert p.predicted_s == pytest.approx(free[tuple(sorted(p.choices.items()))])


def test_default_plans_put_two_workers_on_each_sm_within_half_its_shared_memory():
    spec = DeviceSpec.preset("h200")
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), 1, 512)
    plan = search(g, spec, beam_width=2, top_k=1)[0]
    assert plan.workers == 2 * spec.sm_count
    assert spec.max_resident_blocks(128, plan.peak_smem_bytes) >= 2
    fixed = search(g, spec, workers=spec.sm_count, beam_width=2, top_k=1)[0]
    assert fixed.workers == spec.sm_count


def test_two_workers_an_sm_leave_l1_its_reserve():
    # At batch 8 the 1B LM head's fastest tiles alone (256 x 64 boxes, 104 KiB) would leave
    # each SM 47 KiB of L1, and on an H200 the rest of the step ran slower for it: the
    # Hopper presets keep 64 KiB of the SM for L1, so the search takes 128-row boxes.
    import dataclasses

    from mk.planner.cost import op_smem_bytes

    spec = DeviceSpec.preset("h200")
    assert spec.l1_reserve_per_sm == 64 * 1024
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), 8, 1024)
    plan = search(g, spec, beam_width=2, top_k=1)[0]
    assert plan.workers == 2 * spec.sm_count
    assert 2 * (plan.peak_smem_bytes + spec.reserved_smem_per_block) <= spec.smem_per_sm - spec.l1_reserve_per_sm
    no_reserve = search(g, dataclasses.replace(spec, l1_reserve_per_sm=0), beam_width=2, top_k=1)[0]
    head = no_reserve.choices["lm_head"]
    assert op_smem_bytes(g.node("lm_head"), head) > (spec.smem_per_sm - spec.l1_reserve_per_sm) // 2
    assert plan.choices["lm_head"].block_n < head.block_n
    with pytest.raises(ValueError, match="l1_reserve_per_sm"):
        dataclasses.replace(spec, l1_reserve_per_sm=spec.smem_per_sm)


@pytest.mark.parametrize("batch", [1, 8])
def test_rope_fuses_into_qkv_with_or_without_split_k(batch):
    # RoPE + KV append rides in the QKV tiles' epilogue, or with split-K (batch 8's QKV) in
    # its reduce tiles: either way one task and one wait less a layer, so the search fuses it.
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), batch, 1024)
    plan = search(g, DeviceSpec.preset("h200"))[0]
    qkv = plan.choices["l0.qkv"]
    assert "l0.rope_kv" in qkv.fuse and "l0.rope_kv" not in plan.choices, qkv
    assert (qkv.split_k > 1) == (batch == 8), qkv  # both paths are what the search picks




def test_gemvs_with_more_tiles_than_workers_run_as_one_even_run_a_worker():
    """At batch 1 on an H200, ops with more tiles than workers (the LM head, the 1B gate_up)
    are dealt as runs of adjacent TMA tiles that keep >= 95% of the workers busy, one run a
    worker; ops with fewer tiles stay one tile a task, and tl.dot tiles (batch 8) never run."""
    from mk.planner.cost import op_tasks
    from mk.tasks.linear.planning import RUN_MIN_BUSY

    spec = DeviceSpec.preset("h200")
    for name in ("llama-3.2-1b", "llama-3-8b"):
        for batch in (1, 8):
            graph = decode_graph(ModelShape.preset(name), batch, 1024)
            plan = search(graph, spec, top_k=1)[0]
            for op, c in plan.choices.items():
                node = graph.node(op)
                if node.kind != "linear":
                    continue
                tiles = -(-node.dims["N"] // c.block_n) * c.split_k
                if batch > 1 or tiles <= plan.workers:
                    assert c.tiles_per_task == 1, (name, batch, op, c)
                    continue
                tasks = op_tasks(node, c) - (tiles // c.split_k if c.split_k > 1 else 0)
                assert c.tma_stages and RUN_MIN_BUSY * plan.workers <= tasks <= plan.workers, (name, op, c, tasks)
            if batch == 1:
                assert plan.choices["lm_head"].tiles_per_task > 1
                assert f"run={plan.choices['lm_head'].tiles_per_task}" in plan.explain()


def test_split_k_reduces_are_cut_as_narrow_as_one_wave_of_workers_takes():
    """A split-K linear's reduce tiles (OpChoice.reduce_block_n) are the narrowest that keep
    its reduce tasks within one wave of workers (not under REDUCE_MIN_COLS columns): the 1B
    batch-8 step measured 3.9% faster so on an H200 (session 27). The model prices the
    narrower reduce cheaper, and a width that does not divide the partial tile is refused."""
    from dataclasses import replace

    from mk.planner.cost import estimate_op, op_phases
    from mk.tasks.linear.planning import REDUCE_MIN_COLS, reduce_width

    spec = DeviceSpec.preset("h100")
    split = set()
    for name in ("llama-3.2-1b", "llama-3-8b"):
        graph = decode_graph(ModelShape.preset(name), 8, 1024)
        plan = search(graph, spec, top_k=1)[0]
        for op, c in plan.choices.items():
            node = graph.node(op)
            if node.kind != "linear" or c.split_k == 1:
                continue
            split.add((name, op.split(".")[-1]))
            width = reduce_width(node, c)
            reduces = op_phases(node, c)[1][0]
            narrower = width // 2
            assert width < c.block_n and reduces <= plan.workers, (name, op, c)
            assert (narrower < REDUCE_MIN_COLS or c.block_n % narrower
                    or reduces * 2 > plan.workers), (name, op, c)
            assert f"reduce_bn={width}" in plan.explain()
            wide = replace(c, reduce_block_n=0)
            assert op_phases(node, wide)[1][0] * c.block_n // width == reduces
            fused = [graph.node(f) for f in c.fuse]
            assert (estimate_op(node, c, spec, plan.workers, fused).seconds
                    < estimate_op(node, wide, spec, plan.workers, fused).seconds), (name, op)
            with pytest.raises(ValueError, match="reduce_block_n must divide"):
                reduce_width(node, replace(c, reduce_block_n=c.block_n * 3 // 4))
    assert split == {("llama-3.2-1b", "qkv"), ("llama-3.2-1b", "o_proj"), ("llama-3.2-1b", "gate_up"),
                     ("llama-3.2-1b", "down"), ("llama-3-8b", "qkv"), ("llama-3-8b", "o_proj"), ("llama-3-8b", "down")}


def test_rope_folds_into_attention_where_the_qkv_tiles_split_heads():
    """Qwen3's q/k norm needs whole heads, which the 8B QKV's 32-row tiles do not hold: the
    RoPE then folds into the attention splits (each holds its group's whole heads) instead of
    running as a phase of its own. Llama's rotation needs only pairs, so it stays in the QKV
    tiles, where it costs the splits nothing; a QKV with a bias (Qwen2) keeps it there too."""
    spec = DeviceSpec.preset("h200")
    qwen3 = search(decode_graph(ModelShape.preset("qwen3-8b"), 1, 1024), spec)[0]
    assert qwen3.choices["l1.qkv"].block_n % 128 and "l1.rope_kv" not in qwen3.choices["l1.qkv"].fuse
    assert qwen3.choices["l1.attention"].fuse == ("l1.rope_kv",) and "l1.rope_kv" not in qwen3.choices
    for name in ("llama-3-8b", "qwen2.5-7b"):
        plan = search(decode_graph(ModelShape.preset(name), 1, 1024), spec)[0]
        assert "l1.rope_kv" in plan.choices["l1.qkv"].fuse and not plan.choices["l1.attention"].fuse, name
