"""The Llama family: Llama 2, 3, 3.1 and 3.2, SmolLM, TinyLlama (``model_type: "llama"``).

Llama's layers are the shared decoder's (:mod:`mk.models.blocks`) as they are: RMSNorm,
QKV without bias, RoPE (plain or llama3-scaled), grouped-query attention over every
cached position, SiLU-gated MLP; its config is :class:`~mk.models.config.LlamaConfig`, which
the other families extend.

    model = Llama.from_pretrained("path/to/llama", max_batch_size=8, max_seq_len=4096)
    out = model.generate(input_ids, max_new_tokens=64)
"""

from __future__ import annotations

from .config import LlamaConfig
from .decoder import DecoderModel


class Llama(DecoderModel):
    """A Llama decoder through the megakernel (the API: :class:`~mk.models.decoder.DecoderModel`)."""

    config_class = LlamaConfig


__all__ = ["Llama", "LlamaConfig"]
