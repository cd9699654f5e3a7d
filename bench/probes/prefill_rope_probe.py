"""GPU probe: what the interleaved RoPE read costs the 512-token prefill (1B shape).

Times mk's prefill as it runs (q/k rows interleaved, rope_kv(interleaved=True)) and the
rope_kv kernel alone on a [1, 512] prompt in both layouts. Writes $OUT/prefill_rope_probe.json.
"""
import json, os, sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _harness import back_to_back_ms  # noqa: E402
from _llama_shapes import SHAPES, random_model  # noqa: E402
from mk.models import Llama, LlamaConfig  # noqa: E402
from mk.tasks.rope import rope_kv  # noqa: E402

cfg = LlamaConfig(**SHAPES["1b"])
model = Llama(cfg, random_model(cfg), device="cuda", dtype=torch.bfloat16, max_batch_size=1, max_seq_len=1024)
ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda", dtype=torch.int32)
res = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("MK_COMMIT")}
with torch.no_grad():
    res["prefill_ms"] = back_to_back_ms(lambda: model._prefill(ids, [512]), 5, 2)
    hq, hkv, d, T = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 512
    qkv = torch.randn(1, T, hq + 2 * hkv, d, device="cuda")
    q, k, v = qkv.split([hq, hkv, hkv], dim=2)
    pos = torch.arange(T, device="cuda", dtype=torch.int32)[None]
    kc, vc = model.k_cache[0, :1], model.v_cache[0, :1]
    for inter in (False, True):
        res[f"rope_kv_interleaved_{inter}_ms"] = back_to_back_ms(
            lambda: rope_kv(q, k, v, pos, model.weights["inv_freq"], kc, vc, interleaved=inter), 50, 5)
    # Each prefill op alone, from a profile of one prefill.
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model._prefill(ids, [512])
        torch.cuda.synchronize()
    res["kernels_ms"] = {e.key[:60]: e.device_time_total / 1e3 for e in prof.key_averages()
                         if e.device_time_total > 0}
print(json.dumps(res, indent=1))
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "prefill_rope_probe.json"), "w"), indent=1)
