"""Causal attention over a prompt (prefill), flash-attention style, with grouped queries.

For batch row b, query head h (its key/value head is h // (Hq / Hkv)) and query t < L_b:

    s_j     = scale * <q[b, t, h], k[b, j, h_kv]>          for j <= t and j < L_b
    out[t]  = sum_j softmax(s)_j * v[b, j, h_kv]

L_b = seqlens[b] is the valid length of row b (prompts are right-padded to T); padded
query rows come out as zeros and padded keys are never attended. The queries may be a
chunk of the prompt: with ``q_start`` they are tokens [q_start, q_start + Tq) and attend
to keys [0, q_start + Tq), so a long prompt can be prefilled a chunk at a time, each
chunk's keys written to the cache before its attention (bounded activation memory).

Sliding window (Mistral's ``sliding_window``): with ``window = W`` token t attends only the
keys ``j`` with ``t - W < j <= t`` (its last W positions, itself included), Hugging Face's
rule (``transformers.masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``, with
the causal mask). Key blocks wholly before a tile's window are never loaded.

The tile walks key blocks left to right keeping a running max and running sum per query
row (online softmax), so no [T, T] score matrix exists; scores, sums and the output
accumulator are float32 whatever the storage dtype. Key blocks wholly above the causal
diagonal or past L_b are never loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._dot import mma

from ._cost import TaskCost
from ._device import jit, interpreting, check_same_device, check_same_dtype, check_tensor, is_capturing

#: Widest head the tile keeps in registers ([BLOCK_M, HEAD_DIM] float32 accumulator).
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class PrefillAttentionConfig:
    """Tile shape and launch settings of one attention tile.

    ``head_dim`` is part of the tile (it is the K dim of ``q @ k^T`` and the N dim of
    ``p @ v``), so the shared-memory model can be computed from the config alone.
    """

    head_dim: int
    block_m: int = 64
    block_n: int = 64
    num_stages: int = 2
    num_warps: int = 4


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def prefill_attention_config(seq_len: int, head_dim: int, interpreted: bool = False) -> PrefillAttentionConfig:
    """Default tile for prompts of ``seq_len`` tokens and heads of ``head_dim``.

    On a GPU: 64 query rows per tile, against 128-key blocks for heads up to 64 wide and
    64-key blocks up to 128, through a 3-deep ring (H200, causal GQA 32/8 heads, graph
    replays against SDPA's flash backend: 1.16 / 0.91 of it at 2k / 8k tokens for 64-wide
    heads, where 128 x 64 tiles ran 0.96 / 0.85; 1.16 / 0.96 for 128-wide heads, where
    2 stages ran 1.10 / 0.94).
    Under the interpreter every op costs the same whatever its size, so larger blocks
    simply mean fewer programs.
    """
    fit = max(16, triton.next_power_of_2(max(seq_len, 1)))
    if interpreted:
        block = min(64, fit)
        return PrefillAttentionConfig(head_dim, block, block, num_stages=1, num_warps=4)
    block_m = min(64, fit)
    block_n = min(128 if head_dim <= 64 else 64 if head_dim <= 128 else 32, fit)
    num_warps = 4
    num_stages = 3
    return PrefillAttentionConfig(head_dim, block_m, block_n, num_stages, num_warps)


@jit
def _online_softmax_update(acc, m_i, l_i, qk, v):
    """Fold one key block into the running (acc, max, sum); qk is in log2 units, -inf where masked."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen no visible key yet has m_new == -inf; subtracting 0 instead
    # keeps exp2 at exactly 0 where -inf - -inf would give NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # p is float32: against a 16-bit v it goes through the tensor cores in two halves
    # (mma), not rounded once as flash attention does.
    acc = mma(p, v, acc * alpha[:, None])
    return acc, m_new, l_i


