"""Quantized checkpoints: what config.json's ``quantization_config`` says, read into the weight
format (:mod:`mk.tasks.linear.format`) the projections are stored in, and each stored scale
converted to that format's.

Two FP8 (e4m3) layouts are published:

- ``compressed-tensors``, format ``float-quantized`` (RedHatAI's ``*-FP8`` models): a
  ``weight_scale`` per output channel (``[N, 1]``, strategy ``channel``), per tensor (``[]`` or
  ``[1]``, strategy ``tensor``: every row gets it) or per 128 x 128 block (strategy ``block``);
- transformers' ``fp8`` method with ``weight_block_size`` ``[128, 128]`` (Qwen's and DeepSeek's
  ``*-FP8`` models): ``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]``, which despite its name
  multiplies the stored values.

mk runs both weight-only: activations stay in float32 (their ``input_scale`` tensors, when a
checkpoint was calibrated for static activation scales, are not read). Modules the config
leaves unquantized (``ignore`` / ``modules_to_not_convert``, usually the LM head) load as they
are. Anything else is refused, naming the field: another ``quant_method`` or format, integer
or grouped weights, a block other than 128 x 128, a quantized KV cache.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mk.tasks.linear.format import FP8_BLOCK, FP8_CHANNEL, SCALE_BLOCK, WeightFormat, block_scales_per_row

#: The ``quant_method`` values mk reads.
QUANT_METHODS = ("compressed-tensors", "fp8")
#: Tensors of a quantized checkpoint that mk has no use for: static activation scales
#: (mk keeps activations in float32).
UNUSED_SUFFIXES = (".input_scale",)


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint stores its quantized projections.

    ``format``: mk's weight format of them; ``scale_suffix``: the name of a weight's scales
    beside it (``q_proj.weight`` + ``_scale`` or ``_scale_inv``); ``scale_layout``: what that
    tensor holds (``"tensor"``, ``"channel"`` or ``"block"``: one per 128 x 128 block);
    ``ignore``: patterns of the modules left unquantized (``lm_head``, or ``re:`` regexes)."""

    method: str
    format: WeightFormat
    scale_suffix: str
    scale_layout: str
    ignore: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether module ``module`` (``model.layers.0.self_attn.q_proj``, ``lm_head``) is stored quantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern):
                return False
        return True

    def scale_shape(self, N: int, K: int) -> tuple[int, ...]:
        """The shape the checkpoint's scales of an ``[N, K]`` weight must have (a per-tensor
        scale may also be ``[]``: see :meth:`to_format`)."""
        if self.scale_layout == "tensor":
            return (1,)
        if self.scale_layout == "channel":
            return (N, 1)
        return (-(-N // SCALE_BLOCK), -(-K // SCALE_BLOCK))

    def to_format(self, name: str, stored: torch.Tensor, N: int, K: int) -> torch.Tensor:
        """The checkpoint's scales ``stored`` of weight ``name`` ``[N, K]`` as :attr:`format`'s
        (float32: ``[N]`` per channel, ``[N, ceil(K/128)]`` per row and block); ValueError
        naming the tensor when their shape is not the layout's, or a value is not finite and > 0."""
        want = self.scale_shape(N, K)
        shape = tuple(stored.shape)
        if shape != want and not (self.scale_layout == "tensor" and shape == ()):
            raise ValueError(f"{name}{self.scale_suffix}: scales of shape {shape}, expected {want} "
                             f"({self.scale_layout} scales of a {self.method} checkpoint) for a weight of {(N, K)}")
        s = stored.float()
        if self.scale_layout == "tensor":
            s = s.reshape(1).expand(N).contiguous()
        elif self.scale_layout == "channel":
            s = s.reshape(N)
        else:
            s = block_scales_per_row(s, N)
        self.format.check_scale(name, (N, K), s)
        return s


def read_quantization(d: Mapping, source: str) -> CheckpointQuantization | None:
    """The quantization a config.json dict ``d`` declares (None when it has no
    ``quantization_config``); ValueError naming the field mk does not run."""
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"{source}: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method == "fp8":
        return _transformers_fp8(q, source)
    if method == "compressed-tensors":
        return _compressed_tensors(q, source)
    raise ValueError(f"{source}: quantization_config.quant_method is {method!r}; mk reads FP8 checkpoints of "
                     f"{' or '.join(repr(m) for m in QUANT_METHODS)}")


def _ignore_list(q: Mapping, field: str, source: str) -> tuple[str, ...]:
    value = q.get(field) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{source}: quantization_config.{field} must be a list of module names, got {value!r}")
    return tuple(value)


def _transformers_fp8(q: Mapping, source: str) -> CheckpointQuantization:
    where = f"{source}: quantization_config"
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt is {fmt!r}; mk runs e4m3 FP8 weights")
    block = q.get("weight_block_size")
    if block is None:
        raise ValueError(f"{where} (quant_method 'fp8') has no weight_block_size; mk reads [128, 128] blocks")
    if not isinstance(block, (list, tuple)) or list(block) != [SCALE_BLOCK, SCALE_BLOCK]:
        raise ValueError(f"{where}.weight_block_size is {block!r}; mk runs [128, 128] blocks")
    return CheckpointQuantization("fp8", FP8_BLOCK, "_scale_inv", "block", _ignore_list(q, "modules_to_not_convert",
                                                                                       source))


def _compressed_tensors(q: Mapping, source: str) -> CheckpointQuantization:
    where = f"{source}: quantization_config"
    fmt = q.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"{where}.format is {fmt!r}; mk reads compressed-tensors 'float-quantized' (FP8) checkpoints")
    if q.get("kv_cache_scheme") is not None:
        raise ValueError(f"{where}.kv_cache_scheme is set; mk does not run a quantized KV cache from a checkpoint")
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise ValueError(f"{where}.config_groups must hold one group (one scheme for every projection), got "
                         f"{len(groups) if isinstance(groups, Mapping) else groups!r}")
    (group_name, group), = groups.items()
    w = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(w, Mapping):
        raise ValueError(f"{where}.config_groups.{group_name}.weights must be an object")
    wh = f"{where}.config_groups.{group_name}.weights"
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(f"{wh} are {w.get('num_bits')}-bit {w.get('type')!r}; mk runs 8-bit float (e4m3) weights")
    if w.get("symmetric", True) is not True or w.get("dynamic", False):
        raise ValueError(f"{wh}: mk runs symmetric, static weight scales")
    strategy = w.get("strategy")
    if strategy == "block":
        if list(w.get("block_structure") or []) != [SCALE_BLOCK, SCALE_BLOCK]:
            raise ValueError(f"{wh}.block_structure is {w.get('block_structure')!r}; mk runs [128, 128] blocks")
        return CheckpointQuantization("compressed-tensors", FP8_BLOCK, "_scale", "block",
                                      _ignore_list(q, "ignore", source))
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"{wh}.strategy is {strategy!r}; mk runs 'channel', 'tensor' or 'block' FP8 scales")
    return CheckpointQuantization("compressed-tensors", FP8_CHANNEL, "_scale", strategy, _ignore_list(q, "ignore", source))
