"""One rank of tests/models/test_tp_gpu.py (started by torchrun, one process per GPU; 2 or 4).

Float32 weights and cache, exact prefill: the tensor-parallel model's greedy tokens must
equal one GPU's (rank 0 builds that one too). Requests at other lengths replace the step,
and its symmetric workspace with it: after a few rounds the GPU's free memory is where it
was after the first. Every family decodes over the ranks as on one GPU. A bf16 model's
prompt runs as CUDA graphs cut at its sums over the ranks, and stays alive to the end, where
the ranks must still leave destroy_process_group. A model planned by measuring on every rank
runs one plan on all. Last, the other ranks stop taking part:
rank 0's step ends in a MegakernelTimeout instead of hanging. Rank 0 prints
"ok" when all held."""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mk.models import Llama, LlamaConfig
from mk.persistent.runtime import MegakernelTimeout

world = int(os.environ["WORLD_SIZE"])
config = LlamaConfig.tiny(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=32)
kw = dict(seed=3, dtype=torch.float32, kv_dtype=torch.float32, prefill_precision="exact", max_batch_size=2,
          max_seq_len=512)
_T0 = time.perf_counter()
model = Llama.from_config(config, tp=world, **kw)
rank = model.rank


def passed(what: str) -> None:
    """Rank 0 says on stderr which case has passed, and when: a run cut short by its time
    limit then shows how far it got (slow, or stuck in a case)."""
    if rank == 0:
        print(f"[ranks {time.perf_counter() - _T0:6.1f} s] {what}", file=sys.stderr, flush=True)


prompts = [[(7 * t + 3) % 512 for t in range(20)], [(11 * t + 5) % 512 for t in range(13)]]
got = model.generate(prompts, max_new_tokens=24)
if rank == 0:
    want = Llama.from_config(config, device=model.device, **kw).generate(prompts, max_new_tokens=24)
    assert got == want, (got, want)
passed("tokens equal one GPU's")
# Other lengths (other plan buckets) replace the batch's step; its workspace goes with it.
free = []
for _ in range(4):
    for new in (24, 200):
        model.generate(prompts, max_new_tokens=new)
    assert len([k for k in model.steps.built if k[0] == 2]) == 1, list(model.steps.built)
    torch.cuda.synchronize()
    free.append(torch.cuda.mem_get_info(model.device)[0])
assert free[-1] >= free[0] - 8 * 2**20, f"free memory fell by {(free[0] - free[-1]) / 2**20:.1f} MiB over the rounds"
passed("steps replaced, their workspaces released")
# Every family (Qwen2's biases, Qwen3's q / k head norms, Mistral's window) decodes over the
# ranks as on one GPU (the VM tests' configs).
from tests.models.test_tp import CASES  # noqa: E402

for name, (cls, fam_config, tp) in CASES.items():
    if tp != world:
        continue
    fam_kw = dict(kw, max_batch_size=1)
    fam_prompts = [[t % fam_config.vocab_size for t in prompts[0]]]
    fam_got = cls.from_config(fam_config, tp=tp, **fam_kw).generate(fam_prompts, max_new_tokens=16)
    if rank == 0:
        fam_want = cls.from_config(fam_config, device=model.device, **fam_kw).generate(fam_prompts, max_new_tokens=16)
        assert fam_got == fam_want, (name, fam_got, fam_want)
    passed(f"{name} decodes as on one GPU")
# bf16, fast prefill: a prompt's chunk runs eagerly once, then as captured CUDA graphs, one
# between each two of its sums over the ranks (NCCL, outside the graphs); the replay gives
# the eager run's logits, close to exact ones. The model stays alive to the end: a graph
# holding a NCCL collective would leave destroy_process_group hanging.
fast = Llama.from_config(config, tp=world, seed=3, dtype=torch.bfloat16, max_batch_size=1, max_seq_len=512)
eager, replayed = fast.logits(prompts[:1]), fast.logits(prompts[:1])
assert fast.prefiller.graphs and not fast.prefiller.graphs_failed, "the tensor-parallel prefill chunk was not captured"
(chunk, _, _), = fast.prefiller.graphs.values()
assert len(chunk.graphs) == 2 * config.num_hidden_layers + 2, len(chunk.graphs)
assert torch.equal(eager, replayed), float((eager - replayed).abs().max())
exact = model.logits(prompts[:1])
assert float((replayed - exact).abs().max() / exact.abs().max()) < 0.1
passed("prefill graphs replayed")
# Measured planning: every rank times rank 0's candidates together (the sums over the
# ranks in the projections' tiles and in tiles of their own among them) and runs the
# fastest; the tokens are the predicted plan's.
# A plan folder of its own on each rank: every rank misses, so every rank measures; each
# keeps its own pick there, before rank 0's plan is broadcast.
user_cache = os.environ.get("MK_CACHE_DIR")
os.environ["MK_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"mk-measure-rank{rank}-")
measured = Llama.from_config(config, tp=world, plan_mode="measure", **kw)
assert measured.generate(prompts, max_new_tokens=24) == got
plan = measured.last_decoder.step.plan
assert plan.measured_s is not None and plan.measured_s > 0, plan
mine = sorted(p.read_text() for p in (Path(os.environ["MK_CACHE_DIR"]) / "plans").glob("*.json"))
assert mine and all(json.loads(t)["measured_s"] for t in mine), mine
picks = [None] * world
dist.all_gather_object(picks, mine)
assert all(p == picks[0] for p in picks), "the ranks measured different picks"
passed("measured planning agrees")
del measured
if user_cache is None:
    del os.environ["MK_CACHE_DIR"]
else:
    os.environ["MK_CACHE_DIR"] = user_cache
# The other ranks stop: rank 0's step meets no one and ends within the watchdog's bound.
dec = model.last_decoder
dist.barrier()
if rank == 0:
    try:
        dec.kernel.launch()
        dec.kernel.check()
    except MegakernelTimeout:
        pass  # (the first wait to run out names itself: a meeting, or a wait behind one)
    else:
        sys.exit("rank 0's step finished without its peer")
dist.barrier()
if rank == 0:
    print("ok")
dist.destroy_process_group()
