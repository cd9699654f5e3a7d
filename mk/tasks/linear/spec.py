"""The linear ops of the megakernel: one tile (or a run of tiles) of ``y = x @ W.T`` with its
epilogue (:func:`linear_op`), split-K partials (:func:`linear_partial_op`) and their reduce
(:func:`linear_reduce_op`), as :class:`~mk.tasks._spec.OpSpec` factories. A megakernel tile
is exactly the tile the launcher would run: :class:`LinearShape` resolves it with the
launcher's own config check and row-tile rule. The fused QKV + RoPE ops
(:mod:`mk.tasks.qkv_rope`) build on the same shape.
"""

from __future__ import annotations

import torch

from .._device import default_dtype
from .._spec import OpSpec, Region, as_2d, cdiv, check_sizes, check_tile, register
from ..all_reduce import (RANKS_SUM_IMPORT, RANKS_SUM_OPERANDS, _check_rank, ranks_sum_ref, ranks_sum_regions,
                          ranks_sum_tail)
from ..argmax import argmax_pack_ref
from .format import SCALE_BLOCK, SCALE_BLOCK_CODE, SCALE_CHANNEL, SCALE_NONE, expand_columns
from .config import (LinearConfig, check_config, tile_rows, dot_waits_in_stream, gemv_stream, linear_config,
                     linear_k_splits, prefetch_lines)


class LinearShape:
    """Tile geometry shared by the linear ops, resolved once as the launcher would.

    Buffers: x ``[M, K]``, w ``[N, K]`` (gate/up interleaved with silu_mul), norm_w ``[K]``,
    res and out ``[M, n_out]`` (n_out = N/2 with silu_mul), ws ``[split_k, M, N]``
    float32 (2-D view ``[split_k*M, N]``).
    """

    def __init__(self, op, M, N, K, split_k, block_m, block_n, block_k, num_warps, residual, silu_mul,
                 prefetch_k, dtype, tiles_per_task=1, w_scale=0):
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
        check_config(cfg, K, silu_mul)  # the launcher's own checks, same messages
        self.config = cfg
        self.M, self.N, self.K, self.split_k = M, N, K, split_k
        # Rows per tile as the launcher runs them (tl.dot tiles cut down to what M needs).
        self.bm, self.bn, self.bk = tile_rows(cfg, M), cfg.block_n, cfg.block_k
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
        # The weight's format's scales (mk.tasks.linear.format): 0 none, 1 per output channel,
        # 2 per row and 128 columns (a chunk then lies within one 128-column block).
        if w_scale not in (SCALE_NONE, SCALE_CHANNEL, SCALE_BLOCK_CODE):
            raise ValueError(f"{op}: w_scale must be 0, 1 or 2 (mk.tasks.linear.format), got {w_scale!r}")
        if w_scale == SCALE_BLOCK_CODE and SCALE_BLOCK % self.bk:
            raise ValueError(f"{op}: a weight scaled per {SCALE_BLOCK} columns needs block_k dividing "
                             f"{SCALE_BLOCK}, got {self.bk}")
        self.w_scale = w_scale

    def constexprs(self) -> dict:
        return {"M": self.M, "N": self.N, "K": self.K, "N_OUT": self.n_out, "BLOCK_M": self.bm,
                "BLOCK_N": self.bn, "BLOCK_K": self.bk, "PREFETCH_LINES": self.prefetch_lines, "LINE": self.line,
                "PREFETCH_BULK": self.bulk, "TILES_PER_TASK": self.run, "TILES_N": self.tiles_n,
                **({"W_SCALE": self.w_scale} if self.w_scale else {})}

    # The weight's format: its scales' operand, the tile calls' arguments, the VM's weights.

    @property
    def scale_operands(self) -> tuple[str, ...]:
        """Operand ``w_scale`` (float32 ``[N]`` or ``[N, ceil(K / 128)]``) when the weight has scales."""
        return ("w_scale",) if self.w_scale else ()

    @property
    def scale_kwargs(self) -> str:
        """What a tile call adds for the weight's scales (nothing without them)."""
        return ", w_scale_ptr=w_scale, W_SCALE=W_SCALE" if self.w_scale else ""

    def scale_regions(self, bind, n0: int, n1: int) -> list:
        """The scales of weight rows [n0, n1) a task reads."""
        return [Region(bind["w_scale"], n0, n1, 0, self.scale_cols)] if self.w_scale else []

    @property
    def scale_cols(self) -> int:
        return cdiv(self.K, SCALE_BLOCK) if self.w_scale == SCALE_BLOCK_CODE else 1

    def weights_ref(self, b, n0: int, n1: int) -> torch.Tensor:
        """VM: weight rows [n0, n1) as float32, their format's scales applied."""
        w = as_2d(b["w"])[n0:n1].float()
        if self.w_scale == SCALE_CHANNEL:
            return w * b["w_scale"].reshape(-1)[n0:n1].float()[:, None]
        if self.w_scale == SCALE_BLOCK_CODE:
            return w * expand_columns(b["w_scale"].reshape(self.N, -1)[n0:n1].float(), self.K)
        return w

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
                f"BLOCK_K=BLOCK_K, TMA_STAGES=TMA_STAGES{self.scale_kwargs}")
        if wait:
            call = ("ok, last_ev, last_need, t_ready = " + call + ", WAIT=task_wait, wait_args=task_wait_args, "
                    "wait_state=task_wait_state, WAIT_FLAGS=TASK_WAIT_FLAGS, X_GROUP=X_GROUP, X_STAGES=X_STAGES")
        return f"EPILOGUE_FLAGS: tl.constexpr = {f'({flags},)' if flags else None}\n{call})"

    def task_args(self, splits: int | None = None) -> list[dict]:
        """Args of every task: (pid_m, pid_n) in row-major order, pid_n counting runs of
        tiles; with ``splits``, each tile's K splits together (``split``)."""
        tiles = [{"pid_m": m, "pid_n": n} for m in range(self.tiles_m) for n in range(self.tasks_n)]
        if splits is None:
            return tiles
        return [{**t, "split": k} for t in tiles for k in range(splits)]

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
        # A tile of all M rows reads one box of the view: every split's rows are adjacent.
        bands = ([(0, self.split_k * self.M)] if (r0, r1) == (0, self.M) else
                 [self.ws_rows(split, r0, r1) for split in range(self.split_k)])
        regs = [Region(bind["ws"], w0, w1, n0, n1) for w0, w1 in bands]
        if norm_sq:
            col = self.N + n0 // self.sq_bn
            regs += [Region(bind["ws"], w0, w1, col, col + 1) for w0, w1 in bands]
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


