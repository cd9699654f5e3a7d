"""The fused QKV projection + RoPE + KV append against linear and rope_kv run apart, on
Hugging Face weights (the fused op gets them with q and k rows interleaved)."""

import pytest
import torch
import triton.language as tl

from mk import jit
from mk.tasks.linear import LinearConfig, linear_run
from mk.tasks.qkv_rope import qkv_rope_kv, qkv_rope_kv_ref, qkv_rope_kv_run_epilogue
from mk.tasks.rope import interleave_rotary, rope_inv_freq, rope_kv_ref
from tests.conftest import HAS_CUDA, assert_close

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _problem(batch, hq, hkv, d, K, max_seq, device, dtype=torch.float32):
    wq, wk, wv = (0.1 * torch.randn(h * d, K, device=device) for h in (hq, hkv, hkv))
    hf = [w.to(dtype) for w in (wq, wk, wv)]
    packed = torch.cat([interleave_rotary(hf[0], d), interleave_rotary(hf[1], d), hf[2]]).contiguous()
    x = torch.randn(batch, K, device=device)
    norm_w = (1 + 0.1 * torch.randn(K, device=device)).to(dtype)
    positions = torch.randperm(max_seq)[:batch].to(device=device, dtype=torch.int32)
    inv_freq = rope_inv_freq(d, 500000.0, LLAMA3).to(device)
    return hf, packed, x, norm_w, positions, inv_freq


def _unfused(hf, x, norm_w, positions, inv_freq, k_cache, v_cache, hq, eps=1e-6):
    """linear (RMSNorm first unless norm_w is None) on the Hugging Face weights, then the
    half-split rope_kv reference."""
    B, d, hkv = x.shape[0], k_cache.shape[-1], k_cache.shape[1]
    h = x.float()
    if norm_w is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
    q, k, v = (h @ w.float().T for w in hf)
    return rope_kv_ref(q.view(B, 1, hq, d), k.view(B, 1, hkv, d), v.view(B, 1, hkv, d), positions.view(B, 1),
                       inv_freq, k_cache, v_cache)


@pytest.mark.parametrize("batch,config", [
    (1, None),                              # the GEMV body, launcher's tiles (2 rows)
    (1, LinearConfig(1, 32, 64)),           # GEMV tiles of half a head
    (1, LinearConfig(1, 128, 64)),          # GEMV tiles of two heads
    (3, None),                              # tl.dot body for a decode batch
    (5, LinearConfig(16, 16, 32, num_warps=2)),
    (1, LinearConfig(1, 32, 32, 3)),        # split-K (96 = 3 chunks): partials, then rotating reduces
    (5, LinearConfig(16, 16, 32, 2, num_warps=2)),
])
def test_fused_equals_linear_then_rope_kv(batch, config, device):
    hq, hkv, d, K, max_seq = 4, 2, 64, 96, 20
    hf, packed, x, norm_w, positions, inv_freq = _problem(batch, hq, hkv, d, K, max_seq, device)
    caches = [torch.randn(batch, hkv, max_seq, d, device=device) for _ in range(2)]
    want_q, want_k, want_v = _unfused(hf, x, norm_w, positions, inv_freq, *caches, hq)
    seqlens = torch.zeros(batch, dtype=torch.int64, device=device)
    q = qkv_rope_kv(x, packed, positions, inv_freq, *caches, num_q_heads=hq, norm_weight=norm_w, seqlens=seqlens,
                    config=config)
    assert q.dtype == torch.float32 and q.shape == (batch, hq * d)
    assert_close(q, want_q.reshape(batch, -1), torch.float32, "q")
    assert_close(caches[0], want_k, torch.float32, "k_cache")  # new rows, and every other row untouched
    assert_close(caches[1], want_v, torch.float32, "v_cache")
    assert seqlens.tolist() == (positions + 1).tolist()
    # The reference of the fused op itself (interleaved weights) agrees with the unfused one.
    ref_q, _, _ = qkv_rope_kv_ref(x, packed, positions, inv_freq, *caches, num_q_heads=hq, norm_weight=norm_w)
    assert_close(ref_q, want_q.reshape(batch, -1), torch.float32, "qkv_rope_kv_ref")


def test_without_norm_and_head_dim_128(device):
    batch, hq, hkv, d, K, max_seq = 2, 2, 1, 128, 64, 9
    hf, packed, x, _, positions, inv_freq = _problem(batch, hq, hkv, d, K, max_seq, device)
    caches = [torch.zeros(batch, hkv, max_seq, d, device=device) for _ in range(2)]
    want_q, want_k, want_v = _unfused(hf, x, None, positions, inv_freq, *caches, hq)
    q = qkv_rope_kv(x, packed, positions, inv_freq, *caches, num_q_heads=hq)
    assert_close(q, want_q.reshape(batch, -1), torch.float32, "q")
    assert_close(caches[0], want_k, torch.float32, "k_cache")
    assert_close(caches[1], want_v, torch.float32, "v_cache")


