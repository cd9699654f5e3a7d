"""Tensor parallelism on two and four GPUs of one machine (each skipped with fewer): see
_tp_gpu_ranks.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpus_decode_as_one_replace_their_steps_and_time_out_without_their_peers(ranks):
    if GPUS < ranks:
        pytest.skip(f"needs {ranks} GPUs, the machine has {GPUS}")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                          str(Path(__file__).parent / "_tp_gpu_ranks.py")],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.stdout[-2000:], run.stderr[-6000:])