def _tma_stages(s: "LinearShape", K: int, tma_stages: int, dtype: torch.dtype | None) -> int:
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


def prologue_ref(x: torch.Tensor, norm_w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x rows in float32, RMSNorm-ed over their full length when norm_w is given."""
    h = x.float()
    if norm_w is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w.reshape(-1).float()
    return h


def weight_streaming(s: "LinearShape", K: int, tma_stages: int, dtype, double_buffer: bool,
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


def _ranks_box(s: "LinearShape", a: dict) -> tuple[int, int, int, int]:
    """Task ``a``'s box (r0, r1, c0, c1) when it sums over the ranks."""
    r0, r1, _, _, c0, c1 = s.tile(a)
    return r0, r1, c0, c1


#: A full-K tile's L2 weight prefetch, issued by the dispatch loop before the task's wait.
FULL_K_PREFETCH = ("linear_prefetch_tile(w, pid_n, N, 0, K, K, PREFETCH_LINES=PREFETCH_LINES * GPU, LINE=LINE, "
                    "BLOCK_N=BLOCK_N, BULK=PREFETCH_BULK)")


@register("linear")
def linear_op(M: int, N: int, K: int, *, block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None, num_warps: int | None = None, residual: bool = False,
              norm: bool = False, eps: float = 1e-6, silu_mul: bool = False, prefetch_k: int = 0,
              double_buffer: bool = True, preload_weights: bool | None = None, tma_stages: int = 0,
              tiles_per_task: int = 1, argmax: bool = False, all_reduce: int = 0,
              dtype: torch.dtype | None = None, w_scale: int = 0) -> OpSpec:
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
    :func:`mk.tasks.append_token.append_token_op` with ``from_best`` takes. Its tasks of one row block are then a
    team (:attr:`OpSpec.team`): they all write best's rows, in any order.

    ``all_reduce`` = world > 0: one rank's share of a tensor-parallel projection whose task
    also sums its columns over the ranks. It stores its float32 partial into out, pushes it
    to every rank's recv and writes ``total = res + every rank's partial`` once theirs have
    come (rank order, the same bits on every rank; :func:`mk.tasks.all_reduce.exchange_box`):
    the all-reduce with no phase of its own. Operands res, total ``[M, N]``, recv int64
    ``[world, M, N]`` (symmetric), peers int64 ``[world]`` besides; args rank and hop (the
    all-reduce's index in the step, :func:`mk.tasks.all_reduce.hop_tag`).

    ``w_scale``: the weight's format's scales (:mod:`mk.tasks.linear.format`: 1 per output
    channel, 2 per row and 128 columns), operand w_scale float32 after w; ``dtype`` is then
    the stored weight's (FP8 on a GPU).
    """
    s = LinearShape("linear", M, N, K, 1, block_m, block_n, block_k, num_warps, residual, silu_mul,
                     prefetch_k, dtype, tiles_per_task, w_scale)
    if argmax and (residual or silu_mul):
        raise ValueError("linear: the argmax folds an LM head's logits; no residual or silu_mul epilogue")
    if all_reduce and (argmax or residual or silu_mul or norm):
        raise ValueError("linear: a tile summed over the ranks (all_reduce) has no argmax, residual, silu_mul or "
                         "norm of its own")
    tma, double_buffer, preload = weight_streaming(s, K, tma_stages, dtype, double_buffer, preload_weights)
    operands = ("x", "w") + s.scale_operands + (("norm_w",) if norm else ()) + (("res",) if residual else ())
    operands += ("out",) + (("best",) if argmax else ())
    operands += RANKS_SUM_OPERANDS if all_reduce else ()
    # Unused pointer operands get a harmless real pointer, as the launcher does.
    norm_w, res = ("norm_w" if norm else "w"), ("res" if residual else "out")
    eps_src = "EPS" if norm else "0.0"
    body = (f"linear_tile(x, w, {norm_w}, {res}, out, pid_m, pid_n, M, N, K, 0, K, K, K, N_OUT, N_OUT, {eps_src}, "
            f"HAS_NORM=HAS_NORM, HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, "
            f"BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOUBLE_BUFFER=DOUBLE_BUFFER, "
            f"TMA_STAGES=TMA_STAGES{', w_first=w_first' if preload else ''}"
            f"{', argmax_best=best' if argmax else ''}{s.scale_kwargs})")
    body = s.waiting(body, tma)
    if s.streams_in_run(tma):
        if argmax:
            body = s.run_body(norm, "0, K", "linear_argmax_epilogue", "out, M, N, N, best", wait=s.waits_in_body(tma))
        else:
            body = s.run_body(norm, "0, K", "linear_store_epilogue", f"{res}, out, M, N, N_OUT, N_OUT",
                              "HAS_RESIDUAL, SILU_MUL", wait=s.waits_in_body(tma))
    if all_reduce:  # the task's columns summed over the ranks, once its partial is stored
        ranks_body, ranks_constexprs = ranks_sum_tail(s.bm, s.bn * s.run, all_reduce, M, N)
        body += ranks_body
    prefetch = FULL_K_PREFETCH
    constexprs = {**s.constexprs(), "HAS_NORM": int(norm), "HAS_RESIDUAL": int(residual), "SILU_MUL": int(silu_mul),
                  **s.stream_constexprs(tma),
                  "DOUBLE_BUFFER": int(bool(double_buffer) and s.bm == 1)}
    if argmax:
        constexprs["ARGMAX"] = 1  # its own branch (a branch's key is its name and constexprs)
    if all_reduce:
        constexprs.update(ranks_constexprs)
    if norm:
        constexprs["EPS"] = float(eps)

    def run(b, a):
        r0, r1, n0, n1, _, _ = s.tile(a)
        if all_reduce:  # every rank's partial of these columns (the VM hands over theirs as @x, @w)
            _check_rank("linear", b, a, "x")
            scales = b.get("@w_scale", [None] * len(b["@w"]))
            parts = [as_2d(x)[r0:r1].float() @ s.weights_ref({"w": w, "w_scale": sc}, n0, n1).T
                     for x, w, sc in zip(b["@x"], b["@w"], scales)]
            s.store(b, a, parts[a["rank"]], False)
            ranks_sum_ref(b, _ranks_box(s, a), parts)
            return
        h = prologue_ref(as_2d(b["x"])[r0:r1], b["norm_w"] if norm else None, eps)
        s.store(b, a, h @ s.weights_ref(b, n0, n1).T, residual)
        if argmax:  # the run's columns of the logits as stored, folded into best
            packed = argmax_pack_ref(as_2d(b["out"])[r0:r1, n0:n1], torch.arange(n0, n1)).amax(dim=1)
            best = b["best"].view(-1)
            best[r0:r1] = torch.maximum(best[r0:r1], packed.to(best.device))

    def reads(a, bind):
        r0, r1, n0, n1, c0, c1 = s.tile(a)
        regs = [Region(bind["x"], r0, r1, 0, K), Region(bind["w"], n0, n1, 0, K)] + s.scale_regions(bind, n0, n1)
        if norm:
            regs.append(Region(bind["norm_w"], 0, 1, 0, K))
        if residual or all_reduce:
            regs.append(Region(bind["res"], r0, r1, c0, c1))
        return regs

    def writes(a, bind):
        regs = s.out_regions(a, bind)
        if argmax:
            r0, r1 = s.tile(a)[:2]
            regs.append(Region(bind["best"], 0, 1, r0, r1))
        if all_reduce:
            regs += ranks_sum_regions(bind, _ranks_box(s, a))
        return regs

    preload_src = ("w_first = linear_weights_first(w, pid_n, N, 0, K, K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)"
                   if preload else "")
    constexprs["PRELOAD"] = int(preload)
    return OpSpec(name="linear", operands=operands, args=("pid_m", "pid_n") + (("rank", "hop") if all_reduce else ()),
                  body=body, prefetch=prefetch, preload=preload_src, waits_in_body=s.task_waits(tma),
                  team=(lambda a: a["pid_m"]) if argmax else None,
                  sync_operands=("best",) if argmax else ("recv",) if all_reduce else (),
                  # (The VM computes every rank's partial from their x and w; the GPU reads their stores.)
                  peer_operands=("x", "w") + s.scale_operands if all_reduce else (),
                  imports=("from mk.tasks.linear import linear_argmax_epilogue, linear_prefetch_tile, linear_run, "
                           "linear_store_epilogue, linear_tile, linear_weights_first",)
                  + ((RANKS_SUM_IMPORT,) if all_reduce else ()),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=writes,
                  tiles=lambda _: s.task_args())


@register("linear_partial")
def linear_partial_op(M: int, N: int, K: int, split_k: int, *, block_m: int | None = None,
                      block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                      norm: bool = False, eps: float = 1e-6, prefetch_k: int = 0, double_buffer: bool = True,
                      tma_stages: int = 0, tiles_per_task: int = 1, dtype: torch.dtype | None = None,
                      w_scale: int = 0) -> OpSpec:
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
    ``w_scale``: as :func:`linear_op` (the partial is finished by it, the reduce sums finished partials).
    """
    s = LinearShape("linear_partial", M, N, K, split_k, block_m, block_n, block_k, num_warps, False, False,
                     prefetch_k, dtype, tiles_per_task, w_scale)
    tma = _tma_stages(s, K, tma_stages, dtype)
    operands = ("x", "w") + s.scale_operands + (("norm_w",) if norm else ()) + ("ws",)
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
                        f"BLOCK_K=BLOCK_K, DOUBLE_BUFFER=DOUBLE_BUFFER, TMA_STAGES=TMA_STAGES, NORM_SQ=NORM_SQ"
                        f"{s.scale_kwargs})", tma))
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
            h = prologue_ref(x, b["norm_w"] if norm else None, eps)
        ws[w0:w1, n0:n1] = h[:, k_lo:k_hi] @ s.weights_ref(b, n0, n1)[:, k_lo:k_hi].T

    def reads(a, bind):
        r0, r1, n0, n1, _, _ = s.tile(a)
        k_lo, k_hi = split_of(a)
        whole = norm and not norm_sq  # the rstd of whole rows
        regs = [Region(bind["x"], r0, r1, 0, K) if whole else Region(bind["x"], r0, r1, k_lo, k_hi),
                Region(bind["w"], n0, n1, k_lo, k_hi)] + s.scale_regions(bind, n0, n1)
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
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=writes,
                  tiles=lambda _: s.task_args(split_k))


