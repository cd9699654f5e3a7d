"""The megakernel's generated code compiles for Hopper (sm_90) on this CPU machine.

The interpreter never compiles: inline PTX, layouts and type rules are only checked by a
real compile. Triton can compile for a GPU target without a GPU, so this test catches
what would otherwise show up only on the device.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _can_compile_for_cuda() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _can_compile_for_cuda(), reason="Triton's NVIDIA backend is not installed")
def test_megakernel_compiles_for_sm90(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "MK_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT),
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "persistent" / "_compile_sm90.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]
