"""QKV projection, rotary embedding and KV append in one tile (one decode token a row).

    h          = rmsnorm(x)                          (with norm_weight, else h = x)
    q | k | v  = h @ W.T (+ bias)                    (W: [(Hq + 2 Hkv) D, K], q rows, k rows, v rows)
    q, k       = head_rmsnorm(q), head_rmsnorm(k)    (with q / k norm weights: Qwen3)
    q_out      = rope(q)                             float32 [B, Hq D]
    k_cache[b, h, pos[b]] = rope(k[b, h]);  v_cache[b, h, pos[b]] = v[b, h]

This is :func:`mk.tasks.linear.linear` followed by :func:`mk.tasks.rope.rope_kv`, with the
rotation and the cache stores done by the tile that computed the values, so a decode step
has no RoPE task (and no dependency hop) between the QKV projection and attention.

A rotation mixes elements i and i + D/2 of a head, which a tile of a few weight rows
does not hold together. So the q and k weight rows come in the *interleaved* rotary
layout (:func:`mk.tasks.rope.interleave_rotary`): the pairs are adjacent rows and a tile
of any even width holds whole pairs. The stores put each pair back in place, so rotated
q and the cache have the usual layout. v rows are as they are.

Qwen2's projection bias (``bias``, ``[(Hq + 2 Hkv) D]``) is added to the accumulator before
anything else; it is a vector over the weight rows, so the caller permutes it with them:
``cat(interleave_rotary(b_q, D), interleave_rotary(b_k, D), b_v)``. Qwen3's per-head q / k
RMSNorm (``q_norm_weight``, ``k_norm_weight``, ``[D]`` each) needs a head's every element in
one tile: block_n must then be a multiple of D (the launcher and
:func:`check_qkv_rope_tile` refuse others), and the weights come permuted as the rows:
``interleave_rotary(q_norm.weight, D)``. The norm statistic is a mean over the head, which
the permutation leaves as it is.

Accumulation, rotation and q are float32; the cache stores round to the cache's dtype.
:func:`qkv_rope_kv_tile` is the device function (the megakernel's fused QKV task);
:func:`qkv_rope_kv_reduce_tile` the same epilogue after a split-K reduce (the QKV of decode
batches); :func:`qkv_rope_kv` launches either on its own; :func:`qkv_rope_kv_ref` is the
torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import jit, check_same_device, check_same_dtype, check_tensor, is_capturing
from ._planning import OpKind, register_kind
from ._spec import OpSpec, Region, as_2d, check_sizes, operand_view, register
from .linear import (check_config, tile_rows, LinearConfig, linear_config, linear_partial_kernel, linear_ref,
                     linear_splitk_sum)
from .linear.planning import reduce_width
from .linear.spec import FULL_K_PREFETCH, LinearShape, prologue_ref, weight_streaming
from .linear.tile import _linear_acc
from .rope import _check_inv_freq, check_qk_norm, rope_kv_attention_prologue, rope_kv_op, rope_kv_ref


@jit
def qkv_rope_kv_tile(
    x_ptr, w_ptr, norm_w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr,
    pid_m, pid_n, M, K, max_seq, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr, WRITE_SEQLENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOUBLE_BUFFER: tl.constexpr = False, w_first=None, TMA_STAGES: tl.constexpr = 0,
    WAIT: tl.constexpr = None, wait_args=None, wait_state=None, WAIT_FLAGS: tl.constexpr = None,
    bias_ptr=None, q_norm_w_ptr=None, k_norm_w_ptr=None, qk_eps=0.0, w_scale_ptr=None, W_SCALE: tl.constexpr = 0,
):
    """Tile (pid_m, pid_n): rows pid_m*BLOCK_M.. of x, weight rows pid_n*BLOCK_N.. (even BLOCK_N).

    x ``[M, K]`` (rows K apart), w ``[(HQ + 2 HKV) * HEAD_DIM, K]`` with interleaved q/k
    rows, pos ``[M]`` (each row's position), inv_freq float32 ``[HEAD_DIM / 2]``, q float32
    ``[M, HQ * HEAD_DIM]``, caches ``[M, HKV, max_seq, HEAD_DIM]``. Writes the tile's q
    columns, or its k / v columns into the caches at each row's position (none when the
    position is outside ``[0, max_seq)``), and with WRITE_SEQLENS, tile column 0 also
    seqlens[row] = pos + 1 (clipped to ``[0, max_seq]``). The body streams the weights as
    :func:`mk.tasks.linear.linear_tile` does (DOUBLE_BUFFER, w_first, TMA_STAGES, WAIT; with
    WAIT the wait's new state is returned). ``bias_ptr``, ``q_norm_w_ptr``, ``k_norm_w_ptr``,
    ``qk_eps``: Qwen2's bias and Qwen3's q / k norm, as :func:`qkv_rope_kv_epilogue` takes them.
    ``w_scale_ptr``, ``W_SCALE``: the weight's format, which finishes the product before the
    bias and the rotation (:func:`mk.tasks.linear.tile._linear_acc`).
    """
    N: tl.constexpr = (HQ + 2 * HKV) * HEAD_DIM
    # The rotation's operands' round trip overlaps the weight stream instead of following it.
    pre = qkv_rope_operands(pos_ptr, inv_freq_ptr, pid_m, pid_n, M, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
                            BLOCK_N=BLOCK_N)
    state = 0
    if WAIT is not None:
        acc, state = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, 0, K, K, K, eps,
                                 HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                 TMA_STAGES=TMA_STAGES, WAIT=WAIT, wait_args=wait_args, wait_state=wait_state,
                                 WAIT_FLAGS=WAIT_FLAGS, w_scale_ptr=w_scale_ptr, W_SCALE=W_SCALE)
    else:
        acc = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, 0, K, K, K, eps,
                          HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                          DOUBLE_BUFFER=DOUBLE_BUFFER, w_first=w_first, TMA_STAGES=TMA_STAGES,
                          w_scale_ptr=w_scale_ptr, W_SCALE=W_SCALE)
    qkv_rope_kv_epilogue(acc, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr,
                         pid_m, pid_n, M, max_seq, HQ=HQ, HKV=HKV, HEAD_DIM=HEAD_DIM,
                         WRITE_SEQLENS=WRITE_SEQLENS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, pre=pre, bias_ptr=bias_ptr,
                         q_norm_w_ptr=q_norm_w_ptr, k_norm_w_ptr=k_norm_w_ptr, qk_eps=qk_eps)
    return state


@jit
def qkv_rope_kv_reduce_tile(
    ws_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr,
    pid_m, pid_n, M, max_seq, split_k: tl.constexpr, stride_ws_split, stride_ws_m,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_SEQLENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K=0, eps=0.0, NORM_SQ: tl.constexpr = False, pre=None,
    PART_BLOCK_N: tl.constexpr = 0, bias_ptr=None, q_norm_w_ptr=None, k_norm_w_ptr=None, qk_eps=0.0,
):
    """Tile (pid_m, pid_n) of a split-K QKV: sum its ``split_k`` float32 partials (written by
    :func:`mk.tasks.linear.linear_partial_tile`, read in split order, from L2), then rotate
    and store as :func:`qkv_rope_kv_tile` does. NORM_SQ: scale by the RMSNorm's rstd, which
    the partials left out (:func:`mk.tasks.linear.linear_splitk_sum`; PART_BLOCK_N as there).
    ``pre``: the tile's :func:`qkv_rope_operands`, when the caller loaded them before waiting
    for the partials. Bias and q / k norm (after the sum, as the whole-K tile applies them):
    :func:`qkv_rope_kv_epilogue`."""
    acc = linear_splitk_sum(ws_ptr, pid_m, pid_n, M, (HQ + 2 * HKV) * HEAD_DIM, split_k, stride_ws_split,
                            stride_ws_m, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, K=K, eps=eps, NORM_SQ=NORM_SQ,
                            PART_BLOCK_N=PART_BLOCK_N)
    qkv_rope_kv_epilogue(acc, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr,
                         pid_m, pid_n, M, max_seq, HQ=HQ, HKV=HKV, HEAD_DIM=HEAD_DIM,
                         WRITE_SEQLENS=WRITE_SEQLENS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, pre=pre, bias_ptr=bias_ptr,
                         q_norm_w_ptr=q_norm_w_ptr, k_norm_w_ptr=k_norm_w_ptr, qk_eps=qk_eps)


@jit
def qkv_rope_kv_epilogue(
    acc, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr, pid_m, pid_n, M, max_seq,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_SEQLENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, pre=None,
    bias_ptr=None, q_norm_w_ptr=None, k_norm_w_ptr=None, qk_eps=0.0,
):
    """Rotate tile (pid_m, pid_n)'s float32 ``[BLOCK_M, BLOCK_N]`` QKV values and store them:
    q columns to q, k / v columns into the caches at each row's position. ``pre``: the
    tile's :func:`qkv_rope_operands` when the caller has them already (as
    :func:`qkv_rope_kv_tile` does, before its weight stream).

    ``bias_ptr``: ``[N]`` added first, permuted as the weight rows (Qwen2). ``q_norm_w_ptr``
    and ``k_norm_w_ptr`` (together): ``[HEAD_DIM]`` weights, permuted as the q / k rows, of an
    RMSNorm of every q and k head (eps ``qk_eps``) before the rotation (Qwen3); BLOCK_N must
    then be a multiple of HEAD_DIM, so that the tile holds whole heads. None: off."""
    N: tl.constexpr = (HQ + 2 * HKV) * HEAD_DIM
    if bias_ptr is not None:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    # Adjacent accumulator columns are one rotation pair (2i, 2i + 1).
    even, odd = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col = pid_n * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)  # the pair's first weight row
    head = col // HEAD_DIM
    in_head = col % HEAD_DIM
    if q_norm_w_ptr is not None:
        even, odd = _qk_head_norm(even, odd, head, in_head, q_norm_w_ptr, k_norm_w_ptr, qk_eps, HQ=HQ, HKV=HKV,
                                  HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    if pre is None:
        position, cos, sin = qkv_rope_operands(pos_ptr, inv_freq_ptr, pid_m, pid_n, M, HEAD_DIM=HEAD_DIM,
                                               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    else:
        position, cos, sin = pre
    rotate = (head < HQ + HKV)[None, :]  # q and k heads; v passes through
    y_even = tl.where(rotate, even * cos - odd * sin, even)
    y_odd = tl.where(rotate, odd * cos + even * sin, odd)

    # Stores put pair i of a head back at elements (i, i + D/2): rotated q and the cache
    # keep the usual half-split layout. v rows were never permuted: element j stays at j.
    HALF: tl.constexpr = HEAD_DIM // 2
    is_v = head >= HQ + HKV
    first = tl.where(is_v, in_head, in_head // 2)[None, :]
    second: tl.constexpr = HALF
    ok = (offs_m < M)[:, None] & (col < N)[None, :]
    is_q = (head < HQ)[None, :]
    q_ptrs = q_ptr + offs_m[:, None] * (HQ * HEAD_DIM) + (head * HEAD_DIM)[None, :] + first
    tl.store(q_ptrs, y_even, mask=ok & is_q)
    tl.store(q_ptrs + second, y_odd, mask=ok & is_q)
    in_cache = ((position >= 0) & (position < max_seq))[:, None]
    kv_head = tl.where(is_v, head - HQ - HKV, head - HQ)
    # int64: row * (HKV * max_seq * HEAD_DIM) passes 2**31 for long caches.
    cache_row = (offs_m.to(tl.int64)[:, None] * HKV + kv_head[None, :]) * max_seq + position.to(tl.int64)[:, None]
    offs = cache_row * HEAD_DIM + first
    kv_ok = ok & in_cache & (head >= HQ)[None, :]
    k_ok = kv_ok & (~is_v)[None, :]
    v_ok = kv_ok & is_v[None, :]
    tl.store(k_cache_ptr + offs, y_even.to(k_cache_ptr.dtype.element_ty), mask=k_ok)
    tl.store(k_cache_ptr + offs + second, y_odd.to(k_cache_ptr.dtype.element_ty), mask=k_ok)
    tl.store(v_cache_ptr + offs, y_even.to(v_cache_ptr.dtype.element_ty), mask=v_ok)
    tl.store(v_cache_ptr + offs + 1, y_odd.to(v_cache_ptr.dtype.element_ty), mask=v_ok)
    if WRITE_SEQLENS:
        if pid_n == 0:
            n = tl.minimum(tl.maximum(position + 1, 0), max_seq)
            tl.store(seqlens_ptr + offs_m, n.to(seqlens_ptr.dtype.element_ty), mask=offs_m < M)


@jit
def _qk_head_norm(even, odd, head, in_head, q_norm_w_ptr, k_norm_w_ptr, eps,
                  HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's pairs (even, odd: ``[BLOCK_M, BLOCK_N / 2]``) with every q and k head
    RMSNorm-ed by its weight (interleaved like the rows: pair column c of a head holds
    elements in_head and in_head + 1); v heads pass through. The tile holds whole heads
    (BLOCK_N a multiple of HEAD_DIM), so a head's HEAD_DIM / 2 pairs are adjacent."""
    tl.static_assert(BLOCK_N % HEAD_DIM == 0, "a per-head q/k norm needs whole heads in a tile")
    HEADS: tl.constexpr = BLOCK_N // HEAD_DIM
    PAIRS: tl.constexpr = HEAD_DIM // 2
    sq = tl.sum(tl.reshape(even * even + odd * odd, [BLOCK_M, HEADS, PAIRS]), axis=2)
    rstd = 1.0 / tl.sqrt(sq / HEAD_DIM + eps)                                     # [BLOCK_M, HEADS]
    rstd = tl.reshape(tl.broadcast_to(rstd[:, :, None], [BLOCK_M, HEADS, PAIRS]), [BLOCK_M, BLOCK_N // 2])
    is_q = head < HQ
    is_k = (head >= HQ) & (head < HQ + HKV)
    w_even = tl.where(is_q, tl.load(q_norm_w_ptr + in_head).to(tl.float32),
                      tl.where(is_k, tl.load(k_norm_w_ptr + in_head).to(tl.float32), 1.0))
    w_odd = tl.where(is_q, tl.load(q_norm_w_ptr + in_head + 1).to(tl.float32),
                     tl.where(is_k, tl.load(k_norm_w_ptr + in_head + 1).to(tl.float32), 1.0))
    scale = tl.where((is_q | is_k)[None, :], rstd, 1.0)
    return even * scale * w_even[None, :], odd * scale * w_odd[None, :]


@jit
def qkv_rope_operands(pos_ptr, inv_freq_ptr, pid_m, pid_n, M,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile (pid_m, pid_n)'s rows' positions and the cos and sin ([BLOCK_M, BLOCK_N / 2]
    float32) of its rotation pairs' angles.

    None depends on the step's tasks (positions change only between decode steps), so a
    megakernel task computes them before its dependency wait and passes them on as ``pre``."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col = pid_n * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)
    position = tl.load(pos_ptr + tl.minimum(offs_m, M - 1))
    angle = position.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + (col % HEAD_DIM) // 2)[None, :]
    return position, tl.cos(angle), tl.sin(angle)


@jit
def qkv_rope_kv_run_epilogue(acc, pid_m, pid_n, args, FLAGS: tl.constexpr):
    """:func:`qkv_rope_kv_epilogue` as :func:`mk.tasks.linear.linear_run`'s epilogue, so a run
    of QKV tiles rotates and stores each tile as it completes. ``args``: (pos_ptr,
    inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr, M, max_seq, pre, bias_ptr,
    q_norm_w_ptr, k_norm_w_ptr, qk_eps); FLAGS: (HQ, HKV, HEAD_DIM, WRITE_SEQLENS, HAS_PRE,
    HAS_BIAS, HAS_QK_NORM). ``pre`` is the tile's :func:`qkv_rope_operands` loaded ahead (a
    run of one tile); the bias is Qwen2's, the q / k norm Qwen3's
    (:func:`qkv_rope_kv_epilogue`). An entry whose flag is off holds any placeholder: a tuple
    holding None does not compile on every Triton."""
    pre = None
    bias_ptr = None
    q_norm_w_ptr = None
    k_norm_w_ptr = None
    qk_eps = 0.0
    if FLAGS[4]:
        pre = args[8]
    if FLAGS[5]:
        bias_ptr = args[9]
    if FLAGS[6]:
        q_norm_w_ptr = args[10]
        k_norm_w_ptr = args[11]
        qk_eps = args[12]
    qkv_rope_kv_epilogue(acc, args[0], args[1], args[2], args[3], args[4], args[5], pid_m, pid_n, args[6], args[7],
                         HQ=FLAGS[0], HKV=FLAGS[1], HEAD_DIM=FLAGS[2], WRITE_SEQLENS=FLAGS[3], BLOCK_M=acc.shape[0],
                         BLOCK_N=acc.shape[1], pre=pre, bias_ptr=bias_ptr, q_norm_w_ptr=q_norm_w_ptr,
                         k_norm_w_ptr=k_norm_w_ptr, qk_eps=qk_eps)


@jit
def qkv_rope_kv_reduce_kernel(
    ws_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr, bias_ptr, q_norm_w_ptr, k_norm_w_ptr,
    M, max_seq, qk_eps, split_k: tl.constexpr, stride_ws_split, stride_ws_m,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_SEQLENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tiles_n = tl.cdiv((HQ + 2 * HKV) * HEAD_DIM, BLOCK_N)
    pid = tl.program_id(0)
    qkv_rope_kv_reduce_tile(ws_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr,
                            pid // tiles_n, pid % tiles_n, M, max_seq, split_k, stride_ws_split, stride_ws_m,
                            HQ=HQ, HKV=HKV, HEAD_DIM=HEAD_DIM, WRITE_SEQLENS=WRITE_SEQLENS,
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, bias_ptr=bias_ptr, q_norm_w_ptr=q_norm_w_ptr,
                            k_norm_w_ptr=k_norm_w_ptr, qk_eps=qk_eps)


@jit
def qkv_rope_kv_kernel(
    x_ptr, w_ptr, norm_w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr,
    bias_ptr, q_norm_w_ptr, k_norm_w_ptr, M, K, max_seq, eps, qk_eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
    WRITE_SEQLENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tiles_n = tl.cdiv((HQ + 2 * HKV) * HEAD_DIM, BLOCK_N)
    pid = tl.program_id(0)
    qkv_rope_kv_tile(x_ptr, w_ptr, norm_w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr,
                     pid // tiles_n, pid % tiles_n, M, K, max_seq, eps,
                     HQ=HQ, HKV=HKV, HEAD_DIM=HEAD_DIM, HAS_NORM=HAS_NORM, WRITE_SEQLENS=WRITE_SEQLENS,
                     BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, bias_ptr=bias_ptr,
                     q_norm_w_ptr=q_norm_w_ptr, k_norm_w_ptr=k_norm_w_ptr, qk_eps=qk_eps)


def check_qkv_rope_tile(block_n: int, head_dim: int, qk_norm: bool = False) -> None:
    """Whether a QKV + RoPE tile of ``block_n`` weight rows serves (pure; for the planner):
    even (whole rotation pairs), and with the q / k norm a multiple of ``head_dim`` (whole
    heads, whose statistic the tile takes itself). Raises ValueError naming the rule."""
    if block_n < 2 or block_n % 2:
        raise ValueError(f"config.block_n must be even (>= 2): a tile holds whole rotation pairs, got {block_n}")
    if qk_norm and block_n % head_dim:
        raise ValueError(f"config.block_n must be a multiple of head_dim={head_dim} with the q/k norm: a tile "
                         f"normalises whole heads, got {block_n}")


def qkv_rope_kv(
    x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_q_heads: int,
    norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6, seqlens: torch.Tensor | None = None,
    config: LinearConfig | None = None, bias: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, qk_norm_eps: float = 1e-6,
) -> torch.Tensor:
    """One decode token a sequence: project, rotate, append to the cache; returns q.

    Args:
        x: ``[B, K]`` contiguous, the new token's hidden state of each sequence (weight's
            dtype or float32).
        weight: ``[(Hq + 2 Hkv) * D, K]`` contiguous: q rows, k rows, v rows, the q and k
            rows in the interleaved rotary layout (:func:`mk.tasks.rope.interleave_rotary`).
        positions: int32/int64 ``[B]``, each in ``[0, S_max)``.
        inv_freq: float32 ``[D / 2]`` (:func:`mk.tasks.rope.rope_inv_freq`).
        k_cache, v_cache: ``[B, Hkv, S_max, D]`` contiguous, one dtype; D from here.
        num_q_heads: Hq.
        norm_weight: optional ``[K]``: x is RMSNorm-ed first (eps ``norm_eps``).
        seqlens: optional int32/int64 ``[B]``, set to ``positions + 1``.
        config: tile sizes (even block_n; with split_k > 1 the partials go through a float32
            workspace and a reduce tile rotates); :func:`mk.tasks.linear.linear_config` when None
            (with q / k norms, block_n raised to a multiple of D).
        bias: optional ``[(Hq + 2 Hkv) * D]`` added to the projection (Qwen2), permuted as the
            weight rows: ``cat(interleave_rotary(b_q, D), interleave_rotary(b_k, D), b_v)``.
        q_norm_weight, k_norm_weight: optional ``[D]`` each, together: every q and k head is
            RMSNorm-ed (eps ``qk_norm_eps``) before the rotation (Qwen3), permuted as the rows:
            ``interleave_rotary(q_norm.weight, D)``. config.block_n must then be a multiple of D.

    Returns:
        Rotated q, float32 ``[B, Hq * D]`` (the usual half-split layout). Everything is checked
        before anything is written (position values only outside CUDA graph capture).
    """
    check_tensor("x", x, ndim=2)
    B, K = x.shape
    check_tensor("k_cache", k_cache, ndim=4)
    _, hkv, max_seq, d = k_cache.shape
    check_tensor("k_cache", k_cache, shape=(B, hkv, max_seq, d))
    check_tensor("v_cache", v_cache, shape=(B, hkv, max_seq, d))
    check_same_dtype(k_cache=k_cache, v_cache=v_cache)
    if d < 2 or d % 2:
        raise ValueError(f"k_cache has head_dim {d}; rotary embedding needs an even head_dim >= 2")
    if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1:
        raise ValueError(f"num_q_heads must be an int >= 1, got {num_q_heads!r}")
    N = (num_q_heads + 2 * hkv) * d
    check_tensor("weight", weight, shape=(N, K))
    if x.dtype != weight.dtype and x.dtype != torch.float32:
        raise TypeError(f"x must have weight's dtype ({weight.dtype}) or float32, got {x.dtype}")
    check_tensor("positions", positions, shape=(B,), dtype=(torch.int32, torch.int64))
    _check_inv_freq(inv_freq, d // 2)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(K,))
    if bias is not None:
        check_tensor("bias", bias, shape=(N,))
        check_same_device(x=x, bias=bias)
    check_qk_norm(q_norm_weight, k_norm_weight, d, qk_norm_eps, x, eps_name="qk_norm_eps")
    if seqlens is not None:
        check_tensor("seqlens", seqlens, shape=(B,), dtype=(torch.int32, torch.int64))
    check_same_device(x=x, weight=weight, positions=positions, inv_freq=inv_freq, k_cache=k_cache,
                      v_cache=v_cache, **({"norm_weight": norm_weight} if norm_weight is not None else {}),
                      **({"seqlens": seqlens} if seqlens is not None else {}))
    if B and not is_capturing(positions):
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= max_seq:
            raise ValueError(f"positions must lie in [0, {max_seq}) (the cache length S_max), "
                             f"got values from {lo} to {hi}")
    qk_norm = q_norm_weight is not None
    if config is None:
        config = linear_config(B, N, K, x.dtype)
        if qk_norm and config.block_n % d:
            # Whole heads a tile; as many weight elements a chunk as the default tile streams.
            block_n = d * -(-config.block_n // d)
            config = LinearConfig(**{**config.to_dict(), "block_n": block_n,
                                     "block_k": max(config.block_k * config.block_n // block_n, 16)})
    config = check_config(config, K, silu_mul=False)
    check_qkv_rope_tile(config.block_n, d, qk_norm)
    q = torch.empty((B, num_q_heads * d), dtype=torch.float32, device=x.device)
    if B == 0:
        return q
    bm, bn = tile_rows(config, B), config.block_n
    tiles = triton.cdiv(B, bm) * triton.cdiv(N, bn)
    sizes = dict(HQ=num_q_heads, HKV=hkv, HEAD_DIM=d, WRITE_SEQLENS=seqlens is not None, BLOCK_M=bm, BLOCK_N=bn,
                 num_warps=config.num_warps)
    outputs = (positions, inv_freq, q, k_cache, v_cache, seqlens if seqlens is not None else positions,
               bias, q_norm_weight, k_norm_weight)
    norm_w = norm_weight if norm_weight is not None else weight
    if config.split_k == 1:
        qkv_rope_kv_kernel[(tiles,)](
            x, weight, norm_w, *outputs, B, K, max_seq, float(norm_eps), float(qk_norm_eps),
            HAS_NORM=norm_weight is not None, BLOCK_K=config.block_k, num_stages=config.num_stages, **sizes)
        return q
    # Split-K: the linear's partials, then one reduce tile per output tile rotates and stores.
    ws = torch.empty((config.split_k, B, N), dtype=torch.float32, device=x.device)
    linear_partial_kernel[(tiles, config.split_k)](
        x, weight, norm_w, ws, B, N, K, config.split_k, x.stride(0), weight.stride(0), ws.stride(0), ws.stride(1),
        float(norm_eps), HAS_NORM=norm_weight is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config.block_k,
        GROUP_M=1, PREFETCH_LINES=0, LINE=1, PDL=False, PREFETCH_BULK=False,
        num_warps=config.num_warps, num_stages=config.num_stages)
    qkv_rope_kv_reduce_kernel[(tiles,)](ws, *outputs, B, max_seq, float(qk_norm_eps), config.split_k,
                                        ws.stride(0), ws.stride(1), **sizes)
    return q


def qkv_rope_kv_ref(
    x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_q_heads: int,
    norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6, bias: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, qk_norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for :func:`qkv_rope_kv` (linear and bias, then interleaved q / k norm, RoPE
    and the append); changes nothing it is given. Returns float32 ``(q, k_cache_after,
    v_cache_after)``."""
    B = x.shape[0]
    d = k_cache.shape[-1]
    hkv = k_cache.shape[1]
    qkv = linear_ref(x, weight, norm_weight=norm_weight, norm_eps=norm_eps)
    if bias is not None:
        qkv = qkv + bias.float()
    q, k, v = qkv.view(B, 1, num_q_heads + 2 * hkv, d).split([num_q_heads, hkv, hkv], dim=2)
    q_rot, k_after, v_after = rope_kv_ref(q, k, v, positions.view(B, 1), inv_freq, k_cache, v_cache,
                                          interleaved=True, q_norm_weight=q_norm_weight,
                                          k_norm_weight=k_norm_weight, norm_eps=qk_norm_eps)
    return q_rot.reshape(B, -1), k_after, v_after


# ---------------------------------------------------------------------------------------
# Megakernel spec: how the op runs as a task of the persistent kernel (mk.tasks._spec)
# ---------------------------------------------------------------------------------------


class _QkvRope:
    """The RoPE + KV append epilogue of a QKV tile (fused, or after a split-K reduce): its
    VM semantics and its regions, for tiles of ``s`` (a :class:`mk.tasks.linear.spec.LinearShape`)."""

    def __init__(self, op, s, batch, hq, hkv, d, max_seq, write_seqlens, bias=False, qk_norm=False, qk_eps=1e-6):
        self.op, self.s, self.batch, self.hq, self.hkv, self.d = op, s, batch, hq, hkv, d
        self.max_seq, self.write_seqlens = max_seq, write_seqlens
        self.bias, self.qk_norm, self.qk_eps = bias, qk_norm, qk_eps
        if qk_norm:
            check_qkv_rope_tile(s.bn, d, qk_norm=True)

    @property
    def operands(self) -> tuple[str, ...]:
        """The family options' operands: bias ``[N]``, q_norm and k_norm ``[D]`` (in the rows' layout)."""
        return (("bias",) if self.bias else ()) + (("q_norm", "k_norm") if self.qk_norm else ())

    def device_kwargs(self) -> str:
        """The options as the tile functions' keyword arguments (empty when off)."""
        out = ", bias_ptr=bias" if self.bias else ""
        return out + (", q_norm_w_ptr=q_norm, k_norm_w_ptr=k_norm, qk_eps=QK_EPS" if self.qk_norm else "")

    def run_args(self) -> str:
        """The options as :func:`qkv_rope_kv_run_epilogue`'s trailing args (``pos`` holds the
        place of each that is off)."""
        norms = "q_norm, k_norm, QK_EPS" if self.qk_norm else "pos, pos, 0.0"
        return f", {'bias' if self.bias else 'pos'}, {norms}"

    def run_flags(self, pre: bool) -> str:
        """:func:`qkv_rope_kv_run_epilogue`'s FLAGS."""
        return f"HQ, HKV, HEAD_DIM, SEQLENS, {int(pre)}, {int(self.bias)}, {int(self.qk_norm)}"

    def constexprs(self) -> dict:
        return {"QKV_BIAS": int(self.bias), "QK_NORM": int(self.qk_norm),
                **({"QK_EPS": float(self.qk_eps)} if self.qk_norm else {})}

    def store(self, b, a, acc: torch.Tensor) -> None:
        """VM: add the bias, norm the q / k heads, rotate the float32 tile ``acc`` and store
        q, or k / v into the caches."""
        op, batch, hq, hkv, d, max_seq = self.op, self.batch, self.hq, self.hkv, self.d, self.max_seq
        r0, r1, n0, n1, _, _ = self.s.tile(a)
        if self.bias:
            acc = acc + as_2d(b["bias"])[0, n0:n1].float()
        if self.qk_norm:  # whole heads (check_qkv_rope_tile): each q / k head's columns normed
            acc = acc.clone()
            for c in range(0, n1 - n0, d):
                head = (n0 + c) // d
                if head < hq + hkv:
                    w = as_2d(b["q_norm" if head < hq else "k_norm"])[0].float()
                    x = acc[:, c:c + d]
                    acc[:, c:c + d] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.qk_eps) * w
        pos = operand_view(op, "pos", b["pos"], 1, batch)[0, r0:r1].long()
        inv = operand_view(op, "inv_freq", b["inv_freq"], 1, d // 2)[0].float()
        cols = torch.arange(n0, n1, 2, device=acc.device)
        heads, in_head = cols // d, cols % d
        angle = pos.float()[:, None] * inv[in_head // 2][None, :]
        even, odd = acc[:, 0::2], acc[:, 1::2]
        rot = (heads < hq + hkv)[None, :]
        y_even = torch.where(rot, even * angle.cos() - odd * angle.sin(), even)
        y_odd = torch.where(rot, odd * angle.cos() + even * angle.sin(), odd)
        q = operand_view(op, "q", b["q"], batch, hq * d)
        caches = {c: operand_view(op, c, b[c], batch * hkv * max_seq, d).view(batch, hkv, max_seq, d)
                  for c in ("k_cache", "v_cache")}
        for j, n in enumerate(cols.tolist()):
            head, in_head = n // d, n % d
            # Pair i of a rotated head goes back to elements (i, i + D/2); v stays in place.
            dims = (in_head, in_head + 1) if head >= hq + hkv else (in_head // 2, in_head // 2 + d // 2)
            for value, dim in zip((y_even[:, j], y_odd[:, j]), dims):
                if head < hq:
                    q[r0:r1, head * d + dim] = value.to(q.dtype)
                    continue
                cache = caches["k_cache" if head < hq + hkv else "v_cache"]
                kv = head - hq if head < hq + hkv else head - hq - hkv
                for i, p in enumerate(pos.tolist()):
                    if 0 <= p < max_seq:
                        cache[r0 + i, kv, p, dim] = value[i].to(cache.dtype)
        if self.write_seqlens and a["pid_n"] == 0:
            seqlens = operand_view(op, "seqlens", b["seqlens"], 1, batch)[0]
            seqlens[r0:r1] = (pos + 1).clamp(0, max_seq).to(seqlens.dtype)

    def reads(self, a, bind) -> list:
        r0, r1, n0, n1, _, _ = self.s.tile(a)
        regs = [Region(bind["pos"], 0, 1, r0, r1), Region(bind["inv_freq"], 0, 1, 0, self.d // 2)]
        if self.bias:
            regs.append(Region(bind["bias"], 0, 1, n0, n1))
        if self.qk_norm:
            regs += [Region(bind["q_norm"], 0, 1, 0, self.d), Region(bind["k_norm"], 0, 1, 0, self.d)]
        return regs

    def writes(self, a, bind) -> list:
        hq, hkv, d, max_seq = self.hq, self.hkv, self.d, self.max_seq
        r0, r1, n0, n1, _, _ = self.s.tile(a)
        regs = []
        for head in range(n0 // d, (n1 - 1) // d + 1):
            # The tile's weight rows of this head, then the elements they become.
            lo, hi = max(n0, head * d) - head * d, min(n1, (head + 1) * d) - head * d
            if head >= hq + hkv or (lo, hi) == (0, d):
                spans = [(lo, hi)]
            else:
                spans = [(lo // 2, hi // 2), (lo // 2 + d // 2, hi // 2 + d // 2)]
            if head < hq:
                regs += [Region(bind["q"], r0, r1, head * d + c0, head * d + c1) for c0, c1 in spans]
                continue
            cache, kv = ("k_cache", head - hq) if head < hq + hkv else ("v_cache", head - hq - hkv)
            regs += [Region(bind[cache], (row * hkv + kv) * max_seq, (row * hkv + kv + 1) * max_seq, c0, c1)
                     for row in range(r0, r1) for c0, c1 in spans]
        if self.write_seqlens and a["pid_n"] == 0:
            regs.append(Region(bind["seqlens"], 0, 1, r0, r1))
        return regs


#: A QKV task's rotation operands (positions, the angles' cos and sin), computed before its
#: wait: positions change only between decode steps.
_ROPE_PRE = ("rope_pre = qkv_rope_operands(pos, inv_freq, pid_m, pid_n, M, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, "
             "BLOCK_N=BLOCK_N)")


@register("qkv_rope_kv")
def qkv_rope_kv_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, K: int, max_seq: int, *,
                   block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None, norm: bool = False, eps: float = 1e-6,
                   write_seqlens: bool = False, double_buffer: bool = True, preload_weights: bool | None = None,
                   tma_stages: int = 0, prefetch_k: int = 0, tiles_per_task: int = 1,
                   dtype: torch.dtype | None = None, bias: bool = False, qk_norm: bool = False,
                   qk_eps: float = 1e-6, w_scale: int = 0) -> OpSpec:
    """One tile (pid_m, pid_n) of the fused QKV projection + RoPE + KV append
    (:mod:`mk.tasks.qkv_rope`): a linear tile over the ``(Hq + 2 Hkv) * D`` weight rows that
    rotates its q / k pairs and stores q, or its k / v columns into the caches.

    Operands: x ``[batch, K]``, w (q/k rows interleaved, :func:`mk.tasks.rope.interleave_rotary`),
    norm_w ``[K]`` (with norm), pos ``[batch]``, inv_freq float32 ``[D/2]``, q float32
    ``[batch, Hq * D]``, k_cache and v_cache ``[batch, Hkv, max_seq, D]``, with
    ``write_seqlens`` seqlens ``[batch]`` (= pos + 1, written by the tiles of column 0);
    with ``bias`` bias ``[N]`` (Qwen2), with ``qk_norm`` q_norm and k_norm ``[D]`` (Qwen3:
    each q / k head RMSNorm-ed, eps ``qk_eps``, before the rotation; block_n a multiple of D),
    both in the rows' layout. Args: pid_m, pid_n. Tiles, weight streaming, prefetch and
    their options as :func:`mk.tasks.linear.linear_op`.

    Regions: a tile's cache write is at a runtime position, so it declares every position
    of the heads (and head columns) it covers, per sequence: attention of those heads waits
    for it, as it must.
    """
    check_sizes("qkv_rope_kv", batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, K=K, max_seq=max_seq)
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    if d % 2:
        raise ValueError(f"qkv_rope_kv: head_dim must be even, got {d}")
    N = (hq + 2 * hkv) * d
    s = LinearShape("qkv_rope_kv", batch, N, K, 1, block_m, block_n, block_k, num_warps, False, False,
                     prefetch_k, dtype, tiles_per_task, w_scale)
    if s.bn % 2:
        raise ValueError(f"qkv_rope_kv: block_n must be even (a tile holds whole rotation pairs), got {s.bn}")
    tma, double_buffer, preload = weight_streaming(s, K, tma_stages, dtype, double_buffer, preload_weights)
    rope = _QkvRope("qkv_rope_kv", s, batch, hq, hkv, d, max_seq, write_seqlens, bias, qk_norm, qk_eps)
    operands = (("x", "w") + s.scale_operands + (("norm_w",) if norm else ())
                + ("pos", "inv_freq", "q", "k_cache", "v_cache")
                + (("seqlens",) if write_seqlens else ()) + rope.operands)
    body = (f"qkv_rope_kv_tile(x, w, {'norm_w' if norm else 'w'}, pos, inv_freq, q, k_cache, v_cache, "
            f"{'seqlens' if write_seqlens else 'pos'}, pid_m, pid_n, M, K, S_MAX, {'EPS' if norm else '0.0'}, "
            f"HQ=HQ, HKV=HKV, HEAD_DIM=HEAD_DIM, HAS_NORM=HAS_NORM, WRITE_SEQLENS=SEQLENS, "
            f"BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOUBLE_BUFFER=DOUBLE_BUFFER, "
            f"TMA_STAGES=TMA_STAGES{', w_first=w_first' if preload else ''}{rope.device_kwargs()}"
            f"{s.scale_kwargs})")
    body = s.waiting(body, tma)
    rope_pre = ""
    if s.streams_in_run(tma):
        # A one-tile task loads its rotation operands before its wait (they do not depend on
        # the step's tasks), so its epilogue starts without a round trip.
        rope_pre = _ROPE_PRE if s.run == 1 else ""
        body = s.run_body(norm, "0, K", "qkv_rope_kv_run_epilogue",
                          f"pos, inv_freq, q, k_cache, v_cache, {'seqlens' if write_seqlens else 'pos'}, M, S_MAX, "
                          f"{'rope_pre' if rope_pre else 'pos'}{rope.run_args()}",
                          rope.run_flags(bool(rope_pre)), wait=s.waits_in_body(tma))
    constexprs = {**s.constexprs(), "HQ": hq, "HKV": hkv, "HEAD_DIM": d, "S_MAX": max_seq, "HAS_NORM": int(norm),
                  "SEQLENS": int(write_seqlens), **s.stream_constexprs(tma), "PRELOAD": int(preload),
                  "DOUBLE_BUFFER": int(bool(double_buffer) and s.bm == 1)}
    if norm:
        constexprs["EPS"] = float(eps)
    if bias or qk_norm:  # (a Llama's keys stay as they were)
        constexprs.update(rope.constexprs())
    preload_src = ("w_first = linear_weights_first(w, pid_n, N, 0, K, K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)"
                   if preload else "")
    preload_src = "\n".join(x for x in (preload_src, rope_pre) if x)
    prefetch = FULL_K_PREFETCH

    def run(b, a):
        r0, r1, n0, n1, _, _ = s.tile(a)
        h = prologue_ref(operand_view("qkv_rope_kv", "x", b["x"], batch, K)[r0:r1], b["norm_w"] if norm else None, eps)
        rope.store(b, a, h @ s.weights_ref(b, n0, n1).T)

    def reads(a, bind):
        r0, r1, n0, n1, _, _ = s.tile(a)
        regs = ([Region(bind["x"], r0, r1, 0, K), Region(bind["w"], n0, n1, 0, K)] + s.scale_regions(bind, n0, n1)
                + rope.reads(a, bind))
        if norm:
            regs.append(Region(bind["norm_w"], 0, 1, 0, K))
        return regs

    return OpSpec(name="qkv_rope_kv", operands=operands, args=("pid_m", "pid_n"), body=body, prefetch=prefetch,
                  preload=preload_src, waits_in_body=s.task_waits(tma),
                  imports=("from mk.tasks.linear import linear_prefetch_tile, linear_run, linear_weights_first",
                           "from mk.tasks.qkv_rope import qkv_rope_kv_run_epilogue, qkv_rope_kv_tile, "
                           "qkv_rope_operands"),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=rope.writes,
                  tiles=lambda _: s.task_args())


@register("qkv_rope_kv_reduce")
def qkv_rope_kv_reduce_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, K: int, max_seq: int,
                          split_k: int, *, block_m: int | None = None, block_n: int | None = None,
                          block_k: int | None = None, num_warps: int | None = None, write_seqlens: bool = False,
                          norm_sq: bool = False, eps: float = 1e-6, part_block_n: int | None = None,
                          dtype: torch.dtype | None = None, bias: bool = False, qk_norm: bool = False,
                          qk_eps: float = 1e-6) -> OpSpec:
    """Tile (pid_m, pid_n) of a split-K QKV projection: sum its float32 partials (from a
    :func:`mk.tasks.linear.linear_partial_op` of the same sizes, N = (Hq + 2 Hkv) * D, q/k rows interleaved),
    then RoPE + KV append as :func:`qkv_rope_kv_op` does.

    Operands: ws float32 ``[split_k, batch, N]``, pos, inv_freq, q, k_cache, v_cache (and
    seqlens with ``write_seqlens``) as in :func:`qkv_rope_kv_op`. Args: pid_m, pid_n.
    ``norm_sq``, ``part_block_n``: as :func:`mk.tasks.linear.linear_reduce_op` (the RMSNorm's rstd applied here).
    ``bias``, ``qk_norm``, ``qk_eps``: as :func:`qkv_rope_kv_op` (the partials leave the bias out).
    """
    op = "qkv_rope_kv_reduce"
    check_sizes(op, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, K=K,
                 max_seq=max_seq, split_k=split_k)
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    if d % 2:
        raise ValueError(f"{op}: head_dim must be even, got {d}")
    s = LinearShape(op, batch, (hq + 2 * hkv) * d, K, split_k, block_m, block_n, block_k, num_warps, False, False,
                     0, dtype)
    if s.bn % 2:
        raise ValueError(f"{op}: block_n must be even (a tile holds whole rotation pairs), got {s.bn}")
    part_bn = s.narrow_reduce(part_block_n)
    rope = _QkvRope(op, s, batch, hq, hkv, d, max_seq, write_seqlens, bias, qk_norm, qk_eps)
    operands = (("ws", "pos", "inv_freq", "q", "k_cache", "v_cache") + (("seqlens",) if write_seqlens else ())
                + rope.operands)
    body = (f"qkv_rope_kv_reduce_tile(ws, pos, inv_freq, q, k_cache, v_cache, {'seqlens' if write_seqlens else 'pos'}, "
            f"pid_m, pid_n, M, S_MAX, SPLIT_K, M * WS_N, WS_N, HQ=HQ, HKV=HKV, HEAD_DIM=HEAD_DIM, "
            f"WRITE_SEQLENS=SEQLENS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, K=K, eps=EPS, NORM_SQ=NORM_SQ, pre=rope_pre, "
            f"PART_BLOCK_N=PART_BLOCK_N{rope.device_kwargs()})")
    constexprs = {k: v for k, v in s.constexprs().items() if k not in ("BLOCK_K", "PREFETCH_LINES", "LINE", "PREFETCH_BULK")}
    constexprs.update(SPLIT_K=split_k, HQ=hq, HKV=hkv, HEAD_DIM=d, S_MAX=max_seq, SEQLENS=int(write_seqlens),
                      NORM_SQ=int(norm_sq), WS_N=s.ws_cols(norm_sq), EPS=float(eps) if norm_sq else 0.0,
                      PART_BLOCK_N=part_bn)
    if bias or qk_norm:
        constexprs.update(rope.constexprs())

    def run(b, a):
        rope.store(b, a, s.reduce(b, a, norm_sq, eps))

    def reads(a, bind):
        return s.ws_regions(a, bind, norm_sq) + rope.reads(a, bind)

    return OpSpec(name=op, operands=operands, args=("pid_m", "pid_n"), body=body, preload=_ROPE_PRE,
                  imports=("from mk.tasks.qkv_rope import qkv_rope_kv_reduce_tile, qkv_rope_operands",),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=rope.writes,
                  tiles=lambda _: s.task_args())


# ---------------------------------------------------------------------------------------
# Planning: how the planner plans RoPE + KV append of a decode step (mk.tasks._planning)
# ---------------------------------------------------------------------------------------


class RopeKVKind(OpKind):
    """RoPE of a step's new token with its K/V appended to the cache: one task a sequence
    (:func:`mk.tasks.rope.rope_kv_op`), folded into the QKV linear's tiles (or its split-K
    reduce, :func:`qkv_rope_kv_op`) where they hold what it rotates (whole heads with a q/k
    norm), or folded into the decode attention after it (each split rotates its group's
    heads: :func:`mk.tasks.rope.rope_kv_attention_prologue`). A QKV with a bias runs it only
    in the QKV tiles (which add the bias). The step's first RoPE also publishes the sequence
    lengths attention reads."""

    kind = "rope_kv"
    hosts = frozenset({"linear"})

    def fuses_as_epilogue(self, node, host, host_choice) -> bool:
        if host.kind not in self.hosts:
            return False
        widths = [host_choice.block_n] + ([reduce_width(host, host_choice)] if host_choice.split_k > 1 else [])
        try:
            for width in widths:
                check_qkv_rope_tile(width, node.dims["head_dim"], bool(node.dims.get("qk_norm")))
        except ValueError:
            return False
        return True

    def fuses_as_prologue(self, node, later) -> bool:
        """Into the decode attention that reads its q (:func:`mk.tasks.rope.rope_kv_attention_prologue`);
        not after a QKV with a bias, which only the QKV tiles add (:meth:`runs_alone`: the
        search folds forward only an op that could run apart from its QKV)."""
        return later.kind == "attention" and later.name == node.fuse_later

    def runs_alone(self, node, host) -> bool:
        return host is None or "bias" not in host.buffers

    def attention_prologue(self, node, max_seq: int, first: bool, eps: float):
        """``node`` folded into decode attention's splits: the splits' prologue
        (:func:`mk.tasks.rope.rope_kv_attention_prologue`; ``first``: the step's first RoPE,
        which writes the lengths)."""
        d = node.dims
        return rope_kv_attention_prologue(d["batch"], d["heads"], d["kv_heads"], d["head_dim"], max_seq,
                                          write_seqlens=first,
                                          **({"qk_norm": True, "qk_eps": eps} if d.get("qk_norm") else {}))

    def attention_bindings(self, node, ctx) -> dict:
        """The buffers :meth:`attention_prologue`'s operands bind to in a step being lowered."""
        bind = {"qkv": node.inputs[0], "inv_freq": node.buffers["inv_freq"],
                **{r: node.buffers[r] for r in ("q_norm", "k_norm") if r in node.buffers}}
        if ctx.first(node):
            bind["seqlens"] = ctx.activation("seqlens", ctx.batch, dt=torch.int32)
        return bind

    def _spec(self, node, max_seq: int, first: bool, eps: float):
        d = node.dims
        return rope_kv_op(d["batch"], d["heads"], d["kv_heads"], d["head_dim"], max_seq, write_seqlens=first,
                          interleaved=True, **({"qk_norm": True, "qk_eps": eps} if d.get("qk_norm") else {}))

    def specs(self, node, choice, fused=()):
        return [(self._spec(node, 1, False, 1e-5), None)]

    def buffer_shape(self, node, role, max_seq):
        d = node.dims
        if role == "inv_freq":
            return (d["head_dim"] // 2,), torch.float32
        if role in ("k_cache", "v_cache"):
            return (d["batch"], d["kv_heads"], max_seq, d["head_dim"]), "kv"
        if role in ("q_norm", "k_norm"):
            return (d["head_dim"],), "weight"
        return super().buffer_shape(node, role, max_seq)

    def lower(self, node, choice, ctx) -> None:
        d, first = node.dims, ctx.first(node)
        extra = {"seqlens": ctx.activation("seqlens", ctx.batch, dt=torch.int32)} if first else {}
        extra |= {r: node.buffers[r] for r in ("q_norm", "k_norm") if r in node.buffers}
        q = ctx.activation(node.outputs[0], ctx.batch, d["heads"] * d["head_dim"])
        ctx.add(node.name, self._spec(node, ctx.max_seq, first, ctx.eps), qkv=node.inputs[0], pos="pos",
                inv_freq=node.buffers["inv_freq"], q=q, k_cache=node.buffers["k_cache"],
                v_cache=node.buffers["v_cache"], **extra)


ROPE_KV = register_kind(RopeKVKind())
