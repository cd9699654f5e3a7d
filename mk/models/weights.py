"""Decoder weights: load a Hugging Face safetensors checkpoint, make random ones, save them.

Weights are a flat ``dict[str, torch.Tensor]`` under Hugging Face's parameter names::

    model.embed_tokens.weight                        [vocab, hidden]
    model.layers.{i}.input_layernorm.weight          [hidden]
    model.layers.{i}.self_attn.q_proj.weight         [heads * head_dim, hidden]
    model.layers.{i}.self_attn.{k,v}_proj.weight     [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.o_proj.weight         [hidden, heads * head_dim]
    model.layers.{i}.post_attention_layernorm.weight [hidden]
    model.layers.{i}.mlp.{gate,up}_proj.weight       [intermediate, hidden]
    model.layers.{i}.mlp.down_proj.weight            [hidden, intermediate]
    model.norm.weight                                [hidden]
    lm_head.weight                                   [vocab, hidden]   (absent when tied)

and what a family's layers add (:meth:`~mk.models.config.LlamaConfig.layer_tensors`):
Qwen2's ``self_attn.{q,k,v}_proj.bias``, Qwen3's ``self_attn.{q,k}_norm.weight`` [head_dim].

With ``tie_word_embeddings`` there is no ``lm_head.weight``: the LM head is
``model.embed_tokens.weight``, and is never stored twice.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mk.tasks.linear.format import FP8_BLOCK, FP8_CHANNEL, SCALE_BLOCK, weight_format

from .config import LlamaConfig, check_folder, check_regular_file, read_text_file
from .quantization import UNUSED_SUFFIXES, CheckpointQuantization

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: A safetensors index larger than this is refused before it is read (a 400B model's is ~100 KiB).
MAX_INDEX_BYTES = 64 * 2**20

#: safetensors dtype names mk can load as they are; FP8 values (:data:`_FP8_DTYPE`) only as a
#: quantized checkpoint's projections (:mod:`mk.models.quantization`).
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_FP8_DTYPE = "F8_E4M3"


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a checkpoint of ``config`` must hold, with its shape, in model order."""
    c = config
    h = c.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h)}
    layer = c.layer_tensors()
    for i in range(c.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


#: (tensor name suffix, dim split): what tensor parallelism splits of a layer, and along which
#: dimension (0: rows, by heads or MLP columns; 1: columns, the O and down projections' inputs).
_TP_SPLITS = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
              "self_attn.q_proj.bias": 0, "self_attn.k_proj.bias": 0, "self_attn.v_proj.bias": 0,
              "self_attn.o_proj.weight": 1, "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0,
              "mlp.down_proj.weight": 1}


def tp_slices(config: LlamaConfig, tp: int, rank: int) -> dict[str, tuple[int, int, int]]:
    """Rank ``rank``'s share of each tensor a checkpoint of ``config`` holds under tensor
    parallelism over ``tp`` ranks: ``{name: (dim, start, stop)}`` for the split ones (q/k/v
    rows by heads, gate/up rows and down columns by MLP columns, O columns by heads, the
    embedding's and the LM head's rows by vocabulary; a tied LM head's are the embedding's, as
    ``lm_head.weight``); the others (norms) are whole on every rank. Raises ValueError naming the
    size that does not split (:meth:`mk.models.blocks.ModelShape.shard`)."""
    shard = config.to_model_shape().shard(tp)  # (refuses what does not split)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"rank must be an int in [0, tp={tp}), got {rank!r}")
    d = config.head_dim
    share = {"q": shard.heads * d, "k": shard.kv_heads * d, "v": shard.kv_heads * d, "o": shard.heads * d,
             "gate": shard.intermediate, "up": shard.intermediate, "down": shard.intermediate}
    out = {}
    for name in expected_shapes(config):
        for suffix, dim in _TP_SPLITS.items():
            if name.endswith(suffix):
                n = share[suffix.split(".")[1].split("_")[0]]
                out[name] = (dim, rank * n, (rank + 1) * n)
    v = config.vocab_size // tp
    out["model.embed_tokens.weight"] = out["lm_head.weight"] = (0, rank * v, (rank + 1) * v)
    return out


