"""Argmax over the vocabulary: the greedy next-token choice, as chunk partials plus a reduce.

    out[b] = min { i : x[b, i] = max_j x[b, j] }

with torch.argmax's conventions: the lowest index wins a tie, NaN counts as larger than
everything, -0.0 equals +0.0. Inside the megakernel the LM head's output tiles can feed
``argmax_partial_tile`` chunk by chunk (one (row, chunk) pair per call, writing one
value and one index), and one ``argmax_reduce_tile`` per row combines the chunks. Or the
LM head's tiles fold their rows into one packed int64 a row by atomic max
(``argmax_tile_into``) and the step's last task takes it (``argmax_take``). The
result is exact and deterministic: values are compared through an order-preserving
integer image of their float32 bits (:func:`order_key`), so no rounding or scheduling
order can change which index wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cost import TaskCost
from ._device import jit, check_tensor
from ._planning import GREEDY, LOGITS, SAMPLE, OpKind, register_kind
from ._spec import OpSpec, Region, cdiv, check_sizes, check_tile, make_op, operand_view, register

#: Default widest vocabulary chunk one partial tile covers.
MAX_BLOCK_V = 2048
#: Widest block of chunk partials the reduce loads at once; more chunks loop.
MAX_BLOCK_C = 1024

_INT32_MIN = tl.constexpr(-2147483648)
_INT32_MAX = tl.constexpr(2147483647)


@jit
def order_key(x):
    """int32 image of float32 ``x`` that orders like x (as torch.argmax sees it).

    Non-negative floats keep their bits; negative floats get their magnitude bits
    flipped, so integer order equals float order. -0.0 is mapped to +0.0 first (they
    compare equal), and every NaN to the largest key (torch.argmax picks NaN).
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == _INT32_MIN, 0, bits)  # -0.0 has only the sign bit set
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, _INT32_MAX, key)


@jit
def argmax_block(x, cols, valid, SENTINEL):
    """(value, index) of the largest valid element of block ``x`` (float32), lowest index on ties.

    ``cols`` are the elements' global indices (int32). With no valid element the result
    is (-inf, SENTINEL); pick SENTINEL above every real index so that any real
    candidate, even a -inf one, wins over it in :func:`argmax_reduce_tile`.
    """
    key = tl.where(valid, order_key(x), _INT32_MIN)  # real keys are > INT32_MIN (-inf's is not)
    best = tl.max(key, axis=0)
    idx = tl.min(tl.where(valid & (key == best), cols, SENTINEL), axis=0)
    # Exactly one element matches idx, so the sum is that element's value, NaN or inf included.
    val = tl.sum(tl.where(cols == idx, x, 0.0), axis=0)
    val = tl.where(idx == SENTINEL, float("-inf"), val)
    return val, idx


@jit
def argmax_pack(x, cols):
    """int64 candidates that order as torch.argmax picks: by x (:func:`order_key`), then the
    lower index. The key, biased to be non-negative, sits above ``2**31 - 1 - cols``, so
    every real candidate packs above 0 and zeroed memory is the empty best."""
    key = order_key(x).to(tl.int64) + 2147483648
    return (key << 31) | (2147483647 - cols).to(tl.int64)


@jit
def argmax_unpack(packed):
    """(index int32, value float32) of a packed candidate (:func:`argmax_pack`); a NaN stays a NaN."""
    idx = (2147483647 - (packed & 2147483647)).to(tl.int32)
    key = ((packed >> 31) - 2147483648).to(tl.int32)
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)  # order_key is its own inverse on the bits it keeps
    return idx, bits.to(tl.float32, bitcast=True)


@jit
def argmax_tile_into(y, pid_m, tile, M, V, best_ptr):
    """Fold output tile (pid_m, tile) of the logits, ``y`` (float32 ``[BLOCK_M, BLOCK_N]``:
    rows pid_m*BLOCK_M.., columns tile*BLOCK_N..), into each row's best candidate: one atomic
    max of packed (value, index) pairs (:func:`argmax_pack`) into int64 ``best[row]``. The LM
    head's epilogue (:func:`mk.tasks.linear.linear_argmax_epilogue`): no task reads the logits
    back and no reduce task runs; the max is the same in any order the tiles arrive.
    ``best`` must start at 0 (:func:`argmax_take` leaves it so). Rows past M and columns past
    V are left out."""
    BLOCK_M: tl.constexpr = y.shape[0]
    BLOCK_N: tl.constexpr = y.shape[1]
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    packed = tl.where((cols < V)[None, :], argmax_pack(y, cols[None, :]), 0)
    tl.atomic_max(best_ptr + rows, tl.max(packed, axis=1), mask=rows < M, sem="relaxed")


