"""Trace export from synthetic task timings (the GPU fills them from its global timer)."""

import pytest

from mk.persistent.trace import gantt_png, to_chrome_trace

EVENTS = [
    {"worker": 0, "task": 0, "name": "linear#0", "op": "linear", "start_us": 0.0, "ready_us": 0.0, "end_us": 3.0},
    {"worker": 1, "task": 1, "name": "linear#1", "op": "linear", "start_us": 0.5, "ready_us": 0.5, "end_us": 2.5},
    {"worker": 0, "task": 2, "name": "rmsnorm#2", "op": "rmsnorm", "start_us": 3.1, "ready_us": 3.4, "end_us": 4.0,
     "sm": 7},
]


def test_chrome_trace_has_one_event_per_task_and_one_per_wait():
    trace = to_chrome_trace(EVENTS)["traceEvents"]
    tasks = [t for t in trace if t["cat"] != "wait"]
    waits = [t for t in trace if t["cat"] == "wait"]
    assert [t["name"] for t in tasks] == ["linear#0", "linear#1", "rmsnorm#2"]
    assert [(t["ts"], t["dur"]) for t in tasks] == [(0.0, 3.0), (0.5, 2.0), (3.4, pytest.approx(0.6))]
    assert len(waits) == 1 and waits[0]["tid"] == 0 and waits[0]["dur"] == pytest.approx(0.3)
    assert [t["args"]["sm"] for t in tasks] == [0, 0, 7]


def test_gantt_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    gantt_png(EVENTS, tmp_path / "g.png", num_workers=2)
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
