"""Helpers shared by the persistent-runtime tests and the tests of the tasks' megakernel ops
(tests/tasks/test_*_ops.py)."""

import os
import subprocess
import sys
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


def compile_script_ok(script: str, tmp_path: Path) -> None:
    """Run tests/persistent/<script> in a subprocess with the interpreter off (the switch is
    read when Triton decorates kernels) and assert it compiled and printed "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "MK_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT),
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "persistent" / script)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]
