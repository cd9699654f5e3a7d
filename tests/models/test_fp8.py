"""Models whose projections are stored in FP8 (mk.tasks.linear.format): quantized as they load
(quantize="fp8", per output channel; "fp8-block", per 128 x 128 block) and decoded through the
same megakernel, against the float32 reference that dequantizes the same FP8 weights. On the
CPU the FP8 values are held in float32, so the two must agree to float32 rounding."""

import pytest
import torch

from mk.models import Llama, LlamaConfig, Qwen2Config, Qwen3Config, ReferenceLlama, random_weights, save_weights
from mk.models.auto import AutoModel
from mk.models.reference import greedy_generate, prefill_logits
from tests.conftest import HAS_CUDA

CONFIGS = {
    "llama": LlamaConfig.tiny(vocab_size=301, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, eos_token_id=None),
    "qwen2-bias-tied": Qwen2Config.tiny(vocab_size=257, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                        eos_token_id=None),
    "qwen3-qknorm": Qwen3Config.tiny(vocab_size=263, hidden_size=128, intermediate_size=384, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=128, eos_token_id=None),
}
PROMPTS = [[1, 5, 9, 200, 7], [3, 4], [250, 251, 252, 17, 8, 9]]


@pytest.mark.skipif(HAS_CUDA, reason="the CPU path: FP8 values held in float32, exact")
@pytest.mark.parametrize("name,quantize,lm_head", [("llama", "fp8", False), ("llama", "fp8-block", True),
                                                    ("qwen2-bias-tied", "fp8", True),
                                                    ("qwen3-qknorm", "fp8-block", False)])
def test_fp8_models_decode_as_the_float32_reference_of_their_weights(name, quantize, lm_head):
    config = CONFIGS[name]
    from mk.models.auto import FAMILIES

    model = FAMILIES[config.MODEL_TYPE].from_config(config, seed=3, max_batch_size=3, max_seq_len=24,
                                                    quantize=quantize, quantize_lm_head=lm_head)
    fmt = "fp8" if quantize == "fp8" else "fp8-block"
    assert model.formats == {"layers": fmt, "lm_head": fmt if lm_head else "plain"}
    assert model.shape.linear_format == fmt and model.shape.lm_head_format == model.formats["lm_head"]
    ref = ReferenceLlama(config, model.hf_weights())   # the same FP8 values, dequantized
    want, _ = prefill_logits(ref, PROMPTS)
    for precision in ("exact", "fast"):
        model.prefill_precision = precision
        got = model.logits(PROMPTS)
        for b, p in enumerate(PROMPTS):
            err = (got[b, :len(p)] - want[b, :len(p)]).abs().max() / want[b, :len(p)].abs().max()
            assert err < 1e-4, (precision, b, err)
    # Batch 3: the decode step's tensor-core tiles; batch 1: its GEMV streams.
    assert model.generate(PROMPTS, max_new_tokens=4) == [p + t for p, t in zip(PROMPTS, greedy_generate(ref, PROMPTS,
                                                                                                        4))]
    assert model.generate(PROMPTS[:1], max_new_tokens=3)[0][5:] == greedy_generate(ref, PROMPTS[:1], 3)[0]


def test_a_quantized_model_stores_one_byte_a_weight_plus_its_scales():
    config = CONFIGS["llama"]
    plain = Llama.from_config(config, max_batch_size=1, max_seq_len=16)
    fp8 = Llama.from_config(config, max_batch_size=1, max_seq_len=16, quantize="fp8", quantize_lm_head=True)
    # What a step reads (ModelShape prices each projection in its format): one byte a weight
    # where the plain model reads dtype_bytes (4 on the CPU, 2 on a GPU), norms and scales aside.
    assert fp8.shape.weight_bytes < plain.shape.weight_bytes / plain.shape.dtype_bytes * 1.15
    h, i = config.hidden_size, config.intermediate_size
    gate_up = fp8.weights["w.l0.gate_up"]
    assert gate_up.shape == (2 * i, h) and fp8.weights["w.l0.gate_up.scale"].shape == (2 * i,)
    assert torch.equal(gate_up.float(), gate_up.to(torch.float8_e4m3fn).float())   # e4m3 values
    for bad, error in (("int8", ValueError), (True, ValueError)):
        with pytest.raises(error, match="quantize must be None or one of"):
            Llama.from_config(config, quantize=bad)
    with pytest.raises(TypeError, match="quantize_lm_head must be a bool"):
        Llama.from_config(config, quantize="fp8", quantize_lm_head="yes")


def test_quantize_at_load_reads_a_bf16_checkpoint_into_fp8(tmp_path):
    config = CONFIGS["llama"]
    save_weights(random_weights(config, seed=5, dtype=torch.bfloat16), config, tmp_path)
    model = AutoModel.from_pretrained(tmp_path, quantize="fp8", max_batch_size=1, max_seq_len=16, progress=False)
    assert model.formats == {"layers": "fp8", "lm_head": "plain"}
    ref = ReferenceLlama(config, model.hf_weights())
    assert model.generate([PROMPTS[0]], max_new_tokens=3)[0][5:] == greedy_generate(ref, [PROMPTS[0]], 3)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", ["fp8", "fp8-block"])
