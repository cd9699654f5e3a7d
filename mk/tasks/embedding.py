"""Token embedding lookup:

    out[n, :] = table[token_ids[n], :]

for every position n of ``token_ids`` (any shape), with ``table`` of shape ``[V, H]``.
A pure copy: the output has the table's dtype and its exact values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cost import TaskCost
from ._device import jit, check_same_device, check_tensor, is_capturing
from ._planning import OpKind, register_kind
from ._spec import OpSpec, Region, block_cols, cdiv, check_pow2, check_sizes, check_tile, operand_view, register

#: Widest column block of one tile; wider rows are split over several tiles.
MAX_BLOCK_H = 1024

ID_DTYPES = (torch.int32, torch.int64)


@jit
def embedding_tile(
    ids_ptr, table_ptr, out_ptr,
    row, col_block, H,
    stride_table, stride_out,
    BLOCK_H: tl.constexpr, start=0, V_SHARE: tl.constexpr = 0,
):
    """out[row, cols] = table[ids[row], cols] for cols in block ``col_block``.

    ``row`` and ``col_block`` are int32 scalars. The id is trusted to lie in [0, V):
    the standalone launcher checks that on the host; a persistent kernel feeds ids from
    its own argmax/sampling tasks. ``V_SHARE`` > 0: the table is one tensor-parallel rank's
    share of the vocabulary, rows [start, start + V_SHARE); an id outside it gives zeros
    (the ranks' rows are summed afterwards).
    """
    cols = col_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    # 64-bit: V * H passes 2**31 elements for large vocabularies (128k x 16k).
    token = tl.load(ids_ptr + row).to(tl.int64)
    if V_SHARE > 0:
        token = token - start
        inside = (token >= 0) & (token < V_SHARE)
        token = tl.minimum(tl.maximum(token, 0), V_SHARE - 1)  # (a row of the share, read and dropped)
        vals = tl.load(table_ptr + token * stride_table + cols, mask=mask)
        vals = tl.where(inside, vals, tl.zeros_like(vals))
    else:
        vals = tl.load(table_ptr + token * stride_table + cols, mask=mask)
    tl.store(out_ptr + tl.cast(row, tl.int64) * stride_out + cols, vals.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def embedding_kernel(
    ids_ptr, table_ptr, out_ptr, H,
    stride_table, stride_out, start,
    BLOCK_H: tl.constexpr, V_SHARE: tl.constexpr,
):
    embedding_tile(ids_ptr, table_ptr, out_ptr, tl.program_id(0), tl.program_id(1), H,
                   stride_table, stride_out, BLOCK_H=BLOCK_H, start=start, V_SHARE=V_SHARE)


def embedding_block_h(h: int) -> int:
    """Column block for rows of h elements: the whole row when it fits in MAX_BLOCK_H."""
    return min(triton.next_power_of_2(max(h, 1)), MAX_BLOCK_H)


def embedding_num_warps(block_h: int) -> int:
    # 4-8 contiguous elements per thread: wide enough for vector loads, no more.
    return max(1, min(8, block_h // 256))


def embedding(token_ids: torch.Tensor, table: torch.Tensor, *, check_values: bool = True,
              vocab_start: int | None = None) -> torch.Tensor:
    """Rows of ``table`` picked by ``token_ids``.

    Args:
        token_ids: int32 or int64, any shape, contiguous; every id in ``[0, V)``
            (checked on the host before launch, which synchronises with the device;
            skipped while a CUDA graph is captured).
        table: ``[V, H]``, unit stride in the last dim (rows may be strided).
        check_values: False skips the id range check (no wait for the device), for a
            caller that checked the ids itself; an id outside ``[0, V)`` is then undefined.
        vocab_start: an int >= 0: the table is one tensor-parallel rank's share of the vocabulary, rows
            ``[vocab_start, vocab_start + V)``: an id outside it gives a row of zeros (the
            ranks' outputs add up to the embedding); the check is then only ``id >= 0``.

    Returns:
        ``[*token_ids.shape, H]`` contiguous, dtype of table.
    """
    check_tensor("token_ids", token_ids, dtype=ID_DTYPES)
    check_tensor("table", table, ndim=2, contiguous=False, last_dim_contiguous=True)
    check_same_device(token_ids=token_ids, table=table)
    if vocab_start is not None:
        if isinstance(vocab_start, bool) or not isinstance(vocab_start, int):
            raise TypeError(f"vocab_start must be None or an int, got {type(vocab_start).__name__}")
        if vocab_start < 0:
            raise ValueError(f"vocab_start must be >= 0 (the first id of this rank's share), got {vocab_start}")
    vocab, hidden = table.shape
    ids = token_ids.reshape(-1)
    if check_values and ids.numel() and not is_capturing(ids):  # a value check would break graph capture
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (vocab_start is None and hi >= vocab):
            bad = lo if lo < 0 else hi
            raise ValueError(f"token_ids holds {bad}, outside the table's vocabulary [0, {vocab})")
    out = torch.empty((ids.numel(), hidden), dtype=table.dtype, device=table.device)
    if ids.numel() and hidden:
        block_h = embedding_block_h(hidden)
        embedding_kernel[(ids.numel(), triton.cdiv(hidden, block_h))](
            ids, table, out, hidden, table.stride(0), out.stride(0), vocab_start or 0,
            BLOCK_H=block_h, V_SHARE=0 if vocab_start is None else vocab, num_warps=embedding_num_warps(block_h),
        )
    return out.reshape(*token_ids.shape, hidden)


def embedding_ref(token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Plain torch reference: ``table[token_ids]`` (exact, in the table's dtype)."""
    return table[token_ids.long()]


def embedding_cost(rows: int, hidden: int, dtype_bytes: int = 2, id_bytes: int = 4) -> TaskCost:
    """Bytes of gathering ``rows`` rows of ``hidden`` elements (no flops: a copy)."""
    return TaskCost(bytes_read=rows * (hidden * dtype_bytes + id_bytes),
                    bytes_written=rows * hidden * dtype_bytes, flops=0)


# ---------------------------------------------------------------------------------------
# Megakernel spec: how the op runs as a task of the persistent kernel (mk.tasks._spec)
# ---------------------------------------------------------------------------------------


@register("embedding")
def embedding_op(rows: int, vocab: int, hidden: int, *, ranks: int = 1, block_h: int | None = None,
                 num_warps: int | None = None) -> OpSpec:
    """One (row, column block) tile of ``out[row] = table[ids[row]]``.

    ``ranks`` > 1: the table is rank ``rank``'s share of a vocabulary split over that many
    tensor-parallel ranks (rows [rank * vocab, (rank + 1) * vocab)); ids outside the share
    give zeros, and the ranks' outputs add up to the embedding (an all-reduce after it).

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
        if not 0 <= token < vocab * ranks:
            raise ValueError(f"embedding: ids[{row}] = {token} is outside the vocabulary [0, {vocab * ranks})")
        out = operand_view("embedding", "out", b["out"], rows, hidden)
        token -= a.get("rank", 0) * vocab
        if 0 <= token < vocab:
            out[row, c0:c1] = operand_view("embedding", "table", b["table"], vocab, hidden)[token, c0:c1].to(out.dtype)
        else:  # another rank's share
            out[row, c0:c1] = 0

    def reads(a, bind):
        c0, c1 = cols(a)
        return [Region(bind["ids"], 0, 1, a["row"], a["row"] + 1), Region(bind["table"], 0, vocab, c0, c1)]

    def writes(a, bind):
        c0, c1 = cols(a)
        return [Region(bind["out"], a["row"], a["row"] + 1, c0, c1)]

    share = ranks > 1
    body = "embedding_tile(ids, table, out, row, col_block, H, H, H, BLOCK_H=BLOCK_H"
    body += ", start=rank * V_SHARE, V_SHARE=V_SHARE)" if share else ")"
    return OpSpec(name="embedding", operands=("ids", "table", "out"),
                  args=("row", "col_block") + (("rank",) if share else ()), body=body,
                  imports=("from mk.tasks.embedding import embedding_tile",),
                  constexprs={"ROWS": rows, "H": hidden, "BLOCK_H": block_h, **({"V_SHARE": vocab} if share else {})},
                  num_warps=num_warps or embedding_num_warps(block_h), run=run, reads=reads, writes=writes,
                  tiles=lambda _: [{"row": r, "col_block": cb} for r in range(rows) for cb in range(blocks)])


# ---------------------------------------------------------------------------------------
# Planning: how the planner plans the embedding of a decode step (mk.tasks._planning)
# ---------------------------------------------------------------------------------------


class EmbeddingKind(OpKind):
    """The step's embedding: one task a (row, column block); under tensor parallelism each
    rank's vocabulary share (an all-reduce sums the ranks' rows after it)."""

    kind = "embedding"

    def _spec(self, node, rows: int):
        d = node.dims
        return embedding_op(rows, d["vocab"], d["hidden"], ranks=d.get("world", 1))

    def specs(self, node, choice, fused=()):
        return [(self._spec(node, node.dims["rows"]), None)]

    def buffer_shape(self, node, role, max_seq):
        if role == "w":
            return (node.dims["vocab"], node.dims["hidden"]), "weight"
        return super().buffer_shape(node, role, max_seq)

    def lower(self, node, choice, ctx) -> None:
        ctx.add(node.name, self._spec(node, ctx.batch), ids="ids", table=node.buffers["w"],
                out=ctx.activation(node.outputs[0], ctx.batch, node.dims["hidden"]))


EMBEDDING = register_kind(EmbeddingKind())
