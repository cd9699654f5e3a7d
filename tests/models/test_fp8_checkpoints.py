"""FP8 checkpoints as they are published (mk.models.quantization): compressed-tensors
``float-quantized`` with per-channel or per-tensor scales, transformers' ``fp8`` with 128 x 128
``weight_scale_inv`` blocks. Each is written here as its producers write it (e4m3 tensors, the
scales beside them, config.json's quantization_config) from random weights, loaded by mk, and
compared with the float32 reference of the same weights dequantized by this file's own rule;
then every malformed one is refused, naming what is wrong."""

import json

import pytest
import torch
from safetensors.torch import save_file

from mk.models import Llama, LlamaConfig, ReferenceLlama, random_weights
from mk.models.auto import AutoModel
from mk.models.reference import prefill_logits
from mk.models.weights import PROJECTIONS, check_tp_format, load_weights, shard_scale, tp_slices
from mk.models.quantization import read_quantization
from tests.conftest import HAS_CUDA

F8 = torch.float8_e4m3fn
CONFIG = LlamaConfig.tiny(vocab_size=302, hidden_size=256, intermediate_size=320, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, eos_token_id=None)
PROMPTS = [[1, 5, 9, 200, 7], [3, 4, 250, 17]]
CT_CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "kv_cache_scheme": None, "config_groups": {"group_0": {
                  "targets": ["Linear"], "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                               "dynamic": False, "symmetric": True},
                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False,
                              "symmetric": True}}}}
HF_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head"]}


def _ct(strategy: str) -> dict:
    q = json.loads(json.dumps(CT_CHANNEL))
    q["config_groups"]["group_0"]["weights"]["strategy"] = strategy
    return q


