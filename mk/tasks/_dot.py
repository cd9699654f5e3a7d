"""Matrix products shared by the task bodies."""

import triton.language as tl

from ._device import jit


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
    """
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
    IEEE float32 (lo is then 0).
    """
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
