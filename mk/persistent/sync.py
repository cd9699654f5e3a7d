"""Device-side synchronisation of the megakernel: bounded waits, signals, timestamps.

Waits poll the counter with volatile loads (a scalar acquire atomic in the loop would
cost a block barrier per iteration, triton-lang/triton#7125), then make one acquire
atomic so that the producer's data is visible. Every wait is bounded: past the limit it
records (worker, task, event, seen, expected) in the error buffer and reports failure,
so a broken graph ends in an error instead of a frozen GPU.
"""

import triton
import triton.language as tl

try:  # inline PTX: compiled GPU code only
    from triton.language.extra.cuda import globaltimer as _globaltimer
except ImportError:  # pragma: no cover - older layouts
    _globaltimer = None

#: error buffer layout (int32): flag, worker, task, event, seen, expected
ERROR_WORDS = 8


@triton.jit
def now_ns(USE_TIMER: tl.constexpr):
    """The GPU's global timer in ns (0 where inline PTX is unavailable)."""
    if USE_TIMER:
        return _globaltimer()
    else:
        return tl.zeros([], dtype=tl.int64)


@triton.jit
def wait_events(d, counters_ptr, error_ptr, epoch, worker, task, timeout, HEADER: tl.constexpr,
                MAX_WAITS: tl.constexpr, USE_TIMER: tl.constexpr):
    """Wait for every (event, count) of descriptor ``d``; 1 if all arrived, 0 on timeout.

    ``timeout`` is in ns with the GPU timer, else a number of polls (the interpreter).
    """
    ok = 1
    n_waits = tl.load(d + 2)
    for w in tl.static_range(MAX_WAITS):
        if (w < n_waits) & (ok != 0):
            ev = tl.load(d + HEADER + 2 * w)
            expected = tl.load(d + HEADER + 2 * w + 1) * (epoch + 1)
            seen = tl.load(counters_ptr + ev, volatile=True)
            start = now_ns(USE_TIMER)
            polls = tl.zeros([], dtype=tl.int64)
            waited = tl.zeros([], dtype=tl.int64)
            failed = tl.zeros([], dtype=tl.int32)
            while (seen < expected) & (waited < timeout) & (failed == 0):
                seen = tl.load(counters_ptr + ev, volatile=True)
                # Another worker's timeout ends this wait too: the whole launch stops within
                # one timeout, not one per link of a chain of waiting tasks.
                failed = tl.load(error_ptr, volatile=True)
                polls += 1
                if USE_TIMER:
                    waited = now_ns(USE_TIMER) - start
                else:
                    waited = polls
            if seen < expected:
                ok = 0
                if (failed == 0) & (tl.atomic_cas(error_ptr, 0, 1) == 0):
                    tl.store(error_ptr + 1, worker)
                    tl.store(error_ptr + 2, task)
                    tl.store(error_ptr + 3, ev)
                    tl.store(error_ptr + 4, seen)
                    tl.store(error_ptr + 5, expected)
            else:
                # Acquire: orders this block's later loads after the producers' release.
                tl.atomic_add(counters_ptr + ev, 0, sem="acquire", scope="gpu")
    return ok


@triton.jit
def signal_event(d, counters_ptr):
    """Publish this task's writes: block barrier, then one release increment of its event."""
    ev = tl.load(d + 1)
    tl.debug_barrier()
    if ev >= 0:
        tl.atomic_add(counters_ptr + ev, 1, sem="release", scope="gpu")
