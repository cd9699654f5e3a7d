"""Calibration: fitting the cost-model constants from micro-benchmark timings; the chains'
dependencies; the command's refusal without a GPU; the constants reach the planner."""
import random
from dataclasses import replace

import pytest
import torch

from mk.__main__ import main
from mk.planner.calibrate import (CHAINS, ChainConfig, ChainTiming, Timings, _chain_graph, _chain_graph_op,
                                  chain_residuals, fit_constants)
from mk.planner.cost import estimate_op
from mk.planner.device import CALIBRATED_FIELDS, PRESETS

WORKERS = 264
H200 = PRESETS["h200"]  # the device whose ring limits the chains are fitted with


def _timings(true: dict, bare_task=6e-7, k=9, chains=CHAINS):
    """What the micro-benchmarks would measure on a device whose cost model has ``true`` constants."""
    spec = PRESETS["h200"].with_calibration(true)
    timed = []
    for config in chains:
        node, choice = _chain_graph_op(config)
        per_layer = estimate_op(node, choice, spec, WORKERS).seconds
        timed.append(ChainTiming(config, config.layers, true["launch_overhead_s"] + config.layers * per_layer))
    launch = true["launch_overhead_s"]
    return Timings(workers=WORKERS, sm_count=132, spread_one_s=launch + bare_task,
                   spread_many_s=launch + k * bare_task, spread_tasks=k, copy_Bps=true["dram_bandwidth"],
                   mm_flops=true["bf16_flops"], chains=tuple(timed))


def _random_constants(rng):
    return {"dram_bandwidth": rng.uniform(2e12, 5e12), "bf16_flops": 7e14, "launch_overhead_s": rng.uniform(1e-6, 9e-6),
            "task_overhead_s": rng.uniform(2e-7, 4e-6), "wait_overhead_s": rng.uniform(0, 3e-6),
            "tma_worker_bandwidth": rng.uniform(15e9, 30e9), "worker_bandwidth": rng.uniform(6e9, 14e9)}


def test_fit_recovers_the_constants_that_made_the_timings():
    rng = random.Random(7)
    for _ in range(20):
        true = _random_constants(rng)
        fitted = fit_constants(_timings(true, k=rng.randint(2, 16)), H200)
        assert set(fitted) == set(CALIBRATED_FIELDS)
        for name, value in true.items():
            assert fitted[name] == pytest.approx(value, rel=1e-6, abs=1e-15), name


def test_fitted_constants_reproduce_the_chains():
    true = _random_constants(random.Random(3))
    t = _timings(true)
    rows = chain_residuals(t, H200.with_calibration(fit_constants(t, H200)))
    assert len(rows) == len(CHAINS)
    for r in rows:
        assert r["model_us"] == pytest.approx(r["measured_us"], rel=1e-6)


def test_fit_never_returns_negative_overheads_and_leaves_unmeasured_rates_at_zero():
    true = _random_constants(random.Random(5))
    t = _timings(true)
    # Noise can make the chains cheaper than their tasks: a wait then costs nothing, not less.
    faster = replace(t, chains=tuple(replace(c, seconds=c.seconds * 0.3) for c in t.chains))
    c = fit_constants(faster, H200)
    assert c["wait_overhead_s"] >= 0 and c["task_overhead_s"] >= 0
    only_tma = fit_constants(_timings(true, chains=[ch for ch in CHAINS if ch.tma_stages]), H200)
    assert only_tma["worker_bandwidth"] == 0.0 and only_tma["tma_worker_bandwidth"] > 0
    assert fit_constants(replace(t, chains=()), H200)["wait_overhead_s"] == 0.0  # nothing to fit it from
    with pytest.raises(ValueError, match="at least"):
        fit_constants(replace(t, spread_tasks=1), H200)


def test_fitted_constants_make_a_calibrated_spec():
    true = _random_constants(random.Random(11))
    spec = H200.with_calibration(fit_constants(_timings(true), H200))
    assert spec.calibrated and spec.wait_overhead_s == pytest.approx(true["wait_overhead_s"], rel=1e-6)
    assert spec.worker_rate(tma=True) == pytest.approx(true["tma_worker_bandwidth"], rel=1e-6)


@pytest.mark.parametrize("split_k", [1, 2])
def test_chain_layers_are_dependency_phases(split_k):
    """Every tile of a layer waits for every tile of the layer before (it reads all of h);
    split-K partials wait for the tiles of their K range, reduces for their partials."""
    config = ChainConfig(64, 16, block_k=32, split_k=split_k)
    g = _chain_graph(config, torch.device("cpu"), layers=3)
    deps = g.dependencies()
    tiles = 64 // 16
    if split_k == 1:
        assert len(g.tasks) == 3 * tiles
        for i in range(tiles, 3 * tiles):
            layer = i // tiles
            assert sorted(deps[i]) == list(range((layer - 1) * tiles, layer * tiles))
        assert all(deps[i] == [] for i in range(tiles))
    else:
        per_layer = tiles * split_k + tiles
        assert len(g.tasks) == 3 * per_layer
        first_reduce = tiles * split_k
        for r in range(tiles):  # a reduce waits for its tile's split_k partials
            assert len(deps[first_reduce + r]) == split_k
        # A partial of layer 1 reads h1's half: the reduces that wrote it.
        p = per_layer
        assert deps[p] and all(first_reduce <= d < per_layer for d in deps[p])
        assert len(deps[p]) == tiles // split_k


def test_calibrate_command_without_a_gpu_is_one_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["calibrate", "--no-save"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mk: error:") and "CUDA" in err and "Traceback" not in err
