"""Timelines of a megakernel launch: Chrome-trace JSON and a PNG Gantt chart."""

from __future__ import annotations

from pathlib import Path


def to_chrome_trace(events: list[dict]) -> dict:
    """Chrome trace format ("X" complete events, one thread per worker; a task's wait for its
    inputs is its own "wait" event); opens in Perfetto."""
    out = []
    for e in events:
        ready = e.get("ready_us", e["start_us"])
        if ready > e["start_us"]:  # time spent waiting on the task's inputs
            out.append({"name": f"wait {e['name']}", "cat": "wait", "ph": "X", "ts": e["start_us"],
                        "dur": ready - e["start_us"], "pid": 0, "tid": e["worker"]})
        out.append({"name": e["name"], "cat": e["op"], "ph": "X", "ts": ready,
                    "dur": max(e["end_us"] - ready, 0.0), "pid": 0, "tid": e["worker"],
                    "args": {"sm": e.get("sm", 0)}})
    return {"traceEvents": out, "displayTimeUnit": "ns"}


def gantt_png(events: list[dict], path: str | Path, num_workers: int, title: str = "megakernel") -> None:
    """Workers (rows) over time (µs), one bar per task coloured by op, its wait for inputs in
    grey before it. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # optional dependency
        raise RuntimeError("the PNG Gantt chart needs matplotlib (pip install matplotlib)") from err
    ops = sorted({e["op"] for e in events})
    colours = {op: plt.cm.tab20(i % 20) for i, op in enumerate(ops)}
    fig, ax = plt.subplots(figsize=(14, max(3, num_workers * 0.06 + 2)))
    for e in events:
        ready = e.get("ready_us", e["start_us"])
        if ready > e["start_us"]:  # waiting on inputs: light grey
            ax.barh(e["worker"], ready - e["start_us"], left=e["start_us"], height=0.8, color="0.85", linewidth=0)
        ax.barh(e["worker"], max(e["end_us"] - ready, 1e-3), left=ready, height=0.8,
                color=colours[e["op"]], linewidth=0)
    ax.set_xlabel("µs")
    ax.set_ylabel("worker")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[o]) for o in ops], labels=ops,
              loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def op_spans(events: list[dict], labels: list[str]) -> dict[str, dict]:
    """Per label (``labels[task]``: the caller's name for each task of the program, e.g. the
    op of a step it lowers), in order of its first task: its tasks, their earliest start,
    earliest ready and latest end (µs), and the median body (ready to end) and wait (start to
    ready) of its tasks. What a label adds to a chain of ops is its last end less the previous
    label's."""
    by: dict[str, list[dict]] = {}
    for e in events:
        by.setdefault(labels[e["task"]], []).append(e)

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else 0.0

    out = {}
    for label in sorted(by, key=lambda k: min(e["task"] for e in by[k])):
        es = by[label]
        out[label] = {"tasks": len(es), "first_start_us": min(e["start_us"] for e in es),
                      "first_ready_us": min(e["ready_us"] for e in es), "last_end_us": max(e["end_us"] for e in es),
                      "body_us": median([e["end_us"] - e["ready_us"] for e in es]),
                      "wait_us": median([e["ready_us"] - e["start_us"] for e in es])}
    return out
