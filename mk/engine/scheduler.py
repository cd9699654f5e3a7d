"""Continuous batching: requests take a slot of the model's batch, are prefilled a piece at a
time between decode blocks, decode in the step built for the number of live slots, and give
the slot back when they finish.

One thread runs the :class:`Scheduler`'s loop (:meth:`Scheduler.start`); any thread submits
(:meth:`Scheduler.submit`) and cancels. A request's results come back through its
``emit`` callback, called on the scheduler's thread, in order:

- ``("prompt_logprobs", [None, lp1, lp2, ...])`` once, if asked for (``prompt_logprobs``);
- ``("tokens", [id, ...], [logprob, ...])`` with each block's new tokens (the first token
  alone, after the prefill), each ``logprob`` None, or ``(its logprob, [(id, logprob), ...]
  top-n)`` when ``logprobs`` is set;
- ``("done", reason)`` with reason ``"stop"`` (a stop id) or ``"length"`` (``max_tokens``),
  or ``("error", message)`` if its prefill or a decode step failed. Nothing follows either.

Live slots are always rows ``[0, n)``: a finished request's row takes the last live row's
sequence (its state and KV cache rows, :meth:`~mk.engine.steps.Slots.move`), so the step
that runs is the one for ``n`` rows. Every slot's tokens are chosen as ``generate`` chooses
them: greedily inside the megakernel (the ``argmax`` step) while every live request is
greedy and asks for no logprobs; otherwise the step ends at the logits and each row's
token is chosen on the device from them (:meth:`Request.choose`: argmax, or a draw from
the request's own seed, so a sampled request's tokens do not depend on its neighbours).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from mk.persistent.runtime import MegakernelError
from mk.tasks.append_token import append_token
from mk.tasks.sample import sample

from .stream import HistoryReader

#: Largest ``logprobs`` (top alternatives a token) a request may ask for.
MAX_LOGPROBS = 20


class QueueFull(Exception):
    """The scheduler's queue holds ``max_queue`` requests already: try again later."""