@jit
def argmax_take(best_ptr, row):
    """(index int32, value float32) of row's best candidate (:func:`argmax_tile_into`), and
    best[row] back to 0 for the next step, in one atomic exchange."""
    return argmax_unpack(tl.atomic_xchg(best_ptr + row, tl.zeros([], tl.int64)))


@jit
def argmax_partial_tile(
    logits_ptr, part_val_ptr, part_idx_ptr,
    row, chunk, V, stride_row, stride_part,
    BLOCK_V: tl.constexpr,
):
    """Max and its index over logits[row, chunk*BLOCK_V : (chunk+1)*BLOCK_V] (clipped at V).

    Writes part_val[row, chunk] (float32 value) and part_idx[row, chunk] (int32 global
    index); the partial arrays have row stride ``stride_part`` and unit chunk stride.
    """
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < V
    x = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=0.0).to(tl.float32)
    val, idx = argmax_block(x, cols, valid, V)
    tl.store(part_val_ptr + row * stride_part + chunk, val)
    tl.store(part_idx_ptr + row * stride_part + chunk, idx)


@jit
def argmax_reduce_tile(
    part_val_ptr, part_idx_ptr, out_idx_ptr, out_val_ptr,
    row, n_chunks, stride_part,
    BLOCK_C: tl.constexpr,
):
    """Combine a row's ``n_chunks`` partials: out_idx[row] (int64) and out_val[row] (float32).

    Each lane keeps the best of the chunks congruent to it mod BLOCK_C (larger key, then
    lower index), then the lanes are reduced the same way: a fixed order, so the result
    is the same however the partial tiles were scheduled.
    """
    offs = tl.arange(0, BLOCK_C)
    best_key = tl.full([BLOCK_C], _INT32_MIN, tl.int32)
    best_idx = tl.full([BLOCK_C], _INT32_MAX, tl.int32)
    best_val = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for start in range(0, n_chunks, BLOCK_C):
        c = start + offs
        m = c < n_chunks
        v = tl.load(part_val_ptr + row * stride_part + c, mask=m, other=float("-inf"))
        i = tl.load(part_idx_ptr + row * stride_part + c, mask=m, other=_INT32_MAX)
        k = tl.where(m, order_key(v), _INT32_MIN)
        take = (k > best_key) | ((k == best_key) & (i < best_idx))
        best_key = tl.where(take, k, best_key)
        best_idx = tl.where(take, i, best_idx)
        best_val = tl.where(take, v, best_val)
    top = tl.max(best_key, axis=0)
    idx = tl.min(tl.where(best_key == top, best_idx, _INT32_MAX), axis=0)
    # Read the winner's value from one lane (a sum of one term keeps NaN and inf as they are).
    lane = tl.min(tl.where((best_key == top) & (best_idx == idx), offs, BLOCK_C), axis=0)
    val = tl.sum(tl.where(offs == lane, best_val, 0.0), axis=0)
    tl.store(out_idx_ptr + row, idx.to(tl.int64))
    tl.store(out_val_ptr + row, val)


@jit
def argmax_partial_kernel(
    logits_ptr, part_val_ptr, part_idx_ptr, V, stride_row, stride_part,
    BLOCK_V: tl.constexpr,
):
    argmax_partial_tile(logits_ptr, part_val_ptr, part_idx_ptr, tl.program_id(1), tl.program_id(0),
                        V, stride_row, stride_part, BLOCK_V=BLOCK_V)


@jit
def argmax_reduce_kernel(
    part_val_ptr, part_idx_ptr, out_idx_ptr, out_val_ptr, n_chunks, stride_part,
    BLOCK_C: tl.constexpr,
):
    argmax_reduce_tile(part_val_ptr, part_idx_ptr, out_idx_ptr, out_val_ptr, tl.program_id(0),
                       n_chunks, stride_part, BLOCK_C=BLOCK_C)


def argmax_block_v(v: int, max_block_v: int = MAX_BLOCK_V) -> int:
    """Chunk width for a vocabulary of v: the whole row when it fits, else max_block_v."""
    return min(triton.next_power_of_2(max(v, 16)), max_block_v)


def argmax_block_c(n_chunks: int) -> int:
    """How many chunk partials the reduce loads at once."""
    return min(triton.next_power_of_2(max(n_chunks, 1)), MAX_BLOCK_C)


def check_block_v(block_v: object) -> int:
    """A chunk width: a power of two from 16 to 65536 (``tl.arange`` needs a power of two)."""
    if isinstance(block_v, bool) or not isinstance(block_v, int):
        raise TypeError(f"block_v must be an int, got {type(block_v).__name__}")
    if block_v < 16 or block_v > 65536 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two in [16, 65536], got {block_v}")
    return block_v


