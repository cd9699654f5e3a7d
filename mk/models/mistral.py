"""The Mistral family (``model_type: "mistral"``): Llama's layers, with attention over a
sliding window when ``sliding_window`` is set.

Each token attends to the ``sliding_window`` latest positions, itself included (key
position ``j`` for a query at ``i`` when ``i - sliding_window < j <= i``), as transformers'
Mistral does; decode attention reads only those keys, so a windowed model's KV traffic
stops at the window. ``sliding_window: null`` (Mistral 7B v0.2 and later) attends to every
position, as Llama.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .config import LlamaConfig
from .decoder import DecoderModel


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """A Mistral config: Llama's fields and ``sliding_window`` (None: no window)."""

    sliding_window: int | None = None

    MODEL_TYPE: ClassVar[str] = "mistral"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("MistralForCausalLM",)
    HANDLES: ClassVar[tuple[str, ...]] = ("sliding_window",)

    def __post_init__(self):
        super().__post_init__()
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"MistralConfig: sliding_window must be null or an int >= 1, got {w!r}")

    @property
    def window(self) -> int | None:
        return self.sliding_window


class Mistral(DecoderModel):
    """A Mistral decoder through the megakernel (the API: :class:`~mk.models.decoder.DecoderModel`)."""

    config_class = MistralConfig


__all__ = ["Mistral", "MistralConfig"]
