"""GPU probe: the megakernel's synchronisation cost alone. Chains of layers of empty tasks
(each tile of layer l+1 waits for all tiles of layer l, as in a GEMV chain) over tiles per
layer and workers: µs per layer is barrier + signalling, with no memory traffic."""
import json, os
import torch

from mk.persistent.graph import TaskGraph, lower
from mk.persistent.ops import OpSpec, Region
from mk.persistent.runtime import Megakernel
from mk.timing import capture_graph, event_time_us


def noop(tiles: int) -> OpSpec:
    return OpSpec(name="noop", operands=("x", "out"), args=("tile",), body="pass", constexprs={"T": tiles},
                  num_warps=4, reads=lambda a, b: [Region(b["x"], 0, 1, 0, tiles)],
                  writes=lambda a, b: [Region(b["out"], 0, 1, a["tile"], a["tile"] + 1)])


sms = torch.cuda.get_device_properties(0).multi_processor_count
rows = []
layers = 64
for tiles in (128, 256, 1024):
    for wps in (1, 2, 8):
        g = TaskGraph()
        for l in range(layers + 1):
            g.buffer(f"h{l}", torch.zeros(1, tiles, device="cuda"))
        op = noop(tiles)
        for l in range(layers):
            for t in range(tiles):
                g.add(op, x=f"h{l}", out=f"h{l + 1}", tile=t)
        for backoff in (0, 500):
            k = Megakernel(lower(g, num_workers=sms * wps), backoff_ns=backoff)
            k.run()
            graph = capture_graph([k.launch] * 3)
            us = event_time_us(graph.replay, reps=10, warmup=2) / 3 / layers
            k.check()
            r = dict(tiles=tiles, workers=sms * wps, backoff=backoff, us_per_layer=us)
            print(r, flush=True)
            rows.append(r)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "megakernel_sync_probe.json"), "w"), indent=1)
