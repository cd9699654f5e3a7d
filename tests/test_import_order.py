"""mk works whatever was imported first and whatever TRITON_INTERPRET says: kernels run where
their tensors are. Checked in a fresh interpreter, where import order is real."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import transformers, triton, triton.language as tl  # before mk, as many scripts do
import torch._inductor  # noqa: F401  (imports Triton's runtime its own way)
from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
import torch

from mk import jit
from mk.models import Llama, LlamaConfig
from mk.tasks import rmsnorm, rmsnorm_ref

# A task op on fresh CPU tensors: the interpreter, though nothing set TRITON_INTERPRET.
x, w = torch.randn(3, 200), torch.randn(200)
err = ((rmsnorm(x, w, 1e-6) - rmsnorm_ref(x, w, 1e-6)).norm() / rmsnorm_ref(x, w, 1e-6).norm()).item()
assert err < 1e-5, err

# A user's own kernel through mk.jit, calling Triton's standard library (tl.sum).
@jit
def row_sum(x_ptr, out_ptr, N: tl.constexpr):
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + tl.program_id(0) * N + tl.arange(0, N)), 0))

out = torch.empty(3)
y = torch.randn(3, 16)
row_sum[(3,)](y, out, N=16)
assert torch.allclose(out, y.sum(1), atol=1e-5), (out, y.sum(1))

# generate() through the megakernel, checked against transformers' own greedy decoding.
config = LlamaConfig.tiny(num_hidden_layers=1, vocab_size=300, hidden_size=128, intermediate_size=256,
                          head_dim=32)
model = Llama.from_config(config, seed=3, max_batch_size=1, max_seq_len=16, device="cpu")
hf = LlamaForCausalLM(HFConfig(**config.to_hf_dict())).eval()
hf.load_state_dict({k: v.float() for k, v in model.hf_weights().items()}, strict=False)
prompt = [1, 5, 9, 2]
got = model.generate([prompt], max_new_tokens=3)[0]
want = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)[0].tolist()
assert got == want, (got, want)
print("ok")
"""


@pytest.mark.parametrize("interpret_env", [None, "0"], ids=["unset", "zero"])
def test_mk_works_after_transformers_and_triton_were_imported(tmp_path, interpret_env):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path of a machine without a GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret_env is not None:
        env["TRITON_INTERPRET"] = interpret_env
    env.update(PYTHONPATH=str(ROOT), MK_CACHE_DIR=str(tmp_path))
    script = tmp_path / "user_script.py"  # (Triton reads a kernel's source from its file)
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]
