"""GGUF files (llama.cpp's one-file checkpoints) read as mk checkpoints.

``AutoModel.from_pretrained("model.gguf")`` loads a GGUF file as it loads a Hugging Face
folder: :func:`read_gguf` opens the file (through the ``gguf`` package, imported only here,
only then) and gives a :class:`GGUFCheckpoint`, which says three things:

- :attr:`GGUFCheckpoint.config`: the file's metadata as the ``config.json`` dict mk's one
  config parser reads (:meth:`mk.models.config.LlamaConfig.from_dict`), so a GGUF is checked
  as a folder is;
- :meth:`GGUFCheckpoint.load_weights`: every tensor dequantized to float32
  (``gguf.quants.dequantize``: F32, F16, BF16, Q4_0, Q4_1, Q5_*, Q8_0, the K-quants, ...),
  under Hugging Face's names (:mod:`mk.models.weights`), then in the model's dtype;
- :meth:`GGUFCheckpoint.tokenizer`: the tokenizer and chat template the metadata holds.

Architectures (``general.architecture``): ``llama`` (Llama; a file whose ``general.name``
says Mistral is a Mistral, as llama.cpp converts Mistral models to ``llama`` files),
``mistral``, ``qwen2`` and ``qwen3``; any other is refused, naming it. llama.cpp's converter
permutes the q and k rows of ``llama`` files into its rotary layout (pairs of adjacent
elements, where Hugging Face rotates the two halves of a head): they are put back here. It
leaves Qwen's alone (llama.cpp rotates those as Hugging Face does). A ``llama`` file of
Llama 3.1+ stores its llama3 rope scaling as per-frequency factors (``rope_freqs.weight``):
they are read back into the llama3 parameters that give the same frequencies.

Tensor parallelism (``tp > 1``): each rank dequantizes every tensor whole, on the CPU, and
keeps only its share (:func:`mk.models.weights.shard_tensor`); the model is never held
whole, but each rank reads the whole file.

Refused with a one-line ValueError naming the file and the field or tensor, before any
tensor data goes to the device: a file the ``gguf`` reader cannot read (truncated, corrupt,
not a GGUF), another architecture, missing or ill-typed metadata, something mk does not run
(partial rotary, rope scaling other than llama3, experts, a sliding window outside Mistral),
a missing tensor, one mk would not use, one of the wrong shape, one of a type
``gguf.quants.dequantize`` does not handle; NaN or Inf values are refused as each tensor
loads.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import numpy as np
import torch
from tqdm.auto import tqdm

from .config import LlamaConfig
from .weights import _check_readable, _finite, _some, expected_shapes, shard_tensor

#: ``general.architecture`` values mk reads.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
#: Architectures whose q and k rows llama.cpp's converter permutes (its ``LlamaModel``;
#: Mistral models convert through it), and llama.cpp rotates as adjacent pairs.
PERMUTED_QK = ("llama", "mistral")
#: The four bytes every GGUF file starts with.
GGUF_MAGIC = b"GGUF"
#: What a user is told when the gguf package is missing.
NEEDS_GGUF = "reading GGUF files needs the gguf package: pip install gguf"

#: A layer's Hugging Face tensor names (within ``model.layers.{i}.``) and the GGUF names
#: (within ``blk.{i}.``) that hold them.
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
#: The model's other tensors.
MODEL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
#: llama.cpp's llama3 rope scaling, as a factor each frequency is divided by.
ROPE_FREQS = "rope_freqs.weight"
#: ``original_max_position_embeddings`` of a llama3 rope read from ``rope_freqs.weight`` when
#: the file does not say (Llama 3's 8192): any value gives the same frequencies.
LLAMA3_ORIGINAL_CONTEXT = 8192


class GGUFPackageMissing(ImportError, ValueError):
    """The ``gguf`` package is not installed (a ValueError too, so the CLI reports it in one line)."""


def _gguf():
    """The ``gguf`` package, imported now (mk runs without it until a GGUF file is read)."""
    try:
        import gguf
    except ImportError:
        raise GGUFPackageMissing(NEEDS_GGUF) from None
    return gguf


def is_gguf_path(path) -> bool:
    """Whether ``from_pretrained(path)`` reads ``path`` as a GGUF file: a regular file, or a
    path ending in ``.gguf`` that is not a folder (so that a missing one is reported as a
    missing file, not as a missing checkpoint folder). Folders are Hugging Face checkpoints."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    return os.path.isfile(path) or (path.lower().endswith(".gguf") and not os.path.isdir(path))


