"""Where a decode step's time goes, op by op: one traced step per shape, batch 1 and 8.

Random bf16 weights at the deep-narrow (135M, Qwen2.5-0.5B), 1B, 8B and Qwen3-8B shapes. Each case first
runs ``generate`` as users call it (a 64-token prompt, 256 new tokens: tokens/s, time to first
token, memory beyond weights + KV cache), then launches the same step with every task's start,
ready (its inputs waited for) and end times recorded (``Megakernel(trace=True)``), its
sequences at position 192 (the prompt and 128 tokens). Per op of a layer, the median over the
middle layers of:

* ``adds_us``: its last task's end less the previous op's (what it adds to the layer's chain);
* ``ready_after_prev_us``: its first task's ready time less the previous op's last end (the
  hop, when positive; negative where its tasks start on inputs that came before);
* ``body_us`` / ``wait_us``: the median task's run after its inputs, and its wait for them;
* ``bytes_us``: the op's bytes at the copy bandwidth of this run (its floor).

Tracing adds a few global stores a task: the traced step's time is recorded beside the
untraced one.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from _harness import PROMPT, NEW, measure_generate
from _llama_shapes import MAX_SEQ, QWEN3_8B, QWEN25_05B, SHAPES, random_model

#: (family, config) of each traced shape.
CASES = {"135m": ("llama", SHAPES["135m"]), "qwen2.5-0.5b": ("qwen2", QWEN25_05B), "1b": ("llama", SHAPES["1b"]),
         "8b": ("llama", SHAPES["8b"]), "qwen3-8b": ("qwen3", QWEN3_8B)}


@pytest.fixture(scope="module", params=list(CASES))
def model(request):
    from mk.models.auto import FAMILIES

    family, shape = CASES[request.param]
    cls = FAMILIES[family]
    cfg = cls.config_class(**shape)
    m = cls(cfg, random_model(cfg), device="cuda", dtype=torch.bfloat16, max_batch_size=8, max_seq_len=MAX_SEQ,
            name=request.param)
    yield request.param, m
    del m
    torch.cuda.empty_cache()


def task_labels(step) -> list[str]:
    """The op (the planner's node name, e.g. ``l3.qkv``) of every task of a lowered step."""
    labels = [name for name, n in step.phases for _ in range(n)]
    assert len(labels) == len(step.graph.tasks), "a step's phases count every task once"
    return labels


def layer_table(spans: dict[str, dict], graph, copy_Bps: float) -> list[dict]:
    """Per op of a layer (in the step's order), medians over the middle layers (the first
    and last two are left out: the embedding and the LM head border them)."""
    order = list(spans)
    layers = sorted({int(k[1:].split(".")[0]) for k in order if k.startswith("l") and "." in k})
    middle = layers[2:-2] or layers
    nodes = {n.name: n for n in graph.nodes}
    rows: dict[str, dict[str, list]] = {}
    for L in middle:
        for i, name in enumerate(order):
            if not name.startswith(f"l{L}."):
                continue
            prev = spans[order[i - 1]]
            s = spans[name]
            r = rows.setdefault(name.split(".", 1)[1], {"adds_us": [], "ready_after_prev_us": [], "body_us": [],
                                                        "wait_us": [], "tasks": []})
            r["adds_us"].append(s["last_end_us"] - prev["last_end_us"])
            r["ready_after_prev_us"].append(s["first_ready_us"] - prev["last_end_us"])
            r["body_us"].append(s["body_us"])
            r["wait_us"].append(s["wait_us"])
            r["tasks"].append(s["tasks"])
    out = []
    for op, r in rows.items():
        node = nodes.get(f"l{middle[0]}.{op}")
        row = {"op": op, **{k: statistics.median(v) for k, v in r.items()}}
        row["bytes_us"] = node.bytes / copy_Bps * 1e6 if node is not None else 0.0
        out.append(row)
    return out


@pytest.mark.parametrize("batch", [1, 8])
def test_trace(benchmark, record, gpu_env, model, batch):
    from mk.persistent.runtime import Megakernel
    from mk.persistent.trace import op_spans
    from mk.timing import event_time_us

    key, m = model
    row = dict(model=key, **measure_generate(benchmark, m, batch, gpu_env["copy_Bps"]))
    dec = m.last_decoder
    traced = Megakernel(dec.kernel.program, trace=True)
    start = torch.full((batch,), PROMPT, dtype=torch.int32, device="cuda")

    def steps(kernel):
        def run():
            dec.state["pos"].copy_(start)
            for _ in range(NEW - 1):
                kernel.launch()
        return run

    row["traced_ms_per_step"] = event_time_us(steps(traced), reps=3, warmup=1) / (NEW - 1) / 1e3
    dec.state["pos"].copy_(start + 128)
    traced.launch()
    torch.cuda.synchronize()
    traced.check()
    events = traced.trace_events()
    spans = op_spans(events, task_labels(dec.step))
    plan, graph = m.plan(batch, MAX_SEQ)
    table = layer_table(spans, graph, gpu_env["copy_Bps"])
    layer_us = sum(r["adds_us"] for r in table)
    row.update(layer_us=layer_us, layer_bytes_us=sum(r["bytes_us"] for r in table),
               traced_step_us=max(e["end_us"] for e in events), ops=table)
    print(f"\n{key} batch {batch}: generate {row['generate_ms_per_token']:.3f} ms/token, kernel "
          f"{row['kernel_ms_per_step']:.3f}, traced {row['traced_ms_per_step']:.3f}; a layer {layer_us:.1f} us "
          f"(bytes {row['layer_bytes_us']:.1f})")
    for r in table:
        print(f"  {r['op']:<14} adds {r['adds_us']:6.1f}  ready after prev {r['ready_after_prev_us']:6.1f}  "
              f"body {r['body_us']:5.1f}  wait {r['wait_us']:5.1f}  bytes {r['bytes_us']:5.1f}  tasks {r['tasks']}")
    record("trace", **row)
