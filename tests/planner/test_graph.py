"""The planner's op DAG of a Llama decode step: shapes, bytes, edges, errors."""

import pytest

from mk.planner.graph import MODEL_PRESETS, ModelShape, llama_decode_graph

LLAMA_3_8B_CONFIG = {  # the fields of meta-llama/Meta-Llama-3-8B's config.json the planner reads
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "model_type": "llama",
}


def test_weight_bytes_match_the_bandwidth_floors_of_the_design():
    # DESIGN.md: floors 0.585 ms (1B) and 3.55 ms (8B) at 4.22 TB/s copy bandwidth.
    assert ModelShape.preset("llama-3.2-1b").weight_bytes / 4.22e12 == pytest.approx(0.585e-3, rel=0.01)
    assert ModelShape.preset("Llama-3-8B").weight_bytes / 4.22e12 == pytest.approx(3.55e-3, rel=0.01)


def test_from_hf_config_reads_a_llama_config():
    shape = ModelShape.from_hf_config(LLAMA_3_8B_CONFIG, name="llama-3-8b")
    assert shape == MODEL_PRESETS["llama-3-8b"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelShape.from_hf_config({k: v for k, v in LLAMA_3_8B_CONFIG.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelShape.from_hf_config({**LLAMA_3_8B_CONFIG, "num_key_value_heads": 5})
    with pytest.raises(ValueError, match="unknown model shape 'gpt-5'"):
        ModelShape.preset("gpt-5")


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_graph_is_complete_and_topological(name, batch):
    m = ModelShape.preset(name)
    g = llama_decode_graph(m, batch=batch, kv_len=1000)
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
    g = llama_decode_graph(ModelShape.preset("llama-3.2-1b"), batch=2, kv_len=37)
    import json

    data = json.loads(g.to_json())
    assert data["ops"] == len(g.nodes) and data["kinds"]["linear"] == 4 * 16 + 1
    assert data["nodes"][1]["fuse_into"] == "l0.qkv"
    with pytest.raises(ValueError, match="batch"):
        llama_decode_graph(ModelShape.preset("llama-3.2-1b"), batch=0, kv_len=10)
    with pytest.raises(ValueError, match="hidden"):
        ModelShape("x", hidden=0, intermediate=1, layers=1, heads=1, kv_heads=1, head_dim=1, vocab=1)
