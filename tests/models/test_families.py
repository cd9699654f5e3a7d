"""Every family mk runs against transformers' model of it holding the same weights: the
torch reference first, then mk's prefill and megakernel decode (CPU, interpreter, float32),
and AutoModel / AutoConfig picking the family from config.json."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mk.models import (AutoConfig, AutoModel, Llama, LlamaConfig, Mistral, MistralConfig, Qwen2,  # noqa: E402
                       Qwen2Config, Qwen3, Qwen3Config, ReferenceLlama, random_weights, save_weights)
from mk.models.reference import greedy_generate, prefill_logits  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

#: Small configs that exercise each family's own feature: a window shorter than the
#: prompts (Mistral), biases (Qwen2, tied embeddings), q/k norms with head_dim != hidden /
#: heads (Qwen3).
FAMILY_CONFIGS = {
    "mistral-window": MistralConfig.tiny(vocab_size=997, sliding_window=5, num_hidden_layers=2),
    "qwen2-bias-tied": Qwen2Config.tiny(vocab_size=1001, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3-qknorm": Qwen3Config.tiny(vocab_size=999, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=64),
}
PROMPT = [3, 17, 256, 9, 41, 7, 300, 12, 5, 88, 2]  # longer than the window


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family(request, tmp_path_factory):
    config = FAMILY_CONFIGS[request.param]
    weights = random_weights(config, seed=11)
    folder = tmp_path_factory.mktemp(request.param)
    save_weights(weights, config, folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return config, weights, folder, hf


@torch.no_grad()
def _hf_logits(hf, prompt):
    return hf(torch.tensor([prompt]), use_cache=False).logits[0].float()


@torch.no_grad()
def _hf_greedy(hf, prompt, n):
    ids, out = torch.tensor([prompt]), []
    for _ in range(n):
        out.append(int(hf(ids, use_cache=False).logits[0, -1].argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def test_the_reference_forward_is_the_transformers_model(family):
    config, weights, folder, hf = family
    assert type(transformers.AutoConfig.from_pretrained(folder)).__name__.lower().startswith(config.MODEL_TYPE)
    ours = ReferenceLlama(config, weights)
    logits, _ = prefill_logits(ours, [PROMPT])
    assert rel_err(logits[0], _hf_logits(hf, PROMPT)) < 1e-4
    assert greedy_generate(ours, [PROMPT], 12)[0] == _hf_greedy(hf, PROMPT, 12)


def test_prefill_and_megakernel_decode_follow_the_transformers_model(family):
    config, _, folder, hf = family
    model = AutoModel.from_pretrained(folder, device="cpu", max_batch_size=2, max_seq_len=32, progress=False)
    assert type(model).config_class is type(config) and model.config == config
    # Two prompts of different lengths packed in one prefill (each precision), then decoded together.
    prompts = [PROMPT, PROMPT[3:9]]
    for precision in ("fast", "exact"):
        model.prefill_precision = precision
        logits = model.logits(prompts)
        for b, p in enumerate(prompts):
            assert rel_err(logits[b, :len(p)], _hf_logits(hf, p)) < 1e-4, (precision, b)
    steps = 5
    out = model.generate(prompts, max_new_tokens=steps)
    for b, p in enumerate(prompts):
        assert out[b][len(p):] == _hf_greedy(hf, p, steps), b


def test_auto_picks_the_family_and_refuses_what_mk_does_not_run(tmp_path):
    for config, family in ((LlamaConfig.tiny(), Llama), (MistralConfig.tiny(sliding_window=4), Mistral),
                           (Qwen2Config.tiny(), Qwen2), (Qwen3Config.tiny(), Qwen3)):
        config.save_pretrained(tmp_path)
        assert AutoConfig.from_pretrained(tmp_path) == config
        assert type(AutoModel.from_config(config, device="cpu", max_seq_len=16)) is family
    base = json.loads(Qwen3Config.tiny().to_json())
    assert Qwen3Config.from_dict({**base, "head_dim": None}).head_dim == 128  # Qwen3's own default
    refused = {
        "use_sliding_window": ({**base, "use_sliding_window": True}, "use_sliding_window is true"),
        "layer_types": ({**base, "layer_types": ["full_attention", "sliding_attention"]}, "layers \\[1\\]"),
        "attention_bias": ({**base, "attention_bias": True}, "attention_bias is true"),
        "model_type": ({**base, "model_type": "gemma2"}, "model_type is 'gemma2'"),
        "softcapping": ({**base, "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    }
    for name, (d, match) in refused.items():
        (tmp_path / "config.json").write_text(json.dumps(d))
        with pytest.raises(ValueError, match=match):
            AutoModel.from_pretrained(tmp_path, device="cpu")
    # Qwen's inactive window (use_sliding_window false) is read and ignored, as transformers does.
    d = {**json.loads(Qwen2Config.tiny().to_json()), "sliding_window": 4096, "use_sliding_window": False}
    assert Qwen2Config.from_dict(d).window is None
    with pytest.raises(ValueError, match="sliding_window"):
        LlamaConfig.from_dict({**json.loads(LlamaConfig.tiny().to_json()), "sliding_window": 4096})
    with pytest.raises(TypeError, match="Qwen2 runs a Qwen2Config"):
        Qwen2(LlamaConfig.tiny(), {}, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_each_family_decodes_in_bf16_on_the_gpu_as_the_float32_reference(name):
    # bf16 weights, float32 cache: the fast prefill's logits within the stated 3e-2 of the
    # float32 reference on the same weights, and the megakernel's greedy tokens equal to the
    # reference's (compiled tiles: the fused QKV + RoPE with bias / q/k norm, the windowed
    # attention, SDPA with a window's mask in prefill).
    config = FAMILY_CONFIGS[name]
    weights = random_weights(config, seed=5, dtype=torch.bfloat16)
    model = AutoModel.from_config(config, seed=5, device="cuda", dtype=torch.bfloat16, kv_dtype=torch.float32,
                                  max_batch_size=2, max_seq_len=64)
    ref = ReferenceLlama(config, {k: v.float() for k, v in model.hf_weights().items()})
    assert all(torch.equal(model.hf_weights()[k].cpu(), weights[k]) for k in weights)
    prompts = [PROMPT, PROMPT[2:]]
    logits = model.logits(prompts)
    want, _ = prefill_logits(ref, prompts)
    for b, p in enumerate(prompts):
        assert rel_err(logits[b, :len(p)].cpu(), want[b, :len(p)]) < 3e-2, b
    steps = 16
    out = model.generate(prompts, max_new_tokens=steps)
    exact = AutoModel.from_config(config, seed=5, device="cuda", dtype=torch.bfloat16, kv_dtype=torch.float32,
                                  max_batch_size=2, max_seq_len=64, prefill_precision="exact")
    want_tokens = greedy_generate(ref, prompts, steps)
    assert exact.generate(prompts, max_new_tokens=steps) == [p + t for p, t in zip(prompts, want_tokens)]
    same = sum(a == b for o, p, t in zip(out, prompts, want_tokens) for a, b in zip(o[len(p):], t))
    assert same >= 0.75 * len(prompts) * steps, f"fast prefill: {same} of {len(prompts) * steps} greedy tokens agree"
