"""The plan cache: a hit returns the same plan, any change of key misses, corrupt files re-plan."""

import pytest

from mk.planner.cache import cached_plan, plan_dir
from mk.planner.device import DeviceSpec
from mk.planner.graph import ModelShape, llama_decode_graph
from mk.planner.search import Plan


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("MK_CACHE_DIR", str(tmp_path))


def test_hit_miss_and_corrupt_file():
    g = llama_decode_graph(ModelShape.preset("llama-3.2-1b"), 1, 128)
    h200 = DeviceSpec.preset("h200")
    first, hit = cached_plan(g, h200)
    assert not hit
    again, hit = cached_plan(g, h200)
    assert hit and again.choices == first.choices and again.predicted_s == first.predicted_s
    # A different batch, budget or device is a different plan.
    assert not cached_plan(llama_decode_graph(ModelShape.preset("llama-3.2-1b"), 8, 128), h200)[1]
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
    g = llama_decode_graph(ModelShape.preset("llama-3.2-1b"), 2, 64)
    h200 = DeviceSpec.preset("h200")
    plan, _ = cached_plan(g, h200)
    back = Plan.from_json(plan.to_json(), g, h200)
    assert back.choices == plan.choices and len(back.estimates) == len(plan.choices)
    assert sum(e.seconds for e in back.estimates) == pytest.approx(plan.predicted_s)
