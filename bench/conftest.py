"""Benchmark harness: GPU only; every figure goes to bench/results/ with its peers.

Each benchmark times its op with pytest-benchmark (wall time of a CUDA-graph replay of
many calls, so regressions show in `--benchmark-compare`) and records the event-timed
per-call figure with `record(...)`. With ``--save-results``, at the end of the session the
records of each suite are written to ``bench/results/<suite>-<device>.json`` (the latest run
of each suite and device; git keeps the earlier ones) together with the device, the
Triton/torch versions, the commit, the date and the copy bandwidth of the same run; without
it the checkout is left as it was and the records are printed.
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


def pytest_addoption(parser):
    parser.addoption("--save-results", action="store_true", default=False,
                     help="write each suite's records to bench/results/<suite>-<device>.json (mk)")


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
def results_dir(request, tmp_path_factory) -> Path:
    """Where traces are kept: bench/results/ with ``--save-results``, else a temporary folder."""
    if not request.config.getoption("save_results"):
        return tmp_path_factory.mktemp("results")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR


def within_limit(gpu_env: dict, limits: dict[str, float], seconds: float, what: str) -> None:
    """Assert that ``seconds`` stays under the wall-clock limit set for this run's device
    (``limits``: by device slug, e.g. ``nvidia-h200``: a limit holds for the host it was set
    on). Elsewhere the figure is recorded, not judged."""
    limit = limits.get(gpu_env["device_slug"])
    if limit is not None:
        assert seconds < limit, f"{what} took {seconds * 1e3:.1f} ms (limit on {gpu_env['device']}: {limit * 1e3:.1f} ms)"


@pytest.fixture
def record(gpu_env, request):
    """record(suite, **figures): keep one result row for bench/results/<suite>-....json. With
    ``--save-results`` the file is written again at each row, so a run cut short (a time
    limit, a crash) still leaves what it measured."""
    save = request.config.getoption("save_results")

    def _record(suite: str, **figures):
        _records[suite].append(figures)
        if save:
            _write(suite, gpu_env, quiet=True)

    return _record


def _results(suite: str, env: dict) -> tuple[Path, str]:
    """bench/results/<suite>-<device>.json and its text: ``suite``'s rows so far with ``env``."""
    return (RESULTS_DIR / f"{suite}-{env['device_slug']}.json",
            json.dumps({**env, "suite": suite, "results": _records[suite]}, indent=1) + "\n")


def _write(suite: str, env: dict, quiet: bool = False) -> None:
    """Write ``suite``'s rows so far to its results file."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path, text = _results(suite, env)
    path.write_text(text)
    if not quiet:
        print(f"\nmk: wrote {path}")


def pytest_sessionfinish(session, exitstatus):
    if not _records:
        return
    env = session.config._mk_gpu_env if hasattr(session.config, "_mk_gpu_env") else None
    if env is None:
        return
    for suite in _records:
        if session.config.getoption("save_results"):
            _write(suite, env)
        else:
            path, text = _results(suite, env)
            print(f"\nmk: {suite} on {env['device']} (not saved; --save-results writes {path.name}):\n{text}")


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