@jit
def prefill_attention_tile(
    q_ptr, k_ptr, v_ptr, out_ptr, seqlens_ptr,
    b, q_head, tile_m, Tq, q_start,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    scale,
    GROUP: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = None,
):
    """Attention output for query rows [tile_m*BLOCK_M, (tile_m+1)*BLOCK_M) of batch row b,
    head q_head: of the ``Tq`` rows of q, which are tokens ``q_start + row``.

    ``b``, ``q_head``, ``tile_m`` are int32 scalars (tensors); the key/value head is
    ``q_head // GROUP``. All tensors have unit stride in their last (head) dim. With
    HAS_SEQLENS the row's valid length is ``seqlens_ptr[b]``; keys at or past it, or past
    ``q_start + Tq`` (no query of this call sees them), are never read. Writes exactly this
    tile's rows of out (zeros for tokens at or past the valid length). WINDOW: a sliding
    window of that many keys (token t sees keys ``t - WINDOW < j <= t``); key blocks before
    the tile's first token's window are never read. None: every earlier key.
    """
    kv_head = q_head // GROUP
    seqlen = q_start + Tq
    if HAS_SEQLENS:
        seqlen = tl.minimum(tl.load(seqlens_ptr + b).to(tl.int32), seqlen)
    m_start = tile_m * BLOCK_M
    first = q_start + m_start  # the tile's first token
    # Keys this tile may see: [0, hi). Keys [0, lo_full) lie below every query token of
    # the tile and inside the valid length, so those blocks need no mask at all.
    hi = tl.where(first < seqlen, tl.minimum(seqlen, first + BLOCK_M), 0)
    lo_full = tl.minimum((tl.minimum(first, seqlen) // BLOCK_N) * BLOCK_N, hi)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    tokens = q_start + offs_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # 64-bit batch offsets: b * stride_b passes 2**31 elements for long batched prompts.
    b64 = tl.cast(b, tl.int64)
    q_base = q_ptr + b64 * stride_qb + q_head * stride_qh
    k_base = k_ptr + b64 * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b64 * stride_vb + kv_head * stride_vh
    o_base = out_ptr + b64 * stride_ob + q_head * stride_oh

    row_valid = (tokens < seqlen) & (offs_m < Tq)
    # Padded query rows load as 0 so whatever the caller left there (even NaN) cannot
    # reach the softmax; their output is overwritten with zeros below anyway.
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    kt_ptrs = k_base + offs_n[None, :] * stride_kt + offs_d[:, None]  # [HEAD_DIM, BLOCK_N]: k transposed
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]   # [BLOCK_N, HEAD_DIM]
    # exp(x) == exp2(x * log2(e)): the tile works in base 2, one hardware op on the GPU.
    qk_scale = scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if WINDOW is None:
        full_lo = 0
    else:
        # Keys below lo_full are causal for every token of the tile. Of them, those from
        # full_lo on lie inside every token's window (j > last token - WINDOW): no mask. The
        # blocks from the first token's window up to full_lo need the window's mask only.
        last = first + BLOCK_M - 1
        full_lo = tl.minimum(tl.cdiv(tl.maximum(last - WINDOW + 1, 0), BLOCK_N) * BLOCK_N, lo_full)
        win_lo = (tl.maximum(first - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        for start_n in range(win_lo, full_lo, BLOCK_N):
            cols = start_n + offs_n
            kt = tl.load(kt_ptrs + start_n * stride_kt)
            v = tl.load(v_ptrs + start_n * stride_vt)
            qk = mma(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)) * qk_scale
            qk = tl.where(cols[None, :] > tokens[:, None] - WINDOW, qk, float("-inf"))
            acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, qk, v)

    for start_n in range(full_lo, lo_full, BLOCK_N):
        kt = tl.load(kt_ptrs + start_n * stride_kt)
        v = tl.load(v_ptrs + start_n * stride_vt)
        qk = mma(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)) * qk_scale
        acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, qk, v)

    # The diagonal block(s) and the last valid block: causal and length masks. Keys at
    # or past the valid length are not even loaded (other=0), so NaN padding in k or v
    # cannot leak through 0 * NaN in the dots.
    for start_n in range(lo_full, hi, BLOCK_N):
        cols = start_n + offs_n
        key_valid = cols < seqlen
        kt = tl.load(kt_ptrs + start_n * stride_kt, mask=key_valid[None, :], other=0.0)
        v = tl.load(v_ptrs + start_n * stride_vt, mask=key_valid[:, None], other=0.0)
        qk = mma(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)) * qk_scale
        visible = (cols[None, :] <= tokens[:, None]) & key_valid[None, :]
        if WINDOW is not None:
            visible &= cols[None, :] > tokens[:, None] - WINDOW
        qk = tl.where(visible, qk, float("-inf"))
        acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, qk, v)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out = tl.where(row_valid[:, None], out, 0.0)
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_m < Tq)[:, None])


