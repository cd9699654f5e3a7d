"""Decode attention: one query token per sequence against its KV cache (split-KV, GQA).

For sequence b, query head h and its KV head ``kv = h // G`` (G = Hq / Hkv, the
grouping of Hugging Face's ``repeat_interleave``), over the ``L = seqlens[b]`` cached
positions:

    s[j]   = scale * q[b, h] · k_cache[b, kv, j]           j < L
    out    = Σ_j softmax(s)[j] * v_cache[b, kv, j]

The KV length is cut into ``num_splits`` slices (flash-decoding). The partial task
``(b, kv, split)`` loads each K/V block once for all G query heads of the group and
writes, per query head, the slice's normalised output and its log-sum-exp:

    o_part[b, h, split, :]  float32, Σ_j∈slice p_j v_j / Σ_j∈slice p_j   (0 for an empty slice)
    lse[b, h, split]        float32, natural log of Σ_j∈slice exp(s_j)   (-inf for an empty slice)

The merge task ``(b, h)`` combines them: ``out = Σ_s exp(lse_s - M) o_s / Σ_s exp(lse_s - M)``
with ``M = max_s lse_s``; an empty slice has weight exp(-inf) = 0. In one launch
(:func:`decode_attention_tile`) there is no merge task: each split counts itself in
``arrivals[b, kv]`` when its partial is stored, and the group's last split to arrive
merges the group's heads (and sets the count back to 0), so nothing waits for anything. Slices are cut per
sequence: ``ceil(L / num_splits)`` rounded up to whole BLOCK_N blocks, so a short
sequence fills the first slices and leaves the others empty. In one launch only the *live*
splits (those holding a key) take part: a sequence that fits in one slice is written
straight to the output by split 0 (no workspace, no count, no merge), and otherwise the
last of the live splits merges them. A decode step's attention cost then follows the
sequence's length, not the number of splits planned for the longest one.

Sliding window (Mistral): with ``window = W`` the query at position ``L - 1`` attends the
keys ``j`` with ``L - 1 - W < j <= L - 1``, i.e. the last ``min(L, W)`` keys, itself included.
This is Hugging Face's rule (``transformers.masking_utils.sliding_window_overlay``:
``kv_idx > q_idx - sliding_window``, with the causal mask). The slices then cut
``[max(L - W, 0), L)`` instead of ``[0, L)``: keys before the window are neither read nor
counted, and the live splits are those of the window's ``min(L, W)`` keys.

KV cache layout (shared with :mod:`mk.tasks.rope`): ``[B, Hkv, S_max, D]``; positions
``>= seqlens[b]`` are never read, so they may hold anything (even NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from ._dot import mma
from .linear.prefetch import _prefetch_l2

from ._cost import TaskCost
from ._planning import ACTIVATION_BYTES, OpChoice, OpKind, PhaseTerms, op_kind, register_kind
from ._device import (jit, check_positive_int, check_same_device, check_same_dtype, check_tensor, is_capturing, sm_count,
                      supported_dtypes)
from ._spec import OpSpec, Region, cdiv, check_pow2, check_sizes, check_tile, operand_view, register
from ._team import last_to_arrive

#: Most KV splits one call may use (the merge holds [num_splits, D] float32 in registers).
MAX_NUM_SPLITS = 128

#: tl.dot needs every dimension >= 16, so the query-head group is padded up to this.
MIN_DOT_DIM = 16

_SEQLEN_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class AttentionPrologue:
    """Work an op folded into decode attention does in each live split after the split's
    wait, before it attends (:func:`decode_attention_op`'s ``prologue``): RoPE with Qwen3's
    q/k norm (:func:`mk.tasks.rope.rope_kv_attention_prologue`), so that it needs no phase
    of its own whatever the QKV tiling.

    ``body``: device code run by every live split; it may read ``b``, ``kv_head``, ``split``
    and ``attn_live`` (the sequence's live splits), the attention's constexprs and its own
    (``constexprs``), and the operands it adds (``operands``), calling what ``imports``
    brings in. The split's own loads come after a block barrier, so they see what the body
    stored. ``run(bufs, b, kv, split, live)``: the same in torch (the VM's). ``reads(bind, b,
    kv)`` / ``writes(bind, b, kv)``: its regions for the group of KV head ``kv`` of sequence
    b, declared by every split of the group (any of them may be the one that writes)."""

    operands: tuple[str, ...]
    body: str
    imports: tuple[str, ...]
    constexprs: dict
    run: Callable
    reads: Callable
    writes: Callable


#: No work folded in: the attention's own splits.
_NO_PROLOGUE = AttentionPrologue(operands=(), body="", imports=(), constexprs={}, run=lambda *_: None,
                                 reads=lambda *_: [], writes=lambda *_: [])


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """Tile sizes of the partial task (what its shared memory and registers depend on)."""

    block_g: int        # query heads of one group, padded to a power of 2 >= 16 for tl.dot
    block_n: int        # KV positions per loop step
    block_d: int        # head_dim padded to a power of 2 >= 16
    num_warps: int = 4
    num_stages: int = 2
    dtype_bytes: int = 2  # of q and the KV cache


def decode_attention_config(num_q_heads: int, num_kv_heads: int, head_dim: int,
                            dtype_bytes: int = 2) -> DecodeAttentionConfig:
    """Default tile sizes for a model shape (pure; the planner may search around it)."""
    group = num_q_heads // num_kv_heads
    block_d = max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    # Two [BLOCK_N, BLOCK_D] operand tiles per stage: keep them near 16 KiB each in bf16.
    block_n = 64 if block_d <= 128 else 32
    return DecodeAttentionConfig(
        block_g=max(MIN_DOT_DIM, triton.next_power_of_2(group)), block_n=block_n, block_d=block_d,
        num_warps=4, num_stages=2, dtype_bytes=dtype_bytes)


def decode_attention_num_splits(batch: int, num_kv_heads: int, max_seqlen: int, *, num_sms: int,
                                block_n: int = 64, min_blocks_per_split: int = 2,
                                max_splits: int = MAX_NUM_SPLITS, window: int | None = None) -> int:
    """How many KV splits to use (pure heuristic).

    Enough partial tasks (batch × num_kv_heads × splits) to give every SM about one,
    but no slice shorter than ``min_blocks_per_split`` blocks: below that the merge
    and the per-task overhead cost more than the parallelism gains. With a sliding
    ``window`` the slices cut at most ``window`` keys, whatever the length.
    """
    tasks = max(1, batch * num_kv_heads)
    wanted = -(-num_sms // tasks)
    keys = max_seqlen if window is None else min(max_seqlen, window)
    useful = -(-max(1, keys) // (block_n * min_blocks_per_split))
    return max(1, min(wanted, useful, max_splits))


def window_start(seqlen: int, window: int | None) -> int:
    """The first key a decode query of a ``seqlen``-key sequence attends: ``max(seqlen - window,
    0)`` under a sliding window, else 0 (the module docstring has the rule)."""
    return 0 if window is None else max(seqlen - window, 0)


def slice_len(seqlen: int, num_splits: int, block_n: int) -> int:
    """KV positions a slice holds, as :func:`_split_len` cuts them: ceil(seqlen / num_splits)
    in whole blocks."""
    return -(-(-(-seqlen // num_splits)) // block_n) * block_n


def split_range(seqlen: int, split: int, num_splits: int, block_n: int,
                window: int | None = None) -> tuple[int, int]:
    """KV positions ``[start, end)`` that slice ``split`` covers, as the device cuts them
    (``start >= end``: an empty slice)."""
    lo = window_start(seqlen, window)
    n = slice_len(seqlen - lo, num_splits, block_n)
    return lo + split * n, min(lo + (split + 1) * n, seqlen)


def live_splits(seqlen: int, num_splits: int, block_n: int, window: int | None = None) -> int:
    """:func:`decode_live_splits` on the host: the slices of a ``seqlen``-key sequence cut
    into ``num_splits`` that hold a key (at least 1); under a sliding ``window``, of its
    last ``min(seqlen, window)`` keys."""
    seqlen -= window_start(seqlen, window)
    return max(-(-seqlen // max(slice_len(seqlen, num_splits, block_n), 1)), 1)


# --------------------------------------------------------------------------- device code


@jit
def _split_len(seqlen, num_splits, BLOCK_N: tl.constexpr):
    """KV positions a slice holds: ceil(seqlen / num_splits), rounded up to whole blocks."""
    return tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N


@jit
def decode_live_splits(seqlen, num_splits, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = None):
    """How many of the ``num_splits`` slices of a ``seqlen``-key sequence hold a key (at
    least one: seqlen 0, never valid, still gives split 0, which writes zeros). WINDOW: a
    sliding window, whose ``min(seqlen, WINDOW)`` keys the slices cut."""
    if WINDOW is not None:
        seqlen = tl.minimum(seqlen, WINDOW)
    return tl.maximum(tl.cdiv(seqlen, tl.maximum(_split_len(seqlen, num_splits, BLOCK_N), 1)), 1)


@jit
def _slice_start(seqlen, split, num_splits, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = None):
    """(first position, length) of slice ``split``: see :func:`decode_slice`."""
    if WINDOW is None:
        split_len = _split_len(seqlen, num_splits, BLOCK_N)
        start = split * split_len
    else:
        lo = tl.maximum(seqlen - WINDOW, 0)
        split_len = _split_len(seqlen - lo, num_splits, BLOCK_N)
        start = lo + split * split_len
    return start, split_len


@jit
def decode_slice(seqlen, split, num_splits, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = None):
    """KV positions [start, end) of slice ``split`` (``start >= end``: empty). Without a
    window the slices cut [0, seqlen); with WINDOW, [max(seqlen - WINDOW, 0), seqlen), so a
    split never reads a key before the window."""
    start, split_len = _slice_start(seqlen, split, num_splits, BLOCK_N, WINDOW)
    return start, tl.minimum(start + split_len, seqlen)


@jit
def _attend_slice(
    q_ptr, k_cache_ptr, v_cache_ptr, seqlen,
    b, kv_head, split, num_splits, sm_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr = None,
):
    """Slice ``split`` of a sequence of ``seqlen`` keys for the group of ``kv_head``:
    (out float32 [BLOCK_G, BLOCK_D], normalised over the slice; lse float32 [BLOCK_G],
    natural log; 0 and -inf for an empty slice). WINDOW: see :func:`decode_slice`."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q_mask = mask_g[:, None] & mask_d[None, :]
    # Padded group rows load as zeros: their scores are 0 (finite) and they are never stored.
    # Heads of at most 64: q in the loop's first step, after the pipelined K/V loads are
    # issued, so the two round trips overlap (1B step -0.8%). Wider heads load it first: q
    # carried into the loop spilled the 8B step's kernel (18 -> 42 spills, +6%).
    Q_IN_LOOP: tl.constexpr = BLOCK_D <= 64
    if Q_IN_LOOP:
        q = tl.zeros([BLOCK_G, BLOCK_D], dtype=q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    start, end = decode_slice(seqlen, split, num_splits, BLOCK_N, WINDOW)

    k_base = k_cache_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_cache_ptr + b * stride_vb + kv_head * stride_vh
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): softmax in base 2, exp2 is native
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # Every block this loop visits holds at least one valid position, so m_i turns finite
    # on the first step; an empty slice skips the loop and keeps l_i = 0.
    for n0 in range(start, end, BLOCK_N):
        if Q_IN_LOOP:
            if n0 == start:
                q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        offs = n0 + offs_n
        mask_n = offs < end
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # Masked loads never read positions >= seqlen (nor, under a window, before start), so
        # garbage (even NaN) there can't leak.
        # V with K: its round trip overlaps K's instead of following the softmax.
        k = tl.load(k_base + offs[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p, v, acc * alpha[:, None])
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    log2_sum = m_i + tl.log2(tl.where(has_keys, l_i, 1.0))
    lse = tl.where(has_keys, log2_sum * 0.6931471805599453, float("-inf"))  # ln(2): back to base e
    return out, lse


@jit
def _store_heads(ptr, b, kv_head, stride_b, stride_h, values,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """values [BLOCK_G, BLOCK_D] into ptr[b, h, :HEAD_DIM] for the group's heads h (cast)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    tl.store(ptr + b * stride_b + heads[:, None] * stride_h + offs_d[None, :], values.to(ptr.dtype.element_ty),
             mask=(offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :])


@jit
def _store_partial(o_ptr, lse_ptr, b, kv_head, split, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                   stride_ls, out, lse,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """A slice's (out, lse) into the workspace: o[b, h, split, :] and lse[b, h, split]."""
    _store_heads(o_ptr + split * stride_os, b, kv_head, stride_ob, stride_oh, out,
                 GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D)
    offs_g = tl.arange(0, BLOCK_G)
    tl.store(lse_ptr + b * stride_lb + (kv_head * GROUP + offs_g) * stride_lh + split * stride_ls, lse,
             mask=offs_g < GROUP)


@jit
def decode_attention_partial_tile(
    q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr, o_ptr, lse_ptr,
    b, kv_head, split, num_splits, sm_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr = None,
):
    """Slice ``split`` of sequence b's KV for the GROUP query heads of ``kv_head``.

    Writes ``o_ptr[b, h, split, :]`` (normalised over the slice, cast to o's dtype) and
    ``lse_ptr[b, h, split]`` (natural-log log-sum-exp) for ``h = kv_head*GROUP + g``; nothing
    else. With ``num_splits == 1`` o may point straight at the final output. WINDOW: a
    sliding window of that many keys (:func:`decode_slice`); None: all keys.
    """
    out, lse = _attend_slice(
        q_ptr, k_cache_ptr, v_cache_ptr, tl.load(seqlens_ptr + b), b, kv_head, split, num_splits, sm_scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, WINDOW=WINDOW)
    _store_partial(o_ptr, lse_ptr, b, kv_head, split, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                   stride_ls, out, lse, GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D)


@jit
def decode_attention_prefetch(
    k_cache_ptr, v_cache_ptr, seqlen, b, kv_head, split, num_splits, max_seq,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCKS: tl.constexpr = 2,
    WINDOW: tl.constexpr = None,
):
    """Ask L2 for the first BLOCKS blocks of K and V rows of split ``split``'s slice of a
    sequence of ``seqlen`` keys; issued before the task waits for its inputs.

    The cached positions before this step's never depend on the step, but a length read from
    the seqlens buffer before the wait may be the last step's, one short (this step's QKV
    tiles write it). A prefetch is only a hint (no register, no fault, no stale value: L2 is
    where the QKV tiles' stores land), so a slightly wrong slice costs nothing but the lines.
    The split's loads then meet L2 instead of DRAM. Compiled GPU code only (inline PTX).
    WINDOW: the slice as :func:`decode_slice` cuts it under a sliding window."""
    start, split_len = _slice_start(seqlen, split, num_splits, BLOCK_N, WINDOW)
    # (+1: the position this step appends, if the length is the last step's)
    end = tl.minimum(tl.minimum(start + split_len, seqlen + 1), tl.minimum(start + BLOCKS * BLOCK_N, max_seq))
    LINE: tl.constexpr = 1024 // k_cache_ptr.dtype.element_ty.primitive_bitwidth  # elements of a 128-byte line
    LINES: tl.constexpr = (BLOCK_D + LINE - 1) // LINE
    idx = tl.arange(0, BLOCKS * BLOCK_N * LINES)
    pos = start + idx // LINES
    col = (idx % LINES) * LINE
    ok = (pos < end) & (col < HEAD_DIM)
    pos = tl.where(ok, pos, start)
    col = tl.where(ok, col, 0)
    if start < end:
        _prefetch_l2(k_cache_ptr + b * stride_kb + kv_head * stride_kh + pos * stride_ks + col)
        _prefetch_l2(v_cache_ptr + b * stride_vb + kv_head * stride_vh + pos * stride_vs + col)


@jit
def decode_attention_merge_tile(
    o_part_ptr, lse_ptr, out_ptr,
    b, q_head, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HEADS: tl.constexpr = 1, BLOCK_HEADS: tl.constexpr = 1, CACHE: tl.constexpr = "",
):
    """out[b, h] = the log-sum-exp weighted mean of the ``num_splits`` partials of head h,
    for the HEADS heads ``q_head <= h < q_head + HEADS`` (BLOCK_HEADS: HEADS padded to a
    power of 2).

    Empty splits carry lse = -inf and weigh 0. Touches those heads of out[b] only. All
    heads' partials are loaded at once: one memory round trip, however many heads.
    ``CACHE``: the partials' load cache modifier (".cg" reads them from L2, past this SM's L1).
    """
    offs_h = tl.arange(0, BLOCK_HEADS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < HEADS
    mask_hs = mask_h[:, None] & (offs_s < num_splits)[None, :]
    mask_d = offs_d < HEAD_DIM
    heads = q_head + offs_h
    lse = tl.load(lse_ptr + b * stride_lb + heads[:, None] * stride_lh + offs_s[None, :] * stride_ls,
                  mask=mask_hs, other=float("-inf"), cache_modifier=CACHE)
    o = tl.load(o_part_ptr + b * stride_pb + heads[:, None, None] * stride_ph + offs_s[None, :, None] * stride_ps
                + offs_d[None, None, :], mask=mask_hs[:, :, None] & mask_d[None, None, :], other=0.0,
                cache_modifier=CACHE)
    m = tl.max(lse, axis=1)
    # Split 0 always has a key (seqlen >= 1), so m is finite; the guard only keeps a bad
    # seqlen (or a padded head) from turning into NaN (-inf - -inf).
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m[:, None])
    total = tl.sum(w, axis=1)
    out = tl.sum(w[:, :, None] * o, axis=1) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


@jit
def decode_attention_tile(
    q_ptr, k_cache_ptr, v_cache_ptr, seqlen, o_ptr, lse_ptr, arrivals_ptr, out_ptr,
    b, kv_head, split, num_kv_heads, num_splits, sm_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    stride_outb, stride_outh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_GROUP: tl.constexpr, WINDOW: tl.constexpr = None,
):
    """Split ``split`` of (b, kv_head) for a sequence of ``seqlen`` keys, as
    :func:`decode_attention_partial_tile`; then the group's output, by one of the *live*
    splits (those that hold a key):

    * one live split (the sequence fits in split 0's slice): split 0 writes the group's heads
      of ``out_ptr`` directly; no workspace, no count, no merge;
    * several: each live split stores its partial and counts itself in
      ``arrivals_ptr[b * num_kv_heads + kv_head]`` (int32, 0 when the first one starts); the
      last to arrive sets it back to 0 and merges the live partials into ``out_ptr[b, h]``.

    Splits past the live ones return at once. No split waits for another, so the splits may
    run in any order, or one after another on one program. WINDOW: a sliding window of that
    many keys; the live splits are then those of the window's keys (:func:`decode_slice`).
    """
    live = decode_live_splits(seqlen, num_splits, BLOCK_N, WINDOW)
    if split < live:
        out, lse = _attend_slice(
            q_ptr, k_cache_ptr, v_cache_ptr, seqlen, b, kv_head, split, num_splits, sm_scale,
            stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, WINDOW=WINDOW)
        if live == 1:
            _store_heads(out_ptr, b, kv_head, stride_outb, stride_outh, out,
                         GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D)
        else:
            _store_partial(o_ptr, lse_ptr, b, kv_head, split, stride_ob, stride_oh, stride_os, stride_lb,
                           stride_lh, stride_ls, out, lse,
                           GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D)
            if last_to_arrive(arrivals_ptr + b * num_kv_heads + kv_head, live):
                # From L2 (.cg): this SM's L1 may hold the workspace of an earlier step.
                decode_attention_merge_tile(
                    o_ptr, lse_ptr, out_ptr, b, kv_head * GROUP, live,
                    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls, stride_outb, stride_outh,
                    HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, HEADS=GROUP, BLOCK_HEADS=BLOCK_GROUP,
                    CACHE=".cg")


@jit
def decode_length(pos_ptr, b, max_seq):
    """Sequence b's KV length in a decode step that appends its token at position pos[b]:
    pos[b] + 1, clipped to ``[0, max_seq]`` as :func:`mk.tasks.rope.rope_kv_seqlen_tile`
    writes it. Positions change only between steps, so a persistent kernel may read this
    before the step's QKV tiles have written the seqlens buffer (and before any wait)."""
    return tl.minimum(tl.maximum(tl.load(pos_ptr + b) + 1, 0), max_seq)


@jit
def decode_attention_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr, o_ptr, lse_ptr,
    num_kv_heads, num_splits, sm_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
):
    # Grid (B * Hkv, num_splits).
    pid = tl.program_id(0)
    decode_attention_partial_tile(
        q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr, o_ptr, lse_ptr,
        pid // num_kv_heads, pid % num_kv_heads, tl.program_id(1), num_splits, sm_scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
        GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, WINDOW=WINDOW)


@jit
def decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr, o_ptr, lse_ptr, arrivals_ptr, out_ptr,
    num_kv_heads, num_splits, sm_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    stride_outb, stride_outh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_GROUP: tl.constexpr, WINDOW: tl.constexpr,
):
    # Grid (B * Hkv, num_splits): partials and merges in one launch.
    pid = tl.program_id(0)
    b = pid // num_kv_heads
    decode_attention_tile(
        q_ptr, k_cache_ptr, v_cache_ptr, tl.load(seqlens_ptr + b), o_ptr, lse_ptr, arrivals_ptr, out_ptr,
        b, pid % num_kv_heads, tl.program_id(1), num_kv_heads, num_splits, sm_scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls, stride_outb, stride_outh,
        GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_S=BLOCK_S,
        BLOCK_GROUP=BLOCK_GROUP, WINDOW=WINDOW)


@jit
def decode_attention_merge_kernel(
    o_part_ptr, lse_ptr, out_ptr, num_q_heads, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (B * Hq,).
    pid = tl.program_id(0)
    decode_attention_merge_tile(
        o_part_ptr, lse_ptr, out_ptr, pid // num_q_heads, pid % num_q_heads, num_splits,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ls, stride_ob, stride_oh,
        HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, CACHE=".ca")  # (Triton 3.6 fails on the "" default)


# --------------------------------------------------------------------------- launcher


def _num_sms(t: torch.Tensor) -> int:
    if t.is_cuda:
        return sm_count(t)
    # The interpreter runs programs one by one: a small stand-in still exercises splitting.
    return 4


def check_window(window: object) -> int | None:
    """A sliding window argument: None (every key) or an int >= 1 (keys of the query's last
    ``window`` positions); raises ValueError otherwise."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    return window


def _check_args(q, k_cache, v_cache, seqlens, scale, num_splits, window=None):
    """Validate decode_attention's arguments (nothing is written before); returns the scale."""
    check_tensor("q", q, ndim=3, contiguous=False, last_dim_contiguous=True)
    batch, hq, d = q.shape
    check_tensor("k_cache", k_cache, ndim=4, contiguous=False, last_dim_contiguous=True)
    hkv, max_seq = k_cache.shape[1], k_cache.shape[2]
    check_tensor("k_cache", k_cache, shape=(batch, hkv, max_seq, d), contiguous=False)
    check_tensor("v_cache", v_cache, shape=(batch, hkv, max_seq, d), contiguous=False,
                 last_dim_contiguous=True)
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of k_cache's {hkv} KV heads")
    if d < 1 or max_seq < 1:
        raise ValueError(f"k_cache must have head_dim >= 1 and S_max >= 1, got shape {tuple(k_cache.shape)}")
    check_tensor("seqlens", seqlens, shape=(batch,), dtype=_SEQLEN_DTYPES, contiguous=False)
    check_same_dtype(k_cache=k_cache, v_cache=v_cache)  # q may differ: see mk.tasks._dot.mma
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, seqlens=seqlens)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if num_splits is not None:
        check_positive_int("num_splits", num_splits, maximum=MAX_NUM_SPLITS)
    check_window(window)
    # The only host sync: the standalone op checks the lengths (a fused kernel trusts them).
    # Not possible while a CUDA graph is being captured, so then they are trusted too.
    if batch and not is_capturing(seqlens):
        lo, hi = int(seqlens.min()), int(seqlens.max())
        if lo < 1 or hi > max_seq:
            raise ValueError(f"seqlens must lie in [1, {max_seq}] (S_max of the cache), got {lo} to {hi}")
    return float(scale)


def _launch_partials(q, k_cache, v_cache, seqlens, o_part, lse, scale, *, arrivals=None, out=None, window=None):
    """The partials' grid; with ``arrivals`` (zeros, [B * Hkv]) and ``out``, each group's
    last split also merges it into out (:func:`decode_attention_tile`)."""
    batch, hq, d = q.shape
    hkv = k_cache.shape[1]
    num_splits = lse.shape[2]
    seqlens = seqlens.contiguous()  # the kernels read seqlens[b] at offset b: a strided view is copied
    cfg = decode_attention_config(hq, hkv, d, q.element_size())
    strides = (q.stride(0), q.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
               o_part.stride(0), o_part.stride(1), o_part.stride(2),
               lse.stride(0), lse.stride(1), lse.stride(2))
    sizes = dict(GROUP=hq // hkv, HEAD_DIM=d, BLOCK_G=cfg.block_g, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
                 WINDOW=window, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if arrivals is None:
        decode_attention_partial_kernel[(batch * hkv, num_splits)](
            q, k_cache, v_cache, seqlens, o_part, lse, hkv, num_splits, scale, *strides, **sizes)
    else:
        decode_attention_kernel[(batch * hkv, num_splits)](
            q, k_cache, v_cache, seqlens, o_part, lse, arrivals, out, hkv, num_splits, scale, *strides,
            out.stride(0), out.stride(1), BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_GROUP=triton.next_power_of_2(hq // hkv), **sizes)


def _default_splits(q, k_cache, window=None):
    # From shapes only (S_max, not the actual lengths): no host sync, and a captured CUDA
    # graph stays right when replayed with other lengths. Splits past a short sequence
    # are empty programs that return at once.
    batch, hq, d = q.shape
    _, hkv, max_seq, _ = k_cache.shape
    cfg = decode_attention_config(hq, hkv, d, q.element_size())
    return decode_attention_num_splits(batch, hkv, max_seq, num_sms=_num_sms(q), block_n=cfg.block_n,
                                       window=window)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor, *,
    scale: float | None = None, num_splits: int | None = None, window: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached keys and values.

    Args:
        q: ``[B, Hq, D]``, last dim contiguous.
        k_cache, v_cache: ``[B, Hkv, S_max, D]`` in one dtype (q's or another: a float32 q
            meets a bf16 cache without being rounded), last dim contiguous;
            Hq must be a multiple of Hkv (query head h reads KV head h // (Hq / Hkv)).
        seqlens: ``[B]`` int32/int64, valid cached positions per sequence, in ``[1, S_max]``
            (a strided view is copied first).
        scale: score scale, default ``1 / sqrt(D)``.
        num_splits: KV splits (1..:data:`MAX_NUM_SPLITS`); default from
            :func:`decode_attention_num_splits` on the cache length S_max. With 1 the
            partial task writes the output directly; with more, each group's last split
            merges it, in the same launch.
        window: a sliding window (Mistral's ``sliding_window``): the query of a sequence of
            L keys attends keys ``[max(L - window, 0), L)`` only; the others are not read.
            None: every key.

    Lengths are checked on the host (one sync), except while a CUDA graph is captured.

    Returns:
        ``[B, Hq, D]`` in q's dtype.
    """
    scale = _check_args(q, k_cache, v_cache, seqlens, scale, num_splits, window)
    batch, hq, d = q.shape
    out = torch.empty((batch, hq, d), dtype=q.dtype, device=q.device)
    if batch == 0 or hq == 0:
        return out
    if num_splits is None:
        num_splits = _default_splits(q, k_cache, window)
    lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    if num_splits == 1:  # the partial is already the answer: write it straight into out
        _launch_partials(q, k_cache, v_cache, seqlens, out[:, :, None, :], lse, scale, window=window)
        return out
    o_part = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=q.device)
    arrivals = torch.zeros(batch * k_cache.shape[1], dtype=torch.int32, device=q.device)
    _launch_partials(q, k_cache, v_cache, seqlens, o_part, lse, scale, arrivals=arrivals, out=out, window=window)
    return out


def decode_attention_partials(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor, *,
    scale: float | None = None, num_splits: int | None = None, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the partial tasks of :func:`decode_attention` (same arguments).

    Returns the float32 workspace ``(o_part [B, Hq, num_splits, D], lse [B, Hq, num_splits])``:
    each split's normalised output and natural-log log-sum-exp; an empty split gives
    zeros and -inf (so does every split past a sliding ``window``'s keys).
    :func:`decode_attention_merge` turns it into the output.
    """
    scale = _check_args(q, k_cache, v_cache, seqlens, scale, num_splits, window)
    batch, hq, d = q.shape
    if num_splits is None:
        num_splits = _default_splits(q, k_cache, window) if batch else 1
    o_part = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    if batch and hq:
        _launch_partials(q, k_cache, v_cache, seqlens, o_part, lse, scale, window=window)
    return o_part, lse


def decode_attention_merge(o_part: torch.Tensor, lse: torch.Tensor, *, out: torch.Tensor | None = None,
                           dtype: torch.dtype | None = None) -> torch.Tensor:
    """Merge a split workspace (from :func:`decode_attention_partials`) into ``[B, Hq, D]``.

    Writes into ``out`` when given, else into a new tensor of ``dtype`` (default float32);
    a ``dtype`` that is not out's is refused.
    """
    check_tensor("o_part", o_part, ndim=4, dtype=torch.float32, contiguous=False, last_dim_contiguous=True)
    batch, hq, num_splits, d = o_part.shape
    check_tensor("lse", lse, shape=(batch, hq, num_splits), dtype=torch.float32, contiguous=False)
    if num_splits > MAX_NUM_SPLITS:
        raise ValueError(f"o_part has {num_splits} splits, more than MAX_NUM_SPLITS={MAX_NUM_SPLITS}")
    if out is not None:
        check_tensor("out", out, shape=(batch, hq, d), contiguous=False, last_dim_contiguous=True)
        check_same_device(o_part=o_part, lse=lse, out=out)
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype {dtype} conflicts with out's {out.dtype}; give one of them")
    else:
        check_same_device(o_part=o_part, lse=lse)
        if dtype is not None and dtype not in supported_dtypes(o_part):
            raise TypeError(f"dtype must be one of {list(supported_dtypes(o_part))}, got {dtype!r}")
        out = torch.empty((batch, hq, d), dtype=dtype or torch.float32, device=o_part.device)
    if out.numel() and num_splits:
        decode_attention_merge_kernel[(batch * hq,)](
            o_part, lse, out, hq, num_splits,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(d),
            num_warps=4,
        )
    return out


# --------------------------------------------------------------------------- reference


def decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor, *,
    scale: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """Plain float32 torch decode attention: explicit softmax over the valid positions (under
    a sliding ``window``, the scores of keys ``j <= L - 1 - window`` masked to -inf)."""
    batch, hq, d = q.shape
    hkv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty((batch, hq, d), dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(seqlens[b])
        k = k_cache[b, :, :n].float().repeat_interleave(hq // hkv, dim=0)   # [Hq, n, D]
        v = v_cache[b, :, :n].float().repeat_interleave(hq // hkv, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[b].float(), k) * scale
        if window is not None:
            scores[:, torch.arange(n, device=q.device) <= n - 1 - window] = float("-inf")
        probs = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        out[b] = torch.einsum("hn,hnd->hd", probs, v)
    return out


# --------------------------------------------------------------------------- planner hooks


def decode_attention_cost(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                          seqlens: int | Sequence[int], num_splits: int = 1,
                          dtype_bytes: int = 2, window: int | None = None) -> TaskCost:
    """Bytes and flops of one decode attention (partials and merge together).

    ``seqlens`` is one length for every sequence or one per sequence. Under a sliding
    ``window`` a sequence reads ``min(length, window)`` keys.
    """
    lengths = [seqlens] * batch if isinstance(seqlens, int) else list(seqlens)
    total_len = sum(n if window is None else min(n, window) for n in lengths)
    kv_bytes = 2 * num_kv_heads * total_len * head_dim * dtype_bytes
    q_bytes = batch * num_q_heads * head_dim * dtype_bytes
    seqlen_bytes = batch * 4
    # float32 partial outputs and lse, written by the partials and read by the merge.
    workspace = batch * num_q_heads * num_splits * (head_dim + 1) * 4 if num_splits > 1 else 0
    out_bytes = batch * num_q_heads * head_dim * dtype_bytes
    # 2 flops per multiply-add for QK and PV; ~5 for scaling, max, exp2 and sum per score.
    flops = num_q_heads * total_len * (4 * head_dim + 5)
    if num_splits > 1:
        flops += batch * num_q_heads * num_splits * (2 * head_dim + 3)
    return TaskCost(kv_bytes + q_bytes + seqlen_bytes + workspace, workspace + out_bytes, flops)


def decode_attention_smem_bytes(config: DecodeAttentionConfig, q_bytes: int | None = None) -> int:
    """Shared memory of the partial task: staged K and V tiles plus the dot operands.

    K and V blocks ``[BLOCK_N, BLOCK_D]`` per pipeline stage, q ``[BLOCK_G, BLOCK_D]``
    and p ``[BLOCK_G, BLOCK_N]`` as tl.dot operands, twice over when a float32 q
    (``q_bytes`` 4) meets a 16-bit cache: q and p go in as two halves each
    (:func:`mk.tasks._dot.mma`). Where BLOCK_D <= BLOCK_N, q's and p's buffers share their
    bytes (Triton 3.6 on sm_90, compiled: head_dim 32 and 64 take the larger of the two,
    128 and 256 both). An estimate to prune the search: the compiled kernel's ``shared``
    metadata is the truth.
    """
    c = config
    halves = 2 if (q_bytes or c.dtype_bytes) > c.dtype_bytes else 1
    kv = c.num_stages * 2 * c.block_n * c.block_d * c.dtype_bytes
    q, p = (c.block_g * d * c.dtype_bytes * halves for d in (c.block_d, c.block_n))
    return kv + (q + p if c.block_d > c.block_n else max(q, p))


# ---------------------------------------------------------------------------------------
# Megakernel spec: how the op runs as a task of the persistent kernel (mk.tasks._spec)
# ---------------------------------------------------------------------------------------


def kv_length_at(pos: int, max_seq: int) -> int:
    """The KV length once the token at position ``pos`` is cached: pos + 1, clipped to
    [0, max_seq] (what rope_kv writes to seqlens and decode_length computes)."""
    return min(max(pos + 1, 0), max_seq)


def _run_attention_split(op: str, bufs: dict, b: int, kv: int, s: int, *, batch: int, hq: int, hkv: int, d: int,
                         max_seq: int, splits: int, block_n: int, scale: float, seqlen: int,
                         direct: bool = False, window: int | None = None) -> None:
    """KV split s of (b, kv) of a sequence of ``seqlen`` keys for its group's query heads, with
    torch (the VM's partial); ``direct``: the split is the sequence's only live one and writes
    out instead; ``window``: the slices cut the window's keys only (:func:`split_range`)."""
    group = hq // hkv
    heads = slice(kv * group, (kv + 1) * group)
    start, end = split_range(seqlen, s, splits, block_n, window)
    q = operand_view(op, "q", bufs["q"], batch, hq * d)[b].view(hq, d)[heads].float()
    o_part = operand_view(op, "o_part", bufs["o_part"], batch * hq, splits * d).view(batch, hq, splits, d)
    lse = operand_view(op, "lse", bufs["lse"], batch * hq, splits).view(batch, hq, splits)
    if end > start:
        kc = operand_view(op, "k_cache", bufs["k_cache"], batch * hkv * max_seq, d).view(batch, hkv, max_seq, d)
        vc = operand_view(op, "v_cache", bufs["v_cache"], batch * hkv * max_seq, d).view(batch, hkv, max_seq, d)
        scores = (q @ kc[b, kv, start:end].float().T) * scale
        m = scores.max(dim=-1, keepdim=True).values
        p = torch.exp(scores - m)
        total = p.sum(dim=-1, keepdim=True)
        y = (p @ vc[b, kv, start:end].float()) / total
        if direct:
            out = operand_view(op, "out", bufs["out"], batch, hq * d)
            out[b, kv * group * d:(kv + 1) * group * d] = y.reshape(-1).to(out.dtype)
            return
        o_part[b, heads, s] = y.to(o_part.dtype)
        lse[b, heads, s] = (m + torch.log(total)).squeeze(-1).to(lse.dtype)
    elif direct:  # no key at all (seqlen 0, never valid): zeros, as the device writes
        out = operand_view(op, "out", bufs["out"], batch, hq * d)
        out[b, kv * group * d:(kv + 1) * group * d] = 0
    else:  # an empty slice: zeros and -inf (weight 0 in the merge)
        o_part[b, heads, s] = 0
        lse[b, heads, s] = float("-inf")


def _run_attention_merge(op: str, bufs: dict, b: int, h: int, *, batch: int, hq: int, d: int, splits: int,
                         live: int | None = None) -> None:
    """out[b, head h] from its splits' partials (the first ``live`` of them, default all),
    with torch (the VM's merge)."""
    live = splits if live is None else live
    lse = operand_view(op, "lse", bufs["lse"], batch * hq, splits)[b * hq + h][:live].float()
    o = operand_view(op, "o_part", bufs["o_part"], batch * hq, splits * d)[b * hq + h].view(splits, d)[:live].float()
    m = lse.max()
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # as the device: no -inf - -inf
    w = torch.exp(lse - m)
    total = w.sum()
    y = (w[:, None] * o).sum(dim=0) / torch.where(total > 0, total, torch.ones_like(total))
    out = operand_view(op, "out", bufs["out"], batch, hq * d)
    out[b, h * d:(h + 1) * d] = y.to(out.dtype)


def _attention_split_reads(bind: dict, b: int, kv: int, *, hq: int, hkv: int, d: int, max_seq: int,
                           lengths: str = "seqlens") -> list:
    """What a split of (b, kv) reads: its heads' q, all max_seq cache rows of (b, kv) (the
    slice it reads depends on the runtime length) and b's length (or position: ``lengths``)."""
    group = hq // hkv
    rows = ((b * hkv + kv) * max_seq, (b * hkv + kv + 1) * max_seq)
    return [Region(bind["q"], b, b + 1, kv * group * d, (kv + 1) * group * d),
            Region(bind["k_cache"], *rows, 0, d), Region(bind["v_cache"], *rows, 0, d),
            Region(bind[lengths], 0, 1, b, b + 1)]


def _attention_length(op: str, bufs: dict, b: int, batch: int, max_seq: int, from_positions: bool) -> int:
    """Sequence b's KV length as the device reads it: seqlens[b], or pos[b] + 1 clipped to
    [0, max_seq] (:func:`mk.tasks.decode_attention.decode_length`)."""
    if from_positions:
        return kv_length_at(int(operand_view(op, "pos", bufs["pos"], 1, batch)[0, b]), max_seq)
    return int(operand_view(op, "seqlens", bufs["seqlens"], 1, batch)[0, b])


#: Strides of q, the caches, o_part and lse, as the attention tiles take them (constexprs).
_ATTENTION_STRIDES = ("HQ * HEAD_DIM, HEAD_DIM, "
                      "HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, HEAD_DIM, HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, "
                      "HEAD_DIM, HQ * NUM_SPLITS * HEAD_DIM, NUM_SPLITS * HEAD_DIM, HEAD_DIM, HQ * NUM_SPLITS, NUM_SPLITS, 1")


def _split_tiles(batch: int, hkv: int, splits: int) -> list[dict]:
    """Args of every split task: (b, kv_head, split), all splits of a head together."""
    return [{"b": b, "kv_head": kv, "split": s} for b in range(batch) for kv in range(hkv) for s in range(splits)]


def _attention_tile(op: str, batch: int, hkv: int, splits: int):
    """A task's (b, kv_head, split), checked."""
    def tile(a):
        check_tile(op, "b", a["b"], batch)
        check_tile(op, "kv_head", a["kv_head"], hkv)
        check_tile(op, "split", a["split"], splits)
        return a["b"], a["kv_head"], a["split"]
    return tile


@register("decode_attention_partial")
def decode_attention_partial_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seq: int,
                                num_splits: int, *, scale: float | None = None, block_n: int | None = None,
                                num_warps: int | None = None) -> OpSpec:
    """Split ``split`` of sequence b's KV for the query heads of KV head ``kv_head`` (GQA).

    Operands: q ``[batch, Hq * D]`` (rotated, as rope_kv writes it), k_cache and v_cache
    ``[batch, Hkv, max_seq, D]``, seqlens int32/int64 ``[batch]`` (each in ``[1, max_seq]``),
    o_part float32 ``[batch, Hq, num_splits * D]`` and lse float32 ``[batch, Hq, num_splits]``:
    the workspace of :func:`mk.tasks.decode_attention.decode_attention_partials` (same memory;
    o_part's last two dims are merged so that one task's heads × one split, and one merge's
    splits × one head, are each one box of the 2-D view). Args: b, kv_head, split.

    Regions: the slice a split reads depends on the runtime seqlen, so each task declares a
    read of all ``max_seq`` cache rows of its (b, kv_head); it writes exactly its heads' split.
    Pair with :func:`decode_attention_merge_op`.
    """
    check_sizes("decode_attention_partial", batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, max_seq=max_seq, num_splits=num_splits)
    op = "decode_attention_partial"
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_splits > MAX_NUM_SPLITS:
        raise ValueError(f"{op}: num_splits must be <= {MAX_NUM_SPLITS}, got {num_splits}")
    hq, hkv, d, S = num_q_heads, num_kv_heads, head_dim, num_splits
    group = hq // hkv
    cfg = decode_attention_config(hq, hkv, d)
    block_n = check_pow2(op, "block_n", block_n or cfg.block_n, MIN_DOT_DIM)  # tl.dot: >= 16
    scale = 1.0 / d**0.5 if scale is None else float(scale)
    body = ("decode_attention_partial_tile(q, k_cache, v_cache, seqlens, o_part, lse, b.to(tl.int64), kv_head, "
            "split, NUM_SPLITS, SCALE, " + _ATTENTION_STRIDES + ", "
            "GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)")

    tile = _attention_tile(op, batch, hkv, S)

    def run(bufs, a):
        b, kv, s = tile(a)
        _run_attention_split(op, bufs, b, kv, s, batch=batch, hq=hq, hkv=hkv, d=d, max_seq=max_seq, splits=S,
                             seqlen=_attention_length(op, bufs, b, batch, max_seq, from_positions=False),
                             block_n=block_n, scale=scale)

    def reads(a, bind):
        return _attention_split_reads(bind, *tile(a)[:2], hq=hq, hkv=hkv, d=d, max_seq=max_seq)

    def writes(a, bind):
        b, kv, s = tile(a)
        r0, r1 = b * hq + kv * group, b * hq + (kv + 1) * group
        return [Region(bind["o_part"], r0, r1, s * d, (s + 1) * d), Region(bind["lse"], r0, r1, s, s + 1)]

    return OpSpec(name=op, operands=("q", "k_cache", "v_cache", "seqlens", "o_part", "lse"),
                  args=("b", "kv_head", "split"), body=body,
                  imports=("from mk.tasks.decode_attention import decode_attention_partial_tile",),
                  constexprs={"BATCH": batch, "HQ": hq, "HKV": hkv, "HEAD_DIM": d, "S_MAX": max_seq, "NUM_SPLITS": S,
                              "GROUP": group, "BLOCK_G": cfg.block_g, "BLOCK_N": block_n, "BLOCK_D": cfg.block_d,
                              "SCALE": scale},
                  num_warps=num_warps or cfg.num_warps, run=run, reads=reads, writes=writes,
                  tiles=lambda _: _split_tiles(batch, hkv, S))


def _arrive_and_merge(op: str, bufs: dict, b: int, kv: int, live: int, *, batch: int, hq: int, hkv: int, d: int,
                      splits: int) -> None:
    """A live split of (b, kv) counts itself in; the last of the ``live`` to arrive resets the
    count and merges the group's heads (with torch: the VM's :func:`last_to_arrive` and
    :func:`decode_attention_merge_tile`)."""
    arrivals = operand_view(op, "arrivals", bufs["arrivals"], 1, batch * hkv)[0]
    arrivals[b * hkv + kv] += 1
    if int(arrivals[b * hkv + kv]) == live:
        arrivals[b * hkv + kv] = 0
        group = hq // hkv
        for h in range(kv * group, (kv + 1) * group):
            _run_attention_merge(op, bufs, b, h, batch=batch, hq=hq, d=d, splits=splits, live=live)


def _one_phase_source(from_positions: bool, win: str, prologue: AttentionPrologue) -> tuple[str, str]:
    """The device code of :func:`decode_attention_op`'s task: what it runs before its wait
    (the length and the slice's prefetch) and its body; ``win``: the slicing's extra keyword
    arguments (a window, a least slice)."""
    # The length before the wait: exact from the positions; from seqlens maybe the last step's
    # (good enough for the prefetch's hint, read again after the wait).
    preload = ("attn_len = decode_length(pos, b.to(tl.int64), S_MAX)\n" if from_positions else
               "if GPU:\n    attn_len = tl.load(seqlens + b.to(tl.int64), volatile=True)\n")
    # The K/V lines of the slice into L2 while the task waits (inline PTX: compiled code only).
    preload += ("if GPU:\n    decode_attention_prefetch(k_cache, v_cache, attn_len, b.to(tl.int64), kv_head, split, "
                "NUM_SPLITS, S_MAX, HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, HEAD_DIM, HKV * S_MAX * HEAD_DIM, "
                f"S_MAX * HEAD_DIM, HEAD_DIM, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D{win})")
    # With the exact length before the wait, only the live splits wait for their inputs.
    wait = (f"attn_live = decode_live_splits(attn_len, NUM_SPLITS, BLOCK_N=BLOCK_N{win})\n"
            "if split < attn_live:\n"
            "    ok, last_ev, last_need, t_ready = task_wait(task_wait_args, task_wait_state, TASK_WAIT_FLAGS)\n"
            if from_positions else "")
    if prologue.body:  # (then the split's loads see the prologue's stores)
        wait += "".join(f"    {line}\n" for line in prologue.body.splitlines()) + "    tl.debug_barrier()\n"
    body = wait + ("decode_attention_tile(q, k_cache, v_cache, "
            + ("attn_len, " if from_positions else "tl.load(seqlens + b.to(tl.int64)), ") +
            "o_part, lse, arrivals, out, b.to(tl.int64), "
            "kv_head, split, HKV, NUM_SPLITS, SCALE, " + _ATTENTION_STRIDES + ", HQ * HEAD_DIM, HEAD_DIM, "
            "GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_S=BLOCK_S, "
            f"BLOCK_GROUP=BLOCK_GROUP{win})")
    return preload, body


@register("decode_attention")
def decode_attention_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seq: int,
                        num_splits: int, *, scale: float | None = None, block_n: int | None = None,
                        num_warps: int | None = None, from_positions: bool = False,
                        window: int | None = None, prologue: AttentionPrologue | None = None) -> OpSpec:
    """Decode attention in one phase: split ``split`` of sequence b's KV for the query heads
    of KV head ``kv_head`` (as :func:`decode_attention_partial_op`), and the group's last
    split to finish merges the group's heads into out (as :func:`decode_attention_merge_op`).

    Operands: those of the partial op, then arrivals int32 ``[batch * Hkv]`` (zeros; left
    zero by every complete launch, see :attr:`OpSpec.sync_operands`) and out
    ``[batch, Hq * D]``. Args: b, kv_head, split.

    Only the live splits (those holding a key at the runtime length) work: with one, split 0
    writes out itself (no partial, no count, no merge); with more, the last of them merges
    the live partials. The splits of one (b, kv_head) are a team (:attr:`OpSpec.team`):
    none waits for another. Each declares the whole team's regions (any of them may be the
    one that writes out): reads of the group's partials, writes of its own partial, the
    group's counter and the group's heads of out. A consumer of out therefore waits for all
    of the group's splits, and the one that writes out signals after it.

    ``from_positions``: the operand seqlens is replaced by the step's positions pos int32
    ``[batch]`` and the length is pos[b] + 1 (:func:`mk.tasks.decode_attention.decode_length`,
    what the step's QKV tiles write to seqlens), read before the task's wait: positions
    change only between steps, so one memory round trip leaves the chain from the QKV tiles
    to the O projection. The splits past the live ones then skip their dependency wait too
    (:attr:`OpSpec.waits_in_body`): they read and write nothing, and a consumer still waits
    for split 0, which is always live and waits. (At a short context most of the splits
    planned for the cache's length are past it: 1B batch 8, 3 of 4.)

    ``window``: a sliding window (Mistral): the slices cut only the last ``window`` keys
    (:func:`decode_slice`), so keys before them are never read.

    ``prologue`` (with ``from_positions``): what an op folded in does in each live split
    before it attends (:class:`AttentionPrologue`: the RoPE that writes q and appends the
    new key); its operands come after out.
    """
    op = "decode_attention"
    check_window(window)
    if prologue is not None and not from_positions:
        raise ValueError(f"{op}: a prologue needs from_positions (its splits wait in their body)")
    prologue = prologue or _NO_PROLOGUE
    win = ", WINDOW=WINDOW" if window is not None else ""  # (without a window: the code as before)
    part = decode_attention_partial_op(batch, num_q_heads, num_kv_heads, head_dim, max_seq, num_splits,
                                       scale=scale, block_n=block_n, num_warps=num_warps)
    hq, hkv, d, S = num_q_heads, num_kv_heads, head_dim, num_splits
    group = hq // hkv
    c = part.constexprs
    lengths = "pos" if from_positions else "seqlens"
    preload, body = _one_phase_source(from_positions, win, prologue)

    tile = _attention_tile(op, batch, hkv, S)

    def run(bufs, a):
        b, kv, s = tile(a)
        seqlen = _attention_length(op, bufs, b, batch, max_seq, from_positions)
        live = live_splits(seqlen, S, c["BLOCK_N"], window)
        if s >= live:  # past the sequence: nothing to do
            return
        prologue.run(bufs, b, kv, s, live)
        _run_attention_split(op, bufs, b, kv, s, batch=batch, hq=hq, hkv=hkv, d=d, max_seq=max_seq, splits=S,
                             block_n=c["BLOCK_N"], scale=c["SCALE"], direct=live == 1, seqlen=seqlen,
                             window=window)
        if live > 1:  # (with one, split 0 wrote out itself)
            _arrive_and_merge(op, bufs, b, kv, live, batch=batch, hq=hq, hkv=hkv, d=d, splits=S)

    def reads(a, bind):
        b, kv, _ = tile(a)
        r0, r1 = b * hq + kv * group, b * hq + (kv + 1) * group
        return (_attention_split_reads(bind, b, kv, hq=hq, hkv=hkv, d=d, max_seq=max_seq, lengths=lengths)
                + [Region(bind["o_part"], r0, r1, 0, S * d), Region(bind["lse"], r0, r1, 0, S)]
                + prologue.reads(bind, b, kv))

    def writes(a, bind):
        b, kv, s = tile(a)
        r0, r1 = b * hq + kv * group, b * hq + (kv + 1) * group
        return [Region(bind["o_part"], r0, r1, s * d, (s + 1) * d), Region(bind["lse"], r0, r1, s, s + 1),
                Region(bind["arrivals"], 0, 1, b * hkv + kv, b * hkv + kv + 1),
                Region(bind["out"], b, b + 1, kv * group * d, (kv + 1) * group * d)] + prologue.writes(bind, b, kv)

    operands = (tuple(lengths if role == "seqlens" else role for role in part.operands) + ("arrivals", "out")
                + prologue.operands)
    return OpSpec(name=op, operands=operands, args=part.args, body=body, preload=preload,
                  imports=("from mk.tasks.decode_attention import decode_attention_prefetch, decode_attention_tile, "
                           "decode_length, decode_live_splits",) + prologue.imports,
                  constexprs={**c, "BLOCK_S": 1 << (S - 1).bit_length(), "BLOCK_GROUP": 1 << (group - 1).bit_length(),
                              "FROM_POSITIONS": int(from_positions),
                              **({"WINDOW": window} if window is not None else {}),
                              **prologue.constexprs},
                  num_warps=part.num_warps, run=run, waits_in_body=from_positions,
                  reads=reads, writes=writes, team=lambda a: (a["b"], a["kv_head"]), sync_operands=("arrivals",),
                  tiles=part.tiles)


@register("decode_attention_merge")
def decode_attention_merge_op(batch: int, num_q_heads: int, head_dim: int, num_splits: int, *,
                              num_warps: int = 4) -> OpSpec:
    """out[b, q_head] = the log-sum-exp weighted mean of its ``num_splits`` partials.

    Operands: o_part float32 ``[batch, Hq, num_splits * D]`` and lse float32
    ``[batch, Hq, num_splits]`` (from :func:`decode_attention_partial_op` with the same
    sizes), out ``[batch, Hq * D]`` (what the O projection reads). Args: b, q_head.
    """
    op = "decode_attention_merge"
    check_sizes(op, batch=batch, num_q_heads=num_q_heads, head_dim=head_dim, num_splits=num_splits)
    if num_splits > MAX_NUM_SPLITS:
        raise ValueError(f"{op}: num_splits must be <= {MAX_NUM_SPLITS}, got {num_splits}")
    hq, d, S = num_q_heads, head_dim, num_splits
    block_s, block_d = 1 << (S - 1).bit_length(), 1 << (d - 1).bit_length()
    body = ("decode_attention_merge_tile(o_part, lse, out, b, q_head, NUM_SPLITS, "
            "HQ * NUM_SPLITS * HEAD_DIM, NUM_SPLITS * HEAD_DIM, HEAD_DIM, HQ * NUM_SPLITS, NUM_SPLITS, 1, "
            "HQ * HEAD_DIM, HEAD_DIM, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, CACHE='.cg')")

    def head(a):
        check_tile(op, "b", a["b"], batch)
        check_tile(op, "q_head", a["q_head"], hq)
        return a["b"], a["q_head"]

    def run(bufs, a):
        _run_attention_merge(op, bufs, *head(a), batch=batch, hq=hq, d=d, splits=S)

    def reads(a, bind):
        b, h = head(a)
        r = b * hq + h
        return [Region(bind["o_part"], r, r + 1, 0, S * d), Region(bind["lse"], r, r + 1, 0, S)]

    def writes(a, bind):
        b, h = head(a)
        return [Region(bind["out"], b, b + 1, h * d, (h + 1) * d)]

    return OpSpec(name=op, operands=("o_part", "lse", "out"), args=("b", "q_head"), body=body,
                  imports=("from mk.tasks.decode_attention import decode_attention_merge_tile",),
                  constexprs={"BATCH": batch, "HQ": hq, "HEAD_DIM": d, "NUM_SPLITS": S, "BLOCK_S": block_s,
                              "BLOCK_D": block_d},
                  num_warps=num_warps, run=run, reads=reads, writes=writes,
                  tiles=lambda _: [{"b": b, "q_head": h} for b in range(batch) for h in range(hq)])


# ---------------------------------------------------------------------------------------
# Planning: how the planner plans decode attention (mk.tasks._planning)
# ---------------------------------------------------------------------------------------


def _workspace_bytes(d: dict, kv_splits: int) -> int:
    """Bytes of decode attention's float32 partials (outputs and log-sum-exps), written once."""
    return d["batch"] * d["heads"] * kv_splits * (d["head_dim"] + 1) * 4


def attention_live_splits(d: dict, kv_splits: int) -> int:
    """KV splits of decode attention (an op's dims ``d``) that hold a key at its planned length
    ``kv_len``, as the kernel cuts them (:func:`decode_live_splits`): each split
    ceil(kv_len / kv_splits) keys rounded up to whole KV blocks, so at a short length the
    last splits hold none (they still run a task each, and return at once)."""
    block_n = decode_attention_config(d["heads"], d["kv_heads"], d["head_dim"]).block_n
    return live_splits(d["kv_len"], kv_splits, block_n)


#: Bytes of a cache element the planner's graphs may ask for, and the dtype that holds them.
_KV_DTYPES = {2: torch.bfloat16, 4: torch.float32}


class DecodeAttentionKind(OpKind):
    """Decode attention of a step: each (sequence, KV head) cut into KV splits, one task each,
    the group's last split merging it (one phase). It streams no weights: whoever waits on
    it waits with DRAM idle. The RoPE before it may fold into its splits (the RoPE's kind
    says when: :meth:`mk.tasks.qkv_rope.RopeKVKind.fuses_as_prologue`)."""

    kind = "attention"
    leaves_dram_idle = True

    def candidates(self, node, device, dtype_bytes=2, workers=None):
        return [OpChoice(kv_splits=s) for s in (1, 2, 4, 8, 16) if s <= max(1, node.dims["kv_len"] // 32)]

    def smem_bytes(self, node, choice, dtype_bytes=2):
        d = node.dims
        return decode_attention_smem_bytes(decode_attention_config(d["heads"], d["kv_heads"], d["head_dim"],
                                                                   d["kv_dtype_bytes"]),
                                           q_bytes=ACTIVATION_BYTES)

    def describe(self, choice):
        return f"kv_splits={choice.kv_splits}"

    def bytes_flops(self, node, choice):
        """Several live splits merge their partials through the workspace."""
        live = attention_live_splits(node.dims, choice.kv_splits)
        return node.bytes + (2 * _workspace_bytes(node.dims, live) if live > 1 else 0), node.flops

    def phase_terms(self, node, choice, device, phase, phase_tasks, phase_bytes, dtype_bytes=2):
        """The live splits carry the bytes (a split past the length returns at once, but is
        priced as a live one: its task still takes a worker's turn); the group's merging
        split reads the live partials back (exact when the splits run in one wave, as they
        do in decode)."""
        d = node.dims
        live = attention_live_splits(d, choice.kv_splits)
        return PhaseTerms(task_bytes=max(phase_bytes, 0) / (d["batch"] * d["kv_heads"] * live),
                          reread=_workspace_bytes(d, live) // (d["batch"] * d["kv_heads"]) if live > 1 else 0)

    def exposed_seconds(self, node, choice, device, task_bytes, dtype_bytes=2):
        """A RoPE folded in (its kind's ``attention_prologue``) costs each split a round trip
        for its QKV row before it attends, and the stores before its barrier."""
        return device.load_latency_s if choice.fuse else 0.0

    def _spec(self, node, max_seq: int, splits: int, prologue=None):
        d = node.dims
        # One phase: each KV group's last split merges it (with one split too: a copy). The
        # length from the positions: known before the wait (the step's QKV writes seqlens).
        return decode_attention_op(d["batch"], d["heads"], d["kv_heads"], d["head_dim"], max_seq, splits,
                                   from_positions=True, **({"window": d["window"]} if d.get("window") else {}),
                                   prologue=prologue)

    def specs(self, node, choice, fused=()):
        max_seq = node.dims["kv_len"]
        prologue = op_kind(fused[0].kind).attention_prologue(fused[0], max_seq, False, 1e-5) if fused else None
        return [(self._spec(node, max_seq, choice.kv_splits, prologue), None)]

    def buffer_shape(self, node, role, max_seq):
        d = node.dims
        if role in ("k_cache", "v_cache"):
            if d["kv_dtype_bytes"] not in _KV_DTYPES:
                raise ValueError(f"op {node.name}: a KV cache of {d['kv_dtype_bytes']}-byte elements; mk's steps "
                                 f"hold 2 or 4")
            return (d["batch"], d["kv_heads"], max_seq, d["head_dim"]), _KV_DTYPES[d["kv_dtype_bytes"]]
        return super().buffer_shape(node, role, max_seq)

    def lower(self, node, choice, ctx):
        d, B = node.dims, ctx.batch
        splits, hq, dh = choice.kv_splits, d["heads"], d["head_dim"]
        prologue, extra = None, {}
        if choice.fuse:  # a RoPE: the splits read the QKV row and write q and the new key themselves
            rope = ctx.nodes[choice.fuse[0]]
            kind = op_kind(rope.kind)
            prologue = kind.attention_prologue(rope, ctx.max_seq, ctx.first(rope), ctx.eps)
            extra = kind.attention_bindings(rope, ctx)
        ctx.add(node.name, self._spec(node, ctx.max_seq, splits, prologue),
                q=ctx.activation(node.inputs[0], B, hq * dh), k_cache=node.buffers["k_cache"],
                v_cache=node.buffers["v_cache"], pos="pos",
                o_part=ctx.activation(f"{node.name}.o_part", B, hq, splits * dh),
                lse=ctx.activation(f"{node.name}.lse", B, hq, splits),
                arrivals=ctx.activation(f"{node.name}.arrivals", B * d["kv_heads"], dt=torch.int32),
                out=ctx.activation(node.outputs[0], B, hq * dh), **extra)


ATTENTION = register_kind(DecodeAttentionKind())
