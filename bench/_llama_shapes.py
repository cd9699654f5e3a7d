"""The Llama shapes of the GPU benchmarks and their random bf16 weights."""
import torch

SHAPES = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_theta=500000.0, max_position_embeddings=131072, eos_token_id=None,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               rope_theta=500000.0, max_position_embeddings=8192, eos_token_id=None),
    # Deep and narrow (SmolLM-135M's shape): many short layers, where the per-layer chain of
    # dependency hops, not bandwidth, sets the step's time.
    "135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                 rope_theta=100000.0, max_position_embeddings=8192, eos_token_id=None),
}

#: Qwen3-8B's shape (a Qwen3 model: q/k norm per head, 36 layers).
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                rope_theta=1000000.0, max_position_embeddings=40960, eos_token_id=None)


#: Qwen2.5-0.5B's shape (a Qwen2 model: q/k/v biases; deep, narrow, a large tied vocabulary).
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                  rope_theta=1000000.0, max_position_embeddings=32768, eos_token_id=None)


#: Shapes too large for one GPU: the tensor-parallel benchmarks' (bench/test_tp.py).
TP_SHAPES = {
    "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                rope_theta=500000.0, max_position_embeddings=8192, eos_token_id=None),
}


#: Positions of the benchmark models (their KV cache).
MAX_SEQ = 1024


def shape_model(key: str, max_seq_len: int = MAX_SEQ, max_batch_size: int = 8):
    """A bf16 mk Llama of shape ``key`` with random weights on the GPU."""
    from mk.models import Llama, LlamaConfig

    cfg = LlamaConfig(**SHAPES[key])
    weights = random_model(cfg)
    return Llama(cfg, weights, device="cuda", dtype=torch.bfloat16, max_batch_size=max_batch_size,
                 max_seq_len=max_seq_len, name=f"llama-{key}")


def random_model(cfg, seed=0, shard=None):
    """Random bf16 weights drawn on the GPU (std 0.02, norms 1 + 0.1 N), HF names. ``shard``:
    one rank's slices (mk.models.weights.tp_slices), each tensor cut as it is drawn (every
    rank draws the same model and keeps its share)."""
    from mk.models.weights import expected_shapes, shard_tensor
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = {}
    for name, shape in expected_shapes(cfg).items():
        t = shard_tensor(name, torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32), shard or {})
        w[name] = ((1 + 0.1 * t) if name.endswith("norm.weight") else 0.02 * t).to(torch.bfloat16).contiguous()
        del t
    if shard is not None and "lm_head.weight" in shard and "lm_head.weight" not in w:
        w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()  # a tied head's share
    return w
