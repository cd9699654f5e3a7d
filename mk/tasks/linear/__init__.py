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

Layout of the package: :mod:`~mk.tasks.linear.config` (tile configs, K splits, shared
memory, cost: pure functions), :mod:`~mk.tasks.linear.tile` (the GEMV and tl.dot tile
bodies), :mod:`~mk.tasks.linear.run` (runs of tiles streamed as one, their epilogues),
:mod:`~mk.tasks.linear.splitk` (partials and their reduce), :mod:`~mk.tasks.linear.prefetch`
(L2 prefetch, PDL), :mod:`~mk.tasks.linear.tma_gemm` (the prefill GEMM),
:mod:`~mk.tasks.linear.launch` (the standalone op and its reference),
:mod:`~mk.tasks.linear.spec` (the megakernel's linear ops), :mod:`~mk.tasks.linear.planning` (how
the planner plans and lowers a linear). Every name is re-exported here.
"""

from .config import (DOT_MIN, GEMV_RING_SCRATCH, GROUP_M, MEGAKERNEL_DOT_BUFFERS, SKINNY_MAX_M, VEC_BYTES,
                     WAIT_IN_STREAM_MAX_CHUNKS, WEIGHT_MAJOR_MIN_N, WEIGHT_MAJOR_MIN_ROWS, X_GROUP,
                     X_GROUP_MAX_CHUNK_BYTES, GemvStream, LinearConfig, MegakernelTile, check_config,
                     dot_waits_in_stream, gemv_stream, linear_config, linear_cost, linear_k_splits, linear_smem_bytes,
                     prefetch_lines, tile_rows, weight_major)
from .launch import (interleave_gate_up, linear, linear_kernel, linear_partial_kernel, linear_ref,
                     linear_splitk_reduce_kernel)
from .prefetch import linear_prefetch_tile
from .run import linear_argmax_epilogue, linear_partial_epilogue, linear_run, linear_store_epilogue
from .spec import linear_op, linear_partial_op, linear_reduce_op, linear_tiles
from .planning import LINEAR, LinearKind  # (registers the linear's and the residual add's planning)
from .splitk import linear_partial_tile, linear_split_range, linear_splitk_reduce_tile, linear_splitk_sum
from .tile import linear_tile, linear_weights_first
from .tma_gemm import (TMA_GEMM, TMA_GEMM_NARROW, TmaGemmConfig, linear_tma_kernel, tma_gemm_config, tma_gemm_serves,
                       tma_gemm_smem_bytes)

__all__ = [
    "DOT_MIN", "GEMV_RING_SCRATCH", "GROUP_M", "GemvStream", "LINEAR", "LinearConfig", "LinearKind",
    "MEGAKERNEL_DOT_BUFFERS", "MegakernelTile", "SKINNY_MAX_M", "VEC_BYTES", "WAIT_IN_STREAM_MAX_CHUNKS",
    "WEIGHT_MAJOR_MIN_N", "WEIGHT_MAJOR_MIN_ROWS", "X_GROUP", "X_GROUP_MAX_CHUNK_BYTES",
    "check_config", "dot_waits_in_stream", "gemv_stream", "linear_config", "linear_cost", "linear_k_splits",
    "linear_smem_bytes", "prefetch_lines", "tile_rows", "weight_major", "linear_tile", "linear_weights_first",
    "linear_argmax_epilogue", "linear_partial_epilogue", "linear_run", "linear_store_epilogue",
    "linear_prefetch_tile", "linear_partial_tile", "linear_split_range", "linear_splitk_reduce_tile",
    "linear_splitk_sum", "TMA_GEMM", "TMA_GEMM_NARROW", "TmaGemmConfig", "tma_gemm_config",
    "linear_tma_kernel", "tma_gemm_serves", "tma_gemm_smem_bytes", "interleave_gate_up", "linear", "linear_kernel",
    "linear_partial_kernel", "linear_ref", "linear_splitk_reduce_kernel",
    "linear_op", "linear_partial_op", "linear_reduce_op", "linear_tiles",
]
