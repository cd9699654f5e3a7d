"""Linear tiling as pure functions: the tile config and how :func:`linear_config` picks it,
the K splits, the shared memory and cost of a tile, and how a decode tile streams its
weights (GEMV grouping, waits inside the stream). The standalone launcher, the
megakernel's specs (:mod:`mk.tasks.linear.spec`) and the planner all ask these."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton

from .._cost import TaskCost
from .._device import check_positive_int


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
    through a TMA ring, waits for x inside its weight loop (:func:`mk.tasks.linear.tile._linear_acc`'s WAIT), as
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
#: volatile loads converted through shared memory every chunk (:func:`mk.tasks.linear.linear_run`'s WAIT).
#: Measured on an H200: 8- to 32-chunk tasks gained 0.7-1.5 us
#: each (1B step 0.947 -> 0.893 ms); the 8B down projection's 56-chunk tasks lost 4.5 us and
#: the 1B LM head's 128-chunk runs ~1.7 us. (A grouped stream, :func:`gemv_stream`, has no limit.)
WAIT_IN_STREAM_MAX_CHUNKS = 32

#: Chunks an iteration of a grouped GEMV stream (:func:`mk.tasks.linear.linear_run`'s X_GROUP) and the
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
        # float32 rows (the exact prefill's: two MMAs a chunk, hi and lo halves, against
        # 16-bit weights) take 8 warps: with 4 warps and 3 stages, Triton 3.6's pipelined
        # wgmma loop races under load on Hopper (an H200, 64 x 4096 -> 128256 rows: about one
        # garbage tile in a thousand once the grid runs in several waves).
        bn, bk, warps, stages, prefetch_k = 128, 128 // db, (4 if bm == 64 and db < 4 else 8), 3, 0
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


def tile_rows(config: LinearConfig, M: int) -> int:
    """Rows per tile as launched: block_m, cut down to what M needs, but never below tl.dot's
    16, or :data:`WEIGHT_MAJOR_MIN_ROWS` for a weight-major tile (its rows, twice over, are
    its MMA's N)."""
    if config.block_m == 1:
        return 1
    rows = min(config.block_m, triton.next_power_of_2(max(M, 1)))
    return max(WEIGHT_MAJOR_MIN_ROWS if weight_major(max(rows, DOT_MIN), config.block_n) else DOT_MIN, rows)


#: Operand buffers a tl.dot loop gets inside the megakernel. The megakernel is compiled
#: with Triton's default software pipelining (num_stages=3: two buffers in flight), whatever
#: the tile's own ``stages``; checked against the compiled kernel (tests/planner, GPU).
MEGAKERNEL_DOT_BUFFERS = 2
#: Scratch beside a GEMV task's TMA ring (S > 1) in the megakernel: its cross-warp reduction,
#: 512 B for 128- and 256-wide chunks (64 B for 64-wide: this bounds it).
GEMV_RING_SCRATCH = 512


@dataclass(frozen=True)
class MegakernelTile:
    """How a linear tile runs as a megakernel task, which changes what it stages: its x is
    float32 (``x_bytes``), its weights may stream through a TMA ring of ``tma_stages``, it
    may normalise x itself (``norm``: a fused RMSNorm's weight chunks ride beside the
    ring's), a task may be a run of ``tiles_per_task`` tiles over a split-K range of
    ``split_k`` (:func:`gemv_stream`)."""

    K: int
    tma_stages: int = 0
    norm: bool = False
    split_k: int = 1
    tiles_per_task: int = 1
    x_bytes: int = 4


def linear_smem_bytes(config: LinearConfig, M: int, dtype_bytes: int = 2, task: MegakernelTile | None = None) -> int:
    """Shared memory one tile needs, from the 3-D tile (rows x block_n x block_k) x buffers x
    element bytes, where rows is block_m capped by M as the launcher does (:func:`tile_rows`).

    tl.dot tiles stage x and weight chunks in a ring of buffers, ``(rows * x_bytes + block_n
    * dtype_bytes) * block_k`` each: the launcher's software pipeline holds ``num_stages``
    (x in the weights' dtype), the megakernel's :data:`MEGAKERNEL_DOT_BUFFERS`. An x that
    meets 16-bit weights as two halves (weight-major decode tiles of the launcher; every
    float32 x of the megakernel against narrower weights, :func:`mk.tasks._dot.mma`) stages
    them, ``2 * rows * block_k * dtype_bytes`` (+1 KiB of layout padding in the megakernel
    without a TMA ring). Standalone, a split-K tile adds its float32 [rows, block_n] partial
    staged for the workspace store (in the megakernel it reuses the dead ring).

    A GEMV tile (block_m = 1) of the launcher loads to registers: what remains is the
    cross-warp reduction (block_n x num_warps float32) and, when block_k is not (16 B /
    dtype) x 32 x num_warps, a float32 shuffle of x's chunk each iteration. In the megakernel
    (Triton 3.6 on sm_90) a register GEMV's reduction takes at most 64 B a weight row.

    With ``task`` (a megakernel task; the megakernel's shared memory is the most any task
    takes) the weights may come through a TMA ring of S = ``task.tma_stages``:

    * GEMV: S - 1 buffers in flight (at least one; a grouped stream's ring holds its groups
      in flight instead), each a [block_n, block_k] weight chunk and an 8-byte barrier, plus,
      pipelined beside it (S > 1), the RMSNorm weight's chunk when fused, and x's chunk, or
      instead of it :data:`GEMV_RING_SCRATCH` when the task waits for x inside its stream (x
      then comes to registers, not pipelined);
    * tl.dot: S - 1 x chunks beside S - 1 weight chunks (no halves staged: mma.sync takes
      them to registers from the ring's x chunk), and weight-major tiles
      (:func:`weight_major`) all S weight chunks (wgmma reads them in place) and the halves
      once, x itself in registers; a fused RMSNorm adds S - 1 of its chunks.

    Exact for Hopper's prefill tiles (block_m >= 64) on Triton 3.9 and for the megakernel's
    tiles as compiled (checked on the GPU); the launcher's RMSNorm prologue and pipeliner
    choices move a few KiB either way, so treat its figure as an upper bound within ~30%.
    """
    rows, bn, bk = tile_rows(config, M), config.block_n, config.block_k
    if task is None:  # the standalone launcher's tile
        if config.block_m == 1:
            vec = max(VEC_BYTES // dtype_bytes, 1)
            shuffle = 0 if bk == vec * 32 * config.num_warps else bk * 4
            return bn * config.num_warps * 4 + shuffle
        body = _dot_ring(config.num_stages, rows, bn, bk, dtype_bytes, dtype_bytes)
        if weight_major(rows, bn):
            body += 2 * rows * bk * dtype_bytes
        return body + (rows * bn * 4 if config.split_k > 1 else 0)
    x_bytes, S = task.x_bytes, task.tma_stages
    halves = x_bytes != dtype_bytes  # x meets the weights as hi + lo halves
    if config.block_m == 1 and S:
        chunk = bn * bk * dtype_bytes
        if S == 1:
            return chunk + 8
        stream = gemv_stream(1, S, task.K, bk, bn, dtype_bytes, task.split_k, task.tiles_per_task)
        side = (0 if stream.waits else bk * x_bytes) + (bk * dtype_bytes if task.norm else 0) + 8
        return stream.chunks_in_flight * (chunk + side) + (GEMV_RING_SCRATCH if stream.waits else 0)
    if config.block_m == 1:
        return 64 * bn
    staged = 2 * rows * bk * dtype_bytes if halves else 0
    # (Triton 3.6: 256 B less for some 256-byte norm chunks, within the GPU test's slack.)
    norm_chunks = max(S - 1, 1) * bk * dtype_bytes if task.norm else 0
    if S and weight_major(rows, bn):  # (compiled, sm_90: 8 rows x 128, ring 3: 102424 B)
        return S * (bn * bk * dtype_bytes + 8) + staged + norm_chunks
    if S:  # (compiled, sm_90: 16 rows, 64 x 128, ring 3: 49168 B; with the norm 49424)
        return max(S - 1, 1) * (bn * bk * dtype_bytes + rows * bk * x_bytes + 8) + norm_chunks
    return _dot_ring(MEGAKERNEL_DOT_BUFFERS, rows, bn, bk, x_bytes, dtype_bytes) + (staged + 1024 if halves else 0)


def _dot_ring(buffers: int, rows: int, block_n: int, block_k: int, x_bytes: int, w_bytes: int) -> int:
    """Bytes of a tl.dot tile's operand ring: ``buffers`` x (x chunk + weight chunk)."""
    return buffers * (rows * x_bytes + block_n * w_bytes) * block_k


def linear_cost(M: int, N: int, K: int, dtype_bytes: int = 2, *, residual: bool = False, norm: bool = False,
                silu_mul: bool = False, split_k: int = 1, bias: bool = False,
                weight_bytes: int | None = None) -> TaskCost:
    """Device-memory bytes and flops of one linear (N = weight rows, interleaved with silu_mul).

    Counts W, x, the norm weight, the bias and residual once each (per-tile re-reads of x hit L2),
    the output, and with split_k > 1 the float32 workspace written and read back. The weight
    is ``weight_bytes`` (its format's, scales included: :meth:`~mk.tasks.linear.format.WeightFormat.nbytes`;
    default ``N * K * dtype_bytes``), apart from the activations' ``dtype_bytes``.
    Flops: 2*M*N*K for the product, plus the prologue/epilogue's elementwise work.
    """
    n_out = N // 2 if silu_mul else N
    read = (N * K * dtype_bytes if weight_bytes is None else weight_bytes) + M * K * dtype_bytes
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


def check_config(config: object, K: int, silu_mul: bool) -> LinearConfig:
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
