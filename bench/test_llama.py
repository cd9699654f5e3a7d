"""Llama decode and prefill on the GPU: mk's megakernel against its torch peers, same run.

Random bf16 weights at the Llama-3.2-1B and Llama-3-8B shapes. Per (shape, batch): one
decode step of mk (one megakernel launch, replayed from a CUDA graph for pytest-benchmark,
event-timed for the record) against the same model in bf16 PyTorch replayed from a CUDA
graph (eager) and under torch.compile(mode="reduce-overhead"). Prefill: bench/test_prefill.py.
The floor is the weight bytes over the copy bandwidth measured in this run.
"""

from __future__ import annotations

import pytest
import torch

from _harness import bench_graph
from _llama_peer import TorchLlamaStep
from _llama_shapes import MAX_SEQ



def _event_ms(fn, reps=30, warmup=3) -> float:
    from mk.timing import event_time_us

    return event_time_us(fn, reps=reps, warmup=warmup) / 1e3


@pytest.mark.parametrize("batch", [8, 1])
def test_generation_memory(record, llama, batch):
    """GPU memory a generation adds to the weights and the KV cache (first in the module:
    nothing but the model is allocated yet): long prompts, then decode steps. At most the
    stated prefill workspace and 64 MiB (the decode step's activations and state)."""
    key, model = llama
    prompts = [[(7 * b + 13 * t) % model.config.vocab_size for t in range(MAX_SEQ - 100 - b)] for b in range(batch)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model.generate(prompts, max_new_tokens=16)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    fp = model.footprint()
    record("llama", op="generation_memory", model=key, batch=batch, prompt_tokens=len(prompts[0]), new_tokens=16,
           extra_mib=extra / 2**20, weights_gib=fp["weights"] / 2**30, kv_cache_gib=fp["kv_cache"] / 2**30,
           others_before_mib=(before - fp["weights"] - fp["kv_cache"]) / 2**20,
           prefill_workspace_mib=fp["prefill_workspace"] / 2**20, prefill_chunk=model.prefill_budget.chunk_tokens)
    assert extra <= fp["prefill_workspace"] + 64 * 2**20, \
        f"generation added {extra / 2**20:.1f} MiB to the weights, cache and stated prefill workspace"


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_step(benchmark, record, gpu_env, llama, batch):
    key, model = llama
    prompts = [[(128000 + b) % model.config.vocab_size, 791, 6864, 315] for b in range(batch)]
    list(model.stream(prompts, max_new_tokens=2))  # prefill, compile, two steps
    dec = model.last_decoder
    mk_ms = bench_graph(benchmark, [dec.kernel.launch]) / 1e3
    dec.kernel.check()
    peer = TorchLlamaStep(model, batch)
    ids = torch.ones(batch, dtype=torch.long, device="cuda")
    pos = torch.tensor([10], dtype=torch.long, device="cuda")
    with torch.no_grad():
        from mk.timing import capture_graph

        eager = capture_graph([lambda: peer.step(ids, pos)])
        eager_ms = _event_ms(eager.replay)
        compiled = torch.compile(peer.step, mode="reduce-overhead")
        for _ in range(3):
            compiled(ids, pos)
        compile_ms = _event_ms(lambda: compiled(ids, pos))
    floor_ms = model.shape.weight_bytes / gpu_env["copy_Bps"] * 1e3
    record("llama", op="decode_step", model=key, batch=batch, mk_ms=mk_ms, torch_graph_ms=eager_ms,
           torch_compile_ms=compile_ms, floor_ms=floor_ms, vs_compile=compile_ms / mk_ms,
           of_floor=floor_ms / mk_ms, workers=dec.kernel.program.num_workers, tasks=len(dec.step.graph.tasks),
           predicted_ms=dec.step.plan.predicted_s * 1e3)
