"""Calibration: fitting the cost-model constants from micro-benchmark timings; the command's
refusal without a GPU; the measured constants reach the planner's DeviceSpec."""
import random

import pytest
import torch

from mk.__main__ import main
from mk.planner.calibrate import Timings, _tiny_linear_graph, fit_constants
from mk.planner.device import PRESETS, CALIBRATED_FIELDS


def _timings(launch, task, wait, workers=264, k=9, links=128):
    """What the micro-benchmarks would measure on a device with these true constants."""
    return Timings(workers=workers, spread_one_s=launch + task, spread_many_s=launch + k * task, spread_tasks=k,
                   chain_s=launch + links * (task + wait), chain_links=links, copy_Bps=4.3e12, mm_flops=7e14)


def test_fit_recovers_the_constants_that_made_the_timings():
    rng = random.Random(7)
    for _ in range(20):
        launch, task, wait = rng.uniform(1e-6, 9e-6), rng.uniform(2e-7, 4e-6), rng.uniform(0, 3e-6)
        c = fit_constants(_timings(launch, task, wait, k=rng.randint(2, 16), links=rng.randint(1, 300)))
        assert c["launch_overhead_s"] == pytest.approx(launch, rel=1e-9, abs=1e-15)
        assert c["task_overhead_s"] == pytest.approx(task, rel=1e-9)
        assert c["wait_overhead_s"] == pytest.approx(wait, rel=1e-7, abs=1e-15)
        assert c["dram_bandwidth"] == 4.3e12 and c["bf16_flops"] == 7e14
        assert set(c) == set(CALIBRATED_FIELDS)


def test_fit_never_returns_negative_overheads():
    # Noise can make the chain cheaper than its tasks: a hop then costs nothing, not less.
    t = _timings(3e-6, 1e-6, 0.0)
    noisy = Timings(**{**t.__dict__, "chain_s": t.chain_s * 0.9})
    assert fit_constants(noisy)["wait_overhead_s"] == 0.0
    with pytest.raises(ValueError, match="at least"):
        fit_constants(Timings(**{**t.__dict__, "spread_tasks": 1}))


def test_fitted_constants_make_a_calibrated_spec():
    spec = PRESETS["h200"].with_calibration(fit_constants(_timings(2e-6, 1e-6, 5e-7)))
    assert spec.calibrated and spec.wait_overhead_s == pytest.approx(5e-7) and spec.dram_bandwidth == 4.3e12


@pytest.mark.parametrize("chain", [False, True])
def test_micro_benchmark_graphs_have_the_intended_dependencies(chain):
    g = _tiny_linear_graph(6, chain, torch.device("cpu"))
    deps = g.dependencies()
    assert len(g.tasks) == 6
    assert deps == ([[]] + [[i - 1] for i in range(1, 6)] if chain else [[]] * 6)


def test_calibrate_command_without_a_gpu_is_one_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["calibrate", "--no-save"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mk: error:") and "CUDA" in err and "Traceback" not in err
