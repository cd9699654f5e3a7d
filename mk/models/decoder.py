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
import warnings
from dataclasses import dataclass, field, replace
from typing import ClassVar, Iterator

import numpy as np
import torch

from mk.tasks import default_device, supported_dtypes
from mk.tasks.append_token import append_token
from mk.tasks.argmax import argmax
from mk.tasks.embedding import embedding
from mk.tasks.linear import interleave_gate_up, linear, tma_gemm_serves
from mk.tasks.rmsnorm import rmsnorm
from mk.tasks.rope import deinterleave_rotary, interleave_rotary, rope_inv_freq, rope_kv
from mk.tasks.silu_mul import silu_mul
from mk.tasks.sample import (_check_counter, _check_temperature, _check_top_k, _check_top_p, gumbel_noise, sample,
                             scale_logits_ref)

from mk.models.blocks import MAX_BATCH, TP_PEERS, cache_keys, weight_key
from mk.planner.steps import StepCache
from mk.persistent.runtime import MegakernelTimeout

from .config import LlamaConfig, read_config_json
from . import prefill as _prefill
from .quantization import CheckpointQuantization, read_quantization
from mk.tasks.linear.format import weight_format

from .weights import (QUANTIZE, SCALE_SUFFIX, check_quantize, check_tp_format, expected_shapes, load_weights,
                      quantize_weights, random_weights, tp_slices, weight_formats)

#: How a model picks each batch size's decode plan: the planner's best prediction, or
#: the fastest of its top plans timed on the device (:meth:`DecoderModel.plan`).
PLAN_MODES = ("predict", "measure")
def _check_plan_mode(plan_mode) -> None:
    if plan_mode not in PLAN_MODES:
        raise ValueError(f"plan_mode must be one of {PLAN_MODES}, got {plan_mode!r}")


#: measure mode: decode steps per timed burst, and bursts (after one warm-up) per plan.
MEASURE_BURST, MEASURE_REPS = 20, 3
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


