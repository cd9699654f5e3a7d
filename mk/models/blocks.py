"""The blocks the model families share: a decoder's sizes and the op graph of its decode step.

A :class:`ModelShape` is everything the planner needs to know about a family's decoder
(sizes and the per-family options, not weights); :func:`decode_graph` turns it, with a batch
size and a KV length, into the planner's :class:`~mk.planner.graph.OpGraph`: unfused ops
with their shapes, bytes and flops (from the tasks' own cost hooks), the tensors between
them, and the buffers each op binds (weights, KV cache, rotary table), named here and by
the families' weight packing alike (:func:`weight_key`).

Every supported family (Llama, Mistral, Qwen2, Qwen3) is this decoder: per layer RMSNorm
-> QKV (Qwen2: with a bias) -> [Qwen3: per-head RMSNorm of q and k] RoPE + KV append ->
attention (Mistral: over a sliding window) -> O projection + residual -> RMSNorm -> gate/up
-> SiLU·mul -> down + residual; then the final RMSNorm, the LM head and the next token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from mk.planner.graph import OpGraph, OpNode, add_cost
from mk.tasks.linear.format import weight_format
from mk.tasks.all_reduce import all_reduce_cost
from mk.tasks.argmax import argmax_cost
from mk.tasks.decode_attention import decode_attention_cost
from mk.tasks.embedding import embedding_cost
from mk.tasks.linear import linear_cost
from mk.tasks.rmsnorm import rmsnorm_cost
from mk.tasks.rope import rope_kv_cost
from mk.tasks.silu_mul import silu_mul_cost

#: Buffer-name prefix of the weights, which keeps them apart from the activations.
WEIGHT = "w."


def weight_key(op: str, role: str = "") -> str:
    """Name of the weight buffer of op ``op`` (``role``: a second weight of the op, e.g. a
    bias), as the decode graph binds it and a family's packing stores it."""
    return WEIGHT + op + (f".{role}" if role else "")


def cache_keys(layer: int) -> tuple[str, str]:
    """Names of layer ``layer``'s K and V cache buffers."""
    return f"l{layer}.k_cache", f"l{layer}.v_cache"


