import math

import pytest
import torch

from mk.tasks.decode_attention import (
    MAX_NUM_SPLITS, DecodeAttentionConfig, decode_attention, decode_attention_config,
    decode_attention_cost, decode_attention_merge, decode_attention_num_splits,
    decode_attention_partials, decode_attention_ref, decode_attention_smem_bytes,
)
from tests.conftest import DTYPES, assert_close, rel_err

SEQLENS = [1, 37, 100]  # one key, a partial block, and a cache filled to the end


def make_inputs(seqlens, hq, hkv, head_dim, dtype, device, max_seq=None):
    """q and caches whose positions at or past each seqlen hold NaN (they must never be read)."""
    batch = len(seqlens)
    max_seq = max_seq or max(seqlens)
    q = torch.randn(batch, hq, head_dim, device=device).to(dtype)
    k_cache = torch.randn(batch, hkv, max_seq, head_dim, device=device).to(dtype)
    v_cache = torch.randn(batch, hkv, max_seq, head_dim, device=device).to(dtype)
    for b, n in enumerate(seqlens):
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("nan")
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, lens


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_float32_q_over_a_bf16_cache(head_dim, num_splits, device):
    """A float32 q against a bf16 cache: q and the probabilities meet the cache on the tensor
    cores as two bf16 halves, not rounded, so the output is float32-exact on the bf16 cache
    (rounding them costs ~1e-3)."""
    q, k_cache, v_cache, lens = make_inputs(SEQLENS, 8, 2, head_dim, torch.bfloat16, device)
    q = q.float() + 1e-3 * torch.randn_like(q, dtype=torch.float32)
    out = decode_attention(q, k_cache, v_cache, lens, num_splits=num_splits)
    assert out.dtype == torch.float32
    ref = decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), lens)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)
    assert rel_err(decode_attention_ref(q.to(torch.bfloat16), k_cache, v_cache, lens), ref) > 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2), (8, 1)], ids=["g1", "g3", "g4", "g8"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_matches_reference(hq, hkv, head_dim, num_splits, dtype, device):
    q, k_cache, v_cache, lens = make_inputs(SEQLENS, hq, hkv, head_dim, dtype, device)
    out = decode_attention(q, k_cache, v_cache, lens, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, decode_attention_ref(q, k_cache, v_cache, lens), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 5, 16, MAX_NUM_SPLITS, None])
def test_decode_attention_split_counts(num_splits, dtype, device):
    # 16 and more splits than the 2 blocks of the longest sequence: most slices are empty.
    q, k_cache, v_cache, lens = make_inputs(SEQLENS, 8, 2, 64, dtype, device, max_seq=130)
    out = decode_attention(q, k_cache, v_cache, lens, num_splits=num_splits)
    assert_close(out, decode_attention_ref(q, k_cache, v_cache, lens), dtype)


def test_decode_attention_scale_and_int64_seqlens(device):
    q, k_cache, v_cache, lens = make_inputs([5, 70], 4, 2, 64, torch.float32, device)
    lens = lens.long()
    out = decode_attention(q, k_cache, v_cache, lens, scale=0.3, num_splits=2)
    assert_close(out, decode_attention_ref(q, k_cache, v_cache, lens, scale=0.3), torch.float32)


def test_decode_attention_single_key_returns_its_value(device):
    # With one cached position the softmax is 1: the output is that value row, for every head.
    q, k_cache, v_cache, lens = make_inputs([1, 1], 6, 2, 64, torch.float32, device, max_seq=9)
    out = decode_attention(q, k_cache, v_cache, lens, num_splits=4)
    expected = v_cache[:, :, 0].repeat_interleave(3, dim=1)
    assert_close(out, expected, torch.float32)


