"""The cost model on Llama decode graphs: floors, monotonicity, fusion, split-K, errors."""

from dataclasses import replace

import pytest

from mk.planner.cost import (OpChoice, estimate_op, estimate_step, idle_wait_ops, naive_plan, op_tasks,
                             phase_costs, wave_groups)
from mk.planner.device import DeviceSpec
from mk.models.blocks import ModelShape, decode_graph

H200 = DeviceSpec.preset("h200")


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3-8b"])
def test_naive_step_is_above_the_bandwidth_floor_and_within_reason(name):
    m = ModelShape.preset(name)
    g = decode_graph(m, batch=1, kv_len=512)
    step = estimate_step(g, naive_plan(g), H200, workers=2 * H200.sm_count)
    floor = m.weight_bytes / H200.dram_bandwidth
    assert floor < step.seconds < 5 * floor  # unfused 16-row register tiles: slow, not absurd
    assert len(step.ops) == len(g.nodes) and step.tasks > len(g.nodes)


def test_fusing_the_norm_saves_its_hop_and_traffic():
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=1, kv_len=64)
    plan = naive_plan(g)
    base = estimate_step(g, plan, H200, workers=132)
    fused = dict(plan)
    for L in range(16):
        fused.pop(f"l{L}.attn_norm")
        fused[f"l{L}.qkv"] = OpChoice(block_n=16, block_k=256, fuse=(f"l{L}.attn_norm",))
    step = estimate_step(g, fused, H200, workers=132)
    assert len(step.ops) == len(base.ops) - 16
    assert step.seconds < base.seconds - 16 * H200.wait_overhead_s * 0.99
    with pytest.raises(ValueError, match="no choice"):
        estimate_step(g, {k: v for k, v in plan.items() if k != "lm_head"}, H200, workers=132)
    twice = dict(fused)
    twice["l0.o_proj"] = OpChoice(block_n=16, block_k=256, fuse=("l0.attn_norm",))
    with pytest.raises(ValueError, match="fused into both"):
        estimate_step(g, twice, H200, workers=132)


def test_more_tasks_than_workers_balance_and_few_tasks_are_capped():
    g = decode_graph(ModelShape.preset("llama-3-8b"), batch=1, kv_len=64)
    down = g.node("l0.down")  # 4096 x 14336
    wide = estimate_op(down, OpChoice(block_n=512, block_k=256), H200, workers=132)   # 8 tasks
    narrow = estimate_op(down, OpChoice(block_n=16, block_k=256), H200, workers=132)  # 256 tasks
    assert wide.tasks == 8 and narrow.tasks == 256
    assert wide.memory_s > 3 * narrow.memory_s  # 8 workers cannot pull the whole bandwidth
    # Split-K: more tasks, workspace traffic, and the reduce tasks counted.
    split = estimate_op(down, OpChoice(block_n=16, block_k=256, split_k=4), H200, workers=132)
    assert split.tasks == 256 * 4 + 256 and split.bytes > narrow.bytes
    assert op_tasks(g.node("l0.attention"), OpChoice(kv_splits=4)) == 8 * 4  # the last split of a group merges it


def test_a_last_partial_wave_shares_dram_among_its_own_workers():
    """Workers that never cap their own stream (DRAM the only limit) move an op's bytes in
    bytes / bandwidth however its tasks fall into waves: a last wave of fewer tasks streams
    each faster. (Priced as a full wave, 448 tasks on 264 workers cost 18% more.)"""
    assert wave_groups(448, 264) == ((1, 264), (1, 184))
    assert wave_groups(528, 264) == ((2, 264),) and wave_groups(100, 264) == ((1, 100),) and wave_groups(0, 8) == ()
    uncapped = replace(H200, tma_worker_bandwidth=1e15, worker_bandwidth=1e15)
    up = decode_graph(ModelShape.preset("llama-3-8b").shard(2), batch=1, kv_len=64).node("l0.gate_up")
    for workers in (100, 224, 264, 448):  # 5, 2, 2 and 1 waves of 32-row register tiles
        e = estimate_op(up, OpChoice(block_n=32, block_k=256), uncapped, workers=workers)
        assert e.tasks == 448 and e.memory_s == pytest.approx(e.bytes / H200.dram_bandwidth, rel=1e-9), workers


