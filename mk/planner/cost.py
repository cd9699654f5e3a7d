"""The cost model: predicted time of each op of a decode step under a tiling choice.

For one op and its :class:`OpChoice` the model counts the tasks the choice makes and the
bytes and flops they move (the tasks' own cost hooks, split-K workspace included). An op
is one or more dependency phases (a split-K linear: partials, then reduces); each costs

    wait + sum over waves of (task overhead + task bytes / min(worker rate, bandwidth / busy workers))

where the waves are the tasks the busiest worker runs one after another, ``busy`` how many
workers have a task in that wave (a last, partial wave shares DRAM among fewer: see
:func:`wave_groups`), and the worker rate what one worker streams when DRAM is not the
limit (a few wide tiles cannot pull the whole bandwidth). A decode step at batch 1 is a chain
(every op needs its predecessor's whole output), so the step is the launch plus the sum
over ops. The constants (bandwidths, overheads) are the
:class:`~mk.planner.device.DeviceSpec`'s, measured by ``python -m mk calibrate``;
presets carry placeholders.

Fused ops (an RMSNorm folded into the next linear's prologue, SiLU·mul or a residual add
into a linear's epilogue) cost no task and no hop of their own; the host op reads what the
fused op read from outside and no longer reads the intermediate tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# (OpChoice is the choices' one type: each op kind's candidates are made of it.)
from mk.tasks import OpChoice, op_kind

from .device import DeviceSpec
from .graph import OpGraph, OpNode


@dataclass(frozen=True)
class OpEstimate:
    """Predicted cost of one op (fused ops appear only inside their host)."""

    name: str
    kind: str
    tasks: int
    bytes: int
    flops: int
    smem_bytes: int
    memory_s: float
    compute_s: float
    overhead_s: float
    seconds: float


@dataclass
class StepEstimate:
    """Predicted decode step: per-op estimates in program order; the step is the launch plus their sum."""

    ops: list[OpEstimate] = field(default_factory=list)
    launch_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.launch_s + sum(o.seconds for o in self.ops)

    @property
    def tasks(self) -> int:
        return sum(o.tasks for o in self.ops)

    @property
    def peak_smem_bytes(self) -> int:
        return max((o.smem_bytes for o in self.ops), default=0)


def op_tasks(node: OpNode, choice: OpChoice) -> int:
    """Tasks the choice cuts the op into (split-K reduce tasks included)."""
    return sum(tasks for tasks, _ in op_phases(node, choice))


def op_bytes_flops(node: OpNode, choice: OpChoice) -> tuple[int, int]:
    """Bytes and flops of the op under the choice (workspace traffic included: the op's kind's)."""
    return op_kind(node.kind).bytes_flops(node, choice)


def op_smem_bytes(node: OpNode, choice: OpChoice, dtype_bytes: int = 2) -> int:
    """Shared memory one task of the op takes in the megakernel, by its kind's model. The
    megakernel's shared memory is the most any task takes (the task bodies are branches of
    one program and share the allocation)."""
    return op_kind(node.kind).smem_bytes(node, choice, dtype_bytes)


def op_phases(node: OpNode, choice: OpChoice, nbytes: int = 0, fused: list[OpNode] = ()) -> list[tuple[int, int]]:
    """The op's dependency phases as (tasks, bytes of ``nbytes``), by its kind: tasks of one
    phase run in parallel and the next phase waits for them; ``fused`` ops folded into it may
    add phases after its own (an argmax folded into the LM head leaves the token append)."""
    return op_kind(node.kind).phases(node, choice, nbytes, list(fused))


@dataclass(frozen=True)
class PhaseCost:
    """One dependency phase of an op: ``tasks`` tasks of ``task_s`` seconds each (overhead
    included), which start after one wait of ``wait_s`` once their inputs are ready.
    ``early_s`` of a task's time does not need its inputs: a worker that reaches the task
    before they are ready does that part while it waits (the TMA ring's prologue, issued
    before the dependency wait: :func:`prologue_seconds`)."""

    tasks: int
    task_s: float
    wait_s: float
    early_s: float = 0.0

    def seconds(self, workers: int) -> float:
        """The phase alone on ``workers`` workers: one wait, in which the first tasks do their
        early part, then its busiest worker's tasks."""
        return self.wait_s + math.ceil(self.tasks / workers) * self.task_s - min(self.early_s, self.wait_s)


