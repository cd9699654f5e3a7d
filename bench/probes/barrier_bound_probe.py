"""GPU probe: what a layer's phase barriers cost at most — the step with one op's waits removed.

Each consumer op of a 1B batch-1 step (down, QKV, O projection, gate_up) waits for every
task of the op before it. This times the search's step with every task of one op lowered
without its waits (its descriptor's wait count set to 0), so it starts as soon as its
worker reaches it: an upper bound of what any finer dependency (a consumer that waits for
part of its input at a time) could gain at that barrier. The results are wrong (tasks read
inputs being written); only the time means something. Variants are timed in rounds,
interleaved with the unchanged step, each from the same decode state (a launch appends a
token, and attention costs more the longer the sequence). Env: PROBE_SHAPE (1b), PROBE_OPS (comma list of op
suffixes, default down,qkv,o_proj,gate_up), PROBE_ROUNDS (3); writes $OUT/barrier_bound.json.
"""
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from _harness import back_to_back_ms  # noqa: E402
from _llama_shapes import SHAPES, random_model  # noqa: E402
from mk.models import Llama, LlamaConfig  # noqa: E402
from mk.persistent.runtime import Megakernel  # noqa: E402

OUT = os.environ.get("OUT", ".")
KEY = os.environ.get("PROBE_SHAPE", "1b")


def without_waits(dec, suffix: str) -> Megakernel:
    """The decoder's program with the tasks of ops named ``*.{suffix}`` waiting for nothing."""
    ops = [name for name, n in dec.step.tasks_per_op.items() for _ in range(n)]
    program = dec.kernel.program
    desc = program.desc.clone()
    hit = 0
    for row in range(desc.shape[0]):
        if ops[int(desc[row, 3])].endswith("." + suffix):
            desc[row, 2] = 0
            hit += 1
    if not hit:
        raise SystemExit(f"no op ends with .{suffix}: {sorted(set(ops))[:12]}")
    return Megakernel(replace(program, desc=desc))


def main():
    cfg = LlamaConfig(**SHAPES[KEY])
    w = random_model(cfg)
    model = Llama(cfg, w, device="cuda", dtype=torch.bfloat16, max_batch_size=1, max_seq_len=1024,
                  name=f"llama-{KEY}")
    del w
    model.generate([[128000, 791, 6864, 315]], max_new_tokens=8)
    dec = model.last_decoder
    kernels = {"search": dec.kernel}
    for suffix in os.environ.get("PROBE_OPS", "down,qkv,o_proj,gate_up").split(","):
        kernels[f"no_{suffix}_wait"] = without_waits(dec, suffix)
    # Every launch appends a token, and attention's cost grows with the length: each timing
    # starts from the same decode state (positions, last tokens).
    saved = {k: v.clone() for k, v in dec.state.items()}
    times = {name: [] for name in kernels}
    for _ in range(int(os.environ.get("PROBE_ROUNDS", "3"))):
        for name, kernel in kernels.items():
            for k, v in saved.items():
                dec.state[k].copy_(v)
            times[name].append(back_to_back_ms(kernel.launch, 50, 5))
            kernel.check()
            print(name, round(times[name][-1], 4), flush=True)
    res = {"device": torch.cuda.get_device_name(), "shape": KEY, "commit": os.environ.get("MK_COMMIT"),
           "ms": times, "ms_min": {k: min(v) for k, v in times.items()}}
    print(json.dumps(res["ms_min"], indent=1))
    with open(os.path.join(OUT, "barrier_bound.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