def test_fp8_on_the_gpu_decodes_within_bf16_tolerance_of_the_float32_reference(quantize):
    """On a GPU the projections are stored as float8_e4m3fn and widened in the tiles (to
    float32 for the GEMV streams, to float16 for the tensor cores, where x goes as two float16
    halves): with exact prefill and a float32 cache, the logits are within the bf16
    tolerance of the float32 reference and the greedy tokens follow it. The fast prefill
    multiplies on the FP8 tensor cores (x quantized a row at a time): within 5%."""
    config = LlamaConfig.tiny(vocab_size=1000, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, eos_token_id=None)
    model = Llama.from_config(config, seed=3, max_batch_size=3, max_seq_len=64, quantize=quantize,
                              quantize_lm_head=True, kv_dtype=torch.float32, prefill_precision="exact")
    assert model.weights["w.l0.gate_up"].dtype == torch.float8_e4m3fn
    ref = ReferenceLlama(config, {k: v.float() for k, v in model.hf_weights().items()})
    want, _ = prefill_logits(ref, PROMPTS)
    got = model.logits(PROMPTS)
    for b, p in enumerate(PROMPTS):
        err = (got[b, :len(p)] - want[b, :len(p)]).norm() / want[b, :len(p)].norm()
        assert err < 1e-2, (b, err)
    assert model.generate(PROMPTS, max_new_tokens=4) == [p + t for p, t in zip(PROMPTS, greedy_generate(ref, PROMPTS,
                                                                                                        4))]
    long = [[(7 * t + 3) % 1000 for t in range(32)]]
    model.prefill_precision = "fast"
    got, (want, _) = model.logits(long), prefill_logits(ref, long)
    assert (got - want).norm() / want.norm() < 5e-2


def _bytes_from_config(config, quantize, lm_head, dtype_bytes, fp8_bytes):
    """(weights, scales) a model of ``config`` stores, from the config alone: every tensor's
    elements times its element size (``fp8_bytes`` for a quantized projection: 1 on a GPU, 4
    on the CPU where e4m3 values are held in float32; ``dtype_bytes`` for the rest), the
    float32 scales (a projection's rows, times its 128-column blocks for fp8-block), and the
    float32 RoPE frequencies; a tied LM head counted once, or twice once quantized (its copy)."""
    import math

    from mk.models.weights import expected_shapes

    shapes = dict(expected_shapes(config))
    if quantize and lm_head:
        shapes.setdefault("lm_head.weight", (config.vocab_size, config.hidden_size))
    weights = scales = 0
    for name, shape in shapes.items():
        quantized = quantize and (name.endswith("_proj.weight") or (lm_head and name == "lm_head.weight"))
        weights += math.prod(shape) * (fp8_bytes if quantized else dtype_bytes)
        if quantized:
            N, K = shape
            scales += 4 * N * (1 if quantize == "fp8" else -(-K // 128))
    return weights + scales + 4 * (config.head_dim // 2), scales


@pytest.mark.parametrize("device,dtype,fp8_bytes", [("cpu", torch.float32, 4),
                                                    pytest.param("cuda", torch.bfloat16, 1, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,quantize,lm_head", [("llama", None, False), ("llama", "fp8", False),
                                                    ("qwen2-bias-tied", "fp8-block", True),
                                                    ("qwen2-bias-tied", None, False), ("qwen3-qknorm", "fp8", True)])
def test_footprint_counts_each_weight_at_its_stored_bytes_and_names_the_format(device, dtype, fp8_bytes, name,
                                                                               quantize, lm_head):
    from mk.models.auto import FAMILIES

    config = CONFIGS[name]
    model = FAMILIES[config.MODEL_TYPE].from_config(config, device=device, dtype=dtype, max_batch_size=1,
                                                    max_seq_len=16, quantize=quantize, quantize_lm_head=lm_head)
    fp = model.footprint()
    weights, scales = _bytes_from_config(config, quantize, lm_head, dtype.itemsize, fp8_bytes)
    assert (fp["weights"], fp["scale_bytes"]) == (weights, scales)
    assert fp["weight_format"] == (quantize or "plain")
    assert fp["lm_head_format"] == (quantize if lm_head else "plain")
    if quantize:
        projection = model.weights["w.l0.gate_up"]
        assert projection.element_size() == fp8_bytes
        assert projection.dtype == (torch.float8_e4m3fn if device == "cuda" else torch.float32)


def test_a_plan_says_how_its_weights_are_stored():
    config = CONFIGS["llama"]
    plain = Llama.from_config(config, max_batch_size=1, max_seq_len=16)
    fp8 = Llama.from_config(config, max_batch_size=1, max_seq_len=16, quantize="fp8-block", quantize_lm_head=True)
    bits = 8 * plain.shape.dtype_bytes
    assert repr(plain.plan(1, 16)).splitlines()[1] == f"  weights: {bits}-bit"
    shown = repr(fp8.plan(1, 16)).splitlines()
    assert shown[0].startswith("plan for ") and "l0.qkv" in "\n".join(shown)
    assert shown[1] == "  weights: fp8-block (e4m3, a scale per 128x128 block; LM head included)"
    fp8 = Llama.from_config(config, max_batch_size=1, max_seq_len=16, quantize="fp8")
    assert repr(fp8.plan(1, 16)).splitlines()[1] == f"  weights: fp8 (e4m3, per-channel scales; LM head {bits}-bit)"
