"""``DecoderModel``: a Hugging Face decoder that decodes through the megakernel, the class
every family (:class:`~mk.models.llama.Llama`, :class:`~mk.models.mistral.Mistral`,
:class:`~mk.models.qwen2.Qwen2`, :class:`~mk.models.qwen3.Qwen3`) is; a family names its
config class, whose fields and flags say what its layers add.

Prefill runs the prompts, packed without padding, through the layers in chunks of up to
8192 tokens (:mod:`mk.models.prefill`: precision modes, the workspace bound). Each decode step is **one launch** of the planned
megakernel: every layer, the final norm, the LM head, the next-token choice and the
bookkeeping (the token appended to a device-side history, the position advanced), so
step after step is enqueued with no host work; the host reads the history in blocks to
stream tokens and to stop at EOS.

    model = AutoModel.from_pretrained("path/to/checkpoint", max_batch_size=8, max_seq_len=4096)
    out = model.generate(input_ids, max_new_tokens=64)

Greedy decoding and temperature sampling run inside the megakernel. Top-k / top-p
sampling lowers the step to end at the logits, then runs mk's radix-select sampler and
the append task after the launch.
"""

from __future__ import annotations

import functools
import numbers
import os
import time
from dataclasses import dataclass, replace
from typing import ClassVar, Iterator

import numpy as np
import torch

from mk.tasks import default_device, supported_dtypes
from mk.tasks.linear import interleave_gate_up
from mk.tasks.rope import deinterleave_rotary, interleave_rotary, rope_inv_freq
from mk.tasks.sample import _check_counter, _check_temperature, _check_top_k, _check_top_p

from mk.models.blocks import MAX_BATCH, weight_key

from .config import LlamaConfig, read_config_json
from . import prefill as _prefill
from .quantization import CheckpointQuantization, read_quantization
from mk.tasks.linear.format import weight_format

from mk.engine.prefill import Prefiller, per_token
from mk.engine.ranks import Ranks
from mk.engine.steps import Decoder, Steps
from mk.engine.stream import decode

from .weights import (QUANTIZE, SCALE_SUFFIX, check_quantize, check_tp_format, expected_shapes, load_weights,
                      quantize_weights, random_weights, tp_slices, weight_formats)

#: How a model picks each batch size's decode plan: the planner's best prediction, or
#: the fastest of its top plans timed on the device (:meth:`DecoderModel.plan`).
PLAN_MODES = ("predict", "measure")
def _check_plan_mode(plan_mode) -> None:
    if plan_mode not in PLAN_MODES:
        raise ValueError(f"plan_mode must be one of {PLAN_MODES}, got {plan_mode!r}")


#: Temperatures above 0 and below this decode greedily, as temperature 0 does: the draw is
#: ``argmax(logits / temperature + noise)``, and a logit divided by a temperature this small
#: or smaller (1e-45, a float32 denormal) overflows float32 into inf and NaN; well before it
#: the noise (a few units) no longer moves the argmax. vLLM's threshold too.
MIN_TEMPERATURE = 1e-5


def _check_sampling(temperature, top_k, top_p) -> tuple[float, int | None, float | None]:
    """The sampling arguments checked (mk.tasks.sample's checks, naming each), a temperature
    below :data:`MIN_TEMPERATURE` made 0 (greedy)."""
    temperature, top_k, top_p = _check_temperature(temperature), _check_top_k(top_k), _check_top_p(top_p)
    return (0.0 if temperature < MIN_TEMPERATURE else temperature), top_k, top_p


#: The sequence lengths decode steps are planned for: a request's step is planned for the
#: first of these (or max_seq_len) that its longest sequence can reach. Decode attention is
#: cut into KV splits for the planned length, and the splits a shorter sequence leaves empty
#: still cost a task each: the 1B batch-8 step at 6-60 positions measured 1.233 ms with the
#: 4 splits planned for 1024 and 1.214 with 1 (H100).
PLAN_LENGTHS = (64, 256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True, repr=False)
class StepPlan:
    """What :meth:`DecoderModel.plan` returns: the :class:`~mk.planner.search.Plan`, the op
    graph it was made for and the device it was planned on. Unpacks as ``plan, graph``;
    shown (``repr``, ``print``) as the plan's explanation, a line per op."""

    plan: object  # mk.planner.search.Plan
    graph: object  # mk.planner.graph.OpGraph
    device: object  # mk.planner.device.DeviceSpec

    def __iter__(self):
        return iter((self.plan, self.graph))

    def __repr__(self) -> str:
        from mk.planner.search import Plan

        plan = self.plan
        if not plan.estimates:  # (a plan read from the cache): each op's estimate, for the listing
            plan = Plan.from_json(plan.to_json(), self.graph, self.device)
        head, _, ops = plan.explain().partition("\n")
        return "\n".join([head, f"  weights: {self.describe_weights()}"] + ([ops] if ops else []))

    def describe_weights(self) -> str:
        """How the step's weights are stored, as the graph was planned for them: the
        projections' format and the LM head's (:func:`describe_formats`; weights without a
        format are named by their element size, which is all the planner prices)."""
        dims = {n.name: n.dims for n in self.graph.nodes}
        layers = next((d.get("w_format", "plain") for name, d in dims.items() if name.endswith(".qkv")), "plain")
        lm_head = dims.get("lm_head", {}).get("w_format", "plain")
        return describe_formats(layers, lm_head, plain=f"{8 * self.graph.dtype_bytes}-bit")

    __str__ = __repr__


#: What each quantized weight format (:data:`mk.tasks.linear.format.FORMATS`) stores, as a
#: plan's listing and the CLI's model line say it.
FORMAT_DETAILS = {"fp8": "e4m3, per-channel scales", "fp8-block": "e4m3, a scale per 128x128 block"}