class _Ranks:
    """The tensor-parallel ranks of torch.distributed, as :class:`mk.planner.cache.Ranks`
    (planning in ``measure`` mode: every rank times rank 0's candidates together)."""

    def __init__(self, model: "DecoderModel"):
        self.model, self.lead = model, model.rank == 0

    def all(self, flag: bool) -> bool:
        return self.model._ranks_agree(flag)

    def share(self, obj):
        import torch.distributed as dist

        box = [obj if self.lead else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


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


@dataclass
class _Decoder:
    """One batch size's lowered decode step, its megakernel and its state buffers."""

    step: object  # mk.planner.lower.DecodeStep
    kernel: object  # mk.persistent.runtime.Megakernel
    state: dict
    #: Pinned host buffers the history is read back into (CUDA only; see _HistoryReader).
    host: list = field(default_factory=list)
    #: Seconds its build took (plan_s, lower_s, compile_s), until a request reports them.
    build: dict = field(default_factory=dict)
    #: The buffers it shares with the other ranks (tensor parallelism; :meth:`DecoderModel.tp_buffers`).
    shared: dict = field(default_factory=dict)

    def unreported_build(self) -> dict:
        """The build's seconds the first time a request asks, zeros after."""
        keys = ("plan_s", "lower_s", "compile_s") + (("share_s",) if "share_s" in self.build else ())
        out = {k: self.build.get(k, 0.0) for k in keys}
        self.build = {k: 0.0 for k in keys if k != "plan_s"}
        return out


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
        # Captured one-prompt prefill chunks by (cache row, tokens): (graph, ids, output).
        self._prefill_graphs: dict[tuple[int, int], tuple] = {}
        self._graph_pool, self._graphs_failed = None, False
        self._capturing: _prefill.ChunkGraph | None = None  # the chunk whose graphs are being captured
        self._capture_stream = None  # every capture's (they share one pool)
        self._ranks_out_of_step: str | None = None  # why, once a rank left its peers mid-collective
        self.prefill_precision = prefill_precision
        self.prefill_workspace = _prefill.default_workspace(self.device) if prefill_workspace is None else prefill_workspace
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
        if tp > 1 and plan_mode == "measure" and self.device.type != "cuda":
            raise ValueError("plan_mode='measure' under tensor parallelism times the plans on the ranks' GPUs "
                             "together (CUDA tensors, torch.distributed initialized); on the CPU the ranks plan by "
                             "prediction")
        if tp > 1:
            self._check_ranks_alike()
        self.weights = self._pack(weights)
        c = config
        cache_shape = (c.num_hidden_layers, max_batch_size, self.shape.kv_heads, max_seq_len, c.head_dim)
        self.k_cache = torch.zeros(cache_shape, dtype=self.kv_dtype, device=self.device)
        self.v_cache = torch.zeros(cache_shape, dtype=self.kv_dtype, device=self.device)
        self._device_spec = device_spec
        self._decoders: dict[tuple[int, str, int], _Decoder] = {}
        #: Decode steps lowered before, by plan, batch and length (host memory only: a
        #: decoder dropped from _decoders is bound to new tensors from here, not lowered again).
        self._steps = StepCache()
        self.last_decoder: _Decoder | None = None  # the step the last stream() ran
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

    @property
    def _ranks_joined(self) -> bool:
        """Whether torch.distributed joins this model's ranks (several, each a process); not
        for ranks simulated in one process, as the tests' VM runs them, which plan and build
        alike by construction."""
        import torch.distributed as dist

        return self.tp > 1 and dist.is_available() and dist.is_initialized()

    def _check_ranks_alike(self) -> None:
        """Refuse, on every rank, ranks of one tensor-parallel model built with other options
        (a collective where :attr:`_ranks_joined`). Their collectives pair up only where
        every rank cuts its prefill into the same chunks and plans the same steps."""
        import torch.distributed as dist

        if not self._ranks_joined:
            return
        mine = {"dtype": str(self.dtype), "kv_dtype": str(self.kv_dtype), "max_batch_size": self.max_batch_size,
                "max_seq_len": self.max_seq_len, "prefill_precision": self.prefill_precision,
                "prefill_workspace": self.prefill_workspace, "plan_mode": self.plan_mode}
        everyone = [None] * self.tp
        dist.all_gather_object(everyone, mine)
        odd = sorted({k for other in everyone for k in mine if other[k] != everyone[0][k]})
        if odd:
            raise ValueError("the ranks of a tensor-parallel model must be built alike; they differ in "
                             + "; ".join(f"{k} (by rank: {[other[k] for other in everyone]})" for k in odd))

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
            _prefill.PrefillBudget.make(_prefill_per_token(config, dtype, prefill_precision), prefill_workspace)
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
                "prefill_graphs": sum(out.numel() * out.element_size() + chunk.staging_bytes
                                      for chunk, _, out in self._prefill_graphs.values())}

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

        together = self._ranks_joined
        if self.plan_mode == "measure":
            if self.tp > 1 and not together:
                raise RuntimeError("plan_mode='measure' under tensor parallelism times the plans on every rank at "
                                   "once: initialize torch.distributed first (run under torchrun)")
            plan, _ = cached_plan(graph, self.device_spec, measure=lambda p: self._time_plan(p, graph, batch),
                                  progress=progress, ranks=_Ranks(self) if together else None)
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
        self._check_in_step()
        temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p)
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= self.max_batch_size:
            raise ValueError(f"batch must be an int in [1, max_batch_size={self.max_batch_size}], got {batch!r}")
        if isinstance(total_len, bool) or not isinstance(total_len, int) or not 1 <= total_len <= self.max_seq_len:
            raise ValueError(f"total_len must be an int in [1, max_seq_len={self.max_seq_len}], got {total_len!r}")
        return self._decoder(batch, self._next_token_rule(temperature, top_k, top_p), self.plan_length(total_len),
                             progress=progress).unreported_build()

    def _next_token_rule(self, temperature: float, top_k: int | None, top_p: float | None) -> str:
        """How a step chooses its token (:func:`_next_token_rule`); under tensor parallelism
        greedily only, refused before any work otherwise."""
        rule = _next_token_rule(temperature, top_k, top_p)
        if self.tp > 1 and rule != "argmax":
            raise ValueError(f"a tensor-parallel model (tp={self.tp}) decodes greedily for now: temperature=0, no "
                             f"top_k / top_p (got temperature={temperature}, top_k={top_k}, top_p={top_p})")
        return rule

    def _decoder(self, batch: int, next_token: str, kv_len: int | None = None, progress: bool = False) -> _Decoder:
        """The lowered, compiled step for ``batch`` ending in ``next_token`` (see
        :func:`mk.planner.lower.lower_decode_step`), planned for ``kv_len`` (default
        ``max_seq_len``), built once."""
        key = (batch, next_token, self.max_seq_len if kv_len is None else kv_len)
        if key not in self._decoders:
            # One step per batch and way of choosing the next token is kept: steps planned
            # for other lengths go (each holds its own activations and queues, and generation
            # stays within weights + KV cache + 64 MiB); a length planned again is bound to new
            # tensors from the lowered steps (_steps), the plan and kernel caches: nothing is
            # lowered again.
            self._drop_decoders([k for k in self._decoders if k[:2] == key[:2]])
            t0 = time.perf_counter()
            plan, graph = self.plan(batch, key[2], progress=progress)
            plan_s = time.perf_counter() - t0
            dec = self._decoders[key] = self._build_agreed(plan, graph, batch, next_token)
            dec.build["plan_s"] = plan_s
        return self._decoders[key]

    def _drop_decoders(self, keys: list) -> None:
        """Forget the steps of ``keys``. Under tensor parallelism their symmetric workspaces
        go with them, once every rank is past their launches: every rank drops the same steps
        at the same call, as it builds the same ones."""
        dropped = [self._decoders.pop(k) for k in keys]
        if dropped and self.tp > 1 and self.device.type == "cuda":
            import torch.distributed as dist

            torch.cuda.synchronize(self.device)
            dist.barrier()
        del dropped  # (the workspaces go here, after every rank's barrier)

    def _build_decoder(self, plan, graph, batch: int, next_token: str) -> _Decoder:
        """Lower ``plan`` to a megakernel over this model's weights and cache, with fresh
        state. The lowered step (tasks, dependencies, queues, descriptors) comes from
        :attr:`_steps` when this plan, batch and length were lowered before."""
        from mk.persistent.runtime import Megakernel

        t0 = time.perf_counter()
        # First the collective part (every rank, before anything that may fail on one rank
        # alone: see _build_agreed).
        shared = self.tp_buffers(graph)
        share_s = time.perf_counter() - t0
        S = self.max_seq_len
        i32 = dict(dtype=torch.int32, device=self.device)
        state = {"ids": torch.zeros(batch, **i32), "pos": torch.zeros(batch, **i32),
                 "tokens": torch.zeros(batch, S, **i32),
                 "temperature": torch.ones(1, dtype=torch.float32, device=self.device),
                 "seed": torch.zeros(1, dtype=torch.int64, device=self.device)}
        bufs = dict(self.weights, **state)
        for L in range(self.config.num_hidden_layers):
            kn, vn = cache_keys(L)
            bufs[kn], bufs[vn] = self.k_cache[L, :batch], self.v_cache[L, :batch]
        bufs.update(shared)

        def compile_for(workers):  # the queues of the plan's schedule, as the planner simulated them
            lowered = self._steps.get(plan, graph, bufs, eps=self.config.rms_norm_eps, next_token=next_token,
                                      device=self.device_spec, workers=workers, rank=self.rank)
            step, program = lowered.bind(bufs, self.device)
            return step, Megakernel(program)

        step, kernel = compile_for(1 if self.device.type != "cuda" else plan.workers)
        t1 = time.perf_counter()
        if self.device.type == "cuda" and kernel.residency().max_workers < plan.workers:  # (compiles)
            step, kernel = compile_for(kernel.residency().max_workers)
            kernel.residency()
        t2 = time.perf_counter()
        build = dict(lower_s=t1 - t0 - share_s, compile_s=t2 - t1) | ({"share_s": share_s} if self.tp > 1 else {})
        return _Decoder(step, kernel, state, build=build, shared=shared)

    def _build_agreed(self, plan, graph, batch: int, next_token: str) -> _Decoder:
        """:meth:`_build_decoder` on every rank, which then check together that each built
        it, and built the same schedule (a collective under tensor parallelism: every rank
        reaches it, its own build failed or not). The ranks' projection tiles wait on one
        another's words, so their queues must hold those tiles in one order, or two workers
        can each wait on a tile queued behind the other's (a mixed pair of GPUs, with other
        SM counts, would deal other queues); such ranks are refused, naming them, before any
        launch."""
        import torch.distributed as dist

        if not self._ranks_joined:
            return self._build_decoder(plan, graph, batch, next_token)
        dec, failed = None, None
        try:
            dec = self._build_decoder(plan, graph, batch, next_token)
        except Exception as e:
            failed = e
        mine = None if failed else (dec.kernel.program.schedule_digest(skip_args=("rank",)),
                                    dec.kernel.program.num_workers)
        everyone = [None] * self.tp
        dist.all_gather_object(everyone, mine)
        if failed is not None:
            raise failed
        if None in everyone:
            failed_on = [r for r, m in enumerate(everyone) if m is None]
            raise RuntimeError(f"building the decode step failed on rank(s) {failed_on}; their errors name the cause")
        odd = [r for r, m in enumerate(everyone) if m[0] != everyone[0][0]]
        if odd:
            raise RuntimeError(f"rank(s) {odd} built another schedule of the decode step than rank 0 (workers by "
                               f"rank: {[m[1] for m in everyone]}): the ranks of a tensor-parallel model must run "
                               f"one schedule; use GPUs of one kind, with one calibration")
        return dec

    def tp_buffers(self, graph) -> dict[str, torch.Tensor]:
        """The buffers a tensor-parallel step of ``graph`` shares with the other ranks
        (partial sums, the two buffers every rank pushes its partials' words into, the next
        token's candidates and their flags, and ``tp.peers``: every rank's workspace base),
        zeroed: on CUDA cut from one symmetric-memory workspace
        (:func:`mk.persistent.symmetric.symmetric_workspace`, a collective call: every rank
        makes it together); on the CPU plain tensors, for the VM's simulated ranks
        (:func:`mk.persistent.vm.run_vm_ranks`). Empty for one rank."""
        from mk.planner.lower import meta_buffers

        if self.tp == 1:
            return {}
        meta = {n: t for n, t in meta_buffers(graph, self.max_seq_len).items() if n.startswith("tp.")}
        if self.device.type == "cuda":
            from mk.persistent.symmetric import symmetric_workspace

            return symmetric_workspace(meta, self.device, peers=TP_PEERS)
        return {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in meta.items()}

    def _time_plan(self, plan, graph, batch: int) -> float:
        """Seconds one greedy decode step of ``plan`` takes here (median of a few bursts).

        The timing steps run at the end of the planned length (the graph's ``kv_len``: their
        positions start at ``kv_len - 1 - burst``) and write only cache rows there, which a
        request reaches only later and then overwrites before reading: plans are measured
        before the prompt is prefilled.
        Resetting the positions is one tiny copy per burst, timed with it.

        Under tensor parallelism every rank times the plan at once (their steps meet), and
        each returns the slowest rank's time; where timing failed on any rank, every rank
        raises.
        """
        import torch.distributed as dist

        if self.tp == 1:  # (over several ranks, plan() has made sure torch.distributed is set up)
            return self._time_decoder(self._build_decoder(plan, graph, batch, "argmax"), graph)
        # Each rank compiles the plan on its own, for as long as that takes: a step launched
        # before its peers could join it would wait past the watchdog's bound.
        dec = self._build_agreed(plan, graph, batch, "argmax")
        failed = None
        try:
            seconds = self._time_decoder(dec, graph)
        except Exception as e:
            seconds, failed = 0.0, e
        both = torch.tensor([seconds, float(failed is not None)], dtype=torch.float64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if failed is not None:
            raise failed
        if both[1].item():
            raise RuntimeError("plan_mode='measure': timing a plan failed on another rank; its error names the cause")
        return both[0].item()

    def _time_decoder(self, dec: "_Decoder", graph) -> float:
        """:meth:`_time_plan`'s timing of one built step on this rank."""
        top = graph.kv_len  # (plan() keeps it within max_seq_len)
        if self.device.type != "cuda":  # the interpreter: one step is slow enough to time
            dec.state["pos"].fill_(max(top - 2, 0))
            t0 = time.perf_counter()
            dec.kernel.launch()
            seconds = time.perf_counter() - t0
            dec.kernel.check()
            return seconds
        from mk.timing import event_time_us

        burst = max(1, min(MEASURE_BURST, top - 1))
        start = max(top - 1 - burst, 0)

        def steps():
            dec.state["pos"].fill_(start)
            for _ in range(burst):
                dec.kernel.launch()

        seconds = event_time_us(steps, reps=MEASURE_REPS, warmup=1) * 1e-6 / burst
        dec.kernel.check()
        return seconds

    # ------------------------------------------------------------------ prefill

    def _check_in_step(self) -> None:
        """Refuse work once a rank has left its peers mid-collective: any collective it ran
        next would pair with theirs."""
        if self._ranks_out_of_step:
            raise RuntimeError(f"this tensor-parallel model's ranks are out of step ({self._ranks_out_of_step}); "
                               f"start the processes again")

    def _check_prompts(self, input_ids, max_new_tokens: int) -> tuple[torch.Tensor, list[int]]:
        """Prompts (a [B, T] tensor or a list of id lists) -> right-padded int32 ids, lengths."""
        self._check_in_step()
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
        return self._prefill_precision

    @prefill_precision.setter
    def prefill_precision(self, value: str) -> None:
        old = getattr(self, "_prefill_precision", None)
        self._prefill_precision = _prefill.check_precision(value)
        if hasattr(self, "_prefill_workspace"):
            try:
                self.prefill_budget  # a token of the other precision may not fit the workspace
            except ValueError:
                self._prefill_precision = old
                raise
        self._prefill_graphs = {}

    @property
    def prefill_workspace(self) -> int:
        """Bytes of activations a prefill chunk may hold (chunks are cut to fit)."""
        return self._prefill_workspace

    @prefill_workspace.setter
    def prefill_workspace(self, value: int) -> None:
        self._prefill_budget(value)  # refuses a workspace that holds no token
        self._prefill_workspace = value
        self._prefill_graphs = {}

    @property
    def prefill_budget(self) -> _prefill.PrefillBudget:
        """Bytes a prefill token holds, the workspace, and the chunk length they give."""
        return self._prefill_budget(self._prefill_workspace)

    def _prefill_budget(self, workspace) -> _prefill.PrefillBudget:
        return _prefill.PrefillBudget.make(_prefill_per_token(self.config, self.dtype, self.prefill_precision),
                                           workspace)

    def _prefill(self, ids: torch.Tensor, lengths: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run the prompts (``ids`` right-padded ``[B, T]``, ``lengths``) through every layer,
        filling the cache, packed a chunk at a time; float32 logits of each prompt's last
        token ``[B, V]`` (or of every token ``[B, T, V]``, zeros past a prompt's end)."""
        B, T = ids.shape
        V = self.config.vocab_size
        budget = self.prefill_budget
        budget.check_fits(self.device, sum(lengths), B * T * V * 4 if all_logits else 0)
        if all_logits:
            logits = torch.zeros(B, T, V, dtype=torch.float32, device=self.device)
            # LM-head rows at a time within the workspace: its float32 logits too.
            head_rows = max(1, budget.bound // (4 * V + 4 * self.config.hidden_size))
        else:
            last = torch.empty(B, self.config.hidden_size, dtype=torch.float32, device=self.device)
        for segments in _prefill.pack(lengths, budget.chunk_tokens):
            x = self._prefill_chunk(torch.cat([ids[s.row, s.start:s.stop] for s in segments]), segments)
            for s in segments:
                if all_logits:
                    for r in range(0, s.tokens, head_rows):
                        n = min(head_rows, s.tokens - r)
                        logits[s.row, s.start + r:s.start + r + n] = self._lm_head(x[s.offset + r:s.offset + r + n])
                elif s.stop == lengths[s.row]:  # the chunk that holds the prompt's last token
                    last[s.row] = x[s.offset + s.tokens - 1]
        return logits if all_logits else self._lm_head(last)

    def _prefill_chunk(self, ids: torch.Tensor, segments: list) -> torch.Tensor:
        """:meth:`_prefill_layers` of one chunk; a chunk that is one whole prompt (the
        usual request) runs as CUDA graphs captured for its length (one graph, or under tensor
        parallelism one between each two sums over the ranks: :class:`~mk.models.prefill.ChunkGraph`), rounded up to
        :data:`~mk.models.prefill.GRAPH_TOKEN_STEP` tokens: launched one kernel at a time,
        a small model's prefill is bound by the host's time per launch, not by the GPU
        (1B, 2048 tokens: ~150 launches, 8-14 ms of host time for 7.6 ms of kernels).
        A replayed chunk's result is a view of the graphs' shared output memory: valid until
        the next chunk runs (the caller reads it at once)."""
        seg = segments[0]
        if (self.device.type != "cuda" or self.prefill_precision != "fast" or len(segments) != 1
                or seg.start != 0 or self._graphs_failed or torch.cuda.is_current_stream_capturing()):
            return self._prefill_layers(ids, segments)
        n = seg.tokens
        padded = _prefill.graph_tokens(n, min(self.max_seq_len, self.prefill_budget.chunk_tokens))
        key = (seg.row, padded)
        entry = self._prefill_graphs.pop(key, None)
        if entry is None:
            # Run once eagerly (cuBLAS and cuDNN set themselves up outside a capture; this
            # call's result), then capture the same chunk for the next request of its length.
            static_ids = torch.zeros(padded, dtype=ids.dtype, device=self.device)
            static_ids[:n] = ids
            whole = [_prefill.Segment(seg.row, 0, padded, 0)]
            x = self._prefill_layers(static_ids, whole)
            if not self._prefill_graphs:  # a pool no live graph uses cannot take a capture again
                with torch.cuda.device(self.device):
                    self._graph_pool = torch.cuda.graph_pool_handle()
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(self.device)
            chunk = _prefill.ChunkGraph(self.device, self._graph_pool, self._capture_stream)
            self._capturing, failed = chunk, None
            try:
                out = chunk.capture(lambda: self._prefill_layers(static_ids, whole))
            except Exception as e:  # the chunk still ran eagerly: keep its result, capture no more
                failed = f"{type(e).__name__}: {e}"  # (any error: every rank must reach the agreement below)
            finally:
                self._capturing = None
            if self.tp > 1 and not self._ranks_agree(failed is None):
                failed = failed or "another rank's capture failed"  # (all replay or none: their sums pair up)
            if failed is not None:
                warnings.warn(f"mk: prefill chunks run eagerly from now on; capturing one as a CUDA graph "
                              f"failed: {failed}", RuntimeWarning, stacklevel=2)
                self._graphs_failed = True
                return x[:n]
            self._prefill_graphs[key] = (chunk, static_ids, out)
            while len(self._prefill_graphs) > _prefill.MAX_GRAPHS:
                self._prefill_graphs.pop(next(iter(self._prefill_graphs)))
            return x[:n]
        chunk, static_ids, out = entry
        static_ids[:n] = ids
        static_ids[n:] = 0
        try:
            chunk.replay(self._all_reduce)
        except RuntimeError as e:
            if self.tp > 1:
                # Its peers may wait in a sum of the replay this rank left: any later collective
                # of this rank would pair with theirs, silently wrong.
                self._ranks_out_of_step = f"replaying a captured prefill chunk failed on rank {self.rank}: {e}"
                raise
            warnings.warn(f"mk: prefill chunks run eagerly from now on; replaying a captured one failed: {e}",
                          RuntimeWarning, stacklevel=2)
            self._graphs_failed, self._prefill_graphs = True, {}
            return self._prefill_layers(ids, segments)
        self._prefill_graphs[key] = entry  # most recently used last
        return out[:n]

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of float32 final residuals ``[n, H]`` (all of the vocabulary: under
        tensor parallelism every rank's share, gathered)."""
        w, eps = self.weights, self.config.rms_norm_eps
        head, scale = w[weight_key("lm_head")], w.get(weight_key("lm_head", "scale"))
        if self.prefill_precision == "fast":
            logits = _mm(rmsnorm(x, w[weight_key("final_norm")], eps, out_dtype=self.dtype), head, torch.float32,
                         scale)
        else:
            logits = linear(rmsnorm(x, w[weight_key("final_norm")], eps), head, weight_scale=scale).float()
        if self.tp == 1:
            return logits
        import torch.distributed as dist

        shares = [torch.empty_like(logits) for _ in range(self.tp)]
        dist.all_gather(shares, logits.contiguous())
        return torch.cat(shares, dim=-1)

    def _tp_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """Prefill under tensor parallelism: every rank's partial sum of a split projection
        added up in place (NCCL); itself for one rank. While a chunk is being captured, the
        sum ends a piece of its graphs instead, and runs between two pieces at each replay."""
        if self.tp == 1:
            return partial
        if self._capturing is not None:
            return self._capturing.cut(partial)
        return self._all_reduce(partial)

    @staticmethod
    def _all_reduce(partial: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(partial)
        return partial

    def _ranks_agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a collective: every rank calls it)."""
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _prefill_layers(self, ids: torch.Tensor, segments: list) -> torch.Tensor:
        """One chunk's tokens (``ids`` ``[n]``, the :class:`~mk.models.prefill.Segment` s of
        their prompts) through every layer, their K/V appended to the cache (each prompt's
        earlier tokens are there already); the final residual, float32 ``[n, H]``."""
        c, w = self.config, self.weights

        def W(name):
            return w[weight_key(name)]

        def S(name):  # a projection's scales (its format's), or None
            return w.get(weight_key(name, "scale"))

        n = ids.numel()
        hq, hkv, d = self.shape.heads, self.shape.kv_heads, c.head_dim  # (this rank's heads)
        eps, f32, fast = c.rms_norm_eps, torch.float32, self.prefill_precision == "fast"
        part = f32 if self.tp > 1 else None  # partial sums over ranks are added in float32
        positions, rows = _prefill.chunk_indices(segments, self.device)
        # The residual stream is float32 in both precisions; ids were checked with the prompts.
        # (Under tensor parallelism this rank's vocabulary share: its tokens' rows, zeros for
        # the others', summed over the ranks.)
        share = dict(vocab_start=self.rank * W("embed").shape[0]) if self.tp > 1 else {}
        x = self._tp_sum(embedding(ids, W("embed"), check_values=False, **share).float())
        delta = None  # fast: the last projection's output, added into x by the next norm
        for L in range(c.num_hidden_layers):
            kc, vc = self.k_cache[L], self.v_cache[L]
            l = f"l{L}."
            bias = W(l + "qkv.bias") if c.QKV_BIAS else None
            if fast:
                h, x = self._add_norm(x, delta, W(l + "attn_norm"))
                delta = None  # added in: its memory goes back before the next projection
                qkv = (_mm(h, W(l + "qkv"), None, S(l + "qkv")) if bias is None else
                       torch.addmm(bias, h, W(l + "qkv").t()) if S(l + "qkv") is None else
                       _mm(h, W(l + "qkv"), None, S(l + "qkv")) + bias)
                del h
            else:
                qkv = linear(x, W(l + "qkv"), norm_weight=W(l + "attn_norm"), norm_eps=eps, bias=bias, out_dtype=f32,
                             weight_scale=S(l + "qkv"))
            q, k, v = qkv.view(1, n, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=2)
            norms = (dict(q_norm_weight=W(l + "q_norm"), k_norm_weight=W(l + "k_norm"), norm_eps=eps)
                     if c.QK_NORM else {})
            # Positions and rows were built here from checked lengths: no checks, no read-back.
            q = rope_kv(q, k, v, positions, w["inv_freq"], kc, vc, interleaved=True, cache_rows=rows, validate=False,
                        **norms)
            del qkv, k, v
            attn = _prefill.attention(q[0], kc, vc, segments, self.prefill_precision, window=c.window)
            del q
            if fast:
                delta = self._tp_sum(_mm(attn, W(l + "o_proj"), part, S(l + "o_proj")))
                del attn
                h, x = self._add_norm(x, delta, W(l + "mlp_norm"))
                delta = None
                if S(l + "gate_up") is None and tma_gemm_serves(h, W(l + "gate_up"), silu_mul=True):
                    # mk's TMA GEMM with SiLU·mul in its epilogue: the [n, 2I] product is
                    # never stored (1B / 8B, 2048-8192 tokens: 4-15% under cuBLAS + SiLU·mul).
                    act = linear(h, W(l + "gate_up"), silu_mul=True)
                else:
                    gu = _mm(h, W(l + "gate_up"), None, S(l + "gate_up"))  # gate and up rows interleaved
                    act = silu_mul(gu[:, 0::2], gu[:, 1::2], validate=False)
                    del gu
                del h
                delta = self._tp_sum(_mm(act, W(l + "down"), part, S(l + "down")))
                del act
            else:
                o_s, gu_s, d_s = S(l + "o_proj"), S(l + "gate_up"), S(l + "down")
                x = (linear(attn, W(l + "o_proj"), residual=x, out_dtype=f32, weight_scale=o_s) if self.tp == 1 else
                     x + self._tp_sum(linear(attn, W(l + "o_proj"), out_dtype=f32, weight_scale=o_s)))
                del attn
                act = linear(x, W(l + "gate_up"), norm_weight=W(l + "mlp_norm"), norm_eps=eps, silu_mul=True,
                             out_dtype=f32, weight_scale=gu_s)
                x = (linear(act, W(l + "down"), residual=x, out_dtype=f32, weight_scale=d_s) if self.tp == 1 else
                     x + self._tp_sum(linear(act, W(l + "down"), out_dtype=f32, weight_scale=d_s)))
                del act
        if delta is not None:
            x += delta
        return x

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        """Fast precision: ``x += delta`` (float32) and RMSNorm of the sum, in the weights'
        dtype, in one pass. Returns (normalised, new x)."""
        if delta is None:
            return rmsnorm(x, weight, self.config.rms_norm_eps, out_dtype=self.dtype, validate=False), x
        return rmsnorm(delta, weight, self.config.rms_norm_eps, residual=x, out_dtype=self.dtype, validate=False)

    @torch.no_grad()
    def logits(self, input_ids) -> torch.Tensor:
        """Prefill logits, float32 ``[B, T, V]`` (rows past a shorter prompt's end: padding).
        Refused (RuntimeError) while a :meth:`stream` of this model is unfinished: the
        prefill writes the KV cache that stream decodes from."""
        self._check_not_streaming("logits()")
        ids, lengths = self._check_prompts(input_ids, 0)
        return self._prefill(ids, lengths, all_logits=True)

    # ------------------------------------------------------------------ decoding

    def _first_token(self, logits, lengths, temperature, top_k, top_p, seed) -> torch.Tensor:
        """The token after each prompt, chosen as the decode steps choose theirs."""
        if temperature == 0.0:
            return argmax(logits).to(torch.int32)
        if top_k is None and top_p is None:
            # The megakernel's draw for a token at position p uses Philox offset p, row b.
            B, V = logits.shape
            noise = torch.stack([gumbel_noise(seed, n, B, V, device=self.device)[b] for b, n in enumerate(lengths)])
            return (scale_logits_ref(logits, temperature) + noise).argmax(dim=1).to(torch.int32)
        return sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=0).to(torch.int32)

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
        if self._ranks_joined and self.device.type != "cuda":
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
            yield from self._decode(ids, lengths, max_new_tokens, next_token, temperature, top_k, top_p, seed, eos,
                                    read_every)
        finally:
            if self._streaming is mine:
                self._streaming = None

    def _decode(self, ids: torch.Tensor, lengths: list[int], max_new_tokens: int, next_token: str, temperature: float,
                top_k: int | None, top_p: float | None, seed: int, eos: set[int], read_every: int
                ) -> Iterator[torch.Tensor]:
        """Prefill, then the decode steps, yielding each step's tokens (:meth:`stream`)."""
        B = ids.shape[0]
        dec = self.last_decoder = self._decoder(B, next_token, self.plan_length(max(lengths) + max_new_tokens))
        phases = dec.unreported_build()
        st = dec.state
        t0 = time.perf_counter()
        logits = self._prefill(ids, lengths)
        first = self._first_token(logits, lengths, temperature, top_k, top_p, seed)
        # Device state: the history holds the prompt and the first token; pos points at it.
        st["tokens"].zero_()
        st["tokens"][:, :ids.shape[1]] = ids
        st["pos"].copy_(torch.tensor(lengths, dtype=torch.int32))
        st["tokens"][torch.arange(B, device=self.device), st["pos"].long()] = first
        st["ids"].copy_(first)
        st["temperature"].fill_(temperature if next_token == "sample" else 1.0)
        st["seed"].fill_(seed)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_prefill = time.perf_counter() - t0
        done: list[int | None] = [None] * B  # the EOS id each finished row stopped at
        starts = torch.tensor(lengths)
        rows = torch.arange(B)
        blocks = _HistoryReader(dec, self.device)
        enqueued, produced, t_decode = 0, 0, time.perf_counter()
        while produced < max_new_tokens:
            # Keep the next block queued behind the one being read: the GPU never idles on the host.
            while enqueued < max_new_tokens and blocks.in_flight < 2:
                block = min(read_every, max_new_tokens - enqueued)
                # Step i of the block feeds token enqueued+i; the last block's final step is not needed.
                steps = block - (1 if enqueued + block == max_new_tokens else 0)
                for i in range(steps):
                    self._decode_step(dec, enqueued + i + 1, temperature, top_k, top_p, seed)
                blocks.read(block)
                enqueued += block
            try:
                block, history = blocks.wait()  # a timed-out wait raises MegakernelTimeout here, never hangs
            except MegakernelTimeout as e:
                if self.tp > 1:  # the ranks' launch counts part, and a late peer's words may land after the reset
                    self._ranks_out_of_step = f"a decode step failed on rank {self.rank}: {e}"
                raise
            for i in range(block):
                tok = history[rows, starts + produced + i].long()
                for b in range(B):
                    if done[b] is not None:
                        tok[b] = done[b]
                    elif int(tok[b]) in eos:
                        done[b] = int(tok[b])
                yield tok
                if all(d is not None for d in done):
                    produced = max_new_tokens
                    break
            else:
                produced += block
        elapsed = time.perf_counter() - t_decode
        self.last_stats = {**phases, "prefill_s": t_prefill, "decode_s": elapsed}

    def _decode_step(self, dec: _Decoder, step: int, temperature=0.0, top_k=None, top_p=None, seed=0) -> None:
        """Enqueue decode step number ``step`` (1, 2, ...; the prefill chose token 0)."""
        dec.kernel.launch()
        if dec.step.next_token == "logits":  # top-k / top-p: the sampler, then the append
            st = dec.state
            logits = dec.step.graph.buffers[dec.step.logits]
            st["ids"].copy_(sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                   offset=step))
            append_token(st["ids"], st["pos"], st["tokens"])

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


class _HistoryReader:
    """Reads a decoder's token history back in blocks without stalling the GPU: each block's
    copy goes to its own pinned host buffer behind an event (two buffers, so one block is
    read while the next is copied), with the watchdog's error words beside it. On the CPU
    the copy is immediate."""

    def __init__(self, dec: _Decoder, device: torch.device):
        self.dec, self.cuda = dec, device.type == "cuda"
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, object]] = []
        if self.cuda and not dec.host:
            tokens, error = dec.state["tokens"], dec.kernel.error
            dec.host = [(torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True),
                         torch.empty(error.shape, dtype=error.dtype, pin_memory=True)) for _ in range(2)]
        self.count = 0

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def read(self, block: int) -> None:
        """Queue the read-back of the history after the steps enqueued so far."""
        tokens, error = self.dec.state["tokens"], self.dec.kernel.error
        if not self.cuda:
            self.pending.append((block, tokens.clone(), error.clone(), None))
            return
        host_tokens, host_error = self.dec.host[self.count % 2]
        self.count += 1
        host_tokens.copy_(tokens, non_blocking=True)
        host_error.copy_(error, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((block, host_tokens, host_error, event))

    def wait(self) -> tuple[int, torch.Tensor]:
        """The oldest queued block: (its number of tokens, the history as it was read).
        Raises MegakernelTimeout if a wait in its steps timed out."""
        block, tokens, error, event = self.pending.pop(0)
        if event is not None:
            event.synchronize()
        self.dec.kernel.check(error)
        return block, tokens


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


def _prefill_per_token(c: LlamaConfig, dtype: torch.dtype, precision: str) -> int:
    """Prefill activation bytes a token of a chunk holds (:func:`mk.models.prefill.per_token_bytes`)."""
    q = c.num_attention_heads * c.head_dim
    fast = precision == "fast"
    return _prefill.per_token_bytes(c.hidden_size, q, q + 2 * c.num_key_value_heads * c.head_dim,
                                    c.intermediate_size, dtype.itemsize if fast else 4, fast)


def _mm(a: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
        scale: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ weight.T`` by PyTorch (cuBLAS on a GPU), float32 accumulation; the result in
    ``out_dtype`` (default a's). ``scale``: the weight's format's scales
    (:mod:`mk.tasks.linear.format`): the product of ``weight * scale``, by :func:`_mm_scaled`."""
    if scale is not None:
        return _mm_scaled(a, weight, scale, out_dtype or a.dtype)
    if out_dtype is None or out_dtype == a.dtype:
        return torch.mm(a, weight.t())
    try:
        return torch.mm(a, weight.t(), out_dtype=out_dtype)
    except TypeError:  # PyTorch before 2.8: round to a's dtype, then widen
        return torch.mm(a, weight.t()).to(out_dtype)


#: Integer dtypes a tensor of token ids may have.
_ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _interleave_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Gate and up (weights, or their scales: a row's follow it) interleaved row by row, as
    :func:`mk.tasks.linear.interleave_gate_up` lays the weights out for SiLU·mul."""
    gate, up = parts
    if gate.dim() == 2 and gate.dtype == up.dtype and gate.dtype != torch.float8_e4m3fn:
        return interleave_gate_up(gate, up)
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _mm_scaled(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ (weight * scale).T`` in ``out_dtype``, for prefill. An FP8 weight scaled per output
    channel goes to the FP8 tensor cores (``torch._scaled_mm``) with ``a`` quantized to FP8 a
    row at a time (each row's largest magnitude at 448: W8A8, as prefill engines run FP8
    checkpoints; rows padded to a multiple of 16). A weight scaled per 128 columns is
    dequantized to ``a``'s dtype :data:`DEQUANT_ROWS` rows at a time (a bounded workspace).
    Off a GPU (FP8 values held in float32) the scales apply to the float32 product."""
    from mk.tasks.linear.format import FP8_MAX, expand_columns

    M, K = a.shape
    if weight.dtype == torch.float8_e4m3fn and scale.dim() == 1 and K % 16 == 0 and weight.shape[0] % 16 == 0:
        pad = -M % 16
        a_pad = a if not pad else torch.cat([a, a.new_zeros(pad, K)])
        a_scale = (a_pad.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
        a_q = (a_pad / a_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(a_q, weight.t(), scale_a=a_scale, scale_b=scale[None, :], out_dtype=torch.bfloat16)
        return (y if out_dtype == torch.bfloat16 else y.to(out_dtype))[:M]
    if weight.dtype != torch.float8_e4m3fn and scale.dim() == 1:
        return (_mm(a, weight.to(a.dtype), torch.float32) * scale).to(out_dtype)
    out = torch.empty(M, weight.shape[0], dtype=out_dtype, device=a.device)
    for n0 in range(0, weight.shape[0], DEQUANT_ROWS):
        rows = slice(n0, n0 + DEQUANT_ROWS)
        s = scale[rows][:, None] if scale.dim() == 1 else expand_columns(scale[rows], K)
        out[:, rows] = _mm(a, (weight[rows].float() * s).to(a.dtype), out_dtype)
    return out


#: Rows of a block-scaled weight dequantized at once in prefill (8B shapes: 32 MiB of float32).
DEQUANT_ROWS = 2048


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
