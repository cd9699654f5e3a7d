"""Rotary position embedding (Llama, Hugging Face half-split layout), fused with the KV append.

For a head vector x of even size D, with x1 = x[:D/2] and x2 = x[D/2:]:

    angle[i] = position * inv_freq[i]                 (float32, i < D/2)
    out      = cat(x1 * cos(angle) - x2 * sin(angle),
                   x2 * cos(angle) + x1 * sin(angle))

which is Hugging Face's ``x * cos + rotate_half(x) * sin`` with ``cos = cat(cos, cos)``.

``interleaved=True`` reads the pairs as adjacent elements instead, ``x1 = x[0::2]`` and
``x2 = x[1::2]``, and writes the result in the usual half-split layout:
``rope(interleave_rotary(x), interleaved=True) == rope(x)``. mk's Llama permutes its q and
k weight rows once at load time (:func:`interleave_rotary`), so that a QKV tile of any
even width holds whole pairs and can rotate its own output (:mod:`mk.tasks.qkv_rope`);
rotated q and the KV cache keep the usual layout.
``rope_kv`` rotates q and k of each new token, returns the rotated q, and writes the
rotated k and the untouched v into the KV cache at the token's position.

Per-head q/k RMSNorm (Qwen3): with ``q_norm_weight`` / ``k_norm_weight`` (``[D]``, Hugging
Face's ``q_norm.weight`` / ``k_norm.weight``) each head vector is first replaced by
``x / sqrt(mean(x**2) + eps) * weight`` (float32 statistics over the head), then rotated,
as Qwen3's attention does. The weight is in the layout of x's heads: with
``interleaved=True`` pass ``interleave_rotary(weight, D)``, the permutation of the q / k
weight rows (the mean is the same in any order, so the norm commutes with it).

KV cache layout (shared with :mod:`mk.tasks.decode_attention`)::

    k_cache, v_cache: [B, Hkv, S_max, D]   row (b, h, s) holds position s of head h

so one head's cached rows are contiguous and decode attention streams them.
Rotation math runs in float32 whatever the storage dtype.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import triton
import triton.language as tl

from ._cost import TaskCost
from ._device import jit, check_real, check_same_device, check_same_dtype, check_tensor, is_capturing
from ._spec import OpSpec, Region, as_2d, check_sizes, check_tile, operand_view, register
from .decode_attention import AttentionPrologue, kv_length_at

#: Elements of one half-head tile [BLOCK_H, BLOCK_HALF] a program holds at once.
MAX_TILE_ELEMENTS = 2048

_POSITION_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- frequencies


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: Mapping | None = None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, float32 ``[head_dim // 2]`` on the CPU.

    Default Llama: ``inv_freq[i] = theta ** (-2i / head_dim)``.

    ``rope_scaling`` is the ``rope_scaling`` dict of a Hugging Face config. Supported:
    ``None`` or rope type ``"default"`` (no scaling) and ``"llama3"`` (Llama 3.1/3.2),
    which needs ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``. With wavelength ``w = 2π / inv_freq`` and
    ``L = original_max_position_embeddings``:

    - ``w < L / high_freq_factor`` (high frequencies): kept;
    - ``w > L / low_freq_factor`` (low frequencies): divided by ``factor``;
    - in between: ``(1 - s) * f / factor + s * f`` with
      ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

    Computed in float64 and rounded once to float32 (Hugging Face computes in float32;
    the two differ by at most about one float32 ulp). Raises ValueError on an unknown
    rope type or bad parameters (TypeError where a number is not a number); theta and the
    llama3 parameters must be finite and positive.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even int >= 2, got {head_dim!r}")
    theta = check_real("theta", theta, positive=True)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta ** exponents)

    rope_type = _rope_type(rope_scaling)
    if rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_scaling)
    inv_freq = inv_freq.to(torch.float32)
    # A tiny theta (1e-300) gives frequencies past float32's range: angles of inf, cos/sin NaN.
    if not torch.isfinite(inv_freq).all():
        raise ValueError(f"theta {theta!r} gives inverse frequencies beyond float32's range (models use "
                         f"a theta of 1e4 to 1e7)")
    return inv_freq


def _rope_type(rope_scaling: Mapping | None) -> str:
    if rope_scaling is None:
        return "default"
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    # Hugging Face configs spell it "rope_type" (new) or "type" (old).
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(
            f"rope_scaling has rope type {rope_type!r}; mk supports 'default' and 'llama3'")
    return rope_type


def _llama3_scale(inv_freq: torch.Tensor, rope_scaling: Mapping) -> torch.Tensor:
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope_scaling]
    if missing:
        raise ValueError(f"rope_scaling of type 'llama3' lacks {', '.join(missing)}")
    factor, low, high, old_len = (check_real(f"rope_scaling[{k!r}]", rope_scaling[k], positive=True) for k in keys)
    if not low < high:
        raise ValueError(f"rope_scaling 'llama3' needs low_freq_factor < high_freq_factor, got {low} and {high}")
    wavelen = 2 * math.pi / inv_freq
    low_band = wavelen > old_len / low      # long wavelengths: stretched by factor
    high_band = wavelen < old_len / high    # short wavelengths: kept as they are
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(low_band, inv_freq / factor, torch.where(high_band, inv_freq, mid))


# --------------------------------------------------------------------------- device code


@jit
def rope_cos_sin(inv_freq_ptr, position, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """cos and sin of ``position * inv_freq`` as float32 ``[BLOCK_HALF]`` (0 / 0 past HALF)."""
    offs = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    angle = position.to(tl.float32) * inv_freq
    return tl.cos(angle), tl.sin(angle)


@jit
def rope_rotate_heads(
    x_ptr, out_ptr, stride_xh, stride_oh, num_heads, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, ROTATE: tl.constexpr,
    INTERLEAVED: tl.constexpr = False, PAIR_LOADS: tl.constexpr = False, norm_w_ptr=None, eps=0.0,
):
    """Heads ``0..num_heads`` of one token: out[h] = rope(x[h]) (or a plain copy if not ROTATE).

    ``x_ptr`` / ``out_ptr`` point at head 0 of the token; rows are ``stride_*h`` apart and
    contiguous inside. ``cos`` / ``sin`` come from :func:`rope_cos_sin`. INTERLEAVED: x's
    pair i is elements (2i, 2i + 1), else (i, i + HALF); out's is always (i, i + HALF).
    PAIR_LOADS (with INTERLEAVED): read each head as one contiguous row and split the pairs
    in registers, rather than two stride-2 loads (4x the time at prefill sizes, H200).
    ``norm_w_ptr``: RMSNorm each head (over its 2 * HALF elements, ``eps``) with this weight,
    in x's layout, before the rotation (Qwen3's q / k norm); None: no norm.
    """
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    first = offs_c * 2 if INTERLEAVED else offs_c
    second: tl.constexpr = 1 if INTERLEAVED else HALF
    if norm_w_ptr is not None:
        # The weight of each pair's two elements, in x's layout as the pair itself.
        w1 = tl.load(norm_w_ptr + first, mask=offs_c < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w_ptr + first + second, mask=offs_c < HALF, other=0.0).to(tl.float32)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + offs_h
        mask = (heads < num_heads)[:, None] & (offs_c < HALF)[None, :]
        o1_ptrs = out_ptr + heads[:, None] * stride_oh + offs_c[None, :]
        if INTERLEAVED and PAIR_LOADS:
            offs_2 = tl.arange(0, 2 * BLOCK_HALF)
            mask2 = (heads < num_heads)[:, None] & (offs_2 < 2 * HALF)[None, :]
            both = tl.load(x_ptr + heads[:, None] * stride_xh + offs_2[None, :], mask=mask2, other=0.0)
            x1, x2 = tl.split(tl.reshape(both, (BLOCK_H, BLOCK_HALF, 2)))
        else:
            x1_ptrs = x_ptr + heads[:, None] * stride_xh + first[None, :]
            x1 = tl.load(x1_ptrs, mask=mask, other=0.0)
            x2 = tl.load(x1_ptrs + second, mask=mask, other=0.0)
        if ROTATE:
            x1 = x1.to(tl.float32)
            x2 = x2.to(tl.float32)
            if norm_w_ptr is not None:
                # Padded lanes loaded as 0, so the sum of squares is the head's.
                rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
                x1 = x1 * rstd[:, None] * w1[None, :]
                x2 = x2 * rstd[:, None] * w2[None, :]
            o1 = x1 * cos[None, :] - x2 * sin[None, :]
            o2 = x2 * cos[None, :] + x1 * sin[None, :]
        else:
            o1 = x1
            o2 = x2
        tl.store(o1_ptrs, o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o1_ptrs + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def rope_tile(
    x_ptr, pos_ptr, inv_freq_ptr, out_ptr,
    b, t, num_heads,
    stride_xb, stride_xt, stride_xh,
    stride_pb, stride_pt,
    stride_ob, stride_ot, stride_oh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr = False,
):
    """Rotate all heads of token (b, t) of x into out; touches out[b, t] only."""
    position = tl.load(pos_ptr + b * stride_pb + t * stride_pt)
    cos, sin = rope_cos_sin(inv_freq_ptr, position, HALF, BLOCK_HALF)
    rope_rotate_heads(x_ptr + b * stride_xb + t * stride_xt, out_ptr + b * stride_ob + t * stride_ot,
                      stride_xh, stride_oh, num_heads, cos, sin,
                      HALF=HALF, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, ROTATE=True, INTERLEAVED=INTERLEAVED)


@jit
def rope_kv_tile(
    q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    b, t, num_q_heads, num_kv_heads, max_seq,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_pb, stride_pt,
    stride_qob, stride_qot, stride_qoh,
    stride_kcb, stride_kch, stride_kcs,
    stride_vcb, stride_vch, stride_vcs,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr = False,
    PAIR_LOADS: tl.constexpr = False, q_norm_w_ptr=None, k_norm_w_ptr=None, norm_eps=0.0,
):
    """Token (b, t): q_out[b, t] = rope(q[b, t]); caches[b, :, pos] = rope(k[b, t]), v[b, t].

    ``pos = positions[b, t]``. Touches only q_out[b, t] and the cache rows at pos; a
    position outside ``[0, max_seq)`` writes no cache row (launchers reject it first, this
    guard only keeps a bad position in a fused kernel from corrupting memory).
    ``q_norm_w_ptr`` / ``k_norm_w_ptr``: ``[2 * HALF]`` weights of a per-head RMSNorm of q /
    of k before the rotation (Qwen3; eps ``norm_eps``), in q's and k's layout (the module
    docstring); None: none.
    """
    position = tl.load(pos_ptr + b * stride_pb + t * stride_pt)
    cos, sin = rope_cos_sin(inv_freq_ptr, position, HALF, BLOCK_HALF)
    rope_rotate_heads(q_ptr + b * stride_qb + t * stride_qt, q_out_ptr + b * stride_qob + t * stride_qot,
                      stride_qh, stride_qoh, num_q_heads, cos, sin,
                      HALF=HALF, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, ROTATE=True, INTERLEAVED=INTERLEAVED,
                      PAIR_LOADS=PAIR_LOADS, norm_w_ptr=q_norm_w_ptr, eps=norm_eps)
    # A head count of 0 makes the cache loops empty: no branch on a tensor condition needed.
    kv_heads = tl.where((position >= 0) & (position < max_seq), num_kv_heads, 0)
    rope_rotate_heads(k_ptr + b * stride_kb + t * stride_kt,
                      k_cache_ptr + b * stride_kcb + position * stride_kcs,
                      stride_kh, stride_kch, kv_heads, cos, sin,
                      HALF=HALF, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, ROTATE=True, INTERLEAVED=INTERLEAVED,
                      PAIR_LOADS=PAIR_LOADS, norm_w_ptr=k_norm_w_ptr, eps=norm_eps)
    rope_rotate_heads(v_ptr + b * stride_vb + t * stride_vt,
                      v_cache_ptr + b * stride_vcb + position * stride_vcs,
                      stride_vh, stride_vch, kv_heads, cos, sin,
                      HALF=HALF, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, ROTATE=False)


@jit
def rope_kv_group_tile(
    qkv_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, b, kv_head, append, max_seq,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, q_norm_w_ptr=None, k_norm_w_ptr=None, norm_eps=0.0,
):
    """The group of KV head ``kv_head`` of sequence b's new token, from the fused QKV
    projection's row (``qkv[b]``: q heads, k heads, v heads, q and k interleaved): its
    ``HQ / HKV`` q heads rotated (normed first with ``q_norm_w_ptr``) into ``q[b]``
    (``[B, HQ * HEAD_DIM]``), and with ``append`` (0 or 1) its k (normed, rotated) and v into
    the caches (``[B, HKV, max_seq, HEAD_DIM]``) at ``pos[b]`` (none where the position is
    outside ``[0, max_seq)``). What a decode attention split does before it attends when RoPE
    folds into it (:func:`rope_kv_attention_prologue`)."""
    GROUP: tl.constexpr = HQ // HKV
    W: tl.constexpr = (HQ + 2 * HKV) * HEAD_DIM
    kv = kv_head.to(tl.int64)
    rope_kv_tile(qkv_ptr + kv * (GROUP * HEAD_DIM), qkv_ptr + (HQ + kv) * HEAD_DIM,
                 qkv_ptr + (HQ + HKV + kv) * HEAD_DIM, pos_ptr, inv_freq_ptr, q_ptr + kv * (GROUP * HEAD_DIM),
                 k_cache_ptr + kv * (max_seq * HEAD_DIM), v_cache_ptr + kv * (max_seq * HEAD_DIM),
                 b, 0, GROUP, append, max_seq,
                 W, 0, HEAD_DIM, W, 0, HEAD_DIM, W, 0, HEAD_DIM, 1, 0, HQ * HEAD_DIM, 0, HEAD_DIM,
                 HKV * max_seq * HEAD_DIM, max_seq * HEAD_DIM, HEAD_DIM, HKV * max_seq * HEAD_DIM, max_seq * HEAD_DIM,
                 HEAD_DIM, HALF=HEAD_DIM // 2, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, INTERLEAVED=True,
                 q_norm_w_ptr=q_norm_w_ptr, k_norm_w_ptr=k_norm_w_ptr, norm_eps=norm_eps)


@jit
def rope_kv_seqlen_tile(pos_ptr, seqlens_ptr, b, t, stride_pb, stride_pt, max_seq):
    """seqlens[b] = positions[b, t] + 1, clipped to ``[0, max_seq]``.

    The number of cached positions of sequence b once token (b, t), its newest, is in
    the cache: what :mod:`mk.tasks.decode_attention` reads. A persistent kernel computes
    it on the device from the positions buffer, so a decode step needs no host work
    beyond advancing the positions. The clip only keeps a bad position from making
    attention read past the cache (launchers reject such positions first).
    """
    position = tl.load(pos_ptr + b * stride_pb + t * stride_pt)
    n = tl.minimum(tl.maximum(position + 1, 0), max_seq)
    tl.store(seqlens_ptr + b, n.to(seqlens_ptr.dtype.element_ty))


@jit
def rope_kernel(
    x_ptr, pos_ptr, inv_freq_ptr, out_ptr, T, num_heads,
    stride_xb, stride_xt, stride_xh, stride_pb, stride_pt, stride_ob, stride_ot, stride_oh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    pid = tl.program_id(0)
    rope_tile(x_ptr, pos_ptr, inv_freq_ptr, out_ptr, pid // T, pid % T, num_heads,
              stride_xb, stride_xt, stride_xh, stride_pb, stride_pt, stride_ob, stride_ot, stride_oh,
              HALF=HALF, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, INTERLEAVED=INTERLEAVED)


@jit
def rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, num_rows,
    q_norm_w_ptr, k_norm_w_ptr, norm_eps,
    T, num_q_heads, num_kv_heads, max_seq,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_pb, stride_pt,
    stride_qob, stride_qot, stride_qoh,
    stride_kcb, stride_kch, stride_kcs,
    stride_vcb, stride_vch, stride_vcs,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    if HAS_ROWS:  # a packed batch (B = 1): token t's cache row is rows[t]
        row = tl.load(rows_ptr + pid).to(tl.int64)
        # A row outside the cache writes nothing (max_seq 0 turns the cache writes off); the
        # launcher rejects such rows first, this guards an unchecked call.
        max_seq = tl.where((row >= 0) & (row < num_rows), max_seq, 0)
        row = tl.where((row >= 0) & (row < num_rows), row, 0)
        k_cache_ptr += row * stride_kcb
        v_cache_ptr += row * stride_vcb
    rope_kv_tile(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                 pid // T, pid % T, num_q_heads, num_kv_heads, max_seq,
                 stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                 stride_vb, stride_vt, stride_vh, stride_pb, stride_pt,
                 stride_qob, stride_qot, stride_qoh,
                 stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
                 HALF=HALF, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, INTERLEAVED=INTERLEAVED, PAIR_LOADS=True,
                 q_norm_w_ptr=q_norm_w_ptr, k_norm_w_ptr=k_norm_w_ptr, norm_eps=norm_eps)


# --------------------------------------------------------------------------- settings


def rope_blocks(head_dim: int, num_heads: int) -> tuple[int, int]:
    """``(BLOCK_H, BLOCK_HALF)``: the half-head width padded to a power of 2, and as many
    heads per step as fit in :data:`MAX_TILE_ELEMENTS` (at most the head count, padded)."""
    block_half = triton.next_power_of_2(max(head_dim // 2, 1))
    block_h = min(triton.next_power_of_2(max(num_heads, 1)), max(1, MAX_TILE_ELEMENTS // block_half))
    return block_h, block_half


def rope_num_warps(block_h: int, block_half: int) -> int:
    """Warps for a [BLOCK_H, BLOCK_HALF] tile: 4 cover the usual 2048 elements."""
    return 4 if block_h * block_half <= 2048 else 8


# --------------------------------------------------------------------------- launchers


def _check_positions(positions: object, batch: int, tokens: int) -> torch.Tensor:
    return check_tensor("positions", positions, shape=(batch, tokens), dtype=_POSITION_DTYPES,
                        contiguous=False)


def _check_inv_freq(inv_freq: object, half: int) -> torch.Tensor:
    return check_tensor("inv_freq", inv_freq, shape=(half,), dtype=torch.float32)


def _check_interleaved(interleaved: object) -> None:
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")


def interleave_rotary(t: torch.Tensor, head_dim: int, dim: int = 0) -> torch.Tensor:
    """``t`` with axis ``dim`` (heads of ``head_dim`` elements) reordered from the half-split
    layout to the interleaved one: element i of a head goes to 2i, element i + D/2 to 2i + 1.

    On q / k projection weights ``[H * D, K]`` (dim 0) this makes a model whose q and k
    come out interleaved; a new contiguous tensor. Inverse: :func:`deinterleave_rotary`.
    """
    return _permute_head_axis(t, head_dim, dim, (2, head_dim // 2))


def deinterleave_rotary(t: torch.Tensor, head_dim: int, dim: int = 0) -> torch.Tensor:
    """The inverse of :func:`interleave_rotary` (interleaved -> half-split), a new tensor."""
    return _permute_head_axis(t, head_dim, dim, (head_dim // 2, 2))


def _permute_head_axis(t: torch.Tensor, head_dim: int, dim: int, split: tuple[int, int]) -> torch.Tensor:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even int >= 2, got {head_dim!r}")
    dim = dim % t.dim()
    if t.shape[dim] % head_dim:
        raise ValueError(f"axis {dim} of size {t.shape[dim]} is not a whole number of heads of {head_dim}")
    shape = t.shape[:dim] + (t.shape[dim] // head_dim, *split) + t.shape[dim + 1:]
    return t.reshape(shape).transpose(dim + 1, dim + 2).reshape(t.shape).contiguous()


def check_qk_norm(q_norm_weight, k_norm_weight, head_dim: int, eps, like: torch.Tensor,
                  eps_name: str = "norm_eps") -> None:
    """Per-head q/k norm weights: both None, or both ``[head_dim]`` on ``like``'s device, and
    a finite eps >= 0 (checked with or without weights; named ``eps_name``); raises
    ValueError (TypeError for a non-tensor or a non-number) otherwise."""
    check_real(eps_name, eps)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together (Qwen3 norms both q and k)")
    if q_norm_weight is None:
        return
    check_tensor("q_norm_weight", q_norm_weight, shape=(head_dim,))
    check_tensor("k_norm_weight", k_norm_weight, shape=(head_dim,))
    check_same_device(q=like, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)


def _check_head_dim(name: str, t: torch.Tensor) -> int:
    d = t.shape[-1]
    if d < 2 or d % 2:
        raise ValueError(f"{name} has head_dim {d}; rotary embedding needs an even head_dim >= 2")
    return d


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
         interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of ``x`` (no cache).

    Args:
        x: ``[B, T, H, D]``, D even; last dim contiguous (a slice of a fused QKV output works).
        positions: ``[B, T]`` int32/int64, the position of each token.
        inv_freq: float32 ``[D // 2]``, from :func:`rope_inv_freq`.
        interleaved: x's rotation pairs are adjacent elements (see the module docstring);
            the result has the usual layout.

    Returns:
        A new contiguous ``[B, T, H, D]`` tensor in x's dtype.
    """
    check_tensor("x", x, ndim=4, contiguous=False, last_dim_contiguous=True)
    batch, tokens, heads, d = x.shape
    _check_head_dim("x", x)
    _check_positions(positions, batch, tokens)
    _check_inv_freq(inv_freq, d // 2)
    _check_interleaved(interleaved)
    check_same_device(x=x, positions=positions, inv_freq=inv_freq)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        block_h, block_half = rope_blocks(d, heads)
        rope_kernel[(batch * tokens,)](
            x, positions, inv_freq, out, tokens, heads,
            x.stride(0), x.stride(1), x.stride(2), positions.stride(0), positions.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            HALF=d // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, INTERLEAVED=interleaved,
            num_warps=rope_num_warps(block_h, block_half),
        )
    return out


def _check_cache_slots(positions: torch.Tensor, cache_rows: torch.Tensor | None, max_seq: int,
                       cache_batch: int) -> None:
    """:func:`rope_kv`'s value checks (they read the positions back): every position in the
    cache, every cache row in it, and no two tokens writing one cache slot."""
    tokens = positions.shape[1]
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= max_seq:
        raise ValueError(f"positions must lie in [0, {max_seq}) (the cache length S_max), "
                         f"got values from {lo} to {hi}")
    if cache_rows is not None:
        if tokens and (int(cache_rows.min()) < 0 or int(cache_rows.max()) >= cache_batch):
            raise ValueError(f"cache_rows must lie in [0, {cache_batch}) (the cache's rows), got values "
                             f"from {int(cache_rows.min())} to {int(cache_rows.max())}")
        slots = cache_rows.long() * max_seq + positions[0].long()
        if slots.unique().numel() != tokens:
            raise ValueError("(cache row, position) pairs repeat: two tokens would write one cache slot")
    elif tokens > 1:
        ordered = positions.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise ValueError("positions repeat within a row: two tokens would write one cache slot")


def rope_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, *, interleaved: bool = False, check_values: bool = True,
    cache_rows: torch.Tensor | None = None, validate: bool = True,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Rotate q and k at ``positions``, append k and v to the KV cache, return the rotated q.

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hkv, D]``. D even; the last dim must be
            contiguous (views into a fused QKV output are fine). T = 1 for decode.
        positions: ``[B, T]`` int32/int64, each in ``[0, S_max)`` and distinct within a row
            (two tokens of one sequence cannot share a cache slot).
        inv_freq: float32 ``[D // 2]``, from :func:`rope_inv_freq`.
        k_cache, v_cache: ``[B, Hkv, S_max, D]``, last dim contiguous, in one dtype (k and v
            are converted to it: it may differ from theirs).
        interleaved: q's and k's rotation pairs are adjacent elements (see the module
            docstring); the rotated q and the cache rows have the usual layout.
        check_values: False skips the position checks below (reading positions back to the
            host waits for the device), for a caller that built them (a prefill's arange).
        cache_rows: optional int32/int64 ``[T]`` for a packed batch of several sequences
            (B = 1): token t belongs to cache row ``cache_rows[t]`` (the caches may then
            have any number of rows), and (row, position) pairs must be distinct.
        validate: False skips every check (their host time is several launches'), for a
            caller that built the arguments (mk's prefill); bad arguments are then undefined.
        q_norm_weight, k_norm_weight: ``[D]`` each, together or neither: every q and k head is
            RMSNorm-ed with them (eps ``norm_eps``) before the rotation, as Qwen3 does; in q's
            and k's layout (with ``interleaved``, :func:`interleave_rotary` of Hugging Face's
            ``q_norm.weight`` / ``k_norm.weight``).

    Writes ``k_cache[b, h, positions[b, t]] = rope(k[b, t, h])`` and
    ``v_cache[b, h, positions[b, t]] = v[b, t, h]`` (``b = cache_rows[t]`` with cache_rows);
    no other cache row changes.

    Returns:
        Rotated q, a new contiguous ``[B, T, Hq, D]`` tensor in q's dtype.

    Every argument is checked before anything is written (position values only outside
    CUDA graph capture, where reading them back is impossible, and with check_values).
    """
    if validate:
        check_tensor("q", q, ndim=4, contiguous=False, last_dim_contiguous=True)
        _check_head_dim("q", q)
        check_tensor("k", k, ndim=4, contiguous=False, last_dim_contiguous=True)
        check_tensor("k_cache", k_cache, ndim=4, contiguous=False, last_dim_contiguous=True)
    batch, tokens, hq, d = q.shape
    hkv, max_seq = k.shape[2], k_cache.shape[2]
    cache_batch = batch if cache_rows is None else k_cache.shape[0]
    if validate:
        check_tensor("k", k, shape=(batch, tokens, hkv, d), contiguous=False)
        check_tensor("v", v, shape=(batch, tokens, hkv, d), contiguous=False, last_dim_contiguous=True)
        _check_positions(positions, batch, tokens)
        _check_inv_freq(inv_freq, d // 2)
        _check_interleaved(interleaved)
        check_qk_norm(q_norm_weight, k_norm_weight, d, norm_eps, q)
        if cache_rows is not None:
            if batch != 1:
                raise ValueError(f"cache_rows packs several sequences into one row of q: q must have B = 1, got {batch}")
            check_tensor("cache_rows", cache_rows, shape=(tokens,), dtype=_POSITION_DTYPES)
        check_tensor("k_cache", k_cache, shape=(cache_batch, hkv, max_seq, d), contiguous=False)
        check_tensor("v_cache", v_cache, shape=(cache_batch, hkv, max_seq, d), contiguous=False,
                     last_dim_contiguous=True)
        # The cache may be wider than q/k/v (a float32 cache under bf16 weights): stores convert.
        check_same_dtype(q=q, k=k, v=v)
        check_same_dtype(k_cache=k_cache, v_cache=v_cache)
        check_same_device(q=q, k=k, v=v, positions=positions, inv_freq=inv_freq, k_cache=k_cache,
                          v_cache=v_cache, **({} if cache_rows is None else {"cache_rows": cache_rows}))
        # Range checks need the values on the host: not possible while a CUDA graph is
        # captured, so then positions are trusted (the kernel still skips out-of-range rows).
        if check_values and positions.numel() and not is_capturing(positions):
            _check_cache_slots(positions, cache_rows, max_seq, cache_batch)

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch * tokens and hq + hkv:
        block_h, block_half = rope_blocks(d, max(hq, hkv))
        rope_kv_kernel[(batch * tokens,)](
            q, k, v, positions, inv_freq, q_out, k_cache, v_cache, positions if cache_rows is None else cache_rows,
            cache_batch, q_norm_weight, k_norm_weight, float(norm_eps), tokens, hq, hkv, max_seq,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            positions.stride(0), positions.stride(1),
            q_out.stride(0), q_out.stride(1), q_out.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HALF=d // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, INTERLEAVED=interleaved,
            HAS_ROWS=cache_rows is not None, num_warps=rope_num_warps(block_h, block_half),
        )
    return q_out


# --------------------------------------------------------------------------- references


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
             interleaved: bool = False) -> torch.Tensor:
    """Plain torch rotary embedding in float32, written as Hugging Face's rotate_half form
    (interleaved: x's pairs are ``x[..., 0::2]`` and ``x[..., 1::2]``, put side by side into
    halves first; the result has the usual layout)."""
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    angle = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)   # [B, T, D/2]
    emb = torch.cat([angle, angle], dim=-1)[:, :, None, :]                        # [B, T, 1, D]
    xf = x.float()
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return xf * emb.cos() + rotated_half * emb.sin()


def head_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """float32 RMSNorm of each head vector (last dim) with ``weight``; x itself (float32) if
    weight is None."""
    x = x.float()
    if weight is None:
        return x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_kv_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, *, interleaved: bool = False,
    cache_rows: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for :func:`rope_kv`; changes nothing it is given.

    Returns float32 ``(q_rot, k_cache_after, v_cache_after)``: the caches are float32
    copies with the new rows written.
    """
    q_rot = rope_ref(head_rmsnorm_ref(q, q_norm_weight, norm_eps), positions, inv_freq, interleaved=interleaved)
    k_rot = rope_ref(head_rmsnorm_ref(k, k_norm_weight, norm_eps), positions, inv_freq, interleaved=interleaved)
    k_after, v_after = k_cache.float().clone(), v_cache.float().clone()
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            pos, row = int(positions[b, t]), b if cache_rows is None else int(cache_rows[t])
            k_after[row, :, pos] = k_rot[b, t]
            v_after[row, :, pos] = v[b, t].float()
    return q_rot, k_after, v_after


# --------------------------------------------------------------------------- planner hooks


def rope_kv_cost(batch: int, tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype_bytes: int = 2, qk_norm: bool = False) -> TaskCost:
    """Bytes and flops of one :func:`rope_kv` call (positions and inv_freq included;
    ``qk_norm``: with the per-head q/k RMSNorm, its two weights and its work)."""
    n = batch * tokens
    elems = n * (num_q_heads + 2 * num_kv_heads) * head_dim
    reads = elems * dtype_bytes + n * 8 + (head_dim // 2) * 4
    # 6 flops per rotated (x1, x2) pair (4 mul, 2 add), i.e. 3 per element of q and k, plus the angles.
    flops = n * (num_q_heads + num_kv_heads) * head_dim * 3 + n * head_dim // 2
    if qk_norm:
        reads += 2 * head_dim * dtype_bytes
        # square, add, and two multiplies (rstd, weight) per element of q and k.
        flops += n * (num_q_heads + num_kv_heads) * head_dim * 4
    return TaskCost(reads, elems * dtype_bytes, flops)


def rope_kv_smem_bytes(block_h: int, block_half: int, num_warps: int) -> int:
    """Shared memory the tile needs: none (elementwise, no reduction, no layout change)."""
    return 0


# ---------------------------------------------------------------------------------------
# Megakernel spec: how the op runs as a task of the persistent kernel (mk.tasks._spec)
# ---------------------------------------------------------------------------------------


@register("rope_kv")
def rope_kv_op(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seq: int, *,
               write_seqlens: bool = True, interleaved: bool = False, num_warps: int | None = None,
               qk_norm: bool = False, qk_eps: float = 1e-6) -> OpSpec:
    """RoPE of sequence b's one new token, and its k and v appended to the KV cache.

    Operands: qkv ``[batch, (Hq + 2 Hkv) * D]`` (the fused QKV projection: q heads, then k
    heads, then v heads), pos int32/int64 ``[batch]`` (the token's position, read on the
    device: a decode step needs no host work but advancing it), inv_freq float32 ``[D/2]``,
    q ``[batch, Hq * D]`` (rotated q out), k_cache and v_cache ``[batch, Hkv, max_seq, D]``
    (:mod:`mk.tasks.rope`'s layout), and with ``write_seqlens`` seqlens int32/int64
    ``[batch]``, set to ``pos + 1`` (clipped to ``[0, max_seq]``): the lengths decode
    attention reads, so one positions buffer drives the whole step (let one layer's rope_kv
    write them). ``interleaved``: the rotation pairs are adjacent elements
    (:mod:`mk.tasks.rope`). Args: b.

    Regions: the cache row written is at a runtime position, so the write region is
    conservatively *every* cache row of sequence b (all heads, all positions): attention
    tasks of b, which read their head's rows, then wait for this task (as they must), and
    nothing else of a decode step touches that layer's cache. A position outside
    ``[0, max_seq)`` writes no cache row (the device function's guard; the VM does the same).

    ``qk_norm``: operands q_norm and k_norm ``[D]`` (in q's and k's layout) RMSNorm each q and
    k head (eps ``qk_eps``) before the rotation, as Qwen3 does.
    """
    check_sizes("rope_kv", batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 max_seq=max_seq)
    if head_dim % 2:
        raise ValueError(f"rope_kv: head_dim must be even, got {head_dim}")
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    block_h, block_half = rope_blocks(d, max(hq, hkv))
    width = (hq + 2 * hkv) * d
    operands = (("qkv", "pos", "inv_freq", "q", "k_cache", "v_cache") + (("seqlens",) if write_seqlens else ())
                + (("q_norm", "k_norm") if qk_norm else ()))
    # b in 64 bits: b * (Hkv * S_max * D) passes 2**31 for long caches.
    body = ("rope_kv_tile(qkv, qkv + HQ * HEAD_DIM, qkv + (HQ + HKV) * HEAD_DIM, pos, inv_freq, q, k_cache, v_cache, "
            "b.to(tl.int64), 0, HQ, HKV, S_MAX, "
            "(HQ + 2 * HKV) * HEAD_DIM, 0, HEAD_DIM, (HQ + 2 * HKV) * HEAD_DIM, 0, HEAD_DIM, "
            "(HQ + 2 * HKV) * HEAD_DIM, 0, HEAD_DIM, 1, 0, HQ * HEAD_DIM, 0, HEAD_DIM, "
            "HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, HEAD_DIM, HKV * S_MAX * HEAD_DIM, S_MAX * HEAD_DIM, HEAD_DIM, "
            "HALF=HALF, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, INTERLEAVED=INTERLEAVED"
            + (", q_norm_w_ptr=q_norm, k_norm_w_ptr=k_norm, norm_eps=QK_EPS)" if qk_norm else ")"))
    if write_seqlens:
        body += "\nrope_kv_seqlen_tile(pos, seqlens, b, 0, 1, 0, S_MAX)"

    def seq(a):
        check_tile("rope_kv", "b", a["b"], batch)
        return a["b"]

    def run(bufs, a):
        b = seq(a)
        _rope_kv_rows("rope_kv", bufs, b, slice(None), slice(None), batch=batch, hq=hq, hkv=hkv, d=d, max_seq=max_seq,
                      interleaved=interleaved, qk_norm=qk_norm, qk_eps=qk_eps)
        if write_seqlens:
            _write_seqlen("rope_kv", bufs, b, batch, max_seq)

    def reads(a, bind):
        b = seq(a)
        regs = [Region(bind["qkv"], b, b + 1, 0, width), Region(bind["pos"], 0, 1, b, b + 1),
                Region(bind["inv_freq"], 0, 1, 0, d // 2)]
        if qk_norm:
            regs += [Region(bind["q_norm"], 0, 1, 0, d), Region(bind["k_norm"], 0, 1, 0, d)]
        return regs

    def writes(a, bind):
        b = seq(a)
        rows = (b * hkv * max_seq, (b + 1) * hkv * max_seq)
        regs = [Region(bind["q"], b, b + 1, 0, hq * d), Region(bind["k_cache"], *rows, 0, d),
                Region(bind["v_cache"], *rows, 0, d)]
        if write_seqlens:
            regs.append(Region(bind["seqlens"], 0, 1, b, b + 1))
        return regs

    return OpSpec(name="rope_kv", operands=operands, args=("b",), body=body,
                  imports=("from mk.tasks.rope import rope_kv_seqlen_tile, rope_kv_tile",),
                  constexprs={"BATCH": batch, "HQ": hq, "HKV": hkv, "HEAD_DIM": d, "S_MAX": max_seq, "HALF": d // 2,
                              "BLOCK_H": block_h, "BLOCK_HALF": block_half, "SEQLENS": int(write_seqlens),
                              "INTERLEAVED": int(bool(interleaved)),
                              **({"QK_NORM": 1, "QK_EPS": float(qk_eps)} if qk_norm else {})},
                  num_warps=num_warps or rope_num_warps(block_h, block_half), run=run, reads=reads, writes=writes,
                  tiles=lambda _: [{"b": b} for b in range(batch)])


def _rope_kv_rows(op: str, bufs: dict, b: int, heads: slice, kv_heads: slice | None, *, batch: int, hq: int, hkv: int,
                  d: int, max_seq: int, interleaved: bool, qk_norm: bool, qk_eps: float) -> None:
    """RoPE of sequence b's new token in torch (the VM's), for q heads ``heads`` and, where
    ``kv_heads`` is not None, the k / v heads appended at its position (none outside the
    cache)."""
    qkv = operand_view(op, "qkv", bufs["qkv"], batch, (hq + 2 * hkv) * d)[b].float()
    pos_t = operand_view(op, "pos", bufs["pos"], 1, batch)[0, b]
    inv_freq = operand_view(op, "inv_freq", bufs["inv_freq"], 1, d // 2)[0]
    positions = pos_t.reshape(1, 1)
    norms = {w: as_2d(bufs[w])[0].float() for w in ("q_norm", "k_norm")} if qk_norm else {}
    q_out = operand_view(op, "q", bufs["q"], batch, hq * d)
    q_in = head_rmsnorm_ref(qkv[:hq * d].view(1, 1, hq, d)[:, :, heads], norms.get("q_norm"), qk_eps)
    q_out[b].view(hq, d)[heads] = rope_ref(q_in, positions, inv_freq, interleaved=interleaved)[0, 0].to(q_out.dtype)
    pos = int(pos_t)
    if kv_heads is not None and 0 <= pos < max_seq:
        kc, vc = (operand_view(op, c, bufs[c], batch * hkv * max_seq, d).view(batch, hkv, max_seq, d)
                  for c in ("k_cache", "v_cache"))
        k = head_rmsnorm_ref(qkv[hq * d:(hq + hkv) * d].view(1, 1, hkv, d)[:, :, kv_heads], norms.get("k_norm"),
                             qk_eps)
        kc[b, kv_heads, pos] = rope_ref(k, positions, inv_freq, interleaved=interleaved)[0, 0].to(kc.dtype)
        vc[b, kv_heads, pos] = qkv[(hq + hkv) * d:].view(hkv, d)[kv_heads].to(vc.dtype)


def _write_seqlen(op: str, bufs: dict, b: int, batch: int, max_seq: int) -> None:
    """seqlens[b] from the step's position, in torch (the VM's :func:`rope_kv_seqlen_tile`)."""
    pos = int(operand_view(op, "pos", bufs["pos"], 1, batch)[0, b])
    operand_view(op, "seqlens", bufs["seqlens"], 1, batch)[0, b] = kv_length_at(pos, max_seq)


def rope_kv_attention_prologue(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seq: int, *,
                               write_seqlens: bool = False, qk_norm: bool = False, qk_eps: float = 1e-6):
    """:func:`rope_kv_op`'s work folded into decode attention (an
    :class:`mk.tasks.decode_attention.AttentionPrologue` for
    :func:`mk.tasks.decode_attention.decode_attention_op`): each live split of KV head
    ``kv`` rotates its group's q heads from the fused QKV row (interleaved, normed first with
    ``qk_norm``) into q, every split of the group writing the same values; the split holding
    the new key (the last live one) appends k and v at the token's position; with
    ``write_seqlens`` split 0 of KV head 0 sets seqlens[b] (:func:`rope_kv_seqlen_tile`).

    The q/k norm needs a head's every element, which a QKV tile narrower than a head does
    not hold; here a head is always whole, so RoPE has no phase of its own at any tiling.
    Operands added (attention's q is written): qkv, inv_freq, then q_norm and k_norm, then seqlens.
    """
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    group = hq // hkv
    block_h, block_half = rope_blocks(d, group)
    norms = ", q_norm_w_ptr=q_norm, k_norm_w_ptr=k_norm, norm_eps=ROPE_QK_EPS" if qk_norm else ""
    body = ("rope_kv_group_tile(qkv, pos, inv_freq, q, k_cache, v_cache, b.to(tl.int64), kv_head, "
            "(split == attn_live - 1).to(tl.int32), S_MAX, HQ=HQ, HKV=HKV, HEAD_DIM=HEAD_DIM, "
            f"BLOCK_H=ROPE_BLOCK_H, BLOCK_HALF=ROPE_BLOCK_HALF{norms})")
    if write_seqlens:
        body += "\nif (kv_head == 0) & (split == 0):\n    rope_kv_seqlen_tile(pos, seqlens, b, 0, 1, 0, S_MAX)"
    op = "decode_attention"
    sizes = dict(batch=batch, hq=hq, hkv=hkv, d=d, max_seq=max_seq, interleaved=True, qk_norm=qk_norm, qk_eps=qk_eps)

    def run(bufs, b, kv, split, live):
        _rope_kv_rows(op, bufs, b, slice(kv * group, (kv + 1) * group),
                      slice(kv, kv + 1) if split == live - 1 else None, **sizes)
        if write_seqlens and kv == 0 and split == 0:
            _write_seqlen(op, bufs, b, batch, max_seq)

    def reads(bind, b, kv):
        # Only its group's columns of the row: the group waits for the QKV tiles of its own
        # heads, not for the whole projection.
        regs = [Region(bind["qkv"], b, b + 1, kv * group * d, (kv + 1) * group * d),
                Region(bind["qkv"], b, b + 1, (hq + kv) * d, (hq + kv + 1) * d),
                Region(bind["qkv"], b, b + 1, (hq + hkv + kv) * d, (hq + hkv + kv + 1) * d),
                Region(bind["inv_freq"], 0, 1, 0, d // 2)]
        return regs + ([Region(bind["q_norm"], 0, 1, 0, d), Region(bind["k_norm"], 0, 1, 0, d)] if qk_norm else [])

    def writes(bind, b, kv):
        rows = ((b * hkv + kv) * max_seq, (b * hkv + kv + 1) * max_seq)
        regs = [Region(bind["q"], b, b + 1, kv * group * d, (kv + 1) * group * d),
                Region(bind["k_cache"], *rows, 0, d), Region(bind["v_cache"], *rows, 0, d)]
        return regs + ([Region(bind["seqlens"], 0, 1, b, b + 1)] if write_seqlens and kv == 0 else [])

    return AttentionPrologue(
        operands=("qkv", "inv_freq") + (("q_norm", "k_norm") if qk_norm else ()) + (
            ("seqlens",) if write_seqlens else ()),
        body=body, imports=("from mk.tasks.rope import rope_kv_group_tile, rope_kv_seqlen_tile",),
        constexprs={"ROPE_BLOCK_H": block_h, "ROPE_BLOCK_HALF": block_half, "ROPE_SEQLENS": int(write_seqlens),
                    **({"ROPE_QK_EPS": float(qk_eps)} if qk_norm else {})},
        run=run, reads=reads, writes=writes)
