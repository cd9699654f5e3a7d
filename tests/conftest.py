"""Shared test settings: seeds, dtypes and tolerances, and the `gpu` marker.

On a CPU machine kernels run through the Triton interpreter in float32 and must match
their references to 1e-5 (relative L2 error). On a GPU the same tests run compiled,
and bfloat16 variants (marked ``gpu``) must match a float32 reference to 1e-2.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from mk.tasks import default_device

HAS_CUDA = torch.cuda.is_available()

#: A fresh base seed per run unless MK_TEST_SEED pins it; printed in the header.
BASE_SEED = int(os.environ.get("MK_TEST_SEED", random.SystemRandom().randrange(2**31)))

# float32 on a GPU may go through tf32 tensor cores in tl.dot, hence the looser bound.
TOLERANCE = {
    ("cpu", torch.float32): 1e-5,
    ("cuda", torch.float32): 1e-3,
    ("cuda", torch.bfloat16): 1e-2,
    ("cuda", torch.float16): 5e-3,
}

#: Parametrize a test over this to run float32 everywhere and bfloat16 on the GPU.
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]


def pytest_report_header(config):
    where = "CUDA" if HAS_CUDA else "CPU (Triton interpreter)"
    return f"mk: kernels on {where}; test seed {BASE_SEED} (repeat with MK_TEST_SEED={BASE_SEED})"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the selected compile checks (``compile_script``) in the background, one after
    another: each keeps a core busy for a minute or two while the interpreter tests run on
    the other."""
    from tests.persistent._helpers import can_compile_for_cuda, start_compile_scripts

    scripts = [m.args[0] for item in session.items for m in item.iter_markers("compile_script")]
    if scripts and can_compile_for_cuda():
        start_compile_scripts(scripts)


@pytest.fixture(autouse=True)
def _seed(request):
    """Seed torch from the run's base seed and the test's name: fresh each run, repeatable."""
    seed = (BASE_SEED + sum(map(ord, request.node.nodeid)) * 7919) % (2**31)
    torch.manual_seed(seed)
    random.seed(seed)
    return seed


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: bad input must be refused before."""
    from mk.models import Llama

    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(Llama, "from_config", built)
    monkeypatch.setattr(Llama, "from_pretrained", built)


@pytest.fixture
def device() -> torch.device:
    return default_device()


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE[(default_device().type, dtype)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives inf."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out64.shape == ref64.shape, f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}"
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "output"):
    err = rel_err(out, ref)
    tol = tolerance(dtype)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


#: A chat template in Jinja, as tokenizer_config.json carries one.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def byte_level_tokenizer(folder, chat_template=CHAT_TEMPLATE):
    """A byte-level BPE (a character may take several tokens), 272 ids: fits the default model's vocab."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from mk.models import load_tokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, the cat"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>", "</s>"],
        show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True}
    if chat_template:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(folder)
