"""FP8 weights (mk.tasks.linear.format) through ``generate``, against bf16 and peers, same run.

Random weights at the Llama-3.2-1B and Llama-3-8B shapes quantized to FP8 per output channel
(the LM head too), and the Qwen3-8B shape per 128 x 128 block, batch 1 and 8: a 64-token
prompt and 256 new tokens through ``generate`` (tokens/s, per-token time, time to first
token, GPU memory beyond weights + KV cache), the same step launched back to back (the
kernel), the floor (the bytes a step reads at the copy bandwidth of this run), and for the
Llama shapes a gpt-fast-style FP8 weight-only peer under torch.compile. Then prefill: the
time to first token of a 2048-token prompt through ``generate`` against the bf16 peer's
prefill under torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from _harness import PROMPT, measure_generate, prompts
from _llama_peer import TorchLlamaStep
from _llama_shapes import MAX_SEQ, QWEN3_8B, SHAPES, random_model

#: (key, family, config, quantize): the shapes and formats timed.
CASES = {"1b-fp8": ("llama", SHAPES["1b"], "fp8"), "8b-fp8": ("llama", SHAPES["8b"], "fp8"),
         "qwen3-8b-fp8-block": ("qwen3", QWEN3_8B, "fp8-block")}


def fp8_model(key: str, max_seq_len: int = MAX_SEQ):
    """A bf16 model of case ``key`` with random weights, its projections and LM head quantized
    on the GPU."""
    from mk.models.auto import FAMILIES
    from mk.models.weights import quantize_weights

    family, shape, quantize = CASES[key]
    cls = FAMILIES[family]
    cfg = cls.config_class(**shape)
    weights = quantize_weights(random_model(cfg), cfg, quantize, lm_head=True)
    torch.cuda.empty_cache()
    return cls(cfg, weights, device="cuda", dtype=torch.bfloat16, max_batch_size=8, max_seq_len=max_seq_len,
               name=key)


@pytest.fixture(scope="module", params=list(CASES))
def quantized(request):
    model = fp8_model(request.param)
    yield request.param, model
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("batch", [1, 8])
def test_fp8_generate(benchmark, record, gpu_env, quantized, batch):
    from mk.timing import event_time_us

    key, model = quantized
    row = dict(model=key, formats=model.formats, **measure_generate(benchmark, model, batch, gpu_env["copy_Bps"]))
    kernel_ms = row["kernel_ms_per_step"]
    if model.config.MODEL_TYPE == "llama" and batch == 1:  # the FP8 weight-only peer, same weights
        peer = TorchLlamaStep(model, batch)
        ids = torch.ones(batch, dtype=torch.long, device="cuda")
        pos = torch.tensor([PROMPT], dtype=torch.long, device="cuda")
        with torch.no_grad():
            compiled = torch.compile(peer.step, mode="reduce-overhead")
            for _ in range(3):
                compiled(ids, pos)
            row["peer_compile_ms"] = event_time_us(lambda: compiled(ids, pos), reps=30, warmup=3) / 1e3
        row["vs_peer"] = row["peer_compile_ms"] / kernel_ms
        del peer, compiled
        torch.cuda.empty_cache()
    record("fp8", **row)


@pytest.mark.parametrize("key", ["1b-fp8", "8b-fp8"])
def test_fp8_time_to_first_token(record, key):
    """A 2048-token prompt through generate (FP8: W8A8 prefill on the FP8 tensor cores, its
    CUDA graph captured by a first request) against the same shape's bf16 peer prefill under
    torch.compile."""
    from mk.models import Llama, LlamaConfig
    from mk.timing import event_time_us

    model = fp8_model(key, max_seq_len=4096)
    prompt = prompts(1, model.config.vocab_size, 2048)
    for _ in range(2):
        model.generate(prompt, max_new_tokens=1)  # capture, then replay
    ttft = []
    for _ in range(5):
        model.generate(prompt, max_new_tokens=1)
        ttft.append(model.last_stats["prefill_s"])
    mk_ms = sorted(ttft)[2] * 1e3
    del model
    torch.cuda.empty_cache()
    cfg = LlamaConfig(**CASES[key][1])
    bf16 = Llama(cfg, random_model(cfg), device="cuda", dtype=torch.bfloat16, max_batch_size=1, max_seq_len=4096)
    peer = TorchLlamaStep(bf16, 1)
    ids = torch.tensor(prompt, device="cuda")
    with torch.no_grad():
        compiled = torch.compile(peer.prefill)
        for _ in range(3):
            compiled(ids)
        peer_ms = event_time_us(lambda: compiled(ids), reps=10, warmup=2) / 1e3
    record("fp8", op="time_to_first_token", model=key, prompt=2048, mk_ms=mk_ms, peer_bf16_compile_ms=peer_ms,
           ratio=mk_ms / peer_ms)