def idle_wait_ops(graph) -> set[str]:
    """Ops that read the output of an op streaming no weights (decode attention: its kind's
    ``leaves_dram_idle``): their tasks wait on a latency-bound chain while DRAM idles, so what
    they ask for before their wait arrives during it (the kind's ``prologue_seconds``). After a
    weight-streaming op the wait overlaps that op's tail, which still has DRAM busy: a 56 KiB
    QKV prologue after the down projection measured no faster than 24 KiB (1B, H100)."""
    producers = graph.producers()
    idle = {n.name for n in graph.nodes if op_kind(n.kind).leaves_dram_idle}
    return {n.name for n in graph.nodes if any(producers.get(t, "") in idle for t in n.inputs)}


def _op_traffic(node: OpNode, choice: OpChoice, fused: list[OpNode]) -> tuple[int, int]:
    """Bytes and flops of ``node`` with ``fused`` folded into it: what each fused op changes
    in the host's traffic is its kind's (``fused_bytes``: an RMSNorm prologue adds its weight,
    SiLU·mul takes the I-wide gate/up write off, an all-reduce adds what it moves, ...)."""
    nbytes, flops = op_bytes_flops(node, choice)
    for f in fused:
        nbytes += op_kind(f.kind).fused_bytes(f)
        flops += f.flops
    return max(nbytes, 0), flops


def wave_groups(tasks: int, workers: int) -> tuple[tuple[int, int], ...]:
    """The waves of a phase of ``tasks`` dealt over ``workers``, as (waves, busy workers in
    each): the full waves, then a last one of the remaining tasks. The last wave shares DRAM
    among fewer workers, so each of its tasks streams faster: the 8B gate/up over two H200s
    as 448 tiles of 32 rows (one full wave of 264, then 184) ran a step 2.6% faster than as
    256 runs of split-K partials and a reduce, which pricing every wave as full had ranked
    1.7% slower."""
    if tasks <= 0:
        return ()
    full, rest = divmod(tasks, workers)
    return tuple(g for g in ((full, workers), (1, rest)) if g[0] and g[1])


