import math

import pytest
import torch
import triton
import triton.language as tl

from mk import jit
from mk.tasks.prefill_attention import (
    PrefillAttentionConfig,
    prefill_attention,
    prefill_attention_config,
    prefill_attention_cost,
    prefill_attention_ref,
    prefill_attention_smem_bytes,
    prefill_attention_tile,
)
from tests.conftest import DTYPES, assert_close, rel_err


def _qkv(batch, seq_len, hq, hkv, d, device, dtype=torch.float32):
    q = torch.randn(batch, seq_len, hq, d, device=device).to(dtype)
    k = torch.randn(batch, seq_len, hkv, d, device=device).to(dtype)
    v = torch.randn(batch, seq_len, hkv, d, device=device).to(dtype)
    return q, k, v


# (batch, T, Hq, Hkv, D, seqlens, (block_m, block_n) or None for the default tile)
CASES = [
    pytest.param(1, 37, 4, 4, 64, None, None, id="mha-T37"),
    pytest.param(3, 70, 6, 2, 64, [70, 41, 1], None, id="gqa3-B3-lens"),
    pytest.param(2, 70, 8, 2, 128, [70, 17], (32, 16), id="gqa4-D128-multiblock"),
    pytest.param(3, 37, 3, 1, 128, [37, 0, 16], (16, 32), id="gqa3-D128-bn>bm-empty-row"),
    pytest.param(1, 1, 2, 1, 16, None, None, id="T1-D16"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq_len, hq, hkv, d, lens, blocks", CASES)
def test_prefill_attention_matches_reference(batch, seq_len, hq, hkv, d, lens, blocks, dtype, device):
    q, k, v = _qkv(batch, seq_len, hq, hkv, d, device, dtype)
    seqlens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device=device)
    config = None if blocks is None else PrefillAttentionConfig(d, *blocks)
    got = prefill_attention(q, k, v, seqlens, config=config)
    ref = prefill_attention_ref(q, k, v, seqlens)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    assert_close(got, ref, dtype)
    if lens is not None:
        for b, n in enumerate(lens):
            assert (got[b, n:] == 0).all(), f"padded rows of batch row {b} are not zero"


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq_len, hq, hkv, d, lens, blocks", CASES[1:3])
def test_prefill_attention_float32_q_over_bf16_keys(batch, seq_len, hq, hkv, d, lens, blocks, device):
    """A float32 q (mk keeps activations float32) against bf16 keys and values: neither q nor
    the float32 probabilities are rounded to bf16 on the tensor cores (two bf16 halves), so
    the output is float32-exact on the bf16 K/V, where rounding them costs ~1e-3."""
    q, k, v = _qkv(batch, seq_len, hq, hkv, d, device, torch.bfloat16)
    q = q.float() + 1e-3 * torch.randn_like(q, dtype=torch.float32)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    config = None if blocks is None else PrefillAttentionConfig(d, *blocks)
    got = prefill_attention(q, k, v, seqlens, config=config)
    assert got.dtype == torch.float32
    ref = prefill_attention_ref(q.double(), k.double(), v.double(), seqlens)
    assert rel_err(got, ref) < 1e-4, rel_err(got, ref)
    assert rel_err(prefill_attention_ref(q.to(torch.bfloat16), k, v, seqlens), ref) > 1e-4


def test_prefill_attention_poisoned_padding_does_not_leak(device):
    q, k, v = _qkv(3, 70, 4, 2, 64, device)
    lens = [70, 33, 5]
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = prefill_attention_ref(q, k, v, seqlens)
    for b, n in enumerate(lens):
        q[b, n:] = float("nan")
        k[b, n:] = float("nan")
        v[b, n:] = float("inf")
    got = prefill_attention(q, k, v, seqlens, config=PrefillAttentionConfig(64, 32, 32))
    assert torch.isfinite(got).all()
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("chunk, blocks", [(16, (16, 16)), (23, (16, 32)), (32, (32, 16))])
def test_prefill_attention_a_chunk_at_a_time(chunk, blocks, device):
    # Queries [q_start, q_start + chunk) against the keys [0, q_start + chunk) of the cache:
    # chunk by chunk, the whole prompt's attention (chunks and blocks need not align).
    # Keys past the chunk hold NaN: a chunk must not read them.
    q, k, v = _qkv(3, 61, 4, 2, 32, device)
    lens = [61, 40, 9]
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    want = prefill_attention_ref(q, k, v, seqlens)
    config = PrefillAttentionConfig(32, *blocks)
    for q_start in range(0, 61, chunk):
        end = min(q_start + chunk, 61)
        k_seen, v_seen = k.clone(), v.clone()
        k_seen[:, end:], v_seen[:, end:] = float("nan"), float("nan")
        got = prefill_attention(q[:, q_start:end], k_seen, v_seen, seqlens, config=config, q_start=q_start)
        assert got.shape == (3, end - q_start, 4, 32)
        assert_close(got, want[:, q_start:end], torch.float32)
        assert_close(prefill_attention_ref(q[:, q_start:end], k, v, seqlens, q_start=q_start),
                     want[:, q_start:end], torch.float32)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # later tiles do see the NaN keys
def test_prefill_attention_never_loads_blocks_above_the_diagonal(device):
    # With 32-row query tiles, tile 0 must not even load keys 32..: NaN there would
    # survive a mask applied after the dot (p * NaN = NaN).
    q, k, v = _qkv(1, 70, 2, 1, 64, device)
    ref = prefill_attention_ref(q, k, v)
    k[:, 32:] = float("nan")
    v[:, 32:] = float("nan")
    got = prefill_attention(q, k, v, config=PrefillAttentionConfig(64, 32, 16))
    assert torch.isfinite(got[:, :32]).all()
    assert_close(got[:, :32], ref[:, :32], torch.float32)


def test_prefill_attention_strided_views_and_scale(device):
    # q, k, v as slices of one fused QKV projection: strided rows, contiguous heads.
    hq, hkv, d = 4, 2, 32
    qkv = torch.randn(2, 45, hq + 2 * hkv, d, device=device)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    seqlens = torch.tensor([45, 30], dtype=torch.int64, device=device)
    got = prefill_attention(q, k, v, seqlens, scale=0.3)
    assert_close(got, prefill_attention_ref(q, k, v, seqlens, scale=0.3), torch.float32)


@jit
def _one_worker_kernel(q_ptr, k_ptr, v_ptr, out_ptr, seqlens_ptr, B, T, HQ, NUM_TILES,
                       s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh, scale,
                       GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # A persistent-style caller: one program walks every (row, head, tile) itself.
    for i in range(0, B * HQ * NUM_TILES):
        prefill_attention_tile(q_ptr, k_ptr, v_ptr, out_ptr, seqlens_ptr,
                               i // (HQ * NUM_TILES), (i // NUM_TILES) % HQ, i % NUM_TILES, T, 0,
                               s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh,
                               scale, GROUP=GROUP, HAS_SEQLENS=True, HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN)


def test_prefill_attention_tile_from_another_kernel(device):
    q, k, v = _qkv(2, 40, 3, 1, 16, device)
    seqlens = torch.tensor([40, 23], dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    _one_worker_kernel[(1,)](q, k, v, out, seqlens, 2, 40, 3, triton.cdiv(40, 16),
                             *q.stride()[:3], *k.stride()[:3], *out.stride()[:3], 0.25,
                             GROUP=3, D=16, BM=16, BN=16)
    assert_close(out, prefill_attention_ref(q, k, v, seqlens, scale=0.25), torch.float32)


def test_prefill_attention_rejects_bad_input(device):
    q, k, v = _qkv(2, 8, 4, 2, 16, device)
    lens = torch.tensor([8, 3], dtype=torch.int32, device=device)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    with pytest.raises(ValueError, match="q"):
        prefill_attention(q[0], k, v)
    with pytest.raises(TypeError, match="q"):
        prefill_attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="q"):
        prefill_attention(q.to(torch.int32), k, v)
    with pytest.raises(ValueError, match="k"):
        prefill_attention(q, k[:, :7], v[:, :7])
    with pytest.raises(ValueError, match=r"k has shape \(2, 8, 2, 16\); expected \[2, >= q_start \+ Tq = 9"):
        prefill_attention(q[:, 4:], k, v, q_start=5)
    with pytest.raises(ValueError, match="q_start"):
        prefill_attention(q, k, v, q_start=-1)
    with pytest.raises(ValueError, match="v"):
        prefill_attention(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="k"):
        prefill_attention(q, *_qkv(2, 8, 3, 3, 16, device)[1:])  # 3 kv heads for 4 q heads
    with pytest.raises(ValueError, match="q"):
        prefill_attention(q.transpose(2, 3), k.transpose(2, 3), v.transpose(2, 3))  # head dim strided
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention(*_qkv(1, 8, 2, 2, 48, device))
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention(*_qkv(1, 8, 2, 2, 8, device))
    with pytest.raises(ValueError, match="seqlens"):
        prefill_attention(q, k, v, torch.tensor([8, 9], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="seqlens"):
        prefill_attention(q, k, v, torch.tensor([-1, 3], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="seqlens"):
        prefill_attention(q, k, v, lens[:1])
    with pytest.raises(TypeError, match="seqlens"):
        prefill_attention(q, k, v, lens.float())
    with pytest.raises(ValueError, match="scale"):
        prefill_attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="block_m"):
        prefill_attention(q, k, v, config=PrefillAttentionConfig(16, 24, 16))
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention(q, k, v, config=PrefillAttentionConfig(32))
    with pytest.raises(ValueError, match="k"):
        prefill_attention(q, k.to("meta"), v)  # wrong device
    if device.type == "cpu":
        with pytest.raises(TypeError, match="q"):
            prefill_attention(q.to(torch.bfloat16), k, v)
    else:
        with pytest.raises(TypeError, match="dtypes differ"):
            prefill_attention(q, k.to(torch.bfloat16), v)
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)


def test_prefill_attention_empty(device):
    q, k, v = _qkv(0, 5, 2, 1, 16, device)
    assert prefill_attention(q, k, v).shape == (0, 5, 2, 16)


def test_prefill_attention_planner_hooks():
    config = PrefillAttentionConfig(head_dim=128, block_m=128, block_n=64, num_stages=3, num_warps=8)
    # K and V blocks per stage plus the Q tile, bf16.
    assert prefill_attention_smem_bytes(config) == 2 * 64 * 128 * 2 * 3 + 128 * 128 * 2
    assert prefill_attention_smem_bytes(config, dtype_bytes=4) == 2 * prefill_attention_smem_bytes(config)
    cost = prefill_attention_cost(batch=2, seq_len=3, num_q_heads=4, num_kv_heads=2, head_dim=8)
    assert cost.bytes_read == (2 * 3 * 4 * 8 + 2 * 2 * 3 * 2 * 8) * 2
    assert cost.bytes_written == 2 * 3 * 4 * 8 * 2
    assert cost.flops == 4 * 8 * (2 * 4 * (1 + 2 + 3))
    for seq_len in (1, 37, 4096):
        for d in (64, 128, 256):
            c = prefill_attention_config(seq_len, d)
            assert c.head_dim == d and c.block_m >= 16 and c.block_n >= 16
            assert math.log2(c.block_m).is_integer() and math.log2(c.block_n).is_integer()
            assert prefill_attention_smem_bytes(c) <= 160 * 1024


# --------------------------------------------------------------------------- sliding window


def _hf_sliding_mask(q_positions: torch.Tensor, n_keys: int, window: int) -> torch.Tensor:
    """[Tq, n_keys] bool: transformers' own sliding-window causal mask function (Mistral)."""
    masking = pytest.importorskip("transformers.masking_utils")
    allowed = masking.sliding_window_causal_mask_function(window)
    return allowed(torch.tensor(0), torch.tensor(0), q_positions.cpu()[:, None], torch.arange(n_keys)[None, :])


def _masked_attention(q, k, v, visible):
    """Explicit softmax attention under a [Tq, T] visibility mask (float32, GQA by repeat)."""
    group = q.shape[2] // k.shape[2]
    kf, vf = k.float().repeat_interleave(group, dim=2), v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kf) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), vf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 3, 17, 40])
