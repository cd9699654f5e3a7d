"""Split-K: a partial tile over one K split into a float32 workspace
(:func:`linear_partial_tile`, its range from :func:`linear_split_range`), and the reduce
that sums the splits in split order, then runs the epilogue (:func:`linear_splitk_reduce_tile`)."""

from __future__ import annotations

import triton.language as tl

from .._device import jit
from .run import linear_partial_epilogue
from .tile import _linear_acc, _linear_epilogue, _load_residual


@jit
def linear_split_range(split, split_k, K, BLOCK_K: tl.constexpr):
    """K range [k_lo, k_hi) of split ``split`` of ``split_k``: whole BLOCK_K chunks, balanced to
    within one chunk, the ragged end in the last split (same as :func:`mk.tasks.linear.linear_k_splits`)."""
    n_chunks = tl.cdiv(K, BLOCK_K)
    k_lo = (split * n_chunks // split_k) * BLOCK_K
    k_hi = tl.minimum(((split + 1) * n_chunks // split_k) * BLOCK_K, K)
    return k_lo, k_hi


@jit
def linear_partial_tile(
    x_ptr, w_ptr, norm_w_ptr, ws_ptr,
    pid_m, pid_n, split, M, N, K, k_lo, k_hi,
    stride_xm, stride_wn, stride_ws_split, stride_ws_m, eps,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOUBLE_BUFFER: tl.constexpr = False, TMA_STAGES: tl.constexpr = 0, NORM_SQ: tl.constexpr = False,
    WAIT: tl.constexpr = None, wait_args=None, wait_state=None, WAIT_FLAGS: tl.constexpr = None,
    w_scale_ptr=None, W_SCALE: tl.constexpr = 0,
):
    """Split-K partial: float32 h[rows, k_lo:k_hi] @ W[cols, k_lo:k_hi].T into ws[split, rows, cols].

    The workspace is float32 ``[split_k, M, N]`` with strides (stride_ws_split, stride_ws_m, 1).
    No epilogue here: :func:`linear_splitk_reduce_tile` applies it after summing the splits.
    DOUBLE_BUFFER and TMA_STAGES stream the weights as in :func:`mk.tasks.linear.linear_tile`.

    NORM_SQ (tl.dot tiles through the ring, with HAS_NORM): the partial leaves the RMSNorm's
    rstd out (it needs the whole rows, which a split does not read) and stores its rows' sum of
    x**2 over [k_lo, k_hi) at ws[split, row, N + pid_n]: the workspace then holds
    ``N + cdiv(N, BLOCK_N)`` columns, and the reduce scales by the rstd (:func:`linear_splitk_sum`).
    ``WAIT``: as :func:`mk.tasks.linear.linear_tile` (the wait's new state is returned).
    ``w_scale_ptr``, ``W_SCALE``: the weight's format, which finishes the partial as it does
    a whole tile (so the reduce sums finished products).
    """
    WAITS: tl.constexpr = WAIT is not None
    state = 0
    if NORM_SQ:
        if WAITS:
            acc, sq, state = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm,
                                         stride_wn, eps, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                         BLOCK_K=BLOCK_K, TMA_STAGES=TMA_STAGES, NORM_SQ=True, WAIT=WAIT,
                                         wait_args=wait_args, wait_state=wait_state, WAIT_FLAGS=WAIT_FLAGS,
                                         w_scale_ptr=w_scale_ptr, W_SCALE=W_SCALE)
        else:
            acc, sq = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn,
                                  eps, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                  TMA_STAGES=TMA_STAGES, NORM_SQ=True, w_scale_ptr=w_scale_ptr, W_SCALE=W_SCALE)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(ws_ptr + split * stride_ws_split + offs_m * stride_ws_m + N + pid_n, sq, mask=offs_m < M)
    elif WAITS:
        acc, state = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn,
                                 eps, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                 TMA_STAGES=TMA_STAGES, WAIT=WAIT, wait_args=wait_args, wait_state=wait_state,
                                 WAIT_FLAGS=WAIT_FLAGS, w_scale_ptr=w_scale_ptr, W_SCALE=W_SCALE)
    else:
        acc = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn, eps,
                          HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                          DOUBLE_BUFFER=DOUBLE_BUFFER, TMA_STAGES=TMA_STAGES, w_scale_ptr=w_scale_ptr,
                          W_SCALE=W_SCALE)
    linear_partial_epilogue(acc, pid_m, pid_n, (ws_ptr, split, M, N, stride_ws_split, stride_ws_m), None)
    return state


