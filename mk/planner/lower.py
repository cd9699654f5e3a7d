"""Lowering: a plan of a decode step -> the task graph one megakernel launch runs.

Each op of the plan becomes the tasks of its chosen tile, as its kind lowers it
(:meth:`mk.tasks.OpKind.lower`: the op's specs in :mod:`mk.tasks`), fused ops folded into
their host's tile (an RMSNorm prologue, a residual or SiLU·mul epilogue); this module
holds what is generic: the buffers, the activations (shared between layers), the layers
copied rather than lowered again, and each op's number in the step. The runtime derives
every dependency from the regions the tasks read and write, so they are exact at tile
granularity: a QKV tile waits for the rows it normalises, a split-K partial for the
producer tiles of its K range, attention for its own sequence's RoPE task.

One launch is one whole decode step and needs no host work before the next:

    ids [B] (this step's tokens) -> embedding -> layers -> final norm -> LM head
        -> argmax (or temperature sampling) -> ids (the next tokens)
        -> append_token: tokens[b, pos[b] + 1] = ids[b], pos[b] += 1

``next_token="logits"`` ends the step at the LM head instead, for a caller that picks the
token itself (top-k / top-p) and appends it with :func:`mk.tasks.append_token.append_token`.

Buffers the caller provides (by name), all on one device:

* what the graph's ops bind (:attr:`mk.planner.graph.OpNode.buffers`): an embedding's
  table ``w`` [V, H]; an RMSNorm's ``w`` [H]; a linear's ``w`` [N, K] (a QKV's q and k rows
  in the interleaved rotary layout of :func:`mk.tasks.rope.interleave_rotary`, so that RoPE
  can fuse into its tiles; a gate/up's rows interleaved by
  :func:`mk.tasks.linear.interleave_gate_up`) and its optional ``bias`` [N]; RoPE's
  ``inv_freq`` float32 [D/2], optional ``q_norm`` / ``k_norm`` [D] and, with attention,
  the ``k_cache`` / ``v_cache`` [B, Hkv, S, D];
* the step state: ``ids`` [B], ``pos`` [B] (the positions fed this step), ``tokens``
  [B, S] (each sequence's history), all int32; with ``next_token="sample"`` also
  ``temperature`` float32 [1] and ``seed`` int64 [1].

Activations and workspaces are allocated here, named after the op graph's tensors, all
float32: only the weights and the KV cache are stored in a 16-bit dtype. The layers'
activations of one role are one tensor (``l0.qkv`` is ``l1.qkv``, their ops' scopes aside:
:func:`_layer_shared`), so
after a step each holds the last layer's values. A float32 activation
meets a bf16 weight or cache in two bf16 halves on the tensor cores (:func:`mk.tasks._dot.mma`)
or in float32 FMAs (the GEMV), so nothing between them is rounded (what rounding them would
cost: docs/PERFORMANCE.md). A decode activation is a few KiB a row.
"""

from __future__ import annotations

from itertools import groupby
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch

from mk.persistent.graph import TaskGraph
from mk.tasks import GREEDY, NEXT_TOKEN, SAMPLE, op_kind, op_tiles

from .graph import OpGraph, OpNode
from .plan import Plan

STATE_BUFFERS = ("ids", "pos", "tokens")
SAMPLING_BUFFERS = ("temperature", "seed")


@dataclass
class DecodeStep:
    """The lowered step: its task graph, and the names of the buffers that matter to a caller."""

    graph: TaskGraph
    plan: Plan
    batch: int
    max_seq: int
    next_token: str
    logits: str = "logits"
    tasks_per_op: dict[str, int] = field(default_factory=dict)
    #: (op, tasks) of each run of one op's tasks of one kind, in program order: the
    #: dependency phases the cost model prices (:func:`mk.planner.simulate.phase_task_costs`).
    phases: list[tuple[str, int]] = field(default_factory=list)

    def summary(self) -> str:
        return (f"decode step: {len(self.graph.tasks)} tasks over {len(self.tasks_per_op)} ops, "
                f"batch {self.batch}, cache {self.max_seq} positions, "
                f"next token: {self.next_token}")


def weight_names(graph: OpGraph) -> list[str]:
    """The buffers a step of ``graph`` binds besides its state (see the module docstring)."""
    return list(dict.fromkeys(b for node in graph.nodes for b in node.buffers.values()))


#: The element type a step holds weights of each size in.
_WEIGHT_DTYPES = {2: torch.bfloat16, 4: torch.float32}


