"""Prefill's matrix products by PyTorch (cuBLAS on a GPU), in a weight's format."""

from __future__ import annotations

import torch


def mm(a: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
       scale: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ weight.T`` by PyTorch (cuBLAS on a GPU), float32 accumulation; the result in
    ``out_dtype`` (default a's). ``scale``: the weight's format's scales
    (:mod:`mk.tasks.linear.format`): the product of ``weight * scale``, by :func:`mm_scaled`."""
    if scale is not None:
        return mm_scaled(a, weight, scale, out_dtype or a.dtype)
    if out_dtype is None or out_dtype == a.dtype:
        return torch.mm(a, weight.t())
    try:
        return torch.mm(a, weight.t(), out_dtype=out_dtype)
    except TypeError:  # PyTorch before 2.8: round to a's dtype, then widen
        return torch.mm(a, weight.t()).to(out_dtype)


def mm_scaled(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ (weight * scale).T`` in ``out_dtype``, for prefill. An FP8 weight scaled per output
    channel goes to the FP8 tensor cores (``torch._scaled_mm``) with ``a`` quantized to FP8 a
    row at a time (each row's largest magnitude at 448: W8A8, as prefill engines run FP8
    checkpoints; rows padded to a multiple of 16). A weight scaled per 128 columns is
    dequantized to ``a``'s dtype :data:`DEQUANT_ROWS` rows at a time (a bounded workspace).
    Off a GPU (FP8 values held in float32) the scales apply to the float32 product."""
    from mk.tasks.linear.format import FP8_MAX, expand_columns

    M, K = a.shape
    if weight.dtype == torch.float8_e4m3fn and scale.dim() == 1 and K % 16 == 0 and weight.shape[0] % 16 == 0:
        pad = -M % 16
        a_pad = a if not pad else torch.cat([a, a.new_zeros(pad, K)])
        a_scale = (a_pad.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
        a_q = (a_pad / a_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(a_q, weight.t(), scale_a=a_scale, scale_b=scale[None, :], out_dtype=torch.bfloat16)
        return (y if out_dtype == torch.bfloat16 else y.to(out_dtype))[:M]
    if weight.dtype != torch.float8_e4m3fn and scale.dim() == 1:
        return (mm(a, weight.to(a.dtype), torch.float32) * scale).to(out_dtype)
    out = torch.empty(M, weight.shape[0], dtype=out_dtype, device=a.device)
    for n0 in range(0, weight.shape[0], DEQUANT_ROWS):
        rows = slice(n0, n0 + DEQUANT_ROWS)
        s = scale[rows][:, None] if scale.dim() == 1 else expand_columns(scale[rows], K)
        out[:, rows] = mm(a, (weight[rows].float() * s).to(a.dtype), out_dtype)
    return out


#: Rows of a block-scaled weight dequantized at once in prefill (8B shapes: 32 MiB of float32).
DEQUANT_ROWS = 2048
