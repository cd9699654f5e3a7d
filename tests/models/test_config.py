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


# --------------------------------------------------------------------------- issue 52: refused at read


def _refused(tmp_path, d_or_text, *fragments):
    """config.json of ``d_or_text`` (a dict over Llama-3.2-1B's or raw text) is refused by
    AutoConfig, in one ValueError naming the file and ``fragments``."""
    from mk.models import AutoConfig

    if d_or_text is not None:   # (None: config.json is there already)
        _write(tmp_path, {**LLAMA_32_1B, **d_or_text} if isinstance(d_or_text, dict) else d_or_text)
    with pytest.raises(ValueError) as e:
        AutoConfig.from_pretrained(tmp_path)
    text = str(e.value)
    assert str(tmp_path / "config.json") in text and "\n" not in text, text
    for f in fragments:
        assert f in text, text
    return text


@pytest.mark.parametrize("change, field", [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),   # bool("false") is True: the lm_head was dropped
    ({"tie_word_embeddings": 0}, "tie_word_embeddings"),
    ({"attention_bias": "false"}, "attention_bias"),
    ({"mlp_bias": "no"}, "mlp_bias"),
    ({"model_type": "qwen2", "architectures": None, "use_sliding_window": "false"}, "use_sliding_window"),
])
def test_flags_must_be_json_booleans(tmp_path, change, field):
    _refused(tmp_path, change, field, repr(change[field]))


def test_real_booleans_and_null_flags_load(tmp_path):
    from mk.models import AutoConfig

    for tied in (True, False):
        _write(tmp_path, {**LLAMA_32_1B, "tie_word_embeddings": tied, "attention_bias": None, "mlp_bias": False})
        assert AutoConfig.from_pretrained(tmp_path).tie_word_embeddings is tied
    _write(tmp_path, {**LLAMA_32_1B, "model_type": "qwen2", "architectures": None, "use_sliding_window": False,
                      "sliding_window": 4096, "layer_types": ["full_attention"] * 16})
    assert AutoConfig.from_pretrained(tmp_path).MODEL_TYPE == "qwen2"
    with pytest.raises(ValueError, match="tie_word_embeddings must be a bool"):
        LlamaConfig.tiny(tie_word_embeddings="no")


@pytest.mark.parametrize("change, fragment", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers must be at most 1024, got 1000000000"),
    ({"max_position_embeddings": 2**30}, "max_position_embeddings must be at most 16777216"),
    ({"hidden_size": 10**12}, "vocab_size x hidden_size make the embedding and the LM head"),
    ({"vocab_size": 2**31 // 2048}, "fewer than 2**31"),   # 2**20 x 2048 = 2**31: one too many
    ({"intermediate_size": 2**19}, "2 x intermediate_size x hidden_size make the fused gate/up projection"),
    ({"num_attention_heads": 2**15, "num_key_value_heads": 2**15},
     "(num_attention_heads + 2 x num_key_value_heads) x head_dim x hidden_size"),
])
def test_sizes_mk_cannot_run_are_refused_at_read(tmp_path, change, fragment):
    _refused(tmp_path, change, fragment)


def test_the_largest_sizes_that_fit_int32_offsets_load():
    # Llama-3.1-405B's sizes: every matrix under 2**31 elements.
    c = LlamaConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                    num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=131072)
    assert c.num_hidden_layers == 126
    with pytest.raises(ValueError, match="embedding and the LM head a 131072 x 16384 matrix"):
        LlamaConfig(**{**c.to_dict(), "vocab_size": 131072, "eos_token_id": None})


LLAMA3_TEXT = json.dumps({**LLAMA_32_1B, "rope_scaling": {"rope_type": "llama3", **LLAMA3}})


BAD_NUMBERS = [
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number, got inf"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
    ({"rms_norm_eps": 1e-300}, "rms_norm_eps must be a finite number in (0, 1)"),
    ({"rms_norm_eps": 1.5}, "rms_norm_eps must be a finite number in (0, 1)"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number, got '1e-5'"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number, got inf"),
    ({"rope_theta": 1e-300}, "rope_theta must be a finite number >= 1, got 1e-300"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "factor": float("inf")}},
     "rope_scaling: llama3 factor must be a finite number > 0, got inf"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "high_freq_factor": float("inf")}},
     "rope_scaling: llama3 high_freq_factor must be a finite number > 0, got inf"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "factor": "eight"}},
     "rope_scaling: llama3 factor must be a finite number > 0, got 'eight'"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "factor": True}}, "llama3 factor must be a finite number"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "original_max_position_embeddings": 0.5}},
     "rope_scaling: llama3 original_max_position_embeddings must be an integer in [1, 16777216], got 0.5"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "original_max_position_embeddings": 1.5}},
     "original_max_position_embeddings must be an integer in [1, 16777216], got 1.5"),
    (LLAMA3_TEXT.replace('"original_max_position_embeddings": 8192', '"original_max_position_embeddings": 1e400'),
     "original_max_position_embeddings must be an integer in [1, 16777216], got inf"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "llama3", **LLAMA3, "rope_theta": float("inf")}},
     "rope_theta must be a finite number, got inf"),
]


@pytest.mark.parametrize("change, fragment", BAD_NUMBERS, ids=[f for _, f in BAD_NUMBERS])
def test_numbers_that_cannot_run_are_refused_at_read_naming_the_field(tmp_path, change, fragment):
    _refused(tmp_path, change, fragment)