def meta_buffers(graph: OpGraph, max_seq: int, kv_dtype_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Every buffer a decode step of ``graph`` binds, on the ``meta`` device (shapes and
    dtypes, no memory): enough to lower a step and read its tasks (what they read and
    write) without weights, e.g. to analyse a plan or a trace on a machine without them.
    Each op's kind gives the shapes of the buffers it binds; the cache's element size is the
    one the graph's ops name (``kv_dtype_bytes``), else the weights'."""
    B = graph.batch
    meta = dict(device="meta")
    kv_bytes = next((n.dims["kv_dtype_bytes"] for n in graph.nodes if "kv_dtype_bytes" in n.dims), graph.dtype_bytes)
    if graph.dtype_bytes not in _WEIGHT_DTYPES or kv_bytes not in _WEIGHT_DTYPES:
        raise ValueError(f"meta_buffers: elements of {graph.dtype_bytes} / {kv_bytes} bytes (weights / KV "
                         f"cache); mk's steps hold 2 or 4")
    dtypes = {"weight": _WEIGHT_DTYPES[graph.dtype_bytes], "kv": _WEIGHT_DTYPES[kv_bytes]}
    bufs = {"ids": torch.empty(B, dtype=torch.int32, **meta), "pos": torch.empty(B, dtype=torch.int32, **meta),
            "tokens": torch.empty(B, max_seq, dtype=torch.int32, **meta),
            "temperature": torch.empty(1, **meta), "seed": torch.empty(1, dtype=torch.int64, **meta)}
    for n in graph.nodes:
        kind = op_kind(n.kind)
        for role, name in n.buffers.items():
            shape, dt = kind.buffer_shape(n, role, max_seq)
            bufs[name] = torch.empty(*shape, dtype=dtypes.get(dt, dt), **meta)
    return bufs


class _Lowering:
    """The lowering of one step in progress: what an op's kind may ask for as it adds its
    tasks (:class:`mk.tasks._planning.LowerContext`), and what the layer copies need."""

    def __init__(self, plan: Plan, graph: OpGraph, buffers: Mapping[str, torch.Tensor], g: TaskGraph,
                 step: DecodeStep, eps: float, next_token: str, rank: int, max_seq: int):
        self.plan, self.graph, self.buffers, self.g, self.step = plan, graph, buffers, g, step
        self.batch, self.max_seq, self.eps, self.next_token, self.rank = graph.batch, max_seq, eps, next_token, rank
        self.nodes = {n.name: n for n in graph.nodes}
        self.choices = plan.choices
        self.fused_into = {f: host for host, c in plan.choices.items() for f in c.fuse}
        self.bound = set(weight_names(graph))
        self.shared: dict[tuple, torch.Tensor] = {}  # (role, shape, dtype) -> the one tensor every layer uses
        self.scope = ""  # the scope of the op being lowered
        self.periods: dict[str, list[int]] = {}  # scope -> its tasks' [first, end)
        self.device = buffers["tokens"].device
        # Each op's index among the step's ops of its kind (ctx.number), and back.
        self.numbers: dict[str, int] = {}
        self.numbered: dict[tuple[str, int], str] = {}
        self.numbered_args: dict[str, str] = {}  # a tile arg that carries a number -> the kind it numbers
        by_kind: dict[str, list[str]] = {}
        for n in graph.nodes:
            by_kind.setdefault(n.kind, []).append(n.name)
        for kind, ops in by_kind.items():
            limit = op_kind(kind).number_limit
            if limit is not None and len(ops) > limit:
                raise ValueError(f"lower_decode_step: {len(ops)} ops of kind {kind} in one step; at most {limit}")
            for i, name in enumerate(ops):
                self.numbers[name] = i
                self.numbered[(kind, i)] = name
        self.firsts = {n.kind: n.name for n in reversed(graph.nodes)}

    # ------------------------------------------------------------------ what a kind asks for

    def first(self, node: OpNode) -> bool:
        return self.firsts.get(node.kind) == node.name

    def number(self, node: OpNode) -> int:
        return self.numbers[node.name]

    def dtype(self, buffer: str) -> torch.dtype:
        return self.buffers[buffer].dtype

    def activation(self, name: str, *shape: int, dt: torch.dtype = torch.float32) -> str:
        if name in self.bound:  # an output the graph puts in the caller's memory (a symmetric partial)
            return name
        if name in self.buffers:
            raise ValueError(f"lower_decode_step: activation {name} would overwrite the caller's buffer of that name")
        if name not in self.g.buffers:
            self.g.buffer(name, _layer_shared(self.shared, name, self.scope, shape, dt, self.device))
        return name

    def add(self, node_name: str, spec, rows: int | None = None, numbered: dict | None = None, **bind) -> None:
        tiles = op_tiles(spec, rows)
        if "rank" in spec.args:  # (a tensor-parallel step's tasks carry the rank they run on)
            tiles = [dict(t, rank=self.rank) for t in tiles]
        for arg, node in (numbered or {}).items():
            if arg in spec.args:
                self.numbered_args[arg] = node.kind
                tiles = [dict(t, **{arg: self.number(node)}) for t in tiles]
        first = self.g.add_tiles(spec, tiles, **bind)
        if self.scope:
            self.periods.setdefault(self.scope, [first, first])[1] = len(self.g.tasks)
        self.step.tasks_per_op[node_name] = self.step.tasks_per_op.get(node_name, 0) + len(tiles)
        self.step.phases.append((node_name, len(tiles)))

    # ------------------------------------------------------------------ the step

    def lower_node(self, node: OpNode) -> None:
        kind = op_kind(node.kind)
        fused = node.name in self.fused_into
        if fused and not kind.lowers_when_fused(node):
            return
        choice = self.plan.choices.get(node.name)
        if choice is None and not fused:
            raise ValueError(f"lower_decode_step: op {node.name} has no choice in the plan")
        self.scope = node.scope
        kind.lower(node, choice, self)

    def copy_layer(self, prev, sig, scope_name: str) -> None:
        """Layer ``scope_name``, whose lowering repeats the one before (``prev``) with other
        names: that layer's tasks copied, renamed, their numbered args renumbered."""
        p_scope, (p_names, _), a, b, p_phases = prev
        outside = dict(zip(p_names, sig[0]))
        self.scope = scope_name
        rename: dict[str, str] = {}
        for t in self.g.tasks[a:b]:
            for name in t.bind.values():
                if name not in rename:
                    rename[name] = (scope_name + name[len(p_scope):] if name.startswith(p_scope)
                                    else outside.get(name, name))
        for name, new in rename.items():
            if new not in self.g.buffers:
                like = self.g.buffers[name]
                self.activation(new, *like.shape, dt=like.dtype)
        first = len(self.g.tasks)

        def renumbered(args: dict) -> dict:
            """A copied task's args, each op's number in them that of the same op of this layer."""
            moved = {}
            for arg, kind in self.numbered_args.items():
                if arg in args:
                    name = self.numbered[(kind, args[arg])]
                    name = scope_name + name[len(p_scope):] if name.startswith(p_scope) else name
                    moved[arg] = self.numbers[name]
            return dict(args, **moved) if moved else args

        self.g.repeat(a, b, rename, args=renumbered if self.numbered_args else None)
        for op_name, n in p_phases:
            op_name = scope_name + op_name[len(p_scope):] if op_name.startswith(p_scope) else op_name
            self.step.tasks_per_op[op_name] = self.step.tasks_per_op.get(op_name, 0) + n
            self.step.phases.append((op_name, n))
        self.periods[scope_name] = [first, len(self.g.tasks)]


def lower_decode_step(plan: Plan, graph: OpGraph, buffers: Mapping[str, torch.Tensor], *, eps: float,
                      next_token: str = GREEDY, rank: int = 0) -> DecodeStep:
    """The task graph of one decode step of ``graph`` under ``plan`` (see module docstring);
    of rank ``rank``'s share of a tensor-parallel step (its tasks the same on every rank but
    for that argument of the ops that meet the other ranks, :mod:`mk.tasks.all_reduce`).
    Each op adds its tasks as its kind lowers it (:meth:`mk.tasks.OpKind.lower`).

    Raises ValueError naming the buffer that is missing or of the wrong shape, or the op
    whose choice the runtime cannot run.
    """
    if next_token not in NEXT_TOKEN:
        raise ValueError(f"lower_decode_step: next_token must be one of {NEXT_TOKEN}, got {next_token!r}")
    need = (weight_names(graph) + list(STATE_BUFFERS)
            + (list(SAMPLING_BUFFERS) if next_token == SAMPLE else []))
    missing = [n for n in need if n not in buffers]
    if missing:
        raise ValueError(f"lower_decode_step: missing buffers {missing}")
    S = buffers["tokens"].shape[1] if buffers["tokens"].dim() == 2 else -1
    expect = meta_buffers(graph, max(S, 1))
    for name in need:
        if tuple(buffers[name].shape) != tuple(expect[name].shape):
            raise ValueError(f"lower_decode_step: buffer {name} has shape {tuple(buffers[name].shape)}, "
                             f"expected {tuple(expect[name].shape)}")
    g = TaskGraph()
    for name in need:
        g.buffer(name, buffers[name])
    step = DecodeStep(g, plan, graph.batch, S, next_token)
    low = _Lowering(plan, graph, buffers, g, step, eps, next_token, rank, S)

    # A layer that repeats the one before with other names is that layer's tasks copied,
    # renamed: a step of 32 layers lowers two.
    prev = None  # the last layer lowered or copied: (scope, its signature, tasks [first, end), phases)
    for scope_name, group in groupby(graph.nodes, key=lambda n: n.scope):
        members = list(group)
        sig = (_scope_signature(members, scope_name, plan, low.fused_into, low.firsts, buffers)
               if scope_name else None)
        first, n_phases = len(g.tasks), len(step.phases)
        if sig is not None and prev is not None and prev[1][1] == sig[1]:
            low.copy_layer(prev, sig, scope_name)
        else:
            for node in members:
                low.lower_node(node)
        prev = (scope_name, sig, first, len(g.tasks), step.phases[n_phases:]) if sig is not None else None

    # The layers repeat one another: the dependencies of a long step follow from a few layers'.
    g.periods = [tuple(r) for r in low.periods.values()]
    return step


def _layer_shared(shared: dict, name: str, scope: str, shape: tuple, dt: torch.dtype, device) -> torch.Tensor:
    """Zeros for activation ``name`` of an op in ``scope``; a layer's activation (its scope,
    then its role: ``l3.qkv``) is the same memory as every other layer's of that role,
    shape and dtype, so a step holds one layer's activations and workspaces, not all of
    them (8B batch 8: 138 MiB -> a few).

    Safe because every layer begins with an RMSNorm over whole rows of the residual: each
    task of layer L+1 that writes an activation depends, through that row, on every task of
    layer L that reads one (split-K reduces, attention merges and the residual adds all
    feed the next layer's normed input); the attention arrivals counters are left at zero
    by their last user. :func:`mk.persistent.vm.run_vm` checks this on the memory, not the
    names."""
    if not scope or not name.startswith(scope):
        return torch.zeros(*shape, dtype=dt, device=device)
    key = (name[len(scope):], tuple(shape), dt)
    if key not in shared:
        shared[key] = torch.zeros(*shape, dtype=dt, device=device)
    return shared[key]


def _scope_signature(nodes: list[OpNode], scope: str, plan: Plan, fused_into: dict, firsts: dict,
                     caller: Mapping) -> tuple[list[str], list] | None:
    """What the lowering of one scope's ``nodes`` (a layer) follows from, its names made
    relative: names in the scope by their rest, others by order of first use (and whether
    the caller provides them), and which ops are the step's first of their kind (``firsts``:
    kind -> op; the first RoPE publishes the sequence lengths). Two layers with equal
    signatures lower to the same tasks, renamed (the others' names in that order, for the
    later). None if a layer fuses an op of another scope."""
    outside: dict[str, int] = {}

    def rel(name: str) -> str:
        if name.startswith(scope):
            return "~" + name[len(scope):]
        k = outside.setdefault(name, len(outside))
        return f"#{k}{'*' if name in caller else ''}"

    sig = []
    for node in nodes:
        choice = plan.choices.get(node.name)
        host = fused_into.get(node.name)
        if (host is not None and not host.startswith(scope)) or (
                choice is not None and any(not f.startswith(scope) for f in choice.fuse)):
            return None
        sig.append((rel(node.name), node.kind, tuple(sorted(node.dims.items())), tuple(map(rel, node.inputs)),
                    tuple(map(rel, node.outputs)), tuple((r, rel(b)) for r, b in node.buffers.items()),
                    None if choice is None else replace(choice, fuse=tuple(map(rel, choice.fuse))),
                    None if host is None else rel(host), firsts.get(node.kind) == node.name))
    return list(outside), sig


def lowered_phases(graph: OpGraph, choices: Mapping, next_token: str = GREEDY
                   ) -> tuple[list[tuple[str, int]], list[list[tuple[int, int]]]]:
    """The phases (:attr:`DecodeStep.phases`) and dependencies (implied ones dropped,
    :meth:`mk.persistent.graph.TaskGraph.events`) of the step of ``graph`` under ``choices``
    (op name -> OpChoice), lowered on ``meta`` buffers: what the planner simulates a plan on."""
    plan = Plan(graph.name, graph.batch, graph.kv_len, "meta", 0, dict(choices), 0.0, 0)
    step = lower_decode_step(plan, graph, meta_buffers(graph, graph.kv_len), eps=1e-5, next_token=next_token)
    return step.phases, step.graph.direct_dependencies()


