"""Where DRAM streams in a traced decode step: weight bytes per layer phase (CPU only).

Reads a plan probe's JSON (llama_plan_probe.py: the search plan it ran, the copy bandwidth
of its run) and the trace it saved; lowers that plan on the CPU (meta buffers) to learn each
task's weight bytes (the weight regions it reads); spreads each task's bytes evenly over
[start of its wait, its end] (weights never wait on other tasks: a ring's first chunks are in
flight while the task waits); and reports, per phase of the layers (a phase's window runs from
the previous phase's last task end to its own), the bytes streamed in the window, whose they
are, and the rate against the copy bandwidth.

An estimate: a ring streams its prologue early and the rest at its own pace, so the even
spread moves bytes between neighbouring windows; sums over a layer are exact.

    python bench/probes/trace_dram.py PROBE.json TRACE.json[.gz] [layers, default 2-13] [variant, default search]

e.g. with session 22's traced step (results/probes/llama_plan_probe-1b-s22-traced-*.json and
trace-llama-1b-b1-s22-*.json.gz).
"""
import gzip
import json
import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from _llama_shapes import SHAPES  # noqa: E402
from mk.models import LlamaConfig  # noqa: E402
from mk.planner.device import DeviceSpec  # noqa: E402
from mk.planner.graph import llama_decode_graph  # noqa: E402
from mk.planner.lower import WEIGHT, lower_decode_step, meta_buffers  # noqa: E402
from mk.planner.search import Plan  # noqa: E402

PHASES = ("qkv", "attention", "o_proj", "gate_up", "down")


def task_bytes(step) -> tuple[list[str], np.ndarray]:
    """Each task's op (the plan's node name) and the weight bytes it reads."""
    ops = [name for name, n in step.tasks_per_op.items() for _ in range(n)]
    nbytes = np.zeros(len(step.graph.tasks))
    for t in step.graph.tasks:
        for r in t.reads():
            if r.buffer.startswith(WEIGHT):
                nbytes[t.index] += r.size * step.graph.buffers[r.buffer].element_size()
    return ops, nbytes


def trace_times(path: str, n_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """(stream start, end) in us of every task: its wait's start (or its own), its end."""
    start, end = np.full(n_tasks, np.nan), np.full(n_tasks, np.nan)
    for e in json.load(gzip.open(path) if path.endswith(".gz") else open(path))["traceEvents"]:
        if e.get("ph") != "X":
            continue
        i = int(e["name"].rsplit("#", 1)[1])
        if i >= n_tasks:
            raise SystemExit(f"{path}: task {i} in the trace, the plan lowers to {n_tasks} tasks: "
                             "the trace comes from another lowering (another commit or plan)")
        if e["name"].startswith("wait "):
            start[i] = e["ts"] if np.isnan(start[i]) else min(start[i], e["ts"])
        else:
            end[i] = e["ts"] + e["dur"]
            start[i] = e["ts"] if np.isnan(start[i]) else min(start[i], e["ts"])
    return start, end


def main() -> None:
    probe, trace = sys.argv[1], sys.argv[2]
    lo, hi = map(int, (sys.argv[3] if len(sys.argv) > 3 else "2-13").split("-"))
    variant = sys.argv[4] if len(sys.argv) > 4 else "search"
    res = json.load(open(probe))
    plan_d = res["variants"][variant]["plan"]
    cfg = LlamaConfig(**SHAPES[res["shape"]])
    graph = llama_decode_graph(cfg.to_model_shape(f"llama-{res['shape']}"), res["batch"], plan_d["kv_len"])
    device = DeviceSpec.from_dict(res["device_spec"]) if "device_spec" in res else DeviceSpec.preset("h100")
    plan = Plan.from_json(json.dumps(plan_d), graph, device)
    step = lower_decode_step(plan, graph, meta_buffers(graph, plan_d["kv_len"]), eps=cfg.rms_norm_eps)
    ops, nbytes = task_bytes(step)
    start, end = trace_times(trace, len(ops))
    if np.isnan(end).any():
        raise SystemExit(f"{trace}: {int(np.isnan(end).sum())} tasks missing from the trace")
    rate = nbytes / np.maximum(end - start, 1e-3)  # bytes per us, spread evenly
    op_end = defaultdict(float)
    for i, op in enumerate(ops):
        op_end[op] = max(op_end[op], end[i])
    copy = res["copy_Bps"] / 1e6  # bytes per us
    rows = defaultdict(list)
    prev = None
    for op in op_end:  # program order
        if prev is not None and "." in op:
            layer, kind = op.split(".", 1)
            if kind in PHASES and lo <= int(layer[1:]) <= hi:
                a, b = op_end[prev], op_end[op]
                overlap = np.clip(np.minimum(end, b) - np.maximum(start, a), 0, None)
                streamed = rate * overlap
                own = sum(streamed[i] for i in range(len(ops)) if ops[i] == op)
                rows[kind].append((b - a, streamed.sum(), own, nbytes[[o == op for o in ops]].sum()))
        prev = op
    print(f"{trace}: layers {lo}-{hi}, medians; copy {copy / 1e6:.2f} TB/s")
    print(f"{'phase':<10} {'window us':>9} {'MB in it':>9} {'own MB':>7} {'op MB':>6} {'TB/s':>6} {'of copy':>7}")
    for kind in PHASES:
        w, s, own, tot = (np.median([r[j] for r in rows[kind]]) for j in range(4))
        print(f"{kind:<10} {w:9.2f} {s / 1e6:9.2f} {own / 1e6:7.2f} {tot / 1e6:6.2f} {s / w / 1e6:6.2f} "
              f"{s / w / copy:7.2f}")


if __name__ == "__main__":
    main()
