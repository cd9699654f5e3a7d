import pytest
import torch
import triton
import triton.language as tl

from mk import jit
from mk.tasks.silu_mul import (
    FLOPS_PER_ELEMENT,
    MAX_BLOCK_I,
    silu_mul,
    silu_mul_block_i,
    silu_mul_cost,
    silu_mul_ref,
    silu_mul_tile,
)
from tests.conftest import DTYPES, assert_close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 200), (3, 64), (5, 1000), (2, 3, 37), (2, MAX_BLOCK_I + 300), (7,)])
def test_silu_mul_matches_reference(shape, dtype, device):
    gate = (3 * torch.randn(shape, device=device)).to(dtype)
    up = torch.randn(shape, device=device).to(dtype)
    got = silu_mul(gate, up)
    assert got.shape == gate.shape and got.dtype == dtype and got.is_contiguous()
    assert_close(got, silu_mul_ref(gate, up), dtype)


def test_silu_mul_halves_of_a_fused_projection(device):
    # gate and up as the two halves of one [.., 2I] gate_up output: strided rows.
    gate_up = torch.randn(2, 3, 2 * 200, device=device)
    gate, up = gate_up[..., :200], gate_up[..., 200:]
    assert_close(silu_mul(gate, up), silu_mul_ref(gate, up), torch.float32)


def test_silu_mul_large_magnitudes(device):
    gate = torch.tensor([-80.0, -20.0, 0.0, 20.0, 80.0], device=device)
    up = torch.full_like(gate, 2.0)
    got = silu_mul(gate, up)
    assert torch.isfinite(got).all()
    assert_close(got, silu_mul_ref(gate, up), torch.float32)


@jit
def _one_worker_kernel(g_ptr, u_ptr, o_ptr, ROWS, I, NUM_BLOCKS, BLOCK_I: tl.constexpr):
    # A persistent-style caller: one program walks every (row, column block) itself.
    for t in range(0, ROWS * NUM_BLOCKS):
        silu_mul_tile(g_ptr, u_ptr, o_ptr, t // NUM_BLOCKS, t % NUM_BLOCKS, I, I, I, I, BLOCK_I=BLOCK_I)


def test_silu_mul_tile_from_another_kernel(device):
    gate, up = torch.randn(3, 200, device=device), torch.randn(3, 200, device=device)
    out = torch.full_like(gate, float("nan"))
    _one_worker_kernel[(1,)](gate, up, out, 3, 200, triton.cdiv(200, 64), BLOCK_I=64)
    assert_close(out, silu_mul_ref(gate, up), torch.float32)


def test_silu_mul_rejects_bad_input(device):
    gate, up = torch.randn(2, 16, device=device), torch.randn(2, 16, device=device)
    gate0, up0 = gate.clone(), up.clone()
    with pytest.raises(ValueError, match="up"):
        silu_mul(gate, torch.randn(2, 17, device=device))
    with pytest.raises(TypeError, match="gate"):
        silu_mul(gate.to(torch.int32), up)
    with pytest.raises(TypeError, match="gate"):
        silu_mul(gate.tolist(), up)
    with pytest.raises(ValueError, match="gate"):
        silu_mul(gate.t(), up.t())  # last dim not contiguous
    with pytest.raises(ValueError, match="up"):
        silu_mul(gate, up.to("meta"))  # wrong device
    with pytest.raises(ValueError, match="gate"):
        silu_mul(torch.tensor(1.0, device=device), torch.tensor(1.0, device=device))
    if device.type == "cpu":
        with pytest.raises(TypeError, match="gate"):
            silu_mul(gate.to(torch.bfloat16), up)
    else:
        with pytest.raises(TypeError, match="dtypes differ"):
            silu_mul(gate, up.to(torch.bfloat16))
    assert torch.equal(gate, gate0) and torch.equal(up, up0)


def test_silu_mul_empty_and_hooks(device):
    assert silu_mul(torch.empty(0, 5, device=device), torch.empty(0, 5, device=device)).shape == (0, 5)
    assert silu_mul_block_i(200) == 256 and silu_mul_block_i(14336) == MAX_BLOCK_I
    cost = silu_mul_cost(rows=3, i=200, dtype_bytes=2)
    assert (cost.bytes_read, cost.bytes_written, cost.flops) == (2 * 600 * 2, 600 * 2, FLOPS_PER_ELEMENT * 600)


def test_silu_mul_interleaved_pairs_of_one_projection(device):
    # gate/up rows interleaved (mk's packing): gate the even columns, up the odd ones.
    gate_up = torch.randn(3, 2 * 300, device=device)
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    got = silu_mul(gate, up)
    assert got.is_contiguous() and got.shape == (3, 300)
    assert_close(got, silu_mul_ref(gate, up), torch.float32)
    with pytest.raises(ValueError, match="stride"):
        silu_mul(gate_up[:, 0::3], gate_up[:, 1::3])
    with pytest.raises(ValueError, match="stride"):
        silu_mul(gate, gate_up[:, 300:])
