"""Lowering: a plan of a decode step -> the task graph one megakernel launch runs.

Each op of the plan becomes the tasks of its chosen tile (the op's spec in :mod:`mk.tasks`),
fused ops folded into their host's tile (an RMSNorm prologue, a residual or SiLU·mul
epilogue). The runtime derives every dependency from the regions the tasks read and
write, so they are exact at tile granularity: a QKV tile waits for the rows it
normalises, a split-K partial for the producer tiles of its K range, attention for its
own sequence's RoPE task.

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

from collections import OrderedDict
from itertools import groupby
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch

from mk.persistent.graph import Program, TaskGraph, collector_paused, lower
from mk.tasks import make_op, op_tiles
from mk.tasks.all_reduce import HOP_SPACE

from .cost import reduce_width
from .device import DeviceSpec
from .graph import OpGraph, OpNode
from .search import Plan
from .simulate import phase_task_costs, simulate, step_costs

#: L2 prefetch ahead of a register GEMV tile's dependency wait, in weight columns (never under
#: the interpreter): bench/test_persistent.py's 8192 chain runs best with 1024. Not for tiles
#: that stream through the TMA ring: issued one task ahead it slowed the 1B step on an H200
#: (1.087 ms without, 1.175 with 1024 columns, 1.34 with whole rows), and issued just before
#: the task's own wait too (1.009 -> 1.106 ms; 8B 4.57 -> 5.50; H200).
PREFETCH_K = 1024

STATE_BUFFERS = ("ids", "pos", "tokens")
SAMPLING_BUFFERS = ("temperature", "seed")
#: How a step ends: greedy argmax, temperature sampling (both + append_token), or the logits.
NEXT_TOKEN = ("argmax", "sample", "logits")


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


def meta_buffers(graph: OpGraph, max_seq: int, kv_dtype_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Every buffer a decode step of ``graph`` binds, on the ``meta`` device (shapes and
    dtypes, no memory): enough to lower a step and read its tasks (what they read and
    write) without weights, e.g. to analyse a plan or a trace on a machine without them.
    The cache's element size is the attention ops' (``kv_dtype_bytes``)."""
    B = graph.batch
    meta = dict(device="meta")
    dtypes = {2: torch.bfloat16, 4: torch.float32}
    att = next((n.dims for n in graph.nodes if n.kind == "attention"), {})
    kv_bytes = att.get("kv_dtype_bytes", graph.dtype_bytes)
    if graph.dtype_bytes not in dtypes or kv_bytes not in dtypes:
        raise ValueError(f"meta_buffers: elements of {graph.dtype_bytes} / {kv_bytes} bytes (weights / KV "
                         f"cache); mk's steps hold 2 or 4")
    dtype, kv_dtype = dtypes[graph.dtype_bytes], dtypes[kv_bytes]
    bufs = {"ids": torch.empty(B, dtype=torch.int32, **meta), "pos": torch.empty(B, dtype=torch.int32, **meta),
            "tokens": torch.empty(B, max_seq, dtype=torch.int32, **meta),
            "temperature": torch.empty(1, **meta), "seed": torch.empty(1, dtype=torch.int64, **meta)}
    for n in graph.nodes:
        d = n.dims
        for role, name in n.buffers.items():
            if n.kind == "embedding":
                shape = (d["vocab"], d["hidden"])
            elif n.kind == "rmsnorm":
                shape = (d["n"],)
            elif n.kind == "linear":
                shape = (d["N"], d["K"]) if role == "w" else (d["N"],)
            elif role in ("k_cache", "v_cache"):
                bufs[name] = torch.empty(B, d["kv_heads"], max_seq, d["head_dim"], dtype=kv_dtype, **meta)
                continue
            elif n.kind in ("all_reduce", "argmax"):  # a tensor-parallel step's symmetric buffers
                if role == "peers":
                    shape, dt = (d["world"],), torch.int64
                elif role == "part":  # partial sums (float32 activations)
                    shape, dt = (d["rows"], d["n"]), torch.float32
                elif n.kind == "all_reduce":  # every rank's pushed words of its partial
                    shape, dt = (d["world"], d["rows"], d["n"]), torch.int64
                else:  # each row's candidate over the ranks, and its flag
                    shape, dt = (d["rows"],), torch.int64 if role == "shared" else torch.int32
                bufs[name] = torch.empty(*shape, dtype=dt, **meta)
                continue
            elif role == "inv_freq":
                bufs[name] = torch.empty(d["head_dim"] // 2, **meta)
                continue
            else:  # q_norm / k_norm
                shape = (d["head_dim"],)
            bufs[name] = torch.empty(*shape, dtype=dtype, **meta)
    return bufs


def lower_decode_step(plan: Plan, graph: OpGraph, buffers: Mapping[str, torch.Tensor], *, eps: float,
                      next_token: str = "argmax", rank: int = 0) -> DecodeStep:
    """The task graph of one decode step of ``graph`` under ``plan`` (see module docstring);
    of rank ``rank``'s share of a tensor-parallel step (its tasks the same on every rank but
    for that argument of the ops that meet the other ranks, :mod:`mk.tasks.all_reduce`).

    Raises ValueError naming the buffer that is missing or of the wrong shape, or the op
    whose choice the runtime cannot run.
    """
    if next_token not in NEXT_TOKEN:
        raise ValueError(f"lower_decode_step: next_token must be one of {NEXT_TOKEN}, got {next_token!r}")
    B = graph.batch
    need = (weight_names(graph) + list(STATE_BUFFERS)
            + (list(SAMPLING_BUFFERS) if next_token == "sample" else []))
    missing = [n for n in need if n not in buffers]
    if missing:
        raise ValueError(f"lower_decode_step: missing buffers {missing}")
    embed = next(n for n in graph.nodes if n.kind == "embedding")
    weight = buffers[embed.buffers["w"]]
    dtype, device = weight.dtype, weight.device
    S = buffers["tokens"].shape[1] if buffers["tokens"].dim() == 2 else -1
    expect = meta_buffers(graph, max(S, 1))
    for name in need:
        if tuple(buffers[name].shape) != tuple(expect[name].shape):
            raise ValueError(f"lower_decode_step: buffer {name} has shape {tuple(buffers[name].shape)}, "
                             f"expected {tuple(expect[name].shape)}")
    # One op publishes the sequence lengths attention reads: the step's first RoPE.
    first_rope = next((n.name for n in graph.nodes if n.kind == "rope_kv"), None)

    g = TaskGraph()
    for name in need:
        g.buffer(name, buffers[name])
    nodes = {n.name: n for n in graph.nodes}
    fused_into = {f: host for host, c in plan.choices.items() for f in c.fuse}
    step = DecodeStep(g, plan, B, S, next_token)

    shared: dict[tuple, torch.Tensor] = {}  # (role, shape, dtype) -> the one tensor every layer uses
    scope = ""  # the scope of the op being lowered

    bound = set(weight_names(graph))

    def activation(name: str, *shape: int, dt: torch.dtype = torch.float32) -> str:
        if name in bound:  # an output the graph puts in the caller's memory (a symmetric partial)
            return name
        if name in buffers:
            raise ValueError(f"lower_decode_step: activation {name} would overwrite the caller's buffer of that name")
        if name not in g.buffers:
            g.buffer(name, _layer_shared(shared, name, scope, shape, dt, device))
        return name

    periods: dict[str, list[int]] = {}  # scope -> its tasks' [first, end)

    # Each all-reduce's index in the step (its words' tag: mk.tasks.all_reduce.hop_tag), also
    # under the name of the projection whose tiles run it.
    hops = {n.name: i for i, n in enumerate(n for n in graph.nodes if n.kind == "all_reduce")}
    if len(hops) >= HOP_SPACE:
        raise ValueError(f"lower_decode_step: {len(hops)} all-reduces in one step; their tags allow "
                         f"{HOP_SPACE - 1}")
    reduce_of_hop = {i: name for name, i in hops.items()}
    hops |= {host: hops[f] for host, c in plan.choices.items() for f in c.fuse if f in hops}

    def add_op(node_name: str, spec, rows: int | None = None, **bind) -> None:
        tiles = op_tiles(spec, rows)
        if "rank" in spec.args:
            tiles = [dict(t, rank=rank) for t in tiles]
        if "hop" in spec.args:
            tiles = [dict(t, hop=hops[node_name]) for t in tiles]
        first = g.add_tiles(spec, tiles, **bind)
        if scope:
            periods.setdefault(scope, [first, first])[1] = len(g.tasks)
        step.tasks_per_op[node_name] = step.tasks_per_op.get(node_name, 0) + len(tiles)
        step.phases.append((node_name, len(tiles)))

    def lower_node(node: OpNode) -> None:
        nonlocal scope
        if node.name in fused_into and node.kind != "argmax":  # (a fused argmax leaves the token append)
            return
        choice = plan.choices.get(node.name)
        if choice is None and node.name not in fused_into:
            raise ValueError(f"lower_decode_step: op {node.name} has no choice in the plan")
        kind, d, scope = node.kind, node.dims, node.scope
        if kind == "embedding":
            add_op(node.name, make_op("embedding", rows=B, vocab=d["vocab"], hidden=d["hidden"],
                                      ranks=d.get("world", 1)),
                   ids="ids", table=node.buffers["w"], out=activation(node.outputs[0], B, d["hidden"]))
        elif kind == "rmsnorm":
            add_op(node.name, make_op("rmsnorm", n=d["n"], eps=eps), B, x=node.inputs[0], w=node.buffers["w"],
                   out=activation(node.outputs[0], B, d["n"]))
        elif kind == "linear":
            _lower_linear(node, choice, nodes, add_op, activation, dtype, eps, S, next_token, first_rope)
        elif kind == "rope_kv":
            first = node.name == first_rope
            spec = make_op("rope_kv", batch=B, num_q_heads=d["heads"], num_kv_heads=d["kv_heads"],
                           head_dim=d["head_dim"], max_seq=S, write_seqlens=first, interleaved=True,
                           **({"qk_norm": True, "qk_eps": eps} if d.get("qk_norm") else {}))
            extra = {"seqlens": activation("seqlens", B, dt=torch.int32)} if first else {}
            extra |= {r: node.buffers[r] for r in ("q_norm", "k_norm") if r in node.buffers}
            add_op(node.name, spec, qkv=node.inputs[0], pos="pos", inv_freq=node.buffers["inv_freq"],
                   q=activation(node.outputs[0], B, d["heads"] * d["head_dim"]), k_cache=node.buffers["k_cache"],
                   v_cache=node.buffers["v_cache"], **extra)
        elif kind == "attention":
            splits, hq, dh = choice.kv_splits, d["heads"], d["head_dim"]
            # One phase: each KV group's last split merges it (with one split too: a copy). The
            # length from the positions: known before the wait (the step's QKV writes seqlens).
            spec = make_op("decode_attention", batch=B, num_q_heads=hq, num_kv_heads=d["kv_heads"],
                           head_dim=dh, max_seq=S, num_splits=splits, from_positions=True,
                           **({"window": d["window"]} if d.get("window") else {}))
            add_op(node.name, spec, q=node.inputs[0], k_cache=node.buffers["k_cache"],
                   v_cache=node.buffers["v_cache"], pos="pos",
                   o_part=activation(f"{node.name}.o_part", B, hq, splits * dh),
                   lse=activation(f"{node.name}.lse", B, hq, splits),
                   arrivals=activation(f"{node.name}.arrivals", B * d["kv_heads"], dt=torch.int32),
                   out=activation(node.outputs[0], B, hq * dh))
        elif kind == "all_reduce":  # (with a residual: the layer's stream it adds to)
            res = {"res": node.inputs[1]} if len(node.inputs) > 1 else {}
            add_op(node.name, make_op("all_reduce", M=d["rows"], N=d["n"], world=d["world"], residual=bool(res)),
                   part=node.buffers["part"], out=activation(node.outputs[0], d["rows"], d["n"]),
                   recv=node.buffers["recv"], peers=node.buffers["peers"], **res)
        elif kind == "argmax" and d.get("world", 1) > 1:
            # Each rank's vocabulary share: its best candidate published, the best of them taken.
            if next_token != "argmax" or not argmax_in_lm_head(plan, node.name, next_token):
                raise ValueError(f"lower_decode_step: a tensor-parallel step chooses its token greedily, with the "
                                 f"argmax folded into the LM head (next_token={next_token!r}, plan "
                                 f"{'fuses' if argmax_in_lm_head(plan, node.name, 'argmax') else 'does not fuse'} "
                                 f"{node.name})")
            add_op(node.name, make_op("argmax_publish", batch=B, v_local=d["v"]), best="argmax.best",
                   shared=node.buffers["shared"])
            add_op("append_token", make_op("argmax_ranks", batch=B, max_seq=S, world=d["world"]),
                   shared=node.buffers["shared"], flags=node.buffers["flags"], peers=node.buffers["peers"],
                   next_ids="ids", pos="pos", tokens="tokens")
        elif kind == "argmax":
            if next_token == "logits":
                return
            if argmax_in_lm_head(plan, node.name, next_token):
                # The LM head folded each row's argmax into argmax.best (_lower_linear).
                add_op("append_token", make_op("append_token", batch=B, max_seq=S, from_best=True), next_ids="ids",
                       pos="pos", tokens="tokens", best="argmax.best")
                return
            if next_token == "sample":
                part = make_op("sample_gumbel_partial", rows=B, vocab=d["v"])
                extra = {"params": "temperature", "seed": "seed", "offsets": "seqlens"}
            else:
                part = make_op("argmax_partial", rows=B, vocab=d["v"])
                extra = {}
            chunks = part.constexprs["N_CHUNKS"]
            pv = activation("argmax.val", B, chunks)
            pi = activation("argmax.idx", B, chunks, dt=torch.int32)
            add_op(node.name, part, logits=node.inputs[0], part_val=pv, part_idx=pi, **extra)
            add_op(node.name, make_op("argmax_reduce", rows=B, vocab=d["v"]), part_val=pv, part_idx=pi,
                   out_idx="ids", out_val=activation("next_val", B))
            add_op("append_token", make_op("append_token", batch=B, max_seq=S), next_ids="ids", pos="pos",
                   tokens="tokens")
        else:
            raise ValueError(f"lower_decode_step: op {node.name} of kind {kind} has no task "
                             f"(it must be fused into {node.fuse_into})")

    # A layer that repeats the one before with other names is that layer's tasks copied,
    # renamed: a step of 32 layers lowers two.
    prev = None  # the last layer lowered or copied: (scope, its signature, tasks [first, end), phases)
    for scope_name, group in groupby(graph.nodes, key=lambda n: n.scope):
        members = list(group)
        sig = _scope_signature(members, scope_name, plan, fused_into, first_rope, buffers) if scope_name else None
        first, n_phases = len(g.tasks), len(step.phases)
        if sig is not None and prev is not None and prev[1][1] == sig[1]:
            p_scope, (p_names, _), a, b, p_phases = prev
            outside = dict(zip(p_names, sig[0]))
            scope = scope_name
            rename: dict[str, str] = {}
            for t in g.tasks[a:b]:
                for name in t.bind.values():
                    if name not in rename:
                        rename[name] = (scope + name[len(p_scope):] if name.startswith(p_scope)
                                        else outside.get(name, name))
            for name, new in rename.items():
                if new not in g.buffers:
                    like = g.buffers[name]
                    activation(new, *like.shape, dt=like.dtype)
            def hop_here(args: dict, p_scope=p_scope, scope=scope) -> dict:
                """A copied task's args, its all-reduce's index that of this layer's."""
                if "hop" not in args:
                    return args
                name = reduce_of_hop[args["hop"]]
                return dict(args, hop=hops[scope + name[len(p_scope):]])

            g.repeat(a, b, rename, args=hop_here)
            for op_name, n in p_phases:
                op_name = scope + op_name[len(p_scope):] if op_name.startswith(p_scope) else op_name
                step.tasks_per_op[op_name] = step.tasks_per_op.get(op_name, 0) + n
                step.phases.append((op_name, n))
            periods[scope] = [first, len(g.tasks)]
        else:
            for node in members:
                lower_node(node)
        prev = (scope_name, sig, first, len(g.tasks), step.phases[n_phases:]) if sig is not None else None

    # The layers repeat one another: the dependencies of a long step follow from a few layers'.
    g.periods = [tuple(r) for r in periods.values()]
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


def _scope_signature(nodes: list[OpNode], scope: str, plan: Plan, fused_into: dict, first_rope: str | None,
                     caller: Mapping) -> tuple[list[str], list] | None:
    """What the lowering of one scope's ``nodes`` (a layer) follows from, its names made
    relative: names in the scope by their rest, others by order of first use (and whether
    the caller provides them). Two layers with equal signatures lower to the same tasks,
    renamed (the others' names in that order, for the later). None if a layer fuses an op
    of another scope."""
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
                    None if host is None else rel(host), node.name == first_rope))
    return list(outside), sig


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


