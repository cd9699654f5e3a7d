"""GPU probe: does where the megakernel's sync words live change a decode step?

The same compiled program timed as the decoder's own kernel and as fresh Megakernel
instances (their own counters, state, error word and descriptors, allocated later), some
borrowing the decoder's descriptors or sync buffers, and with the event counters spread one
to a 128-byte line (event ids in the descriptors scaled by the stride). Each variant's logits
after one step from the same state are compared with the decoder's.
Env: PROBE_SHAPE (1b|8b), PROBE_BATCH, PROBE_STRIDES (comma list, default 32). Writes
$OUT/sync_placement_probe.json.
"""
import json, os, sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _harness import back_to_back_ms  # noqa: E402
from _llama_shapes import SHAPES, random_model  # noqa: E402
from mk.models import Llama, LlamaConfig  # noqa: E402
from mk.persistent.graph import HEADER_WORDS  # noqa: E402
from mk.persistent.runtime import Megakernel  # noqa: E402

KEY, B = os.environ.get("PROBE_SHAPE", "1b"), int(os.environ.get("PROBE_BATCH", "1"))
OUT = os.environ.get("OUT", ".")


def spread_events(kernel: Megakernel, stride: int) -> None:
    """Event e's counter at e * stride: rewrite the descriptors' event ids, widen the counters."""
    d, p = kernel.desc, kernel.program
    for col in [1] + [HEADER_WORDS + 2 * k for k in range(p.max_waits)]:
        ev = d[:, col]
        active = ev >= 0
        if col > 1:
            active &= d[:, 2] > (col - HEADER_WORDS) // 2
        d[:, col] = torch.where(active, ev * stride, ev)
    kernel.counters = torch.zeros(kernel.counters.numel() * stride, dtype=torch.int32, device=d.device)
    kernel.state.zero_()


def main():
    cfg = LlamaConfig(**SHAPES[KEY])
    w = random_model(cfg)
    model = Llama(cfg, w, device="cuda", dtype=torch.bfloat16, max_batch_size=B, max_seq_len=1024)
    del w
    prompts = [[128000 + b, 791, 6864, 315] for b in range(B)]
    model.generate(prompts, max_new_tokens=8)
    dec = model.last_decoder
    st = dec.state
    saved = {k: v.clone() for k, v in st.items()}
    logits = dec.step.graph.buffers[dec.step.logits]

    def one_step(kernel):
        for k, v in saved.items():
            st[k].copy_(v)
        kernel.launch()
        kernel.check()
        return logits.float().clone()

    ref = one_step(dec.kernel)
    kernels = {"decoder": dec.kernel}
    kernels["fresh"] = Megakernel(dec.kernel.program)
    k = kernels["fresh_decoder_desc"] = Megakernel(dec.kernel.program)
    k.desc, k.queue_starts = dec.kernel.desc, dec.kernel.queue_starts
    k = kernels["fresh_decoder_sync"] = Megakernel(dec.kernel.program)
    k.counters, k.state, k.error = dec.kernel.counters, dec.kernel.state, dec.kernel.error
    for stride in map(int, os.environ.get("PROBE_STRIDES", "32").split(",")):
        k = kernels[f"events_x{stride}"] = Megakernel(dec.kernel.program)
        spread_events(k, stride)
    res = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("MK_COMMIT"), "shape": KEY, "batch": B,
           "variants": {}}
    for name, kern in kernels.items():
        diff = (one_step(kern) - ref).abs().max().item()
        res["variants"][name] = {"logits_max_abs_diff": diff, "ms": []}
    for _ in range(3):  # interleaved rounds: drift shows as spread within a variant
        for name, kern in kernels.items():
            res["variants"][name]["ms"].append(back_to_back_ms(kern.launch, 50, 5))
            kern.check()
    for name, r in res["variants"].items():
        print(name, r, flush=True)
    json.dump(res, open(os.path.join(OUT, "sync_placement_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
