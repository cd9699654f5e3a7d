"""A plan of a decode step: one :class:`~mk.tasks.OpChoice` per op that is not fused, the
workers' queue schedule, what the model predicts and what was measured (:class:`Plan`);
made by :mod:`mk.planner.search`, lowered by :mod:`mk.planner.lower`, cached by
:mod:`mk.planner.cache`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mk.persistent.graph import SCHEDULES
from mk.tasks import OpChoice, op_kind

from .cost import estimate_step
from .device import DeviceSpec
from .graph import OpGraph


@dataclass
class Plan:
    """A complete plan: one choice per op that is not fused, the workers' queue schedule,
    what the model predicts, and (``measure`` mode, :func:`pick_measured`) the step time
    measured on the GPU.

    ``predicted_s`` is the simulated step under ``schedule``
    (:mod:`mk.planner.simulate`); ``schedule_s`` the simulated step under each schedule.
    """

    model: str
    batch: int
    kv_len: int
    device: str
    workers: int
    choices: dict[str, OpChoice]
    predicted_s: float
    peak_smem_bytes: int
    estimates: list = field(default_factory=list, repr=False)
    measured_s: float | None = None
    schedule: str = "round_robin"
    schedule_s: dict[str, float] = field(default_factory=dict)

    def __repr__(self) -> str:  # (the choices, one per op, are what explain() lists)
        return (f"Plan({self.model}, batch {self.batch}, KV {self.kv_len}, on {self.device}, {self.workers} workers: "
                f"{self.predicted_s * 1e3:.3f} ms predicted, {len(self.choices)} op choices; explain() lists them)")

    def explain(self) -> str:
        """One line per op: its tile, tasks, shared memory and predicted µs."""
        lines = [f"plan for {self.model}, batch {self.batch}, KV {self.kv_len}, on {self.device} "
                 f"({self.workers} workers): {self.predicted_s * 1e3:.3f} ms predicted"
                 + (f", {self.measured_s * 1e3:.3f} ms measured" if self.measured_s is not None else "")
                 + f", peak shared memory {self.peak_smem_bytes / 1024:.1f} KiB"]
        if self.schedule_s:
            lines.append(f"  queues: {self.schedule} (simulated: "
                         + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.schedule_s.items()) + ")")
        for e in self.estimates:
            c = self.choices[e.name]
            tile = op_kind(e.kind).describe(c)
            fused = f" + fused {', '.join(c.fuse)}" if c.fuse else ""
            lines.append(f"  {e.name:<20} {e.kind:<9} {tile:<48} {e.tasks:>6} tasks "
                         f"{e.smem_bytes / 1024:6.1f} KiB {e.seconds * 1e6:8.2f} us{fused}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "batch": self.batch, "kv_len": self.kv_len, "device": self.device,
                           "workers": self.workers, "predicted_s": self.predicted_s,
                           "measured_s": self.measured_s, "peak_smem_bytes": self.peak_smem_bytes,
                           "schedule": self.schedule, "schedule_s": self.schedule_s,
                           "choices": {k: v.to_dict() for k, v in self.choices.items()}}, indent=1)

    @classmethod
    def from_json(cls, text: str, graph: OpGraph | None = None, device: DeviceSpec | None = None) -> "Plan":
        """Read :meth:`to_json`'s output; with the graph and device, the per-op estimates too."""
        d = json.loads(text)
        choices = {k: OpChoice(**{**v, "fuse": tuple(v["fuse"])}) for k, v in d["choices"].items()}
        plan = cls(d["model"], d["batch"], d["kv_len"], d["device"], d["workers"], choices, d["predicted_s"],
                   d["peak_smem_bytes"], measured_s=d.get("measured_s"), schedule=d["schedule"],
                   schedule_s=d["schedule_s"])
        if plan.schedule not in SCHEDULES:
            raise ValueError(f"plan JSON: unknown schedule {plan.schedule!r}")
        if graph is not None and device is not None:
            plan.estimates = estimate_step(graph, choices, device, plan.workers).ops
        return plan
