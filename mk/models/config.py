"""Decoder configuration: what a Hugging Face ``config.json`` says, checked.

:class:`LlamaConfig` is the one parser of every family mk runs: Llama's fields, which the
other families' configs (:mod:`mk.models.mistral`, :mod:`mk.models.qwen2`,
:mod:`mk.models.qwen3`) extend with theirs, naming their ``model_type`` and what their
layers add (a QKV bias, q/k norms, a sliding window). It reads both spellings of the rotary settings found on the Hub:

- classic (transformers < 5): ``"rope_theta": 500000.0`` and ``"rope_scaling": {"rope_type"
  (or "type"): "llama3", "factor": ..., ...}`` (or ``null``);
- transformers 5: ``"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, ...}``.

Both parse to the same config. :meth:`LlamaConfig.to_hf_dict` writes the classic form,
which every transformers version accepts (5.x converts it to ``rope_parameters``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

#: The only rotary embeddings mk implements (see :func:`mk.tasks.rope.rope_inv_freq`).
SUPPORTED_ROPE_TYPES = ("default", "llama3")
#: Parameters of llama3 rope scaling, all required.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
#: config.json fields of Llama look-alikes that change the computation, with what they ask
#: for; set to anything but null / false / 0, they are refused at load.
UNSUPPORTED_FIELDS = {
    "sliding_window": "sliding-window attention",
    "attn_logit_softcapping": "attention logit softcapping",
    "final_logit_softcapping": "final logit softcapping",
    "num_local_experts": "mixture-of-experts layers",
    "num_experts": "mixture-of-experts layers",
    "use_qk_norm": "RMSNorm on q and k",
    "qk_layernorm": "RMSNorm on q and k",
}
#: Fields config.json must hold; the others have Llama's defaults.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes and constants of a Llama decoder (Llama 2, 3, 3.1, 3.2, SmolLM, TinyLlama),
    and the base of the other families' configs.

    Field names are Hugging Face's. ``num_key_value_heads`` defaults to
    ``num_attention_heads`` and ``head_dim`` to ``hidden_size // num_attention_heads``.
    ``rope_scaling`` is ``None`` (plain RoPE) or llama3 scaling, kept as a sorted tuple of
    ``(key, value)`` items so the config stays hashable; a dict passed in is converted,
    and :attr:`rope_scaling_dict` gives it back as a dict. ``eos_token_id`` may be one id,
    a tuple of ids (lists are converted) or ``None``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = 1
    eos_token_id: Any = 2

    #: config.json's ``model_type`` and ``architectures`` of the family.
    MODEL_TYPE: ClassVar[str] = "llama"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)
    #: What the family's layers add to Llama's: biases on the q, k and v projections; an
    #: RMSNorm of each head's q and k before RoPE.
    QKV_BIAS: ClassVar[bool] = False
    QK_NORM: ClassVar[bool] = False
    #: Fields of :data:`UNSUPPORTED_FIELDS` the family reads itself.
    HANDLES: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        # Frozen dataclass: defaults that depend on other fields go in through object.__setattr__.
        set_ = object.__setattr__
        if self.num_key_value_heads is None:
            set_(self, "num_key_value_heads", self.num_attention_heads)
        for name in REQUIRED_FIELDS + ("num_key_value_heads", "max_position_embeddings"):
            _check_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            set_(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"{type(self).__name__}: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{type(self).__name__}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive number, got {v!r}")
            set_(self, name, float(v))
        set_(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))
        set_(self, "tie_word_embeddings", bool(self.tie_word_embeddings))
        if isinstance(self.eos_token_id, (list, tuple)):
            set_(self, "eos_token_id", tuple(int(i) for i in self.eos_token_id))

    # ------------------------------------------------------------------ derived values

    @property
    def rope_scaling_dict(self) -> dict | None:
        """``rope_scaling`` as a Hugging Face dict (``{"rope_type": "llama3", ...}``) or None."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        """``"default"`` or ``"llama3"``."""
        return "default" if self.rope_scaling is None else "llama3"

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (1 for multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id as a tuple (empty when there is none)."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (int(self.eos_token_id),)

    # ------------------------------------------------------------------ construction

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A small config for tests and demos (2 layers, hidden 256, GQA 4:2, vocab 1000)."""
        base = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
        return cls(**{**base, **overrides})

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "config") -> "LlamaConfig":
        """From a Hugging Face ``config.json`` dict (classic or transformers-5 rope form).

        ``source`` names the dict in error messages (``from_pretrained`` passes the path).
        Raises ValueError on anything mk cannot run: another model type, an unsupported
        rope type, biases, an activation other than SiLU, missing or invalid sizes, a
        feature of a look-alike that mk does not implement (naming the field).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type is not None and model_type != cls.MODEL_TYPE:
            raise ValueError(f"{source}: model_type is {model_type!r}; {cls.__name__} reads {cls.MODEL_TYPE!r} "
                             f"configs (mk.models.AutoModel picks the family)")
        archs = d.get("architectures")
        if archs and not set(archs) & set(cls.ARCHITECTURES):
            raise ValueError(f"{source}: architectures is {archs}; {cls.__name__} runs "
                             f"{' or '.join(cls.ARCHITECTURES)}")
        missing = [k for k in REQUIRED_FIELDS if d.get(k) is None]
        if missing:
            raise ValueError(f"{source}: missing required field(s) {', '.join(missing)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act is {act!r}; the MLP mk runs uses 'silu'")
        # Biases beyond the family's own: mk would load and run them wrongly.
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ValueError(f"{source}: {flag} is true; mk runs {cls.MODEL_TYPE} models without it")
        # Features of look-alikes that mk does not implement: a config that sets one would
        # load and run, wrongly, if they were ignored.
        for field, what in UNSUPPORTED_FIELDS.items():
            value = d.get(field)
            if field not in cls.HANDLES and value not in (None, False, 0):
                raise ValueError(f"{source}: {field} is {value!r}; mk does not implement {what}")
        cls._check_family_fields(d, source)

        rope_params = d.get("rope_parameters")
        if rope_params is not None:   # transformers 5: theta lives inside rope_parameters
            if not isinstance(rope_params, Mapping):
                raise ValueError(f"{source}: rope_parameters must be an object, got {rope_params!r}")
            theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
            scaling, field = rope_params, "rope_parameters"
        else:
            theta, scaling, field = d.get("rope_theta", 10000.0), d.get("rope_scaling"), "rope_scaling"

        kwargs = {f.name: d[f.name] for f in fields(cls)
                  if f.name in d and d[f.name] is not None and f.name not in ("rope_theta", "rope_scaling")}
        if "eos_token_id" in d:   # an explicit null means "no EOS", not "use the default"
            kwargs["eos_token_id"] = d["eos_token_id"]
        if "bos_token_id" in d:
            kwargs["bos_token_id"] = d["bos_token_id"]
        try:
            return cls(**kwargs, rope_theta=theta, rope_scaling=_normalize_rope_scaling(scaling, field))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def _check_family_fields(cls, d: Mapping, source: str) -> None:
        """Refuse what the family's config.json may say that mk does not run (a family adds
        its checks here); Llama has none beyond :data:`UNSUPPORTED_FIELDS`."""

    def layer_tensors(self) -> dict[str, tuple[int, ...]]:
        """Shapes of one layer's Hugging Face tensors, by name within the layer
        (``self_attn.q_proj.weight``, ...): what a checkpoint must hold for each layer."""
        h, d = self.hidden_size, self.head_dim
        q, kv, i = self.num_attention_heads * d, self.num_key_value_heads * d, self.intermediate_size
        out = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
               "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
               "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
               "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
        if self.QKV_BIAS:
            out |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        if self.QK_NORM:
            out |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        return out

    @property
    def window(self) -> int | None:
        """Keys a token attends to at most (itself included), None for all: Mistral's
        ``sliding_window``; no other family has one."""
        return None

    @classmethod
    def from_json(cls, text: str, source: str = "config JSON") -> "LlamaConfig":
        """From the text of a ``config.json``."""
        return cls.from_dict(parse_config_json(text, source), source)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "LlamaConfig":
        """From ``folder/config.json`` (a Hugging Face checkpoint folder)."""
        return cls.from_dict(*read_config_json(folder))

    # ------------------------------------------------------------------ output

    def to_dict(self) -> dict:
        """The fields as plain JSON values (rope_scaling a dict, eos ids a list)."""
        d = asdict(self)
        d["rope_scaling"] = self.rope_scaling_dict
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        return d

    def to_hf_dict(self) -> dict:
        """A ``config.json`` dict that transformers' config of the family accepts (classic rope form)."""
        return {"architectures": [self.ARCHITECTURES[0]], "model_type": self.MODEL_TYPE, "hidden_act": "silu",
                **({} if self.QKV_BIAS else {"attention_bias": False}), "mlp_bias": False, **self.to_dict()}

    def to_json(self) -> str:
        """:meth:`to_hf_dict` as indented JSON; :meth:`from_json` reads it back."""
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, folder: str | os.PathLike) -> str:
        """Write ``folder/config.json`` (creating the folder); returns its path."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(os.fspath(folder), "config.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
        return path

    def to_model_shape(self, name: str | None = None, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None):
        """The :class:`mk.models.blocks.ModelShape` of this config, which the decode graph is
        built from (``kv_dtype_bytes``: of a KV-cache element, default the weights' ``dtype_bytes``)."""
        from mk.models.blocks import ModelShape
        return ModelShape(name=self.MODEL_TYPE if name is None else name, hidden=self.hidden_size, intermediate=self.intermediate_size,
                          layers=self.num_hidden_layers, heads=self.num_attention_heads,
                          kv_heads=self.num_key_value_heads, head_dim=self.head_dim, vocab=self.vocab_size,
                          tie_embeddings=self.tie_word_embeddings, dtype_bytes=dtype_bytes,
                          kv_dtype_bytes=kv_dtype_bytes, qkv_bias=self.QKV_BIAS, qk_norm=self.QK_NORM,
                          sliding_window=self.window)


def parse_config_json(text: str, source: str) -> Any:
    """The JSON value of a ``config.json``'s text; ValueError naming ``source`` if it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: invalid JSON ({e})") from None


def read_config_json(folder: str | os.PathLike) -> tuple[Any, str]:
    """``folder/config.json`` parsed, and its path; ValueError naming what is missing or bad."""
    folder = check_folder(folder)
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"no config.json in checkpoint folder {folder!r}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # what the OS said: permission denied, an I/O error, a folder by that name
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
    return parse_config_json(text, path), path


def check_folder(folder: str | os.PathLike) -> str:
    """``folder`` as a path string, once it is known to be a folder this process can list;
    ValueError naming the folder and, where the OS refused, what it said."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"a checkpoint folder must be a path (str or os.PathLike), got {type(folder).__name__}")
    folder = os.fspath(folder)
    try:
        os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"checkpoint folder {folder!r} does not exist or is not a folder") from None
    except OSError as e:
        raise ValueError(f"checkpoint folder {folder!r}: cannot read it: {e.strerror or e}") from None
    return folder


