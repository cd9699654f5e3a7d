"""The persistent runtime on the CPU: megakernel (interpreter, one worker) and the VM."""

import random

import pytest
import torch

from mk.persistent.graph import TaskGraph, lower
from mk.persistent.runtime import Megakernel, MegakernelTimeout
from mk.persistent.vm import Deadlock, run_vm
from mk.tasks import default_device, make_op, rmsnorm
from tests.conftest import assert_close

DEV = default_device()


def random_norm_dag(rng: random.Random, rows: int, n: int, nodes: int):
    """A random DAG of rmsnorm tasks (plain and residual-add) over fresh buffers.

    Each node reads one or two earlier buffers (chains and diamonds) and writes a new
    one; returns the graph and the op-by-op result of every buffer.
    """
    g = TaskGraph()
    g.buffer("w", torch.randn(n, device=DEV) * 0.2 + 1)
    g.buffer("b0", torch.randn(rows, n, device=DEV))
    expected = {"b0": g.buffers["b0"].clone()}
    names = ["b0"]
    plain, resid = make_op("rmsnorm", n=n, eps=1e-5), make_op("rmsnorm", n=n, eps=1e-5, residual=True)
    for i in range(1, nodes + 1):
        out = g.buffer(f"b{i}", torch.full((rows, n), float("nan"), device=DEV))
        if rng.random() < 0.5 or len(names) < 2:
            src = rng.choice(names)
            for r in range(rows):
                g.add(plain, x=src, w="w", out=out, row=r)
            expected[out] = rmsnorm(expected[src], g.buffers["w"], 1e-5)
        else:
            a, b = rng.sample(names, 2)
            h = g.buffer(f"h{i}", torch.full((rows, n), float("nan"), device=DEV))
            for r in range(rows):
                g.add(resid, x=a, res=b, w="w", out=out, res_out=h, row=r)
            expected[out], expected[h] = rmsnorm(expected[a], g.buffers["w"], 1e-5, residual=expected[b])
            names.append(h)
        names.append(out)
    return g, expected


@pytest.mark.parametrize("trial", range(3))
def test_megakernel_equals_op_by_op(trial):
    rng = random.Random(trial)
    g, expected = random_norm_dag(rng, rows=rng.randint(1, 3), n=rng.choice([37, 200, 64]), nodes=6)
    kernel = Megakernel(lower(g, num_workers=1))
    for _ in range(2):  # counters are never reset: the second launch must work too
        kernel.run()
        for name, ref in expected.items():
            assert_close(g.buffers[name], ref, torch.float32, name)
    assert int(kernel.state[0]) == 2


def test_megakernel_at_other_warp_counts_computes_the_same():
    g, expected = random_norm_dag(random.Random(7), rows=2, n=200, nodes=4)
    for warps in (1, 2, 8):
        for name in expected:
            if name != "b0":
                g.buffers[name].fill_(float("nan"))
        kernel = Megakernel(lower(g, num_workers=1), num_warps=warps)
        assert kernel.num_warps == warps
        kernel.run()
        for name, ref in expected.items():
            assert_close(g.buffers[name], ref, torch.float32, f"{name} at {warps} warps")
    with pytest.raises(Exception, match="num_warps"):
        Megakernel(lower(g, num_workers=1), num_warps=3)


@pytest.mark.parametrize("workers", [1, 2, 7, 64])
@pytest.mark.parametrize("schedule", ["round_robin", "zigzag", "list"])
def test_vm_runs_many_workers_without_deadlock_or_early_reads(workers, schedule):
    rng = random.Random(workers)
    g, expected = random_norm_dag(rng, rows=3, n=48, nodes=8)
    program = lower(g, num_workers=workers, schedule=schedule)
    for seed in range(3):
        report = run_vm(program, interleave="random", seed=seed)
        assert sorted(report.order) == list(range(len(g.tasks)))
        for name, ref in expected.items():
            assert_close(g.buffers[name], ref, torch.float32, name)


def test_dependencies_are_exact_at_tile_granularity():
    g = TaskGraph()
    op = make_op("rmsnorm", n=16)
    for name in ("x", "w", "y", "z"):
        g.buffer(name, torch.randn(4, 16, device=DEV) if name != "w" else torch.randn(16, device=DEV))
    for r in range(4):
        g.add(op, x="x", w="w", out="y", row=r)
    for r in range(4):
        g.add(op, x="y", w="w", out="z", row=r)
    deps = g.dependencies()
    assert deps[:4] == [[], [], [], []]
    assert deps[4:] == [[0], [1], [2], [3]]  # row r of z waits only for row r of y


def test_vm_names_the_task_behind_a_missing_producer():
    rng = random.Random(0)
    g, _ = random_norm_dag(rng, rows=2, n=16, nodes=3)
    program = lower(g, num_workers=4)
    victim = program.queues[0][0]  # a first-layer task some later task needs
    program.queues[0].remove(victim)
    with pytest.raises(Deadlock, match=rf"task {victim} \(.*\) is in no queue"):
        run_vm(program)


