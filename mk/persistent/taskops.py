"""OpSpecs of mk's tasks: how each runs inside the megakernel, and on the VM.

Each factory fixes a task's static parameters (constexpr tile sizes, flags, eps) and
returns an :class:`~mk.persistent.ops.OpSpec`. Buffers are addressed as 2-D row-major
``[rows, cols]`` views (a 1-D buffer is one row), which is also how regions are given.
"""

from __future__ import annotations

from mk.tasks.rmsnorm import rmsnorm_block_n, rmsnorm_num_warps, rmsnorm_ref

from .ops import OpSpec, Region, register


@register("rmsnorm")
def rmsnorm_op(n: int, eps: float = 1e-6, residual: bool = False) -> OpSpec:
    """One row of RMSNorm (optionally h = x + res first, written to res_out). Args: row."""
    block_n = rmsnorm_block_n(n)
    operands = ("x", "res", "w", "out", "res_out") if residual else ("x", "w", "out")
    res, res_out = ("res", "res_out") if residual else ("x", "out")
    body = (f"rmsnorm_tile(x, {res}, w, out, {res_out}, row, N, N, N, N, N, {float(eps)!r}, "
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
                  constexprs={"N": n, "BLOCK_N": block_n, "RES": int(residual)},
                  num_warps=rmsnorm_num_warps(block_n), run=run, reads=reads, writes=writes)
