import importlib

import pytest
import torch
import triton.language as tl

from mk import jit
from mk.tasks import TaskCost
from mk.tasks.argmax import (argmax, argmax_cost, argmax_pack_ref, argmax_reduce_kernel, argmax_ref,
                             argmax_smem_bytes, argmax_take, argmax_tile_into, argmax_unpack_ref)
from tests.conftest import DTYPES

argmax_mod = importlib.import_module("mk.tasks.argmax")  # the module: mk.tasks.argmax is the op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, v, block_v", [
    (1, 1000, None),    # one chunk
    (5, 1000, None),
    (5, 1000, 256),     # 4 chunks, the last one partial
    (3, 777, 64),       # odd V, 13 chunks
    (2, 1, None),       # a single logit
    (2, 5000, None),    # several default-width chunks
])
def test_argmax_matches_reference(rows, v, block_v, dtype, device):
    logits = torch.randn(rows, v, device=device).to(dtype)
    got = argmax(logits, block_v=block_v)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got.cpu(), argmax_ref(logits).cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_v", [None, 16, 64])
def test_argmax_ties_go_to_lowest_index(block_v, dtype, device):
    v = 300
    logits = torch.randn(5, v, device=device).clamp(max=3.0)  # below every planted maximum
    logits[0, [250, 17, 120]] = 9.0             # planted ties in different chunks
    logits[1] = 0.5                             # all equal
    logits[2, [299, 64]] = 7.0                  # tie across a chunk boundary, both at chunk starts/ends
    logits[3, 100:] = 4.0                       # a run of equal maxima
    logits[4] = torch.linspace(-3, 3, v)
    logits[4, 0] = logits[4, -1]                # tie between first and last
    logits = logits.to(dtype)
    got = argmax(logits, block_v=block_v).cpu().tolist()
    assert got == [17, 0, 64, 100, 0]
    assert got == argmax_ref(logits).cpu().tolist()


def test_argmax_special_values(device):
    v = 100
    inf = float("inf")
    logits = torch.randn(6, v, device=device)
    logits[0] = -inf
    logits[0, 73] = -50.0                       # the only finite entry
    logits[1] = -inf                            # all -inf: index 0, as torch
    logits[2, 40] = inf
    logits[2, 90] = inf                         # +inf ties
    logits[3] = 0.0
    logits[3, 0] = -0.0                         # -0.0 equals +0.0
    logits[4, 10] = float("nan")
    logits[4, 5] = float("nan")                 # NaN wins, the first one
    logits[5, :50] = -inf
    got = argmax(logits, block_v=16)
    assert got.cpu().tolist()[:5] == [73, 0, 40, 0, 5]
    assert torch.equal(got.cpu(), argmax_ref(logits).cpu())


def test_argmax_strided_rows_and_chunk_independence(device):
    base = torch.randn(4, 1500, device=device)
    logits = base[:, 100:1100]                  # strided rows, contiguous last dim
    ref = argmax_ref(logits)
    for block_v in (None, 16, 128, 1024):
        assert torch.equal(argmax(logits, block_v=block_v).cpu(), ref.cpu())


def test_argmax_reduce_over_many_chunk_blocks(monkeypatch, device):
    # Force the reduce to loop over blocks of 2 partials.
    monkeypatch.setattr(argmax_mod, "MAX_BLOCK_C", 2)
    logits = torch.randn(3, 500, device=device)
    logits[1, [33, 400]] = 10.0
    got = argmax(logits, block_v=64)
    assert torch.equal(got.cpu(), argmax_ref(logits).cpu())


def test_argmax_reduce_tile_partials(device):
    # Hand-made partials: ties between chunks, an empty chunk (-inf, sentinel) and -inf values.
    inf = float("inf")
    part_val = torch.tensor([[1.0, 3.0, 3.0, -inf, 2.0, 3.0, 0.0],
                             [-inf, -inf, -inf, -inf, -inf, -inf, -inf]], device=device)
    part_idx = torch.tensor([[3, 17, 25, 100, 40, 55, 60],
                             [100, 100, 21, 100, 33, 100, 100]], dtype=torch.int32, device=device)
    out = torch.empty(2, dtype=torch.int64, device=device)
    out_val = torch.empty(2, dtype=torch.float32, device=device)
    for block_c in (2, 4, 8):
        argmax_reduce_kernel[(2,)](part_val, part_idx, out, out_val, 7, part_val.stride(0), BLOCK_C=block_c)
        assert out.cpu().tolist() == [17, 21]   # a real -inf candidate beats the empty-chunk sentinel
        assert out_val.cpu().tolist() == [3.0, -inf]


