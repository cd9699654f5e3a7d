"""The megakernel on the GPU: as many workers as the SMs hold, timeouts, CUDA graphs, traces."""

import json
import random
import time

import pytest
import torch

from mk.persistent.graph import TaskGraph, lower
from mk.persistent.runtime import Megakernel, MegakernelTimeout
from mk.tasks import make_op
from mk.tasks.linear import linear_tiles
from tests.conftest import rel_err
from tests.tasks.test_linear_ops import RandomDag

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def gemv_chain(layers: int, n: int, **kw):
    """h[l+1] = W[l] @ h[l] in bf16, one task per tile; returns (graph, weights)."""
    g = TaskGraph()
    g.buffer("h0", torch.randn(1, n, device="cuda", dtype=BF16))
    ws = []
    for layer in range(layers):
        ws.append(torch.randn(n, n, device="cuda", dtype=BF16) / n**0.5)
        g.buffer(f"w{layer}", ws[-1])
        g.buffer(f"h{layer + 1}", torch.zeros(1, n, device="cuda", dtype=BF16))
    op = make_op("linear", M=1, N=n, K=n, dtype=BF16, **kw)
    for layer in range(layers):
        for a in linear_tiles(op):
            g.add(op, x=f"h{layer}", w=f"w{layer}", out=f"h{layer + 1}", **a)
    return g, ws


def chain_ref(x, ws):
    h = x.float()
    for w in ws:
        h = (h @ w.float().T).to(BF16).float()
    return h


@pytest.mark.parametrize("trial", range(4))
def test_random_dags_with_a_worker_per_sm(trial, _seed):
    rng = random.Random(_seed + trial)
    dag = RandomDag(rng, rng.choice([1, 3])).build(nodes=10)
    kernel = Megakernel(lower(dag.g, num_workers=sm_count(), schedule=rng.choice(["round_robin", "list"])))
    for launch in range(3):
        dag.clear_outputs()
        kernel.run()
        dag.check(f"launch {launch}")
    assert int(kernel.state[0]) == 3


def test_every_resident_worker_and_weight_prefetch():
    g, ws = gemv_chain(4, 1024, block_n=2, prefetch_k=512)
    probe = Megakernel(lower(g, num_workers=1))
    workers = probe.residency().max_workers
    kernel = Megakernel(lower(g, num_workers=workers))
    kernel.run()
    assert rel_err(g.buffers["h4"], chain_ref(g.buffers["h0"], ws)) < 2e-2
    too_many = Megakernel(lower(g, num_workers=workers + 1))
    with pytest.raises(Exception, match="cannot all be resident"):
        too_many.launch()


def test_two_warp_workers_fit_more_an_sm_and_compute_the_same():
    g, ws = gemv_chain(4, 1024, block_n=2, prefetch_k=512)
    four = Megakernel(lower(g, num_workers=1)).residency()
    two = Megakernel(lower(g, num_workers=1), num_warps=2).residency()
    assert two.num_warps == 2 and two.max_workers >= four.max_workers
    kernel = Megakernel(lower(g, num_workers=two.max_workers), num_warps=2)
    kernel.run()
    assert rel_err(g.buffers["h4"], chain_ref(g.buffers["h0"], ws)) < 2e-2


def test_broken_graph_times_out_within_a_second_and_the_next_launch_works():
    g, ws = gemv_chain(3, 512, block_n=8)
    kernel = Megakernel(lower(g, num_workers=2 * sm_count()), timeout_s=0.25)
    kernel.run()
    good = kernel.desc.clone()
    # Ask the last task for one more signal than its producers will ever give.
    row = int((kernel.desc[:, 2] > 0).nonzero()[-1])
    kernel.desc[row, 5] += 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with pytest.raises(MegakernelTimeout) as info:
        kernel.run()
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"took {elapsed:.2f} s to report the timeout"
    assert info.value.expected > info.value.seen and info.value.task == int(kernel.desc[row, 3])
    kernel.desc.copy_(good)
    g.buffers["h3"].zero_()
    kernel.run()  # check() reset the counters: the next launch runs normally
    assert rel_err(g.buffers["h3"], chain_ref(g.buffers["h0"], ws)) < 2e-2


def test_launches_replay_from_a_cuda_graph_with_new_inputs():
    g, ws = gemv_chain(3, 1024, block_n=4, prefetch_k=256)
    kernel = Megakernel(lower(g, num_workers=2 * sm_count()))
    kernel.run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.launch()
    x, out = g.buffers["h0"], g.buffers["h3"]
    for _ in range(5):
        x.copy_(torch.randn_like(x))  # per-step input lives in device memory
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, chain_ref(x, ws)) < 2e-2
    kernel.check()


def test_trace_is_a_timeline_in_dependency_order(tmp_path):
    g, ws = gemv_chain(3, 512, block_n=16)
    kernel = Megakernel(lower(g, num_workers=8), trace=True)
    kernel.run()
    events = kernel.trace_events()
    assert len(events) == len(g.tasks)
    end_of = {e["task"]: e["end_us"] for e in events}
    tiles = len(g.tasks) // 3
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for e in events:
        assert e["end_us"] >= e["start_us"] >= 0
        assert 0 <= e["sm"] < num_sms
        if e["task"] >= tiles:  # a tile of layer l+1 finishes after every tile of layer l
            layer = e["task"] // tiles
            assert e["end_us"] >= max(end_of[t] for t in range((layer - 1) * tiles, layer * tiles))
    kernel.save_trace(tmp_path / "t.json", tmp_path / "t.png")
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert len([t for t in trace if t["cat"] != "wait"]) == len(events)
    assert all(e["start_us"] <= e["ready_us"] <= e["end_us"] for e in events)


@pytest.mark.parametrize("block_n,ring,run", [(16, 4, 3), (8, 4, 5), (32, 3, 2)])
def test_runs_of_tma_tiles_equal_one_tile_a_task(block_n, ring, run):
    """A chain of bf16 GEMVs whose tasks are runs of TMA tiles (mk.tasks.linear.linear_run),
    the last run of each layer shorter, over every resident worker: the same products as one
    tile a task (the same chunks in the same order; a bf16 rounding may differ), and within
    bf16 rounding of the reference."""
    n, layers = 1000 - 1000 % block_n + block_n // 2, 3  # a clipped last tile
    n -= n % 8  # rows 16-byte aligned for the TMA descriptor
    results = []
    for tiles_per_task in (1, run):
        torch.manual_seed(0)
        g, ws = gemv_chain(layers, n, block_n=block_n, block_k=128, tma_stages=ring, tiles_per_task=tiles_per_task)
        kernel = Megakernel(lower(g, num_workers=2 * sm_count()))
        kernel.run()
        results.append(g.buffers[f"h{layers}"].float())
        assert rel_err(results[-1], chain_ref(g.buffers["h0"], ws)) < 1e-2
    assert rel_err(results[1], results[0]) < 1e-3
