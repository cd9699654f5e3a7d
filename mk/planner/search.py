"""Beam search over each op's tiling and fusion choices, in DAG order.

A state is a partial plan over the ops seen so far. For each op the search tries every
candidate :class:`~mk.tasks.OpChoice` its kind offers that fits the shared-memory budget,
and the fusions its kind allows (:class:`mk.tasks.OpKind`: an RMSNorm into the next
linear's prologue, SiLU·mul into the gate/up linear's epilogue, a residual add into the
O-proj or down linear's epilogue, ...); it
keeps the ``beam_width`` cheapest partial plans by predicted time (peak shared memory
breaks ties, then the choices themselves, so the result is deterministic). The search
returns its ``top_k`` complete plans, cheapest first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from mk.persistent.graph import collector_paused
from mk.tasks import OpChoice, op_kind

from .cost import estimate_op, estimate_step, idle_wait_ops
from .device import DeviceSpec
from .graph import OpGraph, OpNode
from .plan import Plan
from .simulate import SCHEDULES, simulate_schedules

#: Persistent workers per SM when the caller does not fix the count.
WORKERS_PER_SM = 2


def candidates(node: OpNode, device: DeviceSpec, dtype_bytes: int = 2, workers: int | None = None) -> list[OpChoice]:
    """Every choice the search tries for ``node`` (before the shared-memory check): its
    kind's (:meth:`mk.tasks.OpKind.candidates`)."""
    return op_kind(node.kind).candidates(node, device, dtype_bytes, workers)


@dataclass(frozen=True)
class _State:
    cost: float
    peak_smem: int
    choices: tuple  # ((op name, OpChoice), ...) in DAG order
    pending: tuple = ()  # ops waiting to be fused into a later op's prologue (an RMSNorm's linear)
    order: tuple = ()  # the option index taken at each op: a deterministic tie-break

    def key(self):
        return (self.cost, self.peak_smem, self.order)


def _find(choices: tuple, name: str):
    """The choice of op ``name`` (hosts are a few ops back: scan from the end)."""
    for n, c in reversed(choices):
        if n == name:
            return c
    return None


def search(graph: OpGraph, device: DeviceSpec, *, workers: int | None = None, beam_width: int = 6,
           top_k: int = 3, progress: bool = False) -> list[Plan]:
    """The ``top_k`` cheapest plans for ``graph`` on ``device`` (see module docstring).

    ``workers`` None: two workers an SM where every op has a tile that fits half the SM's
    shared memory, else one an SM. Raises ValueError naming the op when no candidate of an
    op fits the shared-memory budget.
    """
    if beam_width < 1 or top_k < 1:
        raise ValueError(f"beam_width and top_k must be >= 1, got {beam_width}, {top_k}")
    with collector_paused():
        return _search_plans(graph, device, workers, beam_width, top_k, progress)


def _search_plans(graph: OpGraph, device: DeviceSpec, workers: int | None, beam_width: int, top_k: int,
                  progress: bool) -> list[Plan]:
    template = _layer_template(graph)
    # Every layer has the same ops and shapes: plan one layer (with the ops around the
    # layers) and give every layer its choices. The cost is a sum over ops, so the best
    # layer plan is the best for each layer; the top plans then differ in what they do to
    # every layer, not in one late layer's tie.
    planned = template if template is not None else graph
    # An x-major decode tile slows the whole kernel (DeviceSpec.xmajor_kernel_slowdown), which
    # a sum over ops cannot see: plans without one are searched for on their own too, and
    # plans with one pay the slowdown on their whole step.
    found = _search_workers(planned, device, workers, beam_width, top_k, progress)
    if device.xmajor_kernel_slowdown > 0 and any(op_kind(n.kind).may_slow_kernel(n) for n in planned.nodes):
        try:
            found += _search_workers(planned, device, workers, beam_width, top_k, progress, xmajor=False)
        except ValueError:  # some op has only x-major tiles that fit
            pass
    out, seen = [], set()
    for choices, n_workers in found:
        key = (n_workers, tuple(sorted(choices.items(), key=lambda kv: kv[0])))
        if key in seen:
            continue
        seen.add(key)
        # The finalists are simulated as lowered, over the whole step (one layer does not
        # stand for the others: zig-zag deals each from a different place in its pass over
        # the workers; 8B batch 8: 6.5 ms from one layer, 9.0 simulated whole).
        out.append(_finalist(graph, _expand(choices, graph) if template is not None else choices, device, n_workers))
    return sorted(out, key=lambda p: (p.predicted_s, p.peak_smem_bytes))[:top_k]


