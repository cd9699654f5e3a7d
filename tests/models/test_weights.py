import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mk.models import LlamaConfig, load_weights, random_weights, save_weights
from mk.models.weights import INDEX_FILE, SINGLE_FILE, expected_shapes

CONFIG = LlamaConfig.tiny(vocab_size=101, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16)
TIED = LlamaConfig.tiny(vocab_size=101, hidden_size=64, intermediate_size=96, head_dim=16, tie_word_embeddings=True)


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_expected_shapes():
    shapes = expected_shapes(CONFIG)
    assert len(shapes) == 1 + 9 * CONFIG.num_hidden_layers + 2
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (64, 64)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 64)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 96)
    assert shapes["lm_head.weight"] == (101, 64)
    assert "lm_head.weight" not in expected_shapes(TIED)


def test_random_weights_deterministic():
    a, b = random_weights(CONFIG, seed=3), random_weights(CONFIG, seed=3)
    _same(a, b)
    c = random_weights(CONFIG, seed=4)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    norm = a["model.layers.0.input_layernorm.weight"]
    assert (norm - 1).abs().max() > 0.01 and (norm - 1).abs().mean() < 0.3   # near 1, not all ones
    assert 0.015 < a["model.layers.0.mlp.up_proj.weight"].std() < 0.025
    bf = random_weights(CONFIG, seed=3, dtype=torch.bfloat16)
    assert bf["model.norm.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("shard_bytes", [None, 20_000], ids=["single", "sharded"])
def test_save_load_round_trip(tmp_path, config, shard_bytes):
    w = random_weights(config, seed=1)
    paths = save_weights(w, config, tmp_path, shard_bytes=shard_bytes)
    assert (tmp_path / "config.json").is_file()
    if shard_bytes is None:
        assert [p.split("/")[-1] for p in paths] == [SINGLE_FILE]
    else:
        assert len(paths) > 2 and (tmp_path / INDEX_FILE).is_file() and not (tmp_path / SINGLE_FILE).exists()
    assert LlamaConfig.from_pretrained(tmp_path) == config
    loaded = load_weights(tmp_path, config, progress=False)
    _same(loaded, w)
    assert ("lm_head.weight" in loaded) == (not config.tie_word_embeddings)
    half = load_weights(tmp_path, config, dtype=torch.bfloat16, progress=False)
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def test_extra_tensors_ignored(tmp_path):
    # A tied checkpoint that stores lm_head anyway, and an old rotary buffer: both skipped.
    w = random_weights(TIED, seed=2)
    extra = {**w, "lm_head.weight": w["model.embed_tokens.weight"].clone(),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    TIED.save_pretrained(tmp_path)
    save_file(extra, str(tmp_path / SINGLE_FILE))
    _same(load_weights(tmp_path, TIED, progress=False), w)


# --------------------------------------------------------------------------- errors


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_weights(tmp_path / "nope", CONFIG)


def test_no_weight_file(tmp_path):
    CONFIG.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"no weights in .*{SINGLE_FILE}"):
        load_weights(tmp_path, CONFIG)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="pytorch_model.bin.*safetensors only"):
        load_weights(tmp_path, CONFIG)


def test_missing_shard(tmp_path):
    paths = save_weights(random_weights(CONFIG), CONFIG, tmp_path, shard_bytes=20_000)
    gone = paths[1].split("/")[-1]
    (tmp_path / gone).unlink()
    with pytest.raises(ValueError, match=f"names shard '{gone}', which is missing"):
        load_weights(tmp_path, CONFIG)


def test_bad_index(tmp_path):
    save_weights(random_weights(CONFIG), CONFIG, tmp_path, shard_bytes=20_000)
    (tmp_path / INDEX_FILE).write_text("{")
    with pytest.raises(ValueError, match=INDEX_FILE.replace(".", r"\.")):
        load_weights(tmp_path, CONFIG)


def test_index_points_to_wrong_shard(tmp_path):
    paths = save_weights(random_weights(CONFIG), CONFIG, tmp_path, shard_bytes=20_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    other = next(p.split("/")[-1] for p in paths if p.split("/")[-1] != index["weight_map"]["model.norm.weight"])
    index["weight_map"]["model.norm.weight"] = other
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"'model.norm.weight' is in '{other}'"):
        load_weights(tmp_path, CONFIG)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_truncated_file(tmp_path, sharded):
    paths = save_weights(random_weights(CONFIG), CONFIG, tmp_path, shard_bytes=20_000 if sharded else None)
    victim = paths[-1]
    data = Path(victim).read_bytes()
    Path(victim).write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated or corrupt") as e:
        load_weights(tmp_path, CONFIG)
    assert victim in str(e.value)


def test_garbage_file(tmp_path):
    CONFIG.save_pretrained(tmp_path)
    (tmp_path / SINGLE_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match=f"{SINGLE_FILE}: not a readable safetensors file"):
        load_weights(tmp_path, CONFIG)


def test_missing_tensor(tmp_path):
    paths = save_weights(random_weights(CONFIG), CONFIG, tmp_path)
    tensors = load_file(paths[0])
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, paths[0])
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(tmp_path, CONFIG)