@dataclass(eq=False)
class Request:
    """One sequence to generate: its prompt (ids), how many new tokens at most, how to choose
    them, when to stop, and where its results go (``emit``, see the module)."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[tuple], None]
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_ids: frozenset = frozenset()
    logprobs: int | None = None
    prompt_logprobs: bool = False
    #: Set from any thread: the scheduler drops the request at its next block boundary.
    cancelled: bool = False
    # The scheduler's bookkeeping.
    arrived: float = field(default_factory=time.perf_counter)
    produced: int = 0  # tokens emitted
    enqueued: int = 0  # tokens the enqueued steps will have produced (first token included)
    finished: bool = False  # "done" or "error" was emitted

    @property
    def gone(self) -> bool:
        """Finished or cancelled: its row goes back at the next boundary."""
        return self.finished or self.cancelled

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def choose(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        """This request's token ``index`` (0: the one after the prompt) from its float32
        ``logits`` ``[V]``: the argmax, or a draw seeded by the request alone."""
        if self.greedy:
            return torch.argmax(logits).to(torch.int32)
        return sample(logits[None], temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                      seed=self.seed, offset=index)[0].to(torch.int32)

    def logprob_of(self, logits: torch.Tensor, token: torch.Tensor):
        """Device tensors of ``token``'s logprob and the top-``logprobs`` (ids, logprobs)
        under ``logits`` (the model's distribution, before temperature), or None."""
        if self.logprobs is None:
            return None
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(lp, self.logprobs) if self.logprobs else None
        return lp[token.long()], (top.indices if top else None), (top.values if top else None)


def to_device(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as int32 on ``device``; to a GPU from pinned memory, queued on the stream
    without waiting for the work before it (PyTorch keeps the pinned buffer until the copy
    has run)."""
    host = torch.tensor(ids, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def read_logprob(entry):
    """:meth:`Request.logprob_of`'s device tensors as ``(logprob, [(id, logprob), ...])``."""
    if entry is None:
        return None
    chosen, ids, values = entry
    top = list(zip(ids.tolist(), values.tolist())) if ids is not None else []
    return float(chosen), top


class Scheduler:
    """Serves :class:`Request` s on ``model`` (a :class:`~mk.models.decoder.DecoderModel`),
    ``model.max_batch_size`` at a time.

    ``max_queue``: requests waiting for a slot before :meth:`submit` refuses
    (:class:`QueueFull`). ``read_every``: decode steps a block (tokens are read back, and
    requests join and leave, between blocks; default 8 on a GPU, 1 on the CPU). ``prefill_chunk``: most prompt tokens prefilled
    between two blocks, so a running stream waits at most that long for an arriving prompt
    (default: what the model's prefill workspace holds, at most 256)."""

    def __init__(self, model, *, max_queue: int = 64, read_every: int | None = None, prefill_chunk: int | None = None):
        if read_every is None:  # (the interpreter takes long enough a step to read each one)
            read_every = 8 if model.device.type == "cuda" else 1
        for name, value in (("max_queue", max_queue), ("read_every", read_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if model.tp > 1:
            raise ValueError(f"serving a tensor-parallel model (tp={model.tp}) is not built: every rank would have "
                             f"to follow rank 0's schedule; serve on one GPU")
        chunk = min(256, model.prefill_budget.chunk_tokens) if prefill_chunk is None else prefill_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= model.prefill_budget.chunk_tokens:
            raise ValueError(f"prefill_chunk must be an int in [1, {model.prefill_budget.chunk_tokens}] (what the "
                             f"prefill workspace holds), got {chunk!r}")
        self.model, self.read_every, self.prefill_chunk = model, read_every, chunk
        self.slots = model.steps.slots
        self.max_queue = max_queue
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.live: list[Request] = []  # row i holds live[i]
        #: The request being prefilled: (it, its next piece's start, its prompt logprobs so far, its
        #: row, its prompt on the device).
        self.prefilling: tuple[Request, int, list, int, torch.Tensor] | None = None
        self.readers: dict[int, HistoryReader] = {}
        self.in_flight: list[tuple[HistoryReader, list[Request], int, list]] = []
        self.metrics = Metrics()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed: str | None = None  # why the loop ended, if it did by an error
        self._last_read = 0.0

    # ------------------------------------------------------------------ any thread

    def submit(self, request: Request) -> None:
        """Queue ``request`` (checked: its prompt and ``max_tokens`` fit the cache); raises
        :class:`QueueFull` when ``max_queue`` wait already beyond those the free slots will
        take, ValueError for a bad request."""
        self.check(request)
        # Requests bound for a free slot wait only for the next boundary: they take no place
        # of the queue's (read from another thread, a turn late at worst).
        free = self.model.max_batch_size - len(self.live) - (self.prefilling is not None)
        if self.waiting.qsize() >= self.max_queue + max(free, 0):
            self.metrics.count("rejected")
            raise QueueFull(f"{self.max_queue} requests are waiting for a slot already")
        self.waiting.put_nowait(request)
        self.metrics.count("received")

    def check(self, r: Request) -> None:
        """ValueError naming what does not fit this model: ids, lengths, logprobs."""
        m = self.model
        V = m.config.vocab_size
        if not r.prompt:
            raise ValueError("the prompt is empty: it needs at least one token")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V for t in r.prompt):
            raise ValueError(f"the prompt holds a token id outside [0, {V})")
        if isinstance(r.max_tokens, bool) or not isinstance(r.max_tokens, int) or r.max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {r.max_tokens!r}")
        if len(r.prompt) + r.max_tokens > m.max_seq_len:
            raise ValueError(f"the prompt's {len(r.prompt)} tokens + max_tokens={r.max_tokens} exceed the "
                             f"{m.max_seq_len} positions this server's cache holds")
        if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {r.logprobs}")
        if r.prompt_logprobs and len(r.prompt) * V * 4 > m.prefill_budget.bound:
            raise ValueError(f"the prompt's logprobs ({len(r.prompt)} tokens x {V} float32 logits) exceed the "
                             f"prefill workspace ({m.prefill_budget.bound} bytes)")

    def start(self) -> "Scheduler":
        """Run the loop on a thread of its own (a daemon); returns self."""
        self._thread = threading.Thread(target=self.run, name="mk-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop after its current block (waits at most ``timeout`` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Before :meth:`start`: build the greedy decode step of every batch size now, and
        on a GPU capture the prefill graphs of the pieces of prompts of up to two pieces (the
        first request of a size or a piece shape would otherwise wait for its build: seconds,
        or an eager run and a capture); ``progress(done, total)`` after each."""
        if self.alive:
            raise RuntimeError("prepare() runs before start(): it prefills into the row admitted prompts go to")
        m = self.model
        n = m.max_batch_size
        pieces = m.prefiller.piece_shapes(self.prefill_chunk)
        for b in range(1, n + 1):
            m.steps.get(b, "argmax")
            if progress:
                progress(b, n + len(pieces))
        with torch.no_grad():
            for k, (start, tokens) in enumerate(pieces, 1):
                m.prefiller.warm_piece(n - 1, start, tokens)  # the row admitted prompts are prefilled into
                if progress:
                    progress(n + k, n + len(pieces))

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """The loop: until :meth:`stop`, turns of :meth:`step`; idle, a bounded wait for a request."""
        try:
            while not self._stop.is_set():
                if not self.step():
                    try:  # idle: wait (bounded) for a request
                        r = self.waiting.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    self._admit(r)
        except BaseException as e:  # a defect: fail every request held, say why
            self.failed = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self._fail_all(f"the server's scheduler stopped: {self.failed}")
            raise

    def step(self) -> bool:
        """One turn: between blocks, give back the rows of requests that ended and admit a
        waiting one; enqueue decode blocks; run the admitted prompt's next prefill piece;
        read a block. False when idle."""
        busy = False
        if not self.in_flight:
            self._drop_gone()
        # A request is admitted with blocks in flight too: it is prefilled into a row none of
        # them reads (an arrival otherwise waited for the pipeline to drain: a block).
        if self.prefilling is None and len(self.live) < self.model.max_batch_size:
            try:
                self._admit(self.waiting.get_nowait())
            except queue.Empty:
                pass
        self.metrics.gauge(queue_depth=self.waiting.qsize(), live_slots=len(self.live))
        # While nobody joins or leaves, a block is queued behind the one being read, so the
        # device runs it while the host hands out the tokens of the other (leaving waits for a
        # boundary with nothing in flight; a prompt being prefilled keeps one block in flight).
        calm = self.prefilling is None and (self.waiting.empty() or len(self.live) >= self.model.max_batch_size)
        while (self.live and len(self.in_flight) < (2 if calm else 1) and not any(r.gone for r in self.live)
               and self._enqueue_block()):
            busy = True
        if self.prefilling is not None:
            # Its launches overlap the block just queued, and the device runs it after that
            # block (one stream): the piece writes a row past the live ones, which the block
            # does not read, so the streams stall for the piece's device time, not the host's.
            self._prefill_piece()
            busy = True
        if self.in_flight:
            self._read_block()
            busy = True
        return busy

    def _admit(self, r: Request) -> None:
        """Begin prefilling ``r`` into the batch's last row, which no live request holds while
        one is admitted: every prompt's pieces then go to one row, so the prefill's CUDA graphs
        are captured once per piece start and length, not once more for each row. Its prompt
        goes to the device now, from pinned memory without waiting: a copy from pageable
        memory would wait for the blocks in flight."""
        self.prefilling = (r, 0, [], self.model.max_batch_size - 1, to_device(r.prompt, self.model.device))

    @torch.no_grad()
    def _prefill_piece(self) -> None:
        """The next piece of the prefilling request, into its row (the batch's last); after
        its last piece its sequence moves to the row after the live ones, its first token is
        chosen, and the request goes live."""
        r, start, prompt_lps, row, prompt_ids = self.prefilling
        m = self.model
        if r.cancelled:
            self.prefilling = None
            self.metrics.count("cancelled")
            return
        stop = min(start + self.prefill_chunk, len(r.prompt))
        t0 = time.perf_counter()
        try:
            ids = prompt_ids[start:stop]
            logits = m.prefiller.piece(row, ids, start, all_logits=r.prompt_logprobs)
            if r.prompt_logprobs:
                prompt_lps.extend(self._prompt_logprobs(r, start, stop, logits))
                logits = logits[-1]
            if stop < len(r.prompt):
                self.prefilling = (r, stop, prompt_lps, row, prompt_ids)
                return
            self.prefilling = None
            if r.prompt_logprobs:
                r.emit(("prompt_logprobs", prompt_lps))
            if r.max_tokens == 0:
                self._finish(r, "length")
                return
            first = r.choose(logits, 0)
            lp = read_logprob(r.logprob_of(logits, first))
            token = int(first)
            if row != len(self.live):
                self.slots.move(row, len(self.live), len(r.prompt))
            self.slots.start(len(self.live), prompt_ids[None], [len(r.prompt)], first.reshape(1))
        except Exception as e:  # (a request's failure is its own: the server goes on)
            self.prefilling = None
            self._fail(r, f"prefill failed: {type(e).__name__}: {e}")
            return
        finally:
            self.metrics.observe("prefill_s", time.perf_counter() - t0)
        self.metrics.observe("time_to_first_token_s", time.perf_counter() - r.arrived)
        self.metrics.count("prompt_tokens", len(r.prompt))
        r.enqueued = 1
        self.live.append(r)
        self._emit_tokens(r, [token], [lp])

    @staticmethod
    def _prompt_logprobs(r: Request, start: int, stop: int, logits: torch.Tensor) -> list:
        """Each prompt token's ``(logprob, top-n)`` given the ones before it (None for the
        first) for tokens ``start + 1`` to ``stop`` (the piece's last row predicts
        ``prompt[stop]``, known already), as :func:`read_logprob` gives a new token's."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        nxt = torch.tensor(r.prompt[start + 1:stop + 1], dtype=torch.long, device=lp.device)
        rows = torch.arange(nxt.numel(), device=lp.device)
        chosen = lp[rows, nxt].tolist()
        if r.logprobs:
            top = torch.topk(lp[:nxt.numel()], r.logprobs, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        else:
            tops = [[] for _ in chosen]
        return ([None] if start == 0 else []) + list(zip(chosen, tops))

    def _enqueue_block(self) -> bool:
        """Enqueue up to ``read_every`` steps for the live rows, never past a row's
        ``max_tokens``; False if a row has all its tokens enqueued already."""
        m, rows = self.model, list(self.live)
        block = min([self.read_every] + [r.max_tokens - r.enqueued for r in rows])
        if block <= 0:
            return False
        plain = all(r.greedy and r.logprobs is None for r in rows)
        dec = m.steps.get(len(rows), "argmax" if plain else "logits")
        choices = []  # logits steps: per step, per row, the logprob tensors (or None)
        for i in range(block):
            dec.kernel.launch()
            if not plain:  # the step ended at the logits: each row chooses its own token
                logits, st = dec.step.graph.buffers[dec.step.logits], dec.state
                ids = torch.stack([r.choose(logits[b], r.enqueued + i) for b, r in enumerate(rows)])
                choices.append([r.logprob_of(logits[b], ids[b]) for b, r in enumerate(rows)])
                st["ids"].copy_(ids)
                append_token(st["ids"], st["pos"], st["tokens"])
        reader = self.readers.get(len(rows))
        if reader is None or reader.dec is not dec:
            reader = self.readers[len(rows)] = HistoryReader(dec, m.device)
        reader.read(block)
        for r in rows:
            r.enqueued += block
        self.in_flight.append((reader, rows, block, choices, time.perf_counter()))
        return True

    def _read_block(self) -> None:
        """Wait for the oldest block in flight and hand each row its tokens."""
        reader, rows, block, choices, enqueued_at = self.in_flight.pop(0)
        try:
            _, history = reader.wait()  # bounded: a step that timed out raises here
        except MegakernelError as e:
            # The requests of this block and of the blocks queued behind it (they are never
            # read) fail; one that went live behind them keeps its row and goes on. The rows
            # of the failed ones go back at the next boundary, as a finished request's do.
            failed = set(rows).union(*(held for _, held, *_ in self.in_flight))
            self._drop_in_flight()
            for r in self.live:
                if r in failed and not r.gone:
                    self._fail(r, f"a decode step failed: {e}")
            return
        now = time.perf_counter()
        # The block ran from when it was enqueued or the previous block was read, the later.
        self.metrics.observe("decode_s", now - max(enqueued_at, self._last_read))
        self.metrics.count("decoded_tokens", block * len(rows))
        self._last_read = now
        for b, r in enumerate(rows):
            if r.gone:
                continue
            start = len(r.prompt) + r.produced
            tokens = history[b, start:start + block].tolist()
            self._emit_tokens(r, tokens, [read_logprob(c[b]) for c in choices] if choices else [None] * block)

    def _drop_in_flight(self) -> None:
        """Forget the blocks in flight and their queued reads (a step failed: none is read)."""
        for reader, *_ in self.in_flight:
            reader.drop()
        self.in_flight = []

    def _emit_tokens(self, r: Request, tokens: list[int], lps: list) -> None:
        """Hand ``r`` its next ``tokens`` (one event); it finishes at a stop id (the tokens
        after it are dropped) or at ``max_tokens``, and its row goes back at the next
        boundary with nothing in flight."""
        reason = None
        for n, token in enumerate(tokens, 1):
            if token in r.stop_ids or r.produced + n >= r.max_tokens:
                reason = "stop" if token in r.stop_ids else "length"
                tokens, lps = tokens[:n], lps[:n]
                break
        r.produced += len(tokens)
        self.metrics.count("generated_tokens", len(tokens))
        r.emit(("tokens", tokens, lps))
        if reason:
            self._finish(r, reason)

    def _drop_gone(self) -> None:
        """Give back the rows of requests that finished or were cancelled: the last live row's
        sequence moves into each, so the live rows stay ``[0, n)`` (nothing in flight)."""
        i = 0
        while i < len(self.live):
            r = self.live[i]
            if not r.gone:
                i += 1
                continue
            last = len(self.live) - 1
            if i != last:
                self.slots.move(last, i, len(self.live[last].prompt) + self.live[last].enqueued)
                self.live[i] = self.live[last]
            self.live.pop()
            if not r.finished:
                self.metrics.count("cancelled")

    def _finish(self, r: Request, reason: str) -> None:
        r.finished = True
        self.metrics.count("finished")
        r.emit(("done", reason))

    def _fail(self, r: Request, message: str) -> None:
        r.finished = True
        self.metrics.count("failed")
        r.emit(("error", message))

    def _fail_all(self, message: str) -> None:
        for r in list(self.live) + ([self.prefilling[0]] if self.prefilling else []):
            if not r.gone:
                self._fail(r, message)
        self._drop_in_flight()
        self.live, self.prefilling = [], None
        while True:
            try:
                self._fail(self.waiting.get_nowait(), message)
            except queue.Empty:
                break


class Metrics:
    """Counts, gauges and durations the scheduler keeps (read by ``/metrics``): each
    duration's count and sum, and its most recent :data:`RECENT` values for quantiles."""

    RECENT = 1000

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.gauges: dict[str, float] = {}
        self.durations: dict[str, list] = {}  # name: [count, sum, deque of recent]

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def gauge(self, **values) -> None:
        with self.lock:
            self.gauges.update(values)

    def observe(self, name: str, seconds: float) -> None:
        with self.lock:
            d = self.durations.setdefault(name, [0, 0.0, collections.deque(maxlen=self.RECENT)])
            d[0] += 1
            d[1] += seconds
            d[2].append(seconds)

    def snapshot(self) -> tuple[dict, dict, dict]:
        """(counts, gauges, {name: (count, sum, sorted recent values)})."""
        with self.lock:
            return (dict(self.counts), dict(self.gauges),
                    {k: (c, s, sorted(recent)) for k, (c, s, recent) in self.durations.items()})
