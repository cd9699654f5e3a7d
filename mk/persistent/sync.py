"""Device-side synchronisation of the megakernel: bounded waits, signals, timestamps.

A wait polls its counter with relaxed volatile loads, then makes one ``ld.acquire.gpu``
(under the interpreter an acquire atomic) so that the producers' data is visible (acquire
polls measured no faster on an H200). Every wait is bounded: past the limit it records
(worker, task, event, seen, expected) in the error buffer and reports failure, so a broken graph ends in an
error instead of a frozen GPU; a wait also gives up as soon as another worker has
recorded an error. A worker remembers the last event count it saw reached: tiles of one
layer on one worker all wait for the same event, and only the first pays for it.
"""

import triton.language as tl

from mk.tasks._device import jit, load_acquire, record_timeout

try:  # inline PTX: compiled GPU code only
    from triton.language.extra.cuda import globaltimer as _globaltimer
except ImportError:  # pragma: no cover - older layouts
    _globaltimer = None

#: error buffer layout (int32): flag, worker, task, event, seen, expected
ERROR_WORDS = 8


@jit
def now_ns(USE_TIMER: tl.constexpr):
    """The GPU's global timer in ns (0 where inline PTX is unavailable)."""
    if USE_TIMER:
        return _globaltimer()
    else:
        return tl.zeros([], dtype=tl.int64)


@jit
def sm_id(GPU: tl.constexpr):
    """The streaming multiprocessor this program runs on (%smid; 0 without GPU code, where
    inline PTX is unavailable): traces show which workers share an SM."""
    if GPU:
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.zeros([], dtype=tl.int32)


@jit
def _backoff(NS: tl.constexpr):
    """Sleep about NS ns between polls, so that hundreds of waiting workers do not flood
    the memory system that the working ones stream through."""
    if NS > 0:
        tl.inline_asm_elementwise(f"nanosleep.u32 {NS};\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@jit
def wait_event(ev, count, active, counters_ptr, error_ptr, epoch, worker, task, timeout, last_ev, last_need,
               USE_TIMER: tl.constexpr, BACKOFF_NS: tl.constexpr = 0):
    """Wait until ``counters[ev] >= count * (epoch + 1)`` (when ``active``).

    Returns (ok, last_ev, last_need): ok is 0 on timeout or when another worker failed;
    (last_ev, last_need) is the latest event threshold this worker has seen reached.
    ``timeout`` is in ns with the GPU timer, else a number of polls (the interpreter).
    """
    ok = 1
    need = count * (epoch + 1)
    if active & ((ev != last_ev) | (need > last_need)):
        seen = tl.load(counters_ptr + ev, volatile=True)
        start = now_ns(USE_TIMER)
        polls = tl.zeros([], dtype=tl.int64)
        waited = tl.zeros([], dtype=tl.int64)
        failed = tl.zeros([], dtype=tl.int32)
        while (seen < need) & (waited < timeout) & (failed == 0):
            if USE_TIMER:
                _backoff(BACKOFF_NS)
            seen = tl.load(counters_ptr + ev, volatile=True)
            # Another worker's timeout ends this wait too: the whole launch stops within
            # one timeout, not one per link of a chain of waiting tasks. (Every 16th poll:
            # the flag is rarely set, and each load adds to what the memory system serves.)
            if polls % 16 == 15:
                failed = tl.load(error_ptr, volatile=True)
            polls += 1
            if USE_TIMER:
                waited = now_ns(USE_TIMER) - start
            else:
                waited = polls
        if seen < need:
            ok = 0
            record_timeout(error_ptr, failed, worker, task, ev, seen, need)
        else:
            # Relaxed polls, then one acquire: the producers' writes are visible after it.
            load_acquire(counters_ptr + ev, GPU=USE_TIMER)
            last_ev = ev
            last_need = need
    return ok, last_ev, last_need


@jit
def signal_event(ev, counters_ptr, count=1):
    """Publish this worker's writes: block barrier, then one release add of ``count`` to event
    ``ev`` (the signals of ``count`` tasks at once, see the megakernel's deferred signals)."""
    tl.debug_barrier()
    if ev >= 0:
        tl.atomic_add(counters_ptr + ev, count, sem="release", scope="gpu")
