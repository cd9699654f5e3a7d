"""Lowered decode steps kept in host memory (:class:`StepCache`): a step asked for again (a
request back at a length bucket or batch size seen before) is bound to new tensors, not
lowered, its dependencies derived and its queues dealt again."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Mapping

import torch

from mk.persistent.graph import Program, TaskGraph, collector_paused, lower

from .device import DeviceSpec
from .graph import OpGraph
from .lower import SAMPLING_BUFFERS, STATE_BUFFERS, DecodeStep, lower_decode_step, weight_names
from .plan import Plan
from .simulate import step_queues


@dataclass
class LoweredStep:
    """A decode step lowered once, over ``meta`` tensors: its task graph (dependencies and
    events derived), its queues and its :class:`~mk.persistent.graph.Program` (descriptors
    name buffer slots, not addresses). :meth:`bind` gives the same step over real tensors,
    lowering nothing again."""

    step: DecodeStep
    program: Program

    def bind(self, buffers: Mapping[str, torch.Tensor], device) -> tuple[DecodeStep, Program]:
        """The step and program over the caller's ``buffers`` (by name, the shapes and
        dtypes it was lowered for) and fresh zeroed activations on ``device``, shared where
        the lowering shared them (:func:`_layer_shared`)."""
        meta = self.step.graph
        g = TaskGraph()
        fresh: dict[int, torch.Tensor] = {}  # id of a meta activation -> its tensor on the device
        for name, t in meta.buffers.items():
            if name in buffers:
                real = buffers[name]
                if tuple(real.shape) != tuple(t.shape) or real.dtype != t.dtype:
                    raise ValueError(f"LoweredStep.bind: buffer {name} is {tuple(real.shape)} {real.dtype}, lowered "
                                     f"for {tuple(t.shape)} {t.dtype}")
            else:
                real = fresh.get(id(t))
                if real is None:
                    real = fresh[id(t)] = torch.zeros(t.shape, dtype=t.dtype, device=device)
            g.buffer(name, real)
        g.tasks = meta.tasks
        g._deps, g._events = meta._deps, meta._events
        return replace(self.step, graph=g), replace(self.program, graph=g)


class StepCache:
    """Lowered steps (:class:`LoweredStep`) by what decides them: the plan (its choices and
    schedule), the batch, the planned length, the cache length, the next-token rule, the
    workers and the buffers' shapes and dtypes; the ``size`` used last are kept. A step
    asked for again (a request back at a length bucket or batch size seen before) is bound
    to new tensors, not lowered again."""

    def __init__(self, size: int = 16):
        self.size = size
        self._steps: OrderedDict = OrderedDict()

    def get(self, plan: Plan, graph: OpGraph, buffers: Mapping[str, torch.Tensor], *, eps: float,
            next_token: str, device: DeviceSpec, workers: int, rank: int = 0) -> LoweredStep:
        """The step of ``plan`` lowered over ``buffers``' shapes for ``workers`` workers
        (queues as :func:`step_queues` deals them), as rank ``rank`` of a tensor-parallel
        step runs it: from the cache, or lowered now."""
        bound = {*weight_names(graph), *STATE_BUFFERS, *SAMPLING_BUFFERS}
        need = [n for n in buffers if n in bound]
        shapes = tuple(sorted((n, tuple(buffers[n].shape), str(buffers[n].dtype)) for n in need))
        key = (plan.to_json(), graph.to_json(indent=None), shapes, eps, next_token, workers,
               device.to_json(), rank)
        hit = self._steps.get(key)
        if hit is not None:
            self._steps.move_to_end(key)
            return hit
        meta = {n: torch.empty(buffers[n].shape, dtype=buffers[n].dtype, device="meta") for n in need}
        with collector_paused():
            step = lower_decode_step(plan, graph, meta, eps=eps, next_token=next_token, rank=rank)
            program = lower(step.graph, num_workers=workers, queues=step_queues(step, graph, device, workers))
        self._steps[key] = lowered = LoweredStep(step, program)
        while len(self._steps) > self.size:
            self._steps.popitem(last=False)
        return lowered
