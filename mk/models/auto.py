"""``AutoModel`` / ``AutoConfig``: the family a checkpoint's config.json names.

``model_type`` picks the family (``architectures`` when there is no ``model_type``);
every family offers the same API (:class:`~mk.models.decoder.DecoderModel`). A GGUF file
stands for a folder: its metadata is read as a config.json (:mod:`mk.models.gguf`).

    model = AutoModel.from_pretrained("path/to/Qwen2.5-0.5B", max_seq_len=4096)
    print(model.generate([[1, 2, 3]], max_new_tokens=16))
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from .config import LlamaConfig, check_family_names, read_config_json
from .decoder import DecoderModel
from .gguf import is_gguf_path, read_gguf
from .llama import Llama
from .mistral import Mistral
from .qwen2 import Qwen2
from .qwen3 import Qwen3

#: Every family mk runs, by config.json ``model_type``.
FAMILIES: dict[str, type[DecoderModel]] = {cls.config_class.MODEL_TYPE: cls for cls in (Llama, Mistral, Qwen2, Qwen3)}
#: config.json files already warned about naming no family (by absolute path).
_WARNED_BARE: set[str] = set()


def family_of(d: Mapping, source: str = "config") -> type[DecoderModel]:
    """The family class of a config.json dict; ValueError naming what it says otherwise."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
    model_type, archs = check_family_names(d, source)
    if model_type is not None:
        if model_type not in FAMILIES:
            raise ValueError(f"{source}: model_type is {model_type!r}; mk runs {sorted(FAMILIES)}")
        return FAMILIES[model_type]
    archs = archs or []
    for cls in FAMILIES.values():
        if set(archs) & set(cls.config_class.ARCHITECTURES):
            return cls
    if archs:
        known = [a for cls in FAMILIES.values() for a in cls.config_class.ARCHITECTURES]
        raise ValueError(f"{source}: architectures is {archs}; mk runs {known}")
    # A bare config of sizes: Llama's, as transformers' LlamaConfig would read it; said once
    # per file and process (generate reads config.json more than once).
    if os.path.abspath(source) not in _WARNED_BARE:
        _WARNED_BARE.add(os.path.abspath(source))
        warnings.warn(f"{source} names no model_type or architectures: read as a Llama (model_type 'llama'); "
                      f"add model_type to config.json to say which family it is", UserWarning, stacklevel=3)
    return Llama


def read_config(source: str | os.PathLike) -> tuple[Mapping, str]:
    """The config.json dict of a checkpoint (a folder's ``config.json``, or a GGUF file's
    metadata read as one) and the path its errors name."""
    if is_gguf_path(source):
        ckpt = read_gguf(source)
        return ckpt.config, ckpt.path
    return read_config_json(source)


class AutoConfig:
    """The config of whichever family a checkpoint is."""

    @staticmethod
    def from_pretrained(folder: str | os.PathLike) -> LlamaConfig:
        """``folder/config.json`` (or a ``.gguf`` file's metadata) read by its family's config class."""
        d, path = read_config(folder)
        return family_of(d, path).config_class.from_dict(d, path)


class AutoModel:
    """The model of whichever family a checkpoint is."""

    @staticmethod
    def from_pretrained(folder: str | os.PathLike, **kwargs) -> DecoderModel:
        """Load ``folder`` (or a ``.gguf`` file) as its family (:meth:`DecoderModel.from_pretrained`'s arguments)."""
        d, path = read_config(folder)
        return family_of(d, path).from_pretrained(folder, **kwargs)

    @staticmethod
    def from_config(config: LlamaConfig, **kwargs) -> DecoderModel:
        """Random weights for ``config``, of the family its class is (:meth:`DecoderModel.from_config`)."""
        for cls in FAMILIES.values():
            if type(config) is cls.config_class:
                return cls.from_config(config, **kwargs)
        names = ", ".join(c.config_class.__name__ for c in FAMILIES.values())
        got = "None" if config is None else type(config).__name__
        raise TypeError(f"config must be the config of a family mk runs ({names}), got {got}")


__all__ = ["AutoConfig", "AutoModel", "FAMILIES", "family_of", "read_config"]
