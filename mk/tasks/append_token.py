"""The last task of a decode step: record each sequence's new token and advance its position.

    tokens[b, pos[b] + 1] = next_ids[b];   pos[b] += 1

``pos[b]`` is the position of the token the step fed in; the token it chose goes one
position later. Keeping the token history and the positions in device memory is what lets
decode steps run back to back with no host work: the host reads ``tokens`` only when it
wants to stream or check for EOS. A position whose successor would fall outside the
history (``pos[b] + 1 >= max_seq``) records nothing and leaves ``pos[b]`` as it is, so a
runaway loop can never write out of bounds.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._device import jit, check_same_device, check_tensor


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
    append_token_tile(next_ids_ptr, pos_ptr, tokens_ptr, tl.program_id(0), stride_tokens, max_seq)


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
        pos: int32/int64 ``[B]``, the positions fed this step (advanced in place).
        tokens: int32/int64 ``[B, max_seq]``, contiguous: each sequence's history.
    """
    _check(next_ids, pos, tokens)
    if tokens.shape[0]:
        append_token_kernel[(tokens.shape[0],)](next_ids, pos, tokens, tokens.stride(0), tokens.shape[1])


def append_token_ref(next_ids: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor) -> None:
    """:func:`append_token` in plain torch (in place)."""
    for b in range(tokens.shape[0]):
        p = int(pos[b])
        if p + 1 < tokens.shape[1]:
            tokens[b, p + 1] = next_ids[b]
            pos[b] = p + 1
