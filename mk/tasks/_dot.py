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