def _check_positive_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"LlamaConfig: {name} must be an int >= 1, got {v!r}")


def _normalize_rope_scaling(scaling: object, field: str = "rope_scaling") -> tuple | None:
    """None for plain RoPE, else llama3's parameters as a sorted ``(key, value)`` tuple.

    Accepts a dict (either rope-type spelling, extra keys such as rope_theta ignored),
    an already normalized tuple, or None.
    """
    if scaling is None:
        return None
    if isinstance(scaling, tuple):
        scaling = dict(scaling)
    if not isinstance(scaling, Mapping):
        raise ValueError(f"{field} must be an object or null, got {scaling!r}")
    # Hugging Face spells it "rope_type" (new) or "type" (old configs).
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"{field}: unsupported rope type {rope_type!r}; mk supports "
                         f"{' and '.join(map(repr, SUPPORTED_ROPE_TYPES))}")
    missing = [k for k in LLAMA3_ROPE_KEYS if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{field}: llama3 rope scaling lacks {', '.join(missing)}")
    out = {"rope_type": "llama3", "factor": float(scaling["factor"]),
           "low_freq_factor": float(scaling["low_freq_factor"]),
           "high_freq_factor": float(scaling["high_freq_factor"]),
           "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
    if not (out["factor"] > 0 and out["original_max_position_embeddings"] > 0
            and 0 < out["low_freq_factor"] < out["high_freq_factor"]):
        raise ValueError(f"{field}: llama3 rope scaling needs factor > 0, original_max_position_embeddings > 0 "
                         f"and 0 < low_freq_factor < high_freq_factor, got {out}")
    return tuple(sorted(out.items()))
