"""Llama models: :class:`Llama` (decode through the megakernel), config, weights, a
plain-torch reference forward, and the tokenizer.

``LlamaConfig.from_pretrained(folder)`` and ``load_weights(folder, config)`` read a
Hugging Face checkpoint; :class:`ReferenceLlama` is the float32 torch model the
megakernel is checked against.
"""

from .config import LlamaConfig
from .llama import Llama
from .reference import KVCache, ReferenceLlama, greedy_generate, pad_prompts, prefill_logits
from .tokenizer import Tokenizer, load_tokenizer
from .weights import expected_shapes, load_weights, random_weights, save_weights

__all__ = [
    "Llama",
    "LlamaConfig",
    "KVCache",
    "ReferenceLlama",
    "greedy_generate",
    "pad_prompts",
    "prefill_logits",
    "Tokenizer",
    "load_tokenizer",
    "expected_shapes",
    "load_weights",
    "random_weights",
    "save_weights",
]
