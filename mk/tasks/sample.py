"""Next-token sampling: temperature, top-k and top-p (nucleus), reproducible, without a sort.

With z = logits / T (IEEE-rounded float32 division), the allowed set is

    top-k:  z_i >= the k-th largest z                          (ties at the k-th value kept)
    top-p:  mass{ j allowed by top-k : z_j > z_i } < top_p      (p = softmax of the top-k logits)

which is Hugging Face's Temperature -> TopK -> TopP warper chain; top-p keeps the
smallest set of highest-probability tokens whose mass reaches top_p, and when tokens
tie at the boundary value all of them are kept (HF's sort would split them in
whatever order it produced). The token is then drawn by Gumbel-max,

    token = argmax over allowed i of  z_i + g_i,    g_i = -log(-log(u_i)),

with u_i uniform in (0, 1) from Philox keyed by ``seed`` with the counter
(i, row, offset mod 2**32, offset >> 32). The same (logits, seed, offset) give the same
tokens on every run and every schedule; a new ``offset`` (e.g. the decode step) gives
an independent draw. :func:`gumbel_noise` exposes exactly that g so that
:func:`sample_ref` can replay a draw in plain torch.

Everything is exact and parallel over vocabulary chunks. The two thresholds are found
by radix select on an order-preserving uint32 image of z: each pass decides
RADIX_BITS more bits of the threshold from per-chunk histograms (token counts for
top-k, probability mass for top-p) reduced per row, so a threshold takes
32 // RADIX_BITS passes of (chunk tiles -> one reduce tile). The megakernel schedules:

    [top-p]  argmax_partial_tile on the raw logits -> argmax_reduce_tile  (row max, for softmax)
    [top-k]  for each pass: sample_hist_tile(count) per chunk -> sample_select_tile per row
    [top-p]  for each pass: sample_hist_tile(mass) per chunk  -> sample_select_tile per row
             sample_gumbel_partial_tile per chunk -> argmax_reduce_tile per row -> token

All per-row state lives in two small arrays (int32 ``state_i`` and float32 ``state_f``,
[B, STATE_WORDS]; see :func:`sample_workspace`) that pass 0 of each threshold
re-initialises, so they are reused across decode steps without clearing. The greedy
path (temperature 0) is just the argmax partials and reduce.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._cost import TaskCost
from ._device import check_device, check_same_device, check_tensor, default_device, interpreting, jit
from ._spec import OpSpec, Region, operand_view, register
from .argmax import (
    ArgmaxShape, argmax, argmax_block, argmax_block_c, argmax_partial_kernel, argmax_reduce_kernel,
    check_block_v, check_logits, order_key,
)

#: Bits of a threshold decided per radix pass (1, 2, 4 or 8): 2**RADIX_BITS histogram bins.
RADIX_BITS = 4
#: Default widest vocabulary chunk of the sampler's tiles.
MAX_BLOCK_V = 1024
#: Widest block of chunk histograms the select tile loads at once.
MAX_BLOCK_C = 128
#: One-hot entries (sub-block × bins) a histogram step holds at once: bounded by registers
#: on the GPU; the interpreter is faster with fewer, larger steps.
HIST_ELEMENTS, HIST_ELEMENTS_INTERPRETED = 4096, 1 << 16
#: Words per row in state_i and state_f.
STATE_WORDS = 4

# state_i slots (uint32 bit patterns stored as int32).
_PREFIX = tl.constexpr(0)  # bits of the threshold decided so far
_KTH = tl.constexpr(1)     # top-k threshold key (lowest allowed), final after the last top-k pass
_PTH = tl.constexpr(2)     # top-p threshold key, final after the last top-p pass
# state_f slots.
_ABOVE = tl.constexpr(0)   # count / mass of the tokens above the current prefix group
_TARGET = tl.constexpr(1)  # k, or top_p × (mass of the top-k set)

_SIGN_BIT = tl.constexpr(-2147483648)  # int32 0x80000000: signed order -> unsigned order
_MAX_SEED = 2**63


@jit
def sample_key(z):
    """uint32 image of float32 z, increasing with z (-0.0 = +0.0): radix digits read from it."""
    return (order_key(z) ^ _SIGN_BIT).to(tl.uint32, bitcast=True)


@jit
def scale_logits(x, temperature):
    """z = x / temperature with IEEE rounding (``/`` may be approximate on the GPU).

    The reference divides the same way (:func:`scale_logits_ref`), so top-k/top-p sets
    agree bit for bit; and a true division (not a multiply) keeps the compiler from fusing
    z + g into an FMA.
    """
    return tl.math.div_rn(x, tl.zeros_like(x) + temperature)


@jit
def gumbel(seed, offset, row, cols):
    """Gumbel(0, 1) noise for tokens ``cols`` (int32 block) of ``row`` at step ``offset``.

    Philox-4x32 keyed by seed, counter (token, row, offset low word, offset high word):
    every (seed, offset, row, token) has its own stream, with no counter arithmetic that
    could overflow or collide. u = (top 23 bits + 0.5) / 2**23 lies strictly inside
    (0, 1), so both logs are finite.
    """
    # Adding a zero tensor turns ints specialised as constants (Triton makes an argument
    # equal to 1 a constexpr) into tensors; tl.to_tensor is not in every Triton we support.
    off = (offset + tl.zeros([], dtype=tl.int64)).to(tl.int64)
    c1 = (row + tl.zeros([], dtype=tl.int32)).to(tl.uint32)
    r, _, _, _ = tl.philox(seed, cols.to(tl.uint32), c1, off.to(tl.uint32), (off >> 32).to(tl.uint32))
    u = ((r >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    # Clamp so that an inexact log near u = 1 cannot give 0 (g would be +inf).
    e = tl.maximum(-tl.log(u), 1.4901161193847656e-08)
    return -tl.log(e)


@jit
def gumbel_noise_tile(out_ptr, row, chunk, V, stride_row, seed, offset, BLOCK_V: tl.constexpr):
    """out[row, chunk*BLOCK_V ...] = the noise the sampler adds to those tokens."""
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    tl.store(out_ptr + row * stride_row + cols, gumbel(seed, offset, row, cols), mask=cols < V)


@jit
def sample_hist_tile(
    logits_ptr, state_i_ptr, row_max_ptr, part_hist_ptr,
    row, chunk, pass_idx, V, stride_row, stride_state_i, stride_hist, temperature,
    WEIGHTED: tl.constexpr, USE_KTH: tl.constexpr,
    RADIX_BITS: tl.constexpr, BLOCK_V: tl.constexpr, SUB_V: tl.constexpr,
):
    """Histogram of the next radix digit over one chunk: part_hist[row, chunk, :].

    Counts (WEIGHTED=False, top-k) or sums exp(z - z_max) (WEIGHTED=True, top-p) of
    the chunk's tokens whose key starts with the prefix decided by earlier passes
    (none on pass 0), binned by the next RADIX_BITS bits. With USE_KTH only tokens at
    or above the top-k threshold count. ``part_hist`` is [B, n_chunks, 2**RADIX_BITS]
    float32 (counts are exact below 2**24). Reads state_i[row] and row_max[row].
    """
    NBINS: tl.constexpr = 1 << RADIX_BITS
    shift = 32 - RADIX_BITS * (pass_idx + 1)  # uint32 >> int32 is a logical shift (C promotion)
    si = state_i_ptr + row * stride_state_i
    # Pass 0 has no prefix yet; masking the load also ignores a stale one from the last step.
    prefix = tl.load(si + _PREFIX, mask=pass_idx > 0, other=0).to(tl.uint32, bitcast=True)
    if USE_KTH:
        lo = tl.load(si + _KTH).to(tl.uint32, bitcast=True)
    if WEIGHTED:
        # Division is monotone, so the scaled max is the max of the scaled logits.
        zmax = tl.math.div_rn(tl.load(row_max_ptr + row), temperature)
    bins = tl.arange(0, NBINS)
    hist = tl.zeros([NBINS], dtype=tl.float32)
    for start in range(0, BLOCK_V, SUB_V):
        cols = chunk * BLOCK_V + start + tl.arange(0, SUB_V)
        valid = cols < V
        x = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=0.0).to(tl.float32)
        z = scale_logits(x, temperature)
        ukey = sample_key(z)
        digits = ukey >> shift  # the decided prefix bits, then this pass's digit
        take = valid & ((digits >> RADIX_BITS) == prefix)
        if USE_KTH:
            take = take & (ukey >= lo)
        onehot = take[:, None] & ((digits & (NBINS - 1)).to(tl.int32)[:, None] == bins[None, :])
        if WEIGHTED:
            hist += tl.sum(tl.where(onehot, tl.exp(z - zmax)[:, None], 0.0), axis=0)
        else:
            hist += tl.sum(tl.where(onehot, 1.0, 0.0), axis=0)
    tl.store(part_hist_ptr + row * stride_hist + chunk * NBINS + bins, hist)


@jit
def sample_select_tile(
    part_hist_ptr, state_i_ptr, state_f_ptr,
    row, n_chunks, pass_idx, stride_hist, stride_state_i, stride_state_f, goal,
    WEIGHTED: tl.constexpr, RADIX_BITS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Reduce one pass's chunk histograms of ``row`` and fix the next RADIX_BITS of the threshold.

    The threshold is the largest key T with (count or mass of tokens with key >= T)
    >= target, where target = goal (= k) for counts and goal × total mass (= top_p × Z,
    with Z taken from pass 0's histogram) for masses; ``goal`` is k (1 <= k <= V) or
    top_p (in (0, 1), nonzero in float32). Keeps the largest digit whose bin together
    with everything above still reaches the target. If float rounding leaves
    no digit reaching it (masses only), digit 0 keeps the whole group: never fewer
    tokens than the exact rule. Writes the prefix, the running count/mass above the
    group, the target, and the threshold so far (prefix followed by zero bits) into
    the KTH (counts) or PTH (masses) slot; after the last pass that is the threshold.
    """
    NBINS: tl.constexpr = 1 << RADIX_BITS
    bins = tl.arange(0, NBINS)
    offs_c = tl.arange(0, BLOCK_C)
    base = part_hist_ptr + row * stride_hist
    hist = tl.zeros([NBINS], dtype=tl.float32)
    for start in range(0, n_chunks, BLOCK_C):  # fixed order: deterministic sums
        c = start + offs_c
        blk = tl.load(base + c[:, None] * NBINS + bins[None, :], mask=(c < n_chunks)[:, None], other=0.0)
        hist += tl.sum(blk, axis=0)
    # suffix[b] = sum of hist[b:], each summed on its own: monotone in b whatever the rounding.
    suffix = tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0.0), axis=1)

    si = state_i_ptr + row * stride_state_i
    sf = state_f_ptr + row * stride_state_f
    first = pass_idx == 0
    prefix = tl.load(si + _PREFIX, mask=pass_idx > 0, other=0).to(tl.uint32, bitcast=True)
    above = tl.load(sf + _ABOVE, mask=pass_idx > 0, other=0.0)
    if WEIGHTED:
        total = tl.sum(tl.where(bins == 0, suffix, 0.0), axis=0)
        target = tl.where(first, goal * total, tl.load(sf + _TARGET))
    else:
        target = tl.where(first, goal, tl.load(sf + _TARGET))

    digit = tl.max(tl.where(above + suffix >= target, bins, -1), axis=0)
    digit = tl.maximum(digit, 0)
    above = above + tl.sum(tl.where(bins == digit + 1, suffix, 0.0), axis=0)
    prefix = (prefix << RADIX_BITS) | digit.to(tl.uint32)
    shift = 32 - RADIX_BITS * (pass_idx + 1)
    threshold = prefix << shift

    tl.store(si + _PREFIX, prefix.to(tl.int32, bitcast=True))
    if WEIGHTED:
        tl.store(si + _PTH, threshold.to(tl.int32, bitcast=True))
    else:
        tl.store(si + _KTH, threshold.to(tl.int32, bitcast=True))
    tl.store(sf + _ABOVE, above)
    tl.store(sf + _TARGET, target)