def step_queues(step: DecodeStep, graph: OpGraph, device: DeviceSpec, workers: int) -> list[list[int]]:
    """The workers' queues of the lowered ``step`` under its plan's schedule, for
    :func:`mk.persistent.graph.lower`'s ``queues``: its tasks, with the cost model's time of
    each, simulated over the task graph's own dependencies (:mod:`mk.planner.simulate`)."""
    phases = step_costs(graph, step.plan.choices, device, workers, step.next_token)
    phase_task_costs(phases, step.phases)
    deps = step.graph.direct_dependencies()
    return simulate(phases, deps, workers, step.plan.schedule).queues()


def lowered_phases(graph: OpGraph, choices: Mapping, next_token: str = "argmax"
                   ) -> tuple[list[tuple[str, int]], list[list[tuple[int, int]]]]:
    """The phases (:attr:`DecodeStep.phases`) and dependencies (implied ones dropped,
    :meth:`mk.persistent.graph.TaskGraph.events`) of the step of ``graph`` under ``choices``
    (op name -> OpChoice), lowered on ``meta`` buffers: what the planner simulates a plan on."""
    plan = Plan(graph.name, graph.batch, graph.kv_len, "meta", 0, dict(choices), 0.0, 0)
    step = lower_decode_step(plan, graph, meta_buffers(graph, graph.kv_len), eps=1e-5, next_token=next_token)
    return step.phases, step.graph.direct_dependencies()