def read_gguf(path: str | os.PathLike) -> "GGUFCheckpoint":
    """The GGUF file at ``path``, opened and its metadata checked (no tensor data read but a
    llama3 rope's small ``rope_freqs.weight``). The last few files read are kept (by path,
    inode, size and modification time): reading the metadata of a large vocabulary takes the
    ``gguf`` reader seconds, and a load asks for it more than once (config, then weights)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a GGUF path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    _check_readable(path)   # (missing, a folder or a FIFO, not readable: one line naming it)
    st = os.stat(path)
    return _read_cached(path, os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_cached(path: str, realpath: str, inode: int, size: int, mtime_ns: int) -> "GGUFCheckpoint":
    return GGUFCheckpoint(path)


class GGUFCheckpoint:
    """One GGUF file: its metadata read as a Hugging Face config dict (:attr:`config`), its
    tensors as Hugging Face weights (:meth:`load_weights`) and its tokenizer
    (:meth:`tokenizer`). Made by :func:`read_gguf`; the module docstring says what is read
    and what is refused."""

    def __init__(self, path: str):
        self.path = path
        gguf = _gguf()
        _check_magic(path)
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:   # the reader's own errors: ValueError, IndexError, KeyError, numpy's
            raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): "
                             f"{type(e).__name__}: {e}") from None
        self.fields = self.reader.fields
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.architecture = self.get("general.architecture", "str")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{path}: general.architecture is {self.architecture!r}; mk reads GGUF files of the "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} architectures")
        #: The family (config.json's model_type) the file is.
        self.model_type = self._family()
        #: The file's metadata as a Hugging Face config.json dict.
        self.config = self._config()

    # ------------------------------------------------------------------ metadata

    def get(self, key: str, kind: str, default=...):
        """Metadata ``key`` as a Python value of ``kind``: ``"int"``, ``"float"``, ``"str"``,
        ``"bool"``, ``"strs"``, ``"ints"`` or ``"floats"`` (arrays), or ``"layer int"`` (an int,
        or an array of one int per layer, which must all be equal: mk's layers are alike).
        ``default`` when the key is absent (without one, absent is refused); ValueError naming
        the file and the key when it holds another type."""
        gguf = _gguf()
        T = gguf.GGUFValueType
        ints = {T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64}
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.path}: metadata lacks {key}")
            return default
        types = list(field.types)
        array = types[:1] == [T.ARRAY]
        item = types[-1] if array and len(types) > 1 else None   # (an empty array names no item type)
        ok = {"int": not array and types[0] in ints, "float": not array and types[0] in ints | {T.FLOAT32, T.FLOAT64},
              "str": types == [T.STRING], "bool": types == [T.BOOL],
              "strs": array and item in (T.STRING, None), "ints": array and item in ints | {None},
              "floats": array and item in ints | {T.FLOAT32, T.FLOAT64, None},
              "layer int": (not array and types[0] in ints) or (array and item in ints)}[kind]
        if not ok:
            what = f"an array of {item.name if item is not None else 'nothing'}" if array else types[0].name
            raise ValueError(f"{self.path}: metadata {key} must be {_KINDS[kind]}, got {what}")
        try:
            value = field.contents()
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: metadata {key} is not UTF-8 text ({e.reason})") from None
        if kind == "float":
            # A float32 as the shortest decimal that reads back to it: 1e-05, not 9.99999974e-06,
            # which is what the Hugging Face config held before conversion.
            return float(str(np.float32(value))) if types[0] == T.FLOAT32 else float(value)
        if kind == "layer int" and array:
            if not value or len(set(value)) != 1:
                raise ValueError(f"{self.path}: metadata {key} differs from layer to layer ({_some(value)}); "
                                 f"mk runs models whose layers are alike")
            return value[0]
        return value

    def _arch(self, key: str, kind: str, default=...):
        return self.get(f"{self.architecture}.{key}", kind, default)

    def _family(self) -> str:
        if self.architecture != "llama":
            return self.architecture
        # llama.cpp converts Mistral models as "llama" files; their name says what they are
        # (transformers' GGUF loader reads them so too).
        name = self.get("general.name", "str", "") or ""
        return "mistral" if "mistral" in name.lower() else "llama"

    def _config(self) -> dict:
        """The metadata as the config.json of the family; what mk cannot run goes in under the
        field config.json would use, so that the config parser refuses it as it would there."""
        heads = self._arch("attention.head_count", "layer int")
        hidden = self._arch("embedding_length", "int")
        head_dim = self._arch("attention.key_length", "int", None)
        if head_dim is None:   # llama.cpp's default
            if not heads or hidden % heads:
                raise ValueError(f"{self.path}: {self.architecture}.embedding_length ({hidden}) is no multiple of "
                                 f"{self.architecture}.attention.head_count ({heads}), and there is no "
                                 f"{self.architecture}.attention.key_length to say how wide a head is")
            head_dim = hidden // heads
        for key in ("attention.value_length", "rope.dimension_count"):
            v = self._arch(key, "int", head_dim)
            if v != head_dim:
                what = ("values as wide as keys" if key.startswith("attention") else
                        "rotary embeddings over whole heads (no partial rotary)")
                raise ValueError(f"{self.path}: {self.architecture}.{key} is {v}, but heads are {head_dim} wide "
                                 f"({self.architecture}.attention.key_length); mk runs {what}")
        d = {"model_type": self.model_type, "hidden_size": hidden, "head_dim": head_dim,
             "num_hidden_layers": self._arch("block_count", "int"),
             "intermediate_size": self._arch("feed_forward_length", "layer int"),
             "num_attention_heads": heads,
             "num_key_value_heads": self._arch("attention.head_count_kv", "layer int", heads),
             "rms_norm_eps": self._arch("attention.layer_norm_rms_epsilon", "float"),
             "rope_theta": self._arch("rope.freq_base", "float", 10000.0),
             "max_position_embeddings": self._arch("context_length", "int"),
             "tie_word_embeddings": MODEL_NAMES["lm_head.weight"] not in self.tensors,
             "vocab_size": self._vocab_size()}
        d["rope_scaling"] = self._rope_scaling(d)
        experts = self._arch("expert_count", "int", 0)
        if experts:
            d["num_local_experts"] = experts
        window = self._arch("attention.sliding_window", "int", None)
        if window and self.model_type in ("llama", "mistral"):   # (llama.cpp ignores Qwen2's)
            d["sliding_window"] = window
        eos = [self.get(f"tokenizer.ggml.{k}_token_id", "int", None) for k in ("eos", "eot", "eom")]
        eos = list(dict.fromkeys(i for i in eos if i is not None))
        d["eos_token_id"] = eos[0] if len(eos) == 1 else eos or None
        d["bos_token_id"] = self.get("tokenizer.ggml.bos_token_id", "int", None)
        return d

    def _vocab_size(self) -> int:
        v = self._arch("vocab_size", "int", None)
        if v is None:
            if "tokenizer.ggml.tokens" not in self.fields:
                raise ValueError(f"{self.path}: metadata lacks {self.architecture}.vocab_size and "
                                 f"tokenizer.ggml.tokens, either of which says the vocabulary's size")
            v = len(self.fields["tokenizer.ggml.tokens"].data)
        return v

    def _rope_scaling(self, d: dict) -> dict | None:
        """``rope_scaling`` of the config: None, llama3's parameters read back from
        ``rope_freqs.weight``, or what the file says (``rope.scaling.type``), which the config
        parser refuses unless it is one mk runs."""
        kind = self._arch("rope.scaling.type", "str", "none")
        if kind != "none":
            return {"rope_type": kind, "factor": self._arch("rope.scaling.factor", "float", None)}
        linear = self._arch("rope.scale_linear", "float", 1.0)   # (older files' spelling)
        if linear != 1.0:
            return {"rope_type": "linear", "factor": linear}
        if ROPE_FREQS not in self.tensors:
            return None
        t = self.tensors[ROPE_FREQS]
        shape, half = tuple(int(n) for n in reversed(t.shape.tolist())), d["head_dim"] // 2
        if shape != (half,) or t.tensor_type != _gguf().GGMLQuantizationType.F32:
            raise ValueError(f"{self.path}: tensor {ROPE_FREQS!r} must be F32 of shape ({half},) (a factor per "
                             f"frequency of a {d['head_dim']}-wide head), got {t.tensor_type.name} {shape}")
        factors = np.array(t.data, dtype=np.float64)
        original = self._arch("rope.scaling.original_context_length", "int", LLAMA3_ORIGINAL_CONTEXT)
        return llama3_from_factors(factors, d["head_dim"], d["rope_theta"], original,
                                   f"{self.path}: tensor {ROPE_FREQS!r}")

    # ------------------------------------------------------------------ weights

    def tensor_names(self, config: LlamaConfig) -> dict[str, str]:
        """``{Hugging Face name: GGUF name}`` of every tensor a model of ``config`` reads."""
        out = {}
        for name in expected_shapes(config):
            if name.startswith("model.layers."):
                layer, rest = name[len("model.layers."):].split(".", 1)
                out[name] = f"blk.{layer}.{LAYER_NAMES[rest]}"
            else:
                out[name] = MODEL_NAMES[name]
        return out

    def check_tensors(self, config: LlamaConfig) -> dict[str, str]:
        """:meth:`tensor_names`, once the file is known to hold each of them, in the shape
        ``config`` says and in a type the ``gguf`` package dequantizes, and nothing else
        (from the tensor index only: no data read). ValueError naming the tensor otherwise."""
        names = self.tensor_names(config)
        shapes = expected_shapes(config)
        missing = [f"{g} ({hf})" for hf, g in names.items() if g not in self.tensors]
        if missing:
            raise ValueError(f"{self.path}: lacks tensor(s) {_some(missing)}")
        unused = sorted(set(self.tensors) - set(names.values()) - {ROPE_FREQS})
        if unused:
            raise ValueError(f"{self.path}: holds tensor(s) a {config.MODEL_TYPE} model of this config does not use: "
                             f"{_some(unused)}; running without them would compute another model than the file's")
        for hf, g in names.items():
            t = self.tensors[g]
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))   # (GGUF lists dimensions innermost first)
            if shape != shapes[hf]:
                raise ValueError(f"{self.path}: tensor {g!r} ({hf}) has shape {shape}, expected {shapes[hf]} for "
                                 f"this config")
        for qtype in sorted({t.tensor_type for t in self.tensors.values()}):
            if not _dequantizes(qtype):
                g = next(g for g in names.values() if self.tensors[g].tensor_type == qtype)
                raise ValueError(f"{self.path}: tensor {g!r} is stored as {qtype.name}, which the gguf package "
                                 f"(version {_gguf_version()}) cannot dequantize")
        return names

    def load_weights(self, config: LlamaConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                     progress: bool = True, shard: dict[str, tuple[int, int, int]] | None = None
                     ) -> dict[str, torch.Tensor]:
        """The weights of ``config`` under Hugging Face names, as :func:`mk.models.weights.load_weights`
        gives a folder's: each tensor dequantized to float32 on the CPU, its q / k rows put
        back into Hugging Face's rotary layout (``llama`` and ``mistral`` files), cut to
        ``shard`` (one tensor-parallel rank's share, :func:`mk.models.weights.tp_slices`), then
        moved to ``device`` in ``dtype`` (None: float32) and checked finite. Every tensor's
        name, shape and type is checked (:meth:`check_tensors`) before any is read.
        ``progress``: a tqdm bar over the tensors."""
        names = self.check_tensors(config)
        gguf = _gguf()
        c = config
        permuted = {"self_attn.q_proj.weight": c.num_attention_heads, "self_attn.k_proj.weight": c.num_key_value_heads}
        weights = {}
        with tqdm(total=len(names), desc="loading weights", unit="tensor", disable=not progress) as bar:
            for hf, g in names.items():
                t = self.tensors[g]
                try:
                    a = gguf.quants.dequantize(t.data, t.tensor_type)
                except Exception as e:
                    raise ValueError(f"{self.path}: dequantizing tensor {g!r} ({t.tensor_type.name}) failed: {e}") from None
                # (an F32 tensor comes back as a view of the file: copied, so that no weight aliases it)
                w = torch.from_numpy(np.require(a, np.float32, ["C", "W", "O"])).reshape(expected_shapes(c)[hf])
                heads = permuted.get(hf.split(".", 3)[-1]) if self.architecture in PERMUTED_QK else None
                if heads is not None:
                    w = unpermute_rotary(w, heads)
                w = shard_tensor(hf, w, shard or {})
                weights[hf] = _finite(w.to(device=device, dtype=dtype or torch.float32).contiguous(), g, self.path)
                bar.update(1)
        if shard and "lm_head.weight" in shard and "lm_head.weight" not in weights:   # tied: the embedding's rows
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return weights

    # ------------------------------------------------------------------ tokenizer

    def tokenizer(self):
        """The file's tokenizer (:class:`mk.models.tokenizer.Tokenizer`), or None when it has
        none, or one mk does not build (a warning names it): see :mod:`mk.models.gguf_tokenizer`."""
        from .gguf_tokenizer import build_tokenizer

        return build_tokenizer(self)


_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
          "strs": "an array of strings", "ints": "an array of integers", "floats": "an array of numbers",
          "layer int": "an integer (or one per layer)"}


def _check_magic(path: str) -> None:
    """ValueError naming ``path`` unless it starts as a GGUF file does (the reader's own error
    on another file would not say so)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
    if head != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r}); mk reads a checkpoint "
                         f"folder or a .gguf file")


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def _dequantizes(qtype) -> bool:
    """Whether ``gguf.quants.dequantize`` handles tensors of type ``qtype``: tried on one block of zeros."""
    gguf = _gguf()
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        out = gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except Exception:   # NotImplementedError, or a type it cannot even lay out
        return False
    return np.asarray(out).dtype.kind == "f"


