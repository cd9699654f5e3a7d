"""Bad arguments to mk's ops: refused before any work, with one line that names them.

Each refusal case builds a call of one op with one bad argument and the tensors that must
come through it unchanged; the call must raise the given exception type, on one line that
names the argument, and leave every input (caches and ``out`` included) as it was. The
strided cases are inputs an op takes: its result must match the op's torch reference.
"""

import pytest
import torch

from mk.tasks import (decode_attention, decode_attention_ref, embedding, gumbel_noise, linear, rmsnorm, rope_inv_freq,
                      rope_kv, sample, silu_mul, silu_mul_ref)
from mk.tasks.append_token import append_token
from mk.tasks.decode_attention import decode_attention_merge
from tests.conftest import assert_close

INF = float("inf")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _rmsnorm(dev, **kw):
    x, w = torch.randn(2, 16, device=dev), torch.randn(16, device=dev)
    return lambda: rmsnorm(x, w, **kw), [x, w]


def _linear(dev, **kw):
    x, w, nw = torch.randn(3, 16, device=dev), torch.randn(8, 16, device=dev), torch.randn(16, device=dev)
    return lambda: linear(x, w, norm_weight=nw, **kw), [x, w, nw]


def _rope_kv(dev, qk_norm=False, **kw):
    q, k, v = (torch.randn(1, 2, h, 8, device=dev) for h in (4, 2, 2))
    positions, inv_freq = torch.tensor([[3, 5]], device=dev), rope_inv_freq(8, 1e4).to(dev)
    k_cache, v_cache = torch.zeros(1, 2, 16, 8, device=dev), torch.zeros(1, 2, 16, 8, device=dev)
    norms = dict(q_norm_weight=torch.randn(8, device=dev), k_norm_weight=torch.randn(8, device=dev)) if qk_norm else {}
    tensors = [q, k, v, positions, inv_freq, k_cache, v_cache, *norms.values()]
    return lambda: rope_kv(q, k, v, positions, inv_freq, k_cache, v_cache, **norms, **kw), tensors


def _embedding(dev, **kw):
    ids, table = torch.tensor([1, 4, 2], device=dev), torch.randn(5, 8, device=dev)
    return lambda: embedding(ids, table, **kw), [ids, table]


def _sample(dev, **kw):
    logits = torch.randn(3, 20, device=dev)
    return lambda: sample(logits, top_k=5, **kw), [logits]


def _gumbel(dev, rows=2, **kw):
    return lambda: gumbel_noise(0, 0, rows, 4, **kw), []


def _inv_freq(dev, theta=1e4, **scaling):
    return lambda: rope_inv_freq(8, theta, {**LLAMA3, **scaling} if scaling else None), []


def _merge(dev, out=False, **kw):
    o_part, lse = torch.randn(2, 4, 3, 16, device=dev), torch.randn(2, 4, 3, device=dev)
    tensors = [o_part, lse]
    if out:
        kw["out"] = torch.zeros(2, 4, 16, device=dev)
        tensors.append(kw["out"])
    return lambda: decode_attention_merge(o_part, lse, **kw), tensors