def check_logits(logits: object) -> torch.Tensor:
    """``[B, V]`` logits with V >= 1, unit stride along V and int32-addressable rows."""
    check_tensor("logits", logits, ndim=2, contiguous=False, last_dim_contiguous=True)
    rows, v = logits.shape
    if v < 1:
        raise ValueError(f"logits must have at least one column, got shape {tuple(logits.shape)}")
    if rows and (rows - 1) * logits.stride(0) + v >= 2**31:
        raise ValueError(f"logits is too large for int32 offsets: shape {tuple(logits.shape)}")
    return logits


def argmax(logits: torch.Tensor, *, block_v: int | None = None) -> torch.Tensor:
    """Index of the largest logit of each row, as torch.argmax(logits, -1).

    Args:
        logits: ``[B, V]``; rows may be strided, the last dim must be contiguous.
        block_v: chunk width (a power of two); default :func:`argmax_block_v`.

    Returns:
        int64 ``[B]``. Ties go to the lowest index, NaN wins, deterministic.
    """
    check_logits(logits)
    rows, v = logits.shape
    block_v = argmax_block_v(v) if block_v is None else check_block_v(block_v)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    n_chunks = triton.cdiv(v, block_v)
    part_val = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    out_val = torch.empty(rows, dtype=torch.float32, device=logits.device)
    argmax_partial_kernel[(n_chunks, rows)](
        logits, part_val, part_idx, v, logits.stride(0), part_val.stride(0),
        BLOCK_V=block_v, num_warps=4,
    )
    argmax_reduce_kernel[(rows,)](
        part_val, part_idx, out, out_val, n_chunks, part_val.stride(0),
        BLOCK_C=argmax_block_c(n_chunks), num_warps=4,
    )
    return out


def argmax_pack_ref(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """:func:`argmax_pack` in torch: int64 candidates of float32 ``x`` at int ``cols``."""
    bits = x.float().contiguous().view(torch.int32).long()
    bits = torch.where(bits == -2**31, 0, bits)  # -0.0
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = torch.where(torch.isnan(x), 2**31 - 1, key)
    return ((key + 2**31) << 31) | (2**31 - 1 - cols.long())


def argmax_unpack_ref(packed: int) -> int:
    """The index of a packed candidate (:func:`argmax_unpack`)."""
    return 2**31 - 1 - (int(packed) & (2**31 - 1))


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dim, in float32 (the reference the kernels are tested against)."""
    return logits.float().argmax(dim=-1)


def argmax_cost(rows: int, v: int, dtype_bytes: int = 2, block_v: int | None = None) -> TaskCost:
    """Bytes and flops of one argmax over ``rows`` rows of v logits (partials and reduce)."""
    n_chunks = triton.cdiv(v, block_v or argmax_block_v(v))
    partials = rows * n_chunks * 8  # float32 value + int32 index per chunk
    return TaskCost(bytes_read=rows * v * dtype_bytes + partials,
                    bytes_written=partials + rows * 12, flops=rows * (v + n_chunks))


def argmax_smem_bytes(block_v: int, num_warps: int = 4) -> int:
    """Shared memory of the tiles: cross-warp scratch for a max and a min over int32."""
    return 2 * 4 * num_warps


# ---------------------------------------------------------------------------------------
# Megakernel spec: how the op runs as a task of the persistent kernel (mk.tasks._spec)
# ---------------------------------------------------------------------------------------


class ArgmaxShape:
    """Chunking of argmax over ``[rows, vocab]`` logits, as :func:`argmax` cuts it (shared by
    the megakernel's argmax and sampling partials)."""

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

    def chunk_tiles(self) -> list[dict]:
        """Args of every partial task: each row's chunks in order, row after row."""
        return [{"row": r, "chunk": k} for r in range(self.rows) for k in range(self.chunks)]

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
    s = ArgmaxShape("argmax_partial", rows, vocab, block_v)

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
                  num_warps=num_warps, run=run, reads=reads, writes=writes, tiles=lambda _: s.chunk_tiles())


@register("argmax_reduce")
def argmax_reduce_op(rows: int, vocab: int, *, block_v: int | None = None, num_warps: int = 4) -> OpSpec:
    """Combine row ``row``'s chunk partials: out_idx[row] and out_val[row] (deterministic).

    Operands: part_val float32 and part_idx int32 ``[rows, n_chunks]`` (from
    :func:`argmax_partial_op` with the same sizes), out_idx int32/int64 ``[rows]`` (1-D: it
    can be the next step's token ids of :func:`mk.tasks.embedding.embedding_op`), out_val
    float32 ``[rows]``. Args: row.
    """
    s = ArgmaxShape("argmax_reduce", rows, vocab, block_v)

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
                  num_warps=num_warps, run=run, reads=reads, writes=writes,
                  tiles=lambda _: [{"row": r} for r in range(rows)])