def describe_formats(layers: str, lm_head: str, plain: str = "plain") -> str:
    """The weights' formats as a user reads them, from the format names of the projections
    and of the LM head: ``"fp8 (e4m3, per-channel scales; LM head bfloat16)"``,
    ``"fp8-block (e4m3, a scale per 128x128 block; LM head included)"``, or ``plain`` (the
    name of the dtype weights without a format are stored in) where nothing is quantized.
    The embedding and the norms are always stored without a format."""
    def name(fmt: str) -> str:
        return plain if not weight_format(fmt).quantized else fmt

    details = [FORMAT_DETAILS[layers]] if weight_format(layers).quantized else []
    if lm_head != layers:
        details.append(f"LM head {name(lm_head)}" + (f": {FORMAT_DETAILS[lm_head]}" if lm_head in FORMAT_DETAILS
                                                    else ""))
    elif details:
        details.append("LM head included")
    return name(layers) + (f" ({'; '.join(details)})" if details else "")


class DecoderModel:
    """A decoder whose decode steps each run as one megakernel launch.

    Build it with :meth:`from_pretrained` (a Hugging Face checkpoint folder) or
    :meth:`from_config` (random weights). ``device`` defaults to CUDA when there is a GPU
    (else the CPU, through the Triton interpreter); ``dtype`` to bfloat16 on CUDA and
    float32 on the CPU. The KV cache for ``max_batch_size`` sequences of ``max_seq_len``
    tokens is allocated here, once, in ``kv_dtype`` (default: ``dtype``). The decode
    step's activations are float32 whatever the dtype: weights and the cache are all that
    is rounded, and a ``kv_dtype=torch.float32`` cache leaves only the weights (twice the
    cache memory; on a random-weight Llama-3-8B the bf16 cache alone puts the logits ~2%
    off float32).

    Prefill (:mod:`mk.models.prefill`) packs the prompts without padding and runs them in
    chunks that fit ``prefill_workspace`` bytes of activations (default: 5% of the GPU's
    memory, at most 2 GiB; reported by :meth:`footprint`). ``prefill_precision="fast"``
    (default) multiplies in the weights' dtype with float32 accumulation and a float32
    residual stream, on cuBLAS and SDPA kernels on a GPU; ``"exact"`` keeps every
    activation float32 as the decode step does (logits closest to float32, about half the
    tensor-core rate).

    ``plan_mode="measure"`` times the planner's top plans on the device the first time a
    batch size decodes and keeps the fastest (cached on disk like predicted plans). Under
    tensor parallelism (torchrun, CUDA) every rank times rank 0's candidates at once and
    they keep the one whose slowest rank is fastest; the candidates include the best plan
    with its sums over the ranks in tiles of their own, which the cost model cannot tell
    from summing in the projections' tiles (docs/PERFORMANCE.md).
    A request's steps are planned for the length its sequences can reach (the first of
    :data:`PLAN_LENGTHS` at or above prompt + new tokens, at most ``max_seq_len``); one
    compiled step is kept per batch size and way of choosing the next token.
    """

    #: The family's config class (its fields, flags and config.json checks).
    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], *, device=None, dtype=None,
                 max_batch_size: int = 8, max_seq_len: int | None = None, device_spec=None, name: str | None = None,
                 tokenizer=None, plan_mode: str = "predict", kv_dtype=None, prefill_precision: str = "fast",
                 prefill_workspace: int | None = None, tp: int = 1, rank: int = 0):
        self._check_config(config)
        _check_device_spec(device_spec)
        name = config.MODEL_TYPE if name is None else name
        self.device, self.dtype, self.kv_dtype = _resolve_target(device, dtype, kv_dtype)
        max_seq_len = _check_sizes(config, max_batch_size, max_seq_len)
        _check_plan_mode(plan_mode)
        self.config, self.name, self.tokenizer, self.plan_mode = config, name, tokenizer, plan_mode
        self.prefiller = Prefiller(self, prefill_precision, _prefill.default_workspace(self.device)
                                   if prefill_workspace is None else prefill_workspace)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        # Tensor parallelism: this rank's share of the model (weights cut by tp_slices). The
        # projections' and the LM head's formats are the weights' own (their scales).
        self.formats = dict(zip(("layers", "lm_head"), weight_formats(weights, config)))
        self.shape = replace(config.to_model_shape(name, dtype_bytes=self.dtype.itemsize,
                                                   kv_dtype_bytes=self.kv_dtype.itemsize),
                             linear_format=self.formats["layers"], lm_head_format=self.formats["lm_head"]).shard(tp)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
            raise ValueError(f"rank must be an int in [0, tp={tp}), got {rank!r}")
        self.tp, self.rank = tp, rank
        self.ranks = Ranks(tp, rank, self.device)
        if tp > 1 and plan_mode == "measure" and self.device.type != "cuda":
            raise ValueError("plan_mode='measure' under tensor parallelism times the plans on the ranks' GPUs "
                             "together (CUDA tensors, torch.distributed initialized); on the CPU the ranks plan by "
                             "prediction")
        # Their collectives pair up only where every rank cuts its prefill into the same
        # chunks and plans the same steps.
        self.ranks.check_alike({"dtype": str(self.dtype), "kv_dtype": str(self.kv_dtype),
                                "max_batch_size": max_batch_size, "max_seq_len": max_seq_len,
                                "prefill_precision": self.prefill_precision,
                                "prefill_workspace": self.prefill_workspace, "plan_mode": plan_mode})
        self.weights = self._pack(weights)
        c = config
        cache_shape = (c.num_hidden_layers, max_batch_size, self.shape.kv_heads, max_seq_len, c.head_dim)
        self.k_cache = torch.zeros(cache_shape, dtype=self.kv_dtype, device=self.device)
        self.v_cache = torch.zeros(cache_shape, dtype=self.kv_dtype, device=self.device)
        self._device_spec = device_spec
        #: The decode steps built, one per batch size and way of choosing the next token, over
        #: shared slots (:class:`~mk.engine.steps.Steps`).
        self.steps = Steps(self)
        self.last_decoder: Decoder | None = None  # the step the last stream() ran
        #: The running stream (a token of its own), from its first token until it finishes or
        #: is closed: it owns the KV cache and its step's state until then (see :meth:`stream`).
        self._streaming: object | None = None
        #: Seconds of the last request: prefill_s, decode_s, and the build phases it paid
        #: (plan_s, lower_s, compile_s, and share_s under tensor parallelism; 0 when its step
        #: was built before).
        self.last_stats: dict = {}
        #: Seconds spent building the model: load_s (from_pretrained). A step's build
        #: (plan_s, lower_s, compile_s) is reported by the request that paid it
        #: (:attr:`last_stats`, or :meth:`prepare`'s return).
        self.build_stats: dict = {}

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *, device=None, dtype=None, max_batch_size: int = 8,
                        max_seq_len: int | None = None, progress: bool = True, device_spec=None,
                        plan_mode: str = "predict", kv_dtype=None, prefill_precision: str = "fast",
                        prefill_workspace: int | None = None, tp: int = 1, quantize: str | None = None,
                        quantize_lm_head: bool = False) -> "DecoderModel":
        """Load ``folder`` (config.json + model.safetensors, or shards with an index), or a
        GGUF file (:mod:`mk.models.gguf`: its metadata as the config, its tensors
        dequantized, its tokenizer; ``tp`` and ``quantize`` apply to it as to a folder).

        Everything is checked (config, files, every tensor's name and shape) before any
        weight reaches the device; errors name the file or tensor. A ``tokenizer.json`` in
        the folder enables text prompts (:attr:`tokenizer`). ``kv_dtype``, ``prefill_precision``
        and ``prefill_workspace``: see :class:`DecoderModel`.

        ``tp``: tensor parallelism over that many GPUs, one process each (``torchrun
        --nproc-per-node tp``; torch.distributed is set up here if the caller has not).
        Each rank reads only its share of the weights (sliced reads,
        :func:`mk.models.weights.tp_slices`) onto its own GPU; a rank that loaded another
        model or config is refused on every rank.

        ``quantize="fp8"``: the projections are stored in FP8 (e4m3) with a float32 scale per
        output channel, quantized as they load (:mod:`mk.tasks.linear.format`);
        ``"fp8-block"``: one scale per 128 x 128 block. The LM head too with
        ``quantize_lm_head``. The decode step reads one byte a weight; its activations stay
        float32 (weight-only quantization).

        An FP8 checkpoint (config.json's ``quantization_config``: compressed-tensors
        ``float-quantized``, or transformers' ``fp8`` with 128 x 128 blocks; see
        :mod:`mk.models.quantization`) loads in its own format, weight-only as well;
        ``quantize`` may then only name that format, and ``quantize_lm_head`` quantizes an
        LM head the checkpoint left unquantized.
        """
        from .gguf import is_gguf_path, read_gguf
        from .tokenizer import load_tokenizer

        check_quantize(quantize)
        _check_bool("quantize_lm_head", quantize_lm_head)
        _check_device_spec(device_spec)
        _check_plan_mode(plan_mode)
        _prefill.check_precision(prefill_precision)
        gguf = read_gguf(folder) if is_gguf_path(folder) else None   # (a file: GGUF; a folder: Hugging Face's)
        d, path = (gguf.config, gguf.path) if gguf else read_config_json(folder)
        config = cls.config_class.from_dict(d, path)
        stored = None if gguf else read_quantization(d, path)   # (a GGUF's tensors dequantize to float)
        quantize = _stored_or_quantize(stored, quantize, quantize_lm_head, path)
        max_seq_len = _check_sizes(config, max_batch_size, max_seq_len)
        if quantize is not None:
            check_tp_format(config, tp, QUANTIZE[quantize])
        _resolve_target(device, dtype, kv_dtype)  # (refused before any rank joins)
        rank, device = _tp_setup(config, tp, device)
        device, dtype, kv_dtype = _resolve_target(device, dtype, kv_dtype)
        if prefill_workspace is not None:  # refused before any weight is read
            _prefill.PrefillBudget.make(per_token(config, dtype, prefill_precision), prefill_workspace)
        _check_memory(config, device, dtype, kv_dtype, max_batch_size, max_seq_len, tp)
        t0 = time.perf_counter()
        load = gguf.load_weights if gguf else functools.partial(load_weights, folder, quantization=stored)
        weights = load(config, device=device, dtype=dtype, progress=progress and rank == 0,
                       shard=tp_slices(config, tp, rank) if tp > 1 else None)
        if quantize is not None:
            weights = quantize_weights(weights, config, quantize, lm_head=quantize_lm_head)
        model = cls(config, weights, device=device, dtype=dtype, max_batch_size=max_batch_size,
                    max_seq_len=max_seq_len, device_spec=device_spec, name=os.path.basename(os.path.normpath(folder)),
                    tokenizer=gguf.tokenizer() if gguf else load_tokenizer(folder), plan_mode=plan_mode, kv_dtype=kv_dtype,
                    prefill_precision=prefill_precision, prefill_workspace=prefill_workspace, tp=tp, rank=rank)
        model.build_stats["load_s"] = time.perf_counter() - t0
        return model

    @classmethod
    def from_config(cls, config: LlamaConfig, *, seed: int = 0, device=None, dtype=None, max_batch_size: int = 8,
                    max_seq_len: int | None = None, device_spec=None, name: str | None = None,
                    plan_mode: str = "predict", kv_dtype=None, prefill_precision: str = "fast",
                    prefill_workspace: int | None = None, tp: int = 1, quantize: str | None = None,
                    quantize_lm_head: bool = False) -> "DecoderModel":
        """A model of any shape with random weights (deterministic for ``seed``); ``tp``,
        ``quantize`` and ``quantize_lm_head``: as :meth:`from_pretrained` (every rank draws the
        same model, keeping only its share)."""
        cls._check_config(config)
        check_quantize(quantize)
        _check_bool("quantize_lm_head", quantize_lm_head)
        _check_device_spec(device_spec)
        _check_counter("seed", seed)
        _check_plan_mode(plan_mode)
        _prefill.check_precision(prefill_precision)
        max_seq_len = _check_sizes(config, max_batch_size, max_seq_len)
        if quantize is not None:
            check_tp_format(config, tp, QUANTIZE[quantize])
        _resolve_target(device, dtype, kv_dtype)  # (refused before any rank joins)
        rank, device = _tp_setup(config, tp, device)
        device, dtype, kv_dtype = _resolve_target(device, dtype, kv_dtype)
        _check_memory(config, device, dtype, kv_dtype, max_batch_size, max_seq_len, tp)
        weights = random_weights(config, seed=seed, device=device, dtype=dtype,
                                 shard=tp_slices(config, tp, rank) if tp > 1 else None)
        if quantize is not None:
            weights = quantize_weights(weights, config, quantize, lm_head=quantize_lm_head)
        name = f"random-{config.MODEL_TYPE}" if name is None else name
        return cls(config, weights, device=device, dtype=dtype, max_batch_size=max_batch_size,
                   max_seq_len=max_seq_len, device_spec=device_spec, name=name, plan_mode=plan_mode,
                   kv_dtype=kv_dtype, prefill_precision=prefill_precision, prefill_workspace=prefill_workspace,
                   tp=tp, rank=rank)

    @classmethod
    def _check_config(cls, config) -> None:
        """TypeError unless ``config`` is this family's config (an instance of :attr:`config_class`)."""
        if type(config) is not cls.config_class:
            got = type(config).__name__
            raise TypeError(f"{cls.__name__} runs a {cls.config_class.__name__}, got {'None' if config is None else 'a ' + got}"
                            + (" (mk.models.AutoModel picks the family)" if isinstance(config, LlamaConfig) else ""))

    def _pack(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face tensors -> the megakernel's (fused QKV and its bias, interleaved
        gate/up), under the names the decode graph binds (:func:`mk.models.blocks.weight_key`)."""
        c, d = self.config, self.config.head_dim

        def get(name, dtype=None):
            # FP8 projections keep their storage type (float32 holding them off a GPU), their
            # scales float32; everything else is stored in the model's dtype.
            dtype = dtype or (hf[name].dtype if hf[name].dtype in (torch.float8_e4m3fn,) else self.dtype)
            t = hf[name].to(device=self.device, dtype=dtype).contiguous()
            # The megakernel's buffers start 16-byte aligned (vector loads, TMA); a tensor
            # read from safetensors as is may start 8 bytes off. A view of a larger tensor
            # (block scales cut to the weight's rows) would keep all of it alive.
            whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
            return t if t.data_ptr() % 16 == 0 and whole else t.clone()

        def proj(name):
            """A projection's weight in its format's storage type, and its scales (or None)."""
            fmt = weight_format(self.formats["lm_head" if name == "lm_head.weight" else "layers"])
            scale = get(name + SCALE_SUFFIX, torch.float32) if fmt.quantized else None
            return get(name, fmt.storage_dtype(self.device, self.dtype)), scale

        def rotary(t):  # q / k rows (or a bias, or a head's norm weight) in the interleaved rotary layout
            return interleave_rotary(t, d) if t.dim() == 2 else interleave_rotary(t[:, None], d)[:, 0]

        def packed(key, parts, arrange):
            """``w[key]`` = the projections ``parts`` arranged into one weight (rows permuted,
            stacked or interleaved), their scales arranged alike (a row's scales follow it)."""
            pieces = [proj(n) for n in parts]
            w[key] = arrange([q for q, _ in pieces]).contiguous()
            if pieces[0][1] is not None:
                w[key + ".scale"] = arrange([sc for _, sc in pieces]).contiguous()

        w = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight")}
        # (A tied LM head is the embedding, but one rank's share of it is its own tensor.)
        if "lm_head.weight" in hf:
            packed("lm_head", ["lm_head.weight"], lambda ts: ts[0])
        else:
            w["lm_head"] = w["embed"]
        for L in range(c.num_hidden_layers):
            p, l = f"model.layers.{L}.self_attn.", f"l{L}."
            w[l + "attn_norm"] = get(f"model.layers.{L}.input_layernorm.weight")
            # q and k rows in the interleaved rotary layout: RoPE then fuses into the QKV tiles.
            packed(l + "qkv", [p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"],
                   lambda ts: torch.cat([rotary(ts[0]), rotary(ts[1]), ts[2]]))
            if c.QKV_BIAS:
                w[l + "qkv.bias"] = torch.cat([rotary(get(p + "q_proj.bias")), rotary(get(p + "k_proj.bias")),
                                               get(p + "v_proj.bias")]).contiguous()
            if c.QK_NORM:
                w[l + "q_norm"], w[l + "k_norm"] = rotary(get(p + "q_norm.weight")), rotary(get(p + "k_norm.weight"))
            packed(l + "o_proj", [p + "o_proj.weight"], lambda ts: ts[0])
            m = f"model.layers.{L}."
            w[l + "mlp_norm"] = get(m + "post_attention_layernorm.weight")
            packed(l + "gate_up", [m + "mlp.gate_proj.weight", m + "mlp.up_proj.weight"], _interleave_rows)
            packed(l + "down", [m + "mlp.down_proj.weight"], lambda ts: ts[0])
        w = {weight_key(name): t for name, t in w.items()}
        w["inv_freq"] = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_dict).to(self.device)
        return w

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names: views of the packed tensors, except those
        of q and k (copies, put back from the interleaved rotary layout), and of projections
        stored in a format with scales (:attr:`formats`), which come dequantized (float32
        ``q * scale``: the float32 reference of what the model computes)."""
        c, w, d = self.config, self.weights, self.config.head_dim
        hq, hkv = c.num_attention_heads * d, c.num_key_value_heads * d

        def W(name):
            key = weight_key(name)
            scale = w.get(key + ".scale")
            if scale is None:
                return w[key]
            fmt = weight_format(self.formats["lm_head" if name == "lm_head" else "layers"])
            return fmt.dequantize(w[key], scale)

        def plain(t):
            return deinterleave_rotary(t, d) if t.dim() == 2 else deinterleave_rotary(t[:, None], d)[:, 0]

        out = {"model.embed_tokens.weight": W("embed"), "model.norm.weight": W("final_norm")}
        if not c.tie_word_embeddings or weight_key("lm_head") + ".scale" in w:  # (a quantized copy of a tied one)
            out["lm_head.weight"] = W("lm_head")
        for L in range(c.num_hidden_layers):
            p, l = f"model.layers.{L}.", f"l{L}."
            q, k, v = W(l + "qkv").split([hq, hkv, hkv])
            gate_up = W(l + "gate_up")
            out.update({p + "self_attn.q_proj.weight": plain(q), p + "self_attn.k_proj.weight": plain(k),
                        p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": W(l + "o_proj"),
                        p + "input_layernorm.weight": W(l + "attn_norm"),
                        p + "post_attention_layernorm.weight": W(l + "mlp_norm"),
                        p + "mlp.gate_proj.weight": gate_up[0::2],
                        p + "mlp.up_proj.weight": gate_up[1::2],
                        p + "mlp.down_proj.weight": W(l + "down")})
            if c.QKV_BIAS:
                q, k, v = W(l + "qkv.bias").split([hq, hkv, hkv])
                out.update({p + "self_attn.q_proj.bias": plain(q), p + "self_attn.k_proj.bias": plain(k),
                            p + "self_attn.v_proj.bias": v})
            if c.QK_NORM:
                out.update({p + "self_attn.q_norm.weight": plain(W(l + "q_norm")),
                            p + "self_attn.k_norm.weight": plain(W(l + "k_norm"))})
        return out

    # ------------------------------------------------------------------ planning

    def footprint(self) -> dict[str, int | str]:
        """Bytes this model holds on its device, and how its weights are stored.

        ``weights``: the bytes of every stored weight tensor (tied tensors once), scales
        included, as they are stored: FP8 projections one byte an element on a GPU, but four
        on the CPU, where their e4m3 values are held in float32 (the interpreter computes in
        float32); ``scale_bytes``: of those, the float32 scales of the projections stored in a
        format (0 without one); ``weight_format`` and ``lm_head_format``: the projections' and
        the LM head's format (:attr:`formats`: ``"plain"``, ``"fp8"`` or ``"fp8-block"``).
        ``kv_cache``; the most the prefill's activations take at once, ``prefill_workspace``
        (a full chunk's; see :attr:`prefill_budget`); and the outputs the captured prefill
        chunks keep now, ``prefill_graphs`` (at most :data:`~mk.models.prefill.MAX_GRAPHS`
        chunks of ``tokens x hidden`` float32, twice under tensor parallelism, with the
        staging buffer of the sums over the ranks; their activations share one memory pool
        the size of a chunk's workspace, held by PyTorch's allocator). Generation adds the
        decode steps' activations and state, a few tens of MiB."""
        def stored(tensors) -> int:  # (views of one storage, as a tied LM head is, count once)
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

        return {"weights": stored(self.weights.values()),
                "scale_bytes": stored(t for k, t in self.weights.items() if k.endswith(".scale")),
                "weight_format": self.formats["layers"], "lm_head_format": self.formats["lm_head"],
                "kv_cache": self.k_cache.numel() * self.k_cache.element_size() * 2,
                "prefill_workspace": self.prefill_budget.bound,
                "prefill_graphs": self.prefiller.graph_bytes()}

    @property
    def device_spec(self):
        """The :class:`~mk.planner.device.DeviceSpec` plans are made for: the live GPU, or
        on the CPU :meth:`~mk.planner.device.DeviceSpec.interpreter`."""
        if self._device_spec is None:
            from mk.planner.device import DeviceSpec

            self._device_spec = (DeviceSpec.from_gpu(self.device) if self.device.type == "cuda"
                                 else DeviceSpec.interpreter())
        return self._device_spec

    def plan_length(self, tokens: int) -> int:
        """The length a step is planned for when sequences reach ``tokens`` tokens: the first
        of :data:`PLAN_LENGTHS` at or above it, at most ``max_seq_len``. ``tokens`` is an int
        in ``[1, max_seq_len]`` (no sequence of this model gets longer); TypeError or
        ValueError naming it otherwise."""
        if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral):
            raise TypeError(f"tokens must be an int, got {type(tokens).__name__} {tokens!r}")
        if not 1 <= tokens <= self.max_seq_len:
            raise ValueError(f"tokens must be in [1, max_seq_len={self.max_seq_len}] (the longest a sequence of "
                             f"this model gets), got {tokens}")
        return min(next((n for n in PLAN_LENGTHS if n >= tokens), self.max_seq_len), self.max_seq_len)

    def plan(self, batch: int, kv_len: int | None = None, *, progress: bool = False) -> "StepPlan":
        """The plan of one decode step at ``batch`` for sequences of up to ``kv_len`` tokens
        (default ``max_seq_len``; cached on disk) and its op graph (a :class:`StepPlan`:
        ``plan, graph = model.plan(...)``; shown, it explains the plan): the planner's best
        predicted plan, or with ``plan_mode="measure"`` the fastest of its top plans timed on
        this device (:func:`mk.planner.search.pick_measured`). Any plan decodes every length
        up to ``max_seq_len`` correctly; ``kv_len`` is what it is fastest for."""
        from mk.planner.cache import cached_plan
        from mk.models.blocks import decode_graph

        kv_len = self.max_seq_len if kv_len is None else kv_len
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= self.max_batch_size:
            raise ValueError(f"batch must be an int in [1, max_batch_size={self.max_batch_size}], got {batch!r}")
        if isinstance(kv_len, bool) or not isinstance(kv_len, int) or not 1 <= kv_len <= self.max_seq_len:
            raise ValueError(f"kv_len must be an int in [1, max_seq_len={self.max_seq_len}], got {kv_len!r}")
        graph = decode_graph(self.shape, batch, kv_len)
        import torch.distributed as dist

        together = self.ranks.joined
        if self.plan_mode == "measure":
            if self.tp > 1 and not together:
                raise RuntimeError("plan_mode='measure' under tensor parallelism times the plans on every rank at "
                                   "once: initialize torch.distributed first (run under torchrun)")
            plan, _ = cached_plan(graph, self.device_spec, measure=lambda p: self.steps.time_plan(p, graph, batch),
                                  progress=progress, ranks=self.ranks if together else None)
        else:
            plan, _ = cached_plan(graph, self.device_spec, progress=progress)

        if together:
            # Every rank runs rank 0's plan: the ranks' tasks must meet one another. (Ranks
            # simulated in one process, as the tests' VM runs them, plan alike anyway.)
            from mk.planner.search import Plan

            text = [plan.to_json() if self.rank == 0 else None]
            dist.broadcast_object_list(text, src=0)
            plan = Plan.from_json(text[0])
        return StepPlan(plan, graph, self.device_spec)

    def prepare(self, batch: int, total_len: int, *, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, progress: bool = False) -> dict:
        """Plan, lower and compile the decode step a request of ``batch`` sequences reaching
        ``total_len`` tokens (prompt + new) will run, so that its first :meth:`generate` call
        starts decoding at once. Idempotent: a step already built is kept. ``progress`` shows
        the plan search's bar (on a terminal). Returns the seconds it spent: plan_s (search or
        plan cache), lower_s (tasks, queues, kernel source), compile_s (Triton or its cache),
        and under tensor parallelism share_s (the buffers shared with the other ranks: the
        symmetric workspace and its rendezvous); zeros for a step built before."""
        self.ranks.check_in_step()
        temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p)
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= self.max_batch_size:
            raise ValueError(f"batch must be an int in [1, max_batch_size={self.max_batch_size}], got {batch!r}")
        if isinstance(total_len, bool) or not isinstance(total_len, int) or not 1 <= total_len <= self.max_seq_len:
            raise ValueError(f"total_len must be an int in [1, max_seq_len={self.max_seq_len}], got {total_len!r}")
        return self.steps.get(batch, self._next_token_rule(temperature, top_k, top_p), self.plan_length(total_len),
                             progress=progress).unreported_build()

    def _next_token_rule(self, temperature: float, top_k: int | None, top_p: float | None) -> str:
        """How a step chooses its token (:func:`_next_token_rule`); under tensor parallelism
        greedily only, refused before any work otherwise."""
        rule = _next_token_rule(temperature, top_k, top_p)
        if self.tp > 1 and rule != "argmax":
            raise ValueError(f"a tensor-parallel model (tp={self.tp}) decodes greedily for now: temperature=0, no "
                             f"top_k / top_p (got temperature={temperature}, top_k={top_k}, top_p={top_p})")
        return rule

    def _check_prompts(self, input_ids, max_new_tokens: int) -> tuple[torch.Tensor, list[int]]:
        """Prompts (a [B, T] tensor or a list of id lists) -> right-padded int32 ids, lengths."""
        self.ranks.check_in_step()
        rows = _rows(input_ids)
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("every prompt needs at least one token")
        if len(rows) > self.max_batch_size:
            raise ValueError(f"batch of {len(rows)} prompts exceeds max_batch_size={self.max_batch_size}")
        for b, r in enumerate(rows):
            if any(not isinstance(t, int) or not 0 <= t < self.config.vocab_size for t in r):
                raise ValueError(f"prompt {b} has a token id outside [0, {self.config.vocab_size})")
            if len(r) + max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt {b}: {len(r)} tokens + {max_new_tokens} new exceed "
                                 f"max_seq_len={self.max_seq_len}")
        lengths = [len(r) for r in rows]
        T = max(lengths)
        ids = torch.zeros(len(rows), T, dtype=torch.int32)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return ids.to(self.device), lengths

    @property
    def prefill_precision(self) -> str:
        """``"fast"`` or ``"exact"``: see :mod:`mk.models.prefill`."""
        return self.prefiller.precision

    @prefill_precision.setter
    def prefill_precision(self, value: str) -> None:
        self.prefiller.precision = value

    @property
    def prefill_workspace(self) -> int:
        """Bytes of activations a prefill chunk may hold (chunks are cut to fit)."""
        return self.prefiller.workspace

    @prefill_workspace.setter
    def prefill_workspace(self, value: int) -> None:
        self.prefiller.workspace = value

    @property
    def prefill_budget(self) -> _prefill.PrefillBudget:
        """Bytes a prefill token holds, the workspace, and the chunk length they give."""
        return self.prefiller.budget

    @torch.no_grad()
    def logits(self, input_ids) -> torch.Tensor:
        """Prefill logits, float32 ``[B, T, V]`` (rows past a shorter prompt's end: padding).
        Refused (RuntimeError) while a :meth:`stream` of this model is unfinished: the
        prefill writes the KV cache that stream decodes from."""
        self._check_not_streaming("logits()")
        ids, lengths = self._check_prompts(input_ids, 0)
        return self.prefiller.run(ids, lengths, all_logits=True)

    # ------------------------------------------------------------------ decoding

    def stream(self, input_ids, max_new_tokens: int = 64, *, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int = 0, eos_token_id=None, read_every: int = 8
               ) -> Iterator[torch.Tensor]:
        """An iterator over each step's new tokens (LongTensor ``[B]``, on the CPU) as they
        are read back.

        Decode steps are enqueued back to back, in blocks of ``read_every``. Each block ends
        with an asynchronous copy of the device-side history (and the watchdog's error
        words) to pinned host memory; the host handles a block's tokens while the next
        block already runs, so the GPU never waits for it. Stops once every sequence has
        produced an EOS token (``eos_token_id``: an id or a list of ids; default the
        config's): at most one block past it has run. Rows that finished keep yielding
        their EOS id.

        ``temperature``: 0 decodes greedily; so does any temperature below
        :data:`MIN_TEMPERATURE` (its logits / temperature would overflow float32, and the
        draw is the argmax anyway), ignoring ``top_k``, ``top_p`` and ``seed``.

        Every argument and the prompts are checked here, at the call (errors name them,
        before any work); the decode step is built, the prompts prefilled and the steps run
        as tokens are asked for. The KV cache is the model's, so one stream runs at a time:
        from its first token until it is exhausted or closed (``close()``, a ``break`` out
        of a ``for`` loop over it, or its last reference dropped), another :meth:`stream`,
        :meth:`generate` or :meth:`logits` of this model is refused with a RuntimeError,
        and the running stream carries on unharmed.
        """
        return self._open_stream("stream()", input_ids, max_new_tokens, temperature, top_k, top_p, seed,
                                 eos_token_id, read_every)

    def _open_stream(self, caller: str, input_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                     read_every) -> Iterator[torch.Tensor]:
        """:meth:`stream`'s checks, every one before any work (``caller``: the method the
        errors name); the generator that does the work (:meth:`_stream`)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if isinstance(read_every, bool) or not isinstance(read_every, int) or read_every < 1:
            raise ValueError(f"read_every must be an int >= 1, got {read_every!r}")
        temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p)
        _check_counter("seed", seed)
        eos = self._eos_ids(eos_token_id)
        self._check_not_streaming(caller)
        ids, lengths = self._check_prompts(input_ids, max_new_tokens)
        if max_new_tokens == 0:
            return iter(())
        next_token = self._next_token_rule(temperature, top_k, top_p)
        if self.ranks.joined and self.device.type != "cuda":
            raise ValueError(f"decoding over {self.tp} processes runs one CUDA GPU a rank (the ranks' steps meet in "
                             f"each other's GPU memory); on the CPU, tensor-parallel models prefill (logits) only")
        # The prefill's workspace, before the decode step is built (planning and compiling it
        # takes seconds the first time); the prefill checks again, with what is free then.
        self.prefill_budget.check_fits(self.device, sum(lengths))
        return self._stream(caller, ids, lengths, max_new_tokens, next_token, temperature, top_k, top_p, seed, eos,
                            read_every)

    def _check_not_streaming(self, caller: str) -> None:
        """RuntimeError naming ``caller`` while a stream of this model is unfinished: it owns
        the KV cache (and its step's state) until it ends or is closed."""
        if self._streaming is not None:
            raise RuntimeError(f"{caller}: a stream() of this model is still running (it owns the KV cache until "
                               f"it ends); exhaust it or call its close() first")

    @torch.no_grad()
    def _stream(self, caller: str, ids: torch.Tensor, lengths: list[int], max_new_tokens: int, next_token: str,
                temperature: float, top_k: int | None, top_p: float | None, seed: int, eos: set[int],
                read_every: int) -> Iterator[torch.Tensor]:
        """:meth:`stream`'s work, on checked arguments: it runs from the first token asked for,
        and holds the model (:attr:`_streaming`) until it returns, fails or is closed."""
        self._check_not_streaming(caller)  # (another stream created earlier may have started since)
        self._streaming = mine = object()
        try:
            yield from decode(self, ids, lengths, max_new_tokens, next_token, temperature, top_k, top_p, seed, eos,
                                    read_every)
        finally:
            if self._streaming is mine:
                self._streaming = None

    def _eos_ids(self, eos_token_id) -> set[int]:
        """``eos_token_id`` (an id, a list of ids, or None for the config's) as a set;
        TypeError naming it otherwise."""
        if eos_token_id is None:
            return set(self.config.eos_token_ids)
        ids = [eos_token_id] if not isinstance(eos_token_id, (list, tuple, set, frozenset)) else list(eos_token_id)
        for t in ids:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
        return {int(t) for t in ids}

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int = 64, *, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, eos_token_id=None):
        """Prompts + generated tokens.

        ``input_ids``: a LongTensor ``[B, T]`` (returns ``[B, T + n]``, n <= max_new_tokens:
        decoding stops once every row has produced EOS, and finished rows are padded with
        their EOS id), or a list of token-id lists of any lengths (returns a list of lists,
        each cut after its EOS).

        ``temperature`` 0 (or below :data:`MIN_TEMPERATURE`) decodes greedily; above, it
        samples (with ``top_k`` / ``top_p`` if given, drawn from ``seed``). Arguments are
        checked before any work; refused (RuntimeError) while a :meth:`stream` of this model
        is unfinished.
        """
        steps = list(self._open_stream("generate()", input_ids, max_new_tokens, temperature, top_k, top_p, seed,
                                       eos_token_id, 8))
        new = torch.stack(steps, dim=1) if steps else torch.zeros(0, 0, dtype=torch.long)
        if isinstance(input_ids, torch.Tensor):
            prompt = input_ids if input_ids.dim() == 2 else input_ids[None]
            new = new if steps else torch.zeros(prompt.shape[0], 0, dtype=torch.long)
            return torch.cat([prompt.long().cpu(), new], dim=1)
        eos = self._eos_ids(eos_token_id)
        out = []
        for b, r in enumerate(_rows(input_ids)):
            gen = new[b].tolist() if steps else []
            cut = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
            out.append(r + gen[:cut])
        return out


