import math
import sys

import pytest
import torch

from mk.tasks.rope import (deinterleave_rotary, interleave_rotary, rope, rope_inv_freq, rope_kv, rope_kv_cost,
                           rope_kv_ref, rope_ref)
from tests.conftest import DTYPES, assert_close

LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# --------------------------------------------------------------------------- inv_freq


def test_inv_freq_default_by_hand():
    # theta ** (-2i / 8) with theta = 10^4: exactly the powers of ten.
    got = rope_inv_freq(8, 10000.0)
    assert got.dtype == torch.float32 and got.shape == (4,)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.1, 0.01, 0.001]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_inv_freq_llama3_each_band_by_hand(key):
    # inv_freq = [1, 0.1, 0.01, 0.001] -> wavelengths 2π/f = [6.3, 63, 628, 6283].
    # With L = 1000, low_freq_factor 1, high_freq_factor 4: high band w < 250, low band w > 1000.
    scaling = {key: "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1000}
    got = rope_inv_freq(8, 10000.0, scaling)
    smooth = (1000 * 0.01 / (2 * math.pi) - 1.0) / (4.0 - 1.0)   # L / w for f = 0.01, rescaled
    expected = torch.tensor([
        1.0,                                              # high band: kept
        0.1,                                              # high band: kept
        (1 - smooth) * 0.01 / 8.0 + smooth * 0.01,        # between: interpolated
        0.001 / 8.0,                                      # low band: divided by factor
    ])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_inv_freq_llama31_config_bands():
    base = rope_inv_freq(128, 500000.0)
    got = rope_inv_freq(128, 500000.0, LLAMA31_SCALING)
    wavelen = 2 * math.pi / base.double()
    high, low = wavelen < 8192 / 4.0, wavelen > 8192 / 1.0
    mid = ~(high | low)
    assert high.any() and low.any() and mid.any()
    assert torch.equal(got[high], base[high])
    torch.testing.assert_close(got[low], base[low] / 8.0, rtol=1e-6, atol=0)
    # In between the factor moves smoothly from 1 to 1/8 as the wavelength grows.
    ratio = (got[mid] / base[mid]).double()
    assert ((ratio < 1) & (ratio > 1 / 8)).all() and (ratio.diff() < 0).all()


def test_inv_freq_default_rope_type_is_unscaled():
    assert torch.equal(rope_inv_freq(64, 10000.0, {"rope_type": "default"}), rope_inv_freq(64, 10000.0))


def test_inv_freq_rejects_bad_input():
    with pytest.raises(ValueError, match="rope type"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope type"):
        rope_inv_freq(64, 10000.0, {"factor": 4.0})
    with pytest.raises(ValueError, match="high_freq_factor"):
        rope_inv_freq(64, 10000.0, {k: v for k, v in LLAMA31_SCALING.items() if k != "high_freq_factor"})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_inv_freq(64, 10000.0, {**LLAMA31_SCALING, "low_freq_factor": 4.0})
    with pytest.raises(ValueError, match="head_dim"):
        rope_inv_freq(63, 10000.0)
    with pytest.raises(ValueError, match="theta"):
        rope_inv_freq(64, 0.0)


# --------------------------------------------------------------------------- rope_kv


def _scattered_positions(batch, tokens, max_seq, device):
    """Distinct positions per row, different rows, in no particular order."""
    return torch.stack([torch.randperm(max_seq)[:tokens] for _ in range(batch)]).to(device)


def _written_mask(positions, shape):
    mask = torch.zeros(shape, dtype=torch.bool)
    for b in range(positions.shape[0]):
        mask[b, :, positions[b].long().cpu()] = True
    return mask


def _run_and_check(q, k, v, positions, inv_freq, max_seq, dtype):
    batch, _, hkv, d = k.shape
    shape = (batch, hkv, max_seq, d)
    # Poisoned caches: any row the op should not touch must still be NaN afterwards.
    k_cache = torch.full(shape, float("nan"), device=q.device).to(dtype)
    v_cache = torch.full(shape, float("nan"), device=q.device).to(dtype)
    q_ref, k_ref, v_ref = rope_kv_ref(q, k, v, positions, inv_freq, k_cache, v_cache)
    q_rot = rope_kv(q, k, v, positions, inv_freq, k_cache, v_cache)

    assert q_rot.dtype == dtype and q_rot.shape == q.shape and q_rot.is_contiguous()
    assert_close(q_rot, q_ref, dtype, "q_rot")
    written = _written_mask(positions, shape).to(q.device)
    assert_close(k_cache[written], k_ref[written], dtype, "k_cache")
    assert_close(v_cache[written], v_ref[written], dtype, "v_cache")
    assert torch.isnan(k_cache[~written]).all() and torch.isnan(v_cache[~written]).all()
    return k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,hq,hkv", [(64, 4, 4), (64, 6, 2), (128, 8, 2), (128, 3, 1)])
@pytest.mark.parametrize("tokens", [1, 3])
def test_rope_kv_matches_reference(head_dim, hq, hkv, tokens, dtype, device):
    batch, max_seq = 3, 24
    q = torch.randn(batch, tokens, hq, head_dim, device=device).to(dtype)
    k = torch.randn(batch, tokens, hkv, head_dim, device=device).to(dtype)
    v = torch.randn(batch, tokens, hkv, head_dim, device=device).to(dtype)
    positions = _scattered_positions(batch, tokens, max_seq, device)
    inv_freq = rope_inv_freq(head_dim, 10000.0).to(device)
    k_cache, v_cache = _run_and_check(q, k, v, positions, inv_freq, max_seq, dtype)
    # v is copied bit for bit.
    for b in range(batch):
        for t in range(tokens):
            assert torch.equal(v_cache[b, :, positions[b, t]], v[b, t])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_llama3_large_positions(dtype, device):
    # Llama 3.1 frequencies and positions in the thousands: large angles stress sin/cos.
    batch, tokens, hq, hkv, d, max_seq = 2, 2, 4, 2, 64, 9000
    q = torch.randn(batch, tokens, hq, d, device=device).to(dtype)
    k = torch.randn(batch, tokens, hkv, d, device=device).to(dtype)
    v = torch.randn(batch, tokens, hkv, d, device=device).to(dtype)
    positions = torch.tensor([[8999, 4097], [0, 7321]], dtype=torch.int32, device=device)
    inv_freq = rope_inv_freq(d, 500000.0, LLAMA31_SCALING).to(device)
    _run_and_check(q, k, v, positions, inv_freq, max_seq, dtype)


def test_rope_kv_views_of_fused_qkv(device):
    # q, k, v as strided views into one [B, T, Hq + 2 Hkv, D] projection output.
    batch, tokens, hq, hkv, d, max_seq = 2, 1, 4, 2, 64, 10
    qkv = torch.randn(batch, tokens, hq + 2 * hkv, d, device=device)
    q, k, v = qkv.split([hq, hkv, hkv], dim=2)
    assert not q.is_contiguous()
    positions = torch.tensor([[9], [3]], dtype=torch.int64, device=device)
    _run_and_check(q, k, v, positions, rope_inv_freq(d, 10000.0).to(device), max_seq, torch.float32)


def test_rope_position_zero_is_identity(device):
    x = torch.randn(1, 1, 2, 64, device=device)
    out = rope(x, torch.zeros(1, 1, dtype=torch.int32, device=device), rope_inv_freq(64, 10000.0).to(device))
    assert torch.equal(out, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_reference(dtype, device):
    x = torch.randn(2, 3, 5, 128, device=device).to(dtype)
    positions = _scattered_positions(2, 3, 1000, device)
    inv_freq = rope_inv_freq(128, 500000.0, LLAMA31_SCALING).to(device)
    out = rope(x, positions, inv_freq)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, rope_ref(x, positions, inv_freq), dtype)


def test_rope_kv_rejects_bad_input(device):
    batch, tokens, hq, hkv, d, max_seq = 2, 2, 4, 2, 16, 8
    q = torch.randn(batch, tokens, hq, d, device=device)
    k = torch.randn(batch, tokens, hkv, d, device=device)
    v = torch.randn(batch, tokens, hkv, d, device=device)
    pos = torch.tensor([[0, 1], [5, 2]], dtype=torch.int32, device=device)
    inv = rope_inv_freq(d, 10000.0).to(device)
    sentinel = 1234.5
    kc = torch.full((batch, hkv, max_seq, d), sentinel, device=device)
    vc = torch.full((batch, hkv, max_seq, d), sentinel, device=device)

    def call(**over):
        args = dict(q=q, k=k, v=v, positions=pos, inv_freq=inv, k_cache=kc, v_cache=vc)
        args.update(over)
        return rope_kv(**args)

    bad = [
        (ValueError, "positions", dict(positions=torch.tensor([[0, 1], [8, 2]], device=device))),
        (ValueError, "positions", dict(positions=torch.tensor([[0, -1], [3, 2]], device=device))),
        (ValueError, "positions", dict(positions=torch.tensor([[4, 4], [3, 2]], device=device))),
        (ValueError, "positions", dict(positions=pos[:, :1])),
        (TypeError, "positions", dict(positions=pos.float())),
        (TypeError, "positions", dict(positions=[[0, 1], [5, 2]])),
        (ValueError, "q", dict(q=torch.randn(batch, tokens, hq, d - 1, device=device),
                               k=torch.randn(batch, tokens, hkv, d - 1, device=device),
                               v=torch.randn(batch, tokens, hkv, d - 1, device=device))),  # odd head_dim
        (ValueError, "q", dict(q=q[0])),
        (TypeError, "q", dict(q=q.to(torch.int32))),
        (ValueError, "k", dict(k=k[:, :, :, :8])),
        (ValueError, "v", dict(v=torch.randn(batch, tokens, hkv + 1, d, device=device))),
        (ValueError, "v", dict(v=v.transpose(2, 3))),
        (ValueError, "inv_freq", dict(inv_freq=inv[:-1])),
        (TypeError, "inv_freq", dict(inv_freq=inv.double())),
        (ValueError, "k_cache", dict(k_cache=kc[:, :1])),
        (ValueError, "k_cache", dict(k_cache=kc[:1])),
        (ValueError, "v_cache", dict(v_cache=vc[:, :, :4])),
        (TypeError, "v_cache", dict(v_cache=vc.double())),
        (ValueError, "k_cache", dict(k_cache=torch.empty(kc.shape, device="meta"))),
    ]
    for exc, name, over in bad:
        with pytest.raises(exc, match=name):
            call(**over)
        assert (kc == sentinel).all() and (vc == sentinel).all(), f"cache written by a call with bad {name}"
    if device.type == "cpu":
        with pytest.raises(TypeError, match="q"):
            call(q=q.to(torch.bfloat16))


def test_rope_kv_cost_counts_every_byte():
    cost = rope_kv_cost(batch=2, tokens=1, num_q_heads=32, num_kv_heads=8, head_dim=64, dtype_bytes=2)
    assert cost.bytes_written == 2 * (32 + 16) * 64 * 2
    assert cost.bytes_read >= cost.bytes_written and cost.flops > 0


def test_rope_kv_heads_over_several_blocks(monkeypatch, device):
    """More heads than one [BLOCK_H, BLOCK_HALF] block holds: the heads go block by block,
    and every head is rotated and cached."""
    rope_module = sys.modules["mk.tasks.rope"]  # the package's `rope` names the function
    monkeypatch.setattr(rope_module, "MAX_TILE_ELEMENTS", 64)  # head_dim 16: 8 heads a block
    batch, tokens, hq, hkv, d, max_seq = 2, 2, 20, 12, 16, 12
    assert rope_module.rope_blocks(d, max(hq, hkv))[0] == 8
    q = torch.randn(batch, tokens, hq, d, device=device)
    k = torch.randn(batch, tokens, hkv, d, device=device)
    v = torch.randn(batch, tokens, hkv, d, device=device)
    positions = _scattered_positions(batch, tokens, max_seq, device)
    _run_and_check(q, k, v, positions, rope_inv_freq(d, 10000.0).to(device), max_seq, torch.float32)


# --------------------------------------------------------------------------- interleaved layout


def test_interleave_rotary_moves_pairs_side_by_side_and_back():
    w = torch.arange(2 * 8 * 3).reshape(2 * 8, 3)  # two heads of 8 rows, 3 columns
    inter = interleave_rotary(w, 8)
    # Head 0: rows 0, 4, 1, 5, 2, 6, 3, 7; head 1 the same, 8 rows on.
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(inter, w[order + [8 + i for i in order]])
    assert torch.equal(deinterleave_rotary(inter, 8), w)
    x = torch.randn(2, 3, 4, 16)
    assert torch.equal(deinterleave_rotary(interleave_rotary(x, 16, -1), 16, -1), x)
    with pytest.raises(ValueError, match="whole number of heads"):
        interleave_rotary(torch.zeros(12, 3), 8)
    with pytest.raises(ValueError, match="even int"):
        interleave_rotary(torch.zeros(12, 3), 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_input_rotates_to_the_usual_layout(dtype, device):
    # rope(interleave(x), interleaved=True) == rope(x): the kernel reads pairs side by side
    # and writes the half-split layout; the reference is the plain half-split rope.
    batch, tokens, hq, hkv, d, max_seq = 2, 3, 4, 2, 64, 16
    inv_freq = rope_inv_freq(d, 500000.0, LLAMA31_SCALING).to(device)
    positions = _scattered_positions(batch, tokens, max_seq, device)
    x = torch.randn(batch, tokens, hq, d, device=device).to(dtype)
    out = rope(interleave_rotary(x, d, -1), positions, inv_freq, interleaved=True)
    assert_close(out, rope_ref(x, positions, inv_freq), dtype, "rope")
    assert_close(rope_ref(interleave_rotary(x, d, -1), positions, inv_freq, interleaved=True),
                 rope_ref(x, positions, inv_freq), torch.float32, "rope_ref")

    q = torch.randn(batch, tokens, hq, d, device=device).to(dtype)
    k = torch.randn(batch, tokens, hkv, d, device=device).to(dtype)
    v = torch.randn(batch, tokens, hkv, d, device=device).to(dtype)
    caches = [torch.full((batch, hkv, max_seq, d), float("nan"), device=device, dtype=dtype) for _ in range(2)]
    q_rot = rope_kv(interleave_rotary(q, d, -1), interleave_rotary(k, d, -1), v, positions, inv_freq, *caches,
                    interleaved=True)
    q_ref, k_ref, v_ref = rope_kv_ref(q, k, v, positions, inv_freq, *caches)
    written = _written_mask(positions, caches[0].shape).to(device)
    assert_close(q_rot, q_ref, dtype, "q")
    assert_close(caches[0][written], k_ref[written], dtype, "k_cache")
    assert torch.equal(caches[1][written], v_ref[written].to(dtype))  # v is not permuted
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        rope(x, positions, inv_freq, interleaved=1)


def test_unchecked_positions_skip_the_host_check_and_the_kernel_still_guards_the_cache(device):
    # check_values=False: no read-back of positions (a prefill's arange needs none); a bad
    # position then reaches the kernel, whose guard writes no cache row for it.
    batch, tokens, hq, hkv, d, max_seq = 2, 1, 2, 1, 8, 4
    q, k, v = (torch.randn(batch, tokens, h, d, device=device) for h in (hq, hkv, hkv))
    positions = torch.tensor([[max_seq], [1]], dtype=torch.int32, device=device)
    inv_freq = rope_inv_freq(d, 10000.0).to(device)
    caches = [torch.zeros(batch, hkv, max_seq, d, device=device) for _ in range(2)]
    with pytest.raises(ValueError, match="positions must lie in"):
        rope_kv(q, k, v, positions, inv_freq, *caches)
    rope_kv(q, k, v, positions, inv_freq, *caches, check_values=False)
    assert not caches[0][0].any() and not caches[1][0].any()
    _, k_ref, v_ref = rope_kv_ref(q[1:], k[1:], v[1:], positions[1:], inv_freq, caches[0][1:], caches[1][1:])
    assert_close(caches[0][1], k_ref[0], torch.float32, "k row of the good position")
    assert torch.equal(caches[1][1], v_ref[0])


def test_rope_kv_packed_sequences_write_their_own_cache_rows(device):
    # A packed ragged batch (B = 1): each token names its cache row; rows and positions
    # interleave, and the cache may have more rows than the packed batch touches.
    rows_of = [2, 0, 2, 0, 0, 3]
    pos_of = [5, 0, 6, 1, 2, 0]
    hq, hkv, d, max_seq, cache_rows = 4, 2, 32, 8, 4
    n = len(rows_of)
    qkv = torch.randn(1, n, hq + 2 * hkv, d, device=device)
    q, k, v = qkv.split([hq, hkv, hkv], dim=2)
    positions = torch.tensor([pos_of], dtype=torch.int32, device=device)
    rows = torch.tensor(rows_of, dtype=torch.int32, device=device)
    inv_freq = rope_inv_freq(d, 10000.0).to(device)
    shape = (cache_rows, hkv, max_seq, d)
    k_cache = torch.full(shape, float("nan"), device=device)
    v_cache = torch.full(shape, float("nan"), device=device)
    q_ref, k_ref, v_ref = rope_kv_ref(q, k, v, positions, inv_freq, k_cache, v_cache, cache_rows=rows)
    q_rot = rope_kv(q, k, v, positions, inv_freq, k_cache, v_cache, cache_rows=rows)
    assert_close(q_rot, q_ref, torch.float32, "q_rot")
    written = torch.zeros(shape, dtype=torch.bool)
    for r, p in zip(rows_of, pos_of):
        written[r, :, p] = True
    written = written.to(device)
    assert_close(k_cache[written], k_ref[written], torch.float32, "k_cache")
    assert torch.equal(v_cache[written], v_ref[written])
    assert torch.isnan(k_cache[~written]).all() and torch.isnan(v_cache[~written]).all()
    # Bad rows or a repeated (row, position) are refused before anything is written.
    before = k_cache.clone()
    for bad, match in ((torch.tensor(rows_of[:-1] + [4], dtype=torch.int32, device=device), "cache_rows"),
                       (torch.tensor([2, 0, 2, 0, 0, 0], dtype=torch.int32, device=device), "repeat")):
        with pytest.raises(ValueError, match=match):
            rope_kv(q, k, v, positions, inv_freq, k_cache, v_cache, cache_rows=bad)
    assert torch.equal(k_cache.nan_to_num(7.0), before.nan_to_num(7.0))
    with pytest.raises(ValueError, match="B = 1"):
        rope_kv(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                positions.expand(2, -1), inv_freq, k_cache, v_cache, cache_rows=rows)


def test_rope_kv_unchecked_rows_outside_the_cache_write_nothing(device):
    # validate=False trusts the caller; a cache row outside the cache is still never written.
    hq, hkv, d, max_seq = 2, 1, 16, 4
    qkv = torch.randn(1, 2, hq + 2 * hkv, d, device=device)
    q, k, v = qkv.split([hq, hkv, hkv], dim=2)
    k_cache = torch.full((2, hkv, max_seq, d), float("nan"), device=device)
    v_cache = torch.full((2, hkv, max_seq, d), float("nan"), device=device)
    positions = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    rows = torch.tensor([5, 1], dtype=torch.int32, device=device)
    rope_kv(q, k, v, positions, rope_inv_freq(d, 10000.0).to(device), k_cache, v_cache, cache_rows=rows,
            validate=False)
    assert torch.isnan(k_cache[0]).all() and torch.isnan(v_cache[0]).all()
    assert not torch.isnan(k_cache[1, :, 1]).any() and torch.isnan(k_cache[1, :, 0]).all()


# --------------------------------------------------------------------------- Qwen3 q/k norm


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (6, 2, 24), (2, 1, 128)])
def test_rope_kv_qk_norm_matches_qwen3(hq, hkv, d, interleaved, device):
    """q and k RMSNorm-ed per head, then rotated, against transformers' Qwen3RMSNorm and
    apply_rotary_pos_emb in HF's layout; with ``interleaved`` mk gets q, k and both norm
    weights permuted by interleave_rotary, and its outputs come back in the usual layout."""
    from mk.tasks.rope import interleave_rotary
    from tests.tasks.hf_reference import qwen3_norm_rope
    batch, tokens, max_seq, eps = 2, 3, 9, 1e-6
    q = 3 * torch.randn(batch, tokens, hq, d, device=device)
    k = torch.randn(batch, tokens, hkv, d, device=device) + 0.5
    v = torch.randn(batch, tokens, hkv, d, device=device)
    qw, kw = torch.rand(d, device=device) + 0.5, torch.randn(d, device=device)
    positions = torch.stack([torch.randperm(max_seq, device=device)[:tokens] for _ in range(batch)]).int()
    inv_freq = rope_inv_freq(d, 10000.0).to(device)
    k_cache = torch.randn(batch, hkv, max_seq, d, device=device)
    v_cache = torch.randn(batch, hkv, max_seq, d, device=device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    perm = (lambda t: interleave_rotary(t, d, dim=-1)) if interleaved else (lambda t: t)
    q_out = rope_kv(perm(q), perm(k), v, positions, inv_freq, k_cache, v_cache, interleaved=interleaved,
                    q_norm_weight=perm(qw), k_norm_weight=perm(kw), norm_eps=eps)
    assert_close(q_out, qwen3_norm_rope(q, qw, positions, inv_freq, eps), torch.float32, "q")
    k_rot = qwen3_norm_rope(k, kw, positions, inv_freq, eps)
    for b in range(batch):
        for t in range(tokens):
            p = int(positions[b, t])
            k_before[b, :, p], v_before[b, :, p] = k_rot[b, t], v[b, t]
    assert_close(k_cache, k_before, torch.float32, "k cache")
    assert torch.equal(v_cache, v_before)
    q_ref, k_ref, _ = rope_kv_ref(perm(q), perm(k), v, positions, inv_freq, k_cache, v_cache,
                                  interleaved=interleaved, q_norm_weight=perm(qw), k_norm_weight=perm(kw), norm_eps=eps)
    assert_close(q_ref, q_out, torch.float32, "rope_kv_ref")


def test_rope_kv_qk_norm_arguments_are_checked(device):
    q, k, v = (torch.randn(1, 1, h, 8, device=device) for h in (2, 1, 1))
    pos = torch.zeros(1, 1, dtype=torch.int32, device=device)
    inv_freq = rope_inv_freq(8, 10000.0).to(device)
    caches = torch.zeros(1, 1, 4, 8, device=device), torch.zeros(1, 1, 4, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="together"):
        rope_kv(q, k, v, pos, inv_freq, *caches, q_norm_weight=w)
    with pytest.raises(ValueError, match="k_norm_weight"):
        rope_kv(q, k, v, pos, inv_freq, *caches, q_norm_weight=w, k_norm_weight=torch.ones(4, device=device))
    with pytest.raises(ValueError, match="eps"):
        rope_kv(q, k, v, pos, inv_freq, *caches, q_norm_weight=w, k_norm_weight=w, norm_eps=-1.0)
    assert rope_kv_cost(1, 1, 2, 1, 8, qk_norm=False) == rope_kv_cost(1, 1, 2, 1, 8)
    assert rope_kv_cost(1, 1, 2, 1, 8, qk_norm=True).bytes_read == rope_kv_cost(1, 1, 2, 1, 8).bytes_read + 2 * 8 * 2