def shard_tensor(name: str, t: torch.Tensor, slices: dict[str, tuple[int, int, int]]) -> torch.Tensor:
    """Tensor ``name``'s share in ``slices`` (:func:`tp_slices`), a view; itself when whole."""
    if name not in slices:
        return t
    dim, a, b = slices[name]
    return t.narrow(dim, a, b - a)


def shard_weights(weights: dict[str, torch.Tensor], slices: dict[str, tuple[int, int, int]]) -> dict[str, torch.Tensor]:
    """Whole-model weights cut to one rank's share (:func:`tp_slices`), contiguous, a quantized
    weight's scales with it (:func:`shard_scale`); a tied LM head's share comes from the
    embedding."""
    def cut(name, t):
        if name.endswith(SCALE_SUFFIX):
            return shard_scale(name.removesuffix(SCALE_SUFFIX), t, slices)
        return shard_tensor(name, t, slices).contiguous() if name in slices else t

    out = {name: cut(name, t) for name, t in weights.items()}
    if "lm_head.weight" in slices and "lm_head.weight" not in weights:
        out["lm_head.weight"] = shard_tensor("lm_head.weight", weights["model.embed_tokens.weight"], slices).contiguous()
    return out


def shard_scale(weight: str, scale: torch.Tensor, slices: dict[str, tuple[int, int, int]]) -> torch.Tensor:
    """The share in ``slices`` (:func:`tp_slices`) of weight ``weight``'s float32 scales (mk's
    format: ``[N]`` per channel, ``[N, ceil(K/128)]`` per row and 128 columns), contiguous:
    the weight's rows' scales where its rows are split; where its columns are, per-channel
    scales whole and block scales the split's blocks (ValueError unless it starts on one)."""
    if weight not in slices:
        return scale
    dim, a, b = slices[weight]
    if dim == 0:
        return scale[a:b].contiguous()
    if scale.dim() == 1:
        return scale
    if a % SCALE_BLOCK:
        raise ValueError(f"{weight}: a rank's columns [{a}, {b}) do not start on a block of {SCALE_BLOCK}: "
                         f"its block scales do not split over the ranks")
    return scale[:, a // SCALE_BLOCK:-(-b // SCALE_BLOCK)].contiguous()


def check_tp_format(config: LlamaConfig, tp: int, fmt: str) -> None:
    """ValueError naming the size when weights in format ``fmt`` do not split over ``tp``
    ranks: a block-scaled (``fp8-block``) projection split by columns (O by heads, down by
    MLP columns) must give each rank whole 128-column blocks."""
    if tp == 1 or weight_format(fmt).scales != "block":
        return
    shard = config.to_model_shape().shard(tp)
    for what, cols in (("o_proj", shard.heads * config.head_dim), ("down_proj", shard.intermediate)):
        if cols % SCALE_BLOCK:
            raise ValueError(f"{fmt} weights split over tp={tp} ranks give each rank {cols} of {what}'s input "
                             f"columns, not a multiple of the {SCALE_BLOCK}-column scale blocks; use fewer ranks "
                             f"or quantize per channel (fp8)")


# --------------------------------------------------------------------------- loading


def _weight_files(folder: str) -> dict[str, str]:
    """Tensor name -> safetensors file that holds it, from the index or the single file."""
    folder = check_folder(folder)
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.lexists(index_path):
        try:
            weight_map = json.loads(read_text_file(index_path, MAX_INDEX_BYTES))["weight_map"]
        except FileNotFoundError:
            raise ValueError(f"{index_path}: a link to nothing") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path}: not a safetensors index with a weight_map ({e!r})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: weight_map must be an object")
        for name, shard in weight_map.items():
            # A shard is a file of the folder, named plainly: an index naming a path elsewhere
            # ("../x", "/etc/x") would read whatever that is.
            if (not isinstance(shard, str) or not shard or shard in (".", "..") or "/" in shard or "\\" in shard
                    or "\0" in shard):
                raise ValueError(f"{index_path}: tensor {name!r} is in {shard!r}, which is not a file name of "
                                 f"the checkpoint folder")
        files = {name: os.path.join(folder, shard) for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not os.path.lexists(shard):
                raise ValueError(f"{index_path} names shard {os.path.basename(shard)!r}, which is missing "
                                 f"from {folder!r}")
        return files
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.lexists(single):  # (an unreadable or dangling one is reported by _read_headers)
        return {}   # names come from the file's own header
    others = sorted(f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".safetensors")))
    hint = f" (found {others}; mk reads Hugging Face safetensors only)" if others else ""
    raise ValueError(f"no weights in {folder!r}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _read_headers(paths: list[str]) -> dict[str, dict[str, tuple[list[int], str]]]:
    """File -> {tensor name: (shape, dtype)}, from the safetensors headers only (no data read)."""
    headers = {}
    for path in paths:
        _check_readable(path)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                headers[path] = {}
                for name in f.keys():
                    sl = f.get_slice(name)
                    headers[path][name] = (list(sl.get_shape()), sl.get_dtype())
        except Exception as e:   # safetensors raises its own error type on truncated/corrupt files
            raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None
    return headers


def _check_readable(path: str) -> None:
    """ValueError naming ``path`` and what the OS said (missing, permission denied, a folder)
    when it cannot be opened for reading; safetensors' own errors do not tell these apart
    from a corrupt file."""
    try:
        check_regular_file(path)
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None


#: Tensors a checkpoint may hold that mk has no use for, and rightly so: rotary tables that
#: older conversions saved (mk computes its own from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _unused_tensors(names, config: LlamaConfig, scales: dict[str, str]) -> list[str]:
    """Names of a checkpoint's tensors that a model of ``config`` would not read, other than
    :data:`_IGNORED_SUFFIXES`, a tied LM head's copy of the embedding (transformers ties them
    on load too), a quantized projection's scales (``scales``: weight -> its scales' name)
    and a quantized checkpoint's activation scales: a bias Llama does not have, a norm of
    another family. Running without them would compute another model than the checkpoint
    describes."""
    expected = expected_shapes(config)
    allowed = ({"lm_head.weight"} if config.tie_word_embeddings else set()) | set(scales.values())
    ignored = _IGNORED_SUFFIXES + (UNUSED_SUFFIXES if scales else ())
    return sorted(n for n in names if n not in expected and n not in allowed and not n.endswith(ignored))


def load_weights(
    folder: str | os.PathLike, config: LlamaConfig, *, device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None, progress: bool = True, shard: dict[str, tuple[int, int, int]] | None = None,
    quantization: CheckpointQuantization | None = None,
) -> dict[str, torch.Tensor]:
    """Load a Hugging Face Llama checkpoint's weights (``model.safetensors`` or sharded).

    Args:
        folder: the checkpoint folder (``model.safetensors``, or ``model.safetensors.index.json``
            and its shards).
        config: the model's config; decides which tensors must be there and their shapes.
        device: where the tensors go.
        dtype: the dtype they are converted to; ``None`` keeps the stored dtype.
        progress: show a tqdm bar over the tensors.
        shard: one tensor-parallel rank's share (:func:`tp_slices`): those tensors are read
            as slices of the file, never whole.
        quantization: how the checkpoint stores its quantized projections (config.json's
            ``quantization_config``, :func:`mk.models.quantization.read_quantization`).

    Returns:
        ``{name: tensor}`` for exactly :func:`expected_shapes`'s names; a rotary table
        (``rotary_emb.inv_freq``) or a tied ``lm_head.weight`` in the checkpoint is skipped.
        A quantized projection ``name`` holds its FP8 values (float32 holding them off a
        GPU) and ``name + "_scale"`` its float32 scales in mk's format (:data:`SCALE_SUFFIX`).

    Raises:
        ValueError naming the file or tensor: missing folder or weight file, a file the OS
        will not let this process read (what it said), a shard the index names but the
        folder lacks, a truncated or corrupt file, a missing tensor, a tensor the config's
        model would not use (e.g. a bias Llama does not have), a tensor of the wrong shape or
        a non-float dtype, FP8 values without a quantization config, a quantized weight
        without its scales or with scales of the wrong shape, zero or not finite, a tensor
        holding NaN or Inf (also after the conversion to ``dtype``: a value beyond its
        range). Every header is checked before any tensor data is read or moved to ``device``.
    """
    folder = os.fspath(folder)
    mapped = _weight_files(folder)
    paths = sorted(set(mapped.values())) if mapped else [os.path.join(folder, SINGLE_FILE)]
    headers = _read_headers(paths)
    where = {name: path for path, names in headers.items() for name in names}
    # With an index, trust it for which shard holds a tensor, but check that the shard really does.
    for name, path in mapped.items():
        if name not in headers[path]:
            raise ValueError(f"{os.path.join(folder, INDEX_FILE)} says {name!r} is in "
                             f"{os.path.basename(path)!r}, but that file does not hold it")
        where[name] = path

    expected = expected_shapes(config)
    scales = _quantized_weights(config, quantization)
    _check_headers(folder, config, quantization, headers, where, expected, scales)
    storage = quantization.format.storage_dtype(torch.device(device), dtype or torch.float32) if scales else None

    weights: dict[str, torch.Tensor] = {}
    with tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=not progress) as bar:
        for path in paths:   # one open per file, in file order
            names = [n for n in expected if where[n] == path]
            scale_names = {w: s for w, s in scales.items() if where[s] == path}
            if not names and not scale_names:
                continue
            with safe_open(path, framework="pt", device="cpu") as f:
                for weight, scale_name in scale_names.items():   # (small: read whole, checked, then cut)
                    N, K = expected[weight]
                    try:
                        stored = f.get_tensor(scale_name)
                    except Exception as e:
                        raise ValueError(f"{path}: reading tensor {scale_name!r} failed: {e}") from None
                    scale = quantization.to_format(weight, stored, N, K)
                    weights[weight + SCALE_SUFFIX] = shard_scale(weight, scale, shard or {}).to(device)
                for name in names:
                    try:
                        t = _read(f, name, (shard or {}).get(name))
                    except Exception as e:
                        raise ValueError(f"{path}: reading tensor {name!r} failed: {e}") from None
                    t = t.to(device=device, dtype=storage if name in scales else dtype)
                    weights[name] = _finite(t, name, path)
                    bar.update(1)
    out = {name: weights[name] for name in expected}
    out.update({w + SCALE_SUFFIX: weights[w + SCALE_SUFFIX] for w in scales})
    if shard and "lm_head.weight" in shard and "lm_head.weight" not in out:  # tied: the embedding's rows
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # (read as the same share)
    return out


