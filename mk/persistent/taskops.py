"""OpSpecs of mk's tasks: how each runs inside the megakernel, and on the VM.

Each factory fixes a task's static parameters (constexpr tile sizes, flags, eps) and
returns an :class:`~mk.persistent.ops.OpSpec`. Buffers are addressed as 2-D row-major
``[rows, cols]`` views (a 1-D buffer is one row), which is also how regions are given.

Every static parameter that changes the generated code is a constexpr (eps included):
the constexprs are the op's key, and tasks with one key share one generated branch.
"""

from __future__ import annotations

import torch

from mk.tasks._device import INTERPRET, default_dtype

# The launcher's private config check and row-tile rule, reused so that a megakernel
# tile is exactly the tile the standalone op would launch.
from mk.tasks.linear import (
    LinearConfig,
    _check_config,
    _tile_rows,
    linear_config,
    linear_k_splits,
    prefetch_lines,
)
from mk.tasks.rmsnorm import rmsnorm_block_n, rmsnorm_num_warps, rmsnorm_ref
from mk.tasks.silu_mul import silu_mul_block_i, silu_mul_num_warps, silu_mul_ref

from .ops import OpSpec, Region, register

#: Prefetch weights with one TMA bulk prefetch per row (when rows are 16-byte aligned)
#: rather than one prefetch.global.L2 per 128-byte line.
PREFETCH_BULK = True


def _2d(t: torch.Tensor) -> torch.Tensor:
    """The 2-D row-major view regions refer to (a view, so the VM writes in place)."""
    return t.view(1, -1) if t.dim() < 2 else t.view(-1, t.shape[-1])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_tile(op: str, name: str, value: int, count: int) -> None:
    # reads()/writes() run when the graph derives dependencies, so a bad tile index is
    # reported there, naming it, instead of as a silent empty region.
    if not 0 <= value < count:
        raise ValueError(f"{op}: {name}={value} out of range [0, {count})")


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
                  num_warps=rmsnorm_num_warps(block_n), run=run, reads=reads, writes=writes)


# ---------------------------------------------------------------------------------------
# linear: y = x @ W.T (+ RMSNorm prologue, residual or SiLU·mul epilogue), one tile a task
# ---------------------------------------------------------------------------------------


