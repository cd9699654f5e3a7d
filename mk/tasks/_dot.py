"""Matrix products shared by the task bodies."""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc):
    """``acc + a @ b`` in float32, rounding neither operand below its storage precision.

    * Same 16-bit dtype: the tensor cores as they are.
    * Both float32: IEEE float32 (tf32 tensor cores would round them to ~1e-3).
    * A float32 ``a`` (an activation: mk keeps them float32) against a 16-bit ``b`` (a
      weight, the KV cache): ``a`` is split into ``hi = a`` rounded to b's dtype and
      ``lo = a - hi`` rounded again, and both go through the tensor cores. ``hi + lo``
      holds ~16 of a's 24 mantissa bits, where ``hi`` alone holds 8: rounding only ``a``
      put a random-weight Llama-3-8B's logits ~1% further off float32
      (bench/probes/precision_probe.py). Twice the MMAs; decode is bound by memory.
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


@triton.jit
def mma_weight_major(w, x2, acc_t):
    """``acc_t + w @ x2.T`` with the weight chunk as the MMA's left operand: a decode tile's
    few activation rows are the MMA's narrow side (its N, 8 or 16 wide) and the weight rows
    its tall side, so on Hopper a [64, K] weight chunk feeds wgmma straight from the TMA
    ring's shared memory, where [rows, K] @ w.T makes rows the M of mma.sync and loads the
    weights into registers first.

    ``x2`` holds each activation row twice (rows r and R + r of its 2R rows alike): the
    first copy goes in rounded to w's dtype (hi), the second as the remainder (lo), as
    :func:`mma` splits a float32 ``a``, but in one MMA. :func:`fold_weight_major` adds the
    two halves of the [N, 2R] product into the [R, N] tile. A float32 ``w`` multiplies
    IEEE float32 (lo is then 0).
    """
    R2: tl.constexpr = x2.shape[0]
    is_lo = (tl.arange(0, R2) >= R2 // 2)[:, None]
    if w.dtype == tl.float32:
        return tl.dot(w, tl.trans(tl.where(is_lo, 0.0, x2.to(tl.float32))), acc_t, input_precision="ieee")
    hi = x2.to(w.dtype)
    lo = (x2.to(tl.float32) - hi.to(tl.float32)).to(w.dtype)
    return tl.dot(w, tl.trans(tl.where(is_lo, lo, hi)), acc_t)


@triton.jit
def fold_weight_major(acc_t):
    """The [R, N] product tile from :func:`mma_weight_major`'s [N, 2R] accumulator: hi + lo."""
    N: tl.constexpr = acc_t.shape[0]
    R: tl.constexpr = acc_t.shape[1] // 2
    return tl.trans(tl.sum(tl.reshape(acc_t, (N, 2, R)), axis=1))