def _tp_setup(config: LlamaConfig, tp: int, device) -> tuple[int, object]:
    """This process's rank of ``tp`` and its device (its own GPU: LOCAL_RANK), setting up
    torch.distributed (NCCL) where the caller has not; checks that every rank loads the same
    config with the same tp, and refuses on every rank if not. (0, ``device``) for tp=1."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if tp == 1:
        return 0, device
    config.to_model_shape().shard(tp)  # refuses what does not split, before any setup
    import hashlib
    import json

    import torch.distributed as dist

    from mk.persistent.symmetric import join_ranks

    join_ranks(f"tp={tp}", tp)
    if dist.get_world_size() != tp:
        raise ValueError(f"tp={tp}, but torch.distributed has {dist.get_world_size()} ranks")
    rank = dist.get_rank()
    mine = hashlib.sha256(json.dumps([config.to_dict(), tp], sort_keys=True, default=str).encode()).hexdigest()
    everyone = [None] * tp
    dist.all_gather_object(everyone, mine)
    odd = [r for r, h in enumerate(everyone) if h != everyone[0]]
    if odd:
        raise ValueError(f"rank(s) {odd} loaded another model or config than rank 0: every rank of a "
                         f"tensor-parallel model must load the same one")
    if device is None and torch.cuda.is_available():
        from mk.persistent.symmetric import launch_env

        local = launch_env()[2] if "LOCAL_RANK" in os.environ else rank % torch.cuda.device_count()
        device = torch.device("cuda", local)
    return rank, device


def _next_token_rule(temperature: float, top_k: int | None, top_p: float | None) -> str:
    """How a decode step ends: greedy and temperature sampling finish inside the megakernel;
    top-k / top-p take the step's logits to the radix-select sampler."""
    return "argmax" if temperature == 0.0 else "sample" if top_k is None and top_p is None else "logits"


