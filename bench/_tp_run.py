"""One process of bench/test_tp.py's runs.

    torchrun --standalone --nproc-per-node N bench/_tp_run.py SPEC OUT   (tensor parallelism)
    python bench/_tp_run.py SPEC OUT                                     (one GPU)

SPEC is JSON: ``shape`` (a key of SHAPES or TP_SHAPES), ``batches``, ``new`` (tokens a
timed generation decodes after a ``prompt``-token prompt), ``peer_batches`` (the batches the
gpt-fast-style torch.compile peer is timed at), ``check`` (greedy tokens on a float32 cache
and exact prefill, and the bf16 model's prefill logits), ``link`` (calibrate the GPU link),
``ablate`` (time the step with the all-reduces in tiles of their own too), ``measure`` (time
the plan every rank's measurement picks, ``plan_mode="measure"``, where it is not the predicted one),
or instead ``first_token``: a checkpoint folder, from ``from_pretrained`` to the first token.
Every rank draws the same random model and keeps its share. Rank 0 writes the figures to
OUT (JSON) and the last prompt token's logits beside it (OUT + ".logits.pt"; with exact
prefill on the float32 cache, OUT + ".exact.pt").
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _llama_peer import TorchLlamaStep  # noqa: E402
from _llama_shapes import MAX_SEQ, SHAPES, TP_SHAPES, random_model  # noqa: E402
from mk.planner.search import own_all_reduces  # noqa: E402


_STARTED = time.perf_counter()


def _progress(what: str) -> None:
    """Rank 0 tells where the run is and when (seconds since the process began) on stderr:
    a run takes minutes (plans, compiles, the peer's torch.compile)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[_tp_run {time.perf_counter() - _STARTED:6.1f} s] {what}", file=sys.stderr, flush=True)


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(31 * b + 7 * t + 1) % vocab for t in range(length)] for b in range(batch)]


def _barrier(world: int) -> None:
    torch.cuda.synchronize()
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _first_token(spec: dict, world: int) -> dict:
    from mk.models import Llama

    _barrier(world)
    t0 = time.perf_counter()
    model = Llama.from_pretrained(spec["first_token"], tp=world, max_batch_size=1, max_seq_len=MAX_SEQ,
                                  progress=False)
    torch.cuda.synchronize()
    loaded = time.perf_counter()
    model.generate(_prompts(1, spec["prompt"], model.config.vocab_size), max_new_tokens=1)
    first = time.perf_counter()
    return {"from_pretrained_to_first_token_s": first - t0, "load_s": loaded - t0, **model.last_stats}


def _generate_figures(model, batch: int, spec: dict, world: int) -> dict:
    """tokens/s and time to first token through generate (median of 3), the step's own time
    launched back to back, and the memory a generation adds; with ``ablate`` under TP, the
    step's time with its all-reduces in tiles of their own; with ``measure``, the measured plan's."""
    prompt, new = spec["prompt"], spec["new"]
    prompts = _prompts(batch, prompt, model.config.vocab_size)
    model.generate(prompts, max_new_tokens=new)  # plan, compile, warm
    _progress(f"batch {batch}: planned, compiled, warm")
    _barrier(world)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    runs = []
    for _ in range(3):
        _barrier(world)
        model.generate(prompts, max_new_tokens=new)
        runs.append(dict(model.last_stats))
    extra = torch.cuda.max_memory_allocated() - before
    decode_s = sorted(r["decode_s"] for r in runs)[1]
    prefill_s = sorted(r["prefill_s"] for r in runs)[1]
    dec = model.last_decoder
    fp = model.footprint()
    shared = sum(t.numel() * t.element_size() for n, t in dec.shared.items() if n != "tp.peers")
    row = dict(tokens_per_s=batch * (new - 1) / decode_s, generate_ms_per_token=decode_s / (new - 1) * 1e3,
               time_to_first_token_ms=prefill_s * 1e3, kernel_ms_per_step=_kernel_ms(dec, batch, spec, world),
               extra_mib=extra / 2**20, symmetric_mib=shared / 2**20, weights_gib=fp["weights"] / 2**30,
               kv_cache_gib=fp["kv_cache"] / 2**30, workers=dec.kernel.program.num_workers,
               tasks=len(dec.step.graph.tasks))
    _progress(f"batch {batch}: generate and the step timed")
    plan = dec.step.plan
    if world > 1 and spec.get("ablate"):
        graph = model.plan(batch, plan.kv_len)[1]
        own = own_all_reduces(plan, graph, model.device_spec)
        if own is not None:  # (under the plan's own schedule: only where the sums run differs)
            own = replace(own, schedule=plan.schedule, predicted_s=own.schedule_s[plan.schedule])
    else:
        graph = own = None
    if own is not None:
        # The same step with the projections' all-reduces in tiles of their own, as the
        # planner could have had them: what summing in the projections' tiles gains.
        own_dec = model.steps.build_agreed(own, graph, batch, "argmax")
        row["kernel_ms_all_reduces_own_tiles"] = _kernel_ms(own_dec, batch, spec, world)
        del own_dec
        _progress(f"batch {batch}: the all-reduces in own tiles timed")
    if world > 1 and spec.get("measure"):
        # The plan every rank's timing of rank 0's candidates picks: what the cost model's
        # ranking leaves on the table.
        mode, model.plan_mode = model.plan_mode, "measure"
        try:
            measured, graph = model.plan(batch, plan.kv_len)
        finally:
            model.plan_mode = mode
        row["measured_plan_is_predicted"] = measured.choices == plan.choices and measured.schedule == plan.schedule
        if row["measured_plan_is_predicted"]:
            row["kernel_ms_measured_plan"] = row["kernel_ms_per_step"]
        else:
            measured_dec = model.steps.build_agreed(measured, graph, batch, "argmax")
            row["kernel_ms_measured_plan"] = _kernel_ms(measured_dec, batch, spec, world)
            del measured_dec
        _progress(f"batch {batch}: the measured plan timed")
    return row