@jit
def allowed_by_thresholds(z, valid, si, USE_KTH: tl.constexpr, USE_PTH: tl.constexpr):
    """valid & key(z) >= the top-k threshold (USE_KTH) & >= the top-p threshold (USE_PTH).

    ``si`` points at the row's state_i. The one test of membership in the allowed set:
    the Gumbel tile and :func:`sample_allowed_tile` both use it, on z from
    :func:`scale_logits`, so the set reported is bit for bit the set drawn from.
    """
    allowed = valid
    if USE_KTH or USE_PTH:
        ukey = sample_key(z)
        if USE_KTH:
            allowed = allowed & (ukey >= tl.load(si + _KTH).to(tl.uint32, bitcast=True))
        if USE_PTH:
            allowed = allowed & (ukey >= tl.load(si + _PTH).to(tl.uint32, bitcast=True))
    return allowed


@jit
def sample_allowed_tile(
    logits_ptr, state_i_ptr, out_ptr,
    row, chunk, V, stride_row, stride_state_i, stride_out, temperature,
    USE_KTH: tl.constexpr, USE_PTH: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """out[row, chunk*BLOCK_V ...] (int8) = 1 where :func:`sample_gumbel_partial_tile` allows the token."""
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < V
    x = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=0.0).to(tl.float32)
    z = scale_logits(x, temperature)
    allowed = allowed_by_thresholds(z, valid, state_i_ptr + row * stride_state_i, USE_KTH=USE_KTH, USE_PTH=USE_PTH)
    tl.store(out_ptr + row * stride_out + cols, allowed.to(tl.int8), mask=valid)


