"""The Python API takes what its docstrings say (lists, tensors and numpy arrays of int ids;
ints for sizes) and refuses the rest with a TypeError or ValueError naming the argument,
before any work: nothing is built, loaded or written."""

import json
import re
import warnings

import numpy as np
import pytest
import torch

from mk.models import AutoModel, Llama, LlamaConfig, Qwen3Config, random_weights, save_weights
from mk.models.blocks import MAX_BATCH
from mk.models.decoder import DEFAULT_MAX_SEQ_LEN

CONFIG = LlamaConfig.tiny(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_hidden_layers=1, max_position_embeddings=48)


@pytest.fixture(scope="module")
def model():
    return Llama.from_config(CONFIG, seed=1, max_batch_size=2, max_seq_len=24)


def test_max_seq_len_defaults_within_the_models_positions_and_may_not_exceed_them():
    assert Llama.from_config(CONFIG, max_batch_size=1).max_seq_len == min(DEFAULT_MAX_SEQ_LEN, 48) == 48
    with pytest.raises(ValueError, match=r"max_seq_len must be in \[1, 48\] \(the model's max_position_embeddings\), "
                                         r"got 49"):
        Llama.from_config(CONFIG, max_seq_len=49)
    with pytest.raises(TypeError, match="max_seq_len must be an int, got float"):
        Llama.from_config(CONFIG, max_seq_len=24.0)
    with pytest.raises(ValueError, match=f"max_batch_size must be in \\[1, {MAX_BATCH}\\]"):
        Llama.from_config(CONFIG, max_batch_size=MAX_BATCH + 1)
    with pytest.raises(TypeError, match="max_batch_size must be an int, got bool"):
        Llama.from_config(CONFIG, max_batch_size=True)


def test_from_pretrained_checks_sizes_before_reading_a_weight(tmp_path, monkeypatch):
    save_weights(random_weights(CONFIG, seed=0), CONFIG, tmp_path)

    def read(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr("mk.models.decoder.load_weights", read)
    with pytest.raises(ValueError, match="max_seq_len must be in"):
        AutoModel.from_pretrained(tmp_path, max_seq_len=1000)
    with pytest.raises(TypeError, match="a checkpoint folder must be a path"):
        AutoModel.from_pretrained(None)


def test_a_model_that_cannot_fit_is_refused_before_its_weights_are_made(monkeypatch):
    big = LlamaConfig.tiny(max_position_embeddings=2**40)

    def draw(*args, **kwargs):
        raise AssertionError("weights were drawn")

    monkeypatch.setattr("mk.models.decoder.random_weights", draw)
    with pytest.raises(MemoryError, match=r"KV cache .* for max_batch_size=64 x max_seq_len=1099511627776"):
        Llama.from_config(big, max_batch_size=64, max_seq_len=2**40)


def test_a_config_that_is_no_familys_is_a_type_error():
    with pytest.raises(TypeError, match="config must be the config of a family mk runs .* got None"):
        AutoModel.from_config(None)
    with pytest.raises(TypeError, match="Llama runs a LlamaConfig, got None"):
        Llama.from_config(None)
    with pytest.raises(TypeError, match="Llama runs a LlamaConfig, got a dict"):
        Llama.from_config(CONFIG.to_dict())
    with pytest.raises(TypeError, match="Llama runs a LlamaConfig, got a Qwen3Config"):
        Llama.from_config(Qwen3Config.tiny())
    with pytest.raises(TypeError, match="seed must be an int"):
        Llama.from_config(CONFIG, seed="1")


BAD_IDS = [
    ("a string", "hello", TypeError, "input_ids must be a list of token ids"),
    ("string ids", [["a", "b"]], TypeError, "prompt 0 holds str 'a' at position 0"),
    ("float ids", [[1.0, 2.0]], TypeError, "prompt 0 holds float 1.0 at position 0"),
    ("bool ids", [True, 5], TypeError, "prompt 0 holds bool True at position 0"),
    ("None", None, TypeError, "got NoneType"),
    ("mixed", [1, [2, 3]], TypeError, "mixes token ids and lists"),
    ("float tensor", torch.ones(1, 3), TypeError, "integer dtype, got torch.float32"),
    ("bool tensor", torch.ones(1, 3, dtype=torch.bool), TypeError, "integer dtype, got torch.bool"),
    ("float array", np.ones((1, 3)), TypeError, "integer dtype, got float64"),
    ("3-d tensor", torch.ones(1, 1, 3, dtype=torch.long), ValueError, r"\[B, T\] or \[T\], got shape \(1, 1, 3\)"),
    ("an id outside", np.array([[1, 97]]), ValueError, r"token id outside \[0, 97\)"),
    ("empty", [], ValueError, "at least one token"),
]


@pytest.mark.parametrize("ids,error,message", [c[1:] for c in BAD_IDS], ids=[c[0] for c in BAD_IDS])
def test_bad_token_ids_are_named_and_change_nothing(model, ids, error, message):
    before = model.k_cache.clone()
    for call in (lambda: model.generate(ids, max_new_tokens=2), lambda: model.logits(ids),
                 lambda: list(model.stream(ids, 2))):
        with pytest.raises(error, match=message):
            call()
    assert torch.equal(model.k_cache, before)


def test_numpy_prompts_are_read_as_their_ids(model):
    ids = [[5, 9, 11], [7, 3, 2]]
    want = model.logits(ids)
    for same in (np.array(ids), np.array(ids, dtype=np.int32), [np.array(r) for r in ids],
                 [[np.int64(t) for t in r] for r in ids], torch.tensor(ids, dtype=torch.int16)):
        assert torch.equal(model.logits(same), want)
    assert model.generate(np.array(ids[0]), max_new_tokens=0) == [ids[0]]


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(eos_token_id="x"), TypeError, "eos_token_id must be an int, a list of ints or None, got 'x'"),
    (dict(eos_token_id=[1, 2.5]), TypeError, "eos_token_id must be an int"),
    (dict(eos_token_id=True), TypeError, "eos_token_id must be an int"),
    (dict(seed=-1), ValueError, r"seed must be in \[0, 2\*\*63\)"),
    (dict(seed=2**63), ValueError, r"seed must be in \[0, 2\*\*63\)"),
    (dict(seed="7"), TypeError, "seed must be an int"),
    (dict(max_new_tokens=2.0), ValueError, "max_new_tokens must be an int"),
    (dict(top_k=1.5, temperature=1.0), TypeError, "top_k must be an int"),
])
def test_bad_generation_arguments_are_named_and_change_nothing(model, kwargs, error, message):
    before = model.k_cache.clone()
    with pytest.raises(error, match=message):
        model.generate([[1, 2]], **{"max_new_tokens": 2, **kwargs})
    assert torch.equal(model.k_cache, before)


