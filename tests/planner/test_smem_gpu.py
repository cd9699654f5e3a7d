"""The planner's shared-memory model against the compiled megakernel (GPU).

For one-layer Llama steps of the 1B and 8B layer shapes under plans covering every tile
path (TMA rings of several depths and widths, split-K, register GEMV tiles, tl.dot tiles
at batch 8 and 16 with and without a fused RMSNorm, fed by plain loads or a TMA ring), the shared memory Triton reports for
the compiled megakernel must equal the model's peak (:func:`mk.planner.cost.op_smem_bytes`,
the most any task takes), or exceed it by at most 1 KiB of layout padding the model
rounds up.
"""

from dataclasses import replace

import pytest
import torch

from mk.models import Llama, LlamaConfig
from mk.planner.cost import OpChoice, estimate_step
from mk.models.blocks import decode_graph
from mk.planner.search import search

pytestmark = pytest.mark.gpu

LAYER_SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128),
}
TMA = dict(block_k=256, num_warps=4)
LINEAR_CHOICES = {
    "search": None,
    "tma16_ring4": OpChoice(block_n=16, tma_stages=4, **TMA),
    "tma32_ring4_split2": OpChoice(block_n=32, tma_stages=4, split_k=2, **TMA),
    "tma64_ring2": OpChoice(block_n=64, tma_stages=2, **TMA),
    "tma16_ring1_split8": OpChoice(block_n=16, tma_stages=1, split_k=8, **TMA),
    "register_8x2048": OpChoice(block_n=8, block_k=2048, num_warps=4),
    "register_32x512": OpChoice(block_n=32, block_k=512, num_warps=4),
}
DOT_CHOICES = {
    "search": None,
    "dot_32x256": OpChoice(block_n=32, block_k=256, stages=4, num_warps=2),
    "dot_64x128_split2": OpChoice(block_n=64, block_k=128, split_k=2, num_warps=2),
    "tma_dot_64_ring4_split2": OpChoice(block_n=64, tma_stages=4, split_k=2, **TMA),
    "tma_dot_32_ring2": OpChoice(block_n=32, tma_stages=2, **TMA),
}
# Every batch-1 path at the 1B layer; the 8B layer (head_dim 128: a larger attention tile)
# and batches 8 and 16 on fewer, since each case compiles a megakernel.
CASES = ([("1b", 1, v) for v in LINEAR_CHOICES] + [("8b", 1, "search"), ("8b", 1, "tma32_ring4_split2")]
         + [("1b", 8, v) for v in DOT_CHOICES] + [("1b", 16, "dot_64x128_split2"), ("1b", 16, "tma_dot_32_ring2"),
                                                  ("8b", 8, "search")])


@pytest.fixture(scope="module")
def models():
    built = {}

    def get(shape):
        if shape not in built:
            cfg = LlamaConfig(vocab_size=4096, num_hidden_layers=1, max_position_embeddings=512,
                              **LAYER_SHAPES[shape])
            built[shape] = Llama.from_config(cfg, seed=0, max_batch_size=16, max_seq_len=256, name=f"layer-{shape}")
        return built[shape]

    yield get
    built.clear()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("shape,batch,variant", CASES)
def test_compiled_shared_memory_matches_the_model(models, shape, batch, variant):
    model = models(shape)
    graph = decode_graph(model.shape, batch, model.max_seq_len)
    plan = search(graph, model.device_spec, top_k=1)[0]
    pick = (LINEAR_CHOICES if batch == 1 else DOT_CHOICES)[variant]
    if pick is not None:
        choices = {}
        for n, c in plan.choices.items():
            if graph.node(n).kind != "linear":
                choices[n] = c
                continue
            # The LM head folds the argmax in whole-K tiles only (the lowering's rule).
            argmax = any(graph.node(f).kind == "argmax" for f in c.fuse)
            choices[n] = replace(pick, fuse=c.fuse, **({"split_k": 1} if argmax else {}))
        plan = replace(plan, choices=choices)
    predicted = estimate_step(graph, plan.choices, model.device_spec, plan.workers).peak_smem_bytes
    compiled = model.steps.build(plan, graph, batch, "argmax").kernel.residency().shared_bytes
    assert 0 <= predicted - compiled <= 1024, (predicted, compiled)
