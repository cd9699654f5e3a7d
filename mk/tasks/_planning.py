"""How the planner plans an op: one :class:`OpKind` object per kind of op of a decode step,
registered beside its task (``mk/tasks/<op>.py``) when :mod:`mk.tasks` is imported.

The planner (:mod:`mk.planner`) is generic over kinds: for an op of the step's graph (an
``OpNode``: its kind, dims, tensors, bytes and flops, the buffers it binds) it asks the
op's kind for everything that depends on what the op is:

* the tiles to try (:meth:`OpKind.candidates`, as :class:`OpChoice` values) and the
  shared memory one task takes (:meth:`OpKind.smem_bytes`);
* its dependency phases, each a number of tasks counted from the op's own megakernel specs
  (:meth:`OpKind.specs`, the same specs the lowering adds), and what prices a task of each
  beyond the generic model (:meth:`OpKind.phase_terms`);
* which fusions are legal (:meth:`OpKind.fuses_as_epilogue`, :meth:`OpKind.fuses_as_prologue`,
  :meth:`OpKind.runs_alone`) and what a fused op changes in its host's traffic
  (:meth:`OpKind.fused_bytes`);
* how it lowers to tasks (:meth:`OpKind.lower`, over a lowering context the planner
  passes: :class:`LowerContext` says what it offers), and the shapes of the buffers it
  binds (:meth:`OpKind.buffer_shape`).

Nothing here imports the planner: nodes, choices, devices and contexts are read by their
attributes.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import torch

#: Bytes of an activation element: the lowering keeps every activation float32, whatever the
#: weights' dtype.
ACTIVATION_BYTES = 4
#: Shared memory of the small tasks (embedding, RMSNorm, RoPE, merges, reduces, argmax):
#: cross-warp reduction scratch, at most 2 KiB in the compiled megakernel.
SMALL_TASK_SMEM = 2 * 1024
#: How a decode step ends: greedy argmax, temperature sampling (both + the token append), or
#: the logits (a caller that picks the token itself).
GREEDY, SAMPLE, LOGITS = "argmax", "sample", "logits"
NEXT_TOKEN = (GREEDY, SAMPLE, LOGITS)


@dataclass(frozen=True)
class OpChoice:
    """What the search picks for one op (the fields each kind reads; the rest stay default).

    block_n, block_k, split_k, stages, num_warps: tile of a linear (block_m follows M).
    kv_splits: KV-length splits of decode attention.
    fuse: names of ops folded into this one (they then have no task of their own).
    tma_stages: depth of the shared-memory ring the TMA unit streams a linear's weights
        through (0: the register path).
    tiles_per_task: a linear task is a run of this many adjacent tiles along N, streamed as
        one (:func:`mk.tasks.linear.linear_run`): a worker with several tiles of an op pays
        a task's overhead (setup, the stream's ramp) once. The split-K reduces stay one
        tile a task.
    reduce_block_n: split-K only: the width of the reduce tasks' tiles, a divisor of
        block_n (0: block_n). A reduce reads its tile's float32 partials from L2 on the
        layer's critical path; narrower tiles spread that over more (idle) workers.
    """

    block_n: int = 0
    block_k: int = 0
    split_k: int = 1
    stages: int = 1
    num_warps: int = 4
    kv_splits: int = 1
    fuse: tuple[str, ...] = ()
    tma_stages: int = 0
    tiles_per_task: int = 1
    reduce_block_n: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PhaseTerms:
    """What prices one task of an op's phase beyond bytes at a worker's or DRAM's rate (the
    planner's generic model, :func:`mk.planner.cost.phase_costs`):

    ``task_bytes``: the bytes a task streams (None: the phase's bytes over its tasks);
    ``reread``: bytes a task reads again through its worker (from L2: a linear's x rows);
    ``ring_s``: the least seconds a weight byte takes through a TMA ring (0: no ring);
    ``tma``: the task streams through the TMA unit (the worker's TMA rate applies)."""

    task_bytes: float | None = None
    reread: float = 0.0
    ring_s: float = 0.0
    tma: bool = False


class LowerContext(Protocol):
    """What :meth:`OpKind.lower` may ask of the lowering (:mod:`mk.planner.lower`)."""

    batch: int
    max_seq: int
    eps: float
    next_token: str
    rank: int
    nodes: dict  # op name -> OpNode
    choices: dict  # op name -> OpChoice (the plan's)
    fused_into: dict  # op name -> its host's name

    def add(self, node_name: str, spec, rows: int | None = None, numbered: dict | None = None, **bind) -> None:
        """Add every task of ``spec`` (its tiles) for op ``node_name``, binding roles to
        buffers; ``numbered``: args of every tile that carry an op's number in the step
        (``{"hop": node}``: the tiles' arg ``hop`` is :meth:`number` of ``node``)."""

    def activation(self, name: str, *shape: int, dt: torch.dtype = torch.float32) -> str:
        """A float32 (or ``dt``) activation of ``shape`` named ``name``; its name."""

    def first(self, node) -> bool:
        """Whether ``node`` is the first op of its kind in the step."""

    def number(self, node) -> int:
        """``node``'s index among the step's ops of its kind."""

    def dtype(self, buffer: str) -> torch.dtype:
        """The element type of the caller's buffer ``buffer``."""


class OpKind:
    """How the planner plans and lowers the ops of one kind (see the module docstring).

    The defaults describe a row-wise op that runs the runtime's tiles, one task a row: it
    has nothing to choose, takes :data:`SMALL_TASK_SMEM`, streams no weights through a ring
    and fuses into nothing."""

    #: the OpNode kind this object plans
    kind: str = ""
    #: kinds of host whose tiles this op may fold into
    hosts: frozenset = frozenset()
    #: folds into a later host's prologue (an RMSNorm into the next linear), not its epilogue
    prologue: bool = False
    #: its tasks stream no weights, so whoever waits on it waits with DRAM idle (its
    #: consumers' rings fetch during that wait: the planner's early part)
    leaves_dram_idle: bool = False
    #: chooses the step's next token: a step ending at the logits has no task of it
    chooses_token: bool = False
    #: fused into a host's tiles or in tiles of its own, the cost model cannot tell which is
    #: faster: measure mode also times the plan with it in tiles of its own
    measure_unfused: bool = False
    #: the step numbers its ops of this kind (:meth:`LowerContext.number`, an arg of their
    #: tiles); at most this many in a step (None: not numbered)
    number_limit: int | None = None

    # ------------------------------------------------------------------ search

    def candidates(self, node, device, dtype_bytes: int = 2, workers: int | None = None) -> list[OpChoice]:
        """Every choice the search tries for ``node`` (before the shared-memory check)."""
        return [OpChoice()]

    def naive_choice(self, node) -> OpChoice:
        """A fixed, unfused choice: the baseline a search must beat."""
        return OpChoice()

    def smem_bytes(self, node, choice: OpChoice, dtype_bytes: int = 2) -> int:
        """Shared memory one task of the op takes in the megakernel."""
        return SMALL_TASK_SMEM

    def describe(self, choice: OpChoice) -> str:
        """The choice's tile, for a plan's listing."""
        return "the runtime's row tiles"

    def slows_kernel(self, node, choice: OpChoice) -> bool:
        """Whether the choice slows the whole megakernel (its registers make every op spill),
        which a sum over ops cannot see: the planner also searches without such choices."""
        return False

    def may_slow_kernel(self, node) -> bool:
        """Whether some choice of ``node`` may slow the whole megakernel (:meth:`slows_kernel`)."""
        return False

    def fuses_as_epilogue(self, node, host, host_choice: OpChoice) -> bool:
        """Whether ``node`` can fold into the tiles of ``host`` under ``host_choice``."""
        return host.kind in self.hosts and not self.prologue

    def fuses_as_prologue(self, node, later) -> bool:
        """Whether ``node`` can fold into the tiles of ``later`` (its ``prologue_host``: a
        later op), done by them before their own work."""
        return self.prologue and later.kind in self.hosts

    def runs_alone(self, node, host) -> bool:
        """Whether ``node`` (which may fuse into ``host``) can also run as tasks of its own."""
        return True

    def needs_whole_k_host(self, node) -> bool:
        """Whether ``node`` must fold into its host, whose tiles must then cover all of K."""
        return False

    # ------------------------------------------------------------------ cost

    def bytes_flops(self, node, choice: OpChoice) -> tuple[int, int]:
        """Bytes and flops of the op under the choice (workspaces included)."""
        return node.bytes, node.flops

    def fused_bytes(self, node) -> int:
        """What folding ``node`` into its host changes in the host's memory traffic: by
        default the host reads what ``node`` read from outside instead of ``node``'s input,
        and writes ``node``'s output instead of its own (reads - writes)."""
        return node.bytes_read - node.bytes_written

    def tail_bytes(self, node) -> int:
        """Bytes of ``node``'s work that a host runs after its stream, at the end of its
        last phase (:meth:`tail_seconds`), not spread over the stream; 0 for most fusions."""
        return 0

    def tail_seconds(self, node, tasks: int, busy: int, device) -> tuple[float, ...]:
        """Seconds a host task spends on ``node`` fused into it after its stream, where the
        host's last phase has ``tasks`` tasks, ``busy`` of them at once: the terms, added to
        the task's time one after another."""
        return ()

    def host_tail_phases(self, node) -> list[tuple[int, int]]:
        """Phases ``node`` adds after its host's when fused into it, as (tasks, bytes)."""
        return []

    def specs(self, node, choice: OpChoice, fused: list = ()) -> list[tuple[object, int | None]]:
        """The megakernel specs the op (with ``fused`` folded in) lowers to, one per
        dependency phase, with the row count their tiles need (:func:`mk.tasks.op_tiles`):
        what the planner counts tasks from. The lowering adds the same specs; here their
        dtypes and constants are placeholders, which do not change the tiles."""
        raise NotImplementedError(f"op kind {self.kind!r} lists no specs")

    def phases(self, node, choice: OpChoice, nbytes: int = 0, fused: list = ()) -> list[tuple[int, int]]:
        """The op's dependency phases as (tasks, bytes of ``nbytes``): tasks of one phase run
        in parallel, the next phase waits for them. By default one phase per spec (tasks
        counted from its tiles), the bytes all in the first; fused ops may add phases after
        (:meth:`host_tail_phases`)."""
        counts = spec_task_counts(self, node, choice, fused)
        out = [(counts[0], nbytes)] + [(n, 0) for n in counts[1:]]
        return out + [p for f in fused for p in op_kind(f.kind).host_tail_phases(f)]

    def phase_terms(self, node, choice: OpChoice, device, phase: int, phase_tasks: int, phase_bytes: int,
                    dtype_bytes: int = 2) -> PhaseTerms:
        """What prices a task of phase ``phase`` beyond the generic model (:class:`PhaseTerms`)."""
        return PhaseTerms()

    def stream_floor(self, node, choice: OpChoice, device, phase: int, stream: float, task_bytes: float,
                     phase_tasks: int, busy: int) -> float:
        """A task's stream time (``stream`` seconds by the generic model) with the kind's own
        limits applied (a tile's tensor-core rate, a link to other GPUs)."""
        return stream

    def prologue_seconds(self, node, choice: OpChoice, device, stream_s: float, dtype_bytes: int = 2) -> float:
        """The part of a task's first-phase stream that arrives while it waits for its inputs
        where DRAM idles then (its ring's prologue, issued before the wait); 0 by default."""
        return 0.0

    def exposed_seconds(self, node, choice: OpChoice, device, task_bytes: float, dtype_bytes: int = 2) -> float:
        """What a first-phase task spends on its stream beyond its bytes (a ring's ramp)."""
        return 0.0

    # ------------------------------------------------------------------ lowering

    def buffer_shape(self, node, role: str, max_seq: int) -> tuple[tuple[int, ...], str]:
        """Shape of the buffer ``node`` binds as ``role``, and its element type: ``"weight"``
        (the weights' dtype), ``"kv"`` (the KV cache's) or a torch dtype."""
        raise ValueError(f"op {node.name} ({self.kind}): no buffer role {role!r}")

    def lower(self, node, choice: OpChoice | None, ctx: LowerContext) -> None:
        """Add the op's tasks to the step (``choice`` None: fused into ``ctx.fused_into[node.name]``)."""
        raise ValueError(f"lower_decode_step: op {node.name} of kind {self.kind} has no task "
                         f"(it must be fused into {node.fuse_into})")

    def lowers_when_fused(self, node) -> bool:
        """Whether the op still adds tasks of its own when fused into a host (the argmax's
        token append after an LM head that folded it)."""
        return False


class FusedOnlyKind(OpKind):
    """An op that has no task of its own in a decode step: it always folds into its host's
    tiles (a residual add, SiLU·mul in the gate/up linear's epilogue)."""

    def runs_alone(self, node, host) -> bool:
        return host is None  # (lowering one without a host fails, naming it)

    def phases(self, node, choice: OpChoice, nbytes: int = 0, fused: list = ()) -> list[tuple[int, int]]:
        """Priced as one task a row: the search prices every op alone before it learns that
        this one fuses."""
        return [(node.dims["rows"], nbytes)]


_KINDS: dict[str, OpKind] = {}


def register_kind(obj: OpKind) -> OpKind:
    """Register ``obj`` as the planning of its kind (once per kind)."""
    if not obj.kind:
        raise ValueError("an OpKind needs a kind")
    if obj.kind in _KINDS:
        raise ValueError(f"op kind {obj.kind!r} registered twice")
    _KINDS[obj.kind] = obj
    return obj


def op_kind(kind: str) -> OpKind:
    """The registered planning of op kind ``kind``."""
    try:
        return _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown op kind {kind!r}; registered: {sorted(_KINDS)}") from None


def op_kinds() -> list[str]:
    """Every registered op kind, sorted."""
    return sorted(_KINDS)


def spec_task_counts(kind: OpKind, node, choice: OpChoice, fused: list = ()) -> list[int]:
    """Tasks of each spec of ``node`` with ``fused`` folded in, under ``choice``
    (:meth:`OpKind.specs`), counted from the specs' own tiles; cached by what decides them
    (the kinds, dims and bound roles of the ops, and the choice)."""
    key = tuple((n.kind, tuple(sorted(n.dims.items())), tuple(sorted(n.buffers))) for n in (node, *fused))
    return list(_cached_counts(kind.kind, _Keyed((node, tuple(fused)), key), replace(choice, fuse=())))


class _Keyed:
    """Ops keyed by what their specs' tiles follow from, not by their names."""

    __slots__ = ("ops", "key")

    def __init__(self, ops, key):
        self.ops, self.key = ops, key

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return self.key == other.key


@functools.lru_cache(maxsize=4096)
def _cached_counts(kind: str, keyed: _Keyed, choice: OpChoice) -> tuple[int, ...]:
    from ._spec import op_tiles

    node, fused = keyed.ops
    return tuple(len(op_tiles(spec, rows)) for spec, rows in op_kind(kind).specs(node, choice, list(fused)))