def test_plan_checks_its_arguments_and_reads_as_an_explanation(model):
    for batch in (0, 3, "1", True):
        with pytest.raises(ValueError, match=r"batch must be an int in \[1, max_batch_size=2\]"):
            model.plan(batch)
    with pytest.raises(ValueError, match="kv_len must be an int"):
        model.plan(1, 25)
    result = model.plan(1, 16)
    plan, graph = result                       # unpacks as before
    assert result.plan is plan and result.graph is graph and graph.batch == 1
    shown = repr(result)
    assert shown == str(result) and shown.startswith("plan for ") and "l0.qkv" in shown
    assert shown == repr(model.plan(1, 16))   # the same from the plan cache
    assert len(repr(plan)) < 300 and "explain()" in repr(plan)   # not every op's choice, in full


def test_a_config_naming_no_family_is_read_as_llama_and_said(tmp_path):
    d = {k: v for k, v in json.loads(CONFIG.to_json()).items() if k not in ("model_type", "architectures")}
    (tmp_path / "config.json").write_text(json.dumps(d))
    from mk.models import AutoConfig

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert AutoConfig.from_pretrained(tmp_path) == CONFIG
    assert [str(w.message) for w in said if "names no model_type" in str(w.message)], [str(w.message) for w in said]


def test_a_device_torch_does_not_know_is_named():
    with pytest.raises(ValueError, match="device 'foo' is not a device"):
        Llama.from_config(CONFIG, device="foo")


# ------------------------------------------------------------------ issue 52: the rest