#: Integer dtypes a tensor of token ids may have.
_ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _interleave_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Gate and up (weights, or their scales: a row's follow it) interleaved row by row, as
    :func:`mk.tasks.linear.interleave_gate_up` lays the weights out for SiLU·mul."""
    gate, up = parts
    if gate.dim() == 2 and gate.dtype == up.dtype and gate.dtype != torch.float8_e4m3fn:
        return interleave_gate_up(gate, up)
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _rows(input_ids) -> list[list[int]]:
    """Prompts as lists of ids: a ``[B, T]`` (or ``[T]``) integer tensor or numpy array, a
    list of id lists (or of 1-D tensors / arrays), or one list of ids. TypeError naming
    ``input_ids`` for anything else: strings, floats, bools, None."""
    if isinstance(input_ids, np.ndarray):
        if input_ids.dtype.kind not in "iu":
            raise TypeError(f"input_ids: a numpy array of token ids must have an integer dtype, got {input_ids.dtype}")
        input_ids = torch.from_numpy(input_ids.astype(np.int64))
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype not in _ID_DTYPES:
            raise TypeError(f"input_ids: a tensor of token ids must have an integer dtype, got {input_ids.dtype}")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a tensor [B, T] or [T], got shape {tuple(input_ids.shape)}")
        return [r.tolist() for r in input_ids.cpu()]
    if not isinstance(input_ids, (list, tuple)):
        raise TypeError(f"input_ids must be a list of token ids, a list of such lists, or an integer tensor or numpy "
                        f"array; got {type(input_ids).__name__}")
    nested = [isinstance(r, (list, tuple, np.ndarray, torch.Tensor)) for r in input_ids]
    if any(nested) and not all(nested):
        raise TypeError("input_ids mixes token ids and lists of them: give one prompt (a list of ids) or a list of "
                        "prompts")
    rows = [_rows(r)[0] if isinstance(r, (np.ndarray, torch.Tensor)) else list(r) for r in input_ids] \
        if input_ids and all(nested) else [list(input_ids)]
    for b, r in enumerate(rows):
        for i, t in enumerate(r):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                raise TypeError(f"input_ids: prompt {b} holds {type(t).__name__} {t!r} at position {i}; token ids "
                                f"are ints")
        rows[b] = [int(t) for t in r]
    return rows


def _stored_or_quantize(stored: CheckpointQuantization | None, quantize: str | None, lm_head: bool,
                        source: str) -> str | None:
    """The format to quantize a checkpoint's float weights to at load: ``quantize`` for a
    float checkpoint; for a quantized one (``stored``) its own format when its LM head is to be
    quantized too, else None. ValueError when ``quantize`` names another format than the
    checkpoint's (its weights would be quantized twice)."""
    if stored is None:
        return quantize
    if quantize is not None and QUANTIZE[quantize] != stored.format.name:
        raise ValueError(f"{source}: the checkpoint's weights are stored {stored.format.name} ({stored.method}); "
                         f"quantize={quantize!r} would quantize them again: leave quantize out")
    return stored.format.name if lm_head else None


def _check_device_spec(device_spec) -> None:
    """TypeError unless ``device_spec`` is None or a :class:`~mk.planner.device.DeviceSpec`."""
    from mk.planner.device import DeviceSpec

    if device_spec is not None and not isinstance(device_spec, DeviceSpec):
        raise TypeError(f"device_spec must be a mk.planner.device.DeviceSpec or None (DeviceSpec.preset('h100') "
                        f"names one), got {type(device_spec).__name__} {device_spec!r:.80}")


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


#: ``max_seq_len`` when none is given: this, or the model's positions if it has fewer.
DEFAULT_MAX_SEQ_LEN = 4096


def _check_sizes(config: LlamaConfig, max_batch_size, max_seq_len) -> int:
    """``max_seq_len`` (default: :data:`DEFAULT_MAX_SEQ_LEN`, at most the model's positions),
    once it and ``max_batch_size`` are ints the model can run: sequences of at most
    ``max_position_embeddings`` tokens (its RoPE and training stop there), batches of at most
    :data:`~mk.models.blocks.MAX_BATCH`."""
    positions = config.max_position_embeddings
    if max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, positions)
    for what, v, top, why in (("max_batch_size", max_batch_size, MAX_BATCH, "sequences a decode step holds"),
                              ("max_seq_len", max_seq_len, positions, "the model's max_position_embeddings")):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{what} must be an int, got {type(v).__name__} {v!r}")
        if not 1 <= v <= top:
            raise ValueError(f"{what} must be in [1, {top}] ({why}), got {v}")
    return max_seq_len


