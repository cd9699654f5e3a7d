"""The tile bodies: one output tile of ``y = x @ W.T`` over a K range (:func:`linear_tile`),
by the GEMV body (``BLOCK_M == 1``: FMAs over [BLOCK_N, BLOCK_K] weight chunks) or the
tl.dot body (decode tiles weight-major, prefill tiles x-major), with the RMSNorm
prologue and the residual / SiLU·mul / argmax epilogue. The accumulation loop
(:func:`_linear_acc`) also serves the split-K partials and the fused QKV + RoPE tiles.
"""

from __future__ import annotations

import triton.language as tl

from .._device import jit
from .._dot import finish_channels, fold_weight_major, scaled_chunk
from ..argmax import argmax_tile_into


@jit
def _load_x(x_rows, cols, k_hi, MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
    """x[rows, cols] in its storage dtype: a [BLOCK_K] vector for the GEMV body (x_rows is then
    a scalar pointer), a [BLOCK_M, BLOCK_K] tile for the dot body."""
    if BLOCK_M == 1:
        # 1-D, so that the broadcast over weight rows takes the weight tile's layout and
        # only this small vector is rearranged, never the weight chunk.
        if MASKED:
            xt = tl.load(x_rows + cols, mask=cols < k_hi, other=0.0)
        else:
            xt = tl.load(x_rows + cols)
    else:
        if MASKED:
            xt = tl.load(x_rows + cols[None, :], mask=(cols < k_hi)[None, :], other=0.0)
        else:
            xt = tl.load(x_rows + cols[None, :])
    return xt


@jit
def _rows_rstd(x_rows, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1/sqrt(mean(x**2) + eps) of the tile's rows over all of K ([BLOCK_M], a scalar if BLOCK_M == 1)."""
    offs_k = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    else:
        sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        xt = _load_x(x_rows, k + offs_k, K, MASKED=True, BLOCK_M=BLOCK_M).to(tl.float32)
        sum_sq += xt * xt
    if BLOCK_M == 1:
        total = tl.sum(sum_sq, axis=0)
    else:
        total = tl.sum(sum_sq, axis=1)
    return 1.0 / tl.sqrt(total / K + eps)


@jit
def _linear_step(acc, x_rows, w_rows, norm_w_ptr, rstd, cols, k_hi,
                 HAS_NORM: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
                 WEIGHT_MAJOR: tl.constexpr = False, w_scale_ptr=None, offs_n=None, k=0, N=0, K=0,
                 W_SCALE: tl.constexpr = 0):
    """Add one BLOCK_K chunk (columns ``cols``) of the product to ``acc`` ([BLOCK_N, 2 BLOCK_M]
    with WEIGHT_MAJOR: :func:`mk.tasks._dot.mma_weight_major`; weight rows ``offs_n``, their
    format's chunk scale applied: :func:`mk.tasks._dot.scaled_chunk`)."""
    # GEMV weights are read once per call: evict them first, keep x and partials in L2.
    # Prefill tiles share weight tiles across GROUP_M row tiles, so they keep the default.
    if MASKED:
        w = tl.load(w_rows + cols[None, :], mask=(cols < k_hi)[None, :], other=0.0,
                    eviction_policy="evict_first" if BLOCK_M == 1 else "")
    else:
        w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first" if BLOCK_M == 1 else "")
    xt = _load_x(x_rows, cols, k_hi, MASKED=MASKED, BLOCK_M=BLOCK_M)
    if HAS_NORM:
        if MASKED:
            nw = tl.load(norm_w_ptr + cols, mask=cols < k_hi, other=0.0).to(tl.float32)
        else:
            nw = tl.load(norm_w_ptr + cols).to(tl.float32)
        if BLOCK_M == 1:
            xt = xt.to(tl.float32) * rstd * nw
        else:
            xt = xt.to(tl.float32) * rstd[:, None] * nw[None, :]
    if BLOCK_M == 1:
        # Element-wise products into the [BLOCK_N, BLOCK_K] accumulator: FMAs only, no
        # cross-thread reduction inside the weight stream.
        xt = xt.to(tl.float32)
    return scaled_chunk(acc, w, xt, w_scale_ptr, offs_n, k, N, K, W_SCALE=W_SCALE, BLOCK_M=BLOCK_M,
                        WEIGHT_MAJOR=WEIGHT_MAJOR)


@jit
def linear_weights_first(w_ptr, pid_n, N, k_lo, k_hi, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMV tile's first [BLOCK_N, BLOCK_K] weight chunk in registers (zeros if the K range
    holds no whole chunk). Weights never depend on other tasks, so a persistent worker loads
    this *before* waiting on its inputs and hands it to :func:`linear_tile` as ``w_first``
    (with DOUBLE_BUFFER): after the wait only x is left to fetch."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1)[:, None] * stride_wn
    k_full = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
    return tl.load(w_rows + offs_k[None, :], mask=(offs_k < k_full)[None, :], other=0.0,
                   eviction_policy="evict_first")


@jit
def _load_x_ahead(x_rows, k_lo, k_hi, n_k, j, n_chunks, BLOCK_K: tl.constexpr):
    """x's chunk for iteration ``j`` of :func:`mk.tasks.linear.linear_run`'s flat loop (zeros past its last),
    by volatile loads: Triton's pipeliner does not hoist them into the loop's prologue.
    (Their layout is converted through shared memory for the weight chunk's columns, two
    barriers a chunk, where a pipelined load lands in shared memory and is read from there.)"""
    cols = k_lo + (j % n_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(x_rows + cols, mask=cols < tl.where(j < n_chunks, k_hi, 0), other=0.0, volatile=True)


@jit
def _linear_acc(
    x_ptr, w_ptr, norm_w_ptr,
    pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn, eps,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOUBLE_BUFFER: tl.constexpr = False, w_first=None, TMA_STAGES: tl.constexpr = 0,
    NORM_SQ: tl.constexpr = False,
    WAIT: tl.constexpr = None, wait_args=None, wait_state=None, WAIT_FLAGS: tl.constexpr = None,
    w_scale_ptr=None, W_SCALE: tl.constexpr = 0,
):
    """float32 [BLOCK_M, BLOCK_N] = h[rows, k_lo:k_hi] @ W[cols, k_lo:k_hi].T for tile (pid_m, pid_n).

    ``W_SCALE`` (with ``w_scale_ptr``): the weight's format (:mod:`mk.tasks.linear.format`):
    1 finishes the product with each row's scale, 2 scales each chunk's products by its
    rows' scales of that 128-column block.

    NORM_SQ (tl.dot tiles through the TMA ring, with HAS_NORM): returns (the product without
    the RMSNorm's rstd, float32 [BLOCK_M] sums of x**2 over [k_lo, k_hi)) for a K split's
    partial, whose reduce scales by the rstd of the whole rows (:func:`mk.tasks.linear.linear_splitk_sum`).

    ``WAIT`` (tl.dot tiles through the TMA ring only): the caller's wait for x, as in
    :func:`mk.tasks.linear.linear_run`, called in the weight loop's first iteration, so the ring's prologue is
    in flight while the task waits; x then comes by volatile loads two chunks ahead. The
    wait's new state is returned last: ``(acc, state)`` or ``(acc, sq, state)``."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past the edge read the last valid row instead of being masked: the loads stay
    # unmasked full-width vectors, and the epilogue's masked store drops those rows.
    if BLOCK_M == 1:
        x_rows = x_ptr + tl.minimum(pid_m, M - 1) * stride_xm
    else:
        x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
    w_rows = w_ptr + tl.minimum(offs_n, N - 1)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    # The TMA body gathers the RMSNorm statistics from the x chunks it streams anyway and
    # scales by rstd after the loop (rstd is one number per row, so it factors out of the
    # sum): a separate pass over x first would cost K/BLOCK_K more round trips to L2.
    # tl.dot tiles through the ring too: a pass over x first (K / BLOCK_K round trips, ~2.4 us
    # for the 1B batch-8 QKV partials) held back the ring's start.
    LATE_RSTD: tl.constexpr = HAS_NORM & (TMA_STAGES > 0)
    if HAS_NORM & (not LATE_RSTD):
        # x is small next to W (M*K vs N*K), so every tile recomputes its rows' rstd over
        # the full K rather than waiting on another task for it.
        rstd = _rows_rstd(x_rows, K, eps, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    elif BLOCK_M == 1:
        rstd = 1.0  # unused, or applied after the loop
    else:
        rstd = tl.full([BLOCK_M], 1.0, tl.float32)  # (the masked tail chunk's scale)
    # Decode tiles of wide boxes multiply weight-major (weight_major()).
    WEIGHT_MAJOR: tl.constexpr = (BLOCK_M > 1) & (BLOCK_M <= 16) & (BLOCK_N >= 128)  # weight_major()
    WAITS: tl.constexpr = WAIT is not None
    tl.static_assert((not WAITS) | ((BLOCK_M > 1) & (TMA_STAGES > 0)), "_linear_acc waits for tl.dot TMA tiles only")
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif WEIGHT_MAJOR:
        acc = tl.zeros([BLOCK_N, 2 * BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Whole chunks unmasked, then at most one masked tail chunk.
    k_full = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
    if (BLOCK_M == 1) & (TMA_STAGES > 0):
        # The TMA unit streams the weight chunks into a TMA_STAGES-deep shared-memory ring
        # (Triton pipelines descriptor loads): many bytes in flight per program without
        # holding them in registers, which is what a persistent worker lacks. Rows past N
        # come back as zeros. Needs 16-byte aligned rows and BLOCK_N, BLOCK_K <= 256.
        # The x (and norm weight) chunks are plain loads that Triton pipelines alongside
        # (cp.async) once it knows they are 16-byte aligned; unpipelined, each chunk would
        # wait one L2 round trip and cap a worker near 30 GB/s.
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in tl.range(k_lo, k_full, BLOCK_K, num_stages=TMA_STAGES):
            w = w_desc.load([pid_n * BLOCK_N, k])
            xt = _load_x(x_rows, k + offs_k, k_hi, MASKED=False, BLOCK_M=BLOCK_M).to(tl.float32)
            if HAS_NORM:
                sum_sq += xt * xt
                xt = xt * tl.load(norm_w_ptr + k + offs_k).to(tl.float32)
            acc = scaled_chunk(acc, w, xt, w_scale_ptr, offs_n, k, N, K, W_SCALE=W_SCALE, BLOCK_M=BLOCK_M,
                               WEIGHT_MAJOR=WEIGHT_MAJOR)
        if HAS_NORM & (k_full < k_hi):
            x_tail = _load_x(x_rows, k_full + offs_k, k_hi, MASKED=True, BLOCK_M=BLOCK_M).to(tl.float32)
            sum_sq += x_tail * x_tail
    elif TMA_STAGES > 0:
        # Skinny tl.dot tiles (a few decode rows): the same TMA ring for the weights, so a
        # worker keeps TMA_STAGES - 1 chunks in flight instead of a pipelined load's one or two.
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
        sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        if WAITS:
            # Triton's pipeliner issues the ring's prologue where the loop starts and leaves
            # the loop's `if` (the wait) in place; a pipelined x load would be issued in the
            # prologue, before the wait, so x comes by volatile loads instead (_load_x_ahead).
            s0, s1, s2, s3 = wait_state
            n_k = (k_full - k_lo) // BLOCK_K
            xa = tl.zeros([BLOCK_M, BLOCK_K], dtype=x_ptr.dtype.element_ty)
            xb = tl.zeros([BLOCK_M, BLOCK_K], dtype=x_ptr.dtype.element_ty)
        for k in tl.range(k_lo, k_full, BLOCK_K, num_stages=TMA_STAGES):
            w = w_desc.load([pid_n * BLOCK_N, k])
            if WAITS:
                j = (k - k_lo) // BLOCK_K
                if j == 0:
                    s0, s1, s2, s3 = WAIT(wait_args, wait_state, WAIT_FLAGS)
                    xa = _load_x_ahead(x_rows, k_lo, k_full, n_k, 0, n_k, BLOCK_K=BLOCK_K)
                    xb = _load_x_ahead(x_rows, k_lo, k_full, n_k, 1, n_k, BLOCK_K=BLOCK_K)
                xt = xa
                xa = xb
                xb = _load_x_ahead(x_rows, k_lo, k_full, n_k, j + 2, n_k, BLOCK_K=BLOCK_K)
            else:
                xt = _load_x(x_rows, k + offs_k, k_hi, MASKED=False, BLOCK_M=BLOCK_M)
            if HAS_NORM:
                xt = xt.to(tl.float32)
                sum_sq += xt * xt
                xt = xt * tl.load(norm_w_ptr + k + offs_k).to(tl.float32)[None, :]
            acc = scaled_chunk(acc, w, xt, w_scale_ptr, offs_n, k, N, K, W_SCALE=W_SCALE, BLOCK_M=BLOCK_M,
                               WEIGHT_MAJOR=WEIGHT_MAJOR)
        if WAITS:
            if k_full == k_lo:  # no whole chunk: the loop never waited
                s0, s1, s2, s3 = WAIT(wait_args, wait_state, WAIT_FLAGS)
        if HAS_NORM & (k_full < k_hi):
            x_tail = _load_x(x_rows, k_full + offs_k, k_hi, MASKED=True, BLOCK_M=BLOCK_M).to(tl.float32)
            sum_sq += x_tail * x_tail
    elif (BLOCK_M == 1) & DOUBLE_BUFFER:
        # Chunk k+1's weights are requested before chunk k's FMAs, so two chunks are in
        # flight per program: a persistent worker (one program per SM slot) needs that
        # to keep its share of DRAM busy, where a grid of many programs gets it for free.
        if w_first is not None:
            w_cur = w_first  # loaded by the caller, before it waited on its inputs
        else:
            w_cur = linear_weights_first(w_ptr, pid_n, N, k_lo, k_hi, stride_wn, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
        for k in range(k_lo, k_full, BLOCK_K):
            cols_next = k + BLOCK_K + offs_k
            w_next = tl.load(w_rows + cols_next[None, :], mask=(cols_next < k_full)[None, :], other=0.0,
                             eviction_policy="evict_first")
            xt = _load_x(x_rows, k + offs_k, k_hi, MASKED=False, BLOCK_M=BLOCK_M).to(tl.float32)
            if HAS_NORM:
                xt = xt * rstd * tl.load(norm_w_ptr + k + offs_k).to(tl.float32)
            acc = scaled_chunk(acc, w_cur, xt, w_scale_ptr, offs_n, k, N, K, W_SCALE=W_SCALE, BLOCK_M=BLOCK_M,
                               WEIGHT_MAJOR=WEIGHT_MAJOR)
            w_cur = w_next
    else:
        for k in range(k_lo, k_full, BLOCK_K):
            acc = _linear_step(acc, x_rows, w_rows, norm_w_ptr, rstd, k + offs_k, k_hi,
                               HAS_NORM=HAS_NORM, MASKED=False, BLOCK_M=BLOCK_M, WEIGHT_MAJOR=WEIGHT_MAJOR,
                               w_scale_ptr=w_scale_ptr, offs_n=offs_n, k=k, N=N, K=K, W_SCALE=W_SCALE)
    if k_full < k_hi:
        acc = _linear_step(acc, x_rows, w_rows, norm_w_ptr, rstd, k_full + offs_k, k_hi,
                           HAS_NORM=HAS_NORM, MASKED=True, BLOCK_M=BLOCK_M, WEIGHT_MAJOR=WEIGHT_MAJOR,
                           w_scale_ptr=w_scale_ptr, offs_n=offs_n, k=k_full, N=N, K=K, W_SCALE=W_SCALE)
    if BLOCK_M == 1:
        # The one cross-thread reduction of the GEMV, after the weight stream.
        acc = tl.sum(acc, axis=1)[None, :]
    elif WEIGHT_MAJOR:
        acc = fold_weight_major(acc)
    # The weight's format finishes the product, before the rstd and any epilogue.
    acc = finish_channels(acc, w_scale_ptr, offs_n, N, W_SCALE=W_SCALE, w_ptr=w_ptr, BLOCK_M=BLOCK_M)
    if NORM_SQ:
        if WAITS:
            return acc, tl.sum(sum_sq, axis=1), (s0, s1, s2, s3)
        else:
            return acc, tl.sum(sum_sq, axis=1)
    else:
        if LATE_RSTD:
            if BLOCK_M == 1:
                whole_sq = tl.sum(sum_sq, axis=0)
            else:
                whole_sq = tl.sum(sum_sq, axis=1)
            if (k_lo == 0) & (k_hi == K):
                rstd = 1.0 / tl.sqrt(whole_sq / K + eps)
            else:  # a K split: its chunks are not the whole row
                rstd = _rows_rstd(x_rows, K, eps, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
            if BLOCK_M == 1:
                acc = acc * rstd
            else:
                acc = acc * rstd[:, None]
        if WAITS:
            return acc, (s0, s1, s2, s3)
        else:
            return acc


@jit
def _out_tile(pid_m, pid_n, M, N, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows, output columns, mask) of tile (pid_m, pid_n) of y (N = weight rows; with
    SILU_MUL a pair of weight rows makes one column)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if SILU_MUL:
        offs_o = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_out = N // 2
    else:
        offs_o = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_out = N
    return offs_m, offs_o, (offs_m < M)[:, None] & (offs_o < n_out)[None, :]


@jit
def _load_residual(res_ptr, pid_m, pid_n, M, N, stride_rm,
                   SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile (pid_m, pid_n)'s residual, float32 (what :func:`_linear_epilogue` adds)."""
    offs_m, offs_o, mask = _out_tile(pid_m, pid_n, M, N, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_o[None, :], mask=mask, other=0.0).to(tl.float32)


@jit
def _linear_epilogue(
    acc, res_ptr, out_ptr, pid_m, pid_n, M, N, stride_rm, stride_om,
    HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    res=None, bias_ptr=None,
):
    """Store tile (pid_m, pid_n) of y from its float32 accumulator (N = weight rows); returns
    the tile as stored (out's dtype). ``res``: the tile's residual, when the caller loaded it
    already (:func:`_load_residual`). ``bias_ptr``: ``[N]``, one value a weight row, added to
    the product first: the bias belongs to the projection, so it comes before the residual
    add and inside SiLU·mul (interleaved with the gate / up rows)."""
    offs_m, offs_o, mask = _out_tile(pid_m, pid_n, M, N, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    if bias_ptr is not None:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        # Interleaved rows (2i = gate_i, 2i+1 = up_i): adjacent accumulator columns pair up,
        # so the split stays inside the tile whatever BLOCK_N (even) is.
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        y = gate / (1.0 + tl.exp(-gate)) * up
    else:
        y = acc
    if HAS_RESIDUAL:
        if res is None:
            res = _load_residual(res_ptr, pid_m, pid_n, M, N, stride_rm, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M,
                                 BLOCK_N=BLOCK_N)
        y += res
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_o[None, :], y, mask=mask)
    return y


@jit
def linear_tile(
    x_ptr, w_ptr, norm_w_ptr, res_ptr, out_ptr,
    pid_m, pid_n, M, N, K, k_lo, k_hi,
    stride_xm, stride_wn, stride_rm, stride_om, eps,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOUBLE_BUFFER: tl.constexpr = False,
    w_first=None, TMA_STAGES: tl.constexpr = 0,
    WAIT: tl.constexpr = None, wait_args=None, wait_state=None, WAIT_FLAGS: tl.constexpr = None,
    argmax_best=None, bias_ptr=None, w_scale_ptr=None, W_SCALE: tl.constexpr = 0,
):
    """One output tile of y over the K range [k_lo, k_hi), epilogue included.

    Tile (pid_m, pid_n) covers rows pid_m*BLOCK_M.. of x and weight rows pid_n*BLOCK_N..;
    it writes out[rows, pid_n*BLOCK_N ..] (or ``.. pid_n*BLOCK_N/2`` with SILU_MUL) and nothing
    else. For the full product pass k_lo=0, k_hi=K. ``K`` is the full row length, used by
    the RMSNorm prologue (HAS_NORM) for its statistics. BLOCK_M == 1 selects the GEMV
    body (one x row, FMAs); BLOCK_M >= 8 the tl.dot body. SILU_MUL needs an even BLOCK_N
    and the interleaved weight of :func:`mk.tasks.linear.interleave_gate_up`; y has N/2 columns then.
    DOUBLE_BUFFER (GEMV body) requests each weight chunk one iteration ahead; ``w_first`` is
    the first chunk from :func:`linear_weights_first`, when already loaded. TMA_STAGES > 0 (GEMV
    body) streams weights through a shared-memory ring filled by TMA (needs an allocator for
    on-device descriptors: :func:`mk.tasks.enable_device_descriptors`). ``WAIT``: the caller's
    dependency wait, made inside the weight stream (tl.dot TMA tiles: :func:`_linear_acc`);
    the wait's new state is returned. ``argmax_best``: an LM head's tile also folds each
    row's max over its columns into best[row] (:func:`mk.tasks.argmax.argmax_tile_into`).
    ``bias_ptr``: ``[N]`` added to the product (a whole-K tile only: a K split's reduce adds it).
    ``w_scale_ptr``, ``W_SCALE``: the weight's format's scales (:func:`_linear_acc`).
    """
    WAITS: tl.constexpr = WAIT is not None
    res = None
    if WAITS:  # the residual is an input: read after the wait, in the epilogue
        acc, state = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn,
                                 eps, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                 TMA_STAGES=TMA_STAGES, WAIT=WAIT, wait_args=wait_args, wait_state=wait_state,
                                 WAIT_FLAGS=WAIT_FLAGS, w_scale_ptr=w_scale_ptr, W_SCALE=W_SCALE)
    else:
        # The residual's round trip overlaps the weight stream instead of following it.
        if HAS_RESIDUAL:
            res = _load_residual(res_ptr, pid_m, pid_n, M, N, stride_rm, SILU_MUL=SILU_MUL,
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        acc = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn, eps,
                          HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                          DOUBLE_BUFFER=DOUBLE_BUFFER, w_first=w_first,
                          TMA_STAGES=TMA_STAGES, w_scale_ptr=w_scale_ptr, W_SCALE=W_SCALE)
    y = _linear_epilogue(acc, res_ptr, out_ptr, pid_m, pid_n, M, N, stride_rm, stride_om,
                         HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, res=res,
                         bias_ptr=bias_ptr)
    if argmax_best is not None:
        argmax_tile_into(y.to(tl.float32), pid_m, pid_n, M, N, argmax_best)
    if WAITS:
        return state
    else:
        return 0
