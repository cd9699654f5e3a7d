import pytest
import torch
import triton
import triton.language as tl

from mk import jit
from mk.tasks.linear import (
    WAIT_IN_STREAM_MAX_CHUNKS,
    X_GROUP,
    X_GROUP_MAX_CHUNK_BYTES,
    GemvStream,
    gemv_stream,
    LinearConfig,
    tile_rows,
    interleave_gate_up,
    linear,
    linear_config,
    linear_cost,
    linear_k_splits,
    linear_partial_tile,
    linear_ref,
    linear_run,
    linear_smem_bytes,
    linear_split_range,
    linear_store_epilogue,
    linear_splitk_reduce_tile,
    linear_tile,
    weight_major,
)
from tests.conftest import BASE_SEED, DTYPES, assert_close, rel_err

VARIANTS = ["plain", "residual", "norm", "silu_mul", "norm_silu_mul", "norm_residual"]


def make_inputs(M, N, K, variant, dtype, device, lead=None):
    """x [M, K] (or lead + [K]), weight [N, K] and the keyword arguments of one variant."""
    shape = (M,) if lead is None else lead
    x = torch.randn(*shape, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    kw = {}
    if "residual" in variant:
        kw["residual"] = torch.randn(*shape, N, device=device).to(dtype)
    if "norm" in variant:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, device=device)).to(dtype)
        kw["norm_eps"] = 1e-5
    if "silu_mul" in variant:
        kw["silu_mul"] = True
    return x, w, kw


# --- against the reference --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 16, 40])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_linear_default_config(M, split_k, variant, dtype, device):
    N, K = (38 if "silu_mul" in variant else 37), 200  # odd sizes; silu_mul needs an even N
    x, w, kw = make_inputs(M, N, K, variant, dtype, device)
    got = linear(x, w, split_k=split_k, **kw)
    ref = linear_ref(x, w, **kw)
    assert got.dtype == dtype and got.shape == ref.shape
    assert_close(got, ref, dtype)


