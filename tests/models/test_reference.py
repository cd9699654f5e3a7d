"""The torch reference on its own: cache, padding and argument checks (no transformers needed)."""

import pytest
import torch

from mk.models import KVCache, LlamaConfig, ReferenceLlama, random_weights
from mk.models.reference import greedy_generate, pad_prompts, prefill_logits
from tests.conftest import rel_err

CONFIG = LlamaConfig.tiny(vocab_size=997, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32)


@pytest.fixture
def model(_seed):
    return ReferenceLlama(CONFIG, random_weights(CONFIG, seed=_seed))


def test_cache_layout():
    cache = KVCache(CONFIG, max_batch=3, max_seq_len=17)
    assert cache.k.shape == cache.v.shape == (2, 3, 2, 17, 32)
    k0, _ = cache.layer(0)
    assert k0.shape == (3, 2, 17, 32) and k0.data_ptr() == cache.k.data_ptr()
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache(CONFIG, 1, 0)


def test_incremental_equals_full(model):
    # Prefill in pieces and one token at a time: the same logits as one pass over the sequence.
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 12))
    full = model.forward(tokens, 0, model.new_cache(2, 12))
    cache = model.new_cache(2, 12)
    parts = [model.forward(tokens[:, :5], 0, cache), model.forward(tokens[:, 5:9], 5, cache)]
    parts += [model.forward(tokens[:, t:t + 1], torch.tensor([t, t]), cache) for t in range(9, 12)]
    assert rel_err(torch.cat(parts, dim=1), full) < 1e-5


def test_padding_changes_nothing(model):
    prompts = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 600, 996, 0, 12, 11]]
    logits, lengths = prefill_logits(model, prompts)
    assert lengths.tolist() == [5, 1, 8] and logits.shape == (3, 8, CONFIG.vocab_size)
    # Other pad values and each sequence alone give the same numbers; padded positions are zeros.
    tokens, _ = pad_prompts(prompts, pad_id=CONFIG.vocab_size - 1)
    other = model.forward(tokens, 0, model.new_cache(3, 8), lengths)
    for b, p in enumerate(prompts):
        alone = model.forward(torch.tensor([p]), 0, model.new_cache(1, len(p)))[0]
        assert rel_err(logits[b, :len(p)], alone) < 1e-5
        assert torch.equal(logits[b, :len(p)], other[b, :len(p)])
        assert not logits[b, len(p):].any()


def test_greedy_decoding_refuses_logits_that_are_not_finite(_seed):
    # Nothing to compare a token stream against: never a stream of argmaxes of NaN.
    w = random_weights(CONFIG, seed=_seed)
    w["model.layers.1.mlp.down_proj.weight"][5, 9] = float("nan")
    with pytest.raises(FloatingPointError, match="logits for new token 0 hold NaN or Inf"):
        greedy_generate(ReferenceLlama(CONFIG, w), [[1, 2, 3]], 2)


def test_padding_not_written_to_cache(model):
    cache = model.new_cache(2, 6)
    tokens, lengths = pad_prompts([[1, 2, 3], [4]])
    model.forward(tokens, 0, cache, lengths)
    assert cache.k[:, 0, :, 3:].abs().sum() == 0 and cache.k[:, 1, :, 1:].abs().sum() == 0
    assert cache.v[:, 1, :, 0].abs().sum() > 0


def test_greedy_batch_equals_single(model):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [42], [100, 200, 300]]
    batch = greedy_generate(model, prompts, 10)
    assert [len(t) for t in batch] == [10, 10, 10]
    assert batch == [greedy_generate(model, [p], 10)[0] for p in prompts]
    assert greedy_generate(model, prompts, 0) == [[], [], []]


def test_low_precision_weights_and_cache(_seed):
    # bf16 weights are upcast; the float32 math stays close to the float32 model's.
    w = random_weights(CONFIG, seed=_seed)
    ref = ReferenceLlama(CONFIG, w)
    low = ReferenceLlama(CONFIG, {k: v.bfloat16() for k, v in w.items()})
    tokens = torch.randint(0, CONFIG.vocab_size, (1, 9))
    out = low.forward(tokens, 0, low.new_cache(1, 9, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    assert rel_err(out, ref.forward(tokens, 0, ref.new_cache(1, 9))) < 3e-2


def test_argument_checks(model):
    cache = model.new_cache(2, 8)
    with pytest.raises(ValueError, match="max_batch"):
        model.forward(torch.zeros(3, 1, dtype=torch.long), 0, cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.forward(torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 5]), cache)
    with pytest.raises(ValueError, match="token ids"):
        model.forward(torch.full((1, 2), CONFIG.vocab_size), 0, cache)
    with pytest.raises(ValueError, match="lengths"):
        model.forward(torch.zeros(2, 2, dtype=torch.long), 0, cache, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="weights lack"):
        ReferenceLlama(CONFIG, {})
    with pytest.raises(ValueError, match="non-empty"):
        pad_prompts([[1], []])