def unpermute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows (or a bias) from llama.cpp's rotary layout back to Hugging Face's.

    llama.cpp's converter reorders each head's rows from Hugging Face's halves (rows ``i`` and
    ``i + d/2`` rotate together) to adjacent pairs (rows ``2i`` and ``2i + 1``): the head's
    rows viewed as ``[2, d/2]`` are transposed to ``[d/2, 2]``. This transposes them back."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama3_from_factors(factors: np.ndarray, head_dim: int, theta: float, original: int, where: str) -> dict | None:
    """The llama3 ``rope_scaling`` dict whose frequencies are ``theta``'s divided by
    ``factors`` (llama.cpp's ``rope_freqs``: 1 for high frequencies, ``factor`` for low ones,
    ``1 / ((1 - s) / factor + s)`` between, ``s`` linear in 1 / wavelength); None when every
    factor is 1. The two wavelengths that bound the blend are fitted to the factors between
    (``original`` only scales how they are written as low / high_freq_factor); ValueError
    naming ``where`` when no llama3 scaling gives these factors."""
    from mk.tasks.rope import rope_inv_freq

    f = np.asarray(factors, dtype=np.float64)
    if not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise ValueError(f"{where}: holds factors that are not finite positive numbers")
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    factor = float(f.max())
    tol = 1e-5 * factor
    high, low = f <= 1 + tol, f >= factor - tol   # kept, divided by the factor
    mid = ~high & ~low
    bad = f"{where}: its frequency factors are not llama3 rope scaling's"
    if not (high.any() and low.any()) or np.any(np.diff(f) < -tol):   # (factors grow with the wavelength)
        raise ValueError(bad)
    # s as a function of 1 / wavelength: s = (1/w - 1/low_w) / (1/high_w - 1/low_w).
    s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    x = 1 / wavelen[mid]
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(x, s, 1)
        inv_high, inv_low = (1 - intercept) / slope, -intercept / slope
    else:
        # Too few blended points to fit: the bounds are placed between the neighbours that
        # tell (any place there gives these factors), through the blended point if there is one.
        top, bottom = 1 / wavelen[high].max(), 1 / wavelen[low].min()   # (1 / wavelength: top is high)
        if mid.any():
            # s = (x - inv_low) / (inv_high - inv_low) with inv_low in (bottom, x): inv_high in
            # (x, top) and low enough that inv_low stays above bottom.
            hi = min(top, (x[0] - (1 - s[0]) * bottom) / s[0])
            inv_high = (x[0] + hi) / 2
            inv_low = (x[0] - s[0] * inv_high) / (1 - s[0])
        else:
            inv_high, inv_low = top - (top - bottom) / 3, top - 2 * (top - bottom) / 3
    if not 0 < inv_low < inv_high:
        raise ValueError(bad)
    scaling = {"rope_type": "llama3", "factor": factor, "original_max_position_embeddings": int(original),
               "low_freq_factor": float(original * inv_low), "high_freq_factor": float(original * inv_high)}
    got = rope_inv_freq(head_dim, theta, scaling).double().numpy()
    if not np.allclose(got, inv / f, rtol=1e-5, atol=0):
        raise ValueError(bad)
    return scaling


__all__ = ["GGUFCheckpoint", "GGUFPackageMissing", "SUPPORTED_ARCHITECTURES", "is_gguf_path", "read_gguf",
           "unpermute_rotary", "llama3_from_factors"]
