"""The decode step's op graph the families hand the planner: shapes, bytes, edges, bound buffers, errors."""

import pytest

from mk.models.blocks import MODEL_PRESETS, ModelShape, decode_graph
from mk.models.config import LlamaConfig

LLAMA_3_8B_CONFIG = {  # the fields of meta-llama/Meta-Llama-3-8B's config.json the planner reads
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "model_type": "llama",
}


def test_weight_bytes_match_the_bandwidth_floors_of_the_design():
    # DESIGN.md: floors 0.585 ms (1B) and 3.55 ms (8B) at 4.22 TB/s copy bandwidth.
    assert ModelShape.preset("llama-3.2-1b").weight_bytes / 4.22e12 == pytest.approx(0.585e-3, rel=0.01)
    assert ModelShape.preset("Llama-3-8B").weight_bytes / 4.22e12 == pytest.approx(3.55e-3, rel=0.01)


def test_a_config_gives_the_shape_of_its_preset():
    shape = LlamaConfig.from_dict(LLAMA_3_8B_CONFIG).to_model_shape(name="llama-3-8b")
    assert shape == MODEL_PRESETS["llama-3-8b"]
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelShape("x", hidden=64, intermediate=64, layers=1, heads=4, kv_heads=3, head_dim=16, vocab=8)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelShape("x", hidden=64, intermediate=64, layers=1, heads=4, kv_heads=2, head_dim=16, vocab=8,
                   sliding_window=0)
    with pytest.raises(ValueError, match="unknown model shape 'gpt-5'"):
        ModelShape.preset("gpt-5")


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_graph_is_complete_and_topological(name, batch):
    m = ModelShape.preset(name)
    g = decode_graph(m, batch=batch, kv_len=1000)
    assert len(g.nodes) == 1 + 11 * m.layers + 3
    seen = {"tokens"}
    for n in g.nodes:  # every input is produced earlier (or is the token ids)
        assert set(n.inputs) <= seen, n.name
        seen |= set(n.outputs)
    # Every linear is [M=batch, K] x [N, K]^T with the model's sizes.
    linears = {n.name.split(".")[-1]: n.dims for n in g.nodes if n.kind == "linear" and n.layer == 0}
    d = m.head_dim
    assert linears == {"qkv": {"M": batch, "N": (m.heads + 2 * m.kv_heads) * d, "K": m.hidden},
                       "o_proj": {"M": batch, "N": m.hidden, "K": m.heads * d},
                       "gate_up": {"M": batch, "N": 2 * m.intermediate, "K": m.hidden},
                       "down": {"M": batch, "N": m.hidden, "K": m.intermediate}}
    # Bytes: every weight once, plus the KV cache read by attention, plus small activations.
    kv = 2 * m.layers * batch * 1000 * m.kv_heads * d * 2
    weights = m.weight_bytes
    assert weights + kv < g.bytes < (weights + kv) * 1.02
    # Residual adds read the layer input: an edge from the previous layer's output.
    edges = g.edges()
    assert ("l0.o_proj", "l0.attn_residual", "l0.o") in edges and ("embed", "l0.attn_residual", "x0") in edges
    assert ("l1.rope_kv", "l1.attention", "l1.kv_cache") in edges
    assert not any(a.startswith("l0.") and b.startswith("l1.attention") for a, b, _ in edges)


def test_graph_serialises_and_rejects_bad_sizes():
    g = decode_graph(ModelShape.preset("llama-3.2-1b"), batch=2, kv_len=37)
    import json

    data = json.loads(g.to_json())
    assert data["ops"] == len(g.nodes) and data["kinds"]["linear"] == 4 * 16 + 1
    assert data["nodes"][1]["fuse_into"] == "l0.qkv"
    with pytest.raises(ValueError, match="batch"):
        decode_graph(ModelShape.preset("llama-3.2-1b"), batch=0, kv_len=10)
    with pytest.raises(ValueError, match="hidden"):
        ModelShape("x", hidden=0, intermediate=1, layers=1, heads=1, kv_heads=1, head_dim=1, vocab=1)


def test_ops_bind_the_buffers_the_family_options_add():
    base = dict(name="x", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=50)
    plain = decode_graph(ModelShape(**base), batch=1, kv_len=100)
    assert plain.node("l1.qkv").buffers == {"w": "w.l1.qkv"}
    assert plain.node("l1.attention").buffers == {"k_cache": "l1.k_cache", "v_cache": "l1.v_cache"}
    assert plain.node("embed").buffers == {"w": "w.embed"} and plain.node("l0.silu_mul").buffers == {}
    assert all(n.scope == (f"l{n.layer}." if n.layer >= 0 else "") for n in plain.nodes)
    qwen = decode_graph(ModelShape(**base, qkv_bias=True, qk_norm=True), batch=1, kv_len=100)
    assert qwen.node("l1.qkv").buffers == {"w": "w.l1.qkv", "bias": "w.l1.qkv.bias"}
    assert {"q_norm": "w.l1.q_norm", "k_norm": "w.l1.k_norm"}.items() <= qwen.node("l1.rope_kv").buffers.items()
    assert ModelShape(**base, qkv_bias=True, qk_norm=True).weight_bytes == (
        ModelShape(**base).weight_bytes + 2 * 2 * ((4 + 2 * 2) * 16 + 2 * 16))
    # A window caps the keys a step reads, and so attention's bytes.
    windowed = decode_graph(ModelShape(**base, sliding_window=10), batch=1, kv_len=100)
    att, full = windowed.node("l0.attention"), plain.node("l0.attention")
    assert att.dims["window"] == 10 and att.dims["kv_len"] == 10 and full.dims["kv_len"] == 100
    assert att.bytes_read < full.bytes_read / 5
