"""GPU probe: what one layer-to-layer hand-off costs under three protocols.

A persistent grid of W workers runs L layers; in each, every worker reads the whole
previous vector (X floats, as a GEMV task reads x), reduces it and writes its SLICE of the
next (as a GEMV task writes its rows). Protocols:

* ``counter``: the megakernel's today — store, block barrier, release atomic add; the
  consumer polls the counter relaxed, then one acquire load, then reads x.
* ``flagged``: each value is stored with a 32-bit flag (step and layer) in one 8-byte word;
  the producer's counter add is relaxed (no fence); the consumer polls the counter, then
  reads the flagged words and re-reads until every flag is the expected one (no acquire).
* ``ll``: flagged words and no counter: the consumer polls the data itself.

µs a layer = (time of 72 layers - time of 8) / 64. The result is checked
against a float64 reference of the same recurrence.
"""
import json
import os

import torch
import triton
import triton.language as tl

from mk.persistent.sync import _backoff, _load_acquire
from mk.timing import event_time_us


@triton.jit
def _poll(cnt_ptr, need, err_ptr, BACKOFF: tl.constexpr):
    """Spin (relaxed) until the counter reaches ``need``; counts a timeout in err."""
    seen = tl.load(cnt_ptr, volatile=True)
    polls = 0
    while (seen < need) & (polls < 2000000):
        _backoff(BACKOFF)
        seen = tl.load(cnt_ptr, volatile=True)
        polls += 1
    if seen < need:
        tl.atomic_add(err_ptr, 1)


@triton.jit
def _pack(val, flag):
    bits = val.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return bits | (flag.to(tl.int64) << 32)


@triton.jit
def chain_kernel(init_ptr, buf_ptr, pair_ptr, cnt_ptr, err_ptr, epoch, L, MODE: tl.constexpr, W: tl.constexpr,
                 SLICE: tl.constexpr, X: tl.constexpr, BACKOFF: tl.constexpr):
    w = tl.program_id(0)
    offs = tl.arange(0, X)
    so = w * SLICE + tl.arange(0, SLICE)
    for l in range(L):
        if l == 0:
            x = tl.load(init_ptr + offs)
        else:
            src = (l - 1) % 2
            if MODE == 0:
                _poll(cnt_ptr + l - 1, W * (epoch + 1), err_ptr, BACKOFF)
                _load_acquire(cnt_ptr + l - 1, GPU=True)
                x = tl.load(buf_ptr + src * X + offs, volatile=True)
            else:
                want = epoch * L + l  # the flag layer l - 1 wrote
                if MODE == 1:
                    _poll(cnt_ptr + l - 1, W * (epoch + 1), err_ptr, BACKOFF)
                v = tl.load(pair_ptr + src * X + offs, volatile=True)
                stale = tl.sum(((v >> 32).to(tl.int32) != want).to(tl.int32))
                polls = 0
                while (stale > 0) & (polls < 2000000):
                    if MODE == 2:
                        _backoff(BACKOFF)
                    v = tl.load(pair_ptr + src * X + offs, volatile=True)
                    stale = tl.sum(((v >> 32).to(tl.int32) != want).to(tl.int32))
                    polls += 1
                if stale > 0:
                    tl.atomic_add(err_ptr, 1)
                x = v.to(tl.int32).to(tl.float32, bitcast=True)
        mean = tl.sum(x) / X
        out = mean * 0.5 + so.to(tl.float32) * 1e-3 + l * 1e-2
        dst = l % 2
        if MODE == 0:
            tl.store(buf_ptr + dst * X + so, out)
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr + l, 1, sem="release", scope="gpu")
        else:
            tl.store(pair_ptr + dst * X + so, _pack(out, epoch * L + l + 1))
            if MODE == 1:
                tl.atomic_add(cnt_ptr + l, 1, sem="relaxed", scope="gpu")


def reference(init, L, W, SLICE):
    x = init.double()
    idx = torch.arange(W * SLICE, dtype=torch.float64, device=init.device)
    for l in range(L):
        x = x.mean() * 0.5 + idx * 1e-3 + l * 1e-2
    return x


def main():
    out_dir = os.environ.get("OUT", ".")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for W, SLICE in ((256, 8), (128, 16)):
        X = W * SLICE
        init = torch.randn(X, device="cuda")
        for mode, name in ((0, "counter"), (1, "flagged"), (2, "ll")):
            for backoff in (0, 100):
                times = {}
                for L in (8, 72):
                    buf = torch.zeros(2 * X, device="cuda")
                    pair = torch.zeros(2 * X, dtype=torch.int64, device="cuda")
                    cnt = torch.zeros(L, dtype=torch.int32, device="cuda")
                    err = torch.zeros(1, dtype=torch.int32, device="cuda")
                    state = {"epoch": 0}

                    def launch():
                        chain_kernel[(W,)](init, buf, pair, cnt, err, state["epoch"], L, MODE=mode, W=W,
                                           SLICE=SLICE, X=X, BACKOFF=backoff, num_warps=4)
                        state["epoch"] += 1

                    times[L] = event_time_us(launch, reps=30, warmup=3)
                    got = (buf[((L - 1) % 2) * X:((L - 1) % 2 + 1) * X] if mode == 0 else
                           pair[((L - 1) % 2) * X:((L - 1) % 2 + 1) * X].to(torch.int32).view(torch.float32))
                    ok = bool(torch.allclose(got.double(), reference(init, L, W, SLICE), rtol=1e-4, atol=1e-4))
                    assert err.item() == 0 and ok, (name, W, L, err.item())
                r = dict(workers=W, slice=SLICE, x=X, protocol=name, backoff_ns=backoff,
                         us_per_layer=(times[72] - times[8]) / 64, us_8=times[8], us_72=times[72], sms=sms)
                print(r, flush=True)
                rows.append(r)
    json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, rows=rows),
              open(os.path.join(out_dir, "handoff_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
