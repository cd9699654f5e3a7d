"""The decode peer: the same Llama in plain bf16 PyTorch with a static KV cache (gpt-fast
style), for eager replay from a CUDA graph and for torch.compile(mode="reduce-overhead").

Weights come from an :class:`mk.models.Llama` (its packed tensors, shared, not copied). The
caches are module buffers, updated in place with ``index_copy_`` at one position shared by
the batch, as gpt-fast does, so that torch.compile's CUDA graphs accept the mutation.

A model whose projections are FP8 (mk.tasks.linear.format) makes an FP8 weight-only peer:
each projection multiplies the FP8 weight widened to bf16 and applies the scales to the
product (per output channel) or to the widened weight (per 128 columns), which
torch.compile fuses as it can (gpt-fast's weight-only int8 recipe, for FP8).

Under tensor parallelism (a model built with ``tp=N``, one process per GPU) the peer is
gpt-fast's TP: each rank runs its share of the heads and MLP columns and of the vocabulary
(the same shares as mk's), and functional all-reduces (which torch.compile traces and its
CUDA graphs replay) sum the O and down projections and the embedding; the LM head's shares
are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchLlamaStep(torch.nn.Module):
    """``step(ids [B], pos [1]) -> next ids [B]``: one decode step for B sequences at cache
    position ``pos``, attending to positions <= pos. ``forward(ids [B, T], pos [T])`` for
    prefill at any positions, ``prefill(ids [B, T])`` for a fresh prompt (both return the
    last token's logits)."""

    def __init__(self, model, batch: int):
        super().__init__()
        c = model.config
        self.c, self.B, self.S = c, batch, model.max_seq_len
        self.tp, self.hq, self.hkv = model.tp, model.shape.heads, model.shape.kv_heads  # (this rank's heads)
        self.vocab_start = model.rank * model.weights["w.embed"].shape[0]
        shape = (batch, self.hkv, self.S, c.head_dim)
        for L in range(c.num_hidden_layers):
            self.register_buffer(f"k{L}", torch.zeros(shape, dtype=model.dtype, device=model.device))
            self.register_buffer(f"v{L}", torch.zeros(shape, dtype=model.dtype, device=model.device))
        w = model.weights
        self.register_buffer("inv_freq", w["inv_freq"])
        self.register_buffer("embed", w["w.embed"])
        self.register_buffer("final_norm", w["w.final_norm"])
        self.register_buffer("lm_head", w["w.lm_head"])
        self.scaled = set()  # the projections stored with scales
        for L in range(c.num_hidden_layers):
            # (gate/up rows are interleaved for mk's epilogue: the peer splits its output.)
            for name in ("attn_norm", "qkv", "o_proj", "mlp_norm", "gate_up", "down"):
                self.register_buffer(f"l{L}_{name}", w[f"w.l{L}.{name}"])
                if f"w.l{L}.{name}.scale" in w:
                    self.register_buffer(f"l{L}_{name}_scale", w[f"w.l{L}.{name}.scale"])
                    self.scaled.add(f"l{L}_{name}")
        if "w.lm_head.scale" in w:
            self.register_buffer("lm_head_scale", w["w.lm_head.scale"])
            self.scaled.add("lm_head")

    def _proj(self, h, name):
        """``h @ W.T`` of projection ``name`` (its format's scales applied)."""
        w = getattr(self, name)
        if name not in self.scaled:
            return h @ w.T
        s = getattr(self, name + "_scale")
        if s.dim() == 1:  # per output channel: the scales finish the product
            return (h @ w.to(h.dtype).T) * s.to(h.dtype)
        return h @ (w.to(h.dtype) * s.repeat_interleave(128, 1)[:, :w.shape[1]].to(h.dtype)).T

    def _sum(self, x):
        """The ranks' partial sums added (an identity on one GPU)."""
        if self.tp == 1:
            return x
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    def _embed(self, ids):
        if self.tp == 1:
            return self.embed[ids]
        local = ids - self.vocab_start  # this rank's rows; zeros for the others' tokens
        mine = (local >= 0) & (local < self.embed.shape[0])
        return self._sum(self.embed[local.clamp(0, self.embed.shape[0] - 1)] * mine[..., None].to(self.embed.dtype))

    def _logits(self, h):
        logits = self._proj(h, "lm_head").float()
        if self.tp == 1:
            return logits
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        return funcol.all_gather_tensor(logits, 1, dist.group.WORLD)

    def _norm(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps)).to(x.dtype) * w

    def _rope(self, x, pos):  # x [B, T, H, D], pos [T]
        # mk packs the q and k rows in the interleaved rotary layout (pairs side by side,
        # mk.tasks.rope.interleave_rotary); rotating them out of it gives Hugging Face's
        # half-split result, so the peer is the same model.
        ang = pos[:, None].float() * self.inv_freq
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        xf = x.float()
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B, T], pos [T] (absolute positions) -> logits of the last token [B, V]."""
        return self._run(ids, pos, fresh=False)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T], a fresh prompt per row at positions 0..T-1 -> logits of the last token
        [B, V]. Causal attention over the prompt's own K/V (SDPA's flash / cuDNN kernels),
        which are also written to the cache, as gpt-fast's prefill does."""
        return self._run(ids, torch.arange(ids.shape[1], device=ids.device), fresh=True)

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, fresh: bool) -> torch.Tensor:
        c = self.c
        B, T = ids.shape
        hq, hkv, d = self.hq, self.hkv, c.head_dim
        x = self._embed(ids)
        mask = None if fresh else torch.arange(self.S, device=ids.device)[None, :] <= pos[:, None]  # [T, S]
        for L in range(c.num_hidden_layers):
            g = lambda name: getattr(self, f"l{L}_{name}")  # noqa: E731
            h = self._norm(x, g("attn_norm"))
            p = lambda x, name: self._proj(x, f"l{L}_{name}")  # noqa: E731
            q, k, v = p(h, "qkv").view(B, T, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=2)
            q, k, v = self._rope(q, pos).transpose(1, 2), self._rope(k, pos).transpose(1, 2), v.transpose(1, 2)
            kc, vc = getattr(self, f"k{L}"), getattr(self, f"v{L}")
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
            if fresh:  # the prompt attends to its own keys, causally
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask[None, None], enable_gqa=True)
            x = x + self._sum(p(o.transpose(1, 2).reshape(B, T, hq * d), "o_proj"))
            gate, up = p(self._norm(x, g("mlp_norm")), "gate_up").unflatten(-1, (-1, 2)).unbind(-1)
            x = x + self._sum(p(F.silu(gate) * up, "down"))
        return self._logits(self._norm(x[:, -1], self.final_norm))

    def step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.forward(ids[:, None], pos).argmax(-1)
