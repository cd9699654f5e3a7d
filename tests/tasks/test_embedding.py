import pytest
import torch
import triton
import triton.language as tl

from mk import jit
from mk.tasks.embedding import (
    MAX_BLOCK_H,
    embedding,
    embedding_block_h,
    embedding_cost,
    embedding_ref,
    embedding_tile,
)
from tests.conftest import DTYPES, assert_close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ids_shape, vocab, hidden", [
    ((5,), 1000, 200),
    ((3, 7), 1000, 64),
    ((2, 1), 37, MAX_BLOCK_H + 300),
    ((), 50, 16),
])
def test_embedding_matches_reference(ids_shape, vocab, hidden, ids_dtype, dtype, device):
    table = torch.randn(vocab, hidden, device=device).to(dtype)
    ids = torch.randint(0, vocab, ids_shape, device=device, dtype=ids_dtype)
    got = embedding(ids, table)
    assert got.shape == (*ids_shape, hidden) and got.dtype == dtype and got.is_contiguous()
    assert_close(got, embedding_ref(ids, table), dtype)
    assert torch.equal(got, embedding_ref(ids, table))  # a gather is exact


def test_embedding_edges_of_the_vocabulary_and_strided_table(device):
    base = torch.randn(1000, 300, device=device)
    table = base[:, :200]  # strided rows, contiguous last dim
    ids = torch.tensor([[0, 999, 0], [500, 999, 1]], device=device)
    assert torch.equal(embedding(ids, table), embedding_ref(ids, table))


@jit
def _one_worker_kernel(ids_ptr, table_ptr, out_ptr, ROWS, H, NUM_BLOCKS, stride_table, BLOCK_H: tl.constexpr):
    # A persistent-style caller: one program walks every (row, column block) itself.
    for t in range(0, ROWS * NUM_BLOCKS):
        embedding_tile(ids_ptr, table_ptr, out_ptr, t // NUM_BLOCKS, t % NUM_BLOCKS, H,
                       stride_table, H, BLOCK_H=BLOCK_H)


def test_embedding_tile_from_another_kernel(device):
    table = torch.randn(1000, 200, device=device)
    ids = torch.randint(0, 1000, (4,), device=device, dtype=torch.int32)
    out = torch.full((4, 200), float("nan"), device=device)
    _one_worker_kernel[(1,)](ids, table, out, 4, 200, triton.cdiv(200, 64), table.stride(0), BLOCK_H=64)
    assert torch.equal(out, embedding_ref(ids, table))


def test_embedding_rejects_bad_input(device):
    table = torch.randn(100, 16, device=device)
    ids = torch.tensor([[1, 2], [3, 4]], device=device)
    table0 = table.clone()
    with pytest.raises(ValueError, match="token_ids.*100"):
        embedding(torch.tensor([1, 100], device=device), table)
    with pytest.raises(ValueError, match="token_ids.*-1"):
        embedding(torch.tensor([-1, 3], device=device), table)
    with pytest.raises(TypeError, match="token_ids"):
        embedding(ids.float(), table)
    with pytest.raises(TypeError, match="token_ids"):
        embedding([1, 2], table)
    with pytest.raises(ValueError, match="token_ids"):
        embedding(ids.t(), table)  # non-contiguous ids
    with pytest.raises(ValueError, match="table"):
        embedding(ids, table[0])  # 1-d table
    with pytest.raises(ValueError, match="table"):
        embedding(ids, table.t())  # last dim not contiguous
    with pytest.raises(TypeError, match="table"):
        embedding(ids, table.to(torch.int32))
    with pytest.raises(ValueError, match="table"):
        embedding(ids, table.to("meta"))  # wrong device
    if device.type == "cpu":
        with pytest.raises(TypeError, match="table"):
            embedding(ids, table.to(torch.bfloat16))
    assert torch.equal(table, table0)


def test_embedding_empty_and_hooks(device):
    table = torch.randn(10, 16, device=device)
    assert embedding(torch.empty(0, 3, dtype=torch.int64, device=device), table).shape == (0, 3, 16)
    assert embedding_block_h(200) == 256 and embedding_block_h(4096) == MAX_BLOCK_H
    cost = embedding_cost(rows=3, hidden=200, dtype_bytes=2, id_bytes=4)
    assert (cost.bytes_read, cost.bytes_written, cost.flops) == (3 * (400 + 4), 3 * 400, 0)