def test_broken_graph_times_out_with_detail_and_next_launch_works():
    g = TaskGraph()
    op = make_op("rmsnorm", n=32)
    for name in ("x", "w", "y", "z"):
        g.buffer(name, torch.randn(2, 32, device=DEV) if name != "w" else torch.randn(32, device=DEV))
    g.add(op, x="x", w="w", out="y", row=0)
    g.add(op, x="y", w="w", out="z", row=0)
    program = lower(g, num_workers=1)
    kernel = Megakernel(program)
    # Break it: the consumer's wait now expects two signals per launch, only one comes.
    waits_at = 4  # header words
    row = program.queues[0].index(1)
    good = kernel.desc.clone()
    kernel.desc[row, waits_at + 1] = 2
    with pytest.raises(MegakernelTimeout) as info:
        kernel.run()
    assert info.value.task == 1 and info.value.worker == 0 and info.value.seen < info.value.expected
    kernel.desc.copy_(good)
    kernel.run()  # after the error the runtime reset itself
    assert_close(g.buffers["z"][0], rmsnorm(rmsnorm(g.buffers["x"][:1], g.buffers["w"]), g.buffers["w"])[0],
                 torch.float32)


def test_reset_also_zeroes_the_counters_ops_keep_in_their_operands():
    # A launch that failed midway can leave attention's arrival counts partway: reset()
    # must zero them (they are an op's sync operand), and nothing else.
    g = TaskGraph()
    B, HQ, HKV, D, S = 1, 4, 2, 16, 8
    for name, shape in (("q", (B, HQ * D)), ("kc", (B, HKV, S, D)), ("vc", (B, HKV, S, D)),
                        ("o_part", (B, HQ, 2 * D)), ("lse", (B, HQ, 2)), ("out", (B, HQ * D))):
        g.buffer(name, torch.randn(*shape, device=DEV))
    g.buffer("seqlens", torch.tensor([5], dtype=torch.int32, device=DEV))
    g.buffer("arrivals", torch.tensor([1, 3], dtype=torch.int32, device=DEV))
    op = make_op("decode_attention", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_seq=S, num_splits=2)
    for kv in range(HKV):
        for split in range(2):
            g.add(op, q="q", k_cache="kc", v_cache="vc", seqlens="seqlens", o_part="o_part", lse="lse",
                  arrivals="arrivals", out="out", b=0, kv_head=kv, split=split)
    q = g.buffers["q"].clone()
    Megakernel(lower(g, num_workers=1)).reset()
    assert g.buffers["arrivals"].tolist() == [0, 0]
    assert torch.equal(g.buffers["q"], q)


def test_generated_source_is_readable_and_cached(tmp_path):
    g = TaskGraph()
    g.buffer("x", torch.randn(1, 8, device=DEV)), g.buffer("w", torch.randn(8, device=DEV))
    g.buffer("y", torch.empty(1, 8, device=DEV))
    g.add(make_op("rmsnorm", n=8), x="x", w="w", out="y", row=0)
    a = Megakernel(lower(g, 1))
    b = Megakernel(lower(g, 1))
    assert a.kernel is b.kernel and a.digest == b.digest
    path = a.dump_source(tmp_path / "k.py")
    text = path.read_text()
    assert "def megakernel(" in text and "rmsnorm_tile(" in text and "wait_event(" in text


@pytest.mark.parametrize("defer", [False, True])
def test_deferred_signals_are_safe_and_fewer(defer):
    """A worker's run of same-event tasks signals once: same results, no deadlock under random
    interleavings, one counter update per run instead of per task."""
    from mk.tasks.linear import linear_tiles
    from mk.tasks.linear import linear_ref

    g = TaskGraph()
    names = [g.buffer("h0", torch.randn(1, 32, device=DEV))]
    op = make_op("linear", M=1, N=32, K=32, block_n=4, dtype=torch.float32)
    expected = g.buffers["h0"]
    for layer in range(3):  # each tile of a layer reads all of the previous layer's output
        w = g.buffer(f"w{layer}", torch.randn(32, 32, device=DEV) / 32**0.5)
        names.append(g.buffer(f"h{layer + 1}", torch.full((1, 32), float("nan"), device=DEV)))
        for a in linear_tiles(op):
            g.add(op, x=names[-2], w=w, out=names[-1], **a)
        expected = linear_ref(expected, g.buffers[w])
    program = lower(g, num_workers=2)  # round robin: each worker holds 4 consecutive tiles of a layer
    for seed in range(4):
        for name in names[1:]:
            g.buffers[name].fill_(float("nan"))
        report = run_vm(program, interleave="random", seed=seed, defer_signals=defer)
        assert_close(g.buffers["h3"], expected, torch.float32, "h3")
        # Layers 0 and 1 signal (layer 2 has no consumer): 16 tasks, or 2 workers x 2 runs.
        assert report.signals == (4 if defer else 16)


def test_blocks_per_sm_counts_the_shared_memory_reserved_a_block():
    from types import SimpleNamespace

    from mk.persistent.runtime import blocks_per_sm
    h200 = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                           shared_memory_per_block_optin=232448, max_threads_per_multi_processor=2048)
    # 76 KiB a worker: 3 x 76 KiB fit 228 KiB, but not with the driver's 1 KiB a block.
    assert blocks_per_sm(128, 77824, 2, h200) == 2
    assert blocks_per_sm(128, 57872, 2, h200) == 3  # 4 would need 235584 B
    assert blocks_per_sm(128, 53912, 2, h200) == 4
    assert blocks_per_sm(255, 53912, 4, h200) == 2  # 255 registers x 128 threads: 2 by registers
    assert blocks_per_sm(32, 0, 1, h200) == 32
