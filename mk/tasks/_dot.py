"""Matrix products shared by the task bodies."""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc):
    """``acc + a @ b`` in float32. float32 operands stay IEEE float32 (tf32 tensor cores
    would round them to ~1e-3); bf16/fp16 operands use the tensor cores as they are."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
