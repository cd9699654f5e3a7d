"""The prefill GEMM on Hopper: a persistent grid fed by TMA (:func:`linear_tma_kernel`), its
tile (:class:`TmaGemmConfig`) and when :func:`mk.tasks.linear.linear` runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._device import capability, jit, smem_per_block
from .config import SKINNY_MAX_M


@jit
def _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (pid_m, pid_n), GROUP_M row tiles at a time so their weight tiles share L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    return pid_m, pid_n


@jit
def linear_tma_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    NUM_SMS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Prefill GEMM ``out = x @ w.T`` with 16-bit operands: a persistent grid of NUM_SMS
    programs walks the output tiles (grouped so that GROUP_M row tiles share their weight
    tiles in L2); x and w tiles arrive by TMA into a NUM_STAGES-deep ring, and each tile
    leaves through TMA. SILU_MUL: the tile's interleaved gate/up columns become
    ``silu(gate) * up`` in registers, so the [M, N] product is never stored."""
    OUT_N: tl.constexpr = BLOCK_N // 2 if SILU_MUL else BLOCK_N
    n_out = N // 2 if SILU_MUL else N
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, n_out], strides=[stride_om, 1],
                                       block_shape=[BLOCK_M, OUT_N])
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, k_tiles, num_stages=NUM_STAGES):
            x = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(x, w.T, acc)
        if SILU_MUL:
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, OUT_N, 2)))
            y = gate / (1.0 + tl.exp(-gate)) * up
        else:
            y = acc
        o_desc.store([pid_m * BLOCK_M, pid_n * OUT_N], y.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class TmaGemmConfig:
    """Tile of :func:`linear_tma_kernel` (H200, bf16, the Llama 1B/8B prefill GEMMs at
    2048-8192 rows, replayed from CUDA graphs: 128 x 256 x 64 with a 3-deep ring and 8 warps
    ran 0.88-1.02 of cuBLAS, 0.75 on the 1B QKV at 2048 rows; 128 x 128 tiles ran slower)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8


TMA_GEMM = TmaGemmConfig()
#: For grids whose 128 x 256 tiles leave the last wave mostly idle: the 1B QKV at 2048 rows
#: (192 tiles on 132 SMs) ran 0.76 of cuBLAS with TMA_GEMM, 0.92 with 128 x 128 tiles and
#: a 4-deep ring (H200), which elsewhere ran 0.84-1.0 of TMA_GEMM's speed.
TMA_GEMM_NARROW = TmaGemmConfig(block_n=128, num_stages=4)


def tma_gemm_config(M: int, N: int, sms: int) -> TmaGemmConfig:
    """Tile of :func:`linear_tma_kernel` for an ``[M, N]`` output on ``sms`` SMs: TMA_GEMM,
    unless its tiles fill the SMs' waves more than 10 points worse than TMA_GEMM_NARROW's."""

    def busy(c: TmaGemmConfig) -> float:  # fraction of the SMs' wave slots that hold a tile
        tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
        return tiles / (triton.cdiv(tiles, sms) * sms)

    return TMA_GEMM_NARROW if busy(TMA_GEMM_NARROW) > busy(TMA_GEMM) + 0.1 else TMA_GEMM


def tma_gemm_serves(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    """Whether :func:`mk.tasks.linear.linear` of ``x`` ``[M, K]`` by ``weight`` (no RMSNorm, residual or
    split-K; result in x's dtype) runs :func:`linear_tma_kernel` on this device."""
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((x.shape[0], n_out), dtype=x.dtype, device="meta")
    return (x.dim() == 2 and x.is_cuda and x.device == weight.device
            and _tma_gemm_fits(x, weight, out, None, None, 1, silu_mul))


def tma_gemm_smem_bytes(config: TmaGemmConfig = TMA_GEMM, dtype_bytes: int = 2) -> int:
    """Shared memory of :func:`linear_tma_kernel`: the x and w rings and the output tile
    (TMA_GEMM's is the larger of the two tiles :func:`tma_gemm_config` picks from)."""
    ring = config.num_stages * (config.block_m + config.block_n) * config.block_k * dtype_bytes
    return ring + config.block_m * config.block_n * dtype_bytes


def _tma_gemm_fits(x2, weight, out, norm_weight, residual, split_k: int, silu_mul: bool) -> bool:
    """Whether :func:`linear_tma_kernel` serves this call: a GPU with TMA (compute
    capability 9+) and the shared memory of its tile, 16-bit operands and result of one
    dtype, prefill rows (above SKINNY_MAX_M), no RMSNorm prologue, residual or split-K, and
    the 16-byte strides and bases TMA needs."""
    if not x2.is_cuda or capability(x2)[0] < 9:
        return False
    if (smem_per_block(x2) or 0) < tma_gemm_smem_bytes(dtype_bytes=x2.element_size()):
        return False
    if x2.dtype not in (torch.bfloat16, torch.float16) or not x2.dtype == weight.dtype == out.dtype:
        return False
    if norm_weight is not None or residual is not None or split_k != 1 or x2.shape[0] <= SKINNY_MAX_M:
        return False
    eb = x2.element_size()
    # (An output not allocated yet, on the meta device, is contiguous and aligned once it is.)
    return all((t.is_meta or t.data_ptr() % 16 == 0) and (t.stride(0) * eb) % 16 == 0 and t.stride(1) == 1
               for t in (x2, weight, out)) and (not silu_mul or (weight.shape[0] // 2) % 8 == 0)
