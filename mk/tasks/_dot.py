"""Matrix products shared by the task bodies, and how a weight's format (:mod:`mk.tasks.linear.format`)
enters them: :func:`scaled_chunk` and :func:`finish_channels`."""

import triton.language as tl

from ._device import jit


#: An FP8 (e4m3) weight chunk in a GEMV tile (one activation row) widens to float32 element by
#: element: its products with x are exact in float32, and the conversion (e4m3 to f16 to f32)
#: measured faster than either tensor-core detour tried (docs/PERFORMANCE.md, "FP8 weights").
#: Tensor-core tiles widen e4m3 to float16 exactly (one instruction a pair) against x's float16
#: hi and lo halves, x times 2**-8 so that none below 1.7e7 overflows; their products are then
#: the true ones times 2**-8, which the tile's finish (:func:`finish_channels`) undoes.
E4M3_DOT_X, E4M3_DOT_FOLD = tl.constexpr(2.0**-8), tl.constexpr(2.0**8)


@jit
def mma(a, b, acc):
    """``acc + a @ b`` in float32, rounding neither operand below its storage precision.

    * Same 16-bit dtype: the tensor cores as they are.
    * Both float32: IEEE float32 (tf32 tensor cores would round them to ~1e-3).
    * A float32 ``a`` (an activation: mk keeps them float32) against a 16-bit ``b`` (a
      weight, the KV cache): ``a`` is split into ``hi = a`` rounded to b's dtype and
      ``lo = a - hi`` rounded again, and both go through the tensor cores. ``hi + lo``
      holds ~16 of a's 24 mantissa bits, where ``hi`` alone holds 8: rounding only ``a``
      put a random-weight Llama-3-8B's logits ~1% further off float32
      (measured against float32 on an H200). Twice the MMAs; decode is bound by memory.
    * A 16-bit ``a`` against a float32 ``b``: ``a`` widens, IEEE float32.
    * An FP8 ``b`` (a weight stored in e4m3) widens to float16, exactly, and a float32 ``a``
      goes as float16 halves times 2**-8 (:data:`E4M3_DOT_X`: the product is the true one
      times 2**-8, which the tile's finish undoes).
    """
    if b.dtype == tl.float8e4nv:
        b = b.to(tl.float16)
        a = a.to(tl.float32) * E4M3_DOT_X
    if a.dtype == b.dtype:
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)
    elif a.dtype == tl.float32:
        hi = a.to(b.dtype)
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        return tl.dot(lo, b, tl.dot(hi, b, acc))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@jit
def mma_weight_major(w, x, acc_t):
    """``acc_t + w @ [hi; lo].T``, the weight chunk as the MMA's left operand: a decode tile's
    few activation rows ``x`` ([R, K]) are the MMA's narrow side (its N) and the weight rows
    its tall side, so on Hopper a [64, K] weight chunk feeds wgmma straight from the TMA
    ring's shared memory, where ``x @ w.T`` makes R the M of mma.sync (at least 16) and
    loads the weights into registers first.

    ``hi`` is x rounded to w's dtype and ``lo`` the remainder, as :func:`mma` splits a
    float32 ``a``, but both in one MMA as the 2R columns of ``acc_t`` ([N, 2R]);
    :func:`fold_weight_major` adds them into the [R, N] tile. A float32 ``w`` multiplies
    IEEE float32 (lo is then 0). An FP8 ``w`` (e4m3) widens to float16, exactly, against
    float16 halves of x times 2**-8 (as :func:`mma`).
    """
    if w.dtype == tl.float8e4nv:
        w = w.to(tl.float16)
        x = x.to(tl.float32) * E4M3_DOT_X
    if w.dtype == tl.float32:
        hi = x.to(tl.float32)
        lo = tl.zeros_like(hi)
    else:
        hi = x.to(w.dtype)
        lo = (x.to(tl.float32) - hi.to(tl.float32)).to(w.dtype)
    R: tl.constexpr = x.shape[0]
    K: tl.constexpr = x.shape[1]
    both = tl.reshape(tl.permute(tl.join(hi, lo), (2, 0, 1)), (2 * R, K))
    if w.dtype == tl.float32:
        return tl.dot(w, tl.trans(both), acc_t, input_precision="ieee")
    return tl.dot(w, tl.trans(both), acc_t)


@jit
def fold_weight_major(acc_t):
    """The [R, N] product tile from :func:`mma_weight_major`'s [N, 2R] accumulator: hi + lo."""
    N: tl.constexpr = acc_t.shape[0]
    R: tl.constexpr = acc_t.shape[1] // 2
    return tl.trans(tl.sum(tl.reshape(acc_t, (N, 2, R)), axis=1))


@jit
def scaled_chunk(acc, w, x, w_scale_ptr, offs_n, k, N, K, W_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                 WEIGHT_MAJOR: tl.constexpr):
    """``acc`` plus one K chunk's products of a linear tile: the weight chunk ``w``
    ``[BLOCK_N, BLOCK_K]`` (rows ``offs_n``, columns from ``k``) against ``x`` (``[BLOCK_K]``
    float32 for the GEMV body, whose ``acc`` holds the element-wise products ``[BLOCK_N,
    BLOCK_K]``; ``[BLOCK_M, BLOCK_K]`` for the tl.dot body, ``acc`` ``[BLOCK_N, 2 BLOCK_M]``
    weight-major or ``[BLOCK_M, BLOCK_N]``). With ``W_SCALE`` 2 (a weight scaled per row and
    128 columns, :mod:`mk.tasks.linear.format`; the chunk within one 128-column block) each
    row's products are scaled by ``w_scale[row, k // 128]``."""
    if W_SCALE == 2:
        s = tl.load(w_scale_ptr + tl.minimum(offs_n, N - 1) * tl.cdiv(K, 128) + k // 128)
        if BLOCK_M == 1:
            return acc + (w.to(tl.float32) * s[:, None]) * x[None, :]
        elif WEIGHT_MAJOR:
            return acc + mma_weight_major(w, x, tl.zeros(acc.shape, dtype=tl.float32)) * s[:, None]
        else:
            return acc + mma(x, tl.trans(w), tl.zeros(acc.shape, dtype=tl.float32)) * s[None, :]
    else:
        if BLOCK_M == 1:
            return acc + w.to(tl.float32) * x[None, :]
        elif WEIGHT_MAJOR:
            return mma_weight_major(w, x, acc)
        else:
            return mma(x, tl.trans(w), acc)


@jit
def finish_channels(y, w_scale_ptr, offs_n, N, W_SCALE: tl.constexpr, w_ptr=None, BLOCK_M: tl.constexpr = 1):
    """A tile's float32 product ``y`` ``[rows, BLOCK_N]`` (weight rows ``offs_n`` of ``w_ptr``)
    finished by its format: with ``W_SCALE`` 1 each column times its row's scale
    ``w_scale[n]``; a tensor-core tile's (``BLOCK_M`` > 1) products of e4m3 weights times the
    factor their widening left out (:data:`E4M3_DOT_FOLD`)."""
    if W_SCALE == 1:
        y = y * tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if w_ptr is not None:
        if (w_ptr.dtype.element_ty == tl.float8e4nv) & (BLOCK_M > 1):
            y = y * E4M3_DOT_FOLD
    return y
