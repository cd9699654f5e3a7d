"""The decode peer: the same Llama in plain bf16 PyTorch with a static KV cache (gpt-fast
style), for eager replay from a CUDA graph and for torch.compile(mode="reduce-overhead").

Weights come from an :class:`mk.models.Llama` (its packed tensors, shared, not copied).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchLlamaStep:
    """``step(ids [B], pos [B]) -> next ids [B]``: one decode step for B sequences, each
    attending to its cache positions <= pos[b]. ``forward(ids [B, T], start)`` for prefill."""

    def __init__(self, model, batch: int):
        c = model.config
        self.c, self.w, self.B = c, model.weights, batch
        self.S = model.max_seq_len
        self.k = torch.zeros(c.num_hidden_layers, batch, c.num_key_value_heads, self.S, c.head_dim,
                             dtype=model.dtype, device=model.device)
        self.v = torch.zeros_like(self.k)
        self.inv_freq = self.w["inv_freq"]
        # gate/up de-interleaved once (the peer runs them as two matmuls, or one on a cat).
        self.gate_up = {L: torch.cat([self.w[f"w.l{L}.gate_up"][0::2], self.w[f"w.l{L}.gate_up"][1::2]])
                        for L in range(c.num_hidden_layers)}

    def _norm(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps)).to(x.dtype) * w

    def _rope(self, x, pos):  # x [B, T, H, D], pos [B, T]
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B, T], pos [B, T] (absolute positions) -> logits of the last token [B, V]."""
        c, w = self.c, self.w
        B, T = ids.shape
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = w["w.embed"][ids]
        rows = torch.arange(B, device=ids.device)[:, None].expand(B, T)
        key_pos = torch.arange(self.S, device=ids.device)
        mask = key_pos[None, None, :] <= pos[:, :, None]  # [B, T, S]
        for L in range(c.num_hidden_layers):
            h = self._norm(x, w[f"w.l{L}.attn_norm"])
            q, k, v = (h @ w[f"w.l{L}.qkv"].T).view(B, T, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            self.k[L][rows, :, pos] = k
            self.v[L][rows, :, pos] = v
            o = F.scaled_dot_product_attention(q.transpose(1, 2), self.k[L], self.v[L], attn_mask=mask[:, None],
                                               enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(B, T, hq * d) @ w[f"w.l{L}.o_proj"].T
            g, u = (self._norm(x, w[f"w.l{L}.mlp_norm"]) @ self.gate_up[L].T).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ w[f"w.l{L}.down"].T
        return (self._norm(x[:, -1], w["w.final_norm"]) @ w["w.lm_head"].T).float()

    def step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.forward(ids[:, None], pos[:, None]).argmax(-1)