# Explicit tiles: several K chunks plus a ragged tail, several row and column tiles,
# GEMV over several rows, grouped launch order, tiny K chunks.
CONFIGS = [
    pytest.param(1, LinearConfig(1, 64, 32, num_warps=1, num_stages=1), id="gemv-64x32"),
    pytest.param(3, LinearConfig(1, 128, 64, num_warps=2, num_stages=1), id="gemv-rows"),
    pytest.param(3, LinearConfig(16, 64, 32, num_warps=4, num_stages=2), id="skinny-16x64x32"),
    pytest.param(5, LinearConfig(16, 128, 32, num_warps=4, num_stages=2), id="weight-major-8x128x32"),
    pytest.param(12, LinearConfig(16, 128, 64, num_warps=4, num_stages=2), id="weight-major-16x128x64"),
    pytest.param(40, LinearConfig(16, 128, 64, num_warps=4, num_stages=3, group_m=2), id="prefill-16x128x64"),
    pytest.param(40, LinearConfig(64, 256, 16, num_warps=4, num_stages=3), id="prefill-64x256x16"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, config", CONFIGS)
@pytest.mark.parametrize("split_k, variant", [(1, "plain"), (1, "norm_residual"), (3, "residual"),
                                              (3, "norm_silu_mul")])
def test_linear_explicit_config(M, config, split_k, variant, dtype, device):
    N, K = 1000, 200
    x, w, kw = make_inputs(M, N, K, variant, dtype, device)
    cfg = LinearConfig(**{**config.to_dict(), "split_k": split_k})
    got = linear(x, w, config=cfg, **kw)
    assert_close(got, linear_ref(x, w, **kw), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_leading_dims_and_strided_rows(dtype, device):
    x, w, kw = make_inputs(6, 48, 80, "residual", dtype, device, lead=(2, 3))
    got = linear(x, w, **kw)
    assert got.shape == (2, 3, 48)
    assert_close(got, linear_ref(x, w, **kw), dtype)
    base = torch.randn(5, 120, device=device).to(dtype)
    xs = base[:, :80]  # rows strided, last dim contiguous
    assert_close(linear(xs, w, split_k=2), linear_ref(xs, w), dtype)
    assert linear(x[:, :0], w).shape == (2, 0, 48)  # M = 0: nothing to do


def test_linear_1d_input(device):
    x, w, _ = make_inputs(1, 24, 40, "plain", torch.float32, device)
    got = linear(x[0], w)
    assert got.shape == (24,)
    assert_close(got, linear_ref(x[0], w), torch.float32)


# --- split-K ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 16])
def test_linear_split_k_is_deterministic(M, dtype, device):
    x, w, kw = make_inputs(M, 96, 200, "norm_residual", dtype, device)
    cfg = linear_config(M, 96, 200, dtype, split_k=3)
    first = linear(x, w, config=cfg, **kw)
    for _ in range(2):
        assert torch.equal(linear(x, w, config=cfg, **kw), first)
    assert_close(first, linear_ref(x, w, **kw), dtype)


@pytest.mark.parametrize("K, block_k, split_k", [(200, 32, 3), (200, 64, 4), (4096, 1024, 4), (7, 1, 7), (100, 16, 1)])
def test_linear_k_splits(K, block_k, split_k):
    splits = linear_k_splits(K, block_k, split_k)
    assert len(splits) == split_k
    assert splits[0][0] == 0 and splits[-1][1] == K
    for (lo, hi), (nxt, _) in zip(splits, splits[1:]):
        assert hi == nxt and lo < hi and lo % block_k == 0 and hi % block_k == 0
    chunks = [-(-(hi - lo) // block_k) for lo, hi in splits]
    assert max(chunks) - min(chunks) <= 1


@jit
def _split_range_kernel(out_ptr, split_k, K, BLOCK_K: tl.constexpr):
    s = tl.program_id(0)
    k_lo, k_hi = linear_split_range(s, split_k, K, BLOCK_K=BLOCK_K)
    tl.store(out_ptr + 2 * s, k_lo)
    tl.store(out_ptr + 2 * s + 1, k_hi)


def test_linear_split_range_matches_python(device):
    for K, block_k, split_k in [(200, 32, 3), (1000, 64, 5)]:
        out = torch.empty(split_k, 2, dtype=torch.int32, device=device)
        _split_range_kernel[(split_k,)](out, split_k, K, BLOCK_K=block_k)
        assert [tuple(r) for r in out.tolist()] == linear_k_splits(K, block_k, split_k)


# --- device functions touch only their own tile ------------------------------------------


@jit
def _one_tile_kernel(x_ptr, w_ptr, out_ptr, pid_m, pid_n, M, N, K, stride_xm, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    linear_tile(x_ptr, w_ptr, w_ptr, out_ptr, out_ptr, pid_m, pid_n, M, N, K, 0, K,
                stride_xm, stride_wn, stride_om, stride_om, 0.0,
                HAS_NORM=False, HAS_RESIDUAL=False, SILU_MUL=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


@jit
def _one_splitk_tile_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, pid_m, pid_n, M, N, K, split_k,
                            stride_xm, stride_wn, stride_ws_split, stride_ws_m, stride_om,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    for s in range(0, split_k):
        k_lo, k_hi = linear_split_range(s, split_k, K, BLOCK_K=BLOCK_K)
        linear_partial_tile(x_ptr, w_ptr, w_ptr, ws_ptr, pid_m, pid_n, s, M, N, K, k_lo, k_hi,
                            stride_xm, stride_wn, stride_ws_split, stride_ws_m, 0.0,
                            HAS_NORM=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    tl.debug_barrier()  # the reduce reads partials other threads of this program wrote
    linear_splitk_reduce_tile(ws_ptr, out_ptr, out_ptr, pid_m, pid_n, M, N, split_k,
                              stride_ws_split, stride_ws_m, stride_om, stride_om,
                              HAS_RESIDUAL=False, SILU_MUL=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)


@pytest.mark.parametrize("block_m, pid_m", [(1, 2), (16, 1)])
@pytest.mark.parametrize("split", [False, True])
def test_linear_tiles_write_only_their_tile(block_m, pid_m, split, device):
    M, N, K, bn, bk, pid_n, split_k = 20, 70, 50, 16, 16, 4, 3
    x, w, _ = make_inputs(M, N, K, "plain", torch.float32, device)
    out = torch.full((M, N), float("nan"), device=device)
    ws = torch.full((split_k, M, N), float("nan"), device=device)
    if split:
        _one_splitk_tile_kernel[(1,)](x, w, ws, out, pid_m, pid_n, M, N, K, split_k, x.stride(0), w.stride(0),
                                      ws.stride(0), ws.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk)
    else:
        _one_tile_kernel[(1,)](x, w, out, pid_m, pid_n, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                               BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk)
    rows = slice(pid_m * block_m, min((pid_m + 1) * block_m, M))
    cols = slice(pid_n * bn, min((pid_n + 1) * bn, N))  # the last column tile is ragged
    assert_close(out[rows, cols], linear_ref(x, w)[rows, cols], torch.float32)
    written = ~torch.isnan(out)
    assert written[rows, cols].all() and written.sum() == out[rows, cols].numel()
    if split:
        assert (~torch.isnan(ws)).sum() == split_k * out[rows, cols].numel()


# --- SiLU·mul layout -----------------------------------------------------------------------


def test_interleave_gate_up_layout(device):
    g, u = torch.randn(5, 7, device=device), torch.randn(5, 7, device=device)
    w = interleave_gate_up(g, u)
    assert w.shape == (10, 7) and w.is_contiguous()
    assert torch.equal(w[0::2], g) and torch.equal(w[1::2], u)
    assert torch.equal(w[2], g[1]) and torch.equal(w[3], u[1])
    with pytest.raises(ValueError, match="w_up"):
        interleave_gate_up(g, u[:4])
    with pytest.raises(TypeError):
        interleave_gate_up(g, u.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5])
def test_linear_silu_mul_from_separate_weights(M, dtype, device):
    K, inter = 64, 40
    x = torch.randn(M, K, device=device).to(dtype)
    g = (torch.randn(inter, K, device=device) / 8).to(dtype)
    u = (torch.randn(inter, K, device=device) / 8).to(dtype)
    got = linear(x, interleave_gate_up(g, u), silu_mul=True)
    want = torch.nn.functional.silu(x.float() @ g.float().T) * (x.float() @ u.float().T)
    assert got.shape == (M, inter)
    assert_close(got, want, dtype)


# --- planner hooks -------------------------------------------------------------------------


def test_linear_config_heuristic():
    bf16, f32 = torch.bfloat16, torch.float32
    for N, K in [(6144, 4096), (28672, 4096), (4096, 14336)]:  # the H200 winner for every Llama-3-8B GEMV
        c = linear_config(1, N, K, bf16)
        assert (c.block_m, c.block_n, c.block_k, c.num_warps, c.prefetch_k) == (1, 2, 2048, 2, 512)
    assert linear_config(1, 6144, 4096, f32).block_k == 1024  # the same bytes per row either way
    assert linear_config(1, 6144, 200, f32).block_k == 256  # capped by K
    assert linear_config(8, 6144, 4096, bf16).prefetch_k == 0
    assert linear_config(8, 6144, 4096, bf16).block_m == 16
    assert linear_config(40, 6144, 4096, bf16).block_m == 64
    assert linear_config(512, 6144, 4096, bf16).block_m == 128
    for M, N, K, split_k in [(1, 37, 200, 3), (16, 1000, 200, 5), (300, 17, 40, 2), (1, 1, 1, 1), (2, 3, 16, 1)]:
        c = linear_config(M, N, K, f32, split_k=split_k)
        assert c.split_k == split_k and -(-K // c.block_k) >= split_k
        assert c.block_n % 2 == 0 and c.block_n <= max(triton.next_power_of_2(N), 16)
        assert c.block_m == 1 or min(c.block_n, c.block_k) >= 16


def test_linear_config_prints_and_serialises():
    c = LinearConfig(1, 8, 1024, split_k=2, num_warps=4, num_stages=1)
    assert str(c) == "LinearConfig(BM=1 BN=8 BK=1024 split_k=2 warps=4 stages=1 group_m=8 prefetch_k=0)"
    assert c.to_dict() == dict(block_m=1, block_n=8, block_k=1024, split_k=2, num_warps=4, num_stages=1, group_m=8,
                              prefetch_k=0)
    assert LinearConfig(**c.to_dict()) == c


def test_linear_smem_bytes():
    # tl.dot body: stages x (rows + block_n) x block_k x dtype, rows capped by M (at least 16;
    # 8 for weight-major tiles, which stage [hi; lo] ([2 rows, block_k]) for the MMA as well).
    prefill = LinearConfig(128, 128, 64, num_warps=8, num_stages=3)
    assert linear_smem_bytes(prefill, 4096, 2) == 3 * (128 + 128) * 64 * 2
    assert linear_smem_bytes(prefill, 40, 2) == 3 * (64 + 128) * 64 * 2
    assert linear_smem_bytes(prefill, 3, 2) == 3 * (8 + 128) * 64 * 2 + 2 * 8 * 64 * 2
    assert linear_smem_bytes(prefill, 12, 2) == 3 * (16 + 128) * 64 * 2 + 2 * 16 * 64 * 2
    split = LinearConfig(16, 32, 256, split_k=4, num_stages=4)
    assert linear_smem_bytes(split, 8, 2) == 4 * (16 + 32) * 256 * 2 + 16 * 32 * 4
    # GEMV body: cross-warp reduction only, plus x's shuffle when warps do not span block_k.
    gemv = LinearConfig(1, 8, 1024, num_warps=4, num_stages=1)
    assert linear_smem_bytes(gemv, 1, 2) == 8 * 4 * 4
    assert linear_smem_bytes(LinearConfig(1, 16, 512, num_warps=4), 1, 2) == 16 * 4 * 4 + 512 * 4
    more = LinearConfig(64, 128, 64, num_stages=4)
    assert linear_smem_bytes(more, 64, 2) > linear_smem_bytes(LinearConfig(64, 128, 64, num_stages=3), 64, 2)


def test_weight_major_tiles_are_wide_decode_tiles():
    # Decode tiles (<= 16 rows) of >= 128 weight rows multiply weight-major, down to 8 rows.
    assert weight_major(8, 128) and weight_major(16, 256)
    assert not weight_major(16, 64) and not weight_major(32, 128) and not weight_major(1, 128)
    assert tile_rows(LinearConfig(16, 128, 64), 3) == 8
    assert tile_rows(LinearConfig(16, 64, 128), 3) == 16
    assert tile_rows(LinearConfig(16, 128, 64), 12) == 16
    assert tile_rows(LinearConfig(1, 128, 64), 1) == 1


def test_gemv_streams_group_their_chunks_where_a_ring_holds_whole_groups():
    # A ring of 1 + 2 * X_GROUP with groupable chunks: two groups in flight, waiting in the
    # stream however long the task (8B down: 56 chunks of 16 x 256 bf16).
    ring = 1 + 2 * X_GROUP
    st = gemv_stream(1, ring, 14336, 256, 16, 2)
    assert st == GemvStream(waits=True, group=X_GROUP, stages=3) and st.chunks_in_flight == 2 * X_GROUP
    assert gemv_stream(1, ring, 14336, 256, 16, 2, tiles_per_task=7).waits
    # Chunks too big, a K split that is not whole groups, or a ring of other depth: one
    # chunk an iteration, waiting in the stream only while it is short.
    too_big = X_GROUP_MAX_CHUNK_BYTES // (256 * 2) * 2
    assert gemv_stream(1, ring, 4096, 256, too_big, 2).group == 1
    assert gemv_stream(1, ring, 4096, 256, 16, 2, split_k=3).group == 1  # 16 chunks cut 5/5/6
    assert gemv_stream(1, ring, 4096, 256, 16, 2, split_k=2).group == X_GROUP
    short, long_k = WAIT_IN_STREAM_MAX_CHUNKS * 256, (WAIT_IN_STREAM_MAX_CHUNKS + 1) * 256
    assert gemv_stream(1, 4, short, 256, 16, 2) == GemvStream(waits=True, group=1, stages=4)
    assert gemv_stream(1, 4, long_k, 256, 16, 2) == GemvStream(waits=False, group=1, stages=4)
    assert gemv_stream(1, 4, short, 256, 16, 2).chunks_in_flight == 3
    # Not a GEMV ring: no wait in the stream.
    assert not gemv_stream(8, ring, 4096, 256, 16, 2).waits and not gemv_stream(1, 0, 4096, 256, 16, 2).waits


def test_linear_cost():
    M, N, K = 1, 6144, 4096
    c = linear_cost(M, N, K, 2)
    assert c.bytes_read == N * K * 2 + K * 2 and c.bytes_written == N * 2 and c.flops == 2 * N * K
    full = linear_cost(M, N, K, 2, residual=True, norm=True)
    assert full.bytes_read == c.bytes_read + K * 2 + N * 2
    silu = linear_cost(M, N, K, 2, silu_mul=True)
    assert silu.bytes_written == N // 2 * 2
    split = linear_cost(M, N, K, 2, split_k=4)
    assert split.bytes_written == c.bytes_written + 4 * N * 4 and split.bytes_read == c.bytes_read + 4 * N * 4


@pytest.mark.gpu
@pytest.mark.parametrize("M, block_n", [(1, None), (5, None), (5, 128), (64, None)])
@pytest.mark.parametrize("variant", ["residual", "norm", "norm_silu_mul"])
def test_linear_float32_stream_over_bf16_weights(M, block_n, variant, device):
    """A float32 x (every activation of a Llama step is) with bf16 weights: not rounded to
    bf16 on the way to the tensor cores (two bf16 halves, mk.tasks._dot: x-major, or
    weight-major with 128-row boxes), so the result is float32-exact up to summation order:
    rounding x alone would cost ~1e-3."""
    x, w, kw = make_inputs(M, 384, 256, variant, torch.bfloat16, device)
    config = LinearConfig(16, block_n, 64, num_warps=4, num_stages=2) if block_n else None
    x = x.float() * 1.5 + 1e-3 * torch.randn_like(x, dtype=torch.float32)  # values bf16 cannot hold
    if "residual" in variant:
        kw["residual"] = kw["residual"].float() + 1e-3
    y = linear(x, w, out_dtype=torch.float32, config=config, **kw)
    assert y.dtype == torch.float32
    ref = linear_ref(x.double(), w.double(), **{k: v.double() if torch.is_tensor(v) else v for k, v in kw.items()})
    assert rel_err(y, ref) < 1e-4, rel_err(y, ref)
    rounded = linear_ref(x.to(torch.bfloat16).double(), w.double(), **{k: v.double() if torch.is_tensor(v) else v for k, v in kw.items()})
    assert rel_err(rounded, ref) > 1e-4  # the check can tell a rounded x apart


@pytest.mark.gpu
@pytest.mark.parametrize("M", [48, 64])
def test_linear_float32_rows_over_a_vocabulary_of_bf16_weights_in_many_waves(M, device):
    """The exact prefill's LM head (float32 rows, bf16 weights, 128256 outputs: a grid of
    ~1000 tiles in several waves), call after call on fresh inputs: every tile is the
    product. (A config that raced under this load returned a garbage tile in ~1 of 1000.)"""
    gen = torch.Generator(device=device).manual_seed(BASE_SEED)
    w = (0.02 * torch.randn(128256, 4096, generator=gen, device=device)).to(torch.bfloat16)
    wf = w.float()
    for _ in range(12):
        x = torch.randn(M, 4096, generator=gen, device=device)
        y = linear(x, w)
        bad = ((y - x @ wf.T).abs() > 1e-3).any(0)
        assert not bad.any(), f"{int(bad.sum())} wrong columns, from {int(bad.nonzero()[0])}"


# --- argument checks -------------------------------------------------------------------------


def test_linear_rejects_bad_input(device):
    x = torch.randn(2, 16, device=device)
    w = torch.randn(8, 16, device=device)
    res = torch.randn(2, 8, device=device)
    res_before = res.clone()
    with pytest.raises(TypeError, match="x"):
        linear(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="x"):
        linear(x.tolist(), w)
    with pytest.raises(TypeError, match="weight"):
        linear(x, w.double())
    with pytest.raises(ValueError, match="weight"):
        linear(x, torch.randn(8, 17, device=device))  # K mismatch
    with pytest.raises(ValueError, match="weight"):
        linear(x, torch.randn(16, 8, device=device).t())  # not contiguous
    with pytest.raises(ValueError, match="weight"):
        linear(x, torch.randn(8, device=device))
    with pytest.raises(ValueError, match="x"):
        linear(torch.randn(16, 2, device=device).t(), w)  # last dim not contiguous
    with pytest.raises(ValueError, match="residual"):
        linear(x, w, residual=torch.randn(2, 9, device=device))
    with pytest.raises(TypeError, match="residual"):
        linear(x, w, residual=res.double())
    with pytest.raises(TypeError, match="out_dtype"):
        linear(x, w, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="silu_mul"):
        linear(x, torch.randn(7, 16, device=device), silu_mul=True)  # odd N
    with pytest.raises(ValueError, match="silu_mul"):
        linear(x, w, residual=res, silu_mul=True)
    with pytest.raises(TypeError, match="silu_mul"):
        linear(x, w, silu_mul=1)
    with pytest.raises(ValueError, match="norm_weight"):
        linear(x, w, norm_weight=torch.randn(15, device=device))
    with pytest.raises(ValueError, match="norm_eps"):
        linear(x, w, norm_weight=torch.ones(16, device=device), norm_eps=-1.0)
    with pytest.raises(ValueError, match="split_k"):
        linear(x, w, split_k=0)
    with pytest.raises(TypeError, match="split_k"):
        linear(x, w, split_k=2.0)
    with pytest.raises(ValueError, match="split_k"):
        linear(x, w, residual=res, config=LinearConfig(16, 16, 16, split_k=2))  # 1 chunk of K
    with pytest.raises(ValueError, match="split_k"):
        linear(x, w, split_k=3, config=LinearConfig(16, 16, 16, split_k=2))
    with pytest.raises(TypeError, match="config"):
        linear(x, w, config={"block_m": 16})
    with pytest.raises(ValueError, match="config.block_n"):
        linear(x, w, config=LinearConfig(16, 24, 16))
    with pytest.raises(ValueError, match="config.block_m"):
        linear(x, w, config=LinearConfig(8, 16, 16))
    with pytest.raises(ValueError, match="config.block_k"):
        linear(x, w, config=LinearConfig(16, 16, 8))
    with pytest.raises(ValueError, match="config.num_stages"):
        linear(x, w, config=LinearConfig(1, 16, 16, num_stages=0))
    assert torch.equal(res, res_before)


def test_linear_rejects_wrong_device_and_dtype(device):
    x = torch.randn(2, 16, device=device)
    w = torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match="x"):
        linear(torch.randn(2, 16, device="meta"), w)
    with pytest.raises(ValueError, match="weight"):
        linear(x, torch.randn(8, 16, device="meta"))
    with pytest.raises(ValueError, match="norm_weight"):
        linear(x, w, norm_weight=torch.ones(16, device="meta"))
    if device.type == "cpu":
        with pytest.raises(TypeError, match="x"):
            linear(x.to(torch.bfloat16), w.to(torch.bfloat16))


def test_prefetch_lines_cover_the_asked_columns():
    from mk.tasks.linear import prefetch_lines

    assert prefetch_lines(LinearConfig(1, 8, 512), 4096, 2) == (0, 64)
    # 1000 bf16 columns = 15.6 lines of 64 -> 16 lines.
    assert prefetch_lines(LinearConfig(1, 8, 512, prefetch_k=1000), 4096, 2) == (16, 64)
    # Never past the tile's K range: 4096 / 4 splits = 1024 fp32 columns = 32 lines of 32.
    assert prefetch_lines(LinearConfig(1, 8, 512, split_k=4, prefetch_k=99999), 4096, 4) == (32, 32)
    assert prefetch_lines(LinearConfig(1, 8, 512, prefetch_k=3 * 64), 200, 2) == (4, 64)  # 3 lines, rounded up to 4


def test_bad_prefetch_k_is_refused(device):
    x = torch.randn(1, 32, device=device)
    w = torch.randn(16, 32, device=device)
    with pytest.raises(ValueError, match="prefetch_k"):
        linear(x, w, config=LinearConfig(1, 16, 32, prefetch_k=-1))


@pytest.mark.gpu
def test_chain_of_dependent_linears_in_a_graph():
    """Each call reads the previous call's output: with PDL the next kernel starts early, so a
    missing or misplaced dependency wait would read stale activations."""
    torch.manual_seed(BASE_SEED)
    K = 2048
    ws = [torch.randn(K, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(6)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    cfg = linear_config(1, K, K, torch.bfloat16)
    cfg = LinearConfig(**{**cfg.to_dict(), "prefetch_k": 1024})

    def chain():
        h = x
        for w in ws:
            h = linear(h, w, config=cfg)
        return h

    graph = torch.cuda.CUDAGraph()
    chain()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(20):
        # Fresh input each replay, so stale activations from the last replay would show.
        x.copy_(torch.randn_like(x))
        ref = x.float()
        for w in ws:
            ref = (ref @ w.float().T).to(torch.bfloat16).float()
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < 2e-2


def test_skinny_config_fits_the_shared_memory_it_is_given():
    from mk.tasks.linear import linear_smem_bytes

    free = linear_config(8, 6144, 4096, torch.bfloat16)
    assert (free.block_m, free.block_n, free.num_warps, free.num_stages) == (16, 64, 2, 4)
    for limit in (101376, 65536, 40000):  # Ada's 99 KiB, then tighter
        c = linear_config(8, 6144, 4096, torch.bfloat16, smem_limit=limit)
        assert linear_smem_bytes(c, 8, 2) <= limit and c.block_k == free.block_k
    assert linear_config(8, 6144, 4096, torch.bfloat16, smem_limit=101376).num_stages == 2
    # The GEMV body needs (almost) no shared memory: a limit changes nothing.
    assert linear_config(1, 6144, 4096, torch.bfloat16, smem_limit=40000) == linear_config(1, 6144, 4096, torch.bfloat16)


@pytest.mark.parametrize("silu", [False, True])
def test_tma_gemm_tile_matches_reference_through_the_interpreter(silu):
    # The prefill GEMM (persistent grid, TMA descriptors, fused SiLU·mul over interleaved
    # gate/up columns) in float32 through the interpreter: ragged tiles on every edge and
    # more tiles than programs.
    from mk.tasks.linear import linear_tma_kernel

    M, N, K = 40, 48, 40
    x, w = torch.randn(M, K), torch.randn(N, K)
    out = torch.empty(M, N // 2 if silu else N)
    linear_tma_kernel[(3,)](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), NUM_SMS=3, SILU_MUL=silu,
                            BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, NUM_STAGES=1)
    assert rel_err(out, linear_ref(x, w, silu_mul=silu)) < 1e-5


def test_tma_gemm_takes_narrow_tiles_only_where_wide_ones_leave_the_last_wave_idle():
    from mk.tasks.linear import TMA_GEMM, TMA_GEMM_NARROW, tma_gemm_config

    # 1B QKV at 2048 rows: 192 wide tiles fill 1.45 waves of 132 SMs (73% busy), 384
    # narrow ones 2.9 (97%).
    assert tma_gemm_config(2048, 3072, 132) == TMA_GEMM_NARROW
    for M, N in ((2048, 2048), (2048, 16384), (8192, 3072), (2048, 6144), (8192, 28672)):
        assert tma_gemm_config(M, N, 132) == TMA_GEMM, (M, N)
    assert TMA_GEMM_NARROW.block_n < TMA_GEMM.block_n


@pytest.mark.gpu
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("M,N,K", [(2048, 3072, 2048), (300, 1008, 520), (17, 256, 64)])
def test_prefill_rows_take_the_tma_gemm_on_hopper(M, N, K, silu):
    from mk.tasks.linear import tma_gemm_serves

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (0.05 * torch.randn(N, K, device="cuda")).to(torch.bfloat16)
    got = linear(x, w, silu_mul=silu)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N // 2 if silu else N)
    assert rel_err(got, linear_ref(x, w, silu_mul=silu)) < 1e-2
    assert tma_gemm_serves(x, w, silu) == (torch.cuda.get_device_capability()[0] >= 9)
    assert not tma_gemm_serves(x.float(), w.float(), silu) and not tma_gemm_serves(x[:16], w, silu)


# --- projection bias (Qwen2) -------------------------------------------------------------


@pytest.mark.parametrize("M,config", [
    (1, None), (5, None), (40, None),
    (1, LinearConfig(1, 16, 32, 3)), (5, LinearConfig(16, 16, 32, 2, num_warps=2)),
])
@pytest.mark.parametrize("epilogue", ["plain", "residual", "silu_mul"])
def test_linear_bias_matches_torch_linear(M, config, epilogue, device):
    """y = F.linear(x, W, b) (+ residual, or SiLU·mul of the biased gate and up), whole K and
    split K (the bias added once, after the sum)."""
    N, K = 70, 96
    x, w = torch.randn(M, K, device=device), 0.1 * torch.randn(N, K, device=device)
    bias = torch.randn(N, device=device)
    y = torch.nn.functional.linear(x, w, bias)
    kwargs = {}
    if epilogue == "residual":
        kwargs["residual"] = torch.randn(M, N, device=device)
        y = y + kwargs["residual"]
    elif epilogue == "silu_mul":
        kwargs["silu_mul"] = True
        y = torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]
    out = linear(x, w, bias=bias, config=config, **kwargs)
    assert_close(out, y, torch.float32)
    assert_close(linear_ref(x, w, bias=bias, **kwargs), y, torch.float32, "linear_ref")


@jit
def _bias_run_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TILES: tl.constexpr):
    # A run of TILES tiles through linear_run, each stored with its bias by linear_store_epilogue.
    linear_run(x_ptr, w_ptr, w_ptr, 0, tl.program_id(0) * TILES, TILES, M, N, K, 0, K, K, K, 0.0,
               linear_store_epilogue, (out_ptr, out_ptr, M, N, N, N, bias_ptr), (False, False),
               HAS_NORM=False, BLOCK_M=1, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def test_linear_run_store_epilogue_adds_the_bias(device):
    M, N, K = 1, 64, 80
    x, w, bias = torch.randn(M, K, device=device), torch.randn(N, K, device=device), torch.randn(N, device=device)
    out = torch.empty(M, N, device=device)
    _bias_run_kernel[(2,)](x, w, bias, out, M, N, K, BLOCK_N=16, BLOCK_K=32, TILES=2)
    assert_close(out, torch.nn.functional.linear(x, w, bias), torch.float32)


def test_linear_bias_cost_and_checks(device):
    assert linear_cost(4, 96, 64, bias=False) == linear_cost(4, 96, 64)
    assert linear_cost(4, 96, 64, bias=True).bytes_read == linear_cost(4, 96, 64).bytes_read + 96 * 2
    with pytest.raises(ValueError, match="bias"):
        x, w = torch.randn(2, 8, device=device), torch.randn(6, 8, device=device)
        linear(x, w, bias=torch.randn(5, device=device))