class _LinearShape:
    """Tile geometry shared by the linear ops, resolved once as the launcher would.

    Buffers: x ``[M, K]``, w ``[N, K]`` (gate/up interleaved with silu_mul), norm_w ``[K]``,
    res and out ``[M, n_out]`` (n_out = N/2 with silu_mul), ws ``[split_k, M, N]``
    float32 (2-D view ``[split_k*M, N]``).
    """

    def __init__(self, op, M, N, K, split_k, block_m, block_n, block_k, num_warps, residual, silu_mul,
                 prefetch_k, dtype):
        for name, v in (("M", M), ("N", N), ("K", K), ("split_k", split_k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{op}: {name} must be an int >= 1, got {v!r}")
        if silu_mul and N % 2:
            raise ValueError(f"{op}: silu_mul needs an even N (gate/up pairs), got N={N}")
        if silu_mul and residual:
            raise ValueError(f"{op}: residual and silu_mul cannot be combined (as in mk.tasks.linear)")
        dtype = dtype or default_dtype()
        base = linear_config(M, N, K, dtype, split_k=split_k)
        cfg = LinearConfig(block_m or base.block_m, block_n or base.block_n, block_k or base.block_k,
                           split_k=split_k, num_warps=num_warps or base.num_warps,
                           num_stages=base.num_stages, prefetch_k=prefetch_k)
        _check_config(cfg, K, silu_mul)  # the launcher's own checks, same messages
        self.config = cfg
        self.M, self.N, self.K, self.split_k = M, N, K, split_k
        # Rows per tile as the launcher runs them (tl.dot tiles cut down to what M needs).
        self.bm, self.bn, self.bk = _tile_rows(cfg, M), cfg.block_n, cfg.block_k
        self.n_out = N // 2 if silu_mul else N
        self.silu_mul = silu_mul
        self.tiles_m, self.tiles_n = _cdiv(M, self.bm), _cdiv(N, self.bn)
        self.k_splits = linear_k_splits(K, self.bk, split_k)
        # The interpreter has no inline PTX: no prefetch there, whatever was asked.
        lines, line = prefetch_lines(cfg, K, torch.empty((), dtype=dtype).element_size())
        self.prefetch_lines, self.line = (0 if INTERPRET else lines), line
        # TMA bulk prefetch of whole row segments when rows (and so split starts) are 16-byte
        # aligned; TaskGraph.buffer refuses buffers that are not.
        eb = torch.empty((), dtype=dtype).element_size()
        self.bulk = int(PREFETCH_BULK and (K * eb) % 16 == 0 and (self.bk * eb) % 16 == 0)
        self.op = op

    def constexprs(self) -> dict:
        return {"M": self.M, "N": self.N, "K": self.K, "N_OUT": self.n_out, "BLOCK_M": self.bm,
                "BLOCK_N": self.bn, "BLOCK_K": self.bk, "PREFETCH_LINES": self.prefetch_lines, "LINE": self.line,
                "PREFETCH_BULK": self.bulk}

    def tile(self, a) -> tuple[int, int, int, int, int, int]:
        """(r0, r1, n0, n1, c0, c1): x/out rows, weight rows and out columns of tile (pid_m, pid_n),
        clipped to the buffers (edge tiles are partial)."""
        pm, pn = a["pid_m"], a["pid_n"]
        _check_tile(self.op, "pid_m", pm, self.tiles_m)
        _check_tile(self.op, "pid_n", pn, self.tiles_n)
        r0, n0 = pm * self.bm, pn * self.bn
        r1, n1 = min(r0 + self.bm, self.M), min(n0 + self.bn, self.N)
        # With silu_mul a tile's adjacent (gate, up) weight rows make one output column.
        c0, c1 = (n0 // 2, n1 // 2) if self.silu_mul else (n0, n1)
        return r0, r1, n0, n1, c0, c1

    def store(self, b, a, acc: torch.Tensor, residual: bool) -> None:
        """VM: the epilogue (residual or silu_mul) of a float32 tile, stored into out."""
        r0, r1, _, _, c0, c1 = self.tile(a)
        y = _epilogue_ref(acc, _2d(b["res"])[r0:r1, c0:c1] if residual else None, self.silu_mul)
        out = _2d(b["out"])
        out[r0:r1, c0:c1] = y.to(out.dtype)

    def out_regions(self, a, bind) -> list:
        r0, r1, _, _, c0, c1 = self.tile(a)
        return [Region(bind["out"], r0, r1, c0, c1)]

    def ws_rows(self, split: int, r0: int, r1: int) -> tuple[int, int]:
        """Rows of the 2-D workspace view holding split ``split`` of x rows [r0, r1)."""
        return split * self.M + r0, split * self.M + r1


def _epilogue_ref(acc: torch.Tensor, res: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """The linear epilogue in float32 torch (VM semantics of the split-K reduce)."""
    if silu_mul:
        acc = torch.nn.functional.silu(acc[:, 0::2]) * acc[:, 1::2]
    return acc if res is None else acc + res.float()


def _prologue_ref(x: torch.Tensor, norm_w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x rows in float32, RMSNorm-ed over their full length when norm_w is given."""
    h = x.float()
    if norm_w is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w.reshape(-1).float()
    return h


@register("linear")
def linear_op(M: int, N: int, K: int, *, block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None, num_warps: int | None = None, residual: bool = False,
              norm: bool = False, eps: float = 1e-6, silu_mul: bool = False, prefetch_k: int = 0,
              double_buffer: bool = True, prefetch_ahead: int = 0, preload_weights: bool | None = None,
              fold: int = 1, tma_stages: int = 0, dtype: torch.dtype | None = None) -> OpSpec:
    """One output tile (pid_m, pid_n) of ``y = x @ W.T`` over all of K, epilogue included.

    Operands: x ``[M, K]``, w ``[N, K]``, norm_w ``[K]`` (with norm: RMSNorm prologue, eps),
    res ``[M, N]`` (with residual), out ``[M, N]`` (``[M, N/2]`` with silu_mul, w then from
    :func:`mk.tasks.linear.interleave_gate_up`). Args: pid_m, pid_n. Block sizes default to
    :func:`mk.tasks.linear.linear_config` for ``dtype`` (mk's default dtype when None).
    ``double_buffer``: the GEMV body requests each weight chunk one iteration ahead (a
    persistent worker needs the extra bytes in flight), and asks L2 for the chunk
    ``prefetch_ahead`` iterations ahead; ``preload_weights`` loads the first chunk into
    registers before the dependency wait (None: when K is at most two chunks); ``fold``
    narrows the accumulator that many times; ``tma_stages`` > 0 streams the weights through a
    shared-memory ring of that many TMA loads instead (GEMV body; aligned rows, chunks of at
    most 256 elements). ``prefetch_k``
    weight columns are
    pulled into L2 before the dependency wait (never
    under the interpreter).
    """
    s = _LinearShape("linear", M, N, K, 1, block_m, block_n, block_k, num_warps, residual, silu_mul,
                     prefetch_k, dtype)
    # The GEMV body's first weight chunk goes to registers before the wait (with double
    # buffering). By default only for tiles of at most two chunks: on an H200 it takes a
    # 64x2048^2 chain from 7.8 to 4.3 us a layer, but slows 16-chunk tiles (8192 columns)
    # by a third, whose loop then converts the chunk's layout every iteration.
    if preload_weights is None:
        preload_weights = K <= 2 * s.bk
    # TMA streaming needs 16-byte aligned rows and boxes of at most 256 elements a side.
    eb = torch.empty((), dtype=dtype or default_dtype()).element_size()
    tma = int(tma_stages) if (s.bm == 1 and tma_stages and (K * eb) % 16 == 0 and s.bn <= 256
                              and s.bk <= 256 and (s.bk * eb) % 16 == 0) else 0
    if tma:
        double_buffer, preload_weights, fold = False, False, 1
    preload = bool(preload_weights and double_buffer and s.bm == 1)
    operands = ("x", "w") + (("norm_w",) if norm else ()) + (("res",) if residual else ()) + ("out",)
    # Unused pointer operands get a harmless real pointer, as the launcher does.
    norm_w, res = ("norm_w" if norm else "w"), ("res" if residual else "out")
    eps_src = "EPS" if norm else "0.0"
    body = (f"linear_tile(x, w, {norm_w}, {res}, out, pid_m, pid_n, M, N, K, 0, K, K, K, N_OUT, N_OUT, {eps_src}, "
            f"HAS_NORM=HAS_NORM, HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, "
            f"BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOUBLE_BUFFER=DOUBLE_BUFFER, PREFETCH_AHEAD=PREFETCH_AHEAD, "
            f"FOLD=FOLD, TMA_STAGES=TMA_STAGES{', w_first=w_first' if preload else ''})")
    prefetch = ("linear_prefetch_tile(w, pid_n, N, 0, K, K, PREFETCH_LINES=PREFETCH_LINES, LINE=LINE, "
                "BLOCK_N=BLOCK_N, BULK=PREFETCH_BULK)")
    constexprs = {**s.constexprs(), "HAS_NORM": int(norm), "HAS_RESIDUAL": int(residual), "SILU_MUL": int(silu_mul),
                  "TMA_STAGES": tma,
                  "DOUBLE_BUFFER": int(bool(double_buffer) and s.bm == 1),
                  # Inline PTX: never under the interpreter.
                  "PREFETCH_AHEAD": 0 if INTERPRET or not double_buffer or s.bm != 1 else int(prefetch_ahead)}
    if norm:
        constexprs["EPS"] = float(eps)

    def run(b, a):
        r0, r1, n0, n1, _, _ = s.tile(a)
        h = _prologue_ref(_2d(b["x"])[r0:r1], b["norm_w"] if norm else None, eps)
        s.store(b, a, h @ _2d(b["w"])[n0:n1].float().T, residual)

    def reads(a, bind):
        r0, r1, n0, n1, c0, c1 = s.tile(a)
        regs = [Region(bind["x"], r0, r1, 0, K), Region(bind["w"], n0, n1, 0, K)]
        if norm:
            regs.append(Region(bind["norm_w"], 0, 1, 0, K))
        if residual:
            regs.append(Region(bind["res"], r0, r1, c0, c1))
        return regs

    def writes(a, bind):
        return s.out_regions(a, bind)

    preload_src = ("w_first = linear_weights_first(w, pid_n, N, 0, K, K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)"
                   if preload else "")
    constexprs["PRELOAD"] = int(preload)
    constexprs["FOLD"] = int(fold) if double_buffer and s.bm == 1 else 1
    return OpSpec(name="linear", operands=operands, args=("pid_m", "pid_n"), body=body, prefetch=prefetch,
                  preload=preload_src,
                  imports=("from mk.tasks.linear import linear_prefetch_tile, linear_tile, linear_weights_first",),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=writes)


@register("linear_partial")
def linear_partial_op(M: int, N: int, K: int, split_k: int, *, block_m: int | None = None,
                      block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                      norm: bool = False, eps: float = 1e-6, prefetch_k: int = 0,
                      dtype: torch.dtype | None = None) -> OpSpec:
    """Split-K partial of tile (pid_m, pid_n) over K split ``split``: float32 into ws[split].

    Operands: x ``[M, K]``, w ``[N, K]``, norm_w ``[K]`` (with norm), ws float32
    ``[split_k, M, N]``. Args: pid_m, pid_n, split. Without norm a partial reads only its
    K range of x, so it waits only for the producer tiles of that range (split-K
    dataflow); with norm it reads whole rows (the RMSNorm statistics need all of K).
    Pair with :func:`linear_reduce_op` built from the same sizes.
    """
    s = _LinearShape("linear_partial", M, N, K, split_k, block_m, block_n, block_k, num_warps, False, False,
                     prefetch_k, dtype)
    operands = ("x", "w") + (("norm_w",) if norm else ()) + ("ws",)
    norm_w = "norm_w" if norm else "w"
    eps_src = "EPS" if norm else "0.0"
    # The K range is computed on the device from the split index, exactly as the split-K
    # launcher cuts it, so the descriptor carries only (pid_m, pid_n, split).
    prefetch = ("k_lo, k_hi = linear_split_range(split, SPLIT_K, K, BLOCK_K=BLOCK_K)\n"
                "linear_prefetch_tile(w, pid_n, N, k_lo, k_hi, K, PREFETCH_LINES=PREFETCH_LINES, LINE=LINE, "
                "BLOCK_N=BLOCK_N, BULK=PREFETCH_BULK)")
    body = (f"k_lo, k_hi = linear_split_range(split, SPLIT_K, K, BLOCK_K=BLOCK_K)\n"
            f"linear_partial_tile(x, w, {norm_w}, ws, pid_m, pid_n, split, M, N, K, k_lo, k_hi, K, K, M * N, N, "
            f"{eps_src}, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)")
    constexprs = {**s.constexprs(), "SPLIT_K": split_k, "HAS_NORM": int(norm)}
    if norm:
        constexprs["EPS"] = float(eps)

    def split_of(a):
        _check_tile("linear_partial", "split", a["split"], split_k)
        return s.k_splits[a["split"]]

    def run(b, a):
        r0, r1, n0, n1, _, _ = s.tile(a)
        k_lo, k_hi = split_of(a)
        h = _prologue_ref(_2d(b["x"])[r0:r1], b["norm_w"] if norm else None, eps)
        w0, w1 = s.ws_rows(a["split"], r0, r1)
        _2d(b["ws"])[w0:w1, n0:n1] = h[:, k_lo:k_hi] @ _2d(b["w"])[n0:n1, k_lo:k_hi].float().T

    def reads(a, bind):
        r0, r1, n0, n1, _, _ = s.tile(a)
        k_lo, k_hi = split_of(a)
        regs = [Region(bind["x"], r0, r1, 0, K) if norm else Region(bind["x"], r0, r1, k_lo, k_hi),
                Region(bind["w"], n0, n1, k_lo, k_hi)]
        if norm:
            regs.append(Region(bind["norm_w"], 0, 1, 0, K))
        return regs

    def writes(a, bind):
        r0, r1, n0, n1, _, _ = s.tile(a)
        split_of(a)
        w0, w1 = s.ws_rows(a["split"], r0, r1)
        return [Region(bind["ws"], w0, w1, n0, n1)]

    imports = ("from mk.tasks.linear import linear_partial_tile, linear_prefetch_tile, linear_split_range",)
    return OpSpec(name="linear_partial", operands=operands, args=("pid_m", "pid_n", "split"), body=body,
                  prefetch=prefetch, imports=imports,
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=writes)


@register("linear_reduce")
def linear_reduce_op(M: int, N: int, K: int, split_k: int, *, block_m: int | None = None,
                     block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                     residual: bool = False, silu_mul: bool = False, dtype: torch.dtype | None = None) -> OpSpec:
    """Sum the split_k float32 partials of tile (pid_m, pid_n) in split order, then the epilogue.

    Operands: ws float32 ``[split_k, M, N]``, res ``[M, N]`` (with residual), out ``[M, N]``
    (``[M, N/2]`` with silu_mul). Args: pid_m, pid_n. Takes the same sizes as the
    :func:`linear_partial_op` it pairs with (K and block_k only pick the same default tiles).
    """
    s = _LinearShape("linear_reduce", M, N, K, split_k, block_m, block_n, block_k, num_warps, residual, silu_mul,
                     0, dtype)
    operands = ("ws",) + (("res",) if residual else ()) + ("out",)
    res = "res" if residual else "out"
    body = (f"linear_splitk_reduce_tile(ws, {res}, out, pid_m, pid_n, M, N, SPLIT_K, M * N, N, N_OUT, N_OUT, "
            f"HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)")
    constexprs = {k: v for k, v in s.constexprs().items() if k not in ("BLOCK_K", "PREFETCH_LINES", "LINE", "PREFETCH_BULK")}
    constexprs.update(SPLIT_K=split_k, HAS_RESIDUAL=int(residual), SILU_MUL=int(silu_mul))

    def run(b, a):
        r0, r1, n0, n1, _, _ = s.tile(a)
        ws = _2d(b["ws"])
        acc = None
        for split in range(split_k):  # in split order, as the device does
            w0, w1 = s.ws_rows(split, r0, r1)
            part = ws[w0:w1, n0:n1].float()
            acc = part.clone() if acc is None else acc + part
        s.store(b, a, acc, residual)

    def reads(a, bind):
        r0, r1, n0, n1, c0, c1 = s.tile(a)
        regs = [Region(bind["ws"], *s.ws_rows(split, r0, r1), n0, n1) for split in range(split_k)]
        if residual:
            regs.append(Region(bind["res"], r0, r1, c0, c1))
        return regs

    def writes(a, bind):
        return s.out_regions(a, bind)

    return OpSpec(name="linear_reduce", operands=operands, args=("pid_m", "pid_n"), body=body,
                  imports=("from mk.tasks.linear import linear_splitk_reduce_tile",),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=writes)


def linear_tiles(spec: OpSpec) -> list[dict]:
    """Descriptor args of every task of one whole linear / linear_partial / linear_reduce op.

    Tiles in row-major (pid_m, pid_n) order; for partials, all splits of a tile together.
    """
    c = spec.constexprs
    if spec.name not in ("linear", "linear_partial", "linear_reduce"):
        raise ValueError(f"not a linear op: {spec.name!r}")
    tiles = [{"pid_m": m, "pid_n": n} for m in range(_cdiv(c["M"], c["BLOCK_M"]))
             for n in range(_cdiv(c["N"], c["BLOCK_N"]))]
    if spec.name == "linear_partial":
        return [{**t, "split": k} for t in tiles for k in range(c["SPLIT_K"])]
    return tiles


# ---------------------------------------------------------------------------------------
# silu_mul: out = silu(gate) * up, one (row, column block) a task
# ---------------------------------------------------------------------------------------


@register("silu_mul")
def silu_mul_op(i: int, *, block_i: int | None = None, num_warps: int | None = None) -> OpSpec:
    """One (row, column block) tile of ``out = silu(gate) * up`` over rows of ``i`` elements.

    Operands: gate, up, out, each ``[rows, i]``. Args: row, col_block (``cdiv(i, BLOCK_I)``
    blocks per row; the last one is clipped to i).
    """
    if isinstance(i, bool) or not isinstance(i, int) or i < 1:
        raise ValueError(f"silu_mul: i must be an int >= 1, got {i!r}")
    block_i = block_i or silu_mul_block_i(i)
    if block_i & (block_i - 1):
        raise ValueError(f"silu_mul: block_i must be a power of two, got {block_i}")
    blocks = _cdiv(i, block_i)

    def cols(a):
        _check_tile("silu_mul", "col_block", a["col_block"], blocks)
        c0 = a["col_block"] * block_i
        return c0, min(c0 + block_i, i)

    def run(b, a):
        row, (c0, c1) = a["row"], cols(a)
        y = silu_mul_ref(_2d(b["gate"])[row, c0:c1], _2d(b["up"])[row, c0:c1])
        out = _2d(b["out"])
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
                  num_warps=num_warps or silu_mul_num_warps(block_i), run=run, reads=reads, writes=writes)