def test_bad_input_is_refused_and_changes_nothing(device):
    hq, hkv, d, K, max_seq = 2, 1, 8, 32, 6
    hf, packed, x, norm_w, positions, inv_freq = _problem(2, hq, hkv, d, K, max_seq, device)
    caches = [torch.zeros(2, hkv, max_seq, d, device=device) for _ in range(2)]
    with pytest.raises(ValueError, match="positions must lie in"):
        qkv_rope_kv(x, packed, torch.tensor([0, max_seq], dtype=torch.int32, device=device), inv_freq, *caches,
                    num_q_heads=hq)
    with pytest.raises(ValueError, match="weight"):
        qkv_rope_kv(x, packed[:-1], positions, inv_freq, *caches, num_q_heads=hq)
    with pytest.raises(ValueError, match="weight"):
        qkv_rope_kv(x, packed, positions, inv_freq, *caches, num_q_heads=hq + 1)
    with pytest.raises(ValueError, match="block_n must be even"):
        qkv_rope_kv(x, packed, positions, inv_freq, *caches, num_q_heads=hq, config=LinearConfig(1, 1, 32))
    with pytest.raises(ValueError, match="inv_freq"):
        qkv_rope_kv(x, packed, positions, inv_freq[:-1], *caches, num_q_heads=hq)
    assert all(not c.any() for c in caches)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_bf16_weights_float32_x_on_the_gpu(batch, kv_dtype, device):
    hq, hkv, d, K, max_seq = 32, 8, 64, 2048, 300
    hf, packed, x, norm_w, positions, inv_freq = _problem(batch, hq, hkv, d, K, max_seq, device, torch.bfloat16)
    caches = [torch.zeros(batch, hkv, max_seq, d, device=device, dtype=kv_dtype) for _ in range(2)]
    want_q, want_k, want_v = _unfused(hf, x, norm_w, positions, inv_freq, *caches, hq)
    q = qkv_rope_kv(x, packed, positions, inv_freq, *caches, num_q_heads=hq, norm_weight=norm_w)
    assert_close(q, want_q.reshape(batch, -1), torch.bfloat16, "q")
    assert_close(caches[0].float(), want_k, torch.bfloat16, "k_cache")
    assert_close(caches[1].float(), want_v, torch.bfloat16, "v_cache")


# --------------------------------------------------------------------------- Qwen2 bias, Qwen3 q/k norm


def _family_reference(hf, biases, norms, x, positions, inv_freq, k_cache, v_cache, hq, eps=1e-6):
    """Qwen2 / Qwen3 attention inputs in Hugging Face's layout: q/k/v projections with their
    biases, then (norms given) transformers' Qwen3RMSNorm + apply_rotary_pos_emb on q and k,
    else the half-split rotation; k and v appended to float32 copies of the caches."""
    from tests.tasks.hf_reference import qwen3_norm_rope
    B, d, hkv = x.shape[0], k_cache.shape[-1], k_cache.shape[1]
    q, k, v = (x.float() @ w.float().T + (0 if b is None else b.float()) for w, b in zip(hf, biases))
    q, k, v = q.view(B, 1, hq, d), k.view(B, 1, hkv, d), v.view(B, 1, hkv, d)
    if norms is None:
        return rope_kv_ref(q, k, v, positions.view(B, 1), inv_freq, k_cache, v_cache)
    q_rot = qwen3_norm_rope(q, norms[0], positions.view(B, 1), inv_freq, eps)
    k_rot = qwen3_norm_rope(k, norms[1], positions.view(B, 1), inv_freq, eps)
    k_after, v_after = k_cache.float().clone(), v_cache.float().clone()
    for b in range(B):
        k_after[b, :, int(positions[b])] = k_rot[b, 0]
        v_after[b, :, int(positions[b])] = v[b, 0]
    return q_rot, k_after, v_after


FAMILY_CONFIGS = [
    pytest.param(1, None, id="gemv-default"),
    pytest.param(1, LinearConfig(1, 32, 64), id="gemv-one-head"),
    pytest.param(3, LinearConfig(16, 64, 32, num_warps=2), id="dot-two-heads"),
    pytest.param(1, LinearConfig(1, 32, 32, 3), id="gemv-splitk"),
    pytest.param(5, LinearConfig(16, 32, 32, 2, num_warps=2), id="dot-splitk"),
]


@pytest.mark.parametrize("bias,qk_norm", [(True, False), (False, True), (True, True)],
                         ids=["qwen2-bias", "qwen3-norm", "bias+norm"])
