"""A run of adjacent tiles along N streamed as one task (:func:`linear_run`), each finished
tile handed to an epilogue (:func:`linear_store_epilogue`, :func:`linear_argmax_epilogue`,
:func:`linear_partial_epilogue`): the GEMV stream through a TMA ring, optionally waiting
for its input inside the stream, grouped X_GROUP chunks an iteration."""

from __future__ import annotations

import triton.language as tl

from .._device import jit
from .._dot import finish_channels, fold_weight_major, scaled_chunk
from ..argmax import argmax_tile_into
from .tile import _linear_epilogue, _load_x, _load_x_ahead, _rows_rstd


@jit
def linear_run(
    x_ptr, w_ptr, norm_w_ptr,
    pid_m, pid_n, n_tiles, M, N, K, k_lo, k_hi, stride_xm, stride_wn, eps,
    EPILOGUE: tl.constexpr, epilogue_args, EPILOGUE_FLAGS: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TMA_STAGES: tl.constexpr = 0, WAIT: tl.constexpr = None, wait_args=None, wait_state=None,
    WAIT_FLAGS: tl.constexpr = None, X_GROUP: tl.constexpr = 1, X_STAGES: tl.constexpr = 2,
    w_scale_ptr=None, W_SCALE: tl.constexpr = 0,
):
    """Tiles (pid_m, pid_n), (pid_m, pid_n + 1), ... (``n_tiles`` of them) over the K range
    [k_lo, k_hi) as one weight stream, ``EPILOGUE(acc, pid_m, tile, epilogue_args,
    EPILOGUE_FLAGS)`` after each tile's last chunk (acc: its float32 [BLOCK_M, BLOCK_N]
    product, RMSNorm applied). The flags are a tuple of constexprs, or None (values inside
    ``epilogue_args`` are not constexpr to the compiler).

    Why: a task of one tile pays for its stream's ramp (the first chunk's DRAM latency, the
    ring's refill) and its setup (descriptor, barriers) once per tile. A run of adjacent
    tiles is one flat loop over (tile, chunk): the ring keeps the next tile's chunks in
    flight while this tile's epilogue runs, so those costs are paid once per run. The
    tiles' weight rows are adjacent, so they stream like one tall tile, while the
    accumulator stays one tile's size.

    With TMA_STAGES > 0 the weights come through a TMA ring of that depth (16-byte aligned
    rows, boxes of at most 256 a side), else plain loads. BLOCK_M == 1: the GEMV body
    (FMAs into a [BLOCK_N, BLOCK_K] accumulator, reduced at the tile's end); else tl.dot
    tiles through :func:`mk.tasks._dot.mma`. The RMSNorm statistics come from the chunks the
    first tile streams when the range is the whole row; a K split takes them in a pass over
    x first. Columns past k_hi meet x = 0, so a split reads its own range only in effect.

    ``WAIT`` (a jit function; GEMV tiles through the TMA ring only) is the caller's wait for
    x: ``WAIT(wait_args, wait_state, WAIT_FLAGS)`` returns the new state (a 4-tuple opaque
    here), which linear_run returns. It is called in the loop's first iteration, so the
    ring's prologue (the descriptor and the first TMA_STAGES - 1 weight chunks) is already
    in flight while the caller waits: weights never depend on other tasks, and Triton's
    pipeliner issues a loop's prologue where the loop starts. x is then read after the
    wait only, by volatile loads a few chunks ahead (which the pipeliner leaves in place:
    a pipelined x load would be issued in the prologue, before the wait).

    ``X_GROUP`` > 1 (with WAIT; the K range must hold a multiple of X_GROUP chunks): the
    loop streams X_GROUP chunks an iteration through a ring of X_STAGES - 1 groups
    (:func:`_gemv_grouped_run`; TMA_STAGES is then unused), so x's look-ahead
    is a whole group where the chunk-a-iteration loop's is one chunk (the compiler converts
    a carried x chunk to the weight chunk's layout at the start of the next iteration).

    ``W_SCALE`` (with ``w_scale_ptr``): the weight's format (:mod:`mk.tasks.linear.format`),
    applied to each chunk's products (2) or to each finished tile before its epilogue (1).
    """
    offs_k = tl.arange(0, BLOCK_K)
    # Decode tiles of wide boxes multiply weight-major: weight_major().
    WEIGHT_MAJOR: tl.constexpr = (BLOCK_M > 1) & (BLOCK_M <= 16) & (BLOCK_N >= 128)  # weight_major()
    if BLOCK_M == 1:
        x_rows = x_ptr + tl.minimum(pid_m, M - 1) * stride_xm
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        rstd_pre = tl.full([], 1.0, tl.float32)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
        if WEIGHT_MAJOR:  # [N, 2 rows]: the hi and lo halves of each row's product
            acc = tl.zeros([BLOCK_N, 2 * BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        rstd_pre = tl.full([BLOCK_M], 1.0, tl.float32)
    whole_row = (k_lo == 0) & (k_hi == K)
    WAITS_IN_LOOP: tl.constexpr = WAIT is not None
    if WAITS_IN_LOOP:
        tl.static_assert((BLOCK_M == 1) & (TMA_STAGES > 0), "linear_run waits in its loop for TMA GEMV tiles only")
        if X_GROUP > 1:
            return _gemv_grouped_run(x_rows, w_ptr, norm_w_ptr, pid_m, pid_n, n_tiles, N, K, k_lo, k_hi, stride_wn,
                                     eps, EPILOGUE, epilogue_args, EPILOGUE_FLAGS, HAS_NORM, BLOCK_N, BLOCK_K,
                                     X_STAGES, WAIT, wait_args, wait_state, WAIT_FLAGS, X_GROUP,
                                     w_scale_ptr=w_scale_ptr, W_SCALE=W_SCALE)
        s0, s1, s2, s3 = wait_state
    elif HAS_NORM:
        if not whole_row:
            rstd_pre = _rows_rstd(x_rows, K, eps, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    if TMA_STAGES > 0:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    n_k = tl.cdiv(k_hi - k_lo, BLOCK_K)
    n_chunks = n_tiles * n_k
    if WAITS_IN_LOOP:
        # x chunks i+1..i+3 in registers (the chunk after them is requested each iteration):
        # enough ahead to cover an L2 round trip at a chunk's streaming time.
        x1 = tl.zeros([BLOCK_K], dtype=x_ptr.dtype.element_ty)
        x2 = tl.zeros([BLOCK_K], dtype=x_ptr.dtype.element_ty)
        x3 = tl.zeros([BLOCK_K], dtype=x_ptr.dtype.element_ty)
    for i in tl.range(0, n_chunks, num_stages=TMA_STAGES if TMA_STAGES > 0 else 1):
        t = i // n_k
        k = k_lo + (i - t * n_k) * BLOCK_K
        cols = k + offs_k
        n0 = (pid_n + t) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if TMA_STAGES > 0:
            w = w_desc.load([n0, k])
        else:
            w_rows = w_ptr + tl.minimum(n0 + tl.arange(0, BLOCK_N), N - 1)[:, None] * stride_wn
            w = tl.load(w_rows + cols[None, :], mask=(cols < k_hi)[None, :], other=0.0)
        if WAITS_IN_LOOP:
            if i == 0:
                s0, s1, s2, s3 = WAIT(wait_args, wait_state, WAIT_FLAGS)
                if HAS_NORM:
                    if not whole_row:
                        rstd_pre = _rows_rstd(x_rows, K, eps, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
                x1 = _load_x_ahead(x_rows, k_lo, k_hi, n_k, 0, n_chunks, BLOCK_K=BLOCK_K)
                x2 = _load_x_ahead(x_rows, k_lo, k_hi, n_k, 1, n_chunks, BLOCK_K=BLOCK_K)
                x3 = _load_x_ahead(x_rows, k_lo, k_hi, n_k, 2, n_chunks, BLOCK_K=BLOCK_K)
            xt = x1
            x1 = x2
            x2 = x3
            x3 = _load_x_ahead(x_rows, k_lo, k_hi, n_k, i + 3, n_chunks, BLOCK_K=BLOCK_K)
        else:
            xt = _load_x(x_rows, cols, k_hi, MASKED=True, BLOCK_M=BLOCK_M)
        if BLOCK_M == 1:
            acc, sum_sq = _gemv_chunk(acc, sum_sq, w, xt, norm_w_ptr, cols, k_hi, t == 0, HAS_NORM,
                                      w_scale_ptr, offs_n, k, N, K, W_SCALE)
        else:
            if HAS_NORM:
                xt = xt.to(tl.float32)
                sum_sq += tl.where(t == 0, xt * xt, 0.0)
                xt = xt * tl.load(norm_w_ptr + cols, mask=cols < k_hi, other=0.0).to(tl.float32)[None, :]
            acc = scaled_chunk(acc, w, xt, w_scale_ptr, offs_n, k, N, K, W_SCALE=W_SCALE, BLOCK_M=BLOCK_M,
                               WEIGHT_MAJOR=WEIGHT_MAJOR)
        if k + BLOCK_K >= k_hi:  # the tile's last chunk
            if BLOCK_M == 1:
                y = _gemv_tile_end(acc, sum_sq, whole_row, rstd_pre, K, eps, HAS_NORM)
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            else:
                # rstd is one number a row, so it factors out of the row's sum.
                y = fold_weight_major(acc) if WEIGHT_MAJOR else acc
                if HAS_NORM:
                    y = y * tl.where(whole_row, 1.0 / tl.sqrt(tl.sum(sum_sq, axis=1) / K + eps), rstd_pre)[:, None]
                acc = tl.zeros(acc.shape, dtype=tl.float32)
            EPILOGUE(finish_channels(y, w_scale_ptr, offs_n, N, W_SCALE=W_SCALE, w_ptr=w_ptr, BLOCK_M=BLOCK_M), pid_m,
                     pid_n + t, epilogue_args, EPILOGUE_FLAGS)
    if WAITS_IN_LOOP:
        return s0, s1, s2, s3
    else:
        return 0


@jit
def _gemv_chunk(acc, sum_sq, w, xt, norm_w_ptr, cols, k_hi, first_tile, HAS_NORM: tl.constexpr,
                w_scale_ptr=None, offs_n=None, k=0, N=0, K=0, W_SCALE: tl.constexpr = 0):
    """One weight chunk of a GEMV run into its [BLOCK_N, BLOCK_K] accumulator (x RMSNorm-scaled
    by the norm weights; squares summed while the run streams its first tile; the chunk's
    products scaled by the weight's format, :func:`mk.tasks._dot.scaled_chunk`)."""
    xt = xt.to(tl.float32)
    if HAS_NORM:
        sum_sq += tl.where(first_tile, xt * xt, 0.0)
        xt = xt * tl.load(norm_w_ptr + cols, mask=cols < k_hi, other=0.0).to(tl.float32)
    return scaled_chunk(acc, w, xt, w_scale_ptr, offs_n, k, N, K, W_SCALE=W_SCALE, BLOCK_M=1,
                        WEIGHT_MAJOR=False), sum_sq


@jit
def _gemv_tile_end(acc, sum_sq, whole_row, rstd_pre, K, eps, HAS_NORM: tl.constexpr):
    """A GEMV tile's [1, BLOCK_N] result from its accumulator: the row sums, scaled by the
    RMSNorm's rstd (one number a row, so it factors out of the sum): from the squares summed
    over the whole row, or ``rstd_pre`` for a K split."""
    y = tl.sum(acc, axis=1)[None, :]
    if HAS_NORM:
        y = y * tl.where(whole_row, 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / K + eps), rstd_pre)
    return y


@jit
def _gemv_grouped_run(x_rows, w_ptr, norm_w_ptr, pid_m, pid_n, n_tiles, N, K, k_lo, k_hi, stride_wn, eps,
                      EPILOGUE: tl.constexpr, epilogue_args, EPILOGUE_FLAGS: tl.constexpr, HAS_NORM: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_STAGES: tl.constexpr,
                      WAIT: tl.constexpr, wait_args, wait_state, WAIT_FLAGS: tl.constexpr,
                      X_GROUP: tl.constexpr, w_scale_ptr=None, W_SCALE: tl.constexpr = 0):
    """:func:`linear_run` of GEMV tiles that wait for x in their stream, X_GROUP (2 or 4)
    weight chunks an iteration. Each iteration asks for the next group's x chunks (volatile
    loads) before it multiplies its own, so an x chunk has a group's streaming time to
    arrive; the ring (X_STAGES - 1 groups in flight) is issued before the wait."""
    tl.static_assert((X_GROUP == 2) | (X_GROUP == 4), "X_GROUP is 2 or 4")
    s0, s1, s2, s3 = wait_state
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    rstd_pre = tl.full([], 1.0, tl.float32)
    whole_row = (k_lo == 0) & (k_hi == K)
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    n_k = tl.cdiv(k_hi - k_lo, BLOCK_K)
    n_chunks = n_tiles * n_k
    offs_k = tl.arange(0, BLOCK_K)
    xa = tl.zeros([BLOCK_K], dtype=x_rows.dtype.element_ty)
    xb = tl.zeros([BLOCK_K], dtype=x_rows.dtype.element_ty)
    xc = tl.zeros([BLOCK_K], dtype=x_rows.dtype.element_ty)
    xd = tl.zeros([BLOCK_K], dtype=x_rows.dtype.element_ty)
    for g in tl.range(0, n_chunks // X_GROUP, num_stages=X_STAGES):
        i0 = g * X_GROUP
        t = i0 // n_k  # a group never straddles two tiles: n_k is a multiple of X_GROUP
        k0 = k_lo + (i0 - t * n_k) * BLOCK_K
        n0 = (pid_n + t) * BLOCK_N
        wa = w_desc.load([n0, k0])
        wb = w_desc.load([n0, k0 + BLOCK_K])
        if X_GROUP == 4:
            wc = w_desc.load([n0, k0 + 2 * BLOCK_K])
            wd = w_desc.load([n0, k0 + 3 * BLOCK_K])
        if g == 0:
            s0, s1, s2, s3 = WAIT(wait_args, wait_state, WAIT_FLAGS)
            if HAS_NORM:
                if not whole_row:
                    rstd_pre = _rows_rstd(x_rows, K, eps, BLOCK_M=1, BLOCK_K=BLOCK_K)
            xa = _load_x_ahead(x_rows, k_lo, k_hi, n_k, 0, n_chunks, BLOCK_K=BLOCK_K)
            xb = _load_x_ahead(x_rows, k_lo, k_hi, n_k, 1, n_chunks, BLOCK_K=BLOCK_K)
            if X_GROUP == 4:
                xc = _load_x_ahead(x_rows, k_lo, k_hi, n_k, 2, n_chunks, BLOCK_K=BLOCK_K)
                xd = _load_x_ahead(x_rows, k_lo, k_hi, n_k, 3, n_chunks, BLOCK_K=BLOCK_K)
        na = _load_x_ahead(x_rows, k_lo, k_hi, n_k, i0 + X_GROUP, n_chunks, BLOCK_K=BLOCK_K)
        nb = _load_x_ahead(x_rows, k_lo, k_hi, n_k, i0 + X_GROUP + 1, n_chunks, BLOCK_K=BLOCK_K)
        if X_GROUP == 4:
            nc = _load_x_ahead(x_rows, k_lo, k_hi, n_k, i0 + 6, n_chunks, BLOCK_K=BLOCK_K)
            nd = _load_x_ahead(x_rows, k_lo, k_hi, n_k, i0 + 7, n_chunks, BLOCK_K=BLOCK_K)
        first = t == 0
        offs_n = n0 + tl.arange(0, BLOCK_N)
        acc, sum_sq = _gemv_chunk(acc, sum_sq, wa, xa, norm_w_ptr, k0 + offs_k, k_hi, first, HAS_NORM,
                                  w_scale_ptr, offs_n, k0, N, K, W_SCALE)
        acc, sum_sq = _gemv_chunk(acc, sum_sq, wb, xb, norm_w_ptr, k0 + BLOCK_K + offs_k, k_hi, first, HAS_NORM,
                                  w_scale_ptr, offs_n, k0 + BLOCK_K, N, K, W_SCALE)
        if X_GROUP == 4:
            acc, sum_sq = _gemv_chunk(acc, sum_sq, wc, xc, norm_w_ptr, k0 + 2 * BLOCK_K + offs_k, k_hi, first,
                                      HAS_NORM, w_scale_ptr, offs_n, k0 + 2 * BLOCK_K, N, K, W_SCALE)
            acc, sum_sq = _gemv_chunk(acc, sum_sq, wd, xd, norm_w_ptr, k0 + 3 * BLOCK_K + offs_k, k_hi, first,
                                      HAS_NORM, w_scale_ptr, offs_n, k0 + 3 * BLOCK_K, N, K, W_SCALE)
            xc = nc
            xd = nd
        xa = na
        xb = nb
        if k0 + X_GROUP * BLOCK_K >= k_hi:  # the tile's last group
            y = _gemv_tile_end(acc, sum_sq, whole_row, rstd_pre, K, eps, HAS_NORM)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            EPILOGUE(finish_channels(y, w_scale_ptr, offs_n, N, W_SCALE=W_SCALE, w_ptr=w_ptr, BLOCK_M=1), pid_m,
                     pid_n + t, epilogue_args, EPILOGUE_FLAGS)
    return s0, s1, s2, s3


@jit
def linear_store_epilogue(acc, pid_m, pid_n, args, FLAGS: tl.constexpr):
    """:func:`linear_run`'s epilogue for a linear: bias, residual add or SiLU·mul, then the
    store. ``args``: (res_ptr, out_ptr, M, N, stride_rm, stride_om), optionally followed by
    bias_ptr (``[N]``, or None); FLAGS: (HAS_RESIDUAL, SILU_MUL)."""
    bias_ptr = None
    if len(args) > 6:  # with a bias (Qwen2's QKV); a plain spec passes the first six only
        bias_ptr = args[6]
    _linear_epilogue(acc, args[0], args[1], pid_m, pid_n, args[2], args[3], args[4], args[5],
                     HAS_RESIDUAL=FLAGS[0], SILU_MUL=FLAGS[1], BLOCK_M=acc.shape[0], BLOCK_N=acc.shape[1],
                     bias_ptr=bias_ptr)


@jit
def linear_argmax_epilogue(acc, pid_m, pid_n, args, FLAGS: tl.constexpr):
    """:func:`linear_run`'s epilogue for an LM head: the store, then each row's max over the
    tile's columns into best[row] (:func:`mk.tasks.argmax.argmax_tile_into`, from the values
    as stored). ``args``: (out_ptr, M, N, stride_om, best_ptr); FLAGS: None."""
    out_ptr, M, N, stride_om, best_ptr = args
    y = _linear_epilogue(acc, out_ptr, out_ptr, pid_m, pid_n, M, N, stride_om, stride_om, HAS_RESIDUAL=False,
                         SILU_MUL=False, BLOCK_M=acc.shape[0], BLOCK_N=acc.shape[1])
    argmax_tile_into(y.to(tl.float32), pid_m, pid_n, M, N, best_ptr)


@jit
def linear_partial_epilogue(acc, pid_m, pid_n, args, FLAGS: tl.constexpr):
    """:func:`linear_run`'s epilogue for a split-K partial: the float32 tile into its split's
    workspace. ``args``: (ws_ptr, split, M, N, stride_ws_split, stride_ws_m); FLAGS: None."""
    ws_ptr, split, M, N, stride_ws_split, stride_ws_m = args
    offs_m = pid_m * acc.shape[0] + tl.arange(0, acc.shape[0])
    offs_n = pid_n * acc.shape[1] + tl.arange(0, acc.shape[1])
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(ws_ptr + split * stride_ws_split + offs_m[:, None] * stride_ws_m + offs_n[None, :], acc, mask=mask)