@dataclass(frozen=True)
class ModelShape:
    """Sizes and options of a decoder (what config.json says, without the weights).

    ``qkv_bias``: the q/k/v projections add a bias (Qwen2); ``qk_norm``: q and k get a
    per-head RMSNorm before RoPE (Qwen3); ``sliding_window``: each token attends to at most
    this many latest positions, itself included (Mistral), None for all of them.
    ``linear_format`` / ``lm_head_format``: how the layers' projections and the LM head store
    their weights (:mod:`mk.tasks.linear.format`: ``"plain"`` in ``dtype_bytes``, ``"fp8"``
    per output channel, ``"fp8-block"`` per 128 x 128 block).
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool = False
    dtype_bytes: int = 2
    #: bytes of a KV-cache element; None: the weights' (a float32 cache under bf16 weights is 4)
    kv_dtype_bytes: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    #: ranks the model is split over (tensor parallelism); above 1 the shape is one rank's
    #: share (:meth:`shard`): its heads, KV heads and intermediate columns, and vocab/tp rows
    #: of the embedding and the LM head (``vocab`` stays the model's)
    tp: int = 1
    linear_format: str = "plain"
    lm_head_format: str = "plain"

    def __post_init__(self):
        weight_format(self.linear_format), weight_format(self.lm_head_format)  # (refuses an unknown one)
        if self.kv_dtype_bytes is None:
            object.__setattr__(self, "kv_dtype_bytes", self.dtype_bytes)
        for f in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab", "dtype_bytes",
                  "kv_dtype_bytes", "tp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape {self.name!r}: {f} must be an int >= 1, got {v!r}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"ModelShape {self.name!r}: sliding_window must be None or an int >= 1, got {w!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape {self.name!r}: heads ({self.heads}) must be a multiple of "
                             f"kv_heads ({self.kv_heads}) for grouped-query attention")

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (embedding rows excepted: one row per token),
        each projection in its format, scales included; of one rank's share under tensor
        parallelism."""
        h, i, d, db = self.hidden, self.intermediate, self.head_dim, self.dtype_bytes
        qkv = (self.heads + 2 * self.kv_heads) * d
        proj = weight_format(self.linear_format)
        per_layer = (proj.nbytes(qkv, h, db) + proj.nbytes(h, self.heads * d, db) + proj.nbytes(2 * i, h, db)
                     + proj.nbytes(h, i, db)
                     + (2 * h + (qkv if self.qkv_bias else 0) + (2 * d if self.qk_norm else 0)) * db)
        return self.layers * per_layer + h * db + weight_format(self.lm_head_format).nbytes(self.vocab // self.tp, h, db)

    def shard(self, tp: int) -> "ModelShape":
        """One rank's share of this model split over ``tp`` ranks (tensor parallelism): the
        q heads, KV heads and MLP columns split evenly, the LM head's vocabulary rows too.
        Raises ValueError naming the size that does not divide (fewer KV heads than ranks
        included: mk does not replicate KV heads)."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {tp!r}")
        if self.tp != 1:
            raise ValueError(f"ModelShape {self.name!r} is already one of {self.tp} ranks' shares")
        if tp == 1:
            return self
        for what, n in (("key/value heads", self.kv_heads), ("attention heads", self.heads),
                        ("intermediate size", self.intermediate), ("vocabulary", self.vocab)):
            if n % tp:
                raise ValueError(f"{self.name}: {n} {what} do not split over tp={tp} ranks"
                                 + (" (mk splits KV heads, it does not replicate them)"
                                    if what == "key/value heads" else ""))
        return replace(self, name=f"{self.name}/tp{tp}", heads=self.heads // tp, kv_heads=self.kv_heads // tp,
                       intermediate=self.intermediate // tp, tp=tp)

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """A known shape by name (:data:`MODEL_PRESETS`)."""
        key = name.lower().replace("_", "-")
        if key not in MODEL_PRESETS:
            raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_PRESETS)}")
        return MODEL_PRESETS[key]

    def to_dict(self) -> dict:
        return asdict(self)


MODEL_PRESETS = {
    "llama-3.2-1b": ModelShape("llama-3.2-1b", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                               head_dim=64, vocab=128256, tie_embeddings=True),
    "llama-3-8b": ModelShape("llama-3-8b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                             head_dim=128, vocab=128256),
    "mistral-7b": ModelShape("mistral-7b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                             head_dim=128, vocab=32768),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4,
                             head_dim=128, vocab=152064, qkv_bias=True),
    "llama-3-70b": ModelShape("llama-3-70b", hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8,
                              head_dim=128, vocab=128256),
    "qwen3-8b": ModelShape("qwen3-8b", hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                           head_dim=128, vocab=151936, qk_norm=True),
}


def tp_keys(layer: int, role: str) -> tuple[str, str]:
    """Names of the symmetric buffers of one all-reduce of a tensor-parallel step (``role``:
    ``o`` or ``d``, after the O or the down projection of ``layer``): its partial sums, and
    the words every rank pushes of theirs. Those alternate between two buffers, one for the
    O and one for the down projections (and the embedding's, which the choice of the last
    step's token separates from the last down projection's): an all-reduce's words never
    land before the one two back has read them (:mod:`mk.tasks.all_reduce`)."""
    return f"tp.l{layer}.{role}", f"tp.recv.{role}"


#: The symmetric buffers of a tensor-parallel step besides the layers' all-reduces': every
#: rank's workspace base, and the next token's candidates of each rank with their flags.
TP_PEERS, TP_SHARED, TP_FLAGS = "tp.peers", "tp.argmax", "tp.argmax.flags"
#: The embedding's partial rows of a tensor-parallel step (each rank's vocabulary share).
TP_EMBED = "tp.embed"


#: Sequences one decode step holds at most. Batches up to 16 run on the decode tiles
#: (GEMV streams, 16-row tensor-core tiles), larger ones on the prefill's; the planner's
#: search grows with the batch (batch 64: seconds on a CPU).
MAX_BATCH = 64


def decode_graph(model: ModelShape, batch: int, kv_len: int) -> OpGraph:
    """The unfused ops of one decode step for ``batch`` sequences of ``kv_len`` cached tokens
    (the new token included), with the buffers each binds (see the module docstring). For
    one rank's share of a tensor-parallel model (``model.tp > 1``), the O and down
    projections write partial sums that an all-reduce adds to the residual, and the LM
    head's vocabulary share ends in the choice over ranks (:mod:`mk.tasks.all_reduce`)."""
    for name, v in (("batch", batch), ("kv_len", kv_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if batch > MAX_BATCH:
        raise ValueError(f"batch must be at most {MAX_BATCH} (mk.models.blocks.MAX_BATCH), got {batch}")
    m, B, db, tp = model, batch, model.dtype_bytes, model.tp
    h, i, d, hq, hkv = m.hidden, m.intermediate, m.head_dim, m.heads, m.kv_heads
    g = OpGraph(m.name, batch, kv_len, db)

    def op(name, kind, inputs, outputs, dims, cost, layer=-1, fuse_into=None, buffers=None, fuse_later=None):
        return g.add(OpNode(name, kind, tuple(inputs), tuple(outputs), dims, cost.bytes_read, cost.bytes_written,
                            cost.flops, layer, fuse_into, {"w": weight_key(name)} if buffers is None else buffers,
                            f"l{layer}." if layer >= 0 else "", fuse_later))

    def linear(name, inputs, outputs, M, N, K, layer=-1, fmt=m.linear_format, bias=False):
        """A projection: its weight in format ``fmt`` (its bytes, its scales' buffer)."""
        f = weight_format(fmt)
        dims = {"M": M, "N": N, "K": K} | ({"w_format": fmt} if f.scales != "none" else {})
        buffers = {"w": weight_key(name)} | ({"w_scale": weight_key(name, "scale")} if f.scales != "none" else {})
        buffers |= {"bias": weight_key(name, "bias")} if bias else {}
        return op(name, "linear", inputs, outputs, dims,
                  linear_cost(M, N, K, db, bias=bias, weight_bytes=f.nbytes(N, K, db)), layer, buffers=buffers)

    def residual(name, L, partial, res, out, proj):
        """``out = res + partial`` (one rank: the add fused into the projection; tensor
        parallel: the all-reduce of every rank's partial, which the projection's tiles may
        run themselves)."""
        if tp == 1:
            op(name, "add", [partial, res], [out], {"rows": B, "n": h}, add_cost(B, h, db), L, fuse_into=proj,
               buffers={})
        else:
            part, recv = tp_keys(L, partial.rsplit(".", 1)[1])
            op(name, "all_reduce", [partial, res], [out], {"rows": B, "n": h, "world": tp},
               all_reduce_cost(B, h, tp), L, fuse_into=proj, buffers={"part": part, "recv": recv, "peers": TP_PEERS})

    def partial(L, role):  # a projection's output: the all-reduce's symmetric partial under TP
        return tp_keys(L, role)[0] if tp > 1 else f"l{L}.{role}"

    v = m.vocab // tp  # (the embedding's and the LM head's rows of one rank)
    if tp == 1:
        op("embed", "embedding", ["tokens"], ["x0"], {"rows": B, "hidden": h, "vocab": v}, embedding_cost(B, h, db))
    else:  # each rank's vocabulary share: its tokens' rows, zeros for the others', summed over the ranks
        op("embed", "embedding", ["tokens"], [TP_EMBED], {"rows": B, "hidden": h, "vocab": v, "world": tp},
           embedding_cost(B, h, db))
        op("embed_reduce", "all_reduce", [TP_EMBED], ["x0"], {"rows": B, "n": h, "world": tp},
           all_reduce_cost(B, h, tp), buffers={"part": TP_EMBED, "recv": tp_keys(0, "d")[1], "peers": TP_PEERS})
    x = "x0"
    attended = min(kv_len, m.sliding_window or kv_len)  # a window's keys are all the step reads
    for L in range(m.layers):
        p = f"l{L}."
        k_cache, v_cache = cache_keys(L)
        op(p + "attn_norm", "rmsnorm", [x], [p + "h"], {"rows": B, "n": h}, rmsnorm_cost(B, h, db), L,
           fuse_into=p + "qkv")
        n_qkv = (hq + 2 * hkv) * d
        linear(p + "qkv", [p + "h"], [p + "qkv"], B, n_qkv, h, L, bias=m.qkv_bias)
        rope_bufs = {"inv_freq": "inv_freq", "k_cache": k_cache, "v_cache": v_cache}
        if m.qk_norm:
            rope_bufs |= {"q_norm": weight_key(p + "q_norm"), "k_norm": weight_key(p + "k_norm")}
        op(p + "rope_kv", "rope_kv", [p + "qkv"], [p + "q", p + "kv_cache"],
           {"batch": B, "heads": hq, "kv_heads": hkv, "head_dim": d, "qk_norm": m.qk_norm},
           rope_kv_cost(B, 1, hq, hkv, d, db, qk_norm=m.qk_norm), L, fuse_into=p + "qkv", buffers=rope_bufs,
           fuse_later=p + "attention")
        op(p + "attention", "attention", [p + "q", p + "kv_cache"], [p + "attn"],
           {"batch": B, "heads": hq, "kv_heads": hkv, "head_dim": d, "kv_len": attended,
            "kv_dtype_bytes": m.kv_dtype_bytes, "window": m.sliding_window},
           decode_attention_cost(B, hq, hkv, d, attended, dtype_bytes=m.kv_dtype_bytes), L,
           buffers={"k_cache": k_cache, "v_cache": v_cache})
        o = partial(L, "o")
        linear(p + "o_proj", [p + "attn"], [o], B, h, hq * d, L)
        residual(p + "attn_residual", L, o, x, p + "x1", p + "o_proj")
        op(p + "mlp_norm", "rmsnorm", [p + "x1"], [p + "h2"], {"rows": B, "n": h}, rmsnorm_cost(B, h, db), L,
           fuse_into=p + "gate_up")
        linear(p + "gate_up", [p + "h2"], [p + "gu"], B, 2 * i, h, L)
        op(p + "silu_mul", "silu_mul", [p + "gu"], [p + "act"], {"rows": B, "i": i}, silu_mul_cost(B, i, db), L,
           fuse_into=p + "gate_up", buffers={})
        dn = partial(L, "d")
        linear(p + "down", [p + "act"], [dn], B, h, i, L)
        residual(p + "mlp_residual", L, dn, p + "x1", f"x{L + 1}", p + "down")
        x = f"x{L + 1}"
    op("final_norm", "rmsnorm", [x], ["hf"], {"rows": B, "n": h}, rmsnorm_cost(B, h, db), fuse_into="lm_head")
    linear("lm_head", ["hf"], ["logits"], B, v, h, fmt=m.lm_head_format)
    op("argmax", "argmax", ["logits"], ["next_token"], {"rows": B, "v": v, "world": tp}, argmax_cost(B, v, db),
       fuse_into="lm_head", buffers={} if tp == 1 else {"shared": TP_SHARED, "flags": TP_FLAGS, "peers": TP_PEERS})
    return g
