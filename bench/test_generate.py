"""What users get: ``Llama.generate`` as users call it, against the same step launched back to back.

Random bf16 weights at the 1B, 8B and deep-narrow (135M) shapes, batch 1 and 8: a 64-token
prompt and 256 new tokens through ``generate`` (tokens/s, per-token time, time to first
token, GPU memory beyond weights + KV cache), and the same planned step launched 255 times
back to back from the same positions (the kernel's own time). Then, from a checkpoint
written to local disk, the time from ``from_pretrained`` to the first token in a fresh
process, phase by phase (load, plan, lower, compile, prefill), with cold caches (empty
plan, kernel and Triton caches) and warm ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _harness import measure_generate
from _llama_shapes import SHAPES, random_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("batch", [1, 8])
def test_generate(benchmark, record, gpu_env, llama, batch):
    key, model = llama
    record("generate", model=key, **measure_generate(benchmark, model, batch, gpu_env["copy_Bps"]))


FIRST_TOKEN = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from mk.models import Llama
t_import = time.perf_counter()
model = Llama.from_pretrained(sys.argv[1], max_batch_size=1, max_seq_len=1024, progress=False)
torch.cuda.synchronize()
t_loaded = time.perf_counter()
out = model.generate([[(7 * t + 1) % model.config.vocab_size for t in range(64)]], max_new_tokens=1)
t_first = time.perf_counter()
print(json.dumps({"import_s": t_import - t0, "from_pretrained_to_first_token_s": t_first - t_import,
                  "load_s": model.build_stats["load_s"], **model.last_stats}))
"""


@pytest.mark.parametrize("key", ["1b", "8b"])
def test_time_to_first_token(record, tmp_path_factory, key):
    """from_pretrained to the first token, in a fresh process, with cold then warm caches."""
    from mk.models import LlamaConfig
    from mk.models.weights import save_weights

    folder = tmp_path_factory.mktemp(f"ckpt-{key}")
    cfg = LlamaConfig(**SHAPES[key])
    weights = random_model(cfg)
    save_weights(weights, cfg, folder, shard_bytes=4 * 2**30)
    del weights
    torch.cuda.empty_cache()
    script = folder / "first_token.py"
    script.write_text(FIRST_TOKEN)
    caches = tmp_path_factory.mktemp(f"caches-{key}")
    env = {**os.environ, "MK_CACHE_DIR": str(caches / "mk"), "TRITON_CACHE_DIR": str(caches / "triton"),
           "PYTHONPATH": str(ROOT)}
    for caches_state in ("cold", "warm"):
        run = subprocess.run([sys.executable, str(script), str(folder)], env=env, capture_output=True, text=True,
                             timeout=900)
        assert run.returncode == 0, run.stderr[-4000:]
        phases = json.loads(run.stdout.strip().splitlines()[-1])
        record("generate", op="time_to_first_token", model=key, caches=caches_state, **phases)