@jit
def prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, seqlens_ptr,
    Tq, q_start, num_q_heads,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    scale,
    GROUP: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
):
    # Axis 0 runs over query tiles last-first: later tiles see more keys, so starting
    # them first shortens the tail of the grid.
    tile_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    prefill_attention_tile(
        q_ptr, k_ptr, v_ptr, out_ptr, seqlens_ptr,
        bh // num_q_heads, bh % num_q_heads, tile_m, Tq, q_start,
        stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_ob, stride_ot, stride_oh,
        scale,
        GROUP=GROUP, HAS_SEQLENS=HAS_SEQLENS, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        WINDOW=WINDOW,
    )


def _check_config(config: object, head_dim: int) -> PrefillAttentionConfig:
    if not isinstance(config, PrefillAttentionConfig):
        raise TypeError(f"config must be a PrefillAttentionConfig, got {type(config).__name__}")
    if config.head_dim != head_dim:
        raise ValueError(f"config.head_dim is {config.head_dim} but q has head_dim {head_dim}")
    for name in ("block_m", "block_n"):
        value = getattr(config, name)
        # tl.dot needs every dim >= 16; tl.arange needs powers of two.
        if not (isinstance(value, int) and _is_pow2(value) and value >= 16):
            raise ValueError(f"config.{name} must be a power of two >= 16, got {value!r}")
    return config


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    config: PrefillAttentionConfig | None = None,
    check_values: bool = True,
    q_start: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Causal grouped-query attention over right-padded prompts.

    Args:
        q: ``[B, Tq, Hq, D]``, unit stride in the last dim (other dims may be strided,
            e.g. a slice of a fused QKV projection): tokens ``[q_start, q_start + Tq)``.
        k, v: ``[B, T, Hkv, D]`` with ``T >= q_start + Tq`` (keys past ``q_start + Tq``
            are never read), in one dtype (q's or another: a float32 q meets bf16 keys
            without being rounded); Hq must be a multiple of Hkv.
        seqlens: optional ``[B]`` int32 (or int64) valid length of each row, in
            ``[0, T]``; None means every row is T long. Checked on the host, which
            synchronises with the device.
        scale: score scale, default ``1 / sqrt(D)``.
        config: tile settings (default :func:`prefill_attention_config`).
        check_values: False skips the seqlens range check (no wait for the device), for a
            caller that built them; out-of-range lengths are then undefined behaviour.
        q_start: the first query's token index (a chunk of a longer prompt), >= 0.
        window: a sliding window (Mistral's ``sliding_window``): token t attends keys
            ``t - window < j <= t`` only (see the module docstring); None: all ``j <= t``.

    D must be a power of two in [16, 256].

    Returns:
        ``[B, Tq, Hq, D]`` contiguous, dtype of q; rows of tokens at or past
        ``seqlens[b]`` are 0.
    """
    check_tensor("q", q, ndim=4, contiguous=False, last_dim_contiguous=True)
    batch, q_len, num_q_heads, head_dim = q.shape
    if isinstance(q_start, bool) or not isinstance(q_start, int) or q_start < 0:
        raise ValueError(f"q_start must be an int >= 0, got {q_start!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    check_tensor("k", k, ndim=4, contiguous=False, last_dim_contiguous=True)
    seq_len = k.shape[1]
    if k.shape[0] != batch or k.shape[3] != head_dim or seq_len < q_start + q_len:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected [{batch}, >= q_start + Tq = {q_start + q_len}, "
                         f"Hkv, {head_dim}]")
    check_tensor("v", v, shape=tuple(k.shape), contiguous=False, last_dim_contiguous=True)
    check_same_dtype(k=k, v=v)  # q may differ: see mk.tasks._dot.mma
    check_same_device(q=q, k=k, v=v)
    if not (_is_pow2(head_dim) and 16 <= head_dim <= MAX_HEAD_DIM):
        raise ValueError(f"q has head_dim {head_dim}; expected a power of two in [16, {MAX_HEAD_DIM}]")
    num_kv_heads = k.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"k has {num_kv_heads} heads, which must divide the {num_q_heads} heads of q")
    if seqlens is not None:
        check_tensor("seqlens", seqlens, shape=(batch,), dtype=(torch.int32, torch.int64))
        check_same_device(q=q, seqlens=seqlens)
        if (check_values and batch and not is_capturing(seqlens)
                and (int(seqlens.min()) < 0 or int(seqlens.max()) > seq_len)):
            raise ValueError(f"seqlens must lie in [0, {seq_len}], got {seqlens.tolist()}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    config = _check_config(prefill_attention_config(q_len, head_dim, interpreting(q)) if config is None else config, head_dim)

    out = torch.empty((batch, q_len, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(q_len, config.block_m), batch * num_q_heads)
    prefill_attention_kernel[grid](
        q, k, v, out, seqlens if seqlens is not None else out,
        q_len, q_start, num_q_heads,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        float(scale),
        GROUP=num_q_heads // num_kv_heads, HAS_SEQLENS=seqlens is not None,
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, WINDOW=window,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def prefill_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    q_start: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Plain float32 torch reference: explicit scores, causal (and sliding ``window``) and
    length masks, softmax.

    Returns float32 ``[B, Tq, Hq, D]`` with padded query rows set to 0. Padded keys are
    removed with ``where`` before and after the softmax, so NaN padding does not leak.
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    seq_len, group = k.shape[1], num_q_heads // k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lens = (torch.full((batch,), seq_len, device=q.device) if seqlens is None else seqlens).long()
    key_pos = torch.arange(seq_len, device=q.device)
    q_pos = q_start + torch.arange(q_len, device=q.device)
    key_valid = key_pos[None, :] < lens[:, None]                           # [B, T]
    q_valid = q_pos[None, :] < lens[:, None]                               # [B, Tq]
    qf = torch.where(q_valid[:, :, None, None], q.float(), 0.0)
    kf = torch.where(key_valid[:, :, None, None], k.float(), 0.0).repeat_interleave(group, dim=2)
    vf = torch.where(key_valid[:, :, None, None], v.float(), 0.0).repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", qf, kf) * scale               # [B, Hq, Tq, T]
    causal = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        causal &= key_pos[None, :] > q_pos[:, None] - window
    visible = causal[None, None] & key_valid[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                  # fully masked rows: NaN -> 0
    out = torch.einsum("bhts,bshd->bthd", probs, vf)
    return torch.where(q_valid[:, :, None, None], out, 0.0)


def prefill_attention_cost(
    batch: int, seq_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2,
    window: int | None = None,
) -> TaskCost:
    """Bytes and flops of one causal prefill over ``batch`` full rows of ``seq_len`` tokens.

    Bytes count q, k, v read once and out written once (the ideal: K/V re-reads by
    successive query tiles of a head are assumed to hit in L2). Flops count the two
    matmuls over the causal triangle, 2 * 2 * D per (query, visible key) pair; under a
    sliding ``window`` token t sees ``min(t + 1, window)`` keys.
    """
    q_elems = batch * seq_len * num_q_heads * head_dim
    kv_elems = 2 * batch * seq_len * num_kv_heads * head_dim
    if window is None or window >= seq_len:
        visible = seq_len * (seq_len + 1) // 2
    else:  # the triangle up to the window's width, then window keys a token
        visible = window * (window + 1) // 2 + (seq_len - window) * window
    pairs = batch * num_q_heads * visible
    return TaskCost(bytes_read=(q_elems + kv_elems) * dtype_bytes, bytes_written=q_elems * dtype_bytes,
                    flops=4 * head_dim * pairs)


def prefill_attention_smem_bytes(config: PrefillAttentionConfig, dtype_bytes: int = 2) -> int:
    """Shared memory of one tile: the K and V blocks, once per pipeline stage, and the Q tile."""
    kv = 2 * config.block_n * config.head_dim * dtype_bytes * max(1, config.num_stages)
    q = config.block_m * config.head_dim * dtype_bytes
    return kv + q
