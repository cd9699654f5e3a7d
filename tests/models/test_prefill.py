"""Prefill's attention over the cache a chunk has filled, under a sliding window (Mistral)."""

import math

import pytest
import torch

from mk.models import prefill
from mk.models.prefill import Segment
from tests.conftest import assert_close


def _reference(q, k_cache, v_cache, segments, window):
    """Each segment's tokens over its prompt's keys, masked by transformers' own sliding-window
    causal mask function: [n, Hq * D] float32."""
    masking = pytest.importorskip("transformers.masking_utils")
    allowed = masking.sliding_window_causal_mask_function(window)
    n, hq, d = q.shape
    group = hq // k_cache.shape[1]
    out = torch.empty(n, hq, d)
    for s in segments:
        pos = torch.arange(s.start, s.stop)
        visible = allowed(torch.tensor(0), torch.tensor(0), pos[:, None], torch.arange(s.stop)[None, :])
        k = k_cache[s.row, :, :s.stop].float().cpu().repeat_interleave(group, dim=0)   # [Hq, stop, D]
        v = v_cache[s.row, :, :s.stop].float().cpu().repeat_interleave(group, dim=0)
        scores = torch.einsum("thd,hsd->hts", q[s.offset:s.offset + s.tokens].float().cpu(), k) / math.sqrt(d)
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[s.offset:s.offset + s.tokens] = torch.einsum("hts,hsd->thd", p, v)
    return out.reshape(n, hq * d)


# A chunk holding a prompt's continuation (start > 0: its first keys are in the cache from an
# earlier chunk), a whole short prompt, and the start of a third.
SEGMENTS = [Segment(0, 21, 45, 0), Segment(1, 0, 9, 24), Segment(2, 0, 30, 33)]


def _chunk(device, dtype=torch.float32, hq=4, hkv=2, d=16, max_seq=48):
    n = sum(s.tokens for s in SEGMENTS)
    q = torch.randn(n, hq, d, device=device).to(dtype)
    k_cache = torch.randn(3, hkv, max_seq, d, device=device).to(dtype)
    v_cache = torch.randn(3, hkv, max_seq, d, device=device).to(dtype)
    return q, k_cache, v_cache


@pytest.mark.parametrize("window", [1, 4, 16, 100])
def test_exact_prefill_attention_under_a_window_matches_transformers_mask(window, device):
    q, k_cache, v_cache = _chunk(device)
    out = prefill.attention(q, k_cache, v_cache, SEGMENTS, "exact", window=window)
    assert_close(out, _reference(q, k_cache, v_cache, SEGMENTS, window), torch.float32)


@pytest.mark.parametrize("window", [1, 4, 16, 100])
def test_windowed_sdpa_segment_matches_transformers_mask(window):
    """The fast path's windowed SDPA call (its mask and key slice), run by PyTorch on the CPU."""
    q, k_cache, v_cache = _chunk(torch.device("cpu"))
    out = torch.cat([prefill._windowed_sdpa(q[s.offset:s.offset + s.tokens], k_cache, v_cache, s, window)
                     for s in SEGMENTS])
    assert_close(out.reshape(q.shape[0], -1), _reference(q, k_cache, v_cache, SEGMENTS, window), torch.float32)


def test_window_mask_is_transformers_rule():
    masking = pytest.importorskip("transformers.masking_utils")
    allowed = masking.sliding_window_causal_mask_function(5)
    got = prefill.window_mask(7, 12, 3, 5, torch.device("cpu"))
    want = allowed(torch.tensor(0), torch.tensor(0), torch.arange(7, 12)[:, None], torch.arange(3, 12)[None, :])
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [4, 16, 100])
def test_fast_prefill_attention_under_a_window_on_the_gpu(window, device):
    """SDPA with the window's mask (bf16 cache) against the float32 masked softmax."""
    q, k_cache, v_cache = _chunk(device, torch.bfloat16, hq=8, hkv=2, d=64)
    out = prefill.attention(q, k_cache, v_cache, SEGMENTS, "fast", window=window)
    assert_close(out, _reference(q, k_cache, v_cache, SEGMENTS, window), torch.bfloat16)


def test_piece_shapes_cover_each_graph_of_a_prompt_of_up_to_two_pieces():
    """One piece for each (start, padded length) key that prompts cut into pieces of at most
    ``chunk`` tokens replay: every length a piece pads to, at the first two starts, within the
    cache and the prefill chunk, no more than the graph cache holds."""
    step = prefill.GRAPH_TOKEN_STEP
    assert prefill.piece_shapes(2 * step, 1024, 4096) == [(0, step), (0, 2 * step), (2 * step, step),
                                                          (2 * step, 2 * step)]
    # A chunk off the step: its last length pads up to the next step.
    shapes = prefill.piece_shapes(200, 1024, 4096)
    assert [(s, prefill.graph_tokens(n, 4096)) for s, n in shapes] == [(0, 128), (0, 256), (200, 128), (200, 256)]
    # Long chunks fill the cache with first pieces; a short cache leaves the second piece less room.
    assert prefill.piece_shapes(4 * step, 1024, 4096) == [(0, step), (0, 2 * step), (0, 3 * step), (0, 4 * step)]
    assert prefill.piece_shapes(256, 300, 4096) == [(0, 128), (0, 256), (256, 44)]
    assert prefill.piece_shapes(256, 256, 4096) == [(0, 128), (0, 256)]
    # Every piece a prompt of up to two pieces is cut into pads to a shape listed, also where
    # the cache or the prefill chunk is not a multiple of the step.
    for chunk, max_seq, chunk_tokens in ((200, 1024, 4096), (256, 300, 4096), (200, 1024, 200), (100, 1024, 4096)):
        limit = lambda start: min(max_seq - start, chunk_tokens)  # noqa: E731 (as Prefiller.chunk cuts it)
        keys = {(s, prefill.graph_tokens(n, limit(s))) for s, n in prefill.piece_shapes(chunk, max_seq, chunk_tokens)}
        for length in range(1, min(2 * chunk, max_seq) + 1):
            for start in range(0, length, chunk):
                n = min(chunk, length - start)
                assert (start, prefill.graph_tokens(n, limit(start))) in keys, (chunk, max_seq, length, start)