def test_untied_config_needs_lm_head(tmp_path):
    save_weights(random_weights(TIED), TIED, tmp_path)
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_weights(tmp_path, CONFIG)


def test_wrong_shape(tmp_path):
    paths = save_weights(random_weights(CONFIG), CONFIG, tmp_path)
    tensors = load_file(paths[0])
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, paths[0])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(64, 64\), "
                                         r"expected \(32, 64\)") as e:
        load_weights(tmp_path, CONFIG)
    assert SINGLE_FILE in str(e.value)
    # The same folder read with a config of another size: every mismatch is caught from the headers.
    with pytest.raises(ValueError, match="embed_tokens.weight' has shape"):
        load_weights(tmp_path, LlamaConfig.tiny(vocab_size=102, hidden_size=64, intermediate_size=96, head_dim=16))


def test_integer_tensor_rejected(tmp_path):
    paths = save_weights(random_weights(CONFIG), CONFIG, tmp_path)
    tensors = load_file(paths[0])
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(tensors, paths[0])
    with pytest.raises(ValueError, match="'model.norm.weight' has dtype I8"):
        load_weights(tmp_path, CONFIG)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, value):
    w = random_weights(CONFIG, seed=5)
    w["model.layers.1.self_attn.o_proj.weight"][3, 7] = value
    save_weights(w, CONFIG, tmp_path)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.o_proj\.weight' holds 1 NaN or Inf"):
        load_weights(tmp_path, CONFIG, progress=False)


def test_values_that_overflow_the_dtype_they_load_in_are_refused(tmp_path):
    w = random_weights(CONFIG, seed=5)
    w["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e5   # finite in float32 and bf16, beyond float16's 65504
    save_weights(w, CONFIG, tmp_path)
    assert load_weights(tmp_path, CONFIG, progress=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' holds 1 NaN or Inf value\(s\) "
                                         r"\(in float16\)"):
        load_weights(tmp_path, CONFIG, progress=False, dtype=torch.float16)


def test_tensors_the_model_would_not_use_are_refused_naming_them(tmp_path):
    # A Llama config over a checkpoint with q/k/v biases (a Qwen2's, or a mislabelled one):
    # dropping them would compute another model than the checkpoint's.
    paths = save_weights(random_weights(CONFIG), CONFIG, tmp_path)
    tensors = load_file(paths[0])
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    tensors["model.layers.1.mlp.gate_proj.bias"] = torch.zeros(96)
    save_file(tensors, paths[0])
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.self_attn\.q_proj\.bias, "
                                         r"model\.layers\.1\.mlp\.gate_proj\.bias"):
        load_weights(tmp_path, CONFIG)


@pytest.mark.parametrize("victim", ["config.json", SINGLE_FILE, INDEX_FILE])
def test_what_the_os_says_is_reported(tmp_path, monkeypatch, victim):
    """A file this process may not read is reported as such, not as missing or corrupt.
    (Permission bits do not stop root, who runs CI: the OS's refusal is simulated.)"""
    import builtins

    from mk.models import AutoConfig

    save_weights(random_weights(CONFIG), CONFIG, tmp_path, shard_bytes=20_000 if victim == INDEX_FILE else None)
    denied = str(tmp_path / victim)
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if str(file) == denied:
            raise PermissionError(13, "Permission denied", denied)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    with pytest.raises(ValueError, match=f"{victim}: cannot read it: Permission denied"):
        AutoConfig.from_pretrained(tmp_path) if victim == "config.json" else load_weights(tmp_path, CONFIG)


def test_an_unlistable_folder_is_reported_as_the_os_says(tmp_path, monkeypatch):
    import os

    from mk.models import AutoConfig

    CONFIG.save_pretrained(tmp_path)
    real = os.listdir

    def listdir(path="."):
        if str(path) == str(tmp_path):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    for read in (lambda: AutoConfig.from_pretrained(tmp_path), lambda: load_weights(tmp_path, CONFIG)):
        with pytest.raises(ValueError, match="cannot read it: Permission denied"):
            read()


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/x.safetensors", "sub/x.safetensors", ".."])
def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, shard):
    save_weights(random_weights(CONFIG), CONFIG, tmp_path, shard_bytes=20_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = shard
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor {name!r} is in {shard!r}, which is not a file name of the "
                                         f"checkpoint folder"):
        load_weights(tmp_path, CONFIG, progress=False)


@pytest.mark.parametrize("victim", [SINGLE_FILE, INDEX_FILE])
def test_a_fifo_for_a_weight_file_is_refused_not_waited_on(tmp_path, victim):
    """open() of a FIFO blocks until a writer comes: the loader looks before it opens."""
    save_weights(random_weights(CONFIG), CONFIG, tmp_path)
    (tmp_path / SINGLE_FILE).unlink()
    os.mkfifo(tmp_path / victim)
    with pytest.raises(ValueError, match=f"{victim}: is a FIFO, not a regular file"):
        load_weights(tmp_path, CONFIG, progress=False)