def _kernel_ms(dec, batch: int, spec: dict, world: int) -> float:
    """ms of one step of ``dec`` launched back to back from the prompt's end (its kernel's own time)."""
    from mk.timing import event_time_us

    start = torch.full((batch,), spec["prompt"], dtype=torch.int32, device=dec.state["pos"].device)

    def steps():
        dec.state["pos"].copy_(start)
        for _ in range(spec["new"] - 1):
            dec.kernel.launch()

    _barrier(world)
    ms = event_time_us(steps, reps=3, warmup=1) / (spec["new"] - 1) / 1e3
    dec.kernel.check()
    return ms


def _peer_ms(model, batch: int) -> float:
    """ms of one decode step of the gpt-fast-style peer under torch.compile(mode="reduce-overhead")."""
    from mk.timing import event_time_us

    peer = TorchLlamaStep(model, batch)
    ids = torch.ones(batch, dtype=torch.long, device=model.device)
    pos = torch.tensor([100], dtype=torch.long, device=model.device)
    with torch.no_grad():
        compiled = torch.compile(peer.step, mode="reduce-overhead")
        for _ in range(3):
            compiled(ids, pos)
        ms = event_time_us(lambda: compiled(ids, pos), reps=30, warmup=3) / 1e3
    del peer
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return ms


def main(spec: dict, out: Path) -> None:
    from mk.models import Llama, LlamaConfig
    from mk.models.weights import tp_slices
    from mk.timing import copy_bandwidth

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        from mk.persistent.symmetric import join_ranks

        rank, _ = join_ranks("bench/_tp_run.py", world)
    device = torch.device("cuda", torch.cuda.current_device())
    result: dict = {"ranks": world, "device": torch.cuda.get_device_name(device)}
    if spec.get("first_token"):
        result.update(_first_token(spec, world))
    else:
        result.update(copy_bandwidth())
        if spec.get("link") and world > 1:
            from mk.planner.calibrate import measure_link

            result.update(measure_link())
            _progress("link calibrated")
        cfg = LlamaConfig(**{**SHAPES, **TP_SHAPES}[spec["shape"]])
        weights = random_model(cfg, seed=0, shard=tp_slices(cfg, world, rank) if world > 1 else None)
        kw = dict(tp=world, rank=rank, device=device, dtype=torch.bfloat16, max_seq_len=MAX_SEQ)
        if spec.get("check"):
            # Greedy tokens on a float32 cache with exact prefill: what TP must reproduce.
            exact = Llama(cfg, weights, max_batch_size=1, kv_dtype=torch.float32, prefill_precision="exact", **kw)
            out_ids = exact.generate(_prompts(1, spec["prompt"], cfg.vocab_size), max_new_tokens=32)
            result["check_tokens"] = out_ids[0][spec["prompt"]:]
            exact_logits = exact.logits(_prompts(1, spec["prompt"], cfg.vocab_size))[0, -1].float().cpu()
            if rank == 0:
                torch.save(exact_logits, str(out) + ".exact.pt")
            del exact
            torch.cuda.empty_cache()
            _progress("numerics reference (float32 cache, exact prefill) done")
        model = Llama(cfg, weights, max_batch_size=max(spec["batches"]), name=f"llama-{spec['shape']}", **kw)
        del weights
        _progress("model built")
        if spec.get("check"):
            logits = model.logits(_prompts(1, spec["prompt"], cfg.vocab_size))[0, -1].float().cpu()
            if rank == 0:
                torch.save(logits, str(out) + ".logits.pt")
        result["floor_ms"] = model.shape.weight_bytes / result["copy_Bps"] * 1e3
        result["weight_gib_per_gpu"] = model.shape.weight_bytes / 2**30
        result["batches"] = {}
        for batch in spec["batches"]:
            row = _generate_figures(model, batch, spec, world)
            if batch in spec.get("peer_batches", ()):
                row["torch_compile_ms"] = _peer_ms(model, batch)
                _progress(f"batch {batch}: the torch.compile peer timed")
            result["batches"][str(batch)] = row
            if rank == 0:
                print(f"mk tp{world} {spec['shape']} b{batch}: {json.dumps(row)}", flush=True)
    if rank == 0:
        out.write_text(json.dumps(result, indent=1) + "\n")
    _barrier(world)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