def test_batch_8_costs_little_more_than_batch_1_with_wide_tiles():
    """Weights dominate and the KV grows 8x; but each 8-row tile re-reads its float32 x rows
    over its K range, as many bytes as 16 bf16 weight rows: narrow tiles cost far more,
    and the search's wide tiles (and their TMA rings) keep it near batch 1."""
    from mk.planner.search import search

    m = ModelShape.preset("llama-3-8b")
    g1, g8 = decode_graph(m, 1, 512), decode_graph(m, 8, 512)
    one, eight = estimate_step(g1, naive_plan(g1), H200, 132), estimate_step(g8, naive_plan(g8), H200, 132)
    assert eight.seconds > 1.4 * one.seconds
    best1, best8 = search(g1, H200, top_k=1)[0], search(g8, H200, top_k=1)[0]
    assert best1.predicted_s < best8.predicted_s < 1.2 * best1.predicted_s
    assert min(c.block_n for c in best8.choices.values() if c.block_n) >= 64


def test_smem_of_linear_tiles_follows_the_3d_model():
    """The megakernel's tl.dot tiles get two operand buffers whatever their own stages
    (Triton's default pipelining); x is float32 (every activation is) and meets 16-bit
    weights as two halves, each staged through one more buffer. TMA GEMV tiles hold
    tma_stages - 1 weight chunks in flight, each with the norm weight's chunk when fused
    and a barrier, and x's chunk, or instead of it the reduction's scratch where the task
    waits for x inside its stream (x then goes to registers). (Checked against the compiled kernel on the GPU:
    tests/planner/test_smem_gpu.py.)"""
    from mk.planner.cost import op_smem_bytes
    from mk.tasks.linear import GEMV_RING_SCRATCH, MEGAKERNEL_DOT_BUFFERS

    g = decode_graph(ModelShape.preset("llama-3-8b"), batch=8, kv_len=64)
    down, qkv = g.node("l0.down"), g.node("l0.qkv")
    small = op_smem_bytes(down, OpChoice(block_n=64, block_k=256, stages=2))
    assert small == op_smem_bytes(down, OpChoice(block_n=64, block_k=256, stages=4))
    halves = 2 * 16 * 256 * 2 + 1024
    assert small == MEGAKERNEL_DOT_BUFFERS * (16 * 4 + 64 * 2) * 256 + halves  # 16 rows: tl.dot's least
    normed = op_smem_bytes(qkv, OpChoice(block_n=64, block_k=256, fuse=("l0.attn_norm",)))
    assert normed == small
    g1 = decode_graph(ModelShape.preset("llama-3-8b"), batch=1, kv_len=64)
    ring = op_smem_bytes(g1.node("l0.qkv"), OpChoice(block_n=32, block_k=256, tma_stages=4, fuse=("l0.attn_norm",)))
    assert ring == 3 * (32 * 256 * 2 + 256 * 2 + 8) + GEMV_RING_SCRATCH
    # A stream of more than WAIT_IN_STREAM_MAX_CHUNKS pipelines x's chunks beside the weights'.
    assert (op_smem_bytes(g1.node("l0.o_proj"), OpChoice(block_n=32, block_k=256, tma_stages=4))
            == 3 * (32 * 512 + 8) + GEMV_RING_SCRATCH)
    assert op_smem_bytes(g1.node("l0.down"), OpChoice(block_n=32, block_k=256, tma_stages=4)) == 3 * (32 * 512 + 1024 + 8)
    # A grouped stream (ring 9: two groups of 4 chunks in flight) waits in its stream however
    # long, x to registers: eight chunks and their norm chunks.
    grouped = OpChoice(block_n=16, block_k=256, tma_stages=9, fuse=("l0.mlp_norm",))
    assert (op_smem_bytes(g1.node("l0.gate_up"), grouped)
            == 8 * (16 * 256 * 2 + 256 * 2 + 8) + GEMV_RING_SCRATCH == 70208)
    # Weight-major decode tiles (>= 128 weight rows, 8 x rows): all tma_stages weight chunks
    # stay in the ring, [hi; lo] staged once, x in registers, S - 1 norm chunks (compiled for
    # sm_90 with Triton 3.6, whole-K or split-K alike: 100632).
    wide = op_smem_bytes(g.node("l0.gate_up"), OpChoice(block_n=256, block_k=64, tma_stages=3,
                                                        fuse=("l0.mlp_norm",)))
    assert wide == 3 * (256 * 64 * 2 + 8) + 2 * 8 * 64 * 2 + 2 * 64 * 2 == 100632
    # x-major TMA tiles (fewer weight rows, 16 x rows): S - 1 weight and x chunks, and S - 1
    # norm chunks when normed (compiled: 49168, and 49424 with the norm).
    g1b = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=8, kv_len=64)
    xmajor = OpChoice(block_n=64, block_k=128, tma_stages=3, split_k=8)
    assert op_smem_bytes(g1b.node("l0.down"), xmajor) == 2 * (64 * 128 * 2 + 16 * 128 * 4 + 8) == 49168
    assert op_smem_bytes(g1b.node("l0.gate_up"), replace(xmajor, split_k=2, fuse=("l0.mlp_norm",))) == 49168 + 512


