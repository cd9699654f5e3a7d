"""Helpers shared by the persistent-runtime tests and the tests of the tasks' megakernel ops
(tests/tasks/test_*_ops.py)."""

import atexit
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from mk.persistent.graph import TaskGraph

ROOT = Path(__file__).resolve().parents[2]


def region_coverage(g: TaskGraph, buffer: str, tasks, which: str) -> torch.Tensor:
    """How many times each element of ``buffer`` (2-D view) is in the given tasks' regions
    (``which`` = "reads" or "writes"); asserts every region lies inside the buffer."""
    buf = g.buffers[buffer]
    view = buf.reshape(1, -1) if buf.dim() < 2 else buf.reshape(-1, buf.shape[-1])
    count = torch.zeros(view.shape, dtype=torch.int32)
    for t in tasks:
        for r in getattr(t, which)():
            if r.buffer == buffer:
                assert 0 <= r.r0 < r.r1 <= view.shape[0] and 0 <= r.c0 < r.c1 <= view.shape[1], (t.name, r)
                count[r.r0:r.r1, r.c0:r.c1] += 1
    return count


def can_compile_for_cuda() -> bool:
    """Triton's NVIDIA backend is installed (it compiles for a GPU target without a GPU)."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        return False
    return True


def _compile_run(script: str, folder: Path) -> tuple[int, str, str]:
    """(return code, stdout, stderr) of tests/persistent/<script>, compiled with the interpreter
    off, caches in ``folder``."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "MK_CACHE_DIR": str(folder), "PYTHONPATH": str(ROOT),
           "TRITON_CACHE_DIR": str(folder / "triton")}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "persistent" / script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _RUNNING.append(proc)
    try:
        out, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n{script} did not finish compiling in {COMPILE_TIMEOUT_S} s"
    finally:
        _RUNNING.remove(proc)
    return proc.returncode, out, err


#: Seconds a compile script may take.
COMPILE_TIMEOUT_S = 600
#: Compile scripts started ahead of their tests (:func:`start_compile_scripts`): script ->
#: (done, result).
_AHEAD: dict[str, tuple[threading.Event, list]] = {}
_RUNNING: list[subprocess.Popen] = []


def start_compile_scripts(scripts: list[str]) -> None:
    """Run tests/persistent/<script> for each of ``scripts``, one after another, in a background
    thread from now on: a compile for a GPU target keeps a core busy for a minute or two,
    which the interpreter tests leave idle on a 2-core machine. Their tests then only collect
    the results (:func:`compile_script_ok`). A run still going when the tests end is killed."""
    todo = [s for s in dict.fromkeys(scripts) if s not in _AHEAD]
    for script in todo:
        _AHEAD[script] = (threading.Event(), [])

    def run_all():
        for script in todo:
            done, result = _AHEAD[script]
            try:
                with tempfile.TemporaryDirectory(prefix="mk-compile-") as folder:
                    result.append(_compile_run(script, Path(folder)))
            except Exception as e:  # (reported by the script's test)
                result.append((1, "", f"{type(e).__name__}: {e}"))
            finally:
                done.set()

    if todo:
        threading.Thread(target=run_all, name="mk-compile-checks", daemon=True).start()


@atexit.register
def _kill_running() -> None:
    for proc in list(_RUNNING):
        proc.kill()


def compile_script_ok(request, tmp_path: Path) -> None:
    """Run tests/persistent/<script> (the test's ``compile_script`` marker names it) in a
    subprocess with the interpreter off (the switch is read when Triton decorates kernels),
    or take the run :func:`start_compile_scripts` began, and assert it compiled and printed
    "ok"."""
    marker = request.node.get_closest_marker("compile_script")
    assert marker is not None, f"{request.node.name}: no compile_script marker names its script"
    script = marker.args[0]
    if script in _AHEAD:
        done, result = _AHEAD[script]
        assert done.wait(timeout=3 * COMPILE_TIMEOUT_S), f"{script}: the background compile never finished"
        code, out, err = result[0]
    else:
        code, out, err = _compile_run(script, tmp_path)
    assert code == 0 and out.strip().endswith("ok"), err[-4000:]