# ---------------------------------------------------------------------------------------
# Planning: how the planner plans the step's next-token choice (mk.tasks._planning)
# ---------------------------------------------------------------------------------------


class ArgmaxKind(OpKind):
    """The step's next token: greedy, chunk partials then a reduce a row, then the token
    append (:mod:`mk.tasks.append_token`); folded into the LM head's whole-K tiles (each
    row's best in one word, :func:`argmax_tile_into`), leaving the append; with temperature
    sampling, the sampler's partials instead (:mod:`mk.tasks.sample`). Over tensor-parallel
    ranks it is always folded: each rank publishes its share's best, the best of them taken
    (:mod:`mk.tasks.all_reduce`)."""

    kind = "argmax"
    hosts = frozenset({"linear"})
    chooses_token = True

    def fuses_as_epilogue(self, node, host, host_choice) -> bool:
        return host.kind in self.hosts and host_choice.split_k == 1

    def runs_alone(self, node, host) -> bool:
        return host is None or node.dims.get("world", 1) == 1

    def needs_whole_k_host(self, node) -> bool:
        return node.dims.get("world", 1) > 1

    def fused_bytes(self, node) -> int:
        """The host folds its tiles into a word a row (atomics, in L2) and nothing reads the
        logits back: nothing of the argmax's own traffic is left."""
        return 0

    def host_tail_phases(self, node) -> list[tuple[int, int]]:
        """The folded argmax's token append; over ranks, the candidates published, then the choice."""
        return [(node.dims["rows"], 0)] * (2 if node.dims.get("world", 1) > 1 else 1)

    def specs(self, node, choice, fused=()):
        d = node.dims
        return [(argmax_partial_op(d["rows"], d["v"]), None), (argmax_reduce_op(d["rows"], d["v"]), None),
                (make_op("append_token", batch=d["rows"], max_seq=1), None)]

    def buffer_shape(self, node, role, max_seq):
        d = node.dims
        if role == "peers":
            return (d["world"],), torch.int64
        if role in ("shared", "flags"):  # each row's candidate over the ranks, and its flag
            return (d["rows"],), torch.int64 if role == "shared" else torch.int32
        return super().buffer_shape(node, role, max_seq)

    def lowers_when_fused(self, node) -> bool:
        return True

    def lower(self, node, choice, ctx) -> None:
        d, B, S = node.dims, ctx.batch, ctx.max_seq
        folded = ctx.next_token == GREEDY and node.name in ctx.fused_into  # (by the LM head's tiles)
        if d.get("world", 1) > 1:
            # Each rank's vocabulary share: its best candidate published, the best of them taken.
            if not folded:
                raise ValueError(f"lower_decode_step: a tensor-parallel step chooses its token greedily, with the "
                                 f"argmax folded into the LM head (next_token={ctx.next_token!r}, plan "
                                 f"{'fuses' if node.name in ctx.fused_into else 'does not fuse'} {node.name})")
            ctx.add(node.name, make_op("argmax_publish", batch=B, v_local=d["v"]), best="argmax.best",
                    shared=node.buffers["shared"])
            ctx.add("append_token", make_op("argmax_ranks", batch=B, max_seq=S, world=d["world"]),
                    shared=node.buffers["shared"], flags=node.buffers["flags"], peers=node.buffers["peers"],
                    next_ids="ids", pos="pos", tokens="tokens")
            return
        if ctx.next_token == LOGITS:
            return
        if folded:  # the LM head folded each row's argmax into argmax.best
            ctx.add("append_token", make_op("append_token", batch=B, max_seq=S, from_best=True), next_ids="ids",
                    pos="pos", tokens="tokens", best="argmax.best")
            return
        if ctx.next_token == SAMPLE:
            part = make_op("sample_gumbel_partial", rows=B, vocab=d["v"])
            extra = {"params": "temperature", "seed": "seed", "offsets": "seqlens"}
        else:
            part, extra = argmax_partial_op(B, d["v"]), {}
        chunks = part.constexprs["N_CHUNKS"]
        pv = ctx.activation("argmax.val", B, chunks)
        pi = ctx.activation("argmax.idx", B, chunks, dt=torch.int32)
        ctx.add(node.name, part, logits=node.inputs[0], part_val=pv, part_idx=pi, **extra)
        ctx.add(node.name, argmax_reduce_op(B, d["v"]), part_val=pv, part_idx=pi, out_idx="ids",
                out_val=ctx.activation("next_val", B))
        ctx.add("append_token", make_op("append_token", batch=B, max_seq=S), next_ids="ids", pos="pos",
                tokens="tokens")


ARGMAX = register_kind(ArgmaxKind())