def _check_headers(folder: str, config: LlamaConfig, quantization: CheckpointQuantization | None,
                   headers: dict, where: dict[str, str], expected: dict[str, tuple[int, ...]],
                   scales: dict[str, str]) -> None:
    """What the safetensors headers say against what ``config``'s model needs (``expected``
    shapes; ``scales``: the quantized weights and their scales' names), before any tensor
    data is read: ValueError naming the first missing, unused, misshapen or mistyped tensor."""
    missing = [n for n in expected if n not in where] + [s for s in scales.values() if s not in where]
    if missing:
        raise ValueError(f"checkpoint {folder!r} lacks tensor(s) {_some(missing)}")
    if quantization is None:
        fp8 = [n for n in [*expected, *sorted(where)] if n in where and headers[where[n]][n][1] == _FP8_DTYPE]
        if fp8:
            raise ValueError(f"{where[fp8[0]]}: tensor {fp8[0]!r} has dtype {_FP8_DTYPE}; config.json has no "
                             f"quantization_config that says how to read it (its scales, its format)")
    unused = _unused_tensors(where, config, scales)
    if unused:
        raise ValueError(f"checkpoint {folder!r} holds tensor(s) a {config.MODEL_TYPE} model of this config does not "
                         f"use: {_some(unused)}; running without them would compute another model than the "
                         f"checkpoint's (is config.json's model_type right?)")
    for name, shape in expected.items():
        got, st_dtype = headers[where[name]][name]
        if tuple(got) != shape:
            raise ValueError(f"{where[name]}: tensor {name!r} has shape {tuple(got)}, expected {shape} "
                             f"for this config")
        want = {_FP8_DTYPE} if name in scales else _FLOAT_DTYPES
        if st_dtype not in want:
            raise ValueError(f"{where[name]}: tensor {name!r} has dtype {st_dtype}; "
                             + (f"the checkpoint's quantization_config ({quantization.method}) stores it as "
                                f"{_FP8_DTYPE}" if name in scales else
                                "config.json has no quantization_config that says how to read it"
                                if st_dtype == _FP8_DTYPE else "mk loads float weights only"))


