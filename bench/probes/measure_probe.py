"""GPU probe: measure mode on a Llama shape (random bf16 weights).

Builds the model with ``plan_mode="measure"``, generates a few tokens (which times the
planner's top plans and keeps the fastest), and records every timed plan (predicted and
measured ms) and the pick, next to a predict-mode model's plan timed the same way.
Env: PROBE_SHAPE (1b|8b), PROBE_BATCH. Writes $OUT/measure_probe.json.
"""
import json, os, sys, time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _llama_shapes import SHAPES, random_model  # noqa: E402
from mk.models import Llama, LlamaConfig  # noqa: E402

OUT = os.environ.get("OUT", ".")
KEY, B = os.environ.get("PROBE_SHAPE", "1b"), int(os.environ.get("PROBE_BATCH", "1"))


def main():
    cfg = LlamaConfig(**SHAPES[KEY])
    w = random_model(cfg)
    model = Llama(cfg, w, device="cuda", dtype=torch.bfloat16, max_batch_size=max(B, 1), max_seq_len=1024,
                  name=f"llama-{KEY}", plan_mode="measure")
    del w
    timed = []
    original = Llama._time_plan

    def record(self, plan, graph, batch):
        seconds = original(self, plan, graph, batch)
        timed.append({"predicted_ms": plan.predicted_s * 1e3, "measured_ms": seconds * 1e3,
                      "choices": json.loads(plan.to_json())["choices"]})
        return seconds

    Llama._time_plan = record
    prompts = [[128000 + b, 791, 6864, 315] for b in range(B)]
    t = time.time()
    model.generate(prompts, max_new_tokens=8)
    kv_len = model.plan_length(4 + 8)  # what the generate call above was planned for
    pick, graph = model.plan(B, kv_len)
    model.plan_mode = "predict"
    predicted, _ = model.plan(B, kv_len)
    res = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("MK_COMMIT"), "shape": KEY, "batch": B,
           "measure_s": time.time() - t, "timed": timed, "pick_measured_ms": pick.measured_s * 1e3,
           "pick_predicted_ms": pick.predicted_s * 1e3,
           "predict_mode_plan_measured_ms": original(model, predicted, graph, B) * 1e3,
           "predict_mode_plan_is_pick": predicted.choices == pick.choices}
    print(json.dumps({k: v for k, v in res.items() if k != "timed"}, indent=1))
    for r in timed:
        print(f"  predicted {r['predicted_ms']:.3f} ms, measured {r['measured_ms']:.3f} ms")
    json.dump(res, open(os.path.join(OUT, "measure_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
