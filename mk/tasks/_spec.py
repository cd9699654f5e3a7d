"""How an op runs inside the megakernel: :class:`OpSpec`, the regions it touches, the
registry of op factories, and the small checks and views the ops' specs share.

An :class:`OpSpec` says, for one specialisation of a task (its constexpr tile sizes and
operand dtypes fixed), which buffers it touches, which integer arguments its descriptor
carries, the Triton source that runs it (calling the task's device function), optional
source that issues weight loads *before* the dependency wait, a torch version of the same
tile for the Python VM, the regions it reads and writes (the engine, :mod:`mk.persistent`,
derives dependencies from them) and the descriptor args of every task of one whole op.
Each op's factory lives beside its device function in ``mk/tasks/<op>.py`` and registers
itself when :mod:`mk.tasks` is imported.

Generated code sees, for each operand role ``r``, a pointer variable ``r`` already cast to
its element type, and for each argument ``a`` an int32 scalar ``a``. Buffers are addressed
as 2-D row-major ``[rows, cols]`` views (a 1-D buffer is one row), which is also how
regions are given.

Every static parameter that changes the generated code is a constexpr (eps included):
the constexprs are the op's key, and tasks with one key share one generated branch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

import torch

#: Triton spelling of each supported element type.
TL_DTYPES = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16",
             torch.float8_e4m3fn: "tl.float8e4nv",
             torch.int32: "tl.int32", torch.int64: "tl.int64"}


class Region(NamedTuple):
    """A box of a buffer viewed as 2-D ``[rows, cols]``: rows [r0, r1) × cols [c0, c1).

    A named tuple, not a frozen dataclass: a step's tasks make hundreds of thousands of
    regions when its dependencies are derived, and a frozen dataclass takes ~1.5 µs to
    build one, a named tuple under half of that."""

    buffer: str
    r0: int
    r1: int
    c0: int
    c1: int

    def intersects(self, other: "Region") -> bool:
        """Share at least one element (an empty box shares none)."""
        return (self.buffer == other.buffer and self.size > 0 and other.size > 0
                and self.r0 < other.r1 and other.r0 < self.r1 and self.c0 < other.c1 and other.c0 < self.c1)

    @property
    def size(self) -> int:
        return max(0, self.r1 - self.r0) * max(0, self.c1 - self.c0)


@dataclass(frozen=True)
class OpSpec:
    """One task type as the megakernel runs it (see module docstring)."""

    name: str
    operands: tuple[str, ...]
    args: tuple[str, ...]
    body: str
    imports: tuple[str, ...] = ()
    prefetch: str = ""
    #: source run just before the op's dependency waits, binding names the body then uses
    #: (weights loaded into registers while the inputs are still being produced)
    preload: str = ""
    #: the body waits for the task's inputs itself, so that it can start loads that do not
    #: depend on them first: it calls ``task_wait(task_wait_args, task_wait_state,
    #: TASK_WAIT_FLAGS)`` (names the generated code binds) once, before it reads any input,
    #: and assigns ``ok, last_ev, last_need, t_ready`` from what that returns (see
    #: :func:`mk.tasks.linear.linear_run`'s WAIT). After a failed wait such a body still runs
    #: to its end (what it stores is garbage, as is every output of a failed launch); the
    #: task then does not signal and the worker stops, as after any failed wait. A task that
    #: finds, before its wait, that it will read and write nothing (an attention split past
    #: the sequence) may skip the call (``t_ready`` then stays the body's start). Safe only where
    #: each consumer also waits for a member of its team that did wait (see
    #: :func:`mk.tasks.decode_attention.decode_attention_op`): the graph's waits count on
    #: what their producers waited for.
    waits_in_body: bool = False
    constexprs: Mapping[str, int] = field(default_factory=dict)
    num_warps: int = 4
    #: run(buffers_by_role, args) executes one tile with torch ops (the VM's semantics).
    run: Callable[[dict, dict], None] | None = field(default=None, compare=False, repr=False)
    #: reads(args, roles_to_buffer_names) / writes(...) -> list[Region]
    reads: Callable[[dict, dict], list] | None = field(default=None, compare=False, repr=False)
    writes: Callable[[dict, dict], list] | None = field(default=None, compare=False, repr=False)
    #: team(args) -> key: consecutive tasks of this op (same bindings) with one key are a
    #: team that synchronises itself (counters in an operand, never a wait): its members
    #: never depend on one another, and its regions are the whole team's (each member
    #: declares what any of them may touch: the last to arrive may do the team's work).
    team: Callable[[dict], object] | None = field(default=None, compare=False, repr=False)
    #: operand roles holding such counters: zero between launches (or, for the ranks'
    #: flags and pushed words, counting them), zeroed again by Megakernel.reset() after a
    #: failed one.
    sync_operands: tuple[str, ...] = ()
    #: operand roles read on every rank of a tensor-parallel step, each at its own rank's
    #: copy (:mod:`mk.tasks.all_reduce`): the task waits for its peers' part first. The VM
    #: hands a run each rank's tensor of the role under ``"@" + role``.
    peer_operands: tuple[str, ...] = ()
    #: tiles(rows) -> the descriptor args of every task of one whole op, in the order a
    #: graph should add them (:func:`op_tiles`); ``rows`` for ops whose spec leaves the
    #: row count open (None where the spec fixes it).
    tiles: Callable[[int | None], list] | None = field(default=None, compare=False, repr=False)

    @functools.cached_property  # (a frozen spec: computed once; large graphs ask it per task)
    def key(self) -> str:
        """Identity of the generated branch: name plus constexprs."""
        cx = ",".join(f"{k}={v}" for k, v in sorted(self.constexprs.items()))
        return f"{self.name}[{cx}]" if cx else self.name


_REGISTRY: dict[str, Callable[..., OpSpec]] = {}


def register(name: str):
    """Register a factory ``(**static params) -> OpSpec`` under ``name``."""

    def deco(factory):
        if name in _REGISTRY:
            raise ValueError(f"op {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def make_op(name: str, **params) -> OpSpec:
    """Build the OpSpec of registered op ``name`` for the given static parameters."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown op {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**params)


