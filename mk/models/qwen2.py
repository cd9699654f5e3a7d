"""The Qwen2 family: Qwen2 and Qwen2.5 (``model_type: "qwen2"``): Llama's layers with a bias
on the q, k and v projections.

The biases are packed with the fused QKV weight: q and k's in the interleaved rotary
layout of their rows, so the megakernel adds each to its row before RoPE. Qwen2 configs
carry a ``sliding_window`` that applies only with ``use_sliding_window: true``, which mk
refuses (those layers are not implemented); with it false the field is ignored, as in
transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from dataclasses import dataclass

from .config import LlamaConfig, json_bool
from .decoder import DecoderModel


def refuse_sliding_layers(d: Mapping, source: str) -> None:
    """Qwen configs name sliding-window layers by ``use_sliding_window`` (a JSON boolean)
    and, in transformers 5, ``layer_types`` (a list of strings): mk runs every layer over all
    positions, so either one asking for a window is refused, as is either one of another type."""
    if json_bool(d, "use_sliding_window", source):
        raise ValueError(f"{source}: use_sliding_window is true; mk does not implement sliding-window Qwen layers")
    types = d.get("layer_types")
    if types is None:
        return
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"{source}: layer_types must be a list of strings, got {types!r}")
    sliding = [i for i, t in enumerate(types) if t != "full_attention"]
    if sliding:
        raise ValueError(f"{source}: layer_types makes layers {sliding} {types[sliding[0]]!r}; mk "
                         f"runs only full-attention Qwen layers")


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """A Qwen2 / Qwen2.5 config: Llama's fields; the q/k/v projections have biases."""

    MODEL_TYPE: ClassVar[str] = "qwen2"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen2ForCausalLM",)
    QKV_BIAS: ClassVar[bool] = True
    HANDLES: ClassVar[tuple[str, ...]] = ("sliding_window",)

    @classmethod
    def _check_family_fields(cls, d: Mapping, source: str) -> None:
        refuse_sliding_layers(d, source)


class Qwen2(DecoderModel):
    """A Qwen2 / Qwen2.5 decoder through the megakernel (the API: :class:`~mk.models.decoder.DecoderModel`)."""

    config_class = Qwen2Config


__all__ = ["Qwen2", "Qwen2Config"]
