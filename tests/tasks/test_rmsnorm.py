import pytest
import torch

from mk.tasks import rmsnorm, rmsnorm_ref
from mk.tasks.rmsnorm import MAX_BLOCK_N
from tests.conftest import DTYPES, assert_close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 200), (3, 64), (5, 1000), (2, 3, 37), (1, MAX_BLOCK_N + 300)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(shape, with_residual, dtype, device):
    x = torch.randn(shape, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)
    res = torch.randn(shape, device=device).to(dtype) if with_residual else None
    got = rmsnorm(x, w, eps=1e-5, residual=res)
    ref = rmsnorm_ref(x, w, eps=1e-5, residual=res)
    if with_residual:
        assert_close(got[0], ref[0], dtype, "out")
        assert_close(got[1], ref[1], dtype, "residual")
        assert got[0].dtype == dtype and got[1].shape == x.shape
    else:
        assert_close(got, ref, dtype)
        assert got.dtype == dtype and got.shape == x.shape


def test_rmsnorm_strided_rows(device):
    base = torch.randn(4, 300, device=device)
    x = base[:, :200]  # rows strided, last dim contiguous
    w = torch.randn(200, device=device)
    assert_close(rmsnorm(x, w), rmsnorm_ref(x, w), torch.float32)


def test_rmsnorm_rejects_bad_input(device):
    x = torch.randn(2, 16, device=device)
    w = torch.randn(16, device=device)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, torch.randn(17, device=device))
    with pytest.raises(TypeError, match="x"):
        rmsnorm(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="x"):
        rmsnorm(x.tolist(), w)
    with pytest.raises(ValueError, match="x"):
        rmsnorm(x.t(), torch.randn(2, device=device))  # last dim not contiguous
    with pytest.raises(ValueError, match="residual"):
        rmsnorm(x, w, residual=torch.randn(3, 16, device=device))
    with pytest.raises(ValueError, match="eps"):
        rmsnorm(x, w, eps=-1.0)
    if device.type == "cpu":
        with pytest.raises(TypeError, match="x"):
            rmsnorm(x.to(torch.bfloat16), w)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_a_float32_stream_normalised_into_another_dtype(with_residual, device):
    # The prefill's fused step: a float32 residual stream takes a projection's update in the
    # weights' dtype, and its norm comes out in that dtype for the next matmul.
    low = torch.float32 if device.type == "cpu" else torch.bfloat16
    x = torch.randn(5, 300, device=device)
    delta = torch.randn(5, 300, device=device).to(low)
    w = (1 + 0.1 * torch.randn(300, device=device)).to(low)
    if with_residual:
        out, res = rmsnorm(delta, w, eps=1e-5, residual=x, out_dtype=low)
        ref, ref_res = rmsnorm_ref(delta, w, eps=1e-5, residual=x)
        assert res.dtype == torch.float32 and out.dtype == low
        assert_close(res, ref_res, torch.float32, "residual")
    else:
        out, ref = rmsnorm(x, w, eps=1e-5, out_dtype=low), rmsnorm_ref(x, w, eps=1e-5)
        assert out.dtype == low
    assert_close(out, ref, low, "out")
    with pytest.raises(TypeError, match="out_dtype"):
        rmsnorm(x, w, out_dtype=torch.int32)