def _check_memory(config: LlamaConfig, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                  max_batch_size: int, max_seq_len: int, tp: int = 1) -> None:
    """MemoryError, before any weight is read, when this rank's weights and KV cache cannot fit
    in what ``device`` has: free GPU memory, or the machine's memory for the CPU."""
    weights = sum(int(np.prod(s)) for s in expected_shapes(config).values()) * dtype.itemsize // tp
    kv = (2 * config.num_hidden_layers * max_batch_size * (config.num_key_value_heads // tp) * max_seq_len
          * config.head_dim * kv_dtype.itemsize)
    if device.type == "cuda":
        have, where = torch.cuda.mem_get_info(device)[0], f"{device} has free"
    else:
        try:
            have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine has"
        except (ValueError, OSError, AttributeError):  # (no sysconf: nothing to check against)
            return
    if weights + kv > have:
        gib = 2 ** 30
        raise MemoryError(f"the model needs {(weights + kv) / gib:.1f} GiB (weights {weights / gib:.1f} GiB + KV cache "
                          f"{kv / gib:.1f} GiB for max_batch_size={max_batch_size} x max_seq_len={max_seq_len}), "
                          f"and {where} {have / gib:.1f} GiB: lower max_batch_size or max_seq_len")


def _resolve_target(device, dtype, kv_dtype) -> tuple[torch.device, torch.dtype, torch.dtype]:
    """``(device, dtype, kv_dtype)`` with their defaults (the GPU if there is one; bf16 on
    CUDA, float32 on the CPU; the cache in ``dtype``), checked before any work."""
    try:
        device = torch.device(device) if device is not None else default_device()
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device: {e}") from None
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    _check_target(device, dtype)
    kv_dtype = kv_dtype or dtype
    _check_target(device, kv_dtype, what="kv_dtype")
    return device, dtype, kv_dtype


def _check_target(device: torch.device, dtype: torch.dtype, what: str = "dtype") -> None:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but there is no CUDA GPU here (mk runs on the CPU "
                         "through the Triton interpreter)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {device} asked for, but there are {torch.cuda.device_count()} CUDA GPU(s)")
    allowed = supported_dtypes(device)
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        raise ValueError(f"{what} {dtype} is not supported on {device.type}; use one of {list(allowed)}")
