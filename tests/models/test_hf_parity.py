"""The torch reference against Hugging Face ``LlamaForCausalLM`` holding the same weights.

Both directions: our random weights saved with :func:`save_weights` and read by
``from_pretrained``, and a transformers model's ``save_pretrained`` folder read by our
loader. CPU float32: logits within 1e-4 (relative L2), 32 greedy tokens identical.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mk.models import LlamaConfig, ReferenceLlama, load_weights, random_weights, save_weights  # noqa: E402
from mk.models.reference import greedy_generate, prefill_logits  # noqa: E402
from mk.tasks.rope import rope_inv_freq  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

TOL = 1e-4
NEW_TOKENS = 32


def _llama3(original: int = 64) -> dict:
    # A short original context so every band of the llama3 rule holds some frequencies.
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original}


CONFIGS = {
    # tied, query/KV ratio 1, head_dim 64, plain RoPE
    "tied-mha-d64": LlamaConfig.tiny(vocab_size=1001, num_key_value_heads=4, tie_word_embeddings=True),
    # untied, ratio 4, head_dim 64 (!= hidden / heads), llama3 scaling, odd vocabulary
    "gqa4-d64-llama3": LlamaConfig.tiny(vocab_size=997, hidden_size=128, intermediate_size=352,
                                        num_attention_heads=8, num_key_value_heads=2,
                                        rope_theta=500000.0, rope_scaling=_llama3()),
    # tied, ratio 8, head_dim 128, llama3 scaling, one layer
    "tied-gqa8-d128-llama3": LlamaConfig.tiny(vocab_size=1001, num_hidden_layers=1, num_attention_heads=8,
                                              num_key_value_heads=1, head_dim=128, rope_scaling=_llama3(),
                                              tie_word_embeddings=True),
    # untied, ratio 2, head_dim 128
    "gqa2-d128": LlamaConfig.tiny(vocab_size=999, hidden_size=192, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=128, rms_norm_eps=1e-5),
}


def _hf_from(folder):
    return transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from full recomputation (no HF cache): independent of any cache logic."""
    ids, out = torch.tensor([prompt]), []
    for _ in range(n):
        nxt = int(hf(ids, use_cache=False).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@torch.no_grad()
def _hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt]), use_cache=False).logits[0].float()


def _decode_logits(ours: ReferenceLlama, seq: list[int], n_prompt: int) -> torch.Tensor:
    """Logits of every position of ``seq``: prefill ``n_prompt`` tokens, then one token per step."""
    cache = ours.new_cache(1, len(seq))
    parts = [ours.forward(torch.tensor([seq[:n_prompt]]), 0, cache)]
    parts += [ours.forward(torch.tensor([[seq[t]]]), t, cache) for t in range(n_prompt, len(seq))]
    return torch.cat(parts, dim=1)[0]


def _check_against_hf(ours: ReferenceLlama, hf, prompt: list[int]) -> None:
    logits, _ = prefill_logits(ours, [prompt])
    err = rel_err(logits[0], _hf_logits(hf, prompt))
    assert err <= TOL, f"prefill logits: relative error {err:.2e} > {TOL:.0e}"
    generated = greedy_generate(ours, [prompt], NEW_TOKENS)[0]
    assert generated == _hf_greedy(hf, prompt, NEW_TOKENS)
    # Random tiny models often repeat one token, so also compare every decode step's logits
    # (our KV cache, one token at a time) with HF's full recomputation of the same sequence.
    seq = prompt + generated
    err = rel_err(_decode_logits(ours, seq, len(prompt)), _hf_logits(hf, seq))
    assert err <= TOL, f"decode logits: relative error {err:.2e} > {TOL:.0e}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_our_checkpoint_in_transformers(tmp_path, _seed, name):
    config = CONFIGS[name]
    weights = random_weights(config, seed=_seed)
    save_weights(weights, config, tmp_path)
    hf = _hf_from(tmp_path)
    assert hf.config.tie_word_embeddings == config.tie_word_embeddings
    prompt = torch.randint(0, config.vocab_size, (11,)).tolist()
    _check_against_hf(ReferenceLlama(config, weights), hf, prompt)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_checkpoint_in_mk(tmp_path, tied):
    # A model transformers built and initialized itself, saved sharded, then read by our loader.
    config = LlamaConfig.tiny(vocab_size=1001, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, rope_scaling=_llama3(), tie_word_embeddings=tied)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict())).eval()
    with torch.no_grad():   # HF initializes norms to ones: perturb them so a misapplied norm shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()

    loaded_config = LlamaConfig.from_pretrained(tmp_path)
    assert loaded_config == config
    ours = ReferenceLlama(loaded_config, load_weights(tmp_path, loaded_config, progress=False))
    _check_against_hf(ours, hf, torch.randint(0, config.vocab_size, (9,)).tolist())
    assert ReferenceLlama.from_pretrained(tmp_path).config == config


def test_ragged_batch_matches_each_sequence_alone(tmp_path, _seed):
    config = CONFIGS["gqa4-d64-llama3"]
    weights = random_weights(config, seed=_seed)
    save_weights(weights, config, tmp_path)
    hf, ours = _hf_from(tmp_path), ReferenceLlama(config, weights)
    prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (5, 13, 1)]
    logits, lengths = prefill_logits(ours, prompts)
    for b, p in enumerate(prompts):
        err = rel_err(logits[b, :lengths[b]], _hf_logits(hf, p))
        assert err <= TOL, f"sequence {b}: relative error {err:.2e}"
    generated = greedy_generate(ours, prompts, NEW_TOKENS)
    assert generated == [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (64, 10000.0, None),
    (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}),   # Llama 3.1
    (64, 500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}),   # Llama 3.2
])
def test_inv_freq_matches_transformers(head_dim, theta, scaling):
    config = LlamaConfig.tiny(vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim, rope_theta=theta,
                              rope_scaling=scaling, max_position_embeddings=131072)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict()))
    theirs = hf.model.rotary_emb.inv_freq.float()
    ours = rope_inv_freq(head_dim, theta, config.rope_scaling_dict)
    # HF computes in float32, mk in float64 rounded once: about one float32 ulp apart.
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_config_through_transformers():
    # Our classic-form dict is what transformers reads; what it writes (5.x: rope_parameters) reads back.
    config = CONFIGS["gqa4-d64-llama3"]
    hf_config = transformers.LlamaConfig(**config.to_hf_dict())
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(hf_config, field) == getattr(config, field), field
    assert LlamaConfig.from_dict(hf_config.to_dict()) == config