def registered_ops() -> list[str]:
    """The names :func:`make_op` knows, sorted."""
    return sorted(_REGISTRY)


def op_tiles(spec: OpSpec, rows: int | None = None) -> list[dict]:
    """Descriptor args of every task of one whole op, in the order a graph should add them
    (:attr:`OpSpec.tiles`). ``rows``: the row count of an op whose spec leaves it open
    (rmsnorm, silu_mul); the others fix theirs."""
    if spec.tiles is None:
        raise ValueError(f"op_tiles: op {spec.name!r} does not list its tiles")
    return spec.tiles(rows)


def rows_given(op: str, rows: int | None) -> int:
    """``rows`` for :attr:`OpSpec.tiles` of an op whose spec leaves its row count open;
    refused when None."""
    if rows is None:
        raise ValueError(f"op_tiles: {op} needs rows")
    return rows


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """The 2-D row-major view regions refer to (a view, so the VM writes in place)."""
    return t.view(1, -1) if t.dim() < 2 else t.view(-1, t.shape[-1])


def operand_view(op: str, role: str, t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """VM: the 2-D view of operand ``role``, checked to be the ``[rows, cols]`` the op's regions
    are given in (a buffer of another shape would make the derived dependencies wrong)."""
    v = as_2d(t)
    if tuple(v.shape) != (rows, cols):
        raise ValueError(f"{op}: operand {role!r} must view as [{rows}, {cols}] (rows x last dim), "
                         f"got shape {tuple(t.shape)}")
    return v


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for ints."""
    return -(-a // b)


def check_tile(op: str, name: str, value: int, count: int) -> None:
    """Refuse tile index ``value`` of arg ``name`` outside [0, count)."""
    # reads()/writes() run when the graph derives dependencies, so a bad tile index is
    # reported there, naming it, instead of as a silent empty region.
    if not 0 <= value < count:
        raise ValueError(f"{op}: {name}={value} out of range [0, {count})")


def check_sizes(op: str, **sizes) -> None:
    """Refuse any size that is not an int >= 1 (bools included)."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{op}: {name} must be an int >= 1, got {v!r}")


def check_pow2(op: str, name: str, v: int, minimum: int = 1) -> int:
    """``v``, refused unless a power of two >= ``minimum``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or v & (v - 1):
        raise ValueError(f"{op}: {name} must be a power of two >= {minimum}, got {v!r}")
    return v


def block_cols(op: str, a, blocks: int, block: int, width: int) -> tuple[int, int]:
    """Columns [c0, c1) of tile ``a["col_block"]`` of a row cut into ``blocks`` blocks of
    ``block`` (the last clipped to ``width``)."""
    check_tile(op, "col_block", a["col_block"], blocks)
    c0 = a["col_block"] * block
    return c0, min(c0 + block, width)
