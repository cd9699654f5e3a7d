"""The op DAG of one decode step: what the planner plans.

A model family hands the planner an :class:`OpGraph` (see :func:`mk.models.blocks.decode_graph`):
nodes are unfused ops of the kinds registered in :mod:`mk.tasks` (:func:`mk.tasks.op_kinds`) with
their shapes, bytes and flops
(from the tasks' own cost hooks) and the buffers they bind (weights, caches); edges are the
tensors between them. Fusions (RMSNorm prologue, SiLU·mul and residual epilogues, ...) are
the search's choice, not the graph's: the graph lists every op on its own, and marks which
neighbours *may* fuse. Nothing here knows which model the graph came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mk.tasks import TaskCost, op_kinds


@dataclass(frozen=True)
class OpNode:
    """One unfused op: its kind, tensors in and out, sizes, and what it moves and computes.

    ``dims`` are the kind's own sizes (a linear: M, N, K; attention: batch, heads, kv_heads,
    head_dim, kv_len; ...). ``fuse_into`` names the op this one may be folded into;
    ``fuse_later``, a later op whose tiles may instead take it as their prologue (where its
    kind allows: :meth:`mk.tasks.OpKind.fuses_as_prologue`).
    ``buffers`` maps the op's roles to the caller's buffers it binds besides the tensors of
    the graph (a linear's ``w`` and ``bias``, attention's ``k_cache`` and ``v_cache``, ...).
    ``scope`` prefixes the names of the tensors a repeated block (a layer) gives the op:
    tensors equal but for their scope play one role, and a step may keep one copy of them.
    """

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dims: dict
    bytes_read: int
    bytes_written: int
    flops: int
    layer: int = -1
    fuse_into: str | None = None
    buffers: dict = field(default_factory=dict)
    scope: str = ""
    fuse_later: str | None = None

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def prologue_host(self) -> str | None:
        """The later op whose prologue this one would fold into: ``fuse_later``, or for an
        op that only ever folds forward (an RMSNorm) its ``fuse_into``."""
        return self.fuse_later or self.fuse_into


@dataclass
class OpGraph:
    """Ops in program order (a topological order) and the tensors that link them.

    ``name`` says what the graph is of (a model's name); ``dtype_bytes`` is the weights'
    element size, which the tiles' shared memory depends on."""

    name: str
    batch: int
    kv_len: int
    dtype_bytes: int = 2
    nodes: list[OpNode] = field(default_factory=list)

    def add(self, node: OpNode) -> OpNode:
        if node.kind not in op_kinds():
            raise ValueError(f"op {node.name}: unknown kind {node.kind!r}; registered: {op_kinds()}")
        self.nodes.append(node)
        return node

    def producers(self) -> dict[str, str]:
        """Tensor -> the op that writes it last."""
        return {t: n.name for n in self.nodes for t in n.outputs}

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer op, consumer op, tensor) for every tensor an op reads from an earlier op."""
        out, last = [], {}
        for n in self.nodes:
            for t in n.inputs:
                if t in last:
                    out.append((last[t], n.name, t))
            for t in n.outputs:
                last[t] = n.name
        return out

    def node(self, name: str) -> OpNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no op named {name!r}")

    @property
    def layers(self) -> int:
        """How many repeated blocks (layers) the graph has."""
        return 1 + max((n.layer for n in self.nodes), default=-1)

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.nodes)

    @property
    def flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def summary(self) -> dict:
        kinds: dict[str, int] = {}
        for n in self.nodes:
            kinds[n.kind] = kinds.get(n.kind, 0) + 1
        return {"model": self.name, "batch": self.batch, "kv_len": self.kv_len, "ops": len(self.nodes),
                "kinds": kinds, "bytes": self.bytes, "flops": self.flops}

    def to_json(self, indent: int | None = 1) -> str:
        """The graph as JSON; ``indent=None``: compact, as the caches key on it (C-encoded, and
        each node's fields as they are rather than asdict's deep copy: a few ms for an 8B step)."""
        return json.dumps({**self.summary(), "nodes": [vars(n) for n in self.nodes]}, indent=indent)


def add_cost(rows: int, n: int, dtype_bytes: int) -> TaskCost:
    """Bytes and flops of a residual add of ``[rows, n]``."""
    return TaskCost(2 * rows * n * dtype_bytes, rows * n * dtype_bytes, rows * n)
