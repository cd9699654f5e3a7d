import json

import pytest

from mk.models import LlamaConfig
from mk.models.blocks import ModelShape

LLAMA3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# config.json of Llama-3.2-1B as the Hub ships it (classic rope form).
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {"rope_type": "llama3", **LLAMA3},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def _v5_form(d: dict) -> dict:
    """The same config as transformers 5 writes it: theta and scaling in rope_parameters."""
    rest = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    return {**rest, "rope_parameters": {**d["rope_scaling"], "rope_theta": d["rope_theta"]}}


def _write(folder, d) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d) if isinstance(d, dict) else d)


def test_hub_config_parses():
    c = LlamaConfig.from_dict(LLAMA_32_1B)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (2048, 16, 32, 8, 64)
    assert c.tie_word_embeddings and c.rope_theta == 500000.0 and c.rms_norm_eps == 1e-5
    assert c.rope_type == "llama3" and c.rope_scaling_dict == {"rope_type": "llama3", **LLAMA3}
    assert c.num_kv_groups == 4 and c.eos_token_ids == (128001,)
    # The planner's shape of the same config.json agrees.
    assert c.to_model_shape("llama-3.2-1b") == ModelShape.preset("llama-3.2-1b")
    assert c.to_model_shape("llama-3.2-1b") == ModelShape.preset("llama-3.2-1b")


def test_rope_forms_agree():
    classic = LlamaConfig.from_dict(LLAMA_32_1B)
    old_key = {**LLAMA_32_1B, "rope_scaling": {"type": "llama3", **LLAMA3}}
    assert LlamaConfig.from_dict(old_key) == classic
    v5 = LlamaConfig.from_dict(_v5_form(LLAMA_32_1B))
    assert v5 == classic and hash(v5) == hash(classic)
    # Plain RoPE: rope_scaling null, {"rope_type": "default"}, or v5's default rope_parameters.
    plain = {k: v for k, v in LLAMA_32_1B.items() if k != "rope_scaling"}
    a = LlamaConfig.from_dict({**plain, "rope_scaling": None})
    b = LlamaConfig.from_dict({**plain, "rope_scaling": {"rope_type": "default"}})
    c = LlamaConfig.from_dict({**{k: v for k, v in plain.items() if k != "rope_theta"},
                               "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert a == b == c and a.rope_scaling is None and c.rope_theta == 500000.0


def test_defaults():
    c = LlamaConfig.from_dict({"vocab_size": 10, "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 1, "num_attention_heads": 4})
    assert c.num_key_value_heads == 4 and c.head_dim == 16 and c.rope_theta == 10000.0
    assert c.rope_scaling is None and not c.tie_word_embeddings


def test_round_trips(tmp_path):
    c = LlamaConfig.tiny(rope_scaling={"rope_type": "llama3", **LLAMA3}, eos_token_id=[5, 7], tie_word_embeddings=True)
    assert isinstance(c.rope_scaling, tuple) and c.eos_token_id == (5, 7) and c.eos_token_ids == (5, 7)
    hash(c)
    assert LlamaConfig.from_dict(c.to_dict()) == c
    assert LlamaConfig.from_dict(c.to_hf_dict()) == c
    assert LlamaConfig.from_json(c.to_json()) == c
    c.save_pretrained(tmp_path)
    assert LlamaConfig.from_pretrained(tmp_path) == c
    assert json.loads((tmp_path / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    assert LlamaConfig.from_dict({**c.to_dict(), "eos_token_id": None}).eos_token_ids == ()


def test_tiny_overrides():
    c = LlamaConfig.tiny(vocab_size=997, num_key_value_heads=1)
    assert c.vocab_size == 997 and c.num_kv_groups == 4 and c.head_dim == 64


# --------------------------------------------------------------------------- errors


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LlamaConfig.from_pretrained(tmp_path / "nope")


def test_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LlamaConfig.from_pretrained(tmp_path)


def test_invalid_json(tmp_path):
    _write(tmp_path, "{not json")
    with pytest.raises(ValueError, match=r"config\.json.*invalid JSON"):
        LlamaConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("change, pattern", [
    ({"model_type": "mistral"}, "model_type is 'mistral'"),
    ({"architectures": ["MistralForCausalLM"]}, "architectures"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling: unsupported rope type 'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "unsupported rope type 'linear'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope type 'dynamic'"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
     "rope_parameters: unsupported rope type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "low_freq_factor": 5.0}}, "low_freq_factor < high_freq"),
    ({"num_key_value_heads": 5}, r"num_attention_heads \(32\) must be a multiple of num_key_value_heads \(5\)"),
    ({"hidden_size": "deleted"}, "missing required field.*hidden_size"),
    ({"vocab_size": 0}, "vocab_size must be an int >= 1"),
    ({"head_dim": 63}, "head_dim must be even"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"sliding_window": 4096}, "sliding_window is 4096; mk does not implement sliding-window attention"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"num_local_experts": 8}, "num_local_experts is 8; mk does not implement mixture-of-experts"),
    ({"use_qk_norm": True}, "use_qk_norm"),
])
def test_rejected_configs_name_file_and_field(tmp_path, change, pattern):
    d = {**LLAMA_32_1B, **change}
    if "hidden_size" in change:
        del d["hidden_size"]
    _write(tmp_path, d)
    with pytest.raises(ValueError, match=pattern) as e:
        LlamaConfig.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_unsupported_features_left_off_load(tmp_path):
    # Null, false or 0 asks for nothing: such configs load.
    _write(tmp_path, {**LLAMA_32_1B, "sliding_window": None, "num_local_experts": 0, "use_qk_norm": False})
    assert LlamaConfig.from_pretrained(tmp_path).hidden_size == LLAMA_32_1B["hidden_size"]


def test_missing_fields_all_named():
    with pytest.raises(ValueError, match="vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
                                         "num_attention_heads"):
        LlamaConfig.from_dict({"model_type": "llama"})