@jit
def sample_gumbel_partial_tile(
    logits_ptr, state_i_ptr, part_val_ptr, part_idx_ptr,
    row, chunk, V, stride_row, stride_state_i, stride_part, temperature, seed, offset,
    USE_KTH: tl.constexpr, USE_PTH: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Gumbel-max partial of one chunk: the best allowed z + g and its token.

    Allowed: key >= the top-k threshold (USE_KTH) and >= the top-p threshold (USE_PTH).
    Writes part_val[row, chunk], part_idx[row, chunk]; a chunk with no allowed token
    writes (-inf, V), which every allowed token beats in :func:`argmax_reduce_tile`.
    """
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < V
    x = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=0.0).to(tl.float32)
    z = scale_logits(x, temperature)
    allowed = allowed_by_thresholds(z, valid, state_i_ptr + row * stride_state_i, USE_KTH=USE_KTH, USE_PTH=USE_PTH)
    val, idx = argmax_block(z + gumbel(seed, offset, row, cols), cols, allowed, V)
    tl.store(part_val_ptr + row * stride_part + chunk, val)
    tl.store(part_idx_ptr + row * stride_part + chunk, idx)


# Standalone entry points: grid (chunk, row) for chunk tiles, (row,) for reduce tiles.
# seed/offset/pass_idx are not specialised, so every step reuses one compiled kernel.

@jit(do_not_specialize=["seed", "offset"])
def gumbel_noise_kernel(out_ptr, V, stride_row, seed, offset, BLOCK_V: tl.constexpr):
    gumbel_noise_tile(out_ptr, tl.program_id(1), tl.program_id(0), V, stride_row, seed, offset, BLOCK_V=BLOCK_V)


@jit(do_not_specialize=["pass_idx"])
def sample_hist_kernel(
    logits_ptr, state_i_ptr, row_max_ptr, part_hist_ptr,
    pass_idx, V, stride_row, stride_state_i, stride_hist, temperature,
    WEIGHTED: tl.constexpr, USE_KTH: tl.constexpr,
    RADIX_BITS: tl.constexpr, BLOCK_V: tl.constexpr, SUB_V: tl.constexpr,
):
    sample_hist_tile(logits_ptr, state_i_ptr, row_max_ptr, part_hist_ptr,
                     tl.program_id(1), tl.program_id(0), pass_idx, V, stride_row, stride_state_i, stride_hist,
                     temperature, WEIGHTED=WEIGHTED, USE_KTH=USE_KTH, RADIX_BITS=RADIX_BITS,
                     BLOCK_V=BLOCK_V, SUB_V=SUB_V)


@jit(do_not_specialize=["pass_idx"])
def sample_select_kernel(
    part_hist_ptr, state_i_ptr, state_f_ptr,
    n_chunks, pass_idx, stride_hist, stride_state_i, stride_state_f, goal,
    WEIGHTED: tl.constexpr, RADIX_BITS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    sample_select_tile(part_hist_ptr, state_i_ptr, state_f_ptr, tl.program_id(0), n_chunks, pass_idx,
                       stride_hist, stride_state_i, stride_state_f, goal,
                       WEIGHTED=WEIGHTED, RADIX_BITS=RADIX_BITS, BLOCK_C=BLOCK_C)


@jit(do_not_specialize=["seed", "offset"])
def sample_gumbel_partial_kernel(
    logits_ptr, state_i_ptr, part_val_ptr, part_idx_ptr,
    V, stride_row, stride_state_i, stride_part, temperature, seed, offset,
    USE_KTH: tl.constexpr, USE_PTH: tl.constexpr, BLOCK_V: tl.constexpr,
):
    sample_gumbel_partial_tile(logits_ptr, state_i_ptr, part_val_ptr, part_idx_ptr,
                               tl.program_id(1), tl.program_id(0), V, stride_row, stride_state_i, stride_part,
                               temperature, seed, offset, USE_KTH=USE_KTH, USE_PTH=USE_PTH, BLOCK_V=BLOCK_V)


@jit
def sample_allowed_kernel(
    logits_ptr, state_i_ptr, out_ptr, V, stride_row, stride_state_i, stride_out, temperature,
    USE_KTH: tl.constexpr, USE_PTH: tl.constexpr, BLOCK_V: tl.constexpr,
):
    sample_allowed_tile(logits_ptr, state_i_ptr, out_ptr, tl.program_id(1), tl.program_id(0), V, stride_row,
                        stride_state_i, stride_out, temperature, USE_KTH=USE_KTH, USE_PTH=USE_PTH, BLOCK_V=BLOCK_V)


# ---------------------------------------------------------------------------------------------
# Settings (pure functions the planner and the tests share)

def sample_block_v(v: int) -> int:
    """Chunk width of the sampler's tiles for a vocabulary of v."""
    return min(triton.next_power_of_2(max(v, 16)), MAX_BLOCK_V)


def sample_sub_v(block_v: int, radix_bits: int = RADIX_BITS, interpreted: bool = False) -> int:
    """Sub-block of a histogram step: HIST_ELEMENTS one-hot entries at most (registers;
    HIST_ELEMENTS_INTERPRETED under the interpreter)."""
    return max(1, min(block_v, (HIST_ELEMENTS_INTERPRETED if interpreted else HIST_ELEMENTS) >> radix_bits))


def sample_num_passes(radix_bits: int = RADIX_BITS) -> int:
    """Radix passes per threshold."""
    return 32 // radix_bits


def sample_block_c(n_chunks: int) -> int:
    """How many chunk histograms the select tile loads at once."""
    return min(triton.next_power_of_2(max(n_chunks, 1)), MAX_BLOCK_C)


def _float32(x: float) -> float:
    """x rounded to float32, as the kernels receive it."""
    return torch.tensor(x, dtype=torch.float32).item()


# ---------------------------------------------------------------------------------------------
# Argument checks

def _check_temperature(temperature: object) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if temperature > 0 and not 0 < _float32(temperature) < math.inf:
        raise ValueError(f"temperature {temperature!r} is out of float32 range; use 0 for greedy")
    return float(temperature)


def _check_top_k(top_k: object) -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    return top_k


def _check_top_p(top_p: object) -> float | None:
    if top_p is None:
        return None
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise TypeError(f"top_p must be a number or None, got {type(top_p).__name__}")
    if not (0 < top_p <= 1) or _float32(top_p) == 0:  # a zero target would allow nothing
        raise ValueError(f"top_p must be in (0, 1] (and nonzero in float32), got {top_p!r}")
    return float(top_p)


def _check_counter(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < _MAX_SEED:
        raise ValueError(f"{name} must be in [0, 2**63), got {value}")
    return value


def _check_radix_bits(radix_bits: object) -> int:
    if isinstance(radix_bits, bool) or not isinstance(radix_bits, int):
        raise TypeError(f"radix_bits must be an int, got {type(radix_bits).__name__}")
    if radix_bits not in (1, 2, 4, 8):
        raise ValueError(f"radix_bits must be 1, 2, 4 or 8, got {radix_bits!r}")
    return radix_bits


# ---------------------------------------------------------------------------------------------
# Launchers

def gumbel_noise(seed: int, offset: int, rows: int, v: int, *, device: torch.device | str | None = None,
                 block_v: int | None = None) -> torch.Tensor:
    """float32 ``[rows, v]``: the Gumbel noise :func:`sample` adds for (seed, offset).

    Computed by the same device function as the sampler, so ``sample_ref(logits, ...,
    noise=gumbel_noise(seed, offset, *logits.shape))`` replays ``sample(logits, ...,
    seed=seed, offset=offset)`` token for token.
    """
    _check_counter("seed", seed)
    _check_counter("offset", offset)
    for name, n in (("rows", rows), ("v", v)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if rows * v >= 2**31:
        raise ValueError(f"rows * v must be < 2**31, got {rows} * {v}")
    device = check_device("device", device)
    block_v = sample_block_v(v) if block_v is None else check_block_v(block_v)
    out = torch.empty(rows, v, dtype=torch.float32, device=device)
    if rows and v:
        gumbel_noise_kernel[(triton.cdiv(v, block_v), rows)](out, v, out.stride(0), seed, offset,
                                                             BLOCK_V=block_v, num_warps=4)
    return out


def sample_workspace(rows: int, n_chunks: int, radix_bits: int = RADIX_BITS,
                     device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The scratch the sampler's tiles share, for ``rows`` rows of ``n_chunks`` chunks.

    ``state_i`` int32 / ``state_f`` float32 ``[rows, STATE_WORDS]`` (per-row select
    state), ``part_hist`` ``[rows, n_chunks, 2**radix_bits]``, ``part_val`` / ``part_idx``
    ``[rows, n_chunks]`` (argmax partials), ``row_max`` ``[rows]`` (max logit, for top-p)
    and ``score`` ``[rows]`` (the winner's z + g). None of it needs
    clearing between calls: each stage initialises what it reads.
    """
    device = torch.device(device) if device is not None else default_device()
    f32, i32 = torch.float32, torch.int32
    return {
        "state_i": torch.empty(rows, STATE_WORDS, dtype=i32, device=device),
        "state_f": torch.empty(rows, STATE_WORDS, dtype=f32, device=device),
        "part_hist": torch.empty(rows, n_chunks, 1 << radix_bits, dtype=f32, device=device),
        "part_val": torch.empty(rows, n_chunks, dtype=f32, device=device),
        "part_idx": torch.empty(rows, n_chunks, dtype=i32, device=device),
        "row_max": torch.empty(rows, dtype=f32, device=device),
        "score": torch.empty(rows, dtype=f32, device=device),
    }


def _filter(logits: torch.Tensor, t32: float, use_k: bool, k: int, use_p: bool, top_p: float,
            block_v: int, radix_bits: int, ws: dict[str, torch.Tensor], scratch_idx: torch.Tensor) -> None:
    """Run the row-max, top-k and top-p stages: state_i then holds the thresholds."""
    rows, v = logits.shape
    n_chunks = triton.cdiv(v, block_v)
    grid_chunks = (n_chunks, rows)
    part_val, part_hist, state_i, state_f = ws["part_val"], ws["part_hist"], ws["state_i"], ws["state_f"]
    if use_p:  # the row max stabilises the softmax mass of the top-p passes
        argmax_partial_kernel[grid_chunks](logits, part_val, ws["part_idx"], v, logits.stride(0),
                                           part_val.stride(0), BLOCK_V=block_v, num_warps=4)
        argmax_reduce_kernel[(rows,)](part_val, ws["part_idx"], scratch_idx, ws["row_max"], n_chunks,
                                      part_val.stride(0), BLOCK_C=argmax_block_c(n_chunks), num_warps=4)
    for weighted, used, goal in ((False, use_k, float(k)), (True, use_p, top_p)):
        if not used:
            continue
        for pass_idx in range(sample_num_passes(radix_bits)):
            sample_hist_kernel[grid_chunks](
                logits, state_i, ws["row_max"], part_hist, pass_idx, v, logits.stride(0), state_i.stride(0),
                part_hist.stride(0), t32, WEIGHTED=weighted, USE_KTH=weighted and use_k, RADIX_BITS=radix_bits,
                BLOCK_V=block_v, SUB_V=sample_sub_v(block_v, radix_bits, interpreting(logits)), num_warps=4,
            )
            sample_select_kernel[(rows,)](
                part_hist, state_i, state_f, n_chunks, pass_idx, part_hist.stride(0), state_i.stride(0),
                state_f.stride(0), goal, WEIGHTED=weighted, RADIX_BITS=radix_bits,
                BLOCK_C=sample_block_c(n_chunks), num_warps=4,
            )


def _check_workspace(workspace: object, logits: torch.Tensor, n_chunks: int,
                     radix_bits: int) -> dict[str, torch.Tensor]:
    rows = logits.shape[0]
    if not isinstance(workspace, dict):
        raise TypeError(f"workspace must be a dict from sample_workspace(), got {type(workspace).__name__}")
    shapes = {
        "state_i": ((rows, STATE_WORDS), torch.int32), "state_f": ((rows, STATE_WORDS), torch.float32),
        "part_hist": ((rows, n_chunks, 1 << radix_bits), torch.float32),
        "part_val": ((rows, n_chunks), torch.float32), "part_idx": ((rows, n_chunks), torch.int32),
        "row_max": ((rows,), torch.float32), "score": ((rows,), torch.float32),
    }
    for name, (shape, dtype) in shapes.items():
        if name not in workspace:
            raise ValueError(f"workspace lacks {name!r}; build it with sample_workspace()")
        check_tensor(f"workspace[{name!r}]", workspace[name], shape=shape, dtype=dtype)
    check_same_device(logits=logits, **{f"workspace[{name!r}]": workspace[name] for name in shapes})
    return workspace


def _check_sample_args(logits, temperature, top_k, top_p, block_v, radix_bits):
    check_logits(logits)
    temperature = _check_temperature(temperature)
    top_k = _check_top_k(top_k)
    top_p = _check_top_p(top_p)
    radix_bits = _check_radix_bits(radix_bits)
    block_v = None if block_v is None else check_block_v(block_v)
    return temperature, top_k, top_p, block_v, radix_bits


def sample(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    offset: int = 0,
    block_v: int | None = None,
    radix_bits: int = RADIX_BITS,
    workspace: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature), restricted by top-k and top-p.

    Args:
        logits: ``[B, V]`` (rows may be strided; last dim contiguous). Must not hold NaN
            or +inf; -inf marks a banned token.
        temperature: > 0 to sample; 0 means greedy (:func:`argmax`, top_k/top_p ignored).
        top_k: keep the k largest logits (and any tied with the k-th); None keeps all.
        top_p: keep the smallest set of most likely tokens (of those top-k kept) whose
            probability reaches top_p, in (0, 1]; None or 1 keeps all.
        seed, offset: ints in [0, 2**63). Equal (logits, seed, offset) give equal tokens;
            change ``offset`` (e.g. to the decode step) for a fresh draw.
        block_v: vocabulary chunk width (a power of two); default :func:`sample_block_v`.
        radix_bits: threshold bits per radix pass (1, 2, 4, 8): fewer passes, wider histograms.
        workspace: scratch from :func:`sample_workspace` (B rows, ``ceil(V / block_v)``
            chunks) to reuse across steps instead of allocating; its contents do not matter.

    Returns:
        int64 ``[B]`` token ids.
    """
    temperature, top_k, top_p, block_v, radix_bits = _check_sample_args(
        logits, temperature, top_k, top_p, block_v, radix_bits)
    seed = _check_counter("seed", seed)
    offset = _check_counter("offset", offset)
    if temperature == 0:
        return argmax(logits, block_v=block_v)

    rows, v = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    block_v = sample_block_v(v) if block_v is None else block_v
    n_chunks = triton.cdiv(v, block_v)
    use_k = top_k is not None and top_k < v
    use_p = top_p is not None and top_p < 1.0
    t32 = _float32(temperature)
    if workspace is None:
        ws = sample_workspace(rows, n_chunks, radix_bits, logits.device)
    else:
        ws = _check_workspace(workspace, logits, n_chunks, radix_bits)
    _filter(logits, t32, use_k, top_k or 0, use_p, top_p or 1.0, block_v, radix_bits, ws, out)
    part_val, part_idx = ws["part_val"], ws["part_idx"]
    sample_gumbel_partial_kernel[(n_chunks, rows)](
        logits, ws["state_i"], part_val, part_idx, v, logits.stride(0), ws["state_i"].stride(0),
        part_val.stride(0), t32, seed, offset, USE_KTH=use_k, USE_PTH=use_p, BLOCK_V=block_v, num_warps=4,
    )
    argmax_reduce_kernel[(rows,)](part_val, part_idx, out, ws["score"], n_chunks, part_val.stride(0),
                                  BLOCK_C=argmax_block_c(n_chunks), num_warps=4)
    return out


def sample_allowed(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    block_v: int | None = None,
    radix_bits: int = RADIX_BITS,
) -> torch.Tensor:
    """bool ``[B, V]``: the tokens :func:`sample` may draw (thresholds found by the kernels).

    Same arguments as :func:`sample`; with temperature 0 only the argmax is allowed.
    """
    temperature, top_k, top_p, block_v, radix_bits = _check_sample_args(
        logits, temperature, top_k, top_p, block_v, radix_bits)
    rows, v = logits.shape
    if temperature == 0:
        return torch.nn.functional.one_hot(argmax(logits, block_v=block_v), v).bool()
    allowed = torch.ones(rows, v, dtype=torch.bool, device=logits.device)
    use_k = top_k is not None and top_k < v
    use_p = top_p is not None and top_p < 1.0
    if rows == 0 or not (use_k or use_p):
        return allowed
    block_v = sample_block_v(v) if block_v is None else block_v
    t32 = _float32(temperature)
    ws = sample_workspace(rows, triton.cdiv(v, block_v), radix_bits, logits.device)
    scratch = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _filter(logits, t32, use_k, top_k or 0, use_p, top_p or 1.0, block_v, radix_bits, ws, scratch)
    # The mask comes from the sampler's own device code (z = x / T and the key compare), not
    # from torch: on CUDA, ``x / cpu_scalar`` is computed as x * (1/T), which is one ulp below
    # x / T for some x (~1 in 4 values at T = 1.3), and would drop a token sitting exactly
    # at a threshold.
    mask = torch.empty(rows, v, dtype=torch.int8, device=logits.device)
    sample_allowed_kernel[(triton.cdiv(v, block_v), rows)](
        logits, ws["state_i"], mask, v, logits.stride(0), ws["state_i"].stride(0), mask.stride(0), t32,
        USE_KTH=use_k, USE_PTH=use_p, BLOCK_V=block_v, num_warps=4,
    )
    return mask.bool()


# ---------------------------------------------------------------------------------------------
# Reference and planner hooks

def scale_logits_ref(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 x / temperature, IEEE-rounded on every device, as :func:`scale_logits` computes it.

    Not ``x / torch.tensor(T)``: on CUDA, torch divides by a CPU scalar as x * (1/T), which
    is one ulp off x / T for some x, so z (and with it ties, thresholds and z + noise)
    would not match the kernels bit for bit. A divisor tensor on x's device is divided by.
    """
    return x / torch.full_like(x, _float32(temperature))


def sample_allowed_ref(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
) -> torch.Tensor:
    """Plain torch allowed-token mask ``[B, V]``, by sorting (independent of the kernels' radix select).

    Probabilities are computed in float64. A token passes top-p when the mass of the
    strictly more likely tokens is below top_p; that mass is read at the first token
    of its tie group in the sorted order, so tokens tied at the boundary are all kept.
    """
    x = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).bool()
    v = x.shape[-1]
    z = scale_logits_ref(x, temperature)
    allowed = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None and top_k < v:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        allowed &= z >= kth
    if top_p is not None and top_p < 1:
        zk = torch.where(allowed, z, float("-inf")).double()
        z_sorted, order = torch.sort(zk, dim=-1, descending=True)
        p_sorted = torch.softmax(z_sorted, dim=-1)
        mass_before = torch.cat([torch.zeros_like(p_sorted[..., :1]), torch.cumsum(p_sorted, -1)[..., :-1]], -1)
        neg = (-z_sorted).contiguous()  # ascending, as searchsorted wants
        group_start = torch.searchsorted(neg, neg, side="left")
        keep_sorted = mass_before.gather(-1, group_start) < top_p
        allowed &= torch.zeros_like(allowed).scatter(-1, order, keep_sorted)
    return allowed


def sample_ref(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch sampler: :func:`sample_allowed_ref`, then argmax of logits/T + noise over it.

    ``noise`` is the Gumbel noise: ``gumbel_noise(seed, offset, B, V)`` replays
    ``sample(logits, ..., seed=seed, offset=offset)`` token for token; None means zeros.
    """
    x = logits.float()
    if temperature == 0:
        return x.argmax(dim=-1)
    allowed = sample_allowed_ref(logits, temperature, top_k, top_p)
    z = scale_logits_ref(x, temperature)
    noise = torch.zeros_like(z) if noise is None else noise.to(z.device, torch.float32)
    return torch.where(allowed, z + noise, float("-inf")).argmax(dim=-1)


def sample_cost(
    rows: int, v: int, dtype_bytes: int = 2, *, top_k: bool = False, top_p: bool = False,
    block_v: int | None = None, radix_bits: int = RADIX_BITS,
) -> TaskCost:
    """Bytes and flops of one :func:`sample` over ``rows`` rows of v logits, all passes.

    Every pass re-reads the logits (the LM head's output; L2-resident when small).
    Flops count one per elementwise op, roughly: a histogram step costs ~2 per bin
    per token, the Gumbel pass ~100 per token (10 Philox rounds, two logs).
    """
    block_v = block_v or sample_block_v(v)
    n_chunks = triton.cdiv(v, block_v)
    nbins = 1 << radix_bits
    hist_passes = sample_num_passes(radix_bits) * (int(top_k) + int(top_p))
    logits_passes = 1 + int(top_p) + hist_passes
    hist_bytes = rows * n_chunks * nbins * 4
    part_bytes = rows * n_chunks * 8
    reads = rows * v * dtype_bytes * logits_passes + hist_passes * hist_bytes + part_bytes * (1 + int(top_p))
    writes = hist_passes * (hist_bytes + rows * 32) + part_bytes * (1 + int(top_p)) + rows * 12
    flops = rows * v * (100 + 2 * nbins * hist_passes + 2 * int(top_p))
    return TaskCost(bytes_read=reads, bytes_written=writes, flops=flops)


def sample_smem_bytes(block_v: int, num_warps: int = 4, radix_bits: int = RADIX_BITS) -> int:
    """Shared memory of the sampler's tiles (the largest of them; they run one after another).

    Only reduction and layout-conversion scratch: compiled by Triton 3.9 for sm_90 the
    histogram tile takes 0-2048 bytes at 4 warps (0-4096 at 8) depending on radix_bits,
    the select tile <= 512, the Gumbel and argmax tiles 16. Bounded here by 4 float32 per
    thread; the planner checks it against the compiled kernel's metadata.
    """
    return 4 * 4 * 32 * num_warps


# ---------------------------------------------------------------------------------------
# Megakernel spec: how the op runs as a task of the persistent kernel (mk.tasks._spec)
# ---------------------------------------------------------------------------------------


@register("sample_gumbel_partial")
def sample_gumbel_partial_op(rows: int, vocab: int, *, block_v: int | None = None, num_warps: int = 4) -> OpSpec:
    """Temperature sampling, chunk ``chunk`` of row ``row``: the best ``logits / T + gumbel``.

    Operands: logits ``[rows, vocab]``, params float32 ``[1]`` (the temperature T > 0),
    seed int64 ``[1]``, offsets int32/int64 ``[rows]`` (the Philox offset of each row's draw:
    the position of the token being drawn, so every step draws afresh), part_val float32
    and part_idx int32 ``[rows, n_chunks]``. Args: row, chunk. Pair with
    :func:`mk.tasks.argmax.argmax_reduce_op` of the same sizes: together they are
    :func:`mk.tasks.sample.sample` without top-k/top-p, token for token.
    """
    s = ArgmaxShape("sample_gumbel_partial", rows, vocab, block_v)

    def run(bufs, a):
        row = s.row(a)
        chunk, c0, c1 = s.chunk(a)
        x = operand_view(s.op, "logits", bufs["logits"], rows, vocab)[row].float()
        offset = int(operand_view(s.op, "offsets", bufs["offsets"], 1, rows)[0, row])
        noise = gumbel_noise(int(bufs["seed"][0]), offset, row + 1, vocab, device=x.device)[row]
        z = (scale_logits_ref(x, float(bufs["params"][0])) + noise)[c0:c1]
        i = int(z.argmax())
        part_val, part_idx = s.parts(bufs)
        part_val[row, chunk], part_idx[row, chunk] = z[i], c0 + i

    def reads(a, bind):
        row, (_, c0, c1) = s.row(a), s.chunk(a)
        return [Region(bind["logits"], row, row + 1, c0, c1), Region(bind["params"], 0, 1, 0, 1),
                Region(bind["seed"], 0, 1, 0, 1), Region(bind["offsets"], 0, 1, row, row + 1)]

    def writes(a, bind):
        row, (chunk, _, _) = s.row(a), s.chunk(a)
        return [Region(bind[r], row, row + 1, chunk, chunk + 1) for r in ("part_val", "part_idx")]

    return OpSpec(name="sample_gumbel_partial",
                  operands=("logits", "params", "seed", "offsets", "part_val", "part_idx"), args=("row", "chunk"),
                  body="sample_gumbel_partial_tile(logits, logits, part_val, part_idx, row, chunk, V, V, 0, N_CHUNKS, "
                       "tl.load(params), tl.load(seed), tl.load(offsets + row), USE_KTH=False, USE_PTH=False, "
                       "BLOCK_V=BLOCK_V)",
                  imports=("from mk.tasks.sample import sample_gumbel_partial_tile",),
                  constexprs={"ROWS": rows, "V": vocab, "BLOCK_V": s.block_v, "N_CHUNKS": s.chunks},
                  num_warps=num_warps, run=run, reads=reads, writes=writes, tiles=lambda _: s.chunk_tiles())
