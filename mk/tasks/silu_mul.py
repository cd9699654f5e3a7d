"""SiLU-gated product, the activation of a Llama MLP:

    out = silu(gate) * up = gate * sigmoid(gate) * up

elementwise over ``[..., I]``. Computed in float32 and rounded once to the storage dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cost import TaskCost
from ._device import jit, check_same_device, check_same_dtype, check_tensor
from ._planning import FusedOnlyKind, register_kind
from ._spec import (OpSpec, Region, as_2d, block_cols, cdiv, check_pow2, check_sizes, register,
                    rows_given)

#: Widest column block of one tile; wider rows are split over several tiles.
MAX_BLOCK_I = 1024

#: Flops per element: negate, exp, add, divide (the sigmoid), two multiplies.
FLOPS_PER_ELEMENT = 6


@jit
def silu_mul_tile(
    gate_ptr, up_ptr, out_ptr,
    row, col_block, I,
    stride_gate, stride_up, stride_out,
    BLOCK_I: tl.constexpr, COL_STRIDE: tl.constexpr = 1, PAIRS: tl.constexpr = False,
):
    """out[row, cols] = silu(gate[row, cols]) * up[row, cols] for cols in block ``col_block``.

    ``row`` and ``col_block`` are int32 scalars; gate and up have stride ``COL_STRIDE``
    along I (2: the even and odd columns of one interleaved gate/up projection) and row
    stride ``stride_*`` (or two halves of one fused projection); out has unit stride.
    PAIRS: up is gate's next element (interleaved pairs), read as one contiguous load.
    """
    cols = col_block * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    row64 = tl.cast(row, tl.int64)  # rows * I can pass 2**31 elements for long prompts
    if PAIRS:  # up = gate + 1, both stride 2: one contiguous load of the pairs, split in registers
        both = col_block * 2 * BLOCK_I + tl.arange(0, 2 * BLOCK_I)
        gu = tl.load(gate_ptr + row64 * stride_gate + both, mask=both < 2 * I, other=0.0).to(tl.float32)
        g, u = tl.split(tl.reshape(gu, (BLOCK_I, 2)))
    else:
        g = tl.load(gate_ptr + row64 * stride_gate + cols * COL_STRIDE, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row64 * stride_up + cols * COL_STRIDE, mask=mask, other=0.0).to(tl.float32)
    # g / (1 + exp(-g)) is -0 for g -> -inf and g for g -> +inf: no NaN at either end.
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row64 * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, I,
    stride_gate, stride_up, stride_out,
    BLOCK_I: tl.constexpr, COL_STRIDE: tl.constexpr, PAIRS: tl.constexpr,
):
    silu_mul_tile(gate_ptr, up_ptr, out_ptr, tl.program_id(0), tl.program_id(1), I,
                  stride_gate, stride_up, stride_out, BLOCK_I=BLOCK_I, COL_STRIDE=COL_STRIDE, PAIRS=PAIRS)


def silu_mul_block_i(i: int) -> int:
    """Column block for rows of i elements: the whole row when it fits in MAX_BLOCK_I."""
    return min(triton.next_power_of_2(max(i, 1)), MAX_BLOCK_I)


def silu_mul_num_warps(block_i: int) -> int:
    # 4-8 contiguous elements per thread: wide enough for vector loads, no more.
    return max(1, min(8, block_i // 256))


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """``silu(gate) * up`` elementwise.

    Args:
        gate: ``[..., I]``, unit stride in the last dim (rows may be strided), or stride 2
            for the even columns of an interleaved gate/up projection (``gu[..., 0::2]``).
        up: same shape, dtype and last-dim stride as gate (``gu[..., 1::2]``).
        validate: False skips the argument checks, for a caller that built the arguments
            (mk's prefill); bad arguments are then undefined.

    Returns:
        A new contiguous tensor shaped and typed like gate.
    """
    if validate:
        check_tensor("gate", gate, ndim=range(1, 9), contiguous=False)
        check_tensor("up", up, shape=tuple(gate.shape), contiguous=False)
        check_same_dtype(gate=gate, up=up)
        check_same_device(gate=gate, up=up)
        if gate.shape[-1] > 1 and (gate.stride(-1) not in (1, 2) or up.stride(-1) != gate.stride(-1)):
            raise ValueError(f"gate and up need one last-dim stride, 1 or 2 (interleaved pairs), got "
                             f"{gate.stride(-1)} and {up.stride(-1)}")
    n = gate.shape[-1]
    # reshape keeps a view where it can (it may copy strided leading dims: then stride 1).
    gate2, up2 = gate.reshape(-1, n), up.reshape(-1, n)
    col_stride = gate2.stride(-1) if n > 1 else 1
    if n > 1 and up2.stride(-1) != col_stride:  # one of the two was copied: both contiguous
        gate2, up2, col_stride = gate2.contiguous(), up2.contiguous(), 1
    out = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
    rows = gate2.shape[0]
    if rows and n:
        block_i = silu_mul_block_i(n)
        silu_mul_kernel[(rows, triton.cdiv(n, block_i))](
            gate2, up2, out, n, gate2.stride(0), up2.stride(0), out.stride(0),
            BLOCK_I=block_i, COL_STRIDE=col_stride,
            PAIRS=col_stride == 2 and up2.data_ptr() == gate2.data_ptr() + gate2.element_size()
            and up2.stride(0) == gate2.stride(0),
            num_warps=silu_mul_num_warps(block_i),
        )
    return out.reshape(gate.shape)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch reference in float32."""
    return torch.nn.functional.silu(gate.float()) * up.float()


def silu_mul_cost(rows: int, i: int, dtype_bytes: int = 2) -> TaskCost:
    """Bytes and flops of silu_mul over ``rows`` rows of i elements."""
    elems = rows * i
    return TaskCost(bytes_read=2 * elems * dtype_bytes, bytes_written=elems * dtype_bytes,
                    flops=FLOPS_PER_ELEMENT * elems)


# ---------------------------------------------------------------------------------------
# Megakernel spec: how the op runs as a task of the persistent kernel (mk.tasks._spec)
# ---------------------------------------------------------------------------------------


@register("silu_mul")
def silu_mul_op(i: int, *, block_i: int | None = None, num_warps: int | None = None) -> OpSpec:
    """One (row, column block) tile of ``out = silu(gate) * up`` over rows of ``i`` elements.

    Operands: gate, up, out, each ``[rows, i]``. Args: row, col_block (``cdiv(i, BLOCK_I)``
    blocks per row; the last one is clipped to i).
    """
    check_sizes("silu_mul", i=i)
    block_i = check_pow2("silu_mul", "block_i", block_i or silu_mul_block_i(i))
    blocks = cdiv(i, block_i)

    def cols(a):
        return block_cols("silu_mul", a, blocks, block_i, i)

    def run(b, a):
        row, (c0, c1) = a["row"], cols(a)
        y = silu_mul_ref(as_2d(b["gate"])[row, c0:c1], as_2d(b["up"])[row, c0:c1])
        out = as_2d(b["out"])
        out[row, c0:c1] = y.to(out.dtype)

    def reads(a, bind):
        c0, c1 = cols(a)
        return [Region(bind[r], a["row"], a["row"] + 1, c0, c1) for r in ("gate", "up")]

    def writes(a, bind):
        c0, c1 = cols(a)
        return [Region(bind["out"], a["row"], a["row"] + 1, c0, c1)]

    return OpSpec(name="silu_mul", operands=("gate", "up", "out"), args=("row", "col_block"),
                  body="silu_mul_tile(gate, up, out, row, col_block, I, I, I, I, BLOCK_I=BLOCK_I)",
                  imports=("from mk.tasks.silu_mul import silu_mul_tile",),
                  constexprs={"I": i, "BLOCK_I": block_i},
                  num_warps=num_warps or silu_mul_num_warps(block_i), run=run, reads=reads, writes=writes,
                  tiles=lambda rows: [{"row": r, "col_block": cb} for r in range(rows_given("silu_mul", rows))
                                      for cb in range(blocks)])


# ---------------------------------------------------------------------------------------
# Planning: how the planner plans a SiLU·mul of a decode step (mk.tasks._planning)
# ---------------------------------------------------------------------------------------


class SiluMulKind(FusedOnlyKind):
    """A decode step's SiLU·mul: only in the gate/up linear's epilogue (its weights are
    interleaved gate/up pairs, which only that epilogue reads)."""

    kind = "silu_mul"
    hosts = frozenset({"linear"})

    def fused_bytes(self, node) -> int:
        """The host writes the I-wide product instead of the 2I-wide gate/up (writes - reads)."""
        return node.bytes_written - node.bytes_read


SILU_MUL = register_kind(SiluMulKind())