@pytest.mark.parametrize("batch,config", FAMILY_CONFIGS)
def test_bias_and_qk_norm_match_hugging_face_layout(batch, config, bias, qk_norm, device):
    """The bias and the norm weights are given to the fused op permuted as the rows
    (interleave_rotary); the reference works in HF's un-permuted layout, so a missing or
    wrong permutation shows (the biases and weights are random, not symmetric)."""
    hq, hkv, d, K, max_seq = 4, 2, 32, 96, 12
    hf, packed, x, _, positions, inv_freq = _problem(batch, hq, hkv, d, K, max_seq, device)
    biases = [torch.randn(h * d, device=device) if bias else None for h in (hq, hkv, hkv)]
    norms = (torch.rand(d, device=device) + 0.5, torch.randn(d, device=device)) if qk_norm else None
    caches = [torch.randn(batch, hkv, max_seq, d, device=device) for _ in range(2)]
    want_q, want_k, want_v = _family_reference(hf, biases, norms, 2 * x, positions, inv_freq, *caches, hq)
    packed_bias = (torch.cat([interleave_rotary(biases[0], d), interleave_rotary(biases[1], d), biases[2]])
                   if bias else None)
    extra = dict(bias=packed_bias)
    if qk_norm:
        extra.update(q_norm_weight=interleave_rotary(norms[0], d), k_norm_weight=interleave_rotary(norms[1], d))
    q = qkv_rope_kv(2 * x, packed, positions, inv_freq, *caches, num_q_heads=hq, config=config, **extra)
    assert_close(q, want_q.reshape(batch, -1), torch.float32, "q")
    assert_close(caches[0], want_k, torch.float32, "k_cache")
    assert_close(caches[1], want_v, torch.float32, "v_cache")
    ref_q, _, _ = qkv_rope_kv_ref(2 * x, packed, positions, inv_freq, *caches, num_q_heads=hq, **extra)
    assert_close(ref_q, want_q.reshape(batch, -1), torch.float32, "qkv_rope_kv_ref")


def test_qk_norm_needs_whole_heads_a_tile(device):
    from mk.tasks.qkv_rope import check_qkv_rope_tile
    hq, hkv, d, K, max_seq = 2, 1, 16, 32, 6
    hf, packed, x, _, positions, inv_freq = _problem(2, hq, hkv, d, K, max_seq, device)
    caches = [torch.zeros(2, hkv, max_seq, d, device=device) for _ in range(2)]
    w = torch.ones(d, device=device)
    with pytest.raises(ValueError, match="multiple of head_dim=16"):
        qkv_rope_kv(x, packed, positions, inv_freq, *caches, num_q_heads=hq, config=LinearConfig(1, 8, 32),
                    q_norm_weight=w, k_norm_weight=w)
    with pytest.raises(ValueError, match="together"):
        qkv_rope_kv(x, packed, positions, inv_freq, *caches, num_q_heads=hq, q_norm_weight=w)
    with pytest.raises(ValueError, match="bias"):
        qkv_rope_kv(x, packed, positions, inv_freq, *caches, num_q_heads=hq, bias=torch.zeros(3, device=device))
    assert all(not c.any() for c in caches)
    check_qkv_rope_tile(8, 16)  # without the norm, any even width serves
    check_qkv_rope_tile(32, 16, qk_norm=True)


@jit
def _qkv_run_kernel(x_ptr, w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, bias_ptr, qn_ptr, kn_ptr,
                    N, K, max_seq, HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr):
    # A run of TILES QKV tiles through linear_run, the family options in the epilogue's args.
    linear_run(x_ptr, w_ptr, w_ptr, 0, tl.program_id(0) * TILES, TILES, 1, N, K, 0, K, K, K, 0.0,
               qkv_rope_kv_run_epilogue,
               (pos_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, 1, max_seq, pos_ptr,
                bias_ptr, qn_ptr, kn_ptr, 1e-6),
               (HQ, HKV, HEAD_DIM, False, False, True, True), HAS_NORM=False, BLOCK_M=1, BLOCK_N=BLOCK_N,
               BLOCK_K=BLOCK_K)


def test_run_epilogue_takes_bias_and_qk_norm(device):
    hq, hkv, d, K, max_seq = 2, 1, 16, 48, 5
    hf, packed, x, _, positions, inv_freq = _problem(1, hq, hkv, d, K, max_seq, device)
    biases = [torch.randn(h * d, device=device) for h in (hq, hkv, hkv)]
    norms = (torch.rand(d, device=device) + 0.5, torch.randn(d, device=device))
    caches = [torch.zeros(1, hkv, max_seq, d, device=device) for _ in range(2)]
    want_q, want_k, want_v = _family_reference(hf, biases, norms, x, positions, inv_freq, *caches, hq)
    bias = torch.cat([interleave_rotary(biases[0], d), interleave_rotary(biases[1], d), biases[2]])
    q = torch.empty(1, hq * d, device=device)
    N = (hq + 2 * hkv) * d
    _qkv_run_kernel[(N // (2 * d),)](x, packed, positions, inv_freq, q, *caches, bias,
                                    interleave_rotary(norms[0], d), interleave_rotary(norms[1], d), N, K, max_seq,
                                    HQ=hq, HKV=hkv, HEAD_DIM=d, BLOCK_N=d, BLOCK_K=16, TILES=2)
    assert_close(q, want_q.reshape(1, -1), torch.float32, "q")
    assert_close(caches[0], want_k, torch.float32, "k_cache")
    assert_close(caches[1], want_v, torch.float32, "v_cache")
