"""The op DAG of one decode step: what the planner plans.

A :class:`ModelShape` is everything the planner needs to know about a decoder-only
transformer (sizes, not weights); :func:`llama_decode_graph` turns it, with a batch size
and a KV length, into an :class:`OpGraph`: nodes are unfused ops with their shapes,
bytes and flops (from the tasks' own cost hooks), edges are the tensors between them.
Fusions (RMSNorm prologue, SiLU·mul and residual epilogues, ...) are the search's
choice, not the graph's: the graph lists every op on its own, and marks which
neighbours *may* fuse.

Another decoder-only family needs only a new builder that emits the same node kinds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from mk.tasks.argmax import argmax_cost
from mk.tasks.decode_attention import decode_attention_cost
from mk.tasks.embedding import embedding_cost
from mk.tasks.linear import linear_cost
from mk.tasks.rmsnorm import rmsnorm_cost
from mk.tasks.rope import rope_kv_cost
from mk.tasks.silu_mul import silu_mul_cost

#: Node kinds the builders emit and the planner knows how to tile.
KINDS = ("embedding", "rmsnorm", "linear", "rope_kv", "attention", "silu_mul", "add", "argmax")


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-family decoder (what config.json says, without the weights)."""

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

    def __post_init__(self):
        if self.kv_dtype_bytes is None:
            object.__setattr__(self, "kv_dtype_bytes", self.dtype_bytes)
        for f in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab", "dtype_bytes",
                  "kv_dtype_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape {self.name!r}: {f} must be an int >= 1, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape {self.name!r}: heads ({self.heads}) must be a multiple of "
                             f"kv_heads ({self.kv_heads}) for grouped-query attention")

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (embedding rows excepted: one row per token)."""
        h, i, d = self.hidden, self.intermediate, self.head_dim
        per_layer = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 2 * h * i + i * h + 2 * h
        return (self.layers * per_layer + h + self.vocab * h) * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, config: dict, name: str | None = None) -> "ModelShape":
        """From a Hugging Face ``config.json`` dict of a Llama-family model."""
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in need if k not in config]
        if missing:
            raise ValueError(f"config.json lacks {missing}: not a Llama-family decoder config")
        heads = config["num_attention_heads"]
        return cls(name=name or config.get("_name_or_path") or config.get("model_type", "model"),
                   hidden=config["hidden_size"], intermediate=config["intermediate_size"],
                   layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads", heads),
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   vocab=config["vocab_size"], tie_embeddings=bool(config.get("tie_word_embeddings", False)))

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
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
}


@dataclass(frozen=True)
class OpNode:
    """One unfused op: its kind, tensors in and out, sizes, and what it moves and computes.

    ``dims`` are the kind's own sizes (a linear: M, N, K; attention: batch, heads, kv_heads,
    head_dim, kv_len; ...). ``fuse_into`` names the op this one may be folded into.
    """

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dims: dict
    bytes_read: int
    bytes_written: int
    flops: int
    layer: int = -1
    fuse_into: str | None = None

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass
class OpGraph:
    """Ops in program order (a topological order) and the tensors that link them."""

    model: ModelShape
    batch: int
    kv_len: int
    nodes: list[OpNode] = field(default_factory=list)

    def add(self, node: OpNode) -> OpNode:
        if node.kind not in KINDS:
            raise ValueError(f"op {node.name}: unknown kind {node.kind!r}")
        self.nodes.append(node)
        return node

    def producers(self) -> dict[str, str]:
        """Tensor -> the op that writes it last."""
        return {t: n.name for n in self.nodes for t in n.outputs}

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer op, consumer op, tensor) for every tensor an op reads from an earlier op."""
        out, last = [], {}
        for n in self.nodes:
            for t in n.inputs:
                if t in last:
                    out.append((last[t], n.name, t))
            for t in n.outputs:
                last[t] = n.name
        return out

    def node(self, name: str) -> OpNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no op named {name!r}")

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.nodes)

    @property
    def flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def summary(self) -> dict:
        kinds: dict[str, int] = {}
        for n in self.nodes:
            kinds[n.kind] = kinds.get(n.kind, 0) + 1
        return {"model": self.model.name, "batch": self.batch, "kv_len": self.kv_len, "ops": len(self.nodes),
                "kinds": kinds, "bytes": self.bytes, "flops": self.flops}

    def to_json(self) -> str:
        return json.dumps({**self.summary(), "nodes": [asdict(n) for n in self.nodes]}, indent=1)