def _quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, the checkpoint's scales, the weight they stand for) by the layout's own rule."""
    N, K = w.shape
    if layout == "tensor":
        s = w.abs().max() / 448
        full = s.expand(N, K)
        stored = s.reshape(())
    elif layout == "channel":
        stored = (w.abs().amax(dim=1, keepdim=True) / 448).bfloat16().float()   # (written as bf16)
        full = stored.expand(N, K)
    else:   # a scale per 128 x 128 block, indexed by each element's block
        rb, cb = torch.arange(N) // 128, torch.arange(K) // 128
        stored = torch.zeros(-(-N // 128), -(-K // 128))
        for i in range(stored.shape[0]):
            for j in range(stored.shape[1]):
                stored[i, j] = w[rb == i][:, cb == j].abs().max() / 448
        full = stored[rb][:, cb]
    q = (w / full).to(F8)
    return q, stored, q.float() * full


def _write(folder, layout: str, qconfig: dict | None, *, scale_name: str = "weight_scale", lm_head: bool = False,
           edit=None, config: LlamaConfig = CONFIG) -> dict[str, torch.Tensor]:
    """A quantized checkpoint of ``config`` in ``folder``; returns the float32 weights it stands
    for. ``edit(tensors)`` spoils it before it is written."""
    w = random_weights(config, seed=11)
    tensors, meant = {}, {}
    for name, t in w.items():
        module = name.removesuffix(".weight")
        if any(name.endswith(p + ".weight") for p in PROJECTIONS) or (lm_head and name == "lm_head.weight"):
            q, s, meant[name] = _quantize(t, layout)
            tensors[name], tensors[module + "." + scale_name] = q, s.to(torch.bfloat16 if layout == "channel" else
                                                                         torch.float32)
            tensors[module + ".input_scale"] = torch.tensor(0.02)   # (static activation scales: not used)
        else:
            tensors[name], meant[name] = t.to(torch.bfloat16), t.to(torch.bfloat16).float()
    if edit is not None:
        edit(tensors)
    d = config.to_hf_dict()
    if qconfig is not None:
        d["quantization_config"] = qconfig
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return meant


def _err(model, meant) -> float:
    want, _ = prefill_logits(ReferenceLlama(CONFIG, meant), PROMPTS)
    got = model.logits(PROMPTS)
    return max(float((got[b, :len(p)] - want[b, :len(p)]).abs().max() / want[b, :len(p)].abs().max())
               for b, p in enumerate(PROMPTS))


@pytest.mark.skipif(HAS_CUDA, reason="the CPU path: FP8 values held in float32, exact")
@pytest.mark.parametrize("layout,qconfig,scale_name,fmt", [
    ("channel", CT_CHANNEL, "weight_scale", "fp8"), ("tensor", _ct("tensor"), "weight_scale", "fp8"),
    ("block", HF_BLOCK, "weight_scale_inv", "fp8-block")])
def test_published_fp8_checkpoints_load_in_their_format(tmp_path, layout, qconfig, scale_name, fmt):
    meant = _write(tmp_path, layout, qconfig, scale_name=scale_name)
    model = AutoModel.from_pretrained(tmp_path, max_batch_size=2, max_seq_len=16, progress=False)
    assert model.formats == {"layers": fmt, "lm_head": "plain"}
    assert _err(model, meant) < 1e-4
    # The LM head the checkpoint left in bf16 is quantized at load on request, in its format.
    headed = AutoModel.from_pretrained(tmp_path, max_batch_size=2, max_seq_len=16, progress=False,
                                       quantize_lm_head=True, quantize=fmt)
    assert headed.formats == {"layers": fmt, "lm_head": fmt}
    assert torch.equal(headed.hf_weights()["model.layers.1.mlp.down_proj.weight"],
                       model.hf_weights()["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.skipif(HAS_CUDA, reason="the CPU path")
def test_a_quantized_lm_head_loads_with_its_scales(tmp_path):
    meant = _write(tmp_path, "channel", {**CT_CHANNEL, "ignore": []}, lm_head=True)
    model = AutoModel.from_pretrained(tmp_path, max_batch_size=2, max_seq_len=16, progress=False)
    assert model.formats == {"layers": "fp8", "lm_head": "fp8"}
    assert _err(model, meant) < 1e-4


@pytest.mark.parametrize("layout,qconfig,scale_name", [("channel", CT_CHANNEL, "weight_scale"),
                                                       ("block", HF_BLOCK, "weight_scale_inv")])
def test_tensor_parallel_shares_hold_their_rows_and_blocks_scales(tmp_path, layout, qconfig, scale_name):
    """Two ranks' shares, read as slices: each share's dequantized weight is the whole weight's
    rows or columns (per-channel scales follow rows and stay whole where columns split; block
    scales split with their blocks)."""
    config = LlamaConfig.tiny(vocab_size=302, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64)
    _write(tmp_path, layout, qconfig, scale_name=scale_name, config=config)
    stored = read_quantization({"quantization_config": qconfig}, "config.json")
    whole = load_weights(tmp_path, config, progress=False, quantization=stored)
    fmt = stored.format
    for rank in range(2):
        slices = tp_slices(config, 2, rank)
        part = load_weights(tmp_path, config, progress=False, quantization=stored, shard=slices)
        for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            name = f"model.layers.0.{p}.weight"
            dim, a, b = slices[name]
            want = fmt.dequantize(whole[name], whole[name + "_scale"]).narrow(dim, a, b - a)
            assert torch.equal(fmt.dequantize(part[name], part[name + "_scale"]), want), (rank, p)


def test_block_scaled_weights_split_only_on_whole_blocks():
    odd = LlamaConfig.tiny(vocab_size=300, hidden_size=256, intermediate_size=384, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64)
    check_tp_format(odd, 2, "fp8")   # per channel: any split
    with pytest.raises(ValueError, match="give each rank 192 of down_proj's input columns, not a multiple of the 128"):
        check_tp_format(odd, 2, "fp8-block")
    with pytest.raises(ValueError, match="give each rank 192 of down_proj"):
        Llama.from_config(odd, tp=2, quantize="fp8-block")
    s = torch.rand(8, 3) + 0.5
    with pytest.raises(ValueError, match=r"columns \[192, 384\) do not start on a block of 128"):
        shard_scale("w", s, {"w": (1, 192, 384)})
    assert torch.equal(shard_scale("w", s, {"w": (1, 128, 384)}), s[:, 1:])


@pytest.mark.parametrize("case,message", [
    ("gptq", r"quant_method is 'gptq'; mk reads FP8 checkpoints of 'compressed-tensors' or 'fp8'"),
    ("no config", r"tensor 'model.layers.0.self_attn.q_proj.weight' has dtype F8_E4M3; config.json has no "
                  r"quantization_config"),
    ("no scales", r"lacks tensor\(s\) model.layers.0.self_attn.q_proj.weight_scale"),
    ("scale shape", r"q_proj.weight_scale: scales of shape \(3, 1\), expected \(256, 1\)"),
    ("nan scale", r"model.layers.1.mlp.up_proj.weight: scales must be finite and > 0"),
    ("zero scale", r"model.layers.1.mlp.up_proj.weight: scales must be finite and > 0"),
    ("int4", r"weights are 4-bit 'int'; mk runs 8-bit float"),
    ("packed", r"format is 'pack-quantized'; mk reads compressed-tensors 'float-quantized'"),
    ("blocks of 64", r"weight_block_size is \[64, 64\]; mk runs \[128, 128\] blocks"),
    ("kv scheme", r"kv_cache_scheme is set"),
    ("requantize", r"stored fp8 \(compressed-tensors\); quantize='fp8-block' would quantize them again"),
    ("half ignored", r"leaves model.layers.0.mlp.down_proj.weight, model.layers.1.mlp.down_proj.weight unquantized"),
    ("bf16 weight", r"q_proj.weight' has dtype BF16; the checkpoint's quantization_config \(compressed-tensors\) "
                    r"stores it as F8_E4M3"),
])
def test_malformed_fp8_checkpoints_are_refused_naming_what(tmp_path, case, message):
    qconfig, kw, edit = CT_CHANNEL, {}, None
    q0 = "model.layers.0.self_attn.q_proj"
    if case == "gptq":
        qconfig = {"quant_method": "gptq", "bits": 4}
    elif case == "no config":
        qconfig = None
    elif case == "no scales":
        def edit(t): del t[q0 + ".weight_scale"]
    elif case == "scale shape":
        def edit(t): t[q0 + ".weight_scale"] = t[q0 + ".weight_scale"][:3]
    elif case in ("nan scale", "zero scale"):
        def edit(t): t["model.layers.1.mlp.up_proj.weight_scale"][5] = float("nan") if case == "nan scale" else 0.0
    elif case == "int4":
        qconfig = json.loads(json.dumps(CT_CHANNEL))
        qconfig["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int")
    elif case == "packed":
        qconfig = {**CT_CHANNEL, "format": "pack-quantized"}
    elif case == "blocks of 64":
        qconfig = {**HF_BLOCK, "weight_block_size": [64, 64]}
    elif case == "kv scheme":
        qconfig = {**CT_CHANNEL, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    elif case == "requantize":
        kw = {"quantize": "fp8-block"}
    elif case == "half ignored":
        qconfig = {**CT_CHANNEL, "ignore": ["lm_head", "re:.*down_proj"]}
    elif case == "bf16 weight":
        def edit(t): t[q0 + ".weight"] = t[q0 + ".weight"].to(torch.bfloat16)
    _write(tmp_path, "channel", qconfig, edit=edit)
    with pytest.raises(ValueError, match=message):
        AutoModel.from_pretrained(tmp_path, max_batch_size=1, max_seq_len=8, progress=False, **kw)