def test_whole_float_positions_and_null_theta_load(tmp_path):
    from mk.models import AutoConfig

    _write(tmp_path, {**LLAMA_32_1B, "rope_scaling": {"rope_type": "llama3", **LLAMA3,
                                                      "original_max_position_embeddings": 8192.0}})
    assert AutoConfig.from_pretrained(tmp_path) == LlamaConfig.from_dict(LLAMA_32_1B)
    _write(tmp_path, {**LLAMA_32_1B, "rope_theta": None, "rope_scaling": None})
    assert AutoConfig.from_pretrained(tmp_path).rope_theta == 10000.0


@pytest.mark.parametrize("field, value", [
    ("eos_token_id", "eos"), ("eos_token_id", {"id": 2}), ("eos_token_id", 2.7), ("eos_token_id", True),
    ("eos_token_id", -1), ("eos_token_id", 10**30), ("eos_token_id", []), ("eos_token_id", [1, "2"]),
    ("eos_token_id", 128256), ("bos_token_id", [1]), ("bos_token_id", "<s>"), ("bos_token_id", -3),
])
def test_token_ids_must_be_ids_of_the_vocabulary(tmp_path, field, value):
    _refused(tmp_path, {field: value}, f"{field} must be an int in [0, 128256)")


def test_token_ids_that_are_ids_load_and_sets_are_refused():
    c = LlamaConfig.tiny(eos_token_id=[5, 7], bos_token_id=None)
    assert c.eos_token_ids == (5, 7) and c.bos_token_id is None
    assert LlamaConfig.tiny(eos_token_id=None).eos_token_ids == ()
    with pytest.raises(ValueError, match="eos_token_id must be"):
        LlamaConfig.tiny(eos_token_id={2})


WRONG_TYPES = [
    (json.dumps({**LLAMA_32_1B, "model_type": ["llama"]}), "model_type must be a string, got ['llama']"),
    (json.dumps({**LLAMA_32_1B, "architectures": 5}), "architectures must be a list of strings, got 5"),
    (json.dumps({**LLAMA_32_1B, "architectures": "LlamaForCausalLM"}), "architectures must be a list of strings"),
    (json.dumps({**LLAMA_32_1B, "model_type": "qwen2", "architectures": None, "layer_types": 5}),
     "layer_types must be a list of strings, got 5"),
    (json.dumps({**LLAMA_32_1B, "model_type": "qwen2", "architectures": None, "layer_types": "full_attention"}),
     "layer_types must be a list of strings"),
    ("[" * 100000 + "]" * 100000, "invalid JSON (nested too deeply to read)"),
    (json.dumps(LLAMA_32_1B).replace('"hidden_size": 2048', '"hidden_size": ' + "9" * 5000),
     "hidden_size must be an int >= 1, got <an integer of 5000 digits>"),
]


@pytest.mark.parametrize("text, fragment", WRONG_TYPES, ids=[f for _, f in WRONG_TYPES])
def test_values_of_the_wrong_type_name_the_file_and_field(tmp_path, text, fragment):
    _refused(tmp_path, text, fragment)


def test_a_long_integer_where_mk_reads_nothing_is_ignored(tmp_path):
    _write(tmp_path, json.dumps(LLAMA_32_1B)[:-1] + ', "initializer_seed": ' + "7" * 5000 + "}")
    assert LlamaConfig.from_pretrained(tmp_path) == LlamaConfig.from_dict(LLAMA_32_1B)


def test_config_json_that_is_no_regular_small_file_is_refused_unread(tmp_path):
    import os

    path = tmp_path / "config.json"
    os.mkfifo(path)   # reading it would wait for a writer for ever
    assert "is a FIFO, not a regular file" in _refused(tmp_path, None)
    path.unlink()
    path.symlink_to("/dev/zero")   # reading it would never end
    assert "is a device, not a regular file" in _refused(tmp_path, None)
    path.unlink()
    path.mkdir()
    assert "is a folder, not a regular file" in _refused(tmp_path, None)
    path.rmdir()
    with open(path, "wb") as f:   # 17 MiB, sparse: nothing written
        f.truncate(17 * 2**20)
    assert "larger than the 16 MiB mk reads of such a file" in _refused(tmp_path, None)


def test_a_config_naming_no_family_is_warned_about_once(tmp_path):
    import warnings

    from mk.models import AutoConfig

    _write(tmp_path, {k: v for k, v in LLAMA_32_1B.items() if k not in ("model_type", "architectures")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert AutoConfig.from_pretrained(tmp_path).MODEL_TYPE == "llama"
    assert [str(w.message) for w in caught if "names no model_type" in str(w.message)] == [
        f"{tmp_path / 'config.json'} names no model_type or architectures: read as a Llama (model_type 'llama'); "
        f"add model_type to config.json to say which family it is"]


def test_the_rope_op_refuses_a_theta_whose_frequencies_overflow_float32():
    from mk.tasks import rope_inv_freq

    with pytest.raises(ValueError, match="theta 1e-300 gives inverse frequencies beyond float32's range"):
        rope_inv_freq(64, 1e-300)
    assert rope_inv_freq(64, 0.5).isfinite().all()   # (an odd theta, but one that computes)
