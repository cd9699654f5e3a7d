"""Models: the families (:class:`Llama`, :class:`Mistral`, :class:`Qwen2`, :class:`Qwen3`,
each decoding through the megakernel), :class:`AutoModel` to pick one from a checkpoint,
configs, weights, a plain-torch reference forward of Llama, and the tokenizer.

``LlamaConfig.from_pretrained(folder)`` and ``load_weights(folder, config)`` read a
Hugging Face checkpoint; :class:`ReferenceLlama` is the float32 torch model the
megakernel is checked against.
"""

from .auto import AutoConfig, AutoModel
from .config import LlamaConfig
from .decoder import DecoderModel
from .llama import Llama
from .mistral import Mistral, MistralConfig
from .qwen2 import Qwen2, Qwen2Config
from .qwen3 import Qwen3, Qwen3Config
from .reference import KVCache, ReferenceLlama, greedy_generate, pad_prompts, prefill_logits
from .tokenizer import Tokenizer, load_tokenizer
from .weights import expected_shapes, load_weights, random_weights, save_weights

__all__ = [
    "AutoConfig",
    "AutoModel",
    "DecoderModel",
    "Llama",
    "LlamaConfig",
    "Mistral",
    "MistralConfig",
    "Qwen2",
    "Qwen2Config",
    "Qwen3",
    "Qwen3Config",
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