def _streaming(choice, M: int, K: int) -> dict:
    """How a linear tile streams its weights: the choice's TMA ring; register GEMV tiles
    (M = 1) also prefetch PREFETCH_K columns into L2 ahead of their wait."""
    if M == 1 and not choice.tma_stages:
        return dict(tma_stages=0, prefetch_k=min(PREFETCH_K, K))
    return dict(tma_stages=choice.tma_stages)


def argmax_in_lm_head(plan: Plan, argmax: str, next_token: str) -> bool:
    """Whether the LM head's tiles fold each row's argmax into one word themselves
    (:func:`mk.tasks.argmax.argmax_tile_into`), which the token append then takes: the plan
    fuses op ``argmax`` into the LM head and the step ends in a greedy choice. (Temperature
    sampling runs its own partial tasks whatever the plan: they add noise to every logit.)"""
    return next_token == "argmax" and any(argmax in c.fuse for c in plan.choices.values())


def _lower_linear(node: OpNode, choice, nodes: dict[str, OpNode], add_op, activation, dtype, eps,
                  max_seq: int, next_token: str, first_rope: str | None) -> None:
    """One linear op and what is fused into it: split-K partials and their reduce, full
    tiles, or with RoPE + KV append fused, qkv_rope_kv tiles (split-K: partials, then
    qkv_rope_kv_reduce tiles); an LM head with the argmax fused also folds each row's
    argmax into ``argmax.best`` (``next_token="argmax"`` only)."""
    d = node.dims
    M, N, K = d["M"], d["N"], d["K"]
    fused = [nodes[f] for f in choice.fuse if nodes[f].kind != "argmax"]
    argmax = next_token == "argmax" and any(nodes[f].kind == "argmax" for f in choice.fuse)
    norm = next((f for f in fused if f.kind == "rmsnorm"), None)
    add = next((f for f in fused if f.kind == "add"), None)
    silu = next((f for f in fused if f.kind == "silu_mul"), None)
    rope = next((f for f in fused if f.kind == "rope_kv"), None)
    ar = next((f for f in fused if f.kind == "all_reduce"), None)
    x = norm.inputs[0] if norm is not None else node.inputs[0]
    out_name, out_cols = node.outputs[0], N
    if silu is not None:
        out_name, out_cols = silu.outputs[0], N // 2
    if add is not None:
        out_name = add.outputs[0]
    bind = {"x": x, "w": node.buffers["w"]}
    if norm is not None:
        bind["norm_w"] = norm.buffers["w"]
    tiles = dict(block_n=choice.block_n, block_k=choice.block_k, num_warps=choice.num_warps, dtype=dtype)
    gemv = _streaming(choice, M, K)
    run = dict(tiles_per_task=choice.tiles_per_task)  # the reduces stay one tile a task
    norm_kw = dict(norm=norm is not None, eps=eps)
    # What the tile's epilogue (or, split-K, the reduce's) writes and reads besides x and w.
    epilogue = {}
    if rope is not None:
        if add is not None or silu is not None:
            raise ValueError(f"lower_decode_step: op {node.name} fuses {rope.name} and {[f.name for f in fused]}: "
                             f"RoPE fuses only into a QKV linear, beside its RMSNorm")
        r, first = rope.dims, rope.name == first_rope
        heads = dict(num_q_heads=r["heads"], num_kv_heads=r["kv_heads"], head_dim=r["head_dim"], K=K,
                     max_seq=max_seq, write_seqlens=first)
        # The family options: the projection's bias, the q / k norm before the rotation.
        heads |= {"bias": True} if "bias" in node.buffers else {}
        heads |= {"qk_norm": True, "qk_eps": eps} if r.get("qk_norm") else {}
        epilogue.update(pos="pos", inv_freq=rope.buffers["inv_freq"],
                        q=activation(rope.outputs[0], M, r["heads"] * r["head_dim"]),
                        k_cache=rope.buffers["k_cache"], v_cache=rope.buffers["v_cache"])
        epilogue |= {"bias": node.buffers["bias"]} if "bias" in node.buffers else {}
        epilogue |= {role: rope.buffers[role] for role in ("q_norm", "k_norm") if role in rope.buffers}
        if first:
            epilogue["seqlens"] = activation("seqlens", M, dt=torch.int32)
    else:
        if "bias" in node.buffers:
            raise ValueError(f"lower_decode_step: op {node.name} has a bias, which only the QKV tiles with RoPE "
                             f"fused add (the plan must fuse its RoPE)")
        if add is not None:
            epilogue["res"] = next(t for t in add.inputs if t not in node.outputs)
        epilogue["out"] = activation(out_name, M, out_cols)
        if ar is not None:  # the tiles (split-K: the reduces) store their partials, then sum them over the ranks
            epilogue.update(res=ar.inputs[1], total=activation(ar.outputs[0], M, N), recv=ar.buffers["recv"],
                            peers=ar.buffers["peers"])
    flags = dict(residual=add is not None, silu_mul=silu is not None)
    if ar is not None:
        flags["all_reduce"] = ar.dims["world"]
    if argmax:
        if choice.split_k != 1 or rope is not None:
            raise ValueError(f"lower_decode_step: op {node.name} fuses the argmax with split_k={choice.split_k}"
                             f"{' and RoPE' if rope is not None else ''}: only whole-K LM head tiles fold "
                             f"the argmax")
        flags["argmax"] = True
        epilogue["best"] = activation("argmax.best", M, dt=torch.int64)
    try:
        if choice.split_k == 1:
            spec = (make_op("qkv_rope_kv", batch=M, **heads, **norm_kw, **tiles, **gemv, **run) if rope is not None
                    else make_op("linear", M=M, N=N, K=K, **flags, **norm_kw, **tiles, **gemv, **run))
            add_op(node.name, spec, **bind, **epilogue)
        else:
            # Split-K: the partials, then reduce tiles that run the epilogue (RoPE's too).
            part = make_op("linear_partial", M=M, N=N, K=K, split_k=choice.split_k, **norm_kw, **tiles, **gemv, **run)
            # (NORM_SQ partials hand the RMSNorm's rstd to the reduce, with their x**2 sums in ws.)
            sq = dict(norm_sq=bool(part.constexprs["NORM_SQ"]), eps=eps)
            # (Reduce tiles may be narrower than the partials': several a partial tile.)
            red_tiles = dict(tiles, block_n=reduce_width(node, choice), part_block_n=choice.block_n)
            red = (make_op("qkv_rope_kv_reduce", batch=M, **heads, split_k=choice.split_k, **sq, **red_tiles)
                   if rope is not None else
                   make_op("linear_reduce", M=M, N=N, K=K, split_k=choice.split_k, **flags, **sq, **red_tiles))
            ws = activation(f"{node.name}.ws", choice.split_k, M, part.constexprs["WS_N"])
            add_op(node.name, part, **bind, ws=ws)
            add_op(node.name, red, ws=ws, **epilogue)
    except ValueError as err:
        raise ValueError(f"lower_decode_step: op {node.name} ({M}x{N}x{K}) with {choice}: {err}") from None
