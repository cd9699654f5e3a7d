"""The opcode registry: how each task type runs inside the megakernel.

An :class:`OpSpec` says, for one specialisation of a task (its constexpr tile sizes and
operand dtypes fixed), which buffers it touches, which integer arguments its descriptor
carries, the Triton source that runs it (calling the task's device function from
:mod:`mk.tasks`), optional source that issues weight loads *before* the dependency wait,
a torch version of the same tile for the Python VM, and the regions it reads and writes
(the planner and the VM derive dependencies from them).

Generated code sees, for each operand role ``r``, a pointer variable ``r`` already cast to
its element type, and for each argument ``a`` an int32 scalar ``a``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

#: Triton spelling of each supported element type.
TL_DTYPES = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16",
             torch.int32: "tl.int32", torch.int64: "tl.int64"}


@dataclass(frozen=True)
class Region:
    """A box of a buffer viewed as 2-D ``[rows, cols]``: rows [r0, r1) × cols [c0, c1)."""

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
    #: :func:`mk.persistent.taskops.decode_attention_op`): the graph's waits count on
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
    #: operand roles holding such counters: zero between launches, zeroed again by
    #: Megakernel.reset() after a failed one.
    sync_operands: tuple[str, ...] = ()

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
    return sorted(_REGISTRY)
