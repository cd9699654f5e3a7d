"""mk's task library: Triton device functions, each also usable as an ordinary op.

Every task file (a package for a big op: linear/) holds ``<task>_tile`` (the ``@jit``
device function a persistent kernel calls; it touches only its own tile), a standalone
launcher (the op), ``<task>_ref`` (a plain torch reference), its cost, its megakernel
spec: ``<task>_op`` factories of :class:`OpSpec`, registered under the op's name when this
package is imported (:func:`make_op` builds one, :func:`op_tiles` lists its tasks), and
how the planner plans it: an :class:`OpKind` object registered under the kind of the
decode step's ops it runs (:func:`op_kind` finds it; :mod:`mk.tasks._planning`).
"""

# (Modules whose launchers are not exported here still register their megakernel ops.)
from . import all_reduce, append_token, qkv_rope  # noqa: F401
from ._cache import cache_dir, sources_hash
from ._cost import TaskCost
from ._planning import (ACTIVATION_BYTES, GREEDY, LOGITS, NEXT_TOKEN, SAMPLE, OpChoice, OpKind, PhaseTerms, op_kind,
                        op_kinds, register_kind)
from ._device import default_device, default_dtype, enable_device_descriptors, interpreting, jit, supported_dtypes
from ._spec import OpSpec, Region, make_op, op_tiles, register, registered_ops
from .argmax import argmax, argmax_partial_tile, argmax_reduce_tile, argmax_ref
from .decode_attention import (decode_attention, decode_attention_merge_tile, decode_attention_partial_tile,
                               decode_attention_ref)
from .embedding import embedding, embedding_ref, embedding_tile
from .linear import (LinearConfig, interleave_gate_up, linear, linear_config, linear_partial_tile, linear_ref,
                     linear_splitk_reduce_tile, linear_tile)
from .prefill_attention import prefill_attention, prefill_attention_ref, prefill_attention_tile
from .rmsnorm import rmsnorm, rmsnorm_ref, rmsnorm_tile
from .rope import rope, rope_inv_freq, rope_kv, rope_kv_ref, rope_kv_tile, rope_ref
from .sample import gumbel_noise, sample, sample_ref
from .silu_mul import silu_mul, silu_mul_ref, silu_mul_tile

__all__ = [
    "cache_dir", "sources_hash", "TaskCost",
    "ACTIVATION_BYTES", "GREEDY", "LOGITS", "NEXT_TOKEN", "SAMPLE", "OpChoice", "OpKind", "PhaseTerms", "op_kind",
    "op_kinds", "register_kind", "default_device", "default_dtype", "enable_device_descriptors", "interpreting", "jit",
    "supported_dtypes",
    "OpSpec", "Region", "make_op", "op_tiles", "register", "registered_ops",
    "argmax", "argmax_partial_tile", "argmax_reduce_tile", "argmax_ref",
    "decode_attention", "decode_attention_merge_tile", "decode_attention_partial_tile", "decode_attention_ref",
    "embedding", "embedding_ref", "embedding_tile",
    "LinearConfig", "interleave_gate_up", "linear", "linear_config", "linear_partial_tile", "linear_ref",
    "linear_splitk_reduce_tile", "linear_tile",
    "prefill_attention", "prefill_attention_ref", "prefill_attention_tile",
    "rmsnorm", "rmsnorm_ref", "rmsnorm_tile",
    "rope", "rope_inv_freq", "rope_kv", "rope_kv_ref", "rope_kv_tile", "rope_ref",
    "gumbel_noise", "sample", "sample_ref",
    "silu_mul", "silu_mul_ref", "silu_mul_tile",
]