def _quantized_weights(config: LlamaConfig, quantization: CheckpointQuantization | None) -> dict[str, str]:
    """The weights a checkpoint stores quantized, each with its scales' name there; ValueError
    when it leaves some projections of the layers unquantized and not others (mk runs every
    layer's projections in one format)."""
    if quantization is None:
        return {}
    names = projection_weights(config, lm_head=not config.tie_word_embeddings)
    out = {n: n + quantization.scale_suffix for n in names if quantization.quantizes(n.removesuffix(".weight"))}
    layers = [n for n in names if n != "lm_head.weight"]
    plain = [n for n in layers if n not in out]
    if plain and len(plain) < len(layers):
        raise ValueError(f"the checkpoint's quantization_config leaves {_some(plain)} unquantized and quantizes the "
                         f"other projections; mk runs every layer's projections in one format")
    return out


def _some(names: list[str], n: int = 5) -> str:
    """The first ``n`` names, and how many more."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _finite(t: torch.Tensor, name: str, path: str) -> torch.Tensor:
    """``t``, once every value is finite (checked where it now lives: on a GPU, at its speed);
    ValueError naming the tensor otherwise: a corrupt checkpoint, or values beyond the range
    of the dtype it was converted to."""
    if t.dtype == torch.float8_e4m3fn:   # (e4m3fn has no Inf; NaN is every bit of the magnitude set)
        bad = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
        if bad:
            raise ValueError(f"{path}: tensor {name!r} holds {bad} NaN value(s): the checkpoint is corrupt")
        return t
    # (min and max propagate NaN, and need no temporary the tensor's size)
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{path}: tensor {name!r} holds {bad} NaN or Inf value(s) (in {str(t.dtype).replace('torch.', '')}"
                         f"): the checkpoint is corrupt, or its values overflow that dtype")
    return t


def _read(f, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    """Tensor ``name`` of an open safetensors file, or only its slice ``(dim, start, stop)``."""
    if part is None:
        return f.get_tensor(name)
    dim, a, b = part
    sl = f.get_slice(name)
    return (sl[a:b] if dim == 0 else sl[:, a:b]).contiguous()


# --------------------------------------------------------------------------- random and save


def random_weights(
    config: LlamaConfig, *, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    shard: dict[str, tuple[int, int, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Random weights for ``config``, the same for the same seed on every machine.

    Drawn on the CPU (so a seed means the same numbers everywhere), then moved. Matrices are
    normal with std 0.02 as Hugging Face initializes them; norm weights are
    ``1 + 0.1 * normal`` rather than ones, so a test catches a norm weight applied wrong,
    and biases ``0.1 * normal`` rather than zeros, likewise. ``shard``: one rank's slices
    (:func:`tp_slices`); each tensor is cut as it is drawn, so the whole model is never
    held, and the result equals :func:`shard_weights` of the whole model's.
    """
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        w = 1.0 + 0.1 * w if _is_norm(name) else 0.1 * w if name.endswith(".bias") else 0.02 * w
        weights[name] = shard_tensor(name, w, shard or {}).to(device=device, dtype=dtype).contiguous()
    if shard is not None and "lm_head.weight" in shard and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # a tied head's share
    return weights


