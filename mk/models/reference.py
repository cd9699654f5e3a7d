"""A plain-torch decoder forward: the reference the megakernel is checked against.

Written like the Hugging Face models (RMSNorm, rotate-half RoPE, grouped-query
attention, SiLU-gated MLP; what a family's config adds: Qwen2's q/k/v biases, Qwen3's
per-head q/k RMSNorm before RoPE, Mistral's sliding window), computed in float32 whatever the weights' dtype, and using
none of mk's Triton tasks: only :func:`mk.tasks.rope.rope_inv_freq` for the rotary
frequencies (llama3 scaling included), which the tests check against transformers.

The KV cache has the layout mk's decode attention reads, one view per layer::

    k, v: [num_layers, max_batch, num_kv_heads, max_seq_len, head_dim]

Row ``b`` of the batch is cache row ``b``. Prompts of different lengths go in one batch
right-padded, with ``lengths`` saying how many tokens of each row are real: padding is
never written to the cache and never attended to, so it cannot change another row.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mk.tasks.rope import rope_inv_freq

from .config import LlamaConfig
from .weights import expected_shapes, load_weights


class KVCache:
    """Keys and values of every layer: ``k``, ``v`` of shape ``[L, max_batch, Hkv, max_seq_len, D]``.

    ``k[layer]`` / ``v[layer]`` are the ``[B, Hkv, S, D]`` views mk's decode attention
    task reads; position ``s`` of sequence ``b`` lives at ``[:, b, :, s]``.
    """

    def __init__(self, config: LlamaConfig, max_batch: int, max_seq_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        for name, v in (("max_batch", max_batch), ("max_seq_len", max_seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KVCache: {name} must be an int >= 1, got {v!r}")
        shape = (config.num_hidden_layers, max_batch, config.num_key_value_heads, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of layer ``i``, each ``[max_batch, Hkv, max_seq_len, D]`` (views)."""
        return self.k[i], self.v[i]

    def reset(self) -> None:
        """Zero both caches (only for tidiness: positions past a sequence's end are never read)."""
        self.k.zero_()
        self.v.zero_()


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``x * cos + rotate_half(x) * sin`` (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class ReferenceLlama:
    """A decoder's forward in plain float32 torch, from a config (of any family) and a
    weights dict.

    ``weights`` holds Hugging Face parameter names (see :mod:`mk.models.weights`), in any
    dtype on any one device; each matrix is upcast to float32 when used.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor]):
        for name, shape in expected_shapes(config).items():
            if name not in weights:
                raise ValueError(f"ReferenceLlama: weights lack {name!r}")
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"ReferenceLlama: {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
        self.config = config
        self.weights = weights
        self.device = weights["model.embed_tokens.weight"].device
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling_dict).to(self.device)
        # A tied head is the embedding, unless the weights hold one of its own (a tied head
        # stored in another format than the embedding: mk's FP8 LM head, dequantized).
        tied = config.tie_word_embeddings and "lm_head.weight" not in weights
        self.lm_head = "model.embed_tokens.weight" if tied else "lm_head.weight"

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, progress: bool = False) -> "ReferenceLlama":
        """From a Hugging Face checkpoint folder (any family), on the CPU, weights kept in
        their stored dtype."""
        from .auto import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        return cls(config, load_weights(folder, config, progress=progress))

    def new_cache(self, max_batch: int, max_seq_len: int, dtype: torch.dtype = torch.float32) -> KVCache:
        """An empty :class:`KVCache` for this model on its device."""
        return KVCache(self.config, max_batch, max_seq_len, self.device, dtype)

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name].float()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor | int, cache: KVCache,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``T`` tokens of each of ``B`` sequences; returns float32 logits ``[B, T, vocab]``.

        Args:
            tokens: ``[B, T]`` token ids, right-padded when ``lengths`` is given.
            start_pos: ``[B]`` (or one int for all rows): the position of each row's first
                token, i.e. how many tokens of that sequence the cache already holds.
            cache: K/V of positions ``start_pos[b] + t`` go to cache row ``b``; B must not
                exceed ``cache.max_batch``.
            lengths: ``[B]`` valid tokens per row (default: all ``T``). Padding tokens are not
                written to the cache and no token attends to them; their logits are zeros.

        Token ``t`` of row ``b`` attends causally to cache positions ``<= start_pos[b] + t``.
        """
        c = self.config
        dev = self.device
        tokens = torch.as_tensor(tokens, device=dev)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        start_pos = torch.as_tensor(start_pos, device=dev).long().expand(B)
        lengths = torch.full((B,), T, device=dev) if lengths is None else torch.as_tensor(lengths, device=dev).long()
        ends = start_pos + lengths   # cached positions of each sequence after this call
        if B > cache.max_batch:
            raise ValueError(f"batch {B} exceeds the cache's max_batch {cache.max_batch}")
        if lengths.shape != (B,) or bool((lengths < 0).any() | (lengths > T).any()):
            raise ValueError(f"lengths must be [B] = [{B}] with values in [0, {T}], got {lengths.tolist()}")
        if bool((start_pos < 0).any()) or int(ends.max()) > cache.max_seq_len:
            raise ValueError(f"start_pos {start_pos.tolist()} + lengths {lengths.tolist()} must lie in "
                             f"[0, {cache.max_seq_len}] (the cache's max_seq_len)")
        valid = torch.arange(T, device=dev)[None, :] < lengths[:, None]                     # [B, T]
        if bool(((tokens < 0) | (tokens >= c.vocab_size))[valid].any()):
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")

        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        positions = start_pos[:, None] + torch.arange(T, device=dev)                         # [B, T]
        S = int(ends.max())
        key_pos = torch.arange(S, device=dev)
        # Key s is visible to query (b, t) if it is not in the future and is a real token of row b.
        allowed = (key_pos <= positions[:, :, None]) & (key_pos < ends[:, None, None])        # [B, T, S]
        if c.window is not None:  # and among the window's latest positions, the query's own included
            allowed &= key_pos > positions[:, :, None] - c.window
        angle = positions.float()[..., None] * self.inv_freq                                 # [B, T, D/2]
        angle = torch.cat([angle, angle], dim=-1)[:, :, None, :]                             # [B, T, 1, D]
        cos, sin = angle.cos(), angle.sin()

        x = self._w("model.embed_tokens.weight")[tokens.clamp(0, c.vocab_size - 1)]           # [B, T, hidden]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = _rmsnorm(x, self._w(p + "input_layernorm.weight"), c.rms_norm_eps)
            q, k, v = (h @ self._w(p + f"self_attn.{n}_proj.weight").T for n in "qkv")
            if c.QKV_BIAS:
                q, k, v = (t + self._w(p + f"self_attn.{n}_proj.bias") for t, n in zip((q, k, v), "qkv"))
            q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
            if c.QK_NORM:
                q = _rmsnorm(q, self._w(p + "self_attn.q_norm.weight"), c.rms_norm_eps)
                k = _rmsnorm(k, self._w(p + "self_attn.k_norm.weight"), c.rms_norm_eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)

            k_cache, v_cache = cache.layer(i)
            for b in range(B):
                s0, n = int(start_pos[b]), int(lengths[b])
                k_cache[b, :, s0:s0 + n] = k[b, :n].transpose(0, 1).to(k_cache.dtype)
                v_cache[b, :, s0:s0 + n] = v[b, :n].transpose(0, 1).to(v_cache.dtype)
            # Read back from the cache, so a low-precision cache is seen as the kernels see it.
            keys = k_cache[:B, :, :S].float().repeat_interleave(c.num_kv_groups, dim=1)      # [B, H, S, D]
            vals = v_cache[:B, :, :S].float().repeat_interleave(c.num_kv_groups, dim=1)
            scores = q.transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(D)               # [B, H, T, S]
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            # A padding row with nothing visible (length 0 at position 0) gives NaN: make it 0.
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            attn = (probs @ vals).transpose(1, 2).reshape(B, T, H * D)
            x = x + attn @ self._w(p + "self_attn.o_proj.weight").T

            h = _rmsnorm(x, self._w(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            gate = h @ self._w(p + "mlp.gate_proj.weight").T
            up = h @ self._w(p + "mlp.up_proj.weight").T
            x = x + (F.silu(gate) * up) @ self._w(p + "mlp.down_proj.weight").T

        x = _rmsnorm(x, self._w("model.norm.weight"), c.rms_norm_eps)
        logits = x @ self._w(self.lm_head).T
        return logits.masked_fill(~valid[:, :, None], 0.0)

    __call__ = forward


def pad_prompts(prompts: Sequence[Sequence[int]] | torch.Tensor, pad_id: int = 0,
                device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ``(tokens [B, T_max], lengths [B])`` (int64).

    A ``[B, T]`` tensor passes through with every length ``T``.
    """
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2:
            raise ValueError(f"prompts tensor must be [B, T], got shape {tuple(prompts.shape)}")
        return prompts.long().to(device), torch.full((prompts.shape[0],), prompts.shape[1], device=device)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(list(p), dtype=torch.long)
    return tokens, lengths


def prefill_logits(model: ReferenceLlama, prompts: Sequence[Sequence[int]] | torch.Tensor,
                   cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ragged prompts from position 0 in one batch.

    Returns ``(logits [B, T_max, vocab], lengths [B])``; row ``b``'s logits past
    ``lengths[b]`` are zeros. With no ``cache`` a fitting one is made (and dropped).
    """
    tokens, lengths = pad_prompts(prompts, device=model.device)
    if cache is None:
        cache = model.new_cache(tokens.shape[0], tokens.shape[1])
    return model.forward(tokens, 0, cache, lengths), lengths


def greedy_generate(model: ReferenceLlama, prompts: Sequence[Sequence[int]] | torch.Tensor,
                    max_new_tokens: int, cache_dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy decoding: prefill all prompts in one ragged batch, then one token per step.

    Each sequence decodes at its own position (``start_pos = its length so far``). Returns
    the ``max_new_tokens`` new tokens of each prompt (EOS does not stop it: the reference
    is for comparing token streams of fixed length). Raises FloatingPointError where the
    logits a token is chosen from hold NaN or Inf: no token stream to compare against.
    """
    tokens, lengths = pad_prompts(prompts, device=model.device)
    B = tokens.shape[0]
    cache = model.new_cache(B, int(lengths.max()) + max_new_tokens, cache_dtype)
    out: list[list[int]] = [[] for _ in range(B)]
    if max_new_tokens <= 0:
        return out
    logits = model.forward(tokens, 0, cache, lengths)
    logits = logits[torch.arange(B, device=model.device), lengths - 1]
    for step in range(max_new_tokens):
        if not bool(torch.isfinite(logits).all()):
            raise FloatingPointError(f"the reference's logits for new token {step} hold NaN or Inf")
        nxt = logits.argmax(-1)                                                             # [B]
        for b in range(B):
            out[b].append(int(nxt[b]))
        if step + 1 == max_new_tokens:
            break
        logits = model.forward(nxt[:, None], lengths + step, cache)[:, 0]
    return out
