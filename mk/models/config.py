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
import math
import numbers
import os
import stat
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

# What mk can run, checked as a config is made (before anything is built from it): a config
# beyond these would hang building per-layer structures or overflow a kernel's offsets.
#: Layers at most (the largest checkpoints have about 130).
MAX_LAYERS = 1024
#: ``max_position_embeddings`` of a config.json (and llama3's ``original_max_position_embeddings``) at most.
MAX_POSITIONS = 2**24
#: mk's kernels address a weight matrix with int32 offsets: each (the embedding, the LM
#: head, the fused q/k/v and gate/up projections, o and down) holds fewer elements than this.
MAX_MATRIX_ELEMENTS = 2**31
#: The smallest ``rms_norm_eps``: float32's smallest normal number (a smaller one is a
#: denormal, or 0, in the kernels' float32).
MIN_RMS_NORM_EPS = 2.0**-126
#: A checkpoint's small text files (config.json, tokenizer_config.json, a chat template)
#: larger than this are refused before they are read: real ones are KiB.
MAX_TEXT_FILE_BYTES = 16 * 2**20
#: Digits of the longest integer config.json may hold where mk reads it (Python's own
#: limit for turning text into an int); a longer one is kept as :class:`_LongInt`.
_MAX_INT_DIGITS = 4300


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
        name = type(self).__name__
        if self.num_key_value_heads is None:
            set_(self, "num_key_value_heads", self.num_attention_heads)
        for field in REQUIRED_FIELDS + ("num_key_value_heads", "max_position_embeddings"):
            _check_positive_int(name, field, getattr(self, field))
        if self.num_hidden_layers > MAX_LAYERS:
            raise ValueError(f"{name}: num_hidden_layers must be at most {MAX_LAYERS}, got {self.num_hidden_layers}")
        if self.head_dim is None:
            set_(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _check_positive_int(name, "head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"{name}: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        self._check_matrices()
        eps = _check_real(name, "rms_norm_eps", self.rms_norm_eps)
        if not MIN_RMS_NORM_EPS <= eps < 1:
            raise ValueError(f"{name}: rms_norm_eps must be a finite number in (0, 1) (at least float32's "
                             f"smallest normal, 2**-126), got {self.rms_norm_eps!r}")
        theta = _check_real(name, "rope_theta", self.rope_theta)
        if not theta >= 1:
            raise ValueError(f"{name}: rope_theta must be a finite number >= 1, got {self.rope_theta!r}")
        set_(self, "rms_norm_eps", eps)
        set_(self, "rope_theta", theta)
        set_(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))
        _check_bool(name, "tie_word_embeddings", self.tie_word_embeddings)
        set_(self, "bos_token_id", _check_token_ids(name, "bos_token_id", self.bos_token_id, self.vocab_size,
                                                    several=False))
        set_(self, "eos_token_id", _check_token_ids(name, "eos_token_id", self.eos_token_id, self.vocab_size,
                                                    several=True))

    def _check_matrices(self) -> None:
        """ValueError naming the fields when a weight matrix the kernels address (as the
        megakernel packs it: q/k/v fused, gate/up fused) holds :data:`MAX_MATRIX_ELEMENTS` or more."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        for what, sizes, rows, cols in (
                ("the embedding and the LM head", "vocab_size x hidden_size", self.vocab_size, h),
                ("the fused q/k/v projection",
                 "(num_attention_heads + 2 x num_key_value_heads) x head_dim x hidden_size", q + 2 * kv, h),
                ("o_proj", "hidden_size x num_attention_heads x head_dim", h, q),
                ("the fused gate/up projection", "2 x intermediate_size x hidden_size", 2 * i, h),
                ("down_proj", "hidden_size x intermediate_size", h, i)):
            if rows * cols >= MAX_MATRIX_ELEMENTS:
                raise ValueError(f"{type(self).__name__}: {sizes} make {what} a {rows} x {cols} matrix "
                                 f"({rows * cols} elements); mk's kernels address a weight matrix with int32 "
                                 f"offsets, so each must hold fewer than 2**31")

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
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

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
        model_type, archs = check_family_names(d, source)
        if model_type is not None and model_type != cls.MODEL_TYPE:
            raise ValueError(f"{source}: model_type is {model_type!r}; {cls.__name__} reads {cls.MODEL_TYPE!r} "
                             f"configs (mk.models.AutoModel picks the family)")
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
            if json_bool(d, flag, source):
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
            theta = rope_params.get("rope_theta", d.get("rope_theta"))
            scaling, field = rope_params, "rope_parameters"
        else:
            theta, scaling, field = d.get("rope_theta"), d.get("rope_scaling"), "rope_scaling"
        if theta is None:   # absent or null: the default
            theta = 10000.0

        kwargs = {f.name: d[f.name] for f in fields(cls)
                  if f.name in d and d[f.name] is not None and f.name not in ("rope_theta", "rope_scaling")}
        if "eos_token_id" in d:   # an explicit null means "no EOS", not "use the default"
            kwargs["eos_token_id"] = d["eos_token_id"]
        if "bos_token_id" in d:
            kwargs["bos_token_id"] = d["bos_token_id"]
        try:
            config = cls(**kwargs, rope_theta=theta, rope_scaling=_normalize_rope_scaling(scaling, field))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None
        # (A config made in Python may say more: the model's max_seq_len, checked against
        # the memory there is, bounds what it runs.)
        if config.max_position_embeddings > MAX_POSITIONS:
            raise ValueError(f"{source}: max_position_embeddings must be at most {MAX_POSITIONS}, got "
                             f"{config.max_position_embeddings}")
        return config

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


class _LongInt:
    """An integer of config.json too long for Python to read as an int (more than
    :data:`_MAX_INT_DIGITS` digits): kept as its length, so that a field mk reads refuses it
    by name (no size mk runs is that long) and one it does not read is ignored."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str) -> int | _LongInt:
    return int(text) if len(text) <= _MAX_INT_DIGITS else _LongInt(text)


def parse_config_json(text: str, source: str) -> Any:
    """The JSON value of a ``config.json``'s text; ValueError naming ``source`` if it is not JSON
    (or is nested too deeply for Python's parser)."""
    try:
        return json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: invalid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{source}: invalid JSON (nested too deeply to read)") from None


def check_regular_file(path: str) -> os.stat_result:
    """``path``'s stat, once it is known to be a regular file (a link to one included):
    ValueError naming what it is instead (a folder, a FIFO or a device would hang ``open`` or
    a read, or never end); FileNotFoundError and other OSErrors as the OS raised them."""
    st = os.stat(path)   # (a FIFO would block open(): look before opening)
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a plain file")
        raise ValueError(f"{path}: is {kind}, not a regular file")
    return st


def read_text_file(path: str, max_bytes: int = MAX_TEXT_FILE_BYTES) -> str:
    """The text of a small UTF-8 file of a checkpoint (config.json, tokenizer_config.json, a
    chat template), newlines read as Python's text mode reads them.

    FileNotFoundError when there is none (the caller says what that means); ValueError
    naming the file when it is not a regular file (a folder, a FIFO or a device would hang
    or never end), holds more than ``max_bytes``, is not UTF-8, or cannot be read."""
    try:
        st = check_regular_file(path)
        too_big = f"{path}: larger than the {max_bytes // 2**20} MiB mk reads of such a file"
        if st.st_size > max_bytes:
            raise ValueError(f"{too_big} ({st.st_size} bytes)")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)   # (a file that says 0 bytes, as /proc's do, may hold more)
    except FileNotFoundError:
        raise
    except OSError as e:  # what the OS said: permission denied, an I/O error
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise ValueError(too_big)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_config_json(folder: str | os.PathLike) -> tuple[Any, str]:
    """``folder/config.json`` parsed, and its path; ValueError naming what is missing or bad."""
    folder = check_folder(folder)
    path = os.path.join(folder, "config.json")
    try:
        text = read_text_file(path)
    except FileNotFoundError:
        raise ValueError(f"no config.json in checkpoint folder {folder!r}") from None
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