def _finalist(graph: OpGraph, choices: dict[str, OpChoice], device: DeviceSpec, workers: int) -> Plan:
    """The plan of ``choices``, simulated as lowered under every schedule, the fastest kept."""
    times = {s: sim.seconds for s, sim in simulate_schedules(graph, choices, device, workers).items()}
    best = SCHEDULES[0]  # ties go to the first schedule
    for sched in SCHEDULES[1:]:
        if times[sched] < times[best] * (1 - 1e-9):
            best = sched
    if any(_slows_kernel(graph.node(n), c) for n, c in choices.items()):
        times = {k: v * (1 + device.xmajor_kernel_slowdown) for k, v in times.items()}
    step = estimate_step(graph, choices, device, workers)
    return Plan(graph.name, graph.batch, graph.kv_len, device.name, workers, choices, times[best],
                step.peak_smem_bytes, step.ops, schedule=best, schedule_s=times)


def _slows_kernel(node: OpNode, choice: OpChoice) -> bool:
    """Whether the choice slows the whole megakernel (an x-major decode tile's registers)."""
    return op_kind(node.kind).slows_kernel(node, choice)


def own_all_reduces(plan: Plan, graph: OpGraph, device: DeviceSpec) -> Plan | None:
    """``plan`` with every fused op whose kind measure mode also times on its own (the sums
    over tensor-parallel ranks that a projection's tiles run, each tile pushing to the ranks
    and summing its own box: ``measure_unfused``) moved to tiles of its own, the rest
    unchanged, simulated anew; None when it has no such op. The two ways trade places with
    the batch (docs/PERFORMANCE.md, tensor parallelism), closer than the cost model tells
    apart, so ``measure`` mode times both (:func:`mk.planner.cache.cached_plan`)."""
    kinds = {n.name: n.kind for n in graph.nodes}
    choices = dict(plan.choices)
    for name, c in plan.choices.items():
        sums = tuple(f for f in c.fuse if f in kinds and op_kind(kinds[f]).measure_unfused)
        if sums:
            choices[name] = replace(c, fuse=tuple(f for f in c.fuse if f not in sums))
            choices.update({f: OpChoice() for f in sums})
    return None if choices == plan.choices else _finalist(graph, choices, device, plan.workers)


