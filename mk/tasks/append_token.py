"""The last task of a decode step: record each sequence's new token and advance its position.

    tokens[b, pos[b] + 1] = next_ids[b];   pos[b] += 1

``pos[b]`` is the position of the token the step fed in; the token it chose goes one
position later. Keeping the token history and the positions in device memory is what lets
decode steps run back to back with no host work: the host reads ``tokens`` only when it
wants to stream or check for EOS. A position whose successor would fall outside the
history (``pos[b] + 1 >= max_seq``) records nothing and leaves ``pos[b]`` as it is, so a
runaway loop can never write out of bounds. The standalone op (:func:`append_token`) and the
references do the same for a position before the start (``pos[b] + 1 < 0``); the tile, inside
the megakernel, trusts the positions its step wrote.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._device import jit, check_same_device, check_tensor
from ._spec import OpSpec, Region, check_sizes, check_tile, operand_view, register
from .argmax import argmax_unpack_ref


@jit
def append_token_tile(next_ids_ptr, pos_ptr, tokens_ptr, b, stride_tokens, max_seq, tok=None):
    """Sequence ``b``: tokens[b, pos[b] + 1] = next_ids[b], then pos[b] += 1 (when in range).
    ``tok``: the token, when the caller has it (it then also stores next_ids[b] = tok)."""
    if tok is not None:
        tl.store(next_ids_ptr + b, tok.to(next_ids_ptr.dtype.element_ty))
    pos = tl.load(pos_ptr + b)
    if pos + 1 < max_seq:
        if tok is None:
            value = tl.load(next_ids_ptr + b)
        else:
            value = tok
        tl.store(tokens_ptr + b.to(tl.int64) * stride_tokens + pos + 1, value.to(tokens_ptr.dtype.element_ty))
        tl.store(pos_ptr + b, pos + 1)


@jit
def append_token_kernel(next_ids_ptr, pos_ptr, tokens_ptr, stride_tokens, max_seq):
    b = tl.program_id(0)
    # A position before the history's start would write into the previous row (or before the
    # tensor): the standalone op cannot check positions on the host without waiting for the
    # device, so such a sequence records nothing, as one past the end does.
    if tl.load(pos_ptr + b) + 1 >= 0:
        append_token_tile(next_ids_ptr, pos_ptr, tokens_ptr, b, stride_tokens, max_seq)


def _check(next_ids, pos, tokens) -> None:
    check_tensor("tokens", tokens, ndim=2, dtype=(torch.int32, torch.int64))
    batch = tokens.shape[0]
    check_tensor("next_ids", next_ids, shape=(batch,), dtype=(torch.int32, torch.int64))
    check_tensor("pos", pos, shape=(batch,), dtype=(torch.int32, torch.int64))
    check_same_device(next_ids=next_ids, pos=pos, tokens=tokens)


def append_token(next_ids: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place: ``tokens[b, pos[b] + 1] = next_ids[b]`` and ``pos[b] += 1`` for every b.

    Args:
        next_ids: int32/int64 ``[B]``, the tokens chosen this step.
        pos: int32/int64 ``[B]``, the positions fed this step (advanced in place); a sequence
            whose ``pos[b] + 1`` falls outside ``[0, max_seq)`` records nothing and keeps its
            position (no host check: that would wait for the device every step).
        tokens: int32/int64 ``[B, max_seq]``, contiguous: each sequence's history.
    """
    _check(next_ids, pos, tokens)
    if tokens.shape[0]:
        append_token_kernel[(tokens.shape[0],)](next_ids, pos, tokens, tokens.stride(0), tokens.shape[1])


def append_token_ref(next_ids: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor) -> None:
    """:func:`append_token` in plain torch (in place)."""
    for b in range(tokens.shape[0]):
        append_one_ref(next_ids, pos, tokens, b)


def append_one_ref(next_ids: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor, b: int) -> None:
    """Sequence b's step of :func:`append_token_ref` (in place)."""
    p = int(pos[b])
    if 0 <= p + 1 < tokens.shape[1]:
        tokens[b, p + 1] = next_ids[b]
        pos[b] = p + 1


# ---------------------------------------------------------------------------------------
# Megakernel spec: how the op runs as a task of the persistent kernel (mk.tasks._spec)
# ---------------------------------------------------------------------------------------


@register("append_token")
def append_token_op(batch: int, max_seq: int, from_best: bool = False) -> OpSpec:
    """Sequence b's new token into its history, and its position advanced (see
    :mod:`mk.tasks.append_token`). Operands: next_ids ``[batch]``, pos ``[batch]``, tokens
    ``[batch, max_seq]`` (int32/int64). Args: b. The history row is written at a runtime
    position, so the task declares the whole row; reading and writing ``pos[b]`` orders it
    after every task of the step that reads the position. ``from_best``: the token is the
    argmax an LM head folded into operand best int64 ``[batch]`` (:func:`mk.tasks.linear.linear_op`'s
    ``argmax``); the task writes it to next_ids[b] and zeroes best[b] for the next step
    (:func:`mk.tasks.argmax.argmax_take`)."""
    check_sizes("append_token", batch=batch, max_seq=max_seq)

    def seq(a):
        check_tile("append_token", "b", a["b"], batch)
        return a["b"]

    def run(bufs, a):
        b = seq(a)
        next_ids = operand_view("append_token", "next_ids", bufs["next_ids"], 1, batch)[0]
        if from_best:
            best = operand_view("append_token", "best", bufs["best"], 1, batch)[0]
            next_ids[b] = argmax_unpack_ref(best[b])
            best[b] = 0
        append_one_ref(next_ids, operand_view("append_token", "pos", bufs["pos"], 1, batch)[0],
                       operand_view("append_token", "tokens", bufs["tokens"], batch, max_seq), b)

    def reads(a, bind):
        b = seq(a)
        return [Region(bind["best" if from_best else "next_ids"], 0, 1, b, b + 1), Region(bind["pos"], 0, 1, b, b + 1)]

    def writes(a, bind):
        b = seq(a)
        regs = [Region(bind["pos"], 0, 1, b, b + 1), Region(bind["tokens"], b, b + 1, 0, max_seq)]
        if from_best:
            regs += [Region(bind["next_ids"], 0, 1, b, b + 1), Region(bind["best"], 0, 1, b, b + 1)]
        return regs

    body = "append_token_tile(next_ids, pos, tokens, b, MAX_SEQ, MAX_SEQ)"
    if from_best:
        body = "append_token_tile(next_ids, pos, tokens, b, MAX_SEQ, MAX_SEQ, tok=argmax_take(best, b)[0])"
    return OpSpec(name="append_token", operands=("next_ids", "pos", "tokens") + (("best",) if from_best else ()),
                  args=("b",), body=body,
                  imports=("from mk.tasks.append_token import append_token_tile",
                           "from mk.tasks.argmax import argmax_take"),
                  constexprs={"BATCH": batch, "MAX_SEQ": max_seq, **({"FROM_BEST": 1} if from_best else {})},
                  num_warps=1, run=run, reads=reads, writes=writes, sync_operands=("best",) if from_best else (),
                  tiles=lambda _: [{"b": b} for b in range(batch)])