def test_decode_attention_strided_q_and_cache(device):
    # q a view into a fused projection output, the cache a slice of a longer allocation.
    batch, hq, hkv, d = 2, 4, 2, 64
    qkv = torch.randn(batch, hq + 2 * hkv, d, device=device)
    q = qkv[:, :hq]
    big_k = torch.randn(batch, hkv, 80, d, device=device)
    big_v = torch.randn(batch, hkv, 80, d, device=device)
    k_cache, v_cache = big_k[:, :, :50], big_v[:, :, :50]
    lens = torch.tensor([50, 17], dtype=torch.int32, device=device)
    out = decode_attention(q, k_cache, v_cache, lens, num_splits=2)
    assert_close(out, decode_attention_ref(q, k_cache, v_cache, lens), torch.float32)


def test_partials_workspace_contract(device):
    # Per split: the normalised partial output and its log-sum-exp; empty splits are
    # exactly (0, -inf) so the merge gives them weight 0 without NaN.
    q, k_cache, v_cache, lens = make_inputs([1, 100], 4, 2, 64, torch.float32, device)
    num_splits = 4
    o_part, lse = decode_attention_partials(q, k_cache, v_cache, lens, num_splits=num_splits)
    assert o_part.shape == (2, 4, num_splits, 64) and lse.shape == (2, 4, num_splits)
    block_n = decode_attention_config(4, 2, 64, 4).block_n
    kf = k_cache.repeat_interleave(2, dim=1)
    vf = v_cache.repeat_interleave(2, dim=1)
    scale = 1 / math.sqrt(64)
    for b, n in enumerate([1, 100]):
        split_len = math.ceil(math.ceil(n / num_splits) / block_n) * block_n
        for s in range(num_splits):
            lo, hi = s * split_len, min((s + 1) * split_len, n)
            if lo >= hi:
                assert torch.equal(o_part[b, :, s], torch.zeros_like(o_part[b, :, s]))
                assert torch.isneginf(lse[b, :, s]).all()
                continue
            scores = torch.einsum("hd,hnd->hn", q[b], kf[b, :, lo:hi]) * scale
            assert_close(lse[b, :, s], torch.logsumexp(scores, dim=-1), torch.float32, "lse")
            assert_close(o_part[b, :, s], torch.einsum("hn,hnd->hd", scores.softmax(-1), vf[b, :, lo:hi]),
                         torch.float32, "o_part")
    merged = decode_attention_merge(o_part, lse)
    assert_close(merged, decode_attention_ref(q, k_cache, v_cache, lens), torch.float32)


def test_decode_attention_rejects_bad_input(device):
    q, k_cache, v_cache, lens = make_inputs([3, 8], 4, 2, 16, torch.float32, device)

    def call(num_splits=None, scale=None, **over):
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, seqlens=lens)
        args.update(over)
        return decode_attention(**args, num_splits=num_splits, scale=scale)

    bad = [
        (ValueError, "q", dict(q=q[0])),
        (TypeError, "q", dict(q=q.to(torch.int32))),
        (TypeError, "q", dict(q=q.tolist())),
        (ValueError, "q", dict(q=q.transpose(1, 2))),
        (ValueError, "q", dict(q=torch.randn(2, 3, 16, device=device))),     # 3 heads over 2 KV heads
        (ValueError, "k_cache", dict(k_cache=k_cache[..., :8])),
        (ValueError, "k_cache", dict(k_cache=k_cache[:1])),
        (ValueError, "v_cache", dict(v_cache=v_cache[:, :1])),
        (TypeError, "v_cache", dict(v_cache=v_cache.double())),
        (ValueError, "k_cache", dict(k_cache=torch.empty(k_cache.shape, device="meta"))),
        (ValueError, "seqlens", dict(seqlens=torch.tensor([0, 8], dtype=torch.int32, device=device))),
        (ValueError, "seqlens", dict(seqlens=torch.tensor([3, 9], dtype=torch.int32, device=device))),
        (ValueError, "seqlens", dict(seqlens=lens[:1])),
        (TypeError, "seqlens", dict(seqlens=lens.float())),
        (ValueError, "num_splits", dict(num_splits=0)),
        (ValueError, "num_splits", dict(num_splits=MAX_NUM_SPLITS + 1)),
        (TypeError, "num_splits", dict(num_splits=2.0)),
        (ValueError, "scale", dict(scale=float("nan"))),
    ]
    for exc, name, over in bad:
        with pytest.raises(exc, match=name):
            call(**over)
    if device.type == "cpu":
        with pytest.raises(TypeError, match="q"):
            call(q=q.to(torch.bfloat16))


