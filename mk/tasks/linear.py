"""Linear layer ``y = x @ W.T`` with the fusions a Llama block needs.

    h   = rmsnorm(x) = x / sqrt(mean(x**2) + eps) * norm_weight   (with norm_weight, else h = x)
    acc = h @ W.T                                                  (W is [N, K], Hugging Face layout)
    acc = acc + bias                                               (with a bias, [N]: Qwen2's QKV)
    y   = acc + residual                                           (with a residual)
    y   = silu(acc[:, 0::2]) * acc[:, 1::2]                        (with silu_mul; see interleave_gate_up)

Accumulation is in float32 whatever the storage dtype; y is rounded once, at the store.
The RMSNorm statistics are float32 too. A float32 x (normalised or not) meets 16-bit
weights in the tl.dot body as two 16-bit halves (:mod:`mk.tasks._dot`), so it is not
rounded to the weight dtype; the GEMV body multiplies in float32.

One tile body serves every shape; ``BLOCK_M`` (a constexpr) picks how it multiplies:

* ``BLOCK_M == 1`` — the GEMV body, for batch-1 decode (memory-bound). A program owns
  BLOCK_N weight rows and streams them in [BLOCK_N, BLOCK_K] chunks, contiguous along K
  so the loads are full-width vectors. It keeps a float32 [BLOCK_N, BLOCK_K]
  accumulator of element-wise products (plain FMAs, no cross-thread traffic in the
  loop) and reduces it across K once, after the loop.
* ``BLOCK_M >= 8`` — the ``tl.dot`` body, for M = 2..16 (decode batches; BLOCK_M = 8
  or 16) and prefill (BLOCK_M = 64/128). For skinny M each weight tile is loaded once
  and used by all M rows in one tensor-core MMA; rows beyond M are padding the MMA pays
  for in (idle) compute, not in memory traffic. A static loop over rows would re-run
  the FMA stream M times and turn compute-bound near M = 16; the MMA's cost is flat in M.
  Decode tiles (at most 16 rows) multiply weight-major, ``W_tile @ [hi; lo].T``
  (:func:`mk.tasks._dot.mma_weight_major`): the weight chunk is the MMA's tall side, so
  on Hopper it goes to wgmma from the TMA ring's shared memory as it landed.

Split-K (``split_k > 1``): K is cut into contiguous ranges of whole BLOCK_K chunks
(:func:`linear_k_splits`); each (tile, split) program writes float32 partials into a
workspace ``[split_k, M, N]``, and a reduce step sums them in split order 0, 1, 2, …
(bitwise repeatable) and applies the epilogue. The reduce uses the same (BLOCK_M,
BLOCK_N) tiling, so each reduce tile depends on exactly ``split_k`` partial tiles.

Device functions for a persistent kernel: :func:`linear_tile`, :func:`linear_partial_tile`,
:func:`linear_splitk_reduce_tile` (plus :func:`linear_split_range`), and :func:`linear_run`,
which streams a run of adjacent tiles as one and hands each finished tile to an epilogue
(:func:`linear_store_epilogue`, :func:`linear_partial_epilogue`). They never read
``tl.program_id`` and write only their own tiles. Offsets are int32: weights must hold
fewer than 2**31 elements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from ._cost import TaskCost
from ._device import (jit, supported_dtypes, capability, check_positive_int, check_same_device, check_same_dtype,
                      check_tensor, enable_device_descriptors, sm_count, smem_per_block, use_pdl)
from ._dot import fold_weight_major, mma, mma_weight_major
from .argmax import argmax_tile_into

#: Largest M served by the skinny (decode) configs; above it, prefill tiles.
SKINNY_MAX_M = 16

#: Tile rows grouped together in the prefill launch order, for L2 reuse of weight tiles.
GROUP_M = 8

#: tl.dot needs every tile dim to be at least this.
DOT_MIN = 16

#: Fewest rows of a weight-major tile (:func:`weight_major`): each row's hi and lo halves
#: are two of the MMA's N columns, so 8 rows make tl.dot's 16.
WEIGHT_MAJOR_MIN_ROWS = DOT_MIN // 2

#: Fewest weight rows (block_n) of a weight-major decode tile.
WEIGHT_MAJOR_MIN_N = 128


def weight_major(rows: int, block_n: int) -> bool:
    """Whether a tl.dot tile of ``rows`` x rows and ``block_n`` weight rows multiplies
    weight-major, ``W_tile @ [hi; lo].T`` (:func:`mk.tasks._dot.mma_weight_major`): decode
    tiles (at most SKINNY_MAX_M rows) of at least :data:`WEIGHT_MAJOR_MIN_N` weight rows.
    (The device functions test the same with literals: a jit function reads no globals.)

    Measured on an H200 (a batch-8 65536 x 2048 linear with
    RMSNorm streamed by 264 workers of 4 warps, fraction of the copy bandwidth, x-major ->
    weight-major): 128 x 128 boxes 0.77 -> 0.78, 128 x 64 0.77 -> 0.83, 256 x 64 0.84 ->
    0.87, but 64 x 128 0.57 -> 0.49 (a 64-row wgmma waits on every chunk's MMA). With
    2 warps a worker 64 x 128 gains too (0.62 -> 0.78), but the megakernel runs 4.
    """
    return 1 < rows <= SKINNY_MAX_M and block_n >= WEIGHT_MAJOR_MIN_N


def dot_waits_in_stream(rows: int, block_n: int, tma_stages: int, tiles_per_task: int = 1) -> bool:
    """Whether a decode tl.dot tile of ``rows`` x rows and ``block_n`` weight rows, one a task
    through a TMA ring, waits for x inside its weight loop (:func:`_linear_acc`'s WAIT), as
    GEMV tasks do: the ring's prologue is then in flight while the worker waits. Weight-major
    tiles only (:func:`weight_major`), whose x chunks are a few registers. An x-major tile's
    [16, block_k] float32 chunks held ahead spilled the 1B batch-8 kernel (26 -> 60 spills,
    step 1.155 -> 1.340 ms on an H200). The megakernel's lowering and the planner's cost
    model both ask this."""
    return tma_stages > 0 and tiles_per_task == 1 and weight_major(rows, block_n)

#: Widest global load of one thread (bytes): ld.global.v4.b32.
VEC_BYTES = 16

#: Longest stream (weight chunks a task) that waits for x inside it. The wait in the stream
#: puts the ring's prologue in flight before the inputs are ready, but x then comes by
#: volatile loads converted through shared memory every chunk (:func:`linear_run`'s WAIT).
#: Measured on an H200: 8- to 32-chunk tasks gained 0.7-1.5 us
#: each (1B step 0.947 -> 0.893 ms); the 8B down projection's 56-chunk tasks lost 4.5 us and
#: the 1B LM head's 128-chunk runs ~1.7 us. (A grouped stream, :func:`gemv_stream`, has no limit.)
WAIT_IN_STREAM_MAX_CHUNKS = 32

#: Chunks an iteration of a grouped GEMV stream (:func:`linear_run`'s X_GROUP) and the
#: largest chunk (bytes) grouped. A task that waits for x inside its stream reads x by
#: volatile loads, which the compiler converts to the weight chunk's layout by the next
#: iteration: one chunk a loop iteration leaves an x chunk one chunk's streaming time to
#: arrive, X_GROUP chunks an iteration a group's. Measured on an H100: 8 chunks in flight
#: as two groups of 4, the 1B down projection's tasks 12.3 -> 10.2 us, the 8B down 40 -> 36 us and gate_up 77 -> 73 us.
X_GROUP = 4
X_GROUP_MAX_CHUNK_BYTES = 8192


@dataclass(frozen=True)
class GemvStream:
    """How a TMA GEMV task streams its weights: ``waits`` for x inside the stream (the
    ring's prologue in flight while it waits), ``group`` chunks a loop iteration, ``stages``
    the loop's pipeline stages (``stages - 1`` iterations in flight)."""

    waits: bool
    group: int
    stages: int

    @property
    def chunks_in_flight(self) -> int:
        return max((self.stages - 1) * self.group, 1)


def gemv_stream(block_m: int, tma_stages: int, K: int, block_k: int, block_n: int, dtype_bytes: int = 2,
                split_k: int = 1, tiles_per_task: int = 1) -> GemvStream:
    """How a persistent task of this tile streams (:class:`GemvStream`), for GEMV tiles
    (``block_m`` 1) through a TMA ring of ``tma_stages`` (chunks counted over its run of
    tiles and its K split's range, cut as :func:`linear_k_splits` cuts it):

    * grouped: a ring of ``1 + n * X_GROUP`` (n >= 1) whose chunks are at most
      X_GROUP_MAX_CHUNK_BYTES and whose every K split holds a multiple of X_GROUP chunks
      waits in its stream however long, X_GROUP chunks an iteration, n groups in flight;
    * else a stream of at most :data:`WAIT_IN_STREAM_MAX_CHUNKS` chunks waits in it, one
      chunk an iteration, ``tma_stages - 1`` in flight; a longer one waits before it.
    """
    if block_m != 1 or tma_stages <= 0:
        return GemvStream(False, 1, tma_stages)
    n_chunks = -(-K // block_k)
    split_chunks = [(s + 1) * n_chunks // split_k - s * n_chunks // split_k for s in range(split_k)]
    if (X_GROUP > 1 and tma_stages > X_GROUP and (tma_stages - 1) % X_GROUP == 0
            and block_n * block_k * dtype_bytes <= X_GROUP_MAX_CHUNK_BYTES
            and all(c % X_GROUP == 0 for c in split_chunks)):
        return GemvStream(True, X_GROUP, (tma_stages - 1) // X_GROUP + 1)
    chunks = tiles_per_task * -(-n_chunks // split_k)
    return GemvStream(chunks <= WAIT_IN_STREAM_MAX_CHUNKS, 1, tma_stages)


# ---------------------------------------------------------------------------------------
# Device functions
# ---------------------------------------------------------------------------------------


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
                 WEIGHT_MAJOR: tl.constexpr = False):
    """Add one BLOCK_K chunk (columns ``cols``) of the product to ``acc`` ([BLOCK_N, 2 BLOCK_M]
    with WEIGHT_MAJOR: :func:`mk.tasks._dot.mma_weight_major`)."""
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
        acc += w.to(tl.float32) * xt.to(tl.float32)[None, :]
    elif WEIGHT_MAJOR:
        acc = mma_weight_major(w, xt, acc)
    else:
        acc = mma(xt, tl.trans(w), acc)
    return acc


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
def _linear_acc(
    x_ptr, w_ptr, norm_w_ptr,
    pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn, eps,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOUBLE_BUFFER: tl.constexpr = False, w_first=None, TMA_STAGES: tl.constexpr = 0,
    NORM_SQ: tl.constexpr = False,
    WAIT: tl.constexpr = None, wait_args=None, wait_state=None, WAIT_FLAGS: tl.constexpr = None,
):
    """float32 [BLOCK_M, BLOCK_N] = h[rows, k_lo:k_hi] @ W[cols, k_lo:k_hi].T for tile (pid_m, pid_n).

    NORM_SQ (tl.dot tiles through the TMA ring, with HAS_NORM): returns (the product without
    the RMSNorm's rstd, float32 [BLOCK_M] sums of x**2 over [k_lo, k_hi)) for a K split's
    partial, whose reduce scales by the rstd of the whole rows (:func:`linear_splitk_sum`).

    ``WAIT`` (tl.dot tiles through the TMA ring only): the caller's wait for x, as in
    :func:`linear_run`, called in the weight loop's first iteration, so the ring's prologue is
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
            acc += w.to(tl.float32) * xt[None, :]
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
            if WEIGHT_MAJOR:
                acc = mma_weight_major(w, xt, acc)
            else:
                acc = mma(xt, tl.trans(w), acc)
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
            acc += w_cur.to(tl.float32) * xt[None, :]
            w_cur = w_next
    else:
        for k in range(k_lo, k_full, BLOCK_K):
            acc = _linear_step(acc, x_rows, w_rows, norm_w_ptr, rstd, k + offs_k, k_hi,
                               HAS_NORM=HAS_NORM, MASKED=False, BLOCK_M=BLOCK_M, WEIGHT_MAJOR=WEIGHT_MAJOR)
    if k_full < k_hi:
        acc = _linear_step(acc, x_rows, w_rows, norm_w_ptr, rstd, k_full + offs_k, k_hi,
                           HAS_NORM=HAS_NORM, MASKED=True, BLOCK_M=BLOCK_M, WEIGHT_MAJOR=WEIGHT_MAJOR)
    if BLOCK_M == 1:
        # The one cross-thread reduction of the GEMV, after the weight stream.
        acc = tl.sum(acc, axis=1)[None, :]
    elif WEIGHT_MAJOR:
        acc = fold_weight_major(acc)
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
    argmax_best=None, bias_ptr=None,
):
    """One output tile of y over the K range [k_lo, k_hi), epilogue included.

    Tile (pid_m, pid_n) covers rows pid_m*BLOCK_M.. of x and weight rows pid_n*BLOCK_N..;
    it writes out[rows, pid_n*BLOCK_N ..] (or ``.. pid_n*BLOCK_N/2`` with SILU_MUL) and nothing
    else. For the full product pass k_lo=0, k_hi=K. ``K`` is the full row length, used by
    the RMSNorm prologue (HAS_NORM) for its statistics. BLOCK_M == 1 selects the GEMV
    body (one x row, FMAs); BLOCK_M >= 8 the tl.dot body. SILU_MUL needs an even BLOCK_N
    and the interleaved weight of :func:`interleave_gate_up`; y has N/2 columns then.
    DOUBLE_BUFFER (GEMV body) requests each weight chunk one iteration ahead; ``w_first`` is
    the first chunk from :func:`linear_weights_first`, when already loaded. TMA_STAGES > 0 (GEMV
    body) streams weights through a shared-memory ring filled by TMA (needs an allocator for
    on-device descriptors: :func:`mk.tasks.enable_device_descriptors`). ``WAIT``: the caller's
    dependency wait, made inside the weight stream (tl.dot TMA tiles: :func:`_linear_acc`);
    the wait's new state is returned. ``argmax_best``: an LM head's tile also folds each
    row's max over its columns into best[row] (:func:`mk.tasks.argmax.argmax_tile_into`).
    ``bias_ptr``: ``[N]`` added to the product (a whole-K tile only: a K split's reduce adds it).
    """
    WAITS: tl.constexpr = WAIT is not None
    res = None
    if WAITS:  # the residual is an input: read after the wait, in the epilogue
        acc, state = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn,
                                 eps, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                 TMA_STAGES=TMA_STAGES, WAIT=WAIT, wait_args=wait_args, wait_state=wait_state,
                                 WAIT_FLAGS=WAIT_FLAGS)
    else:
        # The residual's round trip overlaps the weight stream instead of following it.
        if HAS_RESIDUAL:
            res = _load_residual(res_ptr, pid_m, pid_n, M, N, stride_rm, SILU_MUL=SILU_MUL,
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        acc = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn, eps,
                          HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                          DOUBLE_BUFFER=DOUBLE_BUFFER, w_first=w_first,
                          TMA_STAGES=TMA_STAGES)
    y = _linear_epilogue(acc, res_ptr, out_ptr, pid_m, pid_n, M, N, stride_rm, stride_om,
                         HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, res=res,
                         bias_ptr=bias_ptr)
    if argmax_best is not None:
        argmax_tile_into(y.to(tl.float32), pid_m, pid_n, M, N, argmax_best)
    if WAITS:
        return state
    else:
        return 0


@jit
def linear_run(
    x_ptr, w_ptr, norm_w_ptr,
    pid_m, pid_n, n_tiles, M, N, K, k_lo, k_hi, stride_xm, stride_wn, eps,
    EPILOGUE: tl.constexpr, epilogue_args, EPILOGUE_FLAGS: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TMA_STAGES: tl.constexpr = 0, WAIT: tl.constexpr = None, wait_args=None, wait_state=None,
    WAIT_FLAGS: tl.constexpr = None, X_GROUP: tl.constexpr = 1, X_STAGES: tl.constexpr = 2,
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
                                     X_STAGES, WAIT, wait_args, wait_state, WAIT_FLAGS, X_GROUP)
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
            acc, sum_sq = _gemv_chunk(acc, sum_sq, w, xt, norm_w_ptr, cols, k_hi, t == 0, HAS_NORM)
        else:
            if HAS_NORM:
                xt = xt.to(tl.float32)
                sum_sq += tl.where(t == 0, xt * xt, 0.0)
                xt = xt * tl.load(norm_w_ptr + cols, mask=cols < k_hi, other=0.0).to(tl.float32)[None, :]
            if WEIGHT_MAJOR:
                acc = mma_weight_major(w, xt, acc)
            else:
                acc = mma(xt, tl.trans(w), acc)
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
            EPILOGUE(y, pid_m, pid_n + t, epilogue_args, EPILOGUE_FLAGS)
    if WAITS_IN_LOOP:
        return s0, s1, s2, s3
    else:
        return 0


@jit
def _gemv_chunk(acc, sum_sq, w, xt, norm_w_ptr, cols, k_hi, first_tile, HAS_NORM: tl.constexpr):
    """One weight chunk of a GEMV run into its [BLOCK_N, BLOCK_K] accumulator (x RMSNorm-scaled
    by the norm weights; squares summed while the run streams its first tile)."""
    xt = xt.to(tl.float32)
    if HAS_NORM:
        sum_sq += tl.where(first_tile, xt * xt, 0.0)
        xt = xt * tl.load(norm_w_ptr + cols, mask=cols < k_hi, other=0.0).to(tl.float32)
    return acc + w.to(tl.float32) * xt[None, :], sum_sq


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
                      X_GROUP: tl.constexpr):
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
        acc, sum_sq = _gemv_chunk(acc, sum_sq, wa, xa, norm_w_ptr, k0 + offs_k, k_hi, first, HAS_NORM)
        acc, sum_sq = _gemv_chunk(acc, sum_sq, wb, xb, norm_w_ptr, k0 + BLOCK_K + offs_k, k_hi, first, HAS_NORM)
        if X_GROUP == 4:
            acc, sum_sq = _gemv_chunk(acc, sum_sq, wc, xc, norm_w_ptr, k0 + 2 * BLOCK_K + offs_k, k_hi, first,
                                      HAS_NORM)
            acc, sum_sq = _gemv_chunk(acc, sum_sq, wd, xd, norm_w_ptr, k0 + 3 * BLOCK_K + offs_k, k_hi, first,
                                      HAS_NORM)
            xc = nc
            xd = nd
        xa = na
        xb = nb
        if k0 + X_GROUP * BLOCK_K >= k_hi:  # the tile's last group
            y = _gemv_tile_end(acc, sum_sq, whole_row, rstd_pre, K, eps, HAS_NORM)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            EPILOGUE(y, pid_m, pid_n + t, epilogue_args, EPILOGUE_FLAGS)
    return s0, s1, s2, s3


@jit
def _load_x_ahead(x_rows, k_lo, k_hi, n_k, j, n_chunks, BLOCK_K: tl.constexpr):
    """x's chunk for iteration ``j`` of :func:`linear_run`'s flat loop (zeros past its last),
    by volatile loads: Triton's pipeliner does not hoist them into the loop's prologue.
    (Their layout is converted through shared memory for the weight chunk's columns, two
    barriers a chunk, where a pipelined load lands in shared memory and is read from there.)"""
    cols = k_lo + (j % n_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(x_rows + cols, mask=cols < tl.where(j < n_chunks, k_hi, 0), other=0.0, volatile=True)


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


@jit
def linear_split_range(split, split_k, K, BLOCK_K: tl.constexpr):
    """K range [k_lo, k_hi) of split ``split`` of ``split_k``: whole BLOCK_K chunks, balanced to
    within one chunk, the ragged end in the last split (same as :func:`linear_k_splits`)."""
    n_chunks = tl.cdiv(K, BLOCK_K)
    k_lo = (split * n_chunks // split_k) * BLOCK_K
    k_hi = tl.minimum(((split + 1) * n_chunks // split_k) * BLOCK_K, K)
    return k_lo, k_hi


@jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs``; returns at once (nothing lands in registers)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@jit
def _bulk_prefetch_rows(base, stride_bytes, rows, nbytes):
    """Thread t < rows asks L2 for ``nbytes`` from ``base + t * stride_bytes`` with one TMA bulk
    prefetch (cp.async.bulk.prefetch.L2, sm_90+): one instruction per row, no duplicates.
    Addresses and sizes must be multiples of 16 bytes."""
    tl.inline_asm_elementwise(
        "{\n .reg .pred p;\n .reg .u32 t;\n .reg .u64 off, a;\n mov.u32 t, %tid.x;\n"
        " setp.lt.u32 p, t, $3;\n setp.ne.and.u32 p, $4, 0, p;\n mul.wide.u32 off, t, $2;\n add.u64 a, $1, off;\n"
        " @p cp.async.bulk.prefetch.L2.global [a], $4;\n mov.u32 $0, 0;\n}",
        "=r,l,r,r,r", [base, stride_bytes, rows, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@jit
def linear_prefetch_tile(w_ptr, pid_n, N, k_lo, k_hi, stride_wn,
                         PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BULK: tl.constexpr = False):
    """Start pulling the first PREFETCH_LINES cache lines (LINE elements each) from k_lo of each of
    the tile's weight rows into L2, without waiting for them.

    Weights never depend on the previous task, so a tile issues this *before* its dependency
    wait (``gdc_wait`` in a standalone launch, the event wait in the megakernel): DRAM starts
    streaming while the producer drains, and the tile's own loads then hit L2. Compiled GPU
    code only (inline PTX); launchers pass PREFETCH_LINES = 0 under the interpreter.
    BULK: one TMA bulk prefetch per row (needs 16-byte aligned rows and k_lo), else one
    ``prefetch.global.L2`` per line.
    """
    if (PREFETCH_LINES > 0) & BULK:
        ELEM_BYTES: tl.constexpr = 128 // LINE
        row0 = pid_n * BLOCK_N
        span = tl.minimum(PREFETCH_LINES * LINE, k_hi - k_lo)
        _bulk_prefetch_rows(w_ptr + row0 * stride_wn + k_lo, stride_wn * ELEM_BYTES, tl.minimum(N - row0, BLOCK_N),
                            (span * ELEM_BYTES) // 16 * 16)
    elif PREFETCH_LINES > 0:
        idx = tl.arange(0, BLOCK_N * PREFETCH_LINES)
        rows = tl.minimum(pid_n * BLOCK_N + idx // PREFETCH_LINES, N - 1)
        cols = tl.minimum(k_lo + (idx % PREFETCH_LINES) * LINE, k_hi - 1)
        _prefetch_l2(w_ptr + rows * stride_wn + cols)


@jit
def _pdl_enter(PDL: tl.constexpr):
    """Under programmatic dependent launch: let the next kernel launch now, then wait for the
    previous one to finish (its writes visible) before this program reads activations."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@jit
def linear_partial_tile(
    x_ptr, w_ptr, norm_w_ptr, ws_ptr,
    pid_m, pid_n, split, M, N, K, k_lo, k_hi,
    stride_xm, stride_wn, stride_ws_split, stride_ws_m, eps,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOUBLE_BUFFER: tl.constexpr = False, TMA_STAGES: tl.constexpr = 0, NORM_SQ: tl.constexpr = False,
    WAIT: tl.constexpr = None, wait_args=None, wait_state=None, WAIT_FLAGS: tl.constexpr = None,
):
    """Split-K partial: float32 h[rows, k_lo:k_hi] @ W[cols, k_lo:k_hi].T into ws[split, rows, cols].

    The workspace is float32 ``[split_k, M, N]`` with strides (stride_ws_split, stride_ws_m, 1).
    No epilogue here: :func:`linear_splitk_reduce_tile` applies it after summing the splits.
    DOUBLE_BUFFER and TMA_STAGES stream the weights as in :func:`linear_tile`.

    NORM_SQ (tl.dot tiles through the ring, with HAS_NORM): the partial leaves the RMSNorm's
    rstd out (it needs the whole rows, which a split does not read) and stores its rows' sum of
    x**2 over [k_lo, k_hi) at ws[split, row, N + pid_n]: the workspace then holds
    ``N + cdiv(N, BLOCK_N)`` columns, and the reduce scales by the rstd (:func:`linear_splitk_sum`).
    ``WAIT``: as :func:`linear_tile` (the wait's new state is returned).
    """
    WAITS: tl.constexpr = WAIT is not None
    state = 0
    if NORM_SQ:
        if WAITS:
            acc, sq, state = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm,
                                         stride_wn, eps, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                         BLOCK_K=BLOCK_K, TMA_STAGES=TMA_STAGES, NORM_SQ=True, WAIT=WAIT,
                                         wait_args=wait_args, wait_state=wait_state, WAIT_FLAGS=WAIT_FLAGS)
        else:
            acc, sq = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn,
                                  eps, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                  TMA_STAGES=TMA_STAGES, NORM_SQ=True)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(ws_ptr + split * stride_ws_split + offs_m * stride_ws_m + N + pid_n, sq, mask=offs_m < M)
    elif WAITS:
        acc, state = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn,
                                 eps, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                 TMA_STAGES=TMA_STAGES, WAIT=WAIT, wait_args=wait_args, wait_state=wait_state,
                                 WAIT_FLAGS=WAIT_FLAGS)
    else:
        acc = _linear_acc(x_ptr, w_ptr, norm_w_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn, eps,
                          HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                          DOUBLE_BUFFER=DOUBLE_BUFFER, TMA_STAGES=TMA_STAGES)
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


@jit
def _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (pid_m, pid_n), GROUP_M row tiles at a time so their weight tiles share L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    return pid_m, pid_n


@jit
def linear_tma_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    NUM_SMS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Prefill GEMM ``out = x @ w.T`` with 16-bit operands: a persistent grid of NUM_SMS
    programs walks the output tiles (grouped so that GROUP_M row tiles share their weight
    tiles in L2); x and w tiles arrive by TMA into a NUM_STAGES-deep ring, and each tile
    leaves through TMA. SILU_MUL: the tile's interleaved gate/up columns become
    ``silu(gate) * up`` in registers, so the [M, N] product is never stored."""
    OUT_N: tl.constexpr = BLOCK_N // 2 if SILU_MUL else BLOCK_N
    n_out = N // 2 if SILU_MUL else N
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, n_out], strides=[stride_om, 1],
                                       block_shape=[BLOCK_M, OUT_N])
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, k_tiles, num_stages=NUM_STAGES):
            x = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(x, w.T, acc)
        if SILU_MUL:
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, OUT_N, 2)))
            y = gate / (1.0 + tl.exp(-gate)) * up
        else:
            y = acc
        o_desc.store([pid_m * BLOCK_M, pid_n * OUT_N], y.to(out_ptr.dtype.element_ty))


@jit
def linear_kernel(
    x_ptr, w_ptr, norm_w_ptr, res_ptr, out_ptr, bias_ptr,
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr, PREFETCH_BULK: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    linear_prefetch_tile(w_ptr, pid_n, N, 0, K, stride_wn, PREFETCH_LINES=PREFETCH_LINES, LINE=LINE, BLOCK_N=BLOCK_N,
                         BULK=PREFETCH_BULK)
    _pdl_enter(PDL)
    linear_tile(x_ptr, w_ptr, norm_w_ptr, res_ptr, out_ptr, pid_m, pid_n, M, N, K, 0, K,
                stride_xm, stride_wn, stride_rm, stride_om, eps,
                HAS_NORM=HAS_NORM, HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, bias_ptr=bias_ptr)


@jit
def linear_partial_kernel(
    x_ptr, w_ptr, norm_w_ptr, ws_ptr,
    M, N, K, split_k, stride_xm, stride_wn, stride_ws_split, stride_ws_m, eps,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_BULK: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    k_lo, k_hi = linear_split_range(split, split_k, K, BLOCK_K=BLOCK_K)
    linear_prefetch_tile(w_ptr, pid_n, N, k_lo, k_hi, stride_wn, PREFETCH_LINES=PREFETCH_LINES, LINE=LINE,
                         BLOCK_N=BLOCK_N, BULK=PREFETCH_BULK)
    _pdl_enter(PDL)
    linear_partial_tile(x_ptr, w_ptr, norm_w_ptr, ws_ptr, pid_m, pid_n, split, M, N, K, k_lo, k_hi,
                        stride_xm, stride_wn, stride_ws_split, stride_ws_m, eps,
                        HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


@jit
def linear_splitk_reduce_kernel(
    ws_ptr, res_ptr, out_ptr, bias_ptr,
    M, N, split_k: tl.constexpr, stride_ws_split, stride_ws_m, stride_rm, stride_om,
    HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    _pdl_enter(PDL)
    linear_splitk_reduce_tile(ws_ptr, res_ptr, out_ptr, pid // num_pid_n, pid % num_pid_n, M, N, split_k,
                              stride_ws_split, stride_ws_m, stride_rm, stride_om,
                              HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                              bias_ptr=bias_ptr)


# ---------------------------------------------------------------------------------------
# Planner hooks: pure functions
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearConfig:
    """Tile sizes and launch settings of one linear.

    block_m: rows of x per tile; 1 selects the GEMV (FMA) body, a power of two >= 16 the
        tl.dot body.
    block_n: weight rows (output columns before silu_mul) per tile; a power of two.
    block_k: K chunk streamed per loop iteration; a power of two.
    split_k: K splits (1 = none); each split covers whole block_k chunks.
    num_warps, num_stages: passed to Triton (stages = software-pipelined loads in flight).
    group_m: row tiles launched together for L2 reuse (matters only when M spans tiles).
    prefetch_k: weight columns (from the start of the tile's K range) that each tile asks
        L2 for before its dependency wait, rounded up to whole 128-byte lines and a power
        of two of them; 0 for none. Pays off with PDL (see :func:`~mk.tasks._device.use_pdl`)
        and in the megakernel, where the wait is long enough to hide DRAM latency.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = GROUP_M
    prefetch_k: int = 0

    def __str__(self) -> str:
        return (f"LinearConfig(BM={self.block_m} BN={self.block_n} BK={self.block_k} split_k={self.split_k} "
                f"warps={self.num_warps} stages={self.num_stages} group_m={self.group_m} "
                f"prefetch_k={self.prefetch_k})")

    def to_dict(self) -> dict:
        return asdict(self)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _prev_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _is_pow2(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and (n & (n - 1)) == 0


def linear_config(M: int, N: int, K: int, dtype: torch.dtype, *, split_k: int = 1,
                  smem_limit: int | None = None) -> LinearConfig:
    """Heuristic config for an [M, K] x [N, K]^T product in ``dtype`` with ``split_k`` splits.

    * M == 1, the GEMV body: 2 weight rows x 2048 bf16 columns per iteration, 2 warps
      (tuned on an H200). Each thread loads four 16 B vectors of each row (128 B in
      flight) into 64 float32 accumulators. Keeping BLOCK_K a multiple of
      vector x 32 x num_warps puts all warps along K, so x's chunk already has the layout
      the broadcast needs; other shapes make the compiler shuffle x through shared memory
      every iteration. num_stages does nothing here (these loads are not pipelined
      through shared memory), hence 1. Each tile prefetches its rows' first 512 columns
      into L2 before waiting on the previous kernel (PDL).
    * M <= 16: tl.dot body with BLOCK_M = 16, so one weight tile serves the whole batch;
      64 x 512 B tiles, 4 stages (160 KiB of shared memory with bf16; with ``smem_limit``,
      the bytes a block may use, fewer stages or narrower tiles where that is less).
    * M > 16: prefill tiles, 64 or 128 x 128 x 128 B of K.

    Block sizes are capped by the problem (no 1024-wide chunk for K = 200) and block_k so
    that K holds at least ``split_k`` chunks. Starting points, to be tuned on the GPU.
    """
    db = _dtype_bytes(dtype)
    vec = max(VEC_BYTES // db, 1)
    if M <= 1:
        # Fastest on an H200 in a sweep (bf16, CUDA-graph replays, PDL on):
        # 2 rows x 2048 columns x 2 warps, prefetching each row's first 512 columns into L2
        # before the dependency wait: 0.90 / 1.04 / 1.03 of copy bandwidth at 4096->6144,
        # 4096->28672 and 14336->4096 (0.82 / 1.01 / 0.96 without PDL). Many small tiles
        # keep every SM streaming until the very end of the product.
        bm, bn, bk, warps, stages, prefetch_k = 1, 2, vec * 32 * 2 * 4, 2, 1, 512
    elif M <= SKINNY_MAX_M:
        # Fastest on an H200 in a sweep (M=8, bf16): 64 weight rows x
        # 512 B of K, 2 warps, 4 stages: 0.73 / 0.91 / 0.81 of copy at 4096->6144,
        # 4096->28672, 14336->4096, level with torch (0.75 / 0.89 / 0.84); the earlier
        # 16-row tiles reached 0.55-0.65. Stages drop where shared memory is smaller.
        bm, bn, bk, warps, stages, prefetch_k = 16, 64, 512 // db, 2, 4, 0
    else:
        bm = 64 if M <= 64 else 128
        bn, bk, warps, stages, prefetch_k = 128, 128 // db, (4 if bm == 64 else 8), 3, 0
    floor = 1 if bm == 1 else DOT_MIN
    # Even block_n >= 2 keeps silu_mul's gate/up pairs inside a tile.
    bn = max(min(bn, triton.next_power_of_2(N)), 2 if bm == 1 else DOT_MIN)
    bk = min(bk, triton.next_power_of_2(K))
    if split_k > 1:
        bk = min(bk, _prev_pow2(K // split_k))  # at least split_k chunks in K
    bk = max(bk, floor)
    if bm == 1:
        warps = max(1, min(warps, bk // (vec * 32)))  # keep the warps along K for short K
    config = LinearConfig(bm, bn, bk, split_k, warps, stages, prefetch_k=prefetch_k)
    if smem_limit is not None and bm > 1:
        # Fewer stages, then narrower tiles, until the operand ring fits (99 KiB on Ada parts).
        while linear_smem_bytes(config, M, db) > smem_limit and (config.num_stages > 2 or config.block_n > DOT_MIN):
            if config.num_stages > 2:
                config = LinearConfig(**{**config.to_dict(), "num_stages": config.num_stages - 1})
            else:
                config = LinearConfig(**{**config.to_dict(), "block_n": config.block_n // 2})
    return config


def linear_k_splits(K: int, block_k: int, split_k: int) -> list[tuple[int, int]]:
    """The K range [k_lo, k_hi) of each split, as the kernels cut them (linear_split_range).

    Contiguous, in order, each a whole number of block_k chunks except the last one's
    ragged end; chunk counts differ by at most one. Empty ranges appear only when split_k
    exceeds the chunk count (the launcher refuses that).
    """
    n_chunks = -(-K // block_k)
    return [((s * n_chunks // split_k) * block_k, min(((s + 1) * n_chunks // split_k) * block_k, K))
            for s in range(split_k)]


def prefetch_lines(config: LinearConfig, K: int, dtype_bytes: int) -> tuple[int, int]:
    """(lines per weight row, elements per line) that a tile of ``config`` prefetches: the
    first ``prefetch_k`` columns of its K range (at most the range), in 128-byte lines,
    rounded up to a power of two of lines. (0, line) when it prefetches nothing."""
    line = max(128 // dtype_bytes, 1)
    span = min(config.prefetch_k, -(-K // config.split_k))
    if span <= 0:
        return 0, line
    return triton.next_power_of_2(-(-span // line)), line


def _tile_rows(config: LinearConfig, M: int) -> int:
    """Rows per tile as launched: block_m, cut down to what M needs, but never below tl.dot's
    16, or :data:`WEIGHT_MAJOR_MIN_ROWS` for a weight-major tile (its rows, twice over, are
    its MMA's N)."""
    if config.block_m == 1:
        return 1
    rows = min(config.block_m, triton.next_power_of_2(max(M, 1)))
    return max(WEIGHT_MAJOR_MIN_ROWS if weight_major(max(rows, DOT_MIN), config.block_n) else DOT_MIN, rows)


def linear_smem_bytes(config: LinearConfig, M: int, dtype_bytes: int = 2) -> int:
    """Shared memory one tile needs, from the 3-D tile (rows x block_n x block_k).

    tl.dot body: the software-pipelined operand ring, num_stages x (x chunk [rows, block_k]
    + weight chunk [block_n, block_k]) x dtype_bytes, where rows is block_m capped by M as
    the launcher does; decode tiles (weight-major, at most 16 rows) also stage x's hi and
    lo halves ([2 rows, block_k]) as the wgmma's shared-memory operand. Exact for Hopper's
    prefill tiles (block_m >= 64) on Triton 3.9; the RMSNorm prologue and the pipeliner's
    choices move a few KiB either way, so treat it as an upper bound within ~30%.

    GEMV body (block_m == 1): its loads go straight to registers, not through a ring. What
    remains is the cross-warp reduction (block_n x num_warps float32) and, when block_k is
    not (16 B / dtype) x 32 x num_warps, a float32 shuffle of x's chunk each iteration.

    With split_k > 1, plus one float32 [rows, block_n] partial tile staged for the
    workspace store. (This is the standalone launcher's tile; inside the megakernel tiles
    compile differently: :func:`mk.planner.cost.op_smem_bytes` models those.)
    """
    rows = _tile_rows(config, M)
    if config.block_m == 1:
        vec = max(VEC_BYTES // dtype_bytes, 1)
        shuffle = 0 if config.block_k == vec * 32 * config.num_warps else config.block_k * 4
        body = config.block_n * config.num_warps * 4 + shuffle
    else:
        body = config.num_stages * (rows + config.block_n) * config.block_k * dtype_bytes
        if weight_major(rows, config.block_n):
            body += 2 * rows * config.block_k * dtype_bytes
    partial = rows * config.block_n * 4 if config.split_k > 1 else 0
    return body + partial


def linear_cost(M: int, N: int, K: int, dtype_bytes: int = 2, *, residual: bool = False, norm: bool = False,
                silu_mul: bool = False, split_k: int = 1, bias: bool = False) -> TaskCost:
    """Device-memory bytes and flops of one linear (N = weight rows, interleaved with silu_mul).

    Counts W, x, the norm weight, the bias and residual once each (per-tile re-reads of x hit L2),
    the output, and with split_k > 1 the float32 workspace written and read back.
    Flops: 2*M*N*K for the product, plus the prologue/epilogue's elementwise work.
    """
    n_out = N // 2 if silu_mul else N
    read = N * K * dtype_bytes + M * K * dtype_bytes
    written = M * n_out * dtype_bytes
    flops = 2 * M * N * K
    if norm:
        read += K * dtype_bytes
        flops += 4 * M * K
    if residual:
        read += M * n_out * dtype_bytes
        flops += M * n_out
    if bias:
        read += N * dtype_bytes
        flops += M * N
    if silu_mul:
        flops += 5 * M * n_out
    if split_k > 1:
        written += split_k * M * N * 4
        read += split_k * M * N * 4
        flops += (split_k - 1) * M * N
    return TaskCost(read, written, flops)


# ---------------------------------------------------------------------------------------
# Weight layout, launcher, reference
# ---------------------------------------------------------------------------------------


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Pack gate and up projections ([I, K] each) into one [2I, K] weight for silu_mul.

    Layout: row 2i is w_gate[i], row 2i+1 is w_up[i]. It does not depend on any tile size:
    every tile with an even BLOCK_N holds whole (gate, up) pairs, and the epilogue
    splits its accumulator's adjacent columns in registers. Returns a new contiguous tensor
    with the inputs' dtype and device.
    """
    for name, t in (("w_gate", w_gate), ("w_up", w_up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have 2 dims [I, K], got shape {tuple(t.shape)}")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate and w_up shapes differ: {tuple(w_gate.shape)} vs {tuple(w_up.shape)}")
    check_same_dtype(w_gate=w_gate, w_up=w_up)
    check_same_device(w_gate=w_gate, w_up=w_up)
    return torch.stack((w_gate, w_up), dim=1).reshape(2 * w_gate.shape[0], w_gate.shape[1])


def _check_config(config: object, K: int, silu_mul: bool) -> LinearConfig:
    if not isinstance(config, LinearConfig):
        raise TypeError(f"config must be a LinearConfig, got {type(config).__name__}")
    for field in ("block_m", "block_n", "block_k", "num_warps"):
        if not _is_pow2(getattr(config, field)):
            raise ValueError(f"config.{field} must be a power of two, got {getattr(config, field)!r}")
    if config.num_warps > 32:
        raise ValueError(f"config.num_warps must be <= 32, got {config.num_warps}")
    if config.block_m != 1 and config.block_m < DOT_MIN:
        raise ValueError(f"config.block_m must be 1 (GEMV) or >= {DOT_MIN} (tl.dot), got {config.block_m}")
    if config.block_m >= DOT_MIN and min(config.block_n, config.block_k) < DOT_MIN:
        raise ValueError(f"config.block_n and config.block_k must be >= {DOT_MIN} with block_m >= {DOT_MIN}, "
                         f"got {config.block_n}, {config.block_k}")
    if silu_mul and config.block_n < 2:
        raise ValueError("config.block_n must be even (>= 2) with silu_mul")
    check_positive_int("config.num_stages", config.num_stages)
    check_positive_int("config.group_m", config.group_m)
    check_positive_int("config.split_k", config.split_k)
    if isinstance(config.prefetch_k, bool) or not isinstance(config.prefetch_k, int) or config.prefetch_k < 0:
        raise ValueError(f"config.prefetch_k must be an int >= 0, got {config.prefetch_k!r}")
    n_chunks = -(-K // config.block_k)
    if config.split_k > n_chunks:
        raise ValueError(f"split_k={config.split_k} exceeds the {n_chunks} chunks of block_k={config.block_k} "
                         f"in K={K}; use a smaller split_k or block_k")
    return config


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    silu_mul: bool = False,
    split_k: int = 1,
    config: LinearConfig | None = None,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x @ weight.T (+ bias)``, optionally with an RMSNorm prologue, residual add or SiLU·mul.

    Args:
        x: ``[..., K]``; rows may be strided, the last dim must be contiguous. Same dtype
            as weight, or float32 (a float32 residual stream over low-precision weights).
        weight: ``[N, K]`` contiguous (Hugging Face layout). With
            ``silu_mul`` the gate/up rows interleaved by :func:`interleave_gate_up`.
        residual: optional ``[..., N]`` added to the product (not with silu_mul), of
            dtype ``out_dtype``.
        norm_weight: optional ``[K]``: x is replaced by rmsnorm(x) (float32 statistics).
        norm_eps: the RMSNorm epsilon.
        silu_mul: return ``silu(gate) * up``, ``[..., N/2]``.
        split_k: K splits, summed by a deterministic reduce. With a config, config.split_k
            is used, and split_k must be 1 or equal to it.
        config: tile sizes; :func:`linear_config` picks them when None.
        out_dtype: dtype of the result; x's dtype when None.
        bias: optional ``[N]``, one value a weight row (Qwen2's q/k/v biases, in the rows'
            order and permutation), added to the float32 product before the residual add or
            SiLU·mul.

    Prefill rows (more than SKINNY_MAX_M) with 16-bit x, weight and result, no RMSNorm,
    residual or split-K and no config given run :func:`linear_tma_kernel` on a GPU with TMA
    and the shared memory for its tile (persistent, TMA-fed; 0.88-1.02 of cuBLAS at the Llama
    prefill shapes on an H200).

    Returns:
        ``[..., N]`` (``[..., N/2]`` with silu_mul) in ``out_dtype``.
    """
    check_tensor("x", x, ndim=range(1, 9), contiguous=False, last_dim_contiguous=True)
    K = x.shape[-1]
    check_tensor("weight", weight, ndim=2)
    if weight.shape[1] != K:
        raise ValueError(f"weight must have shape (N, {K}) to match x's last dim, got {tuple(weight.shape)}")
    N = weight.shape[0]
    if N == 0 or K == 0:
        raise ValueError(f"weight must have at least one row and one column, got shape {tuple(weight.shape)}")
    if weight.numel() >= 2**31:
        raise ValueError(f"weight has {weight.numel()} elements; the kernels index with int32 (< 2**31)")
    if x.dtype != weight.dtype and x.dtype != torch.float32:
        raise TypeError(f"x must have weight's dtype ({weight.dtype}) or float32, got {x.dtype}")
    check_same_device(x=x, weight=weight)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in supported_dtypes(x):
        raise TypeError(f"out_dtype must be one of {list(supported_dtypes(x))}, got {out_dtype!r}")
    if not isinstance(silu_mul, bool):
        raise TypeError(f"silu_mul must be a bool, got {type(silu_mul).__name__}")
    if silu_mul and N % 2:
        raise ValueError(f"silu_mul needs an even number of weight rows (gate/up pairs), got N={N}")
    if silu_mul and residual is not None:
        raise ValueError("residual and silu_mul cannot be combined")
    n_out = N // 2 if silu_mul else N
    if residual is not None:
        check_tensor("residual", residual, shape=(*x.shape[:-1], N), contiguous=False, last_dim_contiguous=True)
        if residual.dtype != out_dtype:
            raise TypeError(f"residual must have the result's dtype ({out_dtype}), got {residual.dtype}")
        check_same_device(x=x, residual=residual)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(K,))
        check_same_device(x=x, norm_weight=norm_weight)
    if bias is not None:
        check_tensor("bias", bias, shape=(N,))
        check_same_device(x=x, bias=bias)
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not norm_eps >= 0:
        raise ValueError(f"norm_eps must be a non-negative number, got {norm_eps!r}")
    check_positive_int("split_k", split_k)
    M = x.numel() // K
    pinned = config
    if config is None:
        # x's dtype: a float32 x with bf16 weights sizes shared memory conservatively.
        config = linear_config(M, N, K, x.dtype, split_k=split_k, smem_limit=smem_per_block(x))
    elif isinstance(config, LinearConfig) and split_k != 1 and split_k != config.split_k:
        raise ValueError(f"split_k={split_k} conflicts with config.split_k={config.split_k}")
    config = _check_config(config, K, silu_mul)

    x2 = x.reshape(M, K)
    out = torch.empty((M, n_out), dtype=out_dtype, device=x.device)
    if M == 0:
        return out.reshape(*x.shape[:-1], n_out)
    if pinned is None and bias is None and _tma_gemm_fits(x2, weight, out, norm_weight, residual, config.split_k,
                                                          silu_mul):
        tma = TMA_GEMM
        enable_device_descriptors()
        sms = sm_count(x)
        tiles = triton.cdiv(M, tma.block_m) * triton.cdiv(N, tma.block_n)
        linear_tma_kernel[(min(sms, tiles),)](
            x2, weight, out, M, N, K, x2.stride(0), weight.stride(0), out.stride(0),
            NUM_SMS=min(sms, tiles), SILU_MUL=silu_mul, BLOCK_M=tma.block_m, BLOCK_N=tma.block_n,
            BLOCK_K=tma.block_k, GROUP_M=tma.group_m, NUM_STAGES=tma.num_stages, num_warps=tma.num_warps)
        return out.reshape(*x.shape[:-1], n_out)
    res2 = residual.reshape(M, N) if residual is not None else out
    norm_w = norm_weight if norm_weight is not None else weight
    bm, bn, bk = _tile_rows(config, M), config.block_n, config.block_k
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    # PDL only for the GEMV body: on an H200 it lifts M=1 by 3-10% but slows the tl.dot
    # tiles (M=8: 0.49 vs 0.56 of copy at 4096->6144), whose early-launched successors
    # hold shared memory that the running tiles' pipelines want.
    pdl = use_pdl(x) and config.block_m == 1
    eb = weight.element_size()
    lines, line = prefetch_lines(config, K, eb) if x.is_cuda else (0, 1)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
    # TMA bulk prefetch needs 16-byte aligned row segments.
    bulk = weight.data_ptr() % 16 == 0 and (weight.stride(0) * eb) % 16 == 0 and (bk * eb) % 16 == 0
    prefetch = dict(PREFETCH_LINES=lines, LINE=line, PDL=pdl, PREFETCH_BULK=bulk)
    if config.split_k == 1:
        linear_kernel[(tiles,)](
            x2, weight, norm_w, res2, out, bias, M, N, K, x2.stride(0), weight.stride(0), res2.stride(0),
            out.stride(0),
            float(norm_eps), HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
            SILU_MUL=silu_mul, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m, **prefetch, **launch)
    else:
        ws = torch.empty((config.split_k, M, N), dtype=torch.float32, device=x.device)
        linear_partial_kernel[(tiles, config.split_k)](
            x2, weight, norm_w, ws, M, N, K, config.split_k, x2.stride(0), weight.stride(0),
            ws.stride(0), ws.stride(1), float(norm_eps),
            HAS_NORM=norm_weight is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
            **prefetch, **launch)
        linear_splitk_reduce_kernel[(tiles,)](
            ws, res2, out, bias, M, N, config.split_k, ws.stride(0), ws.stride(1), res2.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul, BLOCK_M=bm, BLOCK_N=bn, PDL=pdl,
            num_warps=config.num_warps, launch_pdl=pdl)
    return out.reshape(*x.shape[:-1], n_out)


@dataclass(frozen=True)
class TmaGemmConfig:
    """Tile of :func:`linear_tma_kernel` (H200, bf16, the Llama 1B/8B prefill GEMMs at
    2048-8192 rows, replayed from CUDA graphs: 128 x 256 x 64 with a 3-deep ring and 8 warps
    ran 0.88-1.02 of cuBLAS, 0.75 on the 1B QKV at 2048 rows; 128 x 128 tiles ran slower)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8


TMA_GEMM = TmaGemmConfig()


def tma_gemm_serves(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    """Whether :func:`linear` of ``x`` ``[M, K]`` by ``weight`` (no RMSNorm, residual or
    split-K; result in x's dtype) runs :func:`linear_tma_kernel` on this device."""
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((x.shape[0], n_out), dtype=x.dtype, device="meta")
    return (x.dim() == 2 and x.is_cuda and x.device == weight.device
            and _tma_gemm_fits(x, weight, out, None, None, 1, silu_mul))


def tma_gemm_smem_bytes(config: TmaGemmConfig = TMA_GEMM, dtype_bytes: int = 2) -> int:
    """Shared memory of :func:`linear_tma_kernel`: the x and w rings and the output tile."""
    ring = config.num_stages * (config.block_m + config.block_n) * config.block_k * dtype_bytes
    return ring + config.block_m * config.block_n * dtype_bytes


def _tma_gemm_fits(x2, weight, out, norm_weight, residual, split_k: int, silu_mul: bool) -> bool:
    """Whether :func:`linear_tma_kernel` serves this call: a GPU with TMA (compute
    capability 9+) and the shared memory of its tile, 16-bit operands and result of one
    dtype, prefill rows (above SKINNY_MAX_M), no RMSNorm prologue, residual or split-K, and
    the 16-byte strides and bases TMA needs."""
    if not x2.is_cuda or capability(x2)[0] < 9:
        return False
    if (smem_per_block(x2) or 0) < tma_gemm_smem_bytes(dtype_bytes=x2.element_size()):
        return False
    if x2.dtype not in (torch.bfloat16, torch.float16) or not x2.dtype == weight.dtype == out.dtype:
        return False
    if norm_weight is not None or residual is not None or split_k != 1 or x2.shape[0] <= SKINNY_MAX_M:
        return False
    eb = x2.element_size()
    # (An output not allocated yet, on the meta device, is contiguous and aligned once it is.)
    return all((t.is_meta or t.data_ptr() % 16 == 0) and (t.stride(0) * eb) % 16 == 0 and t.stride(1) == 1
               for t in (x2, weight, out)) and (not silu_mul or (weight.shape[0] // 2) % 8 == 0)


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    silu_mul: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch float32 reference of :func:`linear` (same arguments, float32 result).

    With silu_mul the interleaved weight is de-interleaved by slicing (even rows gate,
    odd rows up), independently of the kernel's in-register split.
    """
    h = x.float()
    if norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.float()
    w = weight.float()
    b = torch.zeros(w.shape[0], device=w.device) if bias is None else bias.float()
    if silu_mul:
        gate, up = h @ w[0::2].T + b[0::2], h @ w[1::2].T + b[1::2]
        return torch.nn.functional.silu(gate) * up
    y = h @ w.T + b
    return y if residual is None else y + residual.float()