def test_k_split_cuts_the_whole_range_ring_of_a_down_projection():
    """At equal tile width (16 weight rows, 256-column chunks), a ring that holds the task's
    whole K range shrinks with the split: >= 40% less peak shared memory from split-K 2."""
    from mk.planner.cost import op_smem_bytes
    from mk.tasks.linear.planning import whole_range_stages

    down = decode_graph(ModelShape.preset("llama-3-8b"), batch=1, kv_len=64).node("l0.down")
    K = down.dims["K"]
    smem = {s: op_smem_bytes(down, OpChoice(block_n=16, block_k=256, split_k=s,
                                            tma_stages=whole_range_stages(K, 256, s))) for s in (1, 2, 4, 8)}
    assert smem[2] <= 0.6 * smem[1] and smem[4] <= 0.6 * smem[2]
    assert whole_range_stages(14336, 256, 1) == 56 and whole_range_stages(14336, 256, 4) == 14
    # With a 99 KiB budget only a split ring fits: 55 chunks in flight x 16 rows x 512 B = 440 KiB unsplit.
    assert smem[1] > 440 * 1024 and smem[4] > 99 * 1024 > smem[8]


def test_decode_dot_tiles_stream_at_their_measured_worker_rates():
    """Batch-8 tl.dot tiles: x-major boxes (< 128 weight rows) at xmajor_dot_bandwidth a
    worker, weight-major ones at dot_worker_bandwidth however few workers are busy (an even
    share of DRAM would let 128 busy workers of 264 stream twice as fast each; measured on
    an H200 they do not). Batch 1's GEMV tiles are neither. An x-major tile waits for its
    inputs before its ring starts, so it also pays a chunk's load latency after the wait;
    a weight-major one waits inside its stream."""
    from dataclasses import replace

    from mk.planner.cost import phase_costs

    spec = DeviceSpec.preset("h200")
    assert spec.dot_worker_bandwidth > spec.xmajor_dot_bandwidth > 0
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=8, kv_len=64)
    gate_up = g.node("l0.gate_up")  # 16384 x 2048 bf16
    x_major = phase_costs(gate_up, OpChoice(block_n=64, block_k=128, tma_stages=3), spec, 264)[0]
    assert x_major.tasks == 256
    assert x_major.task_s == pytest.approx(spec.task_overhead_s + 64 * 2048 * 2 / spec.xmajor_dot_bandwidth
                                           + spec.load_latency_s, rel=0.02)
    wide = phase_costs(gate_up, OpChoice(block_n=128, block_k=64, tma_stages=3), spec, 264)[0]
    assert wide.tasks == 128
    assert wide.task_s == pytest.approx(spec.task_overhead_s + 128 * 2048 * 2 / spec.dot_worker_bandwidth, rel=0.02)
    free = replace(spec, dot_worker_bandwidth=0.0, xmajor_dot_bandwidth=0.0)
    assert phase_costs(gate_up, OpChoice(block_n=128, block_k=64, tma_stages=3), free, 264)[0].task_s < 0.8 * wide.task_s
    gemv = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=1, kv_len=64).node("l0.gate_up")
    choice = OpChoice(block_n=32, block_k=256, tma_stages=4)
    assert phase_costs(gemv, choice, spec, 264) == phase_costs(gemv, choice, free, 264)


