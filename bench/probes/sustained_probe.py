"""GPU probe: a decode step under sustained load — clocks, power, and spin-wait backoff.

Times the decoder's program in interleaved rounds of ``PROBE_LAUNCHES`` back-to-back launches
(the first round after an idle pause, the others under load), each round followed by the
SM clock and board power nvidia-smi reads. Variants: runtime settings of the same program
(``PROBE_KNOBS``, comma list of BACKOFF_NS; 0 is the decoder's own setting). Waiting workers
spin on their counters; sleeping between polls draws less power, which may keep clocks up.
Env: PROBE_SHAPE (1b|8b), PROBE_BATCH, PROBE_ROUNDS. Writes $OUT/sustained_probe.json.
"""
import json, os, subprocess, sys, time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _harness import back_to_back_ms  # noqa: E402
from _llama_shapes import SHAPES, random_model  # noqa: E402
from mk.models import Llama, LlamaConfig  # noqa: E402
from mk.persistent.runtime import Megakernel  # noqa: E402

KEY, B = os.environ.get("PROBE_SHAPE", "1b"), int(os.environ.get("PROBE_BATCH", "1"))
OUT = os.environ.get("OUT", ".")


def gpu_clock_power() -> dict:
    q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                        "clocks_throttle_reasons.active", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True).stdout.strip().split(", ")
    return dict(zip(("sm_mhz", "mem_mhz", "power_w", "temp_c", "throttle"), q))


def main():
    cfg = LlamaConfig(**SHAPES[KEY])
    w = random_model(cfg)
    model = Llama(cfg, w, device="cuda", dtype=torch.bfloat16, max_batch_size=B, max_seq_len=1024)
    del w
    model.generate([[128000 + b, 791, 6864, 315] for b in range(B)], max_new_tokens=8)
    dec = model.last_decoder
    knobs = [int(k) for k in os.environ.get("PROBE_KNOBS", "0,100,300").split(",")]
    kernels = {k: (dec.kernel if k == 0 else Megakernel(dec.kernel.program, backoff_ns=k)) for k in knobs}
    for kern in kernels.values():
        kern.run()
    launches = int(os.environ.get("PROBE_LAUNCHES", "400"))
    res = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("MK_COMMIT"), "shape": KEY, "batch": B,
           "launches_a_round": launches, "idle": gpu_clock_power(), "rounds": []}
    time.sleep(2)
    for r in range(int(os.environ.get("PROBE_ROUNDS", "4"))):
        for k, kern in kernels.items():
            ms = back_to_back_ms(kern.launch, launches, 3)
            kern.check()
            row = dict(round=r, backoff_ns=k, ms=ms, **gpu_clock_power())
            res["rounds"].append(row)
            print(row, flush=True)
    json.dump(res, open(os.path.join(OUT, "sustained_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