@jit
def linear_splitk_sum(ws_ptr, pid_m, pid_n, M, N, split_k: tl.constexpr, stride_ws_split, stride_ws_m,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K=0, eps=0.0, NORM_SQ: tl.constexpr = False,
                      PART_BLOCK_N: tl.constexpr = 0):
    """float32 [BLOCK_M, BLOCK_N]: the split_k partials of tile (pid_m, pid_n) summed in split
    order (bitwise repeatable), read with ``.cg`` (past L1: other SMs wrote them). NORM_SQ:
    the partials left out the RMSNorm's rstd (:func:`linear_partial_tile`) and stored their
    rows' sums of x**2 at ws[split, row, N + t], t the partial tile holding this tile's
    columns (tiles of PART_BLOCK_N columns; 0: this tile's width); the sum is scaled by the
    whole rows' rstd.

    One unrolled pass issues every load (partials and sums of squares) before the first add:
    a reduce runs on the layer's critical path, and the compiled loop otherwise waited for the
    squares' round trip before it asked for the partials."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    ptrs = ws_ptr + offs_m[:, None] * stride_ws_m + offs_n[None, :]
    if PART_BLOCK_N:
        sq_ptrs = ws_ptr + offs_m * stride_ws_m + N + (pid_n * BLOCK_N) // PART_BLOCK_N
    else:
        sq_ptrs = ws_ptr + offs_m * stride_ws_m + N + pid_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(split_k):
        acc += tl.load(ptrs + s * stride_ws_split, mask=mask, other=0.0, cache_modifier=".cg")
        if NORM_SQ:
            sq += tl.load(sq_ptrs + s * stride_ws_split, mask=mask_m, other=0.0, cache_modifier=".cg")
    if NORM_SQ:
        acc = acc * (1.0 / tl.sqrt(sq / K + eps))[:, None]
    return acc


@jit
def linear_splitk_reduce_tile(
    ws_ptr, res_ptr, out_ptr,
    pid_m, pid_n, M, N, split_k: tl.constexpr,
    stride_ws_split, stride_ws_m, stride_rm, stride_om,
    HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K=0, eps=0.0, NORM_SQ: tl.constexpr = False, PART_BLOCK_N: tl.constexpr = 0, bias_ptr=None,
):
    """Sum the split_k partials of tile (pid_m, pid_n) in split order, then the epilogue.

    The fixed order makes the result bitwise repeatable run to run. Partials are read with
    ``.cg`` (bypassing L1): in a persistent kernel they were written by other SMs. NORM_SQ:
    the partials left out the RMSNorm's rstd (:func:`linear_partial_tile`); scale by it here.
    PART_BLOCK_N: the partials' tile width where this tile is narrower (one of several
    reduce tiles of a partial tile: :func:`linear_splitk_sum`). ``bias_ptr``: ``[N]`` added to
    the sum (the partials leave it out).
    """
    res = None
    if HAS_RESIDUAL:
        # Asked for before the partials: compiled after them, its round trip came after the
        # sum's (sm_90 SASS of a lone reduce). Alone this measured within the noise (1B
        # batch 8, H200); it costs nothing.
        res = _load_residual(res_ptr, pid_m, pid_n, M, N, stride_rm, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M,
                             BLOCK_N=BLOCK_N)
    acc = linear_splitk_sum(ws_ptr, pid_m, pid_n, M, N, split_k, stride_ws_split, stride_ws_m,
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, K=K, eps=eps, NORM_SQ=NORM_SQ,
                            PART_BLOCK_N=PART_BLOCK_N)
    _linear_epilogue(acc, res_ptr, out_ptr, pid_m, pid_n, M, N, stride_rm, stride_om,
                     HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, res=res,
                     bias_ptr=bias_ptr)