def check_family_names(d: Mapping, source: str) -> tuple[str | None, list[str] | None]:
    """config.json's ``model_type`` (a string or null) and ``architectures`` (a list of
    strings or null); ValueError naming the file and the field when either is something else."""
    model_type, archs = d.get("model_type"), d.get("architectures")
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"{source}: model_type must be a string, got {model_type!r}")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise ValueError(f"{source}: architectures must be a list of strings, got {archs!r}")
    return model_type, archs


def json_bool(d: Mapping, field: str, source: str, default: bool = False) -> bool:
    """``d[field]`` as config.json must spell a flag: true or false (null or absent:
    ``default``); ValueError naming the file and the field for anything else (``"false"`` is
    a string, and would read as true)."""
    value = d.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {field} must be true or false (a JSON boolean), got {value!r}")
    return value


def _check_bool(cls_name: str, field: str, v: object) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{cls_name}: {field} must be a bool (true or false in config.json), got {v!r}")


def _check_positive_int(cls_name: str, field: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{cls_name}: {field} must be an int >= 1, got {v!r}")


def _check_real(cls_name: str, field: str, v: object) -> float:
    """``v`` as a float once it is a finite real number (not a bool, nor a string)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{cls_name}: {field} must be a number, got {v!r}")
    try:
        f = float(v)
    except OverflowError:   # an int too large for a float
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"{cls_name}: {field} must be a finite number, got {v!r}")
    return f


def _check_token_ids(cls_name: str, field: str, v: object, vocab_size: int, several: bool) -> Any:
    """A token id field, checked: None, an int in [0, vocab_size) or (``several``) a non-empty
    list or tuple of them (returned as a tuple); ValueError naming the field otherwise."""
    if v is None:
        return None
    what = f"an int in [0, {vocab_size})" + (", a non-empty list of them" if several else "") + " or null"
    if several and isinstance(v, (list, tuple)):
        if not v:
            raise ValueError(f"{cls_name}: {field} must be {what}, got an empty list")
        for k, i in enumerate(v):
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab_size:
                raise ValueError(f"{cls_name}: {field} must be {what}, got {i!r} at index {k}")
        return tuple(int(i) for i in v)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < vocab_size:
        raise ValueError(f"{cls_name}: {field} must be {what}, got {v!r}")
    return int(v)


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
    out = {"rope_type": "llama3"}
    for key in LLAMA3_ROPE_KEYS[:3]:
        v = scaling[key]
        try:
            f = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        except OverflowError:   # an int too large for a float
            f = math.inf
        if not 0 < f < math.inf:
            raise ValueError(f"{field}: llama3 {key} must be a finite number > 0, got {v!r}")
        out[key] = f
    key = "original_max_position_embeddings"
    v = scaling[key]
    # (8192.0 is 8192; 1.5 or 1e400 is no number of positions)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_POSITIONS:
        raise ValueError(f"{field}: llama3 {key} must be an integer in [1, {MAX_POSITIONS}], got {v!r}")
    out[key] = v
    if not out["low_freq_factor"] < out["high_freq_factor"]:
        raise ValueError(f"{field}: llama3 rope scaling needs low_freq_factor < high_freq_factor, got "
                         f"{out['low_freq_factor']} and {out['high_freq_factor']}")
    return tuple(sorted(out.items()))
