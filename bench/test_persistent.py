"""The megakernel on chained GEMVs against torch.mv and mk's own launches, in one run (bf16).

* 16 layers of 8192 x 8192: bandwidth-bound; the megakernel must reach 0.95x the speed
  of torch.mv per layer replayed from a CUDA graph.
* 64 layers of 2048 x 2048: launch-bound; the megakernel must be 1.5x faster than the
  CUDA-graph peer.

Every layer is one task per output tile; each tile of layer l+1 waits for all tiles of
layer l (it reads all of h[l+1]). A trace of the 64-layer run is saved next to the results.
"""

from __future__ import annotations


import pytest
import torch

from _harness import bench_graph, gemv_chain, gemv_chain_ref
from mk.persistent.graph import lower
from mk.persistent.runtime import Megakernel
from mk.tasks.linear import linear

#: Megakernel tiles per chain (fastest in a sweep on an H200): block rows,
#: block columns, warps per worker, workers per SM, weight columns prefetched before the wait,
#: TMA ring depth (weights streamed through shared memory).
CHAINS = {
    (16, 8192): dict(block_n=32, block_k=256, num_warps=4, workers_per_sm=2, prefetch_k=0, tma_stages=4,
                     floor=0.95),
    (64, 2048): dict(block_n=8, block_k=2048, num_warps=4, workers_per_sm=2, prefetch_k=2048, floor=1.5),
}
_TORCH_US: dict = {}


@pytest.fixture(scope="module")
def chains():
    built = {}
    for (layers, n) in CHAINS:
        torch.manual_seed(layers)
        ws = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n**0.5 for _ in range(layers)]
        x = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
        built[(layers, n)] = (ws, x, gemv_chain_ref(ws, x))
    yield built
    built.clear()


def _megakernel(layers, n, ws, x, trace=False):
    cfg = dict(CHAINS[(layers, n)])
    wps, _ = cfg.pop("workers_per_sm"), cfg.pop("floor")
    g, _, _, out = gemv_chain(layers, n, weights=ws, x=x, **cfg)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return Megakernel(lower(g, num_workers=sms * wps), trace=trace), out


@pytest.mark.parametrize("provider", ["torch", "mk_ops", "mk"])
@pytest.mark.parametrize("layers,n", list(CHAINS))
def test_gemv_chain(benchmark, record, gpu_env, chains, provider, layers, n):
    ws, x, ref = chains[(layers, n)]
    if provider == "torch":
        hs = [x[0]] + [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        calls = [lambda l=l: torch.mv(ws[l], hs[l], out=hs[l + 1]) for l in range(layers)]
        out = hs[-1]
    elif provider == "mk_ops":
        box = {}

        def run_ops():
            h = x
            for w in ws:
                h = linear(h, w)
            box["out"] = h
        run_ops()
        calls = [run_ops] * layers  # bench_graph divides by len(calls): per-layer figure below
        out = None
    else:
        kernel, out = _megakernel(layers, n, ws, x)
        kernel.run()
        calls = [kernel.launch] * layers
    us_per_layer = bench_graph(benchmark, calls) / layers if provider != "torch" else bench_graph(benchmark, calls)
    if provider == "mk_ops":
        out = box["out"]
    else:
        torch.cuda.synchronize()
    if provider == "mk":
        kernel.check()
    err = ((out.float().reshape(-1) - ref.reshape(-1)).norm() / ref.norm()).item()
    # bf16 rounding paths diverge a little per layer: ~2% after 64 layers for torch.mv itself.
    assert err < 5e-2, f"{provider} chain result off by {err:.3g}"
    nbytes = n * n * 2
    fig = dict(layers=layers, n=n, provider=provider, us_per_layer=us_per_layer,
               frac_of_copy=nbytes / (us_per_layer * 1e-6) / gpu_env["copy_Bps"], rel_err=err)
    if provider == "torch":
        _TORCH_US[(layers, n)] = us_per_layer
    elif (layers, n) in _TORCH_US:
        fig["speedup_vs_torch"] = _TORCH_US[(layers, n)] / us_per_layer
    if provider == "mk":
        fig["config"] = {k: v for k, v in CHAINS[(layers, n)].items() if k != "floor"}
        fig["workers"] = kernel.program.num_workers
        fig["tasks"] = len(kernel.program.graph.tasks)
    record("persistent", **fig)
    if provider == "mk" and "speedup_vs_torch" in fig:
        floor = CHAINS[(layers, n)]["floor"]
        assert fig["speedup_vs_torch"] >= floor, (
            f"megakernel {layers}x{n}: {fig['speedup_vs_torch']:.3f}x torch.mv per layer (floor {floor}x)")


def test_save_trace(gpu_env, chains, results_dir):
    """One traced launch of the 64-layer chain: Chrome-trace JSON (Perfetto) and a PNG Gantt."""
    ws, x, _ = chains[(64, 2048)]
    kernel, _ = _megakernel(64, 2048, ws, x, trace=True)
    for _ in range(3):
        kernel.run()
    stem = f"trace-gemv-chain-64x2048-{gpu_env['device_slug']}"  # the latest run's only
    kernel.save_trace(results_dir / f"{stem}.json", results_dir / f"{stem}.png")
    assert (results_dir / f"{stem}.json").stat().st_size > 0
