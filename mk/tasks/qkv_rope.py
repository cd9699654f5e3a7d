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
from .linear import (_check_config, _linear_acc, _tile_rows, LinearConfig, linear_config,
                     linear_partial_kernel, linear_ref, linear_splitk_sum)
from .rope import _check_inv_freq, check_qk_norm, rope_kv_ref


@jit
def qkv_rope_kv_tile(
    x_ptr, w_ptr, norm_w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr,
    pid_m, pid_n, M, K, max_seq, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr, WRITE_SEQLENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOUBLE_BUFFER: tl.constexpr = False, w_first=None, TMA_STAGES: tl.constexpr = 0,
    WAIT: tl.constexpr = None, wait_args=None, wait_state=None, WAIT_FLAGS: tl.constexpr = None,
    bias_ptr=None, q_norm_w_ptr=None, k_norm_w_ptr=None, qk_eps=0.0,
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
                                 WAIT_FLAGS=WAIT_FLAGS)
    else:
        acc = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, 0, K, K, K, eps,
                          HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                          DOUBLE_BUFFER=DOUBLE_BUFFER, w_first=w_first, TMA_STAGES=TMA_STAGES)
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
    inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr, M, max_seq, pre), ``pre`` the
    tile's :func:`qkv_rope_operands` loaded ahead (a run of one tile) or None, optionally
    followed by (bias_ptr, q_norm_w_ptr, k_norm_w_ptr, qk_eps), each pointer None when off
    (Qwen2's bias, Qwen3's q / k norm: :func:`qkv_rope_kv_epilogue`); FLAGS: (HQ, HKV,
    HEAD_DIM, WRITE_SEQLENS)."""
    bias_ptr = None
    q_norm_w_ptr = None
    k_norm_w_ptr = None
    qk_eps = 0.0
    if len(args) > 9:  # the families' options (a Llama's spec passes the first nine only)
        bias_ptr = args[9]
        q_norm_w_ptr = args[10]
        k_norm_w_ptr = args[11]
        qk_eps = args[12]
    qkv_rope_kv_epilogue(acc, args[0], args[1], args[2], args[3], args[4], args[5], pid_m, pid_n, args[6], args[7],
                         HQ=FLAGS[0], HKV=FLAGS[1], HEAD_DIM=FLAGS[2], WRITE_SEQLENS=FLAGS[3], BLOCK_M=acc.shape[0],
                         BLOCK_N=acc.shape[1], pre=args[8], bias_ptr=bias_ptr, q_norm_w_ptr=q_norm_w_ptr,
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
    check_qk_norm(q_norm_weight, k_norm_weight, d, qk_norm_eps, x)
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
    config = _check_config(config, K, silu_mul=False)
    check_qkv_rope_tile(config.block_n, d, qk_norm)
    q = torch.empty((B, num_q_heads * d), dtype=torch.float32, device=x.device)
    if B == 0:
        return q
    bm, bn = _tile_rows(config, B), config.block_n
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