def _search_workers(graph: OpGraph, device: DeviceSpec, workers: int | None, beam_width: int, top_k: int,
                    progress: bool, xmajor: bool = True) -> list[tuple[dict[str, OpChoice], int]]:
    """:func:`_search` with the worker count fixed, or chosen as :func:`search` says."""
    if workers is not None:
        return _search(graph, device, workers, device.smem_per_block, beam_width, top_k, progress, xmajor)
    # Two workers an SM keep twice the weight bytes in flight: measured on an H200: 1B step 1.32 -> 1.24 ms, 8B 5.55 -> 5.13 ms. Both must fit in
    # the SM's shared memory, so each gets at most half of it, less what is left to L1
    # (DeviceSpec.l1_reserve_per_sm; on a 100 KiB Ada SM the 8B shape's attention tile
    # does not fit: one worker an SM there).
    shared = device.smem_per_sm - device.l1_reserve_per_sm
    try:
        return _search(graph, device, device.sm_count * WORKERS_PER_SM,
                       min(device.smem_per_block, shared // WORKERS_PER_SM - device.reserved_smem_per_block),
                       beam_width, top_k, progress, xmajor)
    except ValueError:
        return _search(graph, device, device.sm_count, device.smem_per_block, beam_width, top_k, progress, xmajor)


def _layer_key(node: OpNode):
    def strip(name: str) -> str:  # the op's role in its layer
        return name[len(node.scope):] if name.startswith(node.scope) else name

    return (strip(node.name), node.kind, tuple(sorted(node.dims.items())), node.bytes_read, node.bytes_written,
            node.flops, strip(node.fuse_into) if node.fuse_into else None,
            strip(node.fuse_later) if node.fuse_later else None)


def _layer_template(graph: OpGraph) -> OpGraph | None:
    """The graph cut to its first layer (and the ops outside the layers) when every layer
    has the same ops with the same shapes; None when there is one layer or they differ."""
    by_layer: dict[int, list[OpNode]] = {}
    for n in graph.nodes:
        by_layer.setdefault(n.layer, []).append(n)
    layers = sorted(k for k in by_layer if k >= 0)
    if len(layers) < 2 or layers != list(range(len(layers))):
        return None
    first = [_layer_key(n) for n in by_layer[0]]
    if any([_layer_key(n) for n in by_layer[L]] != first for L in layers[1:]):
        return None
    return replace(graph, nodes=[n for n in graph.nodes if n.layer in (-1, 0)])


def _expand(choices: dict[str, OpChoice], graph: OpGraph) -> dict[str, OpChoice]:
    """Layer 0's choices (from :func:`_layer_template`'s plan) given to every layer of ``graph``."""
    out = {}
    first = next(n.scope for n in graph.nodes if n.layer == 0)
    for n in graph.nodes:
        if n.layer <= 0:
            if n.name in choices:
                out[n.name] = choices[n.name]
            continue
        src = first + n.name[len(n.scope):]
        if src in choices:
            c = choices[src]
            out[n.name] = replace(c, fuse=tuple(n.scope + f[len(first):] for f in c.fuse))
    return out


def _search(graph: OpGraph, device: DeviceSpec, workers: int, budget: int, beam_width: int, top_k: int,
            progress: bool, xmajor: bool = True) -> list[tuple[dict[str, OpChoice], int]]:
    """The beam's ``top_k`` complete plans as (op name -> choice, workers), in beam order;
    ``xmajor`` False leaves x-major decode tiles out of the candidates."""
    beam = [_State(0.0, 0, ())]
    nodes = {n.name: n for n in graph.nodes}
    cache: dict = {}
    iterator = graph.nodes
    if progress:
        from tqdm import tqdm

        iterator = tqdm(graph.nodes, desc="planning", unit="op", leave=False, disable=None)  # (None: a terminal only)

    def shape(node):
        return (node.kind, tuple(sorted(node.dims.items())), node.bytes_read, node.bytes_written, node.flops)

    idle = idle_wait_ops(graph)

    def cost_of(node, choice, fused_names):
        # Keyed by shapes, not names: the layers of a model repeat, so most lookups hit.
        key = (shape(node), node.name in idle, choice, tuple(shape(nodes[f]) for f in fused_names))
        if key not in cache:
            cache[key] = estimate_op(node, replace(choice, fuse=fused_names), device, workers,
                                     [nodes[f] for f in fused_names], graph.dtype_bytes, node.name in idle)
        return cache[key]

    ranked_of: dict = {}
    # Hosts of an op that must fold into their whole-K tiles (an argmax over tensor-parallel ranks).
    whole_k = {n.fuse_into for n in graph.nodes if op_kind(n.kind).needs_whole_k_host(n)}

    for node in iterator:
        rank_key = (shape(node), node.name in idle, node.name in whole_k)
        if rank_key not in ranked_of:
            options = [c for c in candidates(node, device, graph.dtype_bytes, workers)
                       if cost_of(node, c, ()).smem_bytes <= budget and (xmajor or not _slows_kernel(node, c))
                       and (node.name not in whole_k or c.split_k == 1)]
            if not options:
                raise ValueError(f"op {node.name} ({node.kind} {node.dims}): no tile fits the shared-memory "
                                 f"budget of {budget} bytes")
            # Keep only the cheapest few tiles of this op (ops are independent but for fusion),
            # and none that another tile beats on both time and shared memory (a deeper ring
            # that streams no faster would only crowd the beam with equal plans).
            kept: list[OpChoice] = []
            for c in sorted(options, key=lambda c: (cost_of(node, c, ()).seconds, cost_of(node, c, ()).smem_bytes,
                                                    repr(c))):
                if not any(cost_of(node, k, ()).smem_bytes <= cost_of(node, c, ()).smem_bytes for k in kept):
                    kept.append(c)
            ranked_of[rank_key] = kept[:beam_width]
        ranked = ranked_of[rank_key]
        new_beam: list[_State] = []
        host = node.fuse_into
        kind = op_kind(node.kind)
        for state in beam:
            # 1. Fuse this op into its host, already chosen (epilogue fusions), budget permitting.
            hc = _find(state.choices, host) if host is not None else None
            if hc is not None and kind.fuses_as_epilogue(node, nodes[host], hc):
                old = cost_of(nodes[host], replace(hc, fuse=()), hc.fuse)
                new = cost_of(nodes[host], replace(hc, fuse=()), hc.fuse + (node.name,))
                choices = tuple((n, replace(c, fuse=c.fuse + (node.name,)) if n == host else c)
                                for n, c in state.choices)
                if new.smem_bytes <= budget:
                    new_beam.append(_State(state.cost - old.seconds + new.seconds,
                                           max(state.peak_smem, new.smem_bytes), choices, state.pending,
                                           state.order + (-1,)))
            # 2. Defer a prologue (an RMSNorm; a RoPE into attention) into a later host's tiles:
            # where the op could run apart from an earlier host at all, and not where that
            # host's tiles already take it (a fold that costs them nothing).
            later = node.prologue_host
            if (later is not None and kind.fuses_as_prologue(node, nodes[later])
                    and kind.runs_alone(node, nodes[host] if host is not None else None)
                    and not (hc is not None and kind.fuses_as_epilogue(node, nodes[host], hc))):
                new_beam.append(_State(state.cost, state.peak_smem, state.choices, state.pending + (node.name,),
                                       state.order + (-2,)))
            # 3. Run it on its own (a host takes the prologues waiting for it), where its kind
            # may (a residual add or SiLU·mul only fused; a RoPE after a QKV with a bias only in
            # the QKV tiles, which add the bias; the argmax over ranks only folded).
            if not kind.runs_alone(node, nodes[host] if host is not None else None):
                continue
            takes = tuple(p for p in state.pending if nodes[p].prologue_host == node.name)
            rest = tuple(p for p in state.pending if p not in takes)
            for i, c in enumerate(ranked):
                est = cost_of(node, c, takes)
                if est.smem_bytes > budget:  # fusions change a tile's buffers (a norm weight chunk)
                    continue
                new_beam.append(_State(state.cost + est.seconds, max(state.peak_smem, est.smem_bytes),
                                       state.choices + ((node.name, replace(c, fuse=takes)),), rest,
                                       state.order + (i,)))
        # A pending prologue whose host has passed can no longer fuse: drop such states.
        new_beam = [s for s in new_beam if all(_find(s.choices, nodes[p].prologue_host) is None for p in s.pending)]
        new_beam.sort(key=_State.key)
        beam = new_beam[:beam_width]
    return [(dict(state.choices), workers) for state in beam[:top_k] if not state.pending]


def pick_measured(plans: list[Plan], time_plan: Callable[[Plan], float]) -> list[Plan]:
    """``measure`` mode: time every plan on the GPU (``time_plan`` returns seconds a step)
    and return them fastest first, each with ``measured_s`` set (ties: the predicted order)."""
    if not plans:
        raise ValueError("pick_measured needs at least one plan")
    timed = []
    for rank, plan in enumerate(plans):
        seconds = float(time_plan(plan))
        if not seconds > 0:
            raise ValueError(f"time_plan returned {seconds} s for plan {rank}: a step time must be positive")
        timed.append((seconds, rank, replace(plan, measured_s=seconds)))
    return [p for _, _, p in sorted(timed, key=lambda t: t[:2])]
