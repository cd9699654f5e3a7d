"""RMSNorm over the last dim, optionally fused with a residual add.

    h   = x + residual            (when a residual is given, else h = x)
    out = h / sqrt(mean(h**2) + eps) * weight

With a residual the updated residual ``h`` is written too, as Hugging Face Llama does
between its blocks. Statistics are computed in float32 whatever the storage dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cost import TaskCost
from ._device import jit, check_real, check_same_device, check_tensor, supported_dtypes
from ._planning import OpKind, register_kind
from ._spec import OpSpec, Region, register, rows_given

#: Widest chunk one program holds in registers; longer rows loop over chunks.
MAX_BLOCK_N = 8192


@jit
def rmsnorm_tile(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    row, N, stride_x, stride_res, stride_out, stride_res_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Normalise row ``row`` of x (N elements) into out; touches that row only.

    Two passes over the row in BLOCK_N chunks: the sum of squares, then the scaled
    output. With HAS_RESIDUAL, pass one writes h = x + res to res_out and pass two
    reads it back (the same threads wrote it, so no barrier is needed).
    """
    offs = tl.arange(0, BLOCK_N)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    out_row = out_ptr + row * stride_out
    res_out_row = res_out_ptr + row * stride_res_out

    sum_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        mask = cols < N
        h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            h_stored = h.to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_row + cols, h_stored, mask=mask)
            # Statistics of the rounded h, exactly as a separate add then norm would see
            # it. Rounded in registers: reading the store back is unsafe, the loop
            # pipeliner may hoist that load above the store.
            h = h_stored.to(tl.float32)
        sum_sq += h * h
    rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / N + eps)
    if HAS_RESIDUAL:
        tl.debug_barrier()  # pass two reads h that other threads of this block stored

    for start in range(0, N, BLOCK_N):
        cols = start + offs
        mask = cols < N
        if HAS_RESIDUAL:
            h = tl.load(res_out_row + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@jit
def rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    N, stride_x, stride_res, stride_out, stride_res_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rmsnorm_tile(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, tl.program_id(0), N,
                 stride_x, stride_res, stride_out, stride_res_out, eps,
                 HAS_RESIDUAL=HAS_RESIDUAL, BLOCK_N=BLOCK_N)


def rmsnorm_block_n(n: int) -> int:
    """Chunk width for a row of n elements: the whole row when it fits."""
    return min(triton.next_power_of_2(n), MAX_BLOCK_N)


def rmsnorm_num_warps(block_n: int) -> int:
    return 4 if block_n <= 1024 else (8 if block_n <= 4096 else 16)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None, *,
    out_dtype: torch.dtype | None = None, validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` over its last dim.

    Args:
        x: ``[..., N]``, rows may be strided but the last dim must be contiguous.
        weight: ``[N]``.
        eps: added to the mean square, a finite number >= 0.
        residual: optional ``[..., N]`` added to x first (the sum is float32, then rounded
            to residual's dtype: a float32 residual stream may take a bf16 update).
        out_dtype: dtype of the normalised output (default x's): a float32 residual
            stream normalised straight into a bf16 matmul operand.
        validate: False skips the argument checks (their host time is a launch's), for a
            caller that built the arguments (mk's prefill); bad arguments are then undefined.

    Returns:
        ``out`` (x's shape, ``out_dtype``), or ``(out, x + residual)`` with a residual, the
        sum in residual's dtype.
    """
    if validate:
        check_tensor("x", x, ndim=range(1, 9), contiguous=False, last_dim_contiguous=True)
        check_tensor("weight", weight, shape=(x.shape[-1],))
        check_same_device(x=x, weight=weight)
        check_real("eps", eps)
        if residual is not None:
            check_tensor("residual", residual, shape=tuple(x.shape), contiguous=False, last_dim_contiguous=True)
            check_same_device(x=x, residual=residual)
        if out_dtype is not None and out_dtype not in supported_dtypes(x):
            raise TypeError(f"out_dtype must be one of {list(supported_dtypes(x))}, got {out_dtype!r}")
    n = x.shape[-1]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    res2 = residual.reshape(-1, n) if residual is not None else x2
    res_out = torch.empty(x2.shape, dtype=residual.dtype, device=x.device) if residual is not None else out
    rows = x2.shape[0]
    if rows and n:
        block_n = rmsnorm_block_n(n)
        rmsnorm_kernel[(rows,)](
            x2, res2, weight, out, res_out, n,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=rmsnorm_num_warps(block_n),
        )
    out = out.reshape(x.shape)
    return (out, res_out.reshape(x.shape)) if residual is not None else out


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain torch RMSNorm in float32 (the reference the kernels are tested against)."""
    h = x.float() if residual is None else x.float() + residual.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out if residual is None else (out, h)


def rmsnorm_cost(rows: int, n: int, dtype_bytes: int = 2, residual: bool = False) -> TaskCost:
    """Bytes and flops of one rmsnorm over ``rows`` rows of n elements."""
    reads = rows * n * dtype_bytes * (2 if residual else 1) + n * dtype_bytes
    writes = rows * n * dtype_bytes * (2 if residual else 1)
    return TaskCost(reads, writes, flops=rows * n * (5 if residual else 4))


def rmsnorm_smem_bytes(block_n: int, num_warps: int) -> int:
    """Shared memory the tile needs: one float32 per warp for the cross-warp sum."""
    return 4 * num_warps


# ---------------------------------------------------------------------------------------
# Megakernel spec: how the op runs as a task of the persistent kernel (mk.tasks._spec)
# ---------------------------------------------------------------------------------------


@register("rmsnorm")
def rmsnorm_op(n: int, eps: float = 1e-6, residual: bool = False) -> OpSpec:
    """One row of RMSNorm (optionally h = x + res first, written to res_out). Args: row."""
    block_n = rmsnorm_block_n(n)
    operands = ("x", "res", "w", "out", "res_out") if residual else ("x", "w", "out")
    res, res_out = ("res", "res_out") if residual else ("x", "out")
    body = (f"rmsnorm_tile(x, {res}, w, out, {res_out}, row, N, N, N, N, N, EPS, "
            f"HAS_RESIDUAL={residual}, BLOCK_N=BLOCK_N)")

    def run(b, a):
        row = a["row"]
        if residual:
            out, h = rmsnorm_ref(b["x"][row], b["w"], eps, residual=b["res"][row])
            b["res_out"][row] = h.to(b["res_out"].dtype)
        else:
            out = rmsnorm_ref(b["x"][row], b["w"], eps)
        b["out"][row] = out.to(b["out"].dtype)

    def reads(a, bind):
        row = a["row"]
        regs = [Region(bind["x"], row, row + 1, 0, n), Region(bind["w"], 0, 1, 0, n)]
        if residual:
            regs.append(Region(bind["res"], row, row + 1, 0, n))
        return regs

    def writes(a, bind):
        row = a["row"]
        regs = [Region(bind["out"], row, row + 1, 0, n)]
        if residual:
            regs.append(Region(bind["res_out"], row, row + 1, 0, n))
        return regs

    return OpSpec(name="rmsnorm", operands=operands, args=("row",), body=body,
                  imports=("from mk.tasks.rmsnorm import rmsnorm_tile",),
                  constexprs={"N": n, "BLOCK_N": block_n, "RES": int(residual), "EPS": float(eps)},
                  num_warps=rmsnorm_num_warps(block_n), run=run, reads=reads, writes=writes,
                  tiles=lambda rows: [{"row": r} for r in range(rows_given("rmsnorm", rows))])


# ---------------------------------------------------------------------------------------
# Planning: how the planner plans an RMSNorm of a decode step (mk.tasks._planning)
# ---------------------------------------------------------------------------------------


class RMSNormKind(OpKind):
    """An RMSNorm of a decode step: one task a row, or folded into the next linear's
    prologue (its tiles normalise the x rows they read)."""

    kind = "rmsnorm"
    hosts = frozenset({"linear"})
    prologue = True

    def specs(self, node, choice, fused=()):
        return [(rmsnorm_op(node.dims["n"]), node.dims["rows"])]

    def buffer_shape(self, node, role, max_seq):
        if role == "w":
            return (node.dims["n"],), "weight"
        return super().buffer_shape(node, role, max_seq)

    def lower(self, node, choice, ctx) -> None:
        n = node.dims["n"]
        ctx.add(node.name, rmsnorm_op(n, eps=ctx.eps), ctx.batch, x=node.inputs[0], w=node.buffers["w"],
                out=ctx.activation(node.outputs[0], ctx.batch, n))


RMSNORM = register_kind(RMSNormKind())