CASES = [
    pytest.param(_rmsnorm, dict(eps=INF), ValueError, "eps", id="rmsnorm-eps-inf"),
    pytest.param(_rmsnorm, dict(eps=True), TypeError, "eps", id="rmsnorm-eps-bool"),
    pytest.param(_linear, dict(norm_eps=INF), ValueError, "norm_eps", id="linear-norm_eps-inf"),
    pytest.param(_rope_kv, dict(norm_eps="1e-6"), TypeError, "norm_eps", id="rope_kv-norm_eps-str"),
    pytest.param(_rope_kv, dict(norm_eps=None), TypeError, "norm_eps", id="rope_kv-norm_eps-none"),
    pytest.param(_rope_kv, dict(norm_eps=-1.0), ValueError, "norm_eps", id="rope_kv-norm_eps-negative-no-norm"),
    pytest.param(_rope_kv, dict(qk_norm=True, norm_eps=INF), ValueError, "norm_eps", id="rope_kv-norm_eps-inf"),
    pytest.param(_embedding, dict(vocab_start="0"), TypeError, "vocab_start", id="embedding-vocab_start-str"),
    pytest.param(_embedding, dict(vocab_start=1.5), TypeError, "vocab_start", id="embedding-vocab_start-float"),
    pytest.param(_embedding, dict(vocab_start=True), TypeError, "vocab_start", id="embedding-vocab_start-bool"),
    pytest.param(_embedding, dict(vocab_start=-1), ValueError, "vocab_start", id="embedding-vocab_start-negative"),
    pytest.param(_sample, dict(radix_bits=4.0), TypeError, "radix_bits", id="sample-radix_bits-float"),
    pytest.param(_gumbel, dict(device="meta"), ValueError, "device", id="gumbel_noise-device-meta"),
    pytest.param(_gumbel, dict(device="nowhere"), ValueError, "device", id="gumbel_noise-device-unknown"),
    pytest.param(_gumbel, dict(device=3.5), TypeError, "device", id="gumbel_noise-device-float"),
    pytest.param(_gumbel, dict(device="cuda"), ValueError, "device", id="gumbel_noise-device-no-gpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    pytest.param(_gumbel, dict(rows=0, block_v=3), ValueError, "block_v", id="gumbel_noise-block_v-no-rows"),
    pytest.param(_inv_freq, dict(theta=INF), ValueError, "theta", id="rope_inv_freq-theta-inf"),
    pytest.param(_inv_freq, dict(factor=None), TypeError, "factor", id="rope_inv_freq-factor-none"),
    pytest.param(_inv_freq, dict(factor="8"), TypeError, "factor", id="rope_inv_freq-factor-str"),
    pytest.param(_inv_freq, dict(factor=True), TypeError, "factor", id="rope_inv_freq-factor-bool"),
    pytest.param(_inv_freq, dict(factor=torch.tensor([8.0, 2.0])), TypeError, "factor",
                 id="rope_inv_freq-factor-tensor"),
    pytest.param(_inv_freq, dict(factor=INF), ValueError, "factor", id="rope_inv_freq-factor-inf"),
    pytest.param(_inv_freq, dict(original_max_position_embeddings=INF), ValueError,
                 "original_max_position_embeddings", id="rope_inv_freq-length-inf"),
    pytest.param(_inv_freq, dict(high_freq_factor=INF), ValueError, "high_freq_factor",
                 id="rope_inv_freq-high_freq_factor-inf"),
    pytest.param(_merge, dict(dtype=torch.float64), TypeError, "dtype", id="decode_attention_merge-dtype-float64"),
    pytest.param(_merge, dict(out=True, dtype=torch.bfloat16), ValueError, "dtype",
                 id="decode_attention_merge-out-and-dtype"),
]


@pytest.mark.parametrize("build, kwargs, error, names", CASES)
def test_bad_argument_is_refused_before_any_work(build, kwargs, error, names, device):
    call, inputs = build(device, **kwargs)
    before = [t.clone() for t in inputs]
    with pytest.raises(error, match=names) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert "\n" not in str(info.value), f"not one line: {info.value}"
    for i, (t, t0) in enumerate(zip(inputs, before)):
        assert torch.equal(t, t0), f"input {i} changed by a refused call"


# --------------------------------------------------------------------------- inputs that must work


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_attention_strided_seqlens(num_splits, device):
    # A view of every other length: the kernels must read seqlens[b], not the b-th element.
    q, k_cache, v_cache = torch.randn(2, 4, 16, device=device), *torch.randn(2, 2, 2, 8, 16, device=device)
    seqlens = torch.tensor([3, 1, 8, 1], device=device)[::2]
    got = decode_attention(q, k_cache, v_cache, seqlens, num_splits=num_splits)
    assert_close(got, decode_attention_ref(q, k_cache, v_cache, seqlens), torch.float32)


def test_silu_mul_interleaved_halves_of_different_layouts(device):
    # Both halves have stride 2 in their last dim, but only up's rows reshape to a view:
    # gate's permuted leading dims are copied (stride 1), which the launcher must handle.
    gate = torch.randn(2, 3, 16, device=device).transpose(0, 1)[..., 0::2]
    up = torch.randn(3, 2, 16, device=device)[..., 1::2]
    assert_close(silu_mul(gate, up), silu_mul_ref(gate, up), torch.float32)


def test_append_token_position_before_the_history_records_nothing(device):
    # pos[b] + 1 < 0 is outside the history as much as pos[b] + 1 >= max_seq: sequence 1
    # must not write into sequence 0's row (nor move its position), sequence 0 appends.
    tokens = torch.zeros(2, 5, dtype=torch.int64, device=device)
    pos = torch.tensor([0, -3], device=device)
    append_token(torch.tensor([7, 8], device=device), pos, tokens)
    assert tokens.tolist() == [[0, 7, 0, 0, 0], [0] * 5]
    assert pos.tolist() == [1, -3]

