"""How a traced 1B batch-1 decode step's phases end: tails, what drives them, which SMs (CPU only).

For each weight-streaming phase of the layers (QKV, O projection, gate_up, down; tasks
grouped by consecutive task index and op, the linear runs cut into their three ops): how far
the last task ends after the mean task (the phase's tail: the next phase waits for the last),
and how the end correlates with the task's ready time (its first weight chunk and inputs
arrived) and with its time after that. With an ``sm_rate_probe.py`` JSON, tasks on the SMs
that stream fastest (lateness < -1 us there) are reported apart.

    python bench/probes/trace_tails.py TRACE.json[.gz] [SM_RATE.json] [first_layer last_layer]

e.g. results/probes/trace-llama-1b-b1-s28-h100-*.json.gz with sm_rate_probe-2m-h100-*.json
(both from session 28's H100; SM numbering is the GPU's, so pair files of one machine).
"""
import gzip
import json
import math
import statistics as st
import sys
from collections import defaultdict


def _corr(a, b):
    ma, mb = st.mean(a), st.mean(b)
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / den if den else 0.0


def phases(trace: dict) -> list[tuple[str, list[dict]]]:
    """The step's phases in task order: (name, task events with their ready time)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    waits = {e["name"].split(" ", 1)[1]: e for e in events if e["cat"] == "wait"}
    tasks = sorted((e for e in events if e["cat"] != "wait"), key=lambda e: int(e["name"].split("#")[1]))
    runs = []
    for e in tasks:
        index = int(e["name"].split("#")[1])
        w = waits.get(e["name"])
        e = dict(e, ready=w["ts"] + w["dur"] if w else e["ts"], end=e["ts"] + e["dur"],
                 sm=e.get("args", {}).get("sm", -1))
        if runs and runs[-1][0] == e["cat"] and runs[-1][1] == index - 1:
            runs[-1][1] = index
            runs[-1][2].append(e)
        else:
            runs.append([e["cat"], index, [e]])
    out = []
    for op, _, es in runs:
        if op == "linear" and len(es) % 3 == 0 and len(es) < 2000:  # o_proj, gate_up, down of a layer
            third = len(es) // 3
            out += [(name, es[i * third:(i + 1) * third]) for i, name in enumerate(("o_proj", "gate_up", "down"))]
        else:
            out.append(({"qkv_rope_kv": "qkv"}.get(op, op), es))
    return out


def main():
    path = sys.argv[1]
    trace = json.load(gzip.open(path) if path.endswith(".gz") else open(path))
    fast = set()
    rest = sys.argv[2:]
    if rest and rest[0].endswith(".json"):
        rates = json.load(open(rest.pop(0)))
        fast = {int(sm) for sm, late in rates["late_by_sm_id"].items() if late < -1.0}
    first, last = (int(rest[0]), int(rest[1])) if len(rest) >= 2 else (2, 13)
    layers = [p for p in phases(trace) if p[0] in ("qkv", "decode_attention", "o_proj", "gate_up", "down")]
    per_layer = 5
    stats = defaultdict(lambda: defaultdict(list))
    for layer in range(first, last + 1):
        for name, es in layers[layer * per_layer:(layer + 1) * per_layer]:
            if name == "decode_attention":
                continue
            ends = [e["end"] for e in es]
            mean_end = st.mean(ends)
            s = stats[name]
            s["tail"].append(max(ends) - mean_end)
            s["corr_ready"].append(_corr([e["ready"] for e in es], ends))
            s["corr_after"].append(_corr([e["end"] - e["ready"] for e in es], ends))
            s["ready_sd"].append(st.pstdev(e["ready"] for e in es))
            for e in es:
                s["late_fast" if e["sm"] in fast else "late_other"].append(e["end"] - mean_end)
    print(f"{path}: layers {first}-{last}, means; us")
    print(f"{'phase':8s} {'tail':>6s} {'corr(ready,end)':>16s} {'corr(after,end)':>16s} {'sd(ready)':>10s}"
          + (f" {'fast SMs late':>14s} {'others late':>12s}" if fast else ""))
    for name, s in stats.items():
        row = (f"{name:8s} {st.mean(s['tail']):6.2f} {st.mean(s['corr_ready']):16.2f} {st.mean(s['corr_after']):16.2f}"
               f" {st.mean(s['ready_sd']):10.2f}")
        if fast:
            row += f" {st.mean(s['late_fast']):14.2f} {st.mean(s['late_other']):12.2f}"
        print(row)


if __name__ == "__main__":
    main()