def test_a_task_that_waits_before_its_stream_pays_the_first_chunk_latency():
    """A GEMV task that waits for its inputs inside its stream has its ring's first chunks in
    flight during the wait; one that waits before it pays a chunk's load latency once more.
    The 8B down projection's 56-chunk tasks wait before a 4-deep ring, inside a grouped one."""
    from mk.tasks.linear import LINEAR

    exposed_chunk_seconds = LINEAR.exposed_seconds
    g = decode_graph(ModelShape.preset("llama-3-8b"), batch=1, kv_len=64)
    down, dev = g.node("l0.down"), DeviceSpec.preset("h200")
    task_bytes = 16 * 14336 * 2
    chunks = task_bytes / (16 * 256 * 2)
    ring4 = exposed_chunk_seconds(down, OpChoice(block_n=16, block_k=256, tma_stages=4), dev, task_bytes)
    ring9 = exposed_chunk_seconds(down, OpChoice(block_n=16, block_k=256, tma_stages=9), dev, task_bytes)
    assert ring9 == pytest.approx(chunks * dev.chunk_exposed_s)
    assert ring4 == pytest.approx(ring9 + dev.load_latency_s)


def test_a_ring_prologue_counts_as_early_work_only_after_attention():
    from mk.tasks.linear import LINEAR

    exposed_chunk_seconds = LINEAR.exposed_seconds
    # The O projection reads attention's output: while attention runs, DRAM idles and the
    # tasks' TMA rings fill. After a weight-streaming op (QKV after the down projection) the
    # wait overlaps that op's tail: no early part is priced there.
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=1, kv_len=512)
    assert idle_wait_ops(g) == {f"l{L}.o_proj" for L in range(16)}
    spec = DeviceSpec.preset("h100")
    o_proj = g.node("l1.o_proj")  # 8 x 2048 rows a task: 8 chunks of 8 x 256
    whole = phase_costs(o_proj, OpChoice(block_n=8, block_k=256, tma_stages=9), spec, 264, idle_wait=True)[0]
    four = phase_costs(o_proj, OpChoice(block_n=8, block_k=256, tma_stages=4), spec, 264, idle_wait=True)[0]
    exposed = 8 * spec.chunk_exposed_s
    # All 8 chunks in flight before the wait (grouped ring of 1 + 2 x 4): only the x chunks,
    # the epilogue and the task's overhead are left after it.
    assert whole.task_s - whole.early_s == pytest.approx(spec.task_overhead_s + exposed, rel=1e-3)
    # 3 in flight: the 4th is asked for after the wait, a load latency at least is left.
    stream = four.task_s - spec.task_overhead_s - exposed
    assert four.early_s == pytest.approx(min(stream * 3 / 8, stream - spec.load_latency_s), rel=1e-3)
    assert 0 < four.early_s < whole.early_s
    assert phase_costs(o_proj, OpChoice(block_n=8, block_k=256, tma_stages=9), spec, 264)[0].early_s == 0
    # Batch 8: x-major tl.dot tiles wait before their stream, nothing early; weight-major ones
    # wait inside it with tma_stages - 1 chunks in flight (2 of a split's 4 chunks here).
    g8 = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=8, kv_len=512)
    x_major = OpChoice(block_n=64, block_k=128, tma_stages=3, split_k=8)
    assert phase_costs(g8.node("l1.o_proj"), x_major, spec, 264, idle_wait=True)[0].early_s == 0
    w_major = OpChoice(block_n=128, block_k=64, tma_stages=3, split_k=8)
    part = phase_costs(g8.node("l1.o_proj"), w_major, spec, 264, idle_wait=True)[0]
    stream = part.task_s - spec.task_overhead_s
    assert part.early_s == pytest.approx(min(stream * 2 / 4, stream - spec.load_latency_s), rel=1e-3)
    assert phase_costs(g8.node("l1.o_proj"), w_major, spec, 264)[0].early_s == 0
    # A ring of one has an empty prologue: nothing early, and its one chunk's latency after
    # the wait (H200 1B batch 8: o_proj 128 x 128 split 16 in a ring of 1 measured 1.104 ms,
    # 128 x 64 split 16 in a ring of 3 1.041).
    one = OpChoice(block_n=128, block_k=128, tma_stages=1, split_k=16)
    three = OpChoice(block_n=128, block_k=64, tma_stages=3, split_k=16)
    assert phase_costs(g8.node("l1.o_proj"), one, spec, 264, idle_wait=True)[0].early_s == 0
    assert exposed_chunk_seconds(g8.node("l1.o_proj"), one, spec, 128 * 128 * 2) == spec.load_latency_s
    assert exposed_chunk_seconds(g8.node("l1.o_proj"), three, spec, 128 * 128 * 2) == 0