def test_num_splits_heuristic():
    # Fill the SMs when sequences are long, never cut slices below 2 blocks, cap the count.
    assert decode_attention_num_splits(1, 8, 8192, num_sms=132) == 17
    assert decode_attention_num_splits(1, 8, 300, num_sms=132) == 3
    assert decode_attention_num_splits(1, 8, 1, num_sms=132) == 1
    assert decode_attention_num_splits(16, 8, 8192, num_sms=132) == 2
    assert decode_attention_num_splits(64, 8, 8192, num_sms=132) == 1
    assert decode_attention_num_splits(1, 1, 10**7, num_sms=10**4) == MAX_NUM_SPLITS


def test_config_smem_and_cost():
    cfg = decode_attention_config(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert (cfg.block_g, cfg.block_d) == (16, 128) and cfg.block_n >= 16
    assert decode_attention_config(48, 1, 64).block_g == 64
    smem = decode_attention_smem_bytes(cfg)
    assert smem >= cfg.num_stages * 2 * cfg.block_n * 128 * 2
    bigger = DecodeAttentionConfig(**{**cfg.__dict__, "num_stages": cfg.num_stages + 1})
    assert decode_attention_smem_bytes(bigger) > smem

    one = decode_attention_cost(1, 32, 8, 128, 1000, num_splits=1)
    # K and V of 8 heads × 1000 positions × 128 × 2 bytes dominate.
    assert one.bytes_read >= 2 * 8 * 1000 * 128 * 2 and one.flops >= 4 * 32 * 1000 * 128
    split = decode_attention_cost(1, 32, 8, 128, [1000], num_splits=4)
    assert split.bytes > one.bytes and split.flops > one.flops


def test_one_launch_leaves_the_arrival_counts_at_zero_for_the_next(device):
    """The last split of each KV group merges it and sets its count back to 0, so one
    arrivals buffer serves launch after launch (a count left over would merge too early).
    A sequence within one slice is written by split 0 alone: its workspace stays untouched."""
    from mk.tasks.decode_attention import _launch_partials

    q, k_cache, v_cache, lens = make_inputs([1, 37, 100], 8, 2, 64, torch.float32, device)
    arrivals = torch.zeros(3 * 2, dtype=torch.int32, device=device)
    for trial in range(2):
        q = torch.randn_like(q)
        o_part = torch.full((3, 8, 3, 64), float("nan"), device=device)
        lse = torch.full((3, 8, 3), float("nan"), device=device)
        out = torch.full_like(q, float("nan"))
        _launch_partials(q, k_cache, v_cache, lens, o_part, lse, 1 / 8, arrivals=arrivals, out=out)
        assert not arrivals.any(), trial
        assert_close(out, decode_attention_ref(q, k_cache, v_cache, lens), torch.float32)
        assert torch.isnan(o_part[0]).all() and torch.isnan(lse[0]).all(), trial
        assert torch.isfinite(lse[2, :, 0]).all(), trial


# --------------------------------------------------------------------------- sliding window


def _hf_window_mask(q_pos: int, n: int, window: int) -> torch.Tensor:
    """Which of the keys [0, n) the query at q_pos attends under Mistral's sliding window, as
    transformers' own mask function says (the independent statement of the rule)."""
    masking = pytest.importorskip("transformers.masking_utils")
    allowed = masking.sliding_window_causal_mask_function(window)
    return allowed(torch.tensor(0), torch.tensor(0), torch.tensor(q_pos), torch.arange(n))


def test_decode_window_rule_is_transformers_rule(device):
    """The reference's window and the slices' bounds against transformers' mask: a query at
    position L - 1 sees exactly the keys [max(L - W, 0), L)."""
    from mk.tasks.decode_attention import split_range, window_start
    for n, w in [(1, 1), (5, 1), (5, 3), (7, 7), (7, 9), (16, 5)]:
        hf = _hf_window_mask(n - 1, n, w)
        covered = [j for s in range(3) for j in range(*split_range(n, s, 3, 16, window=w))]
        assert covered == hf.nonzero().flatten().tolist() == list(range(window_start(n, w), n))
        # One-hot values: output column j is key j's probability, > 0 exactly where it is seen.
        q = torch.randn(1, 2, 16, device=device)
        k = torch.randn(1, 1, n, 16, device=device)
        v = torch.eye(16, device=device)[:n].reshape(1, 1, n, 16)
        out = decode_attention_ref(q, k, v, torch.tensor([n], device=device), window=w)
        assert torch.equal((out[0, :, :n] > 0).cpu(), hf.expand(2, n))
        kernel = decode_attention(q, k, v, torch.tensor([n], dtype=torch.int32, device=device), window=w)
        assert torch.equal((kernel[0, :, :n] > 0).cpu(), hf.expand(2, n))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 64, 90, 1000])
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_decode_attention_window_matches_masked_softmax(window, num_splits, dtype, device):
    """Keys before the window hold NaN: a read of any of them would show. Splits past the
    window's keys (16 splits of a 5-key window) must stay out of the merge."""
    lens = [1, 37, 100, 130]
    q, k_cache, v_cache, seqlens = make_inputs(lens, 8, 2, 64, dtype, device, max_seq=140)
    # The reference: plain softmax over the window's keys, built here from the rule.
    ref = torch.empty(q.shape, dtype=torch.float32, device=device)
    for b, n in enumerate(lens):
        lo = max(n - window, 0)
        k = k_cache[b, :, lo:n].float().repeat_interleave(4, dim=0)
        v = v_cache[b, :, lo:n].float().repeat_interleave(4, dim=0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[b].float(), k) / 8.0, dim=-1)
        ref[b] = torch.einsum("hn,hnd->hd", p, v)
    assert_close(decode_attention_ref(q, k_cache, v_cache, seqlens, window=window), ref, torch.float32, "ref")
    for b, n in enumerate(lens):
        k_cache[b, :, :max(n - window, 0)] = float("nan")
        v_cache[b, :, :max(n - window, 0)] = float("nan")
    out = decode_attention(q, k_cache, v_cache, seqlens, num_splits=num_splits, window=window)
    assert_close(out, ref, dtype)
    o_part, lse = decode_attention_partials(q, k_cache, v_cache, seqlens, num_splits=num_splits, window=window)
    assert_close(decode_attention_merge(o_part, lse), ref, dtype, "partials + merge")


def test_decode_attention_window_splits_and_cost(device):
    from mk.tasks.decode_attention import live_splits
    # Splits are planned for the window's keys, not the cache's length.
    assert decode_attention_num_splits(1, 1, 100_000, num_sms=100, block_n=64, window=256) == 2
    assert decode_attention_num_splits(1, 1, 100_000, num_sms=100, block_n=64) == 100
    assert live_splits(10_000, 8, 64, window=100) == 2 and live_splits(10_000, 8, 64) == 8
    plain = decode_attention_cost(2, 8, 2, 64, [50, 5000])
    assert decode_attention_cost(2, 8, 2, 64, [50, 5000], window=None) == plain
    windowed = decode_attention_cost(2, 8, 2, 64, [50, 5000], window=100)
    assert plain.bytes_read - windowed.bytes_read == 2 * 2 * (5000 - 100) * 64 * 2
    with pytest.raises(ValueError, match="window"):
        q, k_cache, v_cache, lens = make_inputs([3], 2, 1, 16, torch.float32, device)
        decode_attention(q, k_cache, v_cache, lens, window=0)