def llama_decode_graph(model: ModelShape, batch: int, kv_len: int) -> OpGraph:
    """The unfused ops of one Llama decode step for ``batch`` sequences of ``kv_len`` cached
    tokens (the new token included): embedding, per layer RMSNorm -> QKV -> RoPE + KV append
    -> attention -> O-proj -> residual add -> RMSNorm -> gate/up -> SiLU·mul -> down ->
    residual add, then the final RMSNorm, LM head and argmax.
    """
    for name, v in (("batch", batch), ("kv_len", kv_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    m, B, db = model, batch, model.dtype_bytes
    h, i, d, hq, hkv = m.hidden, m.intermediate, m.head_dim, m.heads, m.kv_heads
    g = OpGraph(model, batch, kv_len)

    def op(name, kind, inputs, outputs, dims, cost, layer=-1, fuse_into=None):
        return g.add(OpNode(name, kind, tuple(inputs), tuple(outputs), dims, cost.bytes_read, cost.bytes_written,
                            cost.flops, layer, fuse_into))

    op("embed", "embedding", ["tokens"], ["x0"], {"rows": B, "hidden": h}, embedding_cost(B, h, db))
    x = "x0"
    for L in range(m.layers):
        p = f"l{L}."
        op(p + "attn_norm", "rmsnorm", [x], [p + "h"], {"rows": B, "n": h}, rmsnorm_cost(B, h, db), L,
           fuse_into=p + "qkv")
        n_qkv = (hq + 2 * hkv) * d
        op(p + "qkv", "linear", [p + "h"], [p + "qkv"], {"M": B, "N": n_qkv, "K": h}, linear_cost(B, n_qkv, h, db), L)
        op(p + "rope_kv", "rope_kv", [p + "qkv"], [p + "q", p + "kv_cache"],
           {"batch": B, "heads": hq, "kv_heads": hkv, "head_dim": d}, rope_kv_cost(B, 1, hq, hkv, d, db), L,
           fuse_into=p + "qkv")
        op(p + "attention", "attention", [p + "q", p + "kv_cache"], [p + "attn"],
           {"batch": B, "heads": hq, "kv_heads": hkv, "head_dim": d, "kv_len": kv_len,
            "kv_dtype_bytes": m.kv_dtype_bytes},
           decode_attention_cost(B, hq, hkv, d, kv_len, dtype_bytes=m.kv_dtype_bytes), L)
        op(p + "o_proj", "linear", [p + "attn"], [p + "o"], {"M": B, "N": h, "K": hq * d},
           linear_cost(B, h, hq * d, db), L)
        op(p + "attn_residual", "add", [p + "o", x], [p + "x1"], {"rows": B, "n": h},
           _add_cost(B, h, db), L, fuse_into=p + "o_proj")
        op(p + "mlp_norm", "rmsnorm", [p + "x1"], [p + "h2"], {"rows": B, "n": h}, rmsnorm_cost(B, h, db), L,
           fuse_into=p + "gate_up")
        op(p + "gate_up", "linear", [p + "h2"], [p + "gu"], {"M": B, "N": 2 * i, "K": h},
           linear_cost(B, 2 * i, h, db), L)
        op(p + "silu_mul", "silu_mul", [p + "gu"], [p + "act"], {"rows": B, "i": i}, silu_mul_cost(B, i, db), L,
           fuse_into=p + "gate_up")
        op(p + "down", "linear", [p + "act"], [p + "d"], {"M": B, "N": h, "K": i}, linear_cost(B, h, i, db), L)
        op(p + "mlp_residual", "add", [p + "d", p + "x1"], [f"x{L + 1}"], {"rows": B, "n": h},
           _add_cost(B, h, db), L, fuse_into=p + "down")
        x = f"x{L + 1}"
    op("final_norm", "rmsnorm", [x], ["hf"], {"rows": B, "n": h}, rmsnorm_cost(B, h, db), fuse_into="lm_head")
    op("lm_head", "linear", ["hf"], ["logits"], {"M": B, "N": m.vocab, "K": h}, linear_cost(B, m.vocab, h, db))
    op("argmax", "argmax", ["logits"], ["next_token"], {"rows": B, "v": m.vocab}, argmax_cost(B, m.vocab, db),
       fuse_into="lm_head")
    return g


def _add_cost(rows: int, n: int, dtype_bytes: int):
    from mk.tasks._cost import TaskCost

    return TaskCost(2 * rows * n * dtype_bytes, rows * n * dtype_bytes, rows * n)
