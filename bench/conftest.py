"""Benchmark harness: GPU only; every figure goes to bench/results/ with its peers.

Each benchmark times its op with pytest-benchmark (wall time of a CUDA-graph replay of
many calls, so regressions show in `--benchmark-compare`) and records the event-timed
per-call figure with `record(...)`. At the end of the session the records of each suite
are written to ``bench/results/<suite>-<device>.json`` (the latest run of each suite and
device; git keeps the earlier ones) together with the device, the Triton/torch versions,
the commit, the date and the copy bandwidth of the same run.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from _llama_shapes import SHAPES, shape_model

HAS_CUDA = torch.cuda.is_available()
RESULTS_DIR = Path(__file__).parent / "results"
_records: dict[str, list[dict]] = defaultdict(list)


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu: a benchmark that runs on the CPU too (the planner)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="benchmarks need a CUDA GPU")
    here = Path(__file__).parent
    for item in items:
        # The hook sees the whole session: leave items outside bench/ alone.
        if "cpu" not in item.keywords and here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def _commit() -> str:
    if os.environ.get("MK_COMMIT"):
        return os.environ["MK_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@pytest.fixture(scope="session")
def gpu_env() -> dict:
    """Device, versions, commit, date and the copy bandwidth measured in this run."""
    import triton

    from mk.timing import copy_bandwidth

    if not HAS_CUDA:  # CPU benchmarks (the planner): the machine instead of a GPU
        import platform

        env = {"device": f"cpu-{platform.machine()}", "cpus": os.cpu_count(), "triton": triton.__version__,
               "torch": torch.__version__, "commit": _commit(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        env["device_slug"] = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
        return env
    env = {
        "device": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    env["device_slug"] = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
    env.update(copy_bandwidth())
    return env


@pytest.fixture(scope="session")
def results_dir() -> Path:
    """bench/results/, where result JSON and traces are kept."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR


@pytest.fixture
def record(gpu_env):
    """record(suite, **figures): keep one result row for bench/results/<suite>-....json."""

    def _record(suite: str, **figures):
        _records[suite].append(figures)

    return _record


def pytest_sessionfinish(session, exitstatus):
    if not _records:
        return
    env = session.config._mk_gpu_env if hasattr(session.config, "_mk_gpu_env") else None
    if env is None:
        return
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    slug = env["device_slug"]
    for suite, rows in _records.items():
        path = RESULTS_DIR / f"{suite}-{slug}.json"
        path.write_text(json.dumps({**env, "suite": suite, "results": rows}, indent=1) + "\n")
        print(f"\nmk: wrote {path}")


@pytest.fixture(scope="session", autouse=True)
def _keep_env_for_results(request):
    """Hand the session's gpu_env to pytest_sessionfinish (only when a GPU is there)."""
    if HAS_CUDA or any("cpu" in item.keywords for item in request.session.items):
        request.config._mk_gpu_env = request.getfixturevalue("gpu_env")
    yield


@pytest.fixture(scope="module", params=list(SHAPES))
def llama(request):
    """(shape key, a bf16 mk Llama of that shape with random weights, MAX_SEQ positions, batch
    <= 8), one shape at a time (bench/_llama_shapes.py)."""
    model = shape_model(request.param)
    yield request.param, model
    del model
    torch.cuda.empty_cache()
