"""Hugging Face's own layers as references for the family options of mk's ops: Qwen3's q/k
RMSNorm and rotary embedding, built from transformers' modules, in HF's layout (no rotary
interleave), so a test that permutes its inputs for mk checks the permutation too."""

from __future__ import annotations

import pytest
import torch


def qwen3_norm_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """x ``[B, T, H, D]`` (HF layout) through ``Qwen3RMSNorm(weight)`` and then
    ``apply_rotary_pos_emb`` at ``positions`` ``[B, T]``, as Qwen3Attention does; float32."""
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    norm = qwen3.Qwen3RMSNorm(x.shape[-1], eps=eps).to(x.device)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        normed = norm(x.float())                                               # [B, T, H, D]
    freqs = positions.float()[..., None] * inv_freq.float()                    # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    # unsqueeze_dim=2: cos/sin [B, T, D] broadcast over the heads of [B, T, H, D].
    rotated, _ = qwen3.apply_rotary_pos_emb(normed, normed, emb.cos(), emb.sin(), unsqueeze_dim=2)
    return rotated