@register("linear_reduce")
def linear_reduce_op(M: int, N: int, K: int, split_k: int, *, block_m: int | None = None,
                     block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                     residual: bool = False, silu_mul: bool = False, norm_sq: bool = False, eps: float = 1e-6,
                     part_block_n: int | None = None, all_reduce: int = 0, dtype: torch.dtype | None = None) -> OpSpec:
    """Sum the split_k float32 partials of tile (pid_m, pid_n) in split order, then the epilogue.

    Operands: ws float32 ``[split_k, M, N]``, res ``[M, N]`` (with residual), out ``[M, N]``
    (``[M, N/2]`` with silu_mul). Args: pid_m, pid_n. Takes the same sizes as the
    :func:`linear_partial_op` it pairs with (K and block_k only pick the same default tiles).
    ``norm_sq``: the partials' ``NORM_SQ`` (ws then has their sums of x**2 after its N
    columns); the sum is scaled by the RMSNorm's rstd (``eps``) here.
    ``part_block_n``: the partials' block_n, where the reduce's tiles (``block_n``) are
    narrower, each partial tile then reduced by several tasks (a multiple of block_n).
    ``all_reduce`` = world > 0: the sum is one rank's partial of a tensor-parallel projection,
    which the task then sums over the ranks as :func:`linear_op`'s tiles do (operands res,
    total, recv, peers besides; args rank, hop).
    """
    s = LinearShape("linear_reduce", M, N, K, split_k, block_m, block_n, block_k, num_warps, residual, silu_mul,
                     0, dtype)
    if all_reduce and (residual or silu_mul or norm_sq):
        raise ValueError("linear_reduce: a tile summed over the ranks (all_reduce) has no residual, silu_mul or "
                         "norm of its own")
    part_bn = s.narrow_reduce(part_block_n)
    operands = ("ws",) + (("res",) if residual else ()) + ("out",) + (RANKS_SUM_OPERANDS if all_reduce else ())
    res = "res" if residual else "out"
    body = (f"linear_splitk_reduce_tile(ws, {res}, out, pid_m, pid_n, M, N, SPLIT_K, M * WS_N, WS_N, N_OUT, N_OUT, "
            f"HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, K=K, eps=EPS, "
            f"NORM_SQ=NORM_SQ, PART_BLOCK_N=PART_BLOCK_N)")
    constexprs = {k: v for k, v in s.constexprs().items() if k not in ("BLOCK_K", "PREFETCH_LINES", "LINE", "PREFETCH_BULK")}
    constexprs.update(SPLIT_K=split_k, HAS_RESIDUAL=int(residual), SILU_MUL=int(silu_mul), NORM_SQ=int(norm_sq),
                      WS_N=s.ws_cols(norm_sq), EPS=float(eps) if norm_sq else 0.0, PART_BLOCK_N=part_bn)
    if all_reduce:
        ranks_body, ranks_constexprs = ranks_sum_tail(s.bm, s.bn * s.run, all_reduce, M, N)
        body += ranks_body
        constexprs.update(ranks_constexprs)

    def run(b, a):
        if all_reduce:  # every rank's sum of its splits (the VM hands over their workspaces as @ws)
            _check_rank("linear_reduce", b, a, "ws")
            parts = [s.reduce(dict(b, ws=ws), a, norm_sq, eps) for ws in b["@ws"]]
            s.store(b, a, parts[a["rank"]], False)
            ranks_sum_ref(b, _ranks_box(s, a), parts)
            return
        s.store(b, a, s.reduce(b, a, norm_sq, eps), residual)

    def reads(a, bind):
        r0, r1, n0, n1, c0, c1 = s.tile(a)
        regs = s.ws_regions(a, bind, norm_sq)
        if residual or all_reduce:
            regs.append(Region(bind["res"], r0, r1, c0, c1))
        return regs

    def writes(a, bind):
        return s.out_regions(a, bind) + (ranks_sum_regions(bind, _ranks_box(s, a)) if all_reduce else [])

    return OpSpec(name="linear_reduce", operands=operands, args=("pid_m", "pid_n") + (("rank", "hop") if all_reduce else ()),
                  body=body, imports=("from mk.tasks.linear import linear_splitk_reduce_tile",)
                  + ((RANKS_SUM_IMPORT,) if all_reduce else ()),
                  constexprs=constexprs, num_warps=s.config.num_warps, run=run, reads=reads, writes=writes,
                  sync_operands=("recv",) if all_reduce else (), peer_operands=("ws",) if all_reduce else (),
                  tiles=lambda _: s.task_args())


def linear_tiles(spec: OpSpec) -> list[dict]:
    """Descriptor args of every task of one whole linear / linear_partial / linear_reduce op.

    Tiles (or runs of tiles_per_task tiles) in row-major (pid_m, pid_n) order; for partials,
    all splits of a tile together.
    """
    if spec.name not in ("linear", "linear_partial", "linear_reduce", "qkv_rope_kv", "qkv_rope_kv_reduce"):
        raise ValueError(f"not a linear op: {spec.name!r}")
    return spec.tiles(None)
