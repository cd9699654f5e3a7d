"""OpSpecs of mk's tasks: how each runs inside the megakernel, and on the VM.

Each factory fixes a task's static parameters (constexpr tile sizes, flags, eps) and
returns an :class:`~mk.tasks._spec.OpSpec`. Buffers are addressed as 2-D row-major
``[rows, cols]`` views (a 1-D buffer is one row), which is also how regions are given.

Every static parameter that changes the generated code is a constexpr (eps included):
the constexprs are the op's key, and tasks with one key share one generated branch.
"""

from __future__ import annotations

import torch

from mk.tasks._device import default_dtype
from mk.tasks.argmax import argmax_block_c, argmax_block_v, argmax_pack_ref, argmax_unpack_ref, check_block_v
from mk.tasks.decode_attention import MAX_NUM_SPLITS, MIN_DOT_DIM, decode_attention_config, live_splits
from mk.tasks.embedding import embedding_block_h, embedding_num_warps

# The launcher's private config check and row-tile rule, reused so that a megakernel
# tile is exactly the tile the standalone op would launch.
from mk.tasks.linear import (
    LinearConfig,
    _check_config,
    _tile_rows,
    linear_config,
    linear_k_splits,
    dot_waits_in_stream,
    prefetch_lines,
    gemv_stream,
)
from mk.tasks.rmsnorm import rmsnorm_block_n, rmsnorm_num_warps, rmsnorm_ref
from mk.tasks.rope import rope_blocks, rope_num_warps, rope_ref
from mk.tasks.silu_mul import silu_mul_block_i, silu_mul_num_warps, silu_mul_ref
from mk.tasks._spec import (OpSpec, Region, as_2d, block_cols, cdiv, check_pow2, check_sizes, check_tile,
                            operand_view, register)


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
                 prefetch_k, dtype, tiles_per_task=1):
        check_sizes(op, M=M, N=N, K=K, split_k=split_k, tiles_per_task=tiles_per_task)
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
        self.tiles_m, self.tiles_n = cdiv(M, self.bm), cdiv(N, self.bn)
        # Width of the partial tiles whose sums of x**2 a split-K reduce reads (NORM_SQ): its
        # own, unless a reduce cuts each partial tile into several (:meth:`narrow_reduce`).
        self.sq_bn = self.bn
        # A task is a run of tiles_per_task adjacent tiles along N (mk.tasks.linear.linear_run),
        # so for regions and the VM it is one tile of tiles_per_task * bn weight rows.
        self.run = tiles_per_task
        self.tasks_n = cdiv(self.tiles_n, self.run)
        self.k_splits = linear_k_splits(K, self.bk, split_k)
        lines, line = prefetch_lines(cfg, K, torch.empty((), dtype=dtype).element_size())
        # (A run streams its own tiles back to back: no L2 prefetch ahead of its wait.) The
        # generated code prefetches only where it is compiled (PREFETCH_LINES * GPU): the
        # interpreter has no inline PTX.
        self.prefetch_lines, self.line = (0 if self.run > 1 else lines), line
        # TMA bulk prefetch of whole row segments when rows (and so split starts) are 16-byte
        # aligned; TaskGraph.buffer refuses buffers that are not.
        eb = self.eb = torch.empty((), dtype=dtype).element_size()
        self.bulk = int((K * eb) % 16 == 0 and (self.bk * eb) % 16 == 0)
        self.op = op

    def constexprs(self) -> dict:
        return {"M": self.M, "N": self.N, "K": self.K, "N_OUT": self.n_out, "BLOCK_M": self.bm,
                "BLOCK_N": self.bn, "BLOCK_K": self.bk, "PREFETCH_LINES": self.prefetch_lines, "LINE": self.line,
                "PREFETCH_BULK": self.bulk, "TILES_PER_TASK": self.run, "TILES_N": self.tiles_n}

    def streams_in_run(self, tma: int) -> bool:
        """Whether a task runs as :func:`mk.tasks.linear.linear_run`: a run of tiles, or a
        GEMV tile through the TMA ring (which waits for its inputs inside the stream, with
        the ring's first chunks already in flight: :attr:`OpSpec.waits_in_body`). (Decode
        tl.dot tiles of one tile a task measured slower as runs of one: 1B batch-8 step
        1.34 -> 1.62 ms on an H200.)"""
        return self.run > 1 or self.waits_in_body(tma)

    def stream(self, tma: int):
        """How the task streams through a ring of ``tma`` (:func:`mk.tasks.linear.gemv_stream`)."""
        return gemv_stream(self.bm, tma, self.K, self.bk, self.bn, self.eb, self.split_k, self.run)

    def waits_in_body(self, tma: int) -> bool:
        """Whether a GEMV task waits for x inside its stream (:func:`mk.tasks.linear.linear_run`)."""
        return self.stream(tma).waits

    def dot_waits(self, tma: int) -> bool:
        """Whether a tl.dot tile waits for x inside its weight loop
        (:func:`mk.tasks.linear.dot_waits_in_stream`)."""
        return dot_waits_in_stream(self.bm, self.bn, tma, self.run)

    def task_waits(self, tma: int) -> bool:
        """Whether the task's body makes its dependency wait itself (:attr:`OpSpec.waits_in_body`)."""
        return self.waits_in_body(tma) or self.dot_waits(tma)

    def waiting(self, call: str, tma: int) -> str:
        """``call`` (a tile function's device call, ending in ``)``) made to wait for the
        task's inputs inside its stream when :meth:`dot_waits`."""
        if not self.dot_waits(tma):
            return call
        return ("ok, last_ev, last_need, t_ready = " + call[:-1] + ", WAIT=task_wait, wait_args=task_wait_args, "
                "wait_state=task_wait_state, WAIT_FLAGS=TASK_WAIT_FLAGS)")

    def stream_constexprs(self, tma: int) -> dict:
        """The ring's constexprs: TMA_STAGES, and the chunks an iteration and loop stages of a
        task that waits in its stream (X_GROUP, X_STAGES)."""
        st = self.stream(tma)
        return {"TMA_STAGES": tma, "X_GROUP": st.group, "X_STAGES": st.stages}

    def run_body(self, norm: bool, k_range: str, epilogue: str, epilogue_args: str, flags: str = "",
                 wait: bool = False) -> str:
        """The device call of a task run by :func:`mk.tasks.linear.linear_run` over the task's
        tiles (x, w and with ``norm`` norm_w; ``k_range`` = "k_lo, k_hi"), the epilogue's
        runtime args and its constexpr flags (names of constexprs); with ``wait`` it waits
        for its inputs itself (:attr:`OpSpec.waits_in_body`)."""
        call = (f"linear_run(x, w, {'norm_w' if norm else 'w'}, pid_m, pid_n * TILES_PER_TASK, "
                f"tl.minimum(TILES_PER_TASK, TILES_N - pid_n * TILES_PER_TASK), M, N, K, {k_range}, K, K, "
                f"{'EPS' if norm else '0.0'}, EPILOGUE={epilogue}, epilogue_args=({epilogue_args},), "
                f"EPILOGUE_FLAGS=EPILOGUE_FLAGS, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, "
                f"BLOCK_K=BLOCK_K, TMA_STAGES=TMA_STAGES")
        if wait:
            call = ("ok, last_ev, last_need, t_ready = " + call + ", WAIT=task_wait, wait_args=task_wait_args, "
                    "wait_state=task_wait_state, WAIT_FLAGS=TASK_WAIT_FLAGS, X_GROUP=X_GROUP, X_STAGES=X_STAGES")
        return f"EPILOGUE_FLAGS: tl.constexpr = {f'({flags},)' if flags else None}\n{call})"

    def tile(self, a) -> tuple[int, int, int, int, int, int]:
        """(r0, r1, n0, n1, c0, c1): x/out rows, weight rows and out columns of task (pid_m, pid_n)
        (its run of tiles), clipped to the buffers (edge tiles are partial)."""
        pm, pn = a["pid_m"], a["pid_n"]
        check_tile(self.op, "pid_m", pm, self.tiles_m)
        check_tile(self.op, "pid_n", pn, self.tasks_n)
        r0, n0 = pm * self.bm, pn * self.bn * self.run
        r1, n1 = min(r0 + self.bm, self.M), min(n0 + self.bn * self.run, self.N)
        # With silu_mul a tile's adjacent (gate, up) weight rows make one output column.
        c0, c1 = (n0 // 2, n1 // 2) if self.silu_mul else (n0, n1)
        return r0, r1, n0, n1, c0, c1

    def store(self, b, a, acc: torch.Tensor, residual: bool) -> None:
        """VM: the epilogue (residual or silu_mul) of a float32 tile, stored into out."""
        r0, r1, _, _, c0, c1 = self.tile(a)
        y = _epilogue_ref(acc, as_2d(b["res"])[r0:r1, c0:c1] if residual else None, self.silu_mul)
        out = as_2d(b["out"])
        out[r0:r1, c0:c1] = y.to(out.dtype)

    def out_regions(self, a, bind) -> list:
        r0, r1, _, _, c0, c1 = self.tile(a)
        return [Region(bind["out"], r0, r1, c0, c1)]

    def ws_rows(self, split: int, r0: int, r1: int) -> tuple[int, int]:
        """Rows of the 2-D workspace view holding split ``split`` of x rows [r0, r1)."""
        return split * self.M + r0, split * self.M + r1

    def norm_sq(self, norm: bool, tma: int) -> bool:
        """Whether a split-K partial with a fused RMSNorm leaves the rstd to its reduce, handing
        it the sums of x**2 of its K range instead (``NORM_SQ`` of
        :func:`mk.tasks.linear.linear_partial_tile`): tl.dot tiles through the TMA ring."""
        return bool(norm) and self.bm > 1 and tma > 0 and not self.streams_in_run(tma)

    def ws_cols(self, norm_sq: bool) -> int:
        """Columns of the workspace: N, and with norm_sq a sum-of-squares column per partial tile."""
        return self.N + (cdiv(self.N, self.sq_bn) if norm_sq else 0)

    def narrow_reduce(self, part_block_n: int | None) -> int:
        """A reduce op's tiles within partial tiles of ``part_block_n`` columns (None: as wide
        as its own): returns the PART_BLOCK_N constexpr (0 where the widths match)."""
        if part_block_n is None or part_block_n == self.bn:
            return 0
        if isinstance(part_block_n, bool) or not isinstance(part_block_n, int) or part_block_n % self.bn:
            raise ValueError(f"{self.op}: a reduce tile of {self.bn} columns must lie within one partial tile: "
                             f"part_block_n must be a multiple of {self.bn}, got {part_block_n!r}")
        self.sq_bn = part_block_n
        return part_block_n

    def ws_regions(self, a, bind, norm_sq: bool = False) -> list:
        """The workspace boxes a split-K reduce of tile ``a`` reads: its tile in every split
        (and with ``norm_sq`` the tile's column of x**2 sums)."""
        r0, r1, n0, n1, _, _ = self.tile(a)
        regs = [Region(bind["ws"], *self.ws_rows(split, r0, r1), n0, n1) for split in range(self.split_k)]
        if norm_sq:
            col = self.N + n0 // self.sq_bn
            regs += [Region(bind["ws"], *self.ws_rows(split, r0, r1), col, col + 1) for split in range(self.split_k)]
        return regs

    def _split_sum(self, b, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """VM: float32 sum over the splits of ws columns [c0, c1) of rows [r0, r1), in split order."""
        ws, acc = as_2d(b["ws"]), None
        for split in range(self.split_k):
            w0, w1 = self.ws_rows(split, r0, r1)
            part = ws[w0:w1, c0:c1].float()
            acc = part.clone() if acc is None else acc + part
        return acc

    def reduce(self, b, a, norm_sq: bool = False, eps: float = 0.0) -> torch.Tensor:
        """VM: the float32 sum of tile ``a``'s split-K partials, in split order as the device sums
        (with ``norm_sq`` scaled by the rstd of the partials' x**2 sums)."""
        r0, r1, n0, n1, _, _ = self.tile(a)
        acc = self._split_sum(b, r0, r1, n0, n1)
        if norm_sq:
            col = self.N + n0 // self.sq_bn
            acc = acc * torch.rsqrt(self._split_sum(b, r0, r1, col, col + 1) / self.K + eps)
        return acc


def _tma_stages(s: "_LinearShape", K: int, tma_stages: int, dtype: torch.dtype | None) -> int:
    """The TMA ring depth a tile can use: 0 unless its rows are 16-byte aligned and its
    boxes at most 256 elements a side (what a tensor descriptor needs) and no wider than K
    (a wider box only moves zeros); GEMV tiles and skinny tl.dot tiles (decode batches: one
    row block) only."""
    eb = torch.empty((), dtype=dtype or default_dtype()).element_size()
    ok = (s.tiles_m == 1 and tma_stages and (K * eb) % 16 == 0 and s.bn <= 256 and s.bk <= min(256, K)
          and (s.bk * eb) % 16 == 0)
    return int(tma_stages) if ok else 0


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


def _weight_streaming(s: "_LinearShape", K: int, tma_stages: int, dtype, double_buffer: bool,
                      preload_weights: bool | None) -> tuple[int, bool, bool]:
    """(TMA ring depth, double buffering, preload) of a GEMV-capable tile, as resolved for it.

    The GEMV body's first weight chunk goes to registers before the wait (with double
    buffering). By default only for tiles of one chunk: on an H200 it takes a 64x2048^2
    chain from 7.8 to 4.3 us a layer, but slows 16-chunk tiles (8192 columns) by a
    third, whose loop then converts the chunk's layout every iteration, and two-chunk
    tiles far more (calibration chains: a 2048^2 layer of
    16 x 1024 tiles took 51 us, a 4096^2 layer of 8 x 2048 tiles 167 us). A TMA ring
    replaces both.
    """
    if preload_weights is None:
        preload_weights = K <= s.bk
    # A tile of one chunk gets a one-slot ring: a 4-deep ring over a one-chunk K with the
    # residual in the epilogue (a small model's down projection, K=256 or 128 at batch 1)
    # decoded wrong tokens on an H200. (Longer streams keep theirs: a grouped stream's ring
    # is deeper than its chunks on purpose.)
    tma = _tma_stages(s, K, tma_stages, dtype)
    if cdiv(K, s.bk) == 1:
        tma = min(tma, 1)
    if tma or s.run > 1:  # the ring, or a run's own stream (linear_run), replaces both
        double_buffer, preload_weights = False, False
    return tma, double_buffer, bool(preload_weights and double_buffer and s.bm == 1)


#: A full-K tile's L2 weight prefetch, issued by the dispatch loop before the task's wait.
_FULL_K_PREFETCH = ("linear_prefetch_tile(w, pid_n, N, 0, K, K, PREFETCH_LINES=PREFETCH_LINES * GPU, LINE=LINE, "
                    "BLOCK_N=BLOCK_N, BULK=PREFETCH_BULK)")


@register("linear")
def linear_op(M: int, N: int, K: int, *, block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None, num_warps: int | None = None, residual: bool = False,
              norm: bool = False, eps: float = 1e-6, silu_mul: bool = False, prefetch_k: int = 0,
              double_buffer: bool = True, preload_weights: bool | None = None, tma_stages: int = 0,
              tiles_per_task: int = 1, argmax: bool = False, dtype: torch.dtype | None = None) -> OpSpec:
    """One output tile (pid_m, pid_n) of ``y = x @ W.T`` over all of K, epilogue included.

    Operands: x ``[M, K]``, w ``[N, K]``, norm_w ``[K]`` (with norm: RMSNorm prologue, eps),
    res ``[M, N]`` (with residual), out ``[M, N]`` (``[M, N/2]`` with silu_mul, w then from
    :func:`mk.tasks.linear.interleave_gate_up`). Args: pid_m, pid_n. Block sizes default to
    :func:`mk.tasks.linear.linear_config` for ``dtype`` (mk's default dtype when None).
    ``double_buffer``: the GEMV body requests each weight chunk one iteration ahead (a
    persistent worker needs the extra bytes in flight); ``preload_weights`` loads the first
    chunk into registers before the dependency wait (None: when K is at most two chunks);
    ``tma_stages`` > 0 streams the weights through a shared-memory ring of that many TMA
    loads instead (GEMV body; aligned rows, chunks of at most 256 elements). ``prefetch_k``
    weight columns are pulled into L2 before the dependency wait (never under the
    interpreter). ``tiles_per_task`` > 1: a task is that many adjacent tiles along N (pid_n
    counts runs), streamed as one (:func:`mk.tasks.linear.linear_run`). ``argmax``: an LM
    head whose tiles also fold each x row's max over their columns into operand best int64
    ``[M]`` (zero before the step; :func:`mk.tasks.argmax.argmax_tile_into`), which
    :func:`append_token_op` with ``from_best`` takes. Its tasks of one row block are then a
    team (:attr:`OpSpec.team`): they all write best's rows, in any order.
    """
    s = _LinearShape("linear", M, N, K, 1, block_m, block_n, block_k, num_warps, residual, silu_mul,
                     prefetch_k, dtype, tiles_per_task)
    if argmax and (residual or silu_mul):
        raise ValueError("linear: the argmax folds an LM head's logits; no residual or silu_mul epilogue")
    tma, double_buffer, preload = _weight_streaming(s, K, tma_stages, dtype, double_buffer, preload_weights)
    operands = ("x", "w") + (("norm_w",) if norm else ()) + (("res",) if residual else ()) + ("out",)
    operands += ("best",) if argmax else ()
    # Unused pointer operands get a harmless real pointer, as the launcher does.
    norm_w, res = ("norm_w" if norm else "w"), ("res" if residual else "out")
    eps_src = "EPS" if norm else "0.0"
    body = (f"linear_tile(x, w, {norm_w}, {res}, out, pid_m, pid_n, M, N, K, 0, K, K, K, N_OUT, N_OUT, {eps_src}, "
            f"HAS_NORM=HAS_NORM, HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, "
            f"BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOUBLE_BUFFER=DOUBLE_BUFFER, "
            f"TMA_STAGES=TMA_STAGES{', w_first=w_first' if preload else ''}"
            f"{', argmax_best=best' if argmax else ''})")
    body = s.waiting(body, tma)
    if s.streams_in_run(tma):
        if argmax:
            body = s.run_body(norm, "0, K", "linear_argmax_epilogue", "out, M, N, N, best", wait=s.waits_in_body(tma))
        else:
            body = s.run_body(norm, "0, K", "linear_store_epilogue", f"{res}, out, M, N, N_OUT, N_OUT",
                              "HAS_RESIDUAL, SILU_MUL", wait=s.waits_in_body(tma))
    prefetch = _FULL_K_PREFETCH
    constexprs = {**s.constexprs(), "HAS_NORM": int(norm), "HAS_RESIDUAL": int(residual), "SILU_MUL": int(silu_mul),
                  **s.stream_constexprs(tma),
                  "DOUBLE_BUFFER": int(bool(double_buffer) and s.bm == 1)}
    if argmax:
        constexprs["ARGMAX"] = 1  # its own branch (a branch's key is its name and constexprs)
    if norm:
        constexprs["EPS"] = float(eps)

    def run(b, a):
        r0, r1, n0, n1, _, _ = s.tile(a)
        h = _prologue_ref(as_2d(b["x"])[r0:r1], b["norm_w"] if norm else None, eps)
        s.store(b, a, h @ as_2d(b["w"])[n0:n1].float().T, residual)
        if argmax:  # the run's columns of the logits as stored, folded into best
            packed = argmax_pack_ref(as_2d(b["out"])[r0:r1, n0:n1], torch.arange(n0, n1)).amax(dim=1)
            best = b["best"].view(-1)
            best[r0:r1] = torch.maximum(best[r0:r1], packed.to(best.device))

    def reads(a, bind):
        r0, r1, n0, n1, c0, c1 = s.tile(a)
        regs = [Region(bind["x"], r0, r1, 0, K), Region(bind["w"], n0, n1, 0, K)]
        if norm:
            regs.append(Region(bind["norm_w"], 0, 1, 0, K))
        if residual:
            regs.append(Region(bind["res"], r0, r1, c0, c1))
        return regs

    def writes(a, bind):
        regs = s.out_regions(a, bind)
        if argmax:
            r0, r1 = s.tile(a)[:2]
            regs.append(Region(bind["best"], 0, 1, r0, r1))
        return regs

    preload_src = ("w_first = linear_weights_first(w, pid_n, N, 0, K, K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)"
                   if preload else "")
    constexprs["PRELOAD"] = int(preload)
    return OpSpec(name="linear", operands=operands, args=("pid_m", "pid_n"), body=body, prefetch=prefetch,
                  preload=preload_src, waits_in_body=s.task_waits(tma),
                  team=(lambda a: a["pid_m"]) if argmax else None, sync_operands=("best",) if argmax else (),
                  imports=("from mk.tasks.linear import linear_argmax_epilogue, linear_prefetch_tile, linear_run, "
                           "linear_store_epilogue, linear_tile, linear_weights_first",),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=writes)


@register("linear_partial")
def linear_partial_op(M: int, N: int, K: int, split_k: int, *, block_m: int | None = None,
                      block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                      norm: bool = False, eps: float = 1e-6, prefetch_k: int = 0, double_buffer: bool = True,
                      tma_stages: int = 0, tiles_per_task: int = 1, dtype: torch.dtype | None = None) -> OpSpec:
    """Split-K partial of tile (pid_m, pid_n) over K split ``split``: float32 into ws[split].

    Operands: x ``[M, K]``, w ``[N, K]``, norm_w ``[K]`` (with norm), ws float32
    ``[split_k, M, N]`` (``constexprs["WS_N"]`` columns: see below). Args: pid_m, pid_n,
    split. Without norm a partial reads only its K range of x, so it waits only for the
    producer tiles of that range (split-K dataflow); with norm GEMV partials read whole
    rows (the RMSNorm statistics need all of K), and tl.dot partials through a TMA ring
    (``constexprs["NORM_SQ"]``) leave the rstd to the reduce: they read their K range only
    and store its sums of x**2 in ``cdiv(N, block_n)`` more ws columns, so the reduce is built
    with ``norm_sq=True`` and ws has ``N + cdiv(N, block_n)`` columns.
    Pair with :func:`linear_reduce_op` built from the same sizes. ``double_buffer`` and
    ``tma_stages`` stream the weights as in :func:`linear_op` (GEMV tiles), and ``tiles_per_task``
    makes a task a run of tiles as there (:func:`linear_reduce_op` then pairs with single tiles).
    """
    s = _LinearShape("linear_partial", M, N, K, split_k, block_m, block_n, block_k, num_warps, False, False,
                     prefetch_k, dtype, tiles_per_task)
    tma = _tma_stages(s, K, tma_stages, dtype)
    operands = ("x", "w") + (("norm_w",) if norm else ()) + ("ws",)
    norm_w = "norm_w" if norm else "w"
    eps_src = "EPS" if norm else "0.0"
    # The K range is computed on the device from the split index, exactly as the split-K
    # launcher cuts it, so the descriptor carries only (pid_m, pid_n, split).
    prefetch = ("k_lo, k_hi = linear_split_range(split, SPLIT_K, K, BLOCK_K=BLOCK_K)\n"
                "linear_prefetch_tile(w, pid_n, N, k_lo, k_hi, K, PREFETCH_LINES=PREFETCH_LINES * GPU, LINE=LINE, "
                "BLOCK_N=BLOCK_N, BULK=PREFETCH_BULK)")
    norm_sq = s.norm_sq(norm, tma)
    body = ("k_lo, k_hi = linear_split_range(split, SPLIT_K, K, BLOCK_K=BLOCK_K)\n"
            + s.waiting(f"linear_partial_tile(x, w, {norm_w}, ws, pid_m, pid_n, split, M, N, K, k_lo, k_hi, K, K, "
                        f"M * WS_N, WS_N, {eps_src}, HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, "
                        f"BLOCK_K=BLOCK_K, DOUBLE_BUFFER=DOUBLE_BUFFER, TMA_STAGES=TMA_STAGES, NORM_SQ=NORM_SQ)", tma))
    if s.streams_in_run(tma):
        body = ("k_lo, k_hi = linear_split_range(split, SPLIT_K, K, BLOCK_K=BLOCK_K)\n"
                + s.run_body(norm, "k_lo, k_hi", "linear_partial_epilogue", "ws, split, M, N, M * N, N",
                             wait=s.waits_in_body(tma)))
    constexprs = {**s.constexprs(), "SPLIT_K": split_k, "HAS_NORM": int(norm), **s.stream_constexprs(tma),
                  "DOUBLE_BUFFER": int(bool(double_buffer) and s.bm == 1 and not tma),
                  "NORM_SQ": int(norm_sq), "WS_N": s.ws_cols(norm_sq)}
    if norm:
        constexprs["EPS"] = float(eps)

    def split_of(a):
        check_tile("linear_partial", "split", a["split"], split_k)
        return s.k_splits[a["split"]]

    def run(b, a):
        r0, r1, n0, n1, _, _ = s.tile(a)
        k_lo, k_hi = split_of(a)
        x = as_2d(b["x"])[r0:r1]
        w0, w1 = s.ws_rows(a["split"], r0, r1)
        ws = as_2d(b["ws"])
        if norm_sq:  # the rstd is the reduce's: the K range's sums of squares go with the partial
            h = x.float() * b["norm_w"].reshape(-1).float()
            ws[w0:w1, s.N + a["pid_n"]] = x[:, k_lo:k_hi].float().pow(2).sum(-1)
        else:
            h = _prologue_ref(x, b["norm_w"] if norm else None, eps)
        ws[w0:w1, n0:n1] = h[:, k_lo:k_hi] @ as_2d(b["w"])[n0:n1, k_lo:k_hi].float().T

    def reads(a, bind):
        r0, r1, n0, n1, _, _ = s.tile(a)
        k_lo, k_hi = split_of(a)
        whole = norm and not norm_sq  # the rstd of whole rows
        regs = [Region(bind["x"], r0, r1, 0, K) if whole else Region(bind["x"], r0, r1, k_lo, k_hi),
                Region(bind["w"], n0, n1, k_lo, k_hi)]
        if norm:
            regs.append(Region(bind["norm_w"], 0, 1, 0, K))
        return regs

    def writes(a, bind):
        r0, r1, n0, n1, _, _ = s.tile(a)
        split_of(a)
        w0, w1 = s.ws_rows(a["split"], r0, r1)
        regs = [Region(bind["ws"], w0, w1, n0, n1)]
        if norm_sq:
            regs.append(Region(bind["ws"], w0, w1, s.N + a["pid_n"], s.N + a["pid_n"] + 1))
        return regs

    imports = ("from mk.tasks.linear import linear_partial_epilogue, linear_partial_tile, linear_prefetch_tile, "
               "linear_run, linear_split_range",)
    return OpSpec(name="linear_partial", operands=operands, args=("pid_m", "pid_n", "split"), body=body,
                  prefetch=prefetch, imports=imports, waits_in_body=s.task_waits(tma),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=writes)


@register("linear_reduce")
def linear_reduce_op(M: int, N: int, K: int, split_k: int, *, block_m: int | None = None,
                     block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                     residual: bool = False, silu_mul: bool = False, norm_sq: bool = False, eps: float = 1e-6,
                     part_block_n: int | None = None, dtype: torch.dtype | None = None) -> OpSpec:
    """Sum the split_k float32 partials of tile (pid_m, pid_n) in split order, then the epilogue.

    Operands: ws float32 ``[split_k, M, N]``, res ``[M, N]`` (with residual), out ``[M, N]``
    (``[M, N/2]`` with silu_mul). Args: pid_m, pid_n. Takes the same sizes as the
    :func:`linear_partial_op` it pairs with (K and block_k only pick the same default tiles).
    ``norm_sq``: the partials' ``NORM_SQ`` (ws then has their sums of x**2 after its N
    columns); the sum is scaled by the RMSNorm's rstd (``eps``) here.
    ``part_block_n``: the partials' block_n, where the reduce's tiles (``block_n``) are
    narrower, each partial tile then reduced by several tasks (a multiple of block_n).
    """
    s = _LinearShape("linear_reduce", M, N, K, split_k, block_m, block_n, block_k, num_warps, residual, silu_mul,
                     0, dtype)
    part_bn = s.narrow_reduce(part_block_n)
    operands = ("ws",) + (("res",) if residual else ()) + ("out",)
    res = "res" if residual else "out"
    body = (f"linear_splitk_reduce_tile(ws, {res}, out, pid_m, pid_n, M, N, SPLIT_K, M * WS_N, WS_N, N_OUT, N_OUT, "
            f"HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, K=K, eps=EPS, "
            f"NORM_SQ=NORM_SQ, PART_BLOCK_N=PART_BLOCK_N)")
    constexprs = {k: v for k, v in s.constexprs().items() if k not in ("BLOCK_K", "PREFETCH_LINES", "LINE", "PREFETCH_BULK")}
    constexprs.update(SPLIT_K=split_k, HAS_RESIDUAL=int(residual), SILU_MUL=int(silu_mul), NORM_SQ=int(norm_sq),
                      WS_N=s.ws_cols(norm_sq), EPS=float(eps) if norm_sq else 0.0, PART_BLOCK_N=part_bn)

    def run(b, a):
        s.store(b, a, s.reduce(b, a, norm_sq, eps), residual)

    def reads(a, bind):
        r0, r1, n0, n1, c0, c1 = s.tile(a)
        regs = s.ws_regions(a, bind, norm_sq)
        if residual:
            regs.append(Region(bind["res"], r0, r1, c0, c1))
        return regs

    def writes(a, bind):
        return s.out_regions(a, bind)

    return OpSpec(name="linear_reduce", operands=operands, args=("pid_m", "pid_n"), body=body,
                  imports=("from mk.tasks.linear import linear_splitk_reduce_tile",),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=writes)


class _QkvRope:
    """The RoPE + KV append epilogue of a QKV tile (fused, or after a split-K reduce): its
    VM semantics and its regions, for tiles of ``s`` (a :class:`_LinearShape`)."""

    def __init__(self, op, s, batch, hq, hkv, d, max_seq, write_seqlens):
        self.op, self.s, self.batch, self.hq, self.hkv, self.d = op, s, batch, hq, hkv, d
        self.max_seq, self.write_seqlens = max_seq, write_seqlens

    def store(self, b, a, acc: torch.Tensor) -> None:
        """VM: rotate the float32 tile ``acc`` and store q, or k / v into the caches."""
        op, batch, hq, hkv, d, max_seq = self.op, self.batch, self.hq, self.hkv, self.d, self.max_seq
        r0, r1, n0, n1, _, _ = self.s.tile(a)
        pos = operand_view(op, "pos", b["pos"], 1, batch)[0, r0:r1].long()
        inv = operand_view(op, "inv_freq", b["inv_freq"], 1, d // 2)[0].float()
        cols = torch.arange(n0, n1, 2, device=acc.device)
        heads, in_head = cols // d, cols % d
        angle = pos.float()[:, None] * inv[in_head // 2][None, :]
        even, odd = acc[:, 0::2], acc[:, 1::2]
        rot = (heads < hq + hkv)[None, :]
        y_even = torch.where(rot, even * angle.cos() - odd * angle.sin(), even)
        y_odd = torch.where(rot, odd * angle.cos() + even * angle.sin(), odd)
        q = operand_view(op, "q", b["q"], batch, hq * d)
        caches = {c: operand_view(op, c, b[c], batch * hkv * max_seq, d).view(batch, hkv, max_seq, d)
                  for c in ("k_cache", "v_cache")}
        for j, n in enumerate(cols.tolist()):
            head, in_head = n // d, n % d
            # Pair i of a rotated head goes back to elements (i, i + D/2); v stays in place.
            dims = (in_head, in_head + 1) if head >= hq + hkv else (in_head // 2, in_head // 2 + d // 2)
            for value, dim in zip((y_even[:, j], y_odd[:, j]), dims):
                if head < hq:
                    q[r0:r1, head * d + dim] = value.to(q.dtype)
                    continue
                cache = caches["k_cache" if head < hq + hkv else "v_cache"]
                kv = head - hq if head < hq + hkv else head - hq - hkv
                for i, p in enumerate(pos.tolist()):
                    if 0 <= p < max_seq:
                        cache[r0 + i, kv, p, dim] = value[i].to(cache.dtype)
        if self.write_seqlens and a["pid_n"] == 0:
            seqlens = operand_view(op, "seqlens", b["seqlens"], 1, batch)[0]
            seqlens[r0:r1] = (pos + 1).clamp(0, max_seq).to(seqlens.dtype)

    def reads(self, a, bind) -> list:
        r0, r1, _, _, _, _ = self.s.tile(a)
        return [Region(bind["pos"], 0, 1, r0, r1), Region(bind["inv_freq"], 0, 1, 0, self.d // 2)]

    def writes(self, a, bind) -> list:
        hq, hkv, d, max_seq = self.hq, self.hkv, self.d, self.max_seq
        r0, r1, n0, n1, _, _ = self.s.tile(a)
        regs = []
        for head in range(n0 // d, (n1 - 1) // d + 1):
            # The tile's weight rows of this head, then the elements they become.
            lo, hi = max(n0, head * d) - head * d, min(n1, (head + 1) * d) - head * d
            if head >= hq + hkv or (lo, hi) == (0, d):
                spans = [(lo, hi)]
            else:
                spans = [(lo // 2, hi // 2), (lo // 2 + d // 2, hi // 2 + d // 2)]
            if head < hq:
                regs += [Region(bind["q"], r0, r1, head * d + c0, head * d + c1) for c0, c1 in spans]
                continue
            cache, kv = ("k_cache", head - hq) if head < hq + hkv else ("v_cache", head - hq - hkv)
            regs += [Region(bind[cache], (row * hkv + kv) * max_seq, (row * hkv + kv + 1) * max_seq, c0, c1)
                     for row in range(r0, r1) for c0, c1 in spans]
        if self.write_seqlens and a["pid_n"] == 0:
            regs.append(Region(bind["seqlens"], 0, 1, r0, r1))
        return regs


#: A QKV task's rotation operands (positions, the angles' cos and sin), computed before its
#: wait: positions change only between decode steps.
_ROPE_PRE = ("rope_pre = qkv_rope_operands(pos, inv_freq, pid_m, pid_n, M, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, "
             "BLOCK_N=BLOCK_N)")


@register("qkv_rope_kv")
def qkv_rope_kv_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, K: int, max_seq: int, *,
                   block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None, norm: bool = False, eps: float = 1e-6,
                   write_seqlens: bool = False, double_buffer: bool = True, preload_weights: bool | None = None,
                   tma_stages: int = 0, prefetch_k: int = 0, tiles_per_task: int = 1,
                   dtype: torch.dtype | None = None) -> OpSpec:
    """One tile (pid_m, pid_n) of the fused QKV projection + RoPE + KV append
    (:mod:`mk.tasks.qkv_rope`): a linear tile over the ``(Hq + 2 Hkv) * D`` weight rows that
    rotates its q / k pairs and stores q, or its k / v columns into the caches.

    Operands: x ``[batch, K]``, w (q/k rows interleaved, :func:`mk.tasks.rope.interleave_rotary`),
    norm_w ``[K]`` (with norm), pos ``[batch]``, inv_freq float32 ``[D/2]``, q float32
    ``[batch, Hq * D]``, k_cache and v_cache ``[batch, Hkv, max_seq, D]``, with
    ``write_seqlens`` seqlens ``[batch]`` (= pos + 1, written by the tiles of column 0).
    Args: pid_m, pid_n. Tiles, weight streaming, prefetch and their options as :func:`linear_op`.

    Regions: a tile's cache write is at a runtime position, so it declares every position
    of the heads (and head columns) it covers, per sequence: attention of those heads waits
    for it, as it must.
    """
    check_sizes("qkv_rope_kv", batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, K=K, max_seq=max_seq)
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    if d % 2:
        raise ValueError(f"qkv_rope_kv: head_dim must be even, got {d}")
    N = (hq + 2 * hkv) * d
    s = _LinearShape("qkv_rope_kv", batch, N, K, 1, block_m, block_n, block_k, num_warps, False, False,
                     prefetch_k, dtype, tiles_per_task)
    if s.bn % 2:
        raise ValueError(f"qkv_rope_kv: block_n must be even (a tile holds whole rotation pairs), got {s.bn}")
    tma, double_buffer, preload = _weight_streaming(s, K, tma_stages, dtype, double_buffer, preload_weights)
    operands = (("x", "w") + (("norm_w",) if norm else ()) + ("pos", "inv_freq", "q", "k_cache", "v_cache")
                + (("seqlens",) if write_seqlens else ()))
    body = (f"qkv_rope_kv_tile(x, w, {'norm_w' if norm else 'w'}, pos, inv_freq, q, k_cache, v_cache, "
            f"{'seqlens' if write_seqlens else 'pos'}, pid_m, pid_n, M, K, S_MAX, {'EPS' if norm else '0.0'}, "
            f"HQ=HQ, HKV=HKV, HEAD_DIM=HEAD_DIM, HAS_NORM=HAS_NORM, WRITE_SEQLENS=SEQLENS, "
            f"BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOUBLE_BUFFER=DOUBLE_BUFFER, "
            f"TMA_STAGES=TMA_STAGES{', w_first=w_first' if preload else ''})")
    body = s.waiting(body, tma)
    rope_pre = ""
    if s.streams_in_run(tma):
        # A one-tile task loads its rotation operands before its wait (they do not depend on
        # the step's tasks), so its epilogue starts without a round trip.
        rope_pre = _ROPE_PRE if s.run == 1 else ""
        body = s.run_body(norm, "0, K", "qkv_rope_kv_run_epilogue",
                          f"pos, inv_freq, q, k_cache, v_cache, {'seqlens' if write_seqlens else 'pos'}, M, S_MAX, "
                          f"{'rope_pre' if rope_pre else 'None'}",
                          "HQ, HKV, HEAD_DIM, SEQLENS", wait=s.waits_in_body(tma))
    constexprs = {**s.constexprs(), "HQ": hq, "HKV": hkv, "HEAD_DIM": d, "S_MAX": max_seq, "HAS_NORM": int(norm),
                  "SEQLENS": int(write_seqlens), **s.stream_constexprs(tma), "PRELOAD": int(preload),
                  "DOUBLE_BUFFER": int(bool(double_buffer) and s.bm == 1)}
    if norm:
        constexprs["EPS"] = float(eps)

    rope = _QkvRope("qkv_rope_kv", s, batch, hq, hkv, d, max_seq, write_seqlens)
    preload_src = ("w_first = linear_weights_first(w, pid_n, N, 0, K, K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)"
                   if preload else "")
    preload_src = "\n".join(x for x in (preload_src, rope_pre) if x)
    prefetch = _FULL_K_PREFETCH

    def run(b, a):
        r0, r1, n0, n1, _, _ = s.tile(a)
        h = _prologue_ref(operand_view("qkv_rope_kv", "x", b["x"], batch, K)[r0:r1], b["norm_w"] if norm else None, eps)
        rope.store(b, a, h @ as_2d(b["w"])[n0:n1].float().T)

    def reads(a, bind):
        r0, r1, n0, n1, _, _ = s.tile(a)
        regs = [Region(bind["x"], r0, r1, 0, K), Region(bind["w"], n0, n1, 0, K)] + rope.reads(a, bind)
        if norm:
            regs.append(Region(bind["norm_w"], 0, 1, 0, K))
        return regs

    return OpSpec(name="qkv_rope_kv", operands=operands, args=("pid_m", "pid_n"), body=body, prefetch=prefetch,
                  preload=preload_src, waits_in_body=s.task_waits(tma),
                  imports=("from mk.tasks.linear import linear_prefetch_tile, linear_run, linear_weights_first",
                           "from mk.tasks.qkv_rope import qkv_rope_kv_run_epilogue, qkv_rope_kv_tile, "
                           "qkv_rope_operands"),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=rope.writes)


@register("qkv_rope_kv_reduce")
def qkv_rope_kv_reduce_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, K: int, max_seq: int,
                          split_k: int, *, block_m: int | None = None, block_n: int | None = None,
                          block_k: int | None = None, num_warps: int | None = None, write_seqlens: bool = False,
                          norm_sq: bool = False, eps: float = 1e-6, part_block_n: int | None = None,
                          dtype: torch.dtype | None = None) -> OpSpec:
    """Tile (pid_m, pid_n) of a split-K QKV projection: sum its float32 partials (from a
    :func:`linear_partial_op` of the same sizes, N = (Hq + 2 Hkv) * D, q/k rows interleaved),
    then RoPE + KV append as :func:`qkv_rope_kv_op` does.

    Operands: ws float32 ``[split_k, batch, N]``, pos, inv_freq, q, k_cache, v_cache (and
    seqlens with ``write_seqlens``) as in :func:`qkv_rope_kv_op`. Args: pid_m, pid_n.
    ``norm_sq``, ``part_block_n``: as :func:`linear_reduce_op` (the RMSNorm's rstd applied here).
    """
    op = "qkv_rope_kv_reduce"
    check_sizes(op, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, K=K,
                 max_seq=max_seq, split_k=split_k)
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    if d % 2:
        raise ValueError(f"{op}: head_dim must be even, got {d}")
    s = _LinearShape(op, batch, (hq + 2 * hkv) * d, K, split_k, block_m, block_n, block_k, num_warps, False, False,
                     0, dtype)
    if s.bn % 2:
        raise ValueError(f"{op}: block_n must be even (a tile holds whole rotation pairs), got {s.bn}")
    part_bn = s.narrow_reduce(part_block_n)
    rope = _QkvRope(op, s, batch, hq, hkv, d, max_seq, write_seqlens)
    operands = ("ws", "pos", "inv_freq", "q", "k_cache", "v_cache") + (("seqlens",) if write_seqlens else ())
    body = (f"qkv_rope_kv_reduce_tile(ws, pos, inv_freq, q, k_cache, v_cache, {'seqlens' if write_seqlens else 'pos'}, "
            f"pid_m, pid_n, M, S_MAX, SPLIT_K, M * WS_N, WS_N, HQ=HQ, HKV=HKV, HEAD_DIM=HEAD_DIM, "
            f"WRITE_SEQLENS=SEQLENS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, K=K, eps=EPS, NORM_SQ=NORM_SQ, pre=rope_pre, "
            f"PART_BLOCK_N=PART_BLOCK_N)")
    constexprs = {k: v for k, v in s.constexprs().items() if k not in ("BLOCK_K", "PREFETCH_LINES", "LINE", "PREFETCH_BULK")}
    constexprs.update(SPLIT_K=split_k, HQ=hq, HKV=hkv, HEAD_DIM=d, S_MAX=max_seq, SEQLENS=int(write_seqlens),
                      NORM_SQ=int(norm_sq), WS_N=s.ws_cols(norm_sq), EPS=float(eps) if norm_sq else 0.0,
                      PART_BLOCK_N=part_bn)

    def run(b, a):
        rope.store(b, a, s.reduce(b, a, norm_sq, eps))

    def reads(a, bind):
        return s.ws_regions(a, bind, norm_sq) + rope.reads(a, bind)

    return OpSpec(name=op, operands=operands, args=("pid_m", "pid_n"), body=body, preload=_ROPE_PRE,
                  imports=("from mk.tasks.qkv_rope import qkv_rope_kv_reduce_tile, qkv_rope_operands",),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=rope.writes)


def linear_tiles(spec: OpSpec) -> list[dict]:
    """Descriptor args of every task of one whole linear / linear_partial / linear_reduce op.

    Tiles (or runs of tiles_per_task tiles) in row-major (pid_m, pid_n) order; for partials,
    all splits of a tile together.
    """
    c = spec.constexprs
    if spec.name not in ("linear", "linear_partial", "linear_reduce", "qkv_rope_kv", "qkv_rope_kv_reduce"):
        raise ValueError(f"not a linear op: {spec.name!r}")
    runs_n = cdiv(cdiv(c["N"], c["BLOCK_N"]), c.get("TILES_PER_TASK", 1))  # tasks along N
    tiles = [{"pid_m": m, "pid_n": n} for m in range(cdiv(c["M"], c["BLOCK_M"])) for n in range(runs_n)]
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
                  num_warps=num_warps or silu_mul_num_warps(block_i), run=run, reads=reads, writes=writes)


# ---------------------------------------------------------------------------------------
# The decode step's other ops: embedding, RoPE + KV append, split-KV attention, argmax
# ---------------------------------------------------------------------------------------


@register("embedding")
def embedding_op(rows: int, vocab: int, hidden: int, *, block_h: int | None = None,
                 num_warps: int | None = None) -> OpSpec:
    """One (row, column block) tile of ``out[row] = table[ids[row]]``.

    Operands: ids int32/int64 ``[rows]`` (1-D), table ``[vocab, hidden]``, out
    ``[rows, hidden]``. Args: row, col_block (``cdiv(hidden, BLOCK_H)`` blocks a row, the
    last clipped). The token id is a runtime value, so a task declares a read of its column
    block of *every* table row: the table is a weight no task writes, so this costs no
    dependency, while the read of ``ids[row]`` orders the task after whatever writes the id.
    """
    check_sizes("embedding", rows=rows, vocab=vocab, hidden=hidden)
    block_h = check_pow2("embedding", "block_h", block_h or embedding_block_h(hidden))
    blocks = cdiv(hidden, block_h)

    def cols(a):
        check_tile("embedding", "row", a["row"], rows)
        return block_cols("embedding", a, blocks, block_h, hidden)

    def run(b, a):
        (c0, c1), row = cols(a), a["row"]
        token = int(operand_view("embedding", "ids", b["ids"], 1, rows)[0, row])
        if not 0 <= token < vocab:
            raise ValueError(f"embedding: ids[{row}] = {token} is outside the vocabulary [0, {vocab})")
        out = operand_view("embedding", "out", b["out"], rows, hidden)
        out[row, c0:c1] = operand_view("embedding", "table", b["table"], vocab, hidden)[token, c0:c1].to(out.dtype)

    def reads(a, bind):
        c0, c1 = cols(a)
        return [Region(bind["ids"], 0, 1, a["row"], a["row"] + 1), Region(bind["table"], 0, vocab, c0, c1)]

    def writes(a, bind):
        c0, c1 = cols(a)
        return [Region(bind["out"], a["row"], a["row"] + 1, c0, c1)]

    return OpSpec(name="embedding", operands=("ids", "table", "out"), args=("row", "col_block"),
                  body="embedding_tile(ids, table, out, row, col_block, H, H, H, BLOCK_H=BLOCK_H)",
                  imports=("from mk.tasks.embedding import embedding_tile",),
                  constexprs={"ROWS": rows, "H": hidden, "BLOCK_H": block_h},
                  num_warps=num_warps or embedding_num_warps(block_h), run=run, reads=reads, writes=writes)


@register("rope_kv")
def rope_kv_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seq: int, *,
               write_seqlens: bool = True, interleaved: bool = False, num_warps: int | None = None) -> OpSpec:
    """RoPE of sequence b's one new token, and its k and v appended to the KV cache.

    Operands: qkv ``[batch, (Hq + 2 Hkv) * D]`` (the fused QKV projection: q heads, then k
    heads, then v heads), pos int32/int64 ``[batch]`` (the token's position, read on the
    device: a decode step needs no host work but advancing it), inv_freq float32 ``[D/2]``,
    q ``[batch, Hq * D]`` (rotated q out), k_cache and v_cache ``[batch, Hkv, max_seq, D]``
    (:mod:`mk.tasks.rope`'s layout), and with ``write_seqlens`` seqlens int32/int64
    ``[batch]``, set to ``pos + 1`` (clipped to ``[0, max_seq]``): the lengths decode
    attention reads, so one positions buffer drives the whole step (let one layer's rope_kv
    write them). ``interleaved``: the rotation pairs are adjacent elements
    (:mod:`mk.tasks.rope`). Args: b.

    Regions: the cache row written is at a runtime position, so the write region is
    conservatively *every* cache row of sequence b (all heads, all positions): attention
    tasks of b, which read their head's rows, then wait for this task (as they must), and
    nothing else of a decode step touches that layer's cache. A position outside
    ``[0, max_seq)`` writes no cache row (the device function's guard; the VM does the same).
    """
    check_sizes("rope_kv", batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 max_seq=max_seq)
    if head_dim % 2:
        raise ValueError(f"rope_kv: head_dim must be even, got {head_dim}")
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    block_h, block_half = rope_blocks(d, max(hq, hkv))
    width = (hq + 2 * hkv) * d
    operands = ("qkv", "pos", "inv_freq", "q", "k_cache", "v_cache") + (("seqlens",) if write_seqlens else ())
    # b in 64 bits: b * (Hkv * S_max * D) passes 2**31 for long caches.
    body = ("rope_kv_tile(qkv, qkv + HQ * HEAD_DIM, qkv + (HQ + HKV) * HEAD_DIM, pos, inv_freq, q, k_cache, v_cache, "
            "b.to(tl.int64), 0, HQ, HKV, S_MAX, "
            "(HQ + 2 * HKV) * HEAD_DIM, 0, HEAD_DIM, (HQ + 2 * HKV) * HEAD_DIM, 0, HEAD_DIM, "
            "(HQ + 2 * HKV) * HEAD_DIM, 0, HEAD_DIM, 1, 0, HQ * HEAD_DIM, 0, HEAD_DIM, "
            "HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, HEAD_DIM, HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, HEAD_DIM, "
            "HALF=HALF, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, INTERLEAVED=INTERLEAVED)")
    if write_seqlens:
        body += "\nrope_kv_seqlen_tile(pos, seqlens, b, 0, 1, 0, S_MAX)"

    def seq(a):
        check_tile("rope_kv", "b", a["b"], batch)
        return a["b"]

    def run(bufs, a):
        b = seq(a)
        qkv = operand_view("rope_kv", "qkv", bufs["qkv"], batch, width)[b].float()
        pos_t = operand_view("rope_kv", "pos", bufs["pos"], 1, batch)[0, b]
        inv_freq = operand_view("rope_kv", "inv_freq", bufs["inv_freq"], 1, d // 2)[0]
        positions = pos_t.reshape(1, 1)
        q_out = operand_view("rope_kv", "q", bufs["q"], batch, hq * d)
        q_out[b] = rope_ref(qkv[:hq * d].view(1, 1, hq, d), positions, inv_freq,
                            interleaved=interleaved).reshape(-1).to(q_out.dtype)
        pos = int(pos_t)
        if 0 <= pos < max_seq:
            kc = operand_view("rope_kv", "k_cache", bufs["k_cache"], batch * hkv * max_seq, d).view(batch, hkv, max_seq, d)
            vc = operand_view("rope_kv", "v_cache", bufs["v_cache"], batch * hkv * max_seq, d).view(batch, hkv, max_seq, d)
            k = qkv[hq * d:(hq + hkv) * d].view(1, 1, hkv, d)
            kc[b, :, pos] = rope_ref(k, positions, inv_freq, interleaved=interleaved)[0, 0].to(kc.dtype)
            vc[b, :, pos] = qkv[(hq + hkv) * d:].view(hkv, d).to(vc.dtype)
        if write_seqlens:
            operand_view("rope_kv", "seqlens", bufs["seqlens"], 1, batch)[0, b] = _length_at(pos, max_seq)

    def reads(a, bind):
        b = seq(a)
        return [Region(bind["qkv"], b, b + 1, 0, width), Region(bind["pos"], 0, 1, b, b + 1),
                Region(bind["inv_freq"], 0, 1, 0, d // 2)]

    def writes(a, bind):
        b = seq(a)
        rows = (b * hkv * max_seq, (b + 1) * hkv * max_seq)
        regs = [Region(bind["q"], b, b + 1, 0, hq * d), Region(bind["k_cache"], *rows, 0, d),
                Region(bind["v_cache"], *rows, 0, d)]
        if write_seqlens:
            regs.append(Region(bind["seqlens"], 0, 1, b, b + 1))
        return regs

    return OpSpec(name="rope_kv", operands=operands, args=("b",), body=body,
                  imports=("from mk.tasks.rope import rope_kv_seqlen_tile, rope_kv_tile",),
                  constexprs={"BATCH": batch, "HQ": hq, "HKV": hkv, "HEAD_DIM": d, "S_MAX": max_seq, "HALF": d // 2,
                              "BLOCK_H": block_h, "BLOCK_HALF": block_half, "SEQLENS": int(write_seqlens),
                              "INTERLEAVED": int(bool(interleaved))},
                  num_warps=num_warps or rope_num_warps(block_h, block_half), run=run, reads=reads, writes=writes)


def _attention_split(seqlen: int, num_splits: int, block_n: int, split: int) -> tuple[int, int]:
    """KV positions [start, end) of ``split``, cut as decode_attention_partial_tile cuts them."""
    split_len = cdiv(cdiv(seqlen, num_splits), block_n) * block_n
    start = split * split_len
    return start, max(start, min(start + split_len, seqlen))


def _run_attention_split(op: str, bufs: dict, b: int, kv: int, s: int, *, batch: int, hq: int, hkv: int, d: int,
                         max_seq: int, splits: int, block_n: int, scale: float, seqlen: int,
                         direct: bool = False) -> None:
    """KV split s of (b, kv) of a sequence of ``seqlen`` keys for its group's query heads, with
    torch (the VM's partial); ``direct``: the split is the sequence's only live one and writes
    out instead."""
    group = hq // hkv
    heads = slice(kv * group, (kv + 1) * group)
    start, end = _attention_split(seqlen, splits, block_n, s)
    q = operand_view(op, "q", bufs["q"], batch, hq * d)[b].view(hq, d)[heads].float()
    o_part = operand_view(op, "o_part", bufs["o_part"], batch * hq, splits * d).view(batch, hq, splits, d)
    lse = operand_view(op, "lse", bufs["lse"], batch * hq, splits).view(batch, hq, splits)
    if end > start:
        kc = operand_view(op, "k_cache", bufs["k_cache"], batch * hkv * max_seq, d).view(batch, hkv, max_seq, d)
        vc = operand_view(op, "v_cache", bufs["v_cache"], batch * hkv * max_seq, d).view(batch, hkv, max_seq, d)
        scores = (q @ kc[b, kv, start:end].float().T) * scale
        m = scores.max(dim=-1, keepdim=True).values
        p = torch.exp(scores - m)
        total = p.sum(dim=-1, keepdim=True)
        y = (p @ vc[b, kv, start:end].float()) / total
        if direct:
            out = operand_view(op, "out", bufs["out"], batch, hq * d)
            out[b, kv * group * d:(kv + 1) * group * d] = y.reshape(-1).to(out.dtype)
            return
        o_part[b, heads, s] = y.to(o_part.dtype)
        lse[b, heads, s] = (m + torch.log(total)).squeeze(-1).to(lse.dtype)
    elif direct:  # no key at all (seqlen 0, never valid): zeros, as the device writes
        out = operand_view(op, "out", bufs["out"], batch, hq * d)
        out[b, kv * group * d:(kv + 1) * group * d] = 0
    else:  # an empty slice: zeros and -inf (weight 0 in the merge)
        o_part[b, heads, s] = 0
        lse[b, heads, s] = float("-inf")


def _run_attention_merge(op: str, bufs: dict, b: int, h: int, *, batch: int, hq: int, d: int, splits: int,
                         live: int | None = None) -> None:
    """out[b, head h] from its splits' partials (the first ``live`` of them, default all),
    with torch (the VM's merge)."""
    live = splits if live is None else live
    lse = operand_view(op, "lse", bufs["lse"], batch * hq, splits)[b * hq + h][:live].float()
    o = operand_view(op, "o_part", bufs["o_part"], batch * hq, splits * d)[b * hq + h].view(splits, d)[:live].float()
    m = lse.max()
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # as the device: no -inf - -inf
    w = torch.exp(lse - m)
    total = w.sum()
    y = (w[:, None] * o).sum(dim=0) / torch.where(total > 0, total, torch.ones_like(total))
    out = operand_view(op, "out", bufs["out"], batch, hq * d)
    out[b, h * d:(h + 1) * d] = y.to(out.dtype)


def _attention_split_reads(bind: dict, b: int, kv: int, *, hq: int, hkv: int, d: int, max_seq: int,
                           lengths: str = "seqlens") -> list:
    """What a split of (b, kv) reads: its heads' q, all max_seq cache rows of (b, kv) (the
    slice it reads depends on the runtime length) and b's length (or position: ``lengths``)."""
    group = hq // hkv
    rows = ((b * hkv + kv) * max_seq, (b * hkv + kv + 1) * max_seq)
    return [Region(bind["q"], b, b + 1, kv * group * d, (kv + 1) * group * d),
            Region(bind["k_cache"], *rows, 0, d), Region(bind["v_cache"], *rows, 0, d),
            Region(bind[lengths], 0, 1, b, b + 1)]


def _attention_length(op: str, bufs: dict, b: int, batch: int, max_seq: int, from_positions: bool) -> int:
    """Sequence b's KV length as the device reads it: seqlens[b], or pos[b] + 1 clipped to
    [0, max_seq] (:func:`mk.tasks.decode_attention.decode_length`)."""
    if from_positions:
        return _length_at(int(operand_view(op, "pos", bufs["pos"], 1, batch)[0, b]), max_seq)
    return int(operand_view(op, "seqlens", bufs["seqlens"], 1, batch)[0, b])


def _length_at(pos: int, max_seq: int) -> int:
    """The KV length once the token at position ``pos`` is cached: pos + 1, clipped to
    [0, max_seq] (what rope_kv writes to seqlens and decode_length computes)."""
    return min(max(pos + 1, 0), max_seq)


#: Strides of q, the caches, o_part and lse, as the attention tiles take them (constexprs).
_ATTENTION_STRIDES = ("HQ * HEAD_DIM, HEAD_DIM, "
                      "HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, HEAD_DIM, HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, "
                      "HEAD_DIM, HQ * NUM_SPLITS * HEAD_DIM, NUM_SPLITS * HEAD_DIM, HEAD_DIM, HQ * NUM_SPLITS, NUM_SPLITS, 1")


def _attention_tile(op: str, batch: int, hkv: int, splits: int):
    """A task's (b, kv_head, split), checked."""
    def tile(a):
        check_tile(op, "b", a["b"], batch)
        check_tile(op, "kv_head", a["kv_head"], hkv)
        check_tile(op, "split", a["split"], splits)
        return a["b"], a["kv_head"], a["split"]
    return tile


@register("decode_attention_partial")
def decode_attention_partial_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seq: int,
                                num_splits: int, *, scale: float | None = None, block_n: int | None = None,
                                num_warps: int | None = None) -> OpSpec:
    """Split ``split`` of sequence b's KV for the query heads of KV head ``kv_head`` (GQA).

    Operands: q ``[batch, Hq * D]`` (rotated, as rope_kv writes it), k_cache and v_cache
    ``[batch, Hkv, max_seq, D]``, seqlens int32/int64 ``[batch]`` (each in ``[1, max_seq]``),
    o_part float32 ``[batch, Hq, num_splits * D]`` and lse float32 ``[batch, Hq, num_splits]``:
    the workspace of :func:`mk.tasks.decode_attention.decode_attention_partials` (same memory;
    o_part's last two dims are merged so that one task's heads × one split, and one merge's
    splits × one head, are each one box of the 2-D view). Args: b, kv_head, split.

    Regions: the slice a split reads depends on the runtime seqlen, so each task declares a
    read of all ``max_seq`` cache rows of its (b, kv_head); it writes exactly its heads' split.
    Pair with :func:`decode_attention_merge_op`.
    """
    check_sizes("decode_attention_partial", batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, max_seq=max_seq, num_splits=num_splits)
    op = "decode_attention_partial"
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_splits > MAX_NUM_SPLITS:
        raise ValueError(f"{op}: num_splits must be <= {MAX_NUM_SPLITS}, got {num_splits}")
    hq, hkv, d, S = num_q_heads, num_kv_heads, head_dim, num_splits
    group = hq // hkv
    cfg = decode_attention_config(hq, hkv, d)
    block_n = check_pow2(op, "block_n", block_n or cfg.block_n, MIN_DOT_DIM)  # tl.dot: >= 16
    scale = 1.0 / d**0.5 if scale is None else float(scale)
    body = ("decode_attention_partial_tile(q, k_cache, v_cache, seqlens, o_part, lse, b.to(tl.int64), kv_head, "
            "split, NUM_SPLITS, SCALE, " + _ATTENTION_STRIDES + ", "
            "GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)")

    tile = _attention_tile(op, batch, hkv, S)

    def run(bufs, a):
        b, kv, s = tile(a)
        _run_attention_split(op, bufs, b, kv, s, batch=batch, hq=hq, hkv=hkv, d=d, max_seq=max_seq, splits=S,
                             seqlen=_attention_length(op, bufs, b, batch, max_seq, from_positions=False),
                             block_n=block_n, scale=scale)

    def reads(a, bind):
        return _attention_split_reads(bind, *tile(a)[:2], hq=hq, hkv=hkv, d=d, max_seq=max_seq)

    def writes(a, bind):
        b, kv, s = tile(a)
        r0, r1 = b * hq + kv * group, b * hq + (kv + 1) * group
        return [Region(bind["o_part"], r0, r1, s * d, (s + 1) * d), Region(bind["lse"], r0, r1, s, s + 1)]

    return OpSpec(name=op, operands=("q", "k_cache", "v_cache", "seqlens", "o_part", "lse"),
                  args=("b", "kv_head", "split"), body=body,
                  imports=("from mk.tasks.decode_attention import decode_attention_partial_tile",),
                  constexprs={"BATCH": batch, "HQ": hq, "HKV": hkv, "HEAD_DIM": d, "S_MAX": max_seq, "NUM_SPLITS": S,
                              "GROUP": group, "BLOCK_G": cfg.block_g, "BLOCK_N": block_n, "BLOCK_D": cfg.block_d,
                              "SCALE": scale},
                  num_warps=num_warps or cfg.num_warps, run=run, reads=reads, writes=writes)


@register("decode_attention")
def decode_attention_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seq: int,
                        num_splits: int, *, scale: float | None = None, block_n: int | None = None,
                        num_warps: int | None = None, from_positions: bool = False) -> OpSpec:
    """Decode attention in one phase: split ``split`` of sequence b's KV for the query heads
    of KV head ``kv_head`` (as :func:`decode_attention_partial_op`), and the group's last
    split to finish merges the group's heads into out (as :func:`decode_attention_merge_op`).

    Operands: those of the partial op, then arrivals int32 ``[batch * Hkv]`` (zeros; left
    zero by every complete launch, see :attr:`OpSpec.sync_operands`) and out
    ``[batch, Hq * D]``. Args: b, kv_head, split.

    Only the live splits (those holding a key at the runtime length) work: with one, split 0
    writes out itself (no partial, no count, no merge); with more, the last of them merges
    the live partials. The splits of one (b, kv_head) are a team (:attr:`OpSpec.team`):
    none waits for another. Each declares the whole team's regions (any of them may be the
    one that writes out): reads of the group's partials, writes of its own partial, the
    group's counter and the group's heads of out. A consumer of out therefore waits for all
    of the group's splits, and the one that writes out signals after it.

    ``from_positions``: the operand seqlens is replaced by the step's positions pos int32
    ``[batch]`` and the length is pos[b] + 1 (:func:`mk.tasks.decode_attention.decode_length`,
    what the step's QKV tiles write to seqlens), read before the task's wait: positions
    change only between steps, so one memory round trip leaves the chain from the QKV tiles
    to the O projection. The splits past the live ones then skip their dependency wait too
    (:attr:`OpSpec.waits_in_body`): they read and write nothing, and a consumer still waits
    for split 0, which is always live and waits. (At a short context most of the splits
    planned for the cache's length are past it: 1B batch 8, 3 of 4.)
    """
    op = "decode_attention"
    part = decode_attention_partial_op(batch, num_q_heads, num_kv_heads, head_dim, max_seq, num_splits,
                                       scale=scale, block_n=block_n, num_warps=num_warps)
    hq, hkv, d, S = num_q_heads, num_kv_heads, head_dim, num_splits
    group = hq // hkv
    c = part.constexprs
    lengths = "pos" if from_positions else "seqlens"
    # The length before the wait: exact from the positions; from seqlens maybe the last step's
    # (good enough for the prefetch's hint, read again after the wait).
    preload = ("attn_len = decode_length(pos, b.to(tl.int64), S_MAX)\n" if from_positions else
               "if GPU:\n    attn_len = tl.load(seqlens + b.to(tl.int64), volatile=True)\n")
    # The K/V lines of the slice into L2 while the task waits (inline PTX: compiled code only).
    preload += ("if GPU:\n    decode_attention_prefetch(k_cache, v_cache, attn_len, b.to(tl.int64), kv_head, split, "
                "NUM_SPLITS, S_MAX, HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, HEAD_DIM, HKV * S_MAX * HEAD_DIM, "
                "S_MAX * HEAD_DIM, HEAD_DIM, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)")
    # With the exact length before the wait, only the live splits wait for their inputs.
    wait = ("if split < decode_live_splits(attn_len, NUM_SPLITS, BLOCK_N=BLOCK_N):\n"
            "    ok, last_ev, last_need, t_ready = task_wait(task_wait_args, task_wait_state, TASK_WAIT_FLAGS)\n"
            if from_positions else "")
    body = wait + ("decode_attention_tile(q, k_cache, v_cache, "
            + ("attn_len, " if from_positions else "tl.load(seqlens + b.to(tl.int64)), ") +
            "o_part, lse, arrivals, out, b.to(tl.int64), "
            "kv_head, split, HKV, NUM_SPLITS, SCALE, " + _ATTENTION_STRIDES + ", HQ * HEAD_DIM, HEAD_DIM, "
            "GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_S=BLOCK_S, "
            "BLOCK_GROUP=BLOCK_GROUP)")

    tile = _attention_tile(op, batch, hkv, S)

    def run(bufs, a):
        b, kv, s = tile(a)
        seqlen = _attention_length(op, bufs, b, batch, max_seq, from_positions)
        live = live_splits(seqlen, S, c["BLOCK_N"])
        if s >= live:  # past the sequence: nothing to do
            return
        _run_attention_split(op, bufs, b, kv, s, batch=batch, hq=hq, hkv=hkv, d=d, max_seq=max_seq, splits=S,
                             block_n=c["BLOCK_N"], scale=c["SCALE"], direct=live == 1, seqlen=seqlen)
        if live == 1:  # split 0 wrote out itself
            return
        arrivals = operand_view(op, "arrivals", bufs["arrivals"], 1, batch * hkv)[0]
        arrivals[b * hkv + kv] += 1
        if int(arrivals[b * hkv + kv]) == live:
            arrivals[b * hkv + kv] = 0
            for h in range(kv * group, (kv + 1) * group):
                _run_attention_merge(op, bufs, b, h, batch=batch, hq=hq, d=d, splits=S, live=live)

    def reads(a, bind):
        b, kv, _ = tile(a)
        r0, r1 = b * hq + kv * group, b * hq + (kv + 1) * group
        return (_attention_split_reads(bind, b, kv, hq=hq, hkv=hkv, d=d, max_seq=max_seq, lengths=lengths)
                + [Region(bind["o_part"], r0, r1, 0, S * d), Region(bind["lse"], r0, r1, 0, S)])

    def writes(a, bind):
        b, kv, s = tile(a)
        r0, r1 = b * hq + kv * group, b * hq + (kv + 1) * group
        return [Region(bind["o_part"], r0, r1, s * d, (s + 1) * d), Region(bind["lse"], r0, r1, s, s + 1),
                Region(bind["arrivals"], 0, 1, b * hkv + kv, b * hkv + kv + 1),
                Region(bind["out"], b, b + 1, kv * group * d, (kv + 1) * group * d)]

    operands = tuple(lengths if role == "seqlens" else role for role in part.operands) + ("arrivals", "out")
    return OpSpec(name=op, operands=operands, args=part.args, body=body, preload=preload,
                  imports=("from mk.tasks.decode_attention import decode_attention_prefetch, decode_attention_tile, "
                           "decode_length, decode_live_splits",),
                  constexprs={**c, "BLOCK_S": 1 << (S - 1).bit_length(), "BLOCK_GROUP": 1 << (group - 1).bit_length(),
                              "FROM_POSITIONS": int(from_positions)},
                  num_warps=part.num_warps, run=run, waits_in_body=from_positions,
                  reads=reads, writes=writes, team=lambda a: (a["b"], a["kv_head"]), sync_operands=("arrivals",))


@register("decode_attention_merge")
def decode_attention_merge_op(batch: int, num_q_heads: int, head_dim: int, num_splits: int, *,
                              num_warps: int = 4) -> OpSpec:
    """out[b, q_head] = the log-sum-exp weighted mean of its ``num_splits`` partials.

    Operands: o_part float32 ``[batch, Hq, num_splits * D]`` and lse float32
    ``[batch, Hq, num_splits]`` (from :func:`decode_attention_partial_op` with the same
    sizes), out ``[batch, Hq * D]`` (what the O projection reads). Args: b, q_head.
    """
    op = "decode_attention_merge"
    check_sizes(op, batch=batch, num_q_heads=num_q_heads, head_dim=head_dim, num_splits=num_splits)
    if num_splits > MAX_NUM_SPLITS:
        raise ValueError(f"{op}: num_splits must be <= {MAX_NUM_SPLITS}, got {num_splits}")
    hq, d, S = num_q_heads, head_dim, num_splits
    block_s, block_d = 1 << (S - 1).bit_length(), 1 << (d - 1).bit_length()
    body = ("decode_attention_merge_tile(o_part, lse, out, b, q_head, NUM_SPLITS, "
            "HQ * NUM_SPLITS * HEAD_DIM, NUM_SPLITS * HEAD_DIM, HEAD_DIM, HQ * NUM_SPLITS, NUM_SPLITS, 1, "
            "HQ * HEAD_DIM, HEAD_DIM, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, CACHE='.cg')")

    def head(a):
        check_tile(op, "b", a["b"], batch)
        check_tile(op, "q_head", a["q_head"], hq)
        return a["b"], a["q_head"]

    def run(bufs, a):
        _run_attention_merge(op, bufs, *head(a), batch=batch, hq=hq, d=d, splits=S)

    def reads(a, bind):
        b, h = head(a)
        r = b * hq + h
        return [Region(bind["o_part"], r, r + 1, 0, S * d), Region(bind["lse"], r, r + 1, 0, S)]

    def writes(a, bind):
        b, h = head(a)
        return [Region(bind["out"], b, b + 1, h * d, (h + 1) * d)]

    return OpSpec(name=op, operands=("o_part", "lse", "out"), args=("b", "q_head"), body=body,
                  imports=("from mk.tasks.decode_attention import decode_attention_merge_tile",),
                  constexprs={"BATCH": batch, "HQ": hq, "HEAD_DIM": d, "NUM_SPLITS": S, "BLOCK_S": block_s,
                              "BLOCK_D": block_d},
                  num_warps=num_warps, run=run, reads=reads, writes=writes)


class _ArgmaxShape:
    """Chunking of argmax over ``[rows, vocab]`` logits, as :func:`mk.tasks.argmax.argmax` cuts it."""

    def __init__(self, op: str, rows: int, vocab: int, block_v: int | None):
        check_sizes(op, rows=rows, vocab=vocab)
        try:
            self.block_v = argmax_block_v(vocab) if block_v is None else check_block_v(block_v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{op}: {e}") from None
        self.rows, self.vocab, self.op = rows, vocab, op
        self.chunks = cdiv(vocab, self.block_v)

    def row(self, a) -> int:
        check_tile(self.op, "row", a["row"], self.rows)
        return a["row"]

    def chunk(self, a) -> tuple[int, int, int]:
        """(chunk, first column, end column) of a partial task, clipped at vocab."""
        check_tile(self.op, "chunk", a["chunk"], self.chunks)
        c0 = a["chunk"] * self.block_v
        return a["chunk"], c0, min(c0 + self.block_v, self.vocab)

    def parts(self, bufs):
        return (operand_view(self.op, "part_val", bufs["part_val"], self.rows, self.chunks),
                operand_view(self.op, "part_idx", bufs["part_idx"], self.rows, self.chunks))


@register("argmax_partial")
def argmax_partial_op(rows: int, vocab: int, *, block_v: int | None = None, num_warps: int = 4) -> OpSpec:
    """Max and its index over chunk ``chunk`` of logits row ``row`` (torch.argmax's order).

    Operands: logits ``[rows, vocab]``, part_val float32 and part_idx int32
    ``[rows, n_chunks]`` (``n_chunks = cdiv(vocab, BLOCK_V)``; BLOCK_V defaults to
    :func:`mk.tasks.argmax.argmax_block_v`). Args: row, chunk. Pair with
    :func:`argmax_reduce_op` of the same sizes.
    """
    s = _ArgmaxShape("argmax_partial", rows, vocab, block_v)

    def run(bufs, a):
        row = s.row(a)
        chunk, c0, c1 = s.chunk(a)
        x = operand_view(s.op, "logits", bufs["logits"], rows, vocab)[row, c0:c1].float()
        i = int(x.argmax())  # the first of equal maxima; NaN wins, as on the device
        part_val, part_idx = s.parts(bufs)
        part_val[row, chunk] = x[i]
        part_idx[row, chunk] = c0 + i

    def reads(a, bind):
        row, (_, c0, c1) = s.row(a), s.chunk(a)
        return [Region(bind["logits"], row, row + 1, c0, c1)]

    def writes(a, bind):
        row, (chunk, _, _) = s.row(a), s.chunk(a)
        return [Region(bind[r], row, row + 1, chunk, chunk + 1) for r in ("part_val", "part_idx")]

    return OpSpec(name="argmax_partial", operands=("logits", "part_val", "part_idx"), args=("row", "chunk"),
                  body="argmax_partial_tile(logits, part_val, part_idx, row, chunk, V, V, N_CHUNKS, BLOCK_V=BLOCK_V)",
                  imports=("from mk.tasks.argmax import argmax_partial_tile",),
                  constexprs={"ROWS": rows, "V": vocab, "BLOCK_V": s.block_v, "N_CHUNKS": s.chunks},
                  num_warps=num_warps, run=run, reads=reads, writes=writes)


@register("argmax_reduce")
def argmax_reduce_op(rows: int, vocab: int, *, block_v: int | None = None, num_warps: int = 4) -> OpSpec:
    """Combine row ``row``'s chunk partials: out_idx[row] and out_val[row] (deterministic).

    Operands: part_val float32 and part_idx int32 ``[rows, n_chunks]`` (from
    :func:`argmax_partial_op` with the same sizes), out_idx int32/int64 ``[rows]`` (1-D: it
    can be the next step's token ids of :func:`embedding_op`), out_val float32 ``[rows]``.
    Args: row.
    """
    s = _ArgmaxShape("argmax_reduce", rows, vocab, block_v)

    def run(bufs, a):
        row = s.row(a)
        part_val, part_idx = s.parts(bufs)
        # Chunks cover increasing columns, so the first of equal chunk maxima holds the lowest index.
        c = int(part_val[row].argmax())
        operand_view(s.op, "out_idx", bufs["out_idx"], 1, rows)[0, row] = int(part_idx[row, c])
        operand_view(s.op, "out_val", bufs["out_val"], 1, rows)[0, row] = part_val[row, c]

    def reads(a, bind):
        row = s.row(a)
        return [Region(bind[r], row, row + 1, 0, s.chunks) for r in ("part_val", "part_idx")]

    def writes(a, bind):
        row = s.row(a)
        return [Region(bind[r], 0, 1, row, row + 1) for r in ("out_idx", "out_val")]

    return OpSpec(name="argmax_reduce", operands=("part_val", "part_idx", "out_idx", "out_val"), args=("row",),
                  body="argmax_reduce_tile(part_val, part_idx, out_idx, out_val, row, N_CHUNKS, N_CHUNKS, "
                       "BLOCK_C=BLOCK_C)",
                  imports=("from mk.tasks.argmax import argmax_reduce_tile",),
                  constexprs={"ROWS": rows, "N_CHUNKS": s.chunks, "BLOCK_C": argmax_block_c(s.chunks)},
                  num_warps=num_warps, run=run, reads=reads, writes=writes)


@register("sample_gumbel_partial")
def sample_gumbel_partial_op(rows: int, vocab: int, *, block_v: int | None = None, num_warps: int = 4) -> OpSpec:
    """Temperature sampling, chunk ``chunk`` of row ``row``: the best ``logits / T + gumbel``.

    Operands: logits ``[rows, vocab]``, params float32 ``[1]`` (the temperature T > 0),
    seed int64 ``[1]``, offsets int32/int64 ``[rows]`` (the Philox offset of each row's draw:
    the position of the token being drawn, so every step draws afresh), part_val float32
    and part_idx int32 ``[rows, n_chunks]``. Args: row, chunk. Pair with
    :func:`argmax_reduce_op` of the same sizes: together they are
    :func:`mk.tasks.sample.sample` without top-k/top-p, token for token.
    """
    s = _ArgmaxShape("sample_gumbel_partial", rows, vocab, block_v)

    def run(bufs, a):
        from mk.tasks.sample import gumbel_noise, scale_logits_ref

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
                  num_warps=num_warps, run=run, reads=reads, writes=writes)


@register("append_token")
def append_token_op(batch: int, max_seq: int, from_best: bool = False) -> OpSpec:
    """Sequence b's new token into its history, and its position advanced (see
    :mod:`mk.tasks.append_token`). Operands: next_ids ``[batch]``, pos ``[batch]``, tokens
    ``[batch, max_seq]`` (int32/int64). Args: b. The history row is written at a runtime
    position, so the task declares the whole row; reading and writing ``pos[b]`` orders it
    after every task of the step that reads the position. ``from_best``: the token is the
    argmax an LM head folded into operand best int64 ``[batch]`` (:func:`linear_op`'s
    ``argmax``); the task writes it to next_ids[b] and zeroes best[b] for the next step
    (:func:`mk.tasks.argmax.argmax_take`)."""
    check_sizes("append_token", batch=batch, max_seq=max_seq)

    def seq(a):
        check_tile("append_token", "b", a["b"], batch)
        return a["b"]

    def run(bufs, a):
        b = seq(a)
        next_ids = operand_view("append_token", "next_ids", bufs["next_ids"], 1, batch)[0]
        if from_best:
            best = operand_view("append_token", "best", bufs["best"], 1, batch)[0]
            next_ids[b] = argmax_unpack_ref(best[b])
            best[b] = 0
        pos = operand_view("append_token", "pos", bufs["pos"], 1, batch)[0]
        tokens = operand_view("append_token", "tokens", bufs["tokens"], batch, max_seq)
        p = int(pos[b])
        if p + 1 < max_seq:
            tokens[b, p + 1] = next_ids[b]
            pos[b] = p + 1

    def reads(a, bind):
        b = seq(a)
        return [Region(bind["best" if from_best else "next_ids"], 0, 1, b, b + 1), Region(bind["pos"], 0, 1, b, b + 1)]

    def writes(a, bind):
        b = seq(a)
        regs = [Region(bind["pos"], 0, 1, b, b + 1), Region(bind["tokens"], b, b + 1, 0, max_seq)]
        if from_best:
            regs += [Region(bind["next_ids"], 0, 1, b, b + 1), Region(bind["best"], 0, 1, b, b + 1)]
        return regs

    body = "append_token_tile(next_ids, pos, tokens, b, MAX_SEQ, MAX_SEQ)"
    if from_best:
        body = "append_token_tile(next_ids, pos, tokens, b, MAX_SEQ, MAX_SEQ, tok=argmax_take(best, b)[0])"
    return OpSpec(name="append_token", operands=("next_ids", "pos", "tokens") + (("best",) if from_best else ()),
                  args=("b",), body=body,
                  imports=("from mk.tasks.append_token import append_token_tile",
                           "from mk.tasks.argmax import argmax_take"),
                  constexprs={"BATCH": batch, "MAX_SEQ": max_seq, **({"FROM_BEST": 1} if from_best else {})},
                  num_warps=1, run=run, reads=reads, writes=writes, sync_operands=("best",) if from_best else ())


def op_tiles(spec: OpSpec, rows: int | None = None) -> list[dict]:
    """Descriptor args of every task of one whole op, in the order a graph should add them.

    Linear ops as :func:`linear_tiles`; rmsnorm and silu_mul need ``rows`` (their ops do not
    fix it); the decode-step ops above know their batch. Attention partials come in
    (b, kv_head, split) order, all splits of a head together.
    """
    c = spec.constexprs
    if spec.name in ("linear", "linear_partial", "linear_reduce", "qkv_rope_kv", "qkv_rope_kv_reduce"):
        return linear_tiles(spec)
    if spec.name in ("rmsnorm", "silu_mul"):
        if rows is None:
            raise ValueError(f"op_tiles: {spec.name} needs rows")
        if spec.name == "rmsnorm":
            return [{"row": r} for r in range(rows)]
        return [{"row": r, "col_block": cb} for r in range(rows) for cb in range(cdiv(c["I"], c["BLOCK_I"]))]
    if spec.name == "embedding":
        return [{"row": r, "col_block": cb} for r in range(c["ROWS"]) for cb in range(cdiv(c["H"], c["BLOCK_H"]))]
    if spec.name == "rope_kv":
        return [{"b": b} for b in range(c["BATCH"])]
    if spec.name in ("decode_attention_partial", "decode_attention"):
        return [{"b": b, "kv_head": kv, "split": s} for b in range(c["BATCH"]) for kv in range(c["HKV"])
                for s in range(c["NUM_SPLITS"])]
    if spec.name == "decode_attention_merge":
        return [{"b": b, "q_head": h} for b in range(c["BATCH"]) for h in range(c["HQ"])]
    if spec.name in ("argmax_partial", "sample_gumbel_partial"):
        return [{"row": r, "chunk": k} for r in range(c["ROWS"]) for k in range(c["N_CHUNKS"])]
    if spec.name == "argmax_reduce":
        return [{"row": r} for r in range(c["ROWS"])]
    if spec.name == "append_token":
        return [{"b": b} for b in range(c["BATCH"])]
    raise ValueError(f"op_tiles: unknown op {spec.name!r}")
