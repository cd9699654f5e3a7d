"""The Qwen3 family (dense Qwen3, ``model_type: "qwen3"``): Llama's layers with an RMSNorm of
each head's q and k (weights ``q_norm`` / ``k_norm`` [head_dim]) before RoPE, and a
``head_dim`` of its own (128 unless config.json says otherwise), independent of hidden
size / heads. Embeddings tied or not.

The q and k rows are stored in the interleaved rotary layout, so the norm weights are
permuted the same way (:func:`mk.tasks.rope.interleave_rotary` over one head).
Sliding-window layers (``use_sliding_window``) and attention biases are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from .config import LlamaConfig
from .decoder import DecoderModel
from .qwen2 import refuse_sliding_layers


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """A Qwen3 config: Llama's fields, ``head_dim`` 128 by default; q and k are normed per head."""

    head_dim: int | None = 128

    MODEL_TYPE: ClassVar[str] = "qwen3"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen3ForCausalLM",)
    QK_NORM: ClassVar[bool] = True
    HANDLES: ClassVar[tuple[str, ...]] = ("sliding_window",)

    @classmethod
    def _check_family_fields(cls, d: Mapping, source: str) -> None:
        refuse_sliding_layers(d, source)


class Qwen3(DecoderModel):
    """A Qwen3 decoder through the megakernel (the API: :class:`~mk.models.decoder.DecoderModel`)."""

    config_class = Qwen3Config


__all__ = ["Qwen3", "Qwen3Config"]