STREAM_ERRORS = [
    (dict(input_ids="hello"), TypeError, "input_ids must be a list of token ids"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an int >= 0, got -1"),
    (dict(read_every=0), ValueError, "read_every must be an int >= 1, got 0"),
    (dict(temperature=-1.0), ValueError, "temperature must be a finite number >= 0"),
    (dict(top_p=2.0, temperature=1.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(max_new_tokens=30), ValueError, r"prompt 0: 2 tokens \+ 30 new exceed max_seq_len=24"),
]


@pytest.mark.parametrize("kwargs,error,message", [c for c in STREAM_ERRORS], ids=[m[:24] for _, _, m in STREAM_ERRORS])
def test_stream_refuses_bad_arguments_at_the_call_not_at_the_first_token(model, kwargs, error, message):
    before = model.k_cache.clone()
    with pytest.raises(error, match=message):
        model.stream(**{"input_ids": [[1, 2]], "max_new_tokens": 2, **kwargs})   # no next(): the call itself
    assert torch.equal(model.k_cache, before)


def _greedy(model, prompts, n):
    from mk.models import ReferenceLlama, greedy_generate

    return greedy_generate(ReferenceLlama(model.config, model.hf_weights()), prompts, n)


def test_one_stream_at_a_time_the_running_one_unharmed(model):
    """A stream owns the KV cache from its first token until it ends or is closed: another
    stream(), generate() or logits() meanwhile is refused (the first decodes on as if alone),
    and one that ended, was closed or was left by a break blocks nothing."""
    a, b = [3, 14, 15], [9, 2, 6, 5]
    want_a, want_b = _greedy(model, [a], 4)[0], _greedy(model, [b], 3)[0]
    first = model.stream([a], 4, read_every=1)
    early = model.stream([b], 3)   # made before the first started: refused at its own first token
    got = [int(next(first)[0])]
    for what, call in (("stream()", lambda: model.stream([b], 3)), ("generate()", lambda: model.generate([b], 3)),
                       ("logits()", lambda: model.logits([b]))):
        with pytest.raises(RuntimeError, match=rf"{re.escape(what)}: a stream\(\) of this model is still running .* call its "
                                                rf"close\(\) first"):
            call()
    with pytest.raises(RuntimeError, match=r"stream\(\): a stream\(\) of this model is still running"):
        next(early)
    got += [int(t[0]) for t in first]
    assert got == want_a
    assert model.generate([b], 3) == [b + want_b]          # it ended: the model is free
    closed = model.stream([a], 4)
    next(closed)
    closed.close()
    assert model.generate([b], 3) == [b + want_b]          # closed
    for _ in model.stream([a], 4):
        break
    assert model.generate([b], 3) == [b + want_b]          # left by a break (the loop dropped it)


def test_a_tiny_temperature_decodes_greedily_not_into_inf(model):
    """logits / 1e-45 overflows float32 (inf, then NaN in the draw); below MIN_TEMPERATURE
    the draw is the argmax anyway, and so it is decoded greedily, whatever the seed."""
    from mk.models.decoder import MIN_TEMPERATURE

    prompts = [[3, 14, 15], [9, 2]]
    want = [p + t for p, t in zip(prompts, _greedy(model, prompts, 3))]
    # (Each way of choosing a token: in the megakernel, or the sampler after it.)
    for temperature, kw in ((1e-45, {}), (1e-40, dict(top_k=5)), (MIN_TEMPERATURE / 2, dict(top_p=0.9))):
        assert model.generate(prompts, 3, temperature=temperature, seed=7, **kw) == want, (temperature, kw)


def test_device_spec_must_be_a_device_spec(tmp_path, monkeypatch):
    from mk.planner.device import DeviceSpec

    message = r"device_spec must be a mk.planner.device.DeviceSpec or None .* got str 'h100'"
    with pytest.raises(TypeError, match=message):
        Llama.from_config(CONFIG, device_spec="h100")
    with pytest.raises(TypeError, match=message):
        Llama(CONFIG, random_weights(CONFIG), device_spec="h100", max_seq_len=24)
    save_weights(random_weights(CONFIG, seed=0), CONFIG, tmp_path)

    def read(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr("mk.models.decoder.load_weights", read)
    with pytest.raises(TypeError, match="device_spec must be a mk.planner.device.DeviceSpec or None"):
        AutoModel.from_pretrained(tmp_path, device_spec={"name": "h100"})
    spec = DeviceSpec.preset("h100")
    assert Llama.from_config(CONFIG, device_spec=spec, max_batch_size=1, max_seq_len=8).device_spec is spec


def test_plan_length_takes_a_reachable_length_only(model):
    from mk.models.decoder import PLAN_LENGTHS

    big = Llama.from_config(CONFIG, max_batch_size=1, max_seq_len=48)
    # The first of PLAN_LENGTHS at or above, at most max_seq_len (PLAN_LENGTHS[0] = 64 > 48).
    assert PLAN_LENGTHS[0] > 48 and [big.plan_length(n) for n in (1, 47, np.int64(48))] == [48, 48, 48]
    for bad, error, message in ((0, ValueError, r"tokens must be in \[1, max_seq_len=24\] .* got 0"),
                                (-3, ValueError, "got -3"), (25, ValueError, "got 25"),
                                (True, TypeError, "tokens must be an int, got bool"),
                                (4.0, TypeError, "got float"), ("4", TypeError, "got str"),
                                (None, TypeError, "got NoneType")):
        with pytest.raises(error, match=message):
            model.plan_length(bad)


def test_the_prefill_memory_check_comes_before_the_decode_step_is_built(model, monkeypatch):
    """The cheap checks (the prompts against the cache, the prefill's workspace against free
    memory) come before planning and compiling the step, at the call."""
    def build(*args, **kwargs):
        raise AssertionError("the decode step was built")

    monkeypatch.setattr(model.steps, "get", build)
    monkeypatch.setattr("mk.models.prefill.free_bytes", lambda device, need=0: 1024)   # as a full GPU
    with pytest.raises(MemoryError, match="prefill needs .* MiB of workspace"):
        model.stream([[1, 2, 3]], 2)
    with pytest.raises(MemoryError, match="prefill needs"):
        model.generate([[1, 2, 3]], 2)
