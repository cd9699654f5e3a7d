"""The tasks are building blocks: a user's own kernel calls mk device functions (decorated with
``mk.jit``, it runs where its tensors are: compiled on a GPU, interpreted on the CPU)."""

import pytest
import torch
import triton.language as tl

from mk import jit
from mk.tasks import rmsnorm_ref, rmsnorm_tile
from tests.conftest import DTYPES, assert_close


@jit
def scaled_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride, eps, scale, BLOCK_N: tl.constexpr):
    """A user's kernel: RMSNorm from mk, then the user's own epilogue (scale and tanh)."""
    row = tl.program_id(0)
    # No residual: mk's tile still wants pointers for it; pass x and out, never touched.
    rmsnorm_tile(x_ptr, x_ptr, w_ptr, out_ptr, out_ptr, row, N, stride, stride, stride, stride, eps,
                 HAS_RESIDUAL=False, BLOCK_N=BLOCK_N)
    # Program order makes the tile's stores visible to this program's later loads only for
    # the same thread; a block barrier covers the others.
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK_N)
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        y = tl.load(out_ptr + row * stride + cols, mask=cols < N).to(tl.float32)
        e = tl.exp(2.0 * y * scale)
        tl.store(out_ptr + row * stride + cols, ((e - 1.0) / (e + 1.0)).to(out_ptr.dtype.element_ty), mask=cols < N)


@pytest.mark.parametrize("dtype", DTYPES)
def test_user_kernel_calls_mk_rmsnorm_tile(dtype, device):
    rows, n = 5, 300
    x = torch.randn(rows, n, device=device).to(dtype)
    w = torch.randn(n, device=device).to(dtype)
    out = torch.empty_like(x)
    scaled_norm_kernel[(rows,)](x, w, out, n, x.stride(0), 1e-6, 0.5, BLOCK_N=128)
    ref = torch.tanh(0.5 * rmsnorm_ref(x, w, eps=1e-6))
    assert_close(out, ref, dtype)