def phase_costs(node: OpNode, choice: OpChoice, device: DeviceSpec, workers: int,
                fused: list[OpNode] = (), dtype_bytes: int = 2, idle_wait: bool = False) -> list[PhaseCost]:
    """The op's phases (:func:`op_phases`) with the time of one task of each.

    A task streams its share of the phase's bytes at the lesser of what one worker streams
    alone (:meth:`DeviceSpec.worker_rate`, what it re-reads included), an even share of DRAM
    among the workers busy in its wave (:func:`wave_groups`), and what the op's kind says
    limits it (a TMA ring's rate, a tile's tensor-core rate, a link to other GPUs: the
    kind's ``phase_terms`` and ``stream_floor``), plus the task overhead; where the op's
    flops outweigh its bytes (prefill-sized M) the streaming part stretches to the compute
    time. ``idle_wait`` (the op is in :func:`idle_wait_ops`): the kind's prologue counts as
    the tasks' early part. A fused op that runs after its host's stream (an all-reduce the
    tiles run themselves) adds its time to the last phase's tasks.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    kind = op_kind(node.kind)
    nbytes, flops = _op_traffic(node, choice, fused)
    tails = [f for f in fused if op_kind(f.kind).tail_bytes(f)]
    phases = op_phases(node, choice, nbytes - sum(op_kind(f.kind).tail_bytes(f) for f in tails), fused)
    streams = []
    for i, (phase_tasks, phase_bytes) in enumerate(phases):
        waves, busy = math.ceil(phase_tasks / workers), min(phase_tasks, workers)
        terms = kind.phase_terms(node, choice, device, i, phase_tasks, phase_bytes, dtype_bytes)
        rate = device.worker_rate(tma=terms.tma)
        task_bytes = max(phase_bytes, 0) / phase_tasks if terms.task_bytes is None else terms.task_bytes
        reread, ring_s = terms.reread, terms.ring_s
        # A task's stream, averaged over the busiest worker's waves (the last may be partial).
        stream = sum(n * max(task_bytes / (device.dram_bandwidth / b), (task_bytes + reread) / rate,
                             task_bytes * ring_s)
                     for n, b in wave_groups(phase_tasks, workers)) / waves
        stream = kind.stream_floor(node, choice, device, i, stream, task_bytes, phase_tasks, busy)
        early = kind.prologue_seconds(node, choice, device, stream, dtype_bytes) if i == 0 and idle_wait else 0.0
        if i == 0:
            stream += kind.exposed_seconds(node, choice, device, task_bytes, dtype_bytes)
        for f in tails if i == len(phases) - 1 else ():
            for seconds in op_kind(f.kind).tail_seconds(f, phase_tasks, busy, device):
                stream += seconds
        streams.append((phase_tasks, waves, stream, early))
    memory_s = sum(waves * s for _, waves, s, _ in streams)
    stretch = max(1.0, flops / device.bf16_flops / memory_s) if memory_s > 0 else 1.0
    return [PhaseCost(tasks, device.task_overhead_s + s * stretch, device.wait_overhead_s, early)
            for tasks, _, s, early in streams]


def estimate_op(node: OpNode, choice: OpChoice, device: DeviceSpec, workers: int,
                fused: list[OpNode] = (), dtype_bytes: int = 2, idle_wait: bool = False) -> OpEstimate:
    """Predicted time of ``node`` (with ``fused`` folded into it) on ``workers`` workers.

    Each phase (:func:`phase_costs`) costs one dependency wait plus, on its busiest worker,
    ``waves`` tasks; the op is the sum of its phases. ``idle_wait``: as :func:`phase_costs`.
    """
    nbytes, flops = _op_traffic(node, choice, fused)
    phases = phase_costs(node, choice, device, workers, fused, dtype_bytes, idle_wait)
    overhead_s = sum(p.wait_s + math.ceil(p.tasks / workers) * device.task_overhead_s for p in phases)
    seconds = sum(p.seconds(workers) for p in phases)
    return OpEstimate(node.name, node.kind, sum(p.tasks for p in phases), nbytes, flops,
                      op_smem_bytes(node, choice, dtype_bytes), seconds - overhead_s, flops / device.bf16_flops,
                      overhead_s, seconds)


def estimate_step(graph: OpGraph, plan: dict[str, OpChoice], device: DeviceSpec, workers: int) -> StepEstimate:
    """Predicted decode step of ``graph`` under ``plan`` (op name -> choice; ops fused into
    another op's choice are skipped). Raises if an op has no choice or is fused twice."""
    fused_into: dict[str, str] = {}
    for host, choice in plan.items():
        for name in choice.fuse:
            if name in fused_into:
                raise ValueError(f"op {name} fused into both {fused_into[name]} and {host}")
            fused_into[name] = host
    nodes = {n.name: n for n in graph.nodes}
    step = StepEstimate(launch_s=device.launch_overhead_s)
    idle = idle_wait_ops(graph)
    for node in graph.nodes:
        if node.name in fused_into:
            continue
        if node.name not in plan:
            raise ValueError(f"op {node.name} ({node.kind}) has no choice in the plan")
        choice = plan[node.name]
        step.ops.append(estimate_op(node, choice, device, workers, [nodes[f] for f in choice.fuse],
                                    graph.dtype_bytes, node.name in idle))
    return step


def naive_plan(graph: OpGraph) -> dict[str, OpChoice]:
    """A fixed, unfused configuration, each op's kind's ``naive_choice`` (every linear 16 x
    256-column tiles, no split-K, no KV split). The baseline the search must beat."""
    return {node.name: op_kind(node.kind).naive_choice(node) for node in graph.nodes}
