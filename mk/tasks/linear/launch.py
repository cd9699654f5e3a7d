"""The standalone op: :func:`linear` (its kernels launch the tile bodies one tile a program,
or the TMA GEMM for prefill), the gate/up weight layout of SiLU·mul, and the torch
reference :func:`linear_ref`."""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .._device import (check_positive_int, check_real, check_same_device, check_same_dtype, check_tensor,
                       enable_device_descriptors, jit, sm_count, smem_per_block, supported_dtypes, use_pdl)
from .config import LinearConfig, check_config, tile_rows, linear_config, prefetch_lines
from .format import SCALE_BLOCK, SCALE_BLOCK_CODE, SCALE_CHANNEL, expand_columns
from .prefetch import _pdl_enter, linear_prefetch_tile
from .splitk import linear_partial_tile, linear_split_range, linear_splitk_reduce_tile
from .tile import linear_tile
from .tma_gemm import _tile_coords, _tma_gemm_fits, linear_tma_kernel, tma_gemm_config


@jit
def linear_kernel(
    x_ptr, w_ptr, norm_w_ptr, res_ptr, out_ptr, bias_ptr,
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr, PREFETCH_BULK: tl.constexpr,
    w_scale_ptr=None, W_SCALE: tl.constexpr = 0,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    linear_prefetch_tile(w_ptr, pid_n, N, 0, K, stride_wn, PREFETCH_LINES=PREFETCH_LINES, LINE=LINE, BLOCK_N=BLOCK_N,
                         BULK=PREFETCH_BULK)
    _pdl_enter(PDL)
    linear_tile(x_ptr, w_ptr, norm_w_ptr, res_ptr, out_ptr, pid_m, pid_n, M, N, K, 0, K,
                stride_xm, stride_wn, stride_rm, stride_om, eps,
                HAS_NORM=HAS_NORM, HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, bias_ptr=bias_ptr, w_scale_ptr=w_scale_ptr,
                W_SCALE=W_SCALE)


@jit
def linear_partial_kernel(
    x_ptr, w_ptr, norm_w_ptr, ws_ptr,
    M, N, K, split_k, stride_xm, stride_wn, stride_ws_split, stride_ws_m, eps,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_BULK: tl.constexpr, w_scale_ptr=None, W_SCALE: tl.constexpr = 0,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    k_lo, k_hi = linear_split_range(split, split_k, K, BLOCK_K=BLOCK_K)
    linear_prefetch_tile(w_ptr, pid_n, N, k_lo, k_hi, stride_wn, PREFETCH_LINES=PREFETCH_LINES, LINE=LINE,
                         BLOCK_N=BLOCK_N, BULK=PREFETCH_BULK)
    _pdl_enter(PDL)
    linear_partial_tile(x_ptr, w_ptr, norm_w_ptr, ws_ptr, pid_m, pid_n, split, M, N, K, k_lo, k_hi,
                        stride_xm, stride_wn, stride_ws_split, stride_ws_m, eps,
                        HAS_NORM=HAS_NORM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, w_scale_ptr=w_scale_ptr,
                        W_SCALE=W_SCALE)


@jit
def linear_splitk_reduce_kernel(
    ws_ptr, res_ptr, out_ptr, bias_ptr,
    M, N, split_k: tl.constexpr, stride_ws_split, stride_ws_m, stride_rm, stride_om,
    HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    _pdl_enter(PDL)
    linear_splitk_reduce_tile(ws_ptr, res_ptr, out_ptr, pid // num_pid_n, pid % num_pid_n, M, N, split_k,
                              stride_ws_split, stride_ws_m, stride_rm, stride_om,
                              HAS_RESIDUAL=HAS_RESIDUAL, SILU_MUL=SILU_MUL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                              bias_ptr=bias_ptr)


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Pack gate and up projections ([I, K] each) into one [2I, K] weight for silu_mul.

    Layout: row 2i is w_gate[i], row 2i+1 is w_up[i]. It does not depend on any tile size:
    every tile with an even BLOCK_N holds whole (gate, up) pairs, and the epilogue
    splits its accumulator's adjacent columns in registers. Returns a new contiguous tensor
    with the inputs' dtype and device.
    """
    for name, t in (("w_gate", w_gate), ("w_up", w_up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have 2 dims [I, K], got shape {tuple(t.shape)}")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate and w_up shapes differ: {tuple(w_gate.shape)} vs {tuple(w_up.shape)}")
    check_same_dtype(w_gate=w_gate, w_up=w_up)
    check_same_device(w_gate=w_gate, w_up=w_up)
    return torch.stack((w_gate, w_up), dim=1).reshape(2 * w_gate.shape[0], w_gate.shape[1])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    silu_mul: bool = False,
    split_k: int = 1,
    config: LinearConfig | None = None,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x @ weight.T (+ bias)``, optionally with an RMSNorm prologue, residual add or SiLU·mul.

    Args:
        x: ``[..., K]``; rows may be strided, the last dim must be contiguous. Same dtype
            as weight, or float32 (a float32 residual stream over low-precision weights).
        weight: ``[N, K]`` contiguous (Hugging Face layout). With
            ``silu_mul`` the gate/up rows interleaved by :func:`interleave_gate_up`.
        residual: optional ``[..., N]`` added to the product (not with silu_mul), of
            dtype ``out_dtype``.
        norm_weight: optional ``[K]``: x is replaced by rmsnorm(x) (float32 statistics).
        norm_eps: the RMSNorm epsilon.
        silu_mul: return ``silu(gate) * up``, ``[..., N/2]``.
        split_k: K splits, summed by a deterministic reduce. With a config, config.split_k
            is used, and split_k must be 1 or equal to it.
        config: tile sizes; :func:`linear_config` picks them when None.
        out_dtype: dtype of the result; x's dtype when None.
        bias: optional ``[N]``, one value a weight row (Qwen2's q/k/v biases, in the rows'
            order and permutation), added to the float32 product before the residual add or
            SiLU·mul.
        weight_scale: the weight's format's scales (:mod:`mk.tasks.linear.format`), float32
            ``[N]`` (per output channel) or ``[N, ceil(K / 128)]`` (per row and 128 columns):
            the weight is ``weight * scale``; ``weight`` may then be FP8 (``float8_e4m3fn``)
            on a GPU, whatever x's dtype.

    Prefill rows (more than SKINNY_MAX_M) with 16-bit x, weight and result, no RMSNorm,
    residual or split-K and no config given run :func:`linear_tma_kernel` on a GPU with TMA
    and the shared memory for its tile (persistent, TMA-fed; 0.88-1.02 of cuBLAS at the Llama
    prefill shapes on an H200).

    Returns:
        ``[..., N]`` (``[..., N/2]`` with silu_mul) in ``out_dtype``.
    """
    M, N, K, n_out, out_dtype, w_scale = _check_linear_args(x, weight, residual, norm_weight, norm_eps, silu_mul,
                                                            split_k, out_dtype, bias, weight_scale)
    config_given = config is not None
    config = _tile_config(config, M, N, K, x, weight, split_k, silu_mul, w_scale)
    x2 = x.reshape(M, K)
    out = torch.empty((M, n_out), dtype=out_dtype, device=x.device)
    if M == 0:
        return out.reshape(*x.shape[:-1], n_out)
    if not config_given and bias is None and not w_scale and _tma_gemm_fits(x2, weight, out, norm_weight, residual,
                                                                               config.split_k, silu_mul):
        _launch_tma_gemm(x2, weight, out, silu_mul)
    else:
        _launch_tiles(x2, weight, out, config, residual, norm_weight, norm_eps, silu_mul, bias, weight_scale, w_scale)
    return out.reshape(*x.shape[:-1], n_out)


def _check_linear_args(x, weight, residual, norm_weight, norm_eps, silu_mul, split_k, out_dtype, bias, weight_scale):
    """:func:`linear`'s arguments checked (TypeError / ValueError naming the first wrong one);
    returns (M, N, K, the result's columns, its dtype, the weight's scale code)."""
    check_tensor("x", x, ndim=range(1, 9), contiguous=False, last_dim_contiguous=True)
    K = x.shape[-1]
    # (An FP8 weight needs its scales: _check_weight_scale.)
    check_tensor("weight", weight, ndim=2, dtype=(*supported_dtypes(x), torch.float8_e4m3fn))
    if weight.shape[1] != K:
        raise ValueError(f"weight must have shape (N, {K}) to match x's last dim, got {tuple(weight.shape)}")
    N = weight.shape[0]
    if N == 0 or K == 0:
        raise ValueError(f"weight must have at least one row and one column, got shape {tuple(weight.shape)}")
    if weight.numel() >= 2**31:
        raise ValueError(f"weight has {weight.numel()} elements; the kernels index with int32 (< 2**31)")
    w_scale = _check_weight_scale(weight_scale, weight, x)
    if x.dtype != weight.dtype and x.dtype != torch.float32 and not w_scale:
        raise TypeError(f"x must have weight's dtype ({weight.dtype}) or float32, got {x.dtype}")
    check_same_device(x=x, weight=weight)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in supported_dtypes(x):
        raise TypeError(f"out_dtype must be one of {list(supported_dtypes(x))}, got {out_dtype!r}")
    if not isinstance(silu_mul, bool):
        raise TypeError(f"silu_mul must be a bool, got {type(silu_mul).__name__}")
    if silu_mul and N % 2:
        raise ValueError(f"silu_mul needs an even number of weight rows (gate/up pairs), got N={N}")
    if silu_mul and residual is not None:
        raise ValueError("residual and silu_mul cannot be combined")
    n_out = N // 2 if silu_mul else N
    if residual is not None:
        check_tensor("residual", residual, shape=(*x.shape[:-1], N), contiguous=False, last_dim_contiguous=True)
        if residual.dtype != out_dtype:
            raise TypeError(f"residual must have the result's dtype ({out_dtype}), got {residual.dtype}")
        check_same_device(x=x, residual=residual)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(K,))
        check_same_device(x=x, norm_weight=norm_weight)
    if bias is not None:
        check_tensor("bias", bias, shape=(N,))
        check_same_device(x=x, bias=bias)
    check_real("norm_eps", norm_eps)
    check_positive_int("split_k", split_k)
    return x.numel() // K, N, K, n_out, out_dtype, w_scale


def _tile_config(config, M: int, N: int, K: int, x, weight, split_k: int, silu_mul: bool, w_scale: int):
    """The tile :func:`linear` runs: ``config`` checked, or :func:`linear_config`'s pick;
    narrowed where the weight's format needs it (a chunk within one scaled block, e4m3 GEMV
    tiles of at least 16 x 32)."""
    if config is None:
        # x's dtype: a float32 x with bf16 weights sizes shared memory conservatively.
        config = linear_config(M, N, K, x.dtype, split_k=split_k, smem_limit=smem_per_block(x))
    elif isinstance(config, LinearConfig) and split_k != 1 and split_k != config.split_k:
        raise ValueError(f"split_k={split_k} conflicts with config.split_k={config.split_k}")
    config = check_config(config, K, silu_mul)
    if w_scale == SCALE_BLOCK_CODE and SCALE_BLOCK % config.block_k:  # (a chunk within one scaled block)
        config = replace(config, block_k=min(config.block_k, SCALE_BLOCK))
    if weight.dtype == torch.float8_e4m3fn and config.block_m == 1:
        # (An e4m3 GEMV tile multiplies on the tensor cores: 16 rows and 32 columns at least.)
        config = replace(config, block_n=max(config.block_n, 16), block_k=max(config.block_k, 32))
    return config


def _launch_tma_gemm(x2, weight, out, silu_mul: bool) -> None:
    """Prefill rows through :func:`linear_tma_kernel` (persistent, TMA-fed), into ``out``."""
    M, K = x2.shape
    N = weight.shape[0]
    sms = sm_count(x2)
    tma = tma_gemm_config(M, N, sms)
    enable_device_descriptors()
    tiles = triton.cdiv(M, tma.block_m) * triton.cdiv(N, tma.block_n)
    linear_tma_kernel[(min(sms, tiles),)](
        x2, weight, out, M, N, K, x2.stride(0), weight.stride(0), out.stride(0),
        NUM_SMS=min(sms, tiles), SILU_MUL=silu_mul, BLOCK_M=tma.block_m, BLOCK_N=tma.block_n,
        BLOCK_K=tma.block_k, GROUP_M=tma.group_m, NUM_STAGES=tma.num_stages, num_warps=tma.num_warps)


def _launch_tiles(x2, weight, out, config: LinearConfig, residual, norm_weight, norm_eps: float, silu_mul: bool,
                  bias, weight_scale, w_scale: int) -> None:
    """Rows through :func:`linear_kernel` (or its split-K partials and reduce), into ``out``."""
    M, K = x2.shape
    N = weight.shape[0]
    res2 = residual.reshape(M, N) if residual is not None else out
    norm_w = norm_weight if norm_weight is not None else weight
    bm, bn, bk = tile_rows(config, M), config.block_n, config.block_k
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    # PDL only for the GEMV body: on an H200 it lifts M=1 by 3-10% but slows the tl.dot
    # tiles (M=8: 0.49 vs 0.56 of copy at 4096->6144), whose early-launched successors
    # hold shared memory that the running tiles' pipelines want.
    pdl = use_pdl(x2) and config.block_m == 1
    eb = weight.element_size()
    lines, line = prefetch_lines(config, K, eb) if x2.is_cuda else (0, 1)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
    # TMA bulk prefetch needs 16-byte aligned row segments.
    bulk = weight.data_ptr() % 16 == 0 and (weight.stride(0) * eb) % 16 == 0 and (bk * eb) % 16 == 0
    prefetch = dict(PREFETCH_LINES=lines, LINE=line, PDL=pdl, PREFETCH_BULK=bulk)
    if w_scale:
        prefetch.update(w_scale_ptr=weight_scale, W_SCALE=w_scale)
    if config.split_k == 1:
        linear_kernel[(tiles,)](
            x2, weight, norm_w, res2, out, bias, M, N, K, x2.stride(0), weight.stride(0), res2.stride(0),
            out.stride(0),
            float(norm_eps), HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
            SILU_MUL=silu_mul, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m, **prefetch, **launch)
    else:
        ws = torch.empty((config.split_k, M, N), dtype=torch.float32, device=x2.device)
        linear_partial_kernel[(tiles, config.split_k)](
            x2, weight, norm_w, ws, M, N, K, config.split_k, x2.stride(0), weight.stride(0),
            ws.stride(0), ws.stride(1), float(norm_eps),
            HAS_NORM=norm_weight is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
            **prefetch, **launch)
        linear_splitk_reduce_kernel[(tiles,)](
            ws, res2, out, bias, M, N, config.split_k, ws.stride(0), ws.stride(1), res2.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul, BLOCK_M=bm, BLOCK_N=bn, PDL=pdl,
            num_warps=config.num_warps, launch_pdl=pdl)


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    silu_mul: bool = False,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch float32 reference of :func:`linear` (same arguments, float32 result).

    With silu_mul the interleaved weight is de-interleaved by slicing (even rows gate,
    odd rows up), independently of the kernel's in-register split.
    """
    h = x.float()
    if norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.float()
    w = weight.float()
    if weight_scale is not None:  # the weight's format, dequantized
        w = w * (weight_scale.float()[:, None] if weight_scale.dim() == 1 else
                 expand_columns(weight_scale.float(), w.shape[1]))
    b = torch.zeros(w.shape[0], device=w.device) if bias is None else bias.float()
    if silu_mul:
        gate, up = h @ w[0::2].T + b[0::2], h @ w[1::2].T + b[1::2]
        return torch.nn.functional.silu(gate) * up
    y = h @ w.T + b
    return y if residual is None else y + residual.float()


def _check_weight_scale(scale, weight: torch.Tensor, x: torch.Tensor) -> int:
    """The tiles' W_SCALE code of ``scale`` (0 without one), once it fits ``weight`` ``[N, K]``:
    float32 ``[N]`` or ``[N, ceil(K / 128)]`` on weight's device; an FP8 weight needs one."""
    if scale is None:
        if weight.dtype == torch.float8_e4m3fn:
            raise ValueError("an FP8 weight needs its weight_scale (per output channel or per 128 columns)")
        return 0
    N, K = weight.shape
    check_tensor("weight_scale", scale, ndim=(1, 2), dtype=torch.float32)
    blocks = -(-K // SCALE_BLOCK)
    if tuple(scale.shape) not in ((N,), (N, blocks)):
        raise ValueError(f"weight_scale must have shape ({N},) or ({N}, {blocks}) for a weight of {(N, K)}, got "
                         f"{tuple(scale.shape)}")
    check_same_device(weight=weight, weight_scale=scale)
    return SCALE_CHANNEL if scale.dim() == 1 else SCALE_BLOCK_CODE