def test_the_h100_plan_for_the_1b_takes_the_rings_that_measured_fastest():
    # Measured on one H100: QKV ring 4, O projection ring 9, down ring 9
    # 1.043 / 1.046 ms; the same with QKV ring 8 1.059, O projection ring 8 1.053, all
    # ring 4 (the plan before) 1.074 / 1.079.
    from mk.planner.search import search

    g = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=1, kv_len=1024)
    plan = search(g, DeviceSpec.preset("h100"), top_k=1)[0]
    rings = {n.split(".")[-1]: c.tma_stages for n, c in plan.choices.items() if n.startswith("l3.")}
    assert (rings["qkv"], rings["o_proj"], rings["down"]) == (4, 9, 9)


def test_attention_splits_past_the_planned_length_carry_no_bytes():
    """Decode attention's KV splits hold ceil(kv_len / splits) keys rounded up to whole KV
    blocks (as the kernel cuts them): at a short planned length the last splits hold none.
    Their tasks still take a worker's turn; the bytes and the merge are the live splits'.
    So a 64-key step plans one split, a 1024-key one several (1B shape, H100 preset)."""
    from mk.planner.cost import op_bytes_flops
    from mk.tasks.decode_attention import attention_live_splits
    from mk.planner.search import search

    spec = DeviceSpec.preset("h100")
    shape = ModelShape.preset("llama-3.2-1b")
    for kv_len, splits, live in ((64, 1, 1), (64, 2, 1), (64, 16, 1), (65, 2, 2), (130, 4, 3), (1024, 16, 16),
                                 (1000, 4, 4)):
        node = decode_graph(shape, 8, kv_len).node("l0.attention")
        assert attention_live_splits(node.dims, splits) == live, (kv_len, splits)
        one, many = (op_bytes_flops(node, OpChoice(kv_splits=s))[0] for s in (1, splits))
        assert (many == one) == (live == 1), (kv_len, splits)  # merges only where two splits live
    for batch in (1, 8):
        short, full = (search(decode_graph(shape, batch, n), spec, top_k=1)[0] for n in (64, 1024))
        assert short.choices["l0.attention"].kv_splits == 1 < full.choices["l0.attention"].kv_splits


def test_hops_among_many_cost_what_the_link_s_crowd_says_and_the_projection_s_tiles_sum():
    from mk.planner.search import own_all_reduces, search

    dev = DeviceSpec.preset("h200")
    crowded = replace(dev, link_crowd_s=5e-9)
    assert dev.hop_seconds(4, 257) == dev.hop_seconds(4, 1) == dev.link_latency_s
    assert crowded.hop_seconds(4, 257) == pytest.approx(dev.link_latency_s + 256 * 3 * 5e-9)
    assert crowded.hop_seconds(2, 257) < crowded.hop_seconds(4, 257)
    graph = decode_graph(ModelShape.preset("llama-3-8b").shard(4), 1, 1024)

    def fused_and_own(device):
        plan = search(graph, device, beam_width=2)[0]
        assert any(f.endswith("_residual") for c in plan.choices.values() for f in c.fuse)
        return plan.predicted_s, own_all_reduces(plan, graph, device).predicted_s

    # Pushed words are polled in local memory: 256 tiles summing at once cost no more than
    # one, and a projection's tiles sum their own boxes, with no phase of their own. A
    # crowded link (as pulling made it, each tile polling its peers' flags across it)
    # narrows the gap to tiles of their own (64 at once at batch 1 over four GPUs).
    fused, own = fused_and_own(dev)
    fused_crowded, own_crowded = fused_and_own(crowded)
    assert fused < own and fused_crowded > fused
    assert own_crowded - fused_crowded < own - fused