@pytest.mark.parametrize("blocks", [None, (32, 16), (16, 32)])
def test_prefill_attention_window_matches_transformers_mask(window, blocks, dtype, device):
    q, k, v = _qkv(2, 70, 4, 2, 16, device, dtype)
    config = None if blocks is None else PrefillAttentionConfig(16, *blocks, num_stages=1)
    ref = _masked_attention(q, k, v, _hf_sliding_mask(torch.arange(70), 70, window))
    assert_close(prefill_attention_ref(q, k, v, window=window), ref, torch.float32, "reference")
    assert_close(prefill_attention(q, k, v, window=window, config=config), ref, dtype)


@pytest.mark.parametrize("window", [2, 16, 33])
def test_prefill_attention_window_continues_a_cache_chunk_with_lengths(window, device):
    """A chunk of queries [q_start, q_start + Tq) over keys its earlier chunks left in the
    cache, rows of different valid lengths: the window counts absolute positions."""
    q, k, v = _qkv(2, 80, 6, 2, 32, device)
    lens = torch.tensor([80, 52], dtype=torch.int32, device=device)
    q_start, tq = 30, 37
    visible = _hf_sliding_mask(torch.arange(q_start, q_start + tq), 80, window)
    key_valid = torch.arange(80) < lens.cpu()[:, None, None, None]                     # [B, 1, 1, T]
    ref = _masked_attention(q[:, q_start:q_start + tq], k, v, visible[None, None] & key_valid)
    query_valid = torch.arange(q_start, q_start + tq, device=device)[None, :] < lens[:, None]  # [B, Tq]
    ref = torch.where(query_valid[:, :, None, None], ref, 0.0)  # tokens past a row's length come out 0
    out = prefill_attention(q[:, q_start:q_start + tq], k, v, lens, window=window, q_start=q_start,
                            config=PrefillAttentionConfig(32, 16, 16, num_stages=1))
    assert_close(out, ref, torch.float32)
    assert_close(prefill_attention_ref(q[:, q_start:q_start + tq], k, v, lens, window=window, q_start=q_start), ref,
                 torch.float32, "reference")


def test_prefill_attention_window_cost_and_checks(device):
    plain = prefill_attention_cost(1, 100, 8, 2, 64)
    assert prefill_attention_cost(1, 100, 8, 2, 64, window=None) == plain
    assert prefill_attention_cost(1, 100, 8, 2, 64, window=100) == plain
    # 10 tokens see 1..10 keys, the other 90 see 10 each.
    assert prefill_attention_cost(1, 100, 8, 2, 64, window=10).flops == 4 * 64 * 8 * (55 + 90 * 10)
    q, k, v = _qkv(1, 4, 2, 1, 16, device)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="window"):
            prefill_attention(q, k, v, window=bad)