def save_weights(
    weights: dict[str, torch.Tensor], config: LlamaConfig, folder: str | os.PathLike, *, shard_bytes: int | None = None,
) -> list[str]:
    """Write a Hugging Face checkpoint folder: ``config.json`` and the weights as safetensors.

    One ``model.safetensors``, or with ``shard_bytes`` shards of at most that many bytes
    each (a tensor larger than that gets a shard of its own) plus
    ``model.safetensors.index.json``. A tied ``lm_head.weight`` is not written. Returns
    the paths of the weight files written. ``transformers``' ``from_pretrained`` reads the folder.
    """
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    expected = expected_shapes(config)
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ValueError(f"save_weights: weights lack {', '.join(missing[:5])}")
    # Only the config's tensors, each its own contiguous CPU copy (safetensors refuses shared storage).
    tensors = {n: weights[n].detach().to("cpu").contiguous().clone() for n in expected}
    if shard_bytes is None:
        path = os.path.join(folder, SINGLE_FILE)
        save_file(tensors, path, metadata={"format": "pt"})
        return [path]

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        paths.append(os.path.join(folder, fname))
        save_file(shard, paths[-1], metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(folder, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return paths


# --------------------------------------------------------------------------- weight formats

#: The projections of a layer whose weights a format applies to (the norms, the embedding and
#: the biases stay in the model's dtype).
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
#: The suffix of a weight's scales under its Hugging Face name (``...q_proj.weight_scale``).
SCALE_SUFFIX = "_scale"
#: What ``quantize=`` takes: the format each projection is stored in (FP8 e4m3 with a float32
#: scale per output channel, or per 128 x 128 block as Qwen's and DeepSeek's FP8 checkpoints).
QUANTIZE = {"fp8": "fp8", "fp8-block": "fp8-block"}


def projection_weights(config: LlamaConfig, lm_head: bool = True) -> list[str]:
    """The Hugging Face names of the projection weights a format applies to, in model order
    (with ``lm_head``: the LM head's too)."""
    names = [f"model.layers.{i}.{p}.weight" for i in range(config.num_hidden_layers) for p in PROJECTIONS]
    return names + (["lm_head.weight"] if lm_head else [])


def check_quantize(quantize) -> str | None:
    """``quantize`` (None, or a key of :data:`QUANTIZE`), refused otherwise, naming it."""
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize must be None or one of {sorted(QUANTIZE)}, got {quantize!r}")
    return quantize


def quantize_weights(weights: dict[str, torch.Tensor], config: LlamaConfig, quantize: str,
                     lm_head: bool = False) -> dict[str, torch.Tensor]:
    """``weights`` (Hugging Face names, float) with every projection (and with ``lm_head`` the
    LM head, a tied one as a copy of the embedding's) stored in format ``quantize``: each
    ``name`` FP8 values (float32 holding them off a GPU) and ``name + "_scale"`` its float32
    scales (:meth:`mk.tasks.linear.format.WeightFormat.quantize`), computed where the tensor
    is; one already stored so (with its scales) is kept. Returns a new dict; the others are
    kept as they are."""
    fmt = weight_format(QUANTIZE[check_quantize(quantize)])
    out = dict(weights)
    if lm_head and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    for name in projection_weights(config, lm_head):
        if name + SCALE_SUFFIX in out:
            continue
        q, scale = fmt.quantize(out[name])
        out[name] = q.to(fmt.storage_dtype(q.device, out[name].dtype))
        out[name + SCALE_SUFFIX] = scale
    return out


def weight_formats(weights: dict[str, torch.Tensor], config: LlamaConfig) -> tuple[str, str]:
    """The formats (:data:`mk.tasks.linear.format.FORMATS` names) of the projections and of the
    LM head of ``weights``, from the scales they carry (per channel ``[N]``, per row and 128
    columns ``[N, K / 128]``); ValueError naming a projection stored otherwise than the rest."""
    def fmt(name: str) -> str:
        scale = weights.get(name + SCALE_SUFFIX)
        return "plain" if scale is None else FP8_CHANNEL.name if scale.dim() == 1 else FP8_BLOCK.name

    names = projection_weights(config, lm_head=False)
    layers = fmt(names[0])
    odd = [n for n in names if fmt(n) != layers]
    if odd:
        raise ValueError(f"every projection must be stored in one format: {names[0]} is {layers}, but "
                         f"{_some(odd)} {'is' if len(odd) == 1 else 'are'} not")
    return layers, fmt("lm_head.weight")