@jit
def _fold_tiles_kernel(y_ptr, best_ptr, M, V, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program t folds output tile (0, t) of [M, V] logits, held as an LM head tile holds it.
    tile = tl.program_id(0)
    rows, cols = tl.arange(0, BLOCK_M), tile * BLOCK_N + tl.arange(0, BLOCK_N)
    y = tl.load(y_ptr + rows[:, None] * V + cols[None, :], mask=(rows < M)[:, None] & (cols < V)[None, :],
                other=float("nan"))  # what a tile holds past V must not win
    argmax_tile_into(y, 0, tile, M, V, best_ptr)


@jit
def _take_kernel(best_ptr, idx_ptr, val_ptr):
    idx, val = argmax_take(best_ptr, tl.program_id(0))
    tl.store(idx_ptr + tl.program_id(0), idx)
    tl.store(val_ptr + tl.program_id(0), val)


def test_lm_head_tiles_fold_into_one_packed_word_a_row(device):
    # LM head tiles fold their rows into best[row] (argmax_tile_into: atomic max of packed
    # (value, index)), whatever order they arrive in; argmax_take is torch.argmax of the
    # whole row, special values ordered as torch orders them, and zeroes best again.
    inf, nan = float("inf"), float("nan")
    M, V, block_n = 6, 70, 16
    logits = torch.randn(M, V)
    logits[0, [20, 35, 69]] = 6.0                # ties across tiles, one in the clipped last tile
    logits[1] = -inf                             # all -inf
    logits[2, [50, 3]] = nan                     # NaN wins, the first one
    logits[3] = 0.0
    logits[3, 0] = -0.0                          # -0.0 equals +0.0
    logits[4, [66, 64]] = inf
    logits[5] = -1e-30                           # tiny negatives against the empty word (0)
    logits[5, 33] = -1e-31
    logits = logits.to(device)
    tiles = -(-V // block_n)
    best = torch.zeros(M + 1, dtype=torch.int64, device=device)  # the row past M stays 0
    _fold_tiles_kernel[(tiles,)](logits, best, M, V, BLOCK_M=8, BLOCK_N=block_n)
    want = argmax_ref(logits).cpu()
    assert want.tolist() == [20, 0, 3, 0, 64, 33]
    # The torch twin (the VM's) packs the same words.
    cols = torch.arange(V)
    assert best[:M].cpu().tolist() == argmax_pack_ref(logits.cpu(), cols).amax(dim=1).tolist()
    assert [argmax_unpack_ref(p) for p in best[:M].tolist()] == want.tolist() and best[M] == 0
    idx = torch.full((M,), -1, dtype=torch.int32, device=device)
    val = torch.zeros(M, device=device)
    _take_kernel[(M,)](best, idx, val)
    assert idx.cpu().tolist() == want.tolist() and best.cpu().tolist() == [0] * (M + 1)
    want_val = logits.cpu().gather(1, want[:, None])[:, 0]
    want_val[3] = 0.0  # -0.0 is packed as +0.0
    torch.testing.assert_close(val.cpu(), want_val, rtol=0, atol=0, equal_nan=True)


def test_argmax_rejects_bad_input(device):
    logits = torch.randn(2, 50, device=device)
    with pytest.raises(TypeError, match="logits"):
        argmax(logits.tolist())
    with pytest.raises(TypeError, match="logits"):
        argmax(logits.to(torch.int32))
    with pytest.raises(ValueError, match="logits"):
        argmax(logits[0])                       # 1-D
    with pytest.raises(ValueError, match="logits"):
        argmax(torch.randn(2, 0, device=device))
    with pytest.raises(ValueError, match="logits"):
        argmax(logits.t())                      # last dim not contiguous
    with pytest.raises(ValueError, match="block_v"):
        argmax(logits, block_v=100)
    with pytest.raises(TypeError, match="block_v"):
        argmax(logits, block_v=64.0)
    with pytest.raises(ValueError, match="logits"):  # wrong device
        argmax(logits.to("meta" if device.type == "cpu" else "cpu"))
    if device.type == "cpu":
        with pytest.raises(TypeError, match="logits"):
            argmax(logits.to(torch.bfloat16))


def test_argmax_empty_batch(device):
    assert argmax(torch.randn(0, 10, device=device)).shape == (0,)


def test_argmax_planner_hooks():
    cost = argmax_cost(2, 128256, dtype_bytes=2, block_v=1024)
    assert isinstance(cost, TaskCost)
    assert cost.bytes_read >= 2 * 128256 * 2 and cost.bytes_written > 0 and cost.flops >= 2 * 128256
    assert argmax_cost(1, 1000).bytes < argmax_cost(2, 1000).bytes
    assert argmax_smem_bytes(1024, 4) > 0
