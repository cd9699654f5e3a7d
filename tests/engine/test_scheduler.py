"""Continuous batching (mk.engine.scheduler) against independent references: every request's
greedy tokens are the float32 torch reference's for that request alone, whatever joins and
leaves the batch around it; a failed step fails its requests and the scheduler goes on."""

from __future__ import annotations

import threading

import pytest
import torch

from mk.engine import stream
from mk.engine.scheduler import QueueFull, Request, Scheduler
from mk.models import Llama, LlamaConfig, ReferenceLlama, greedy_generate
from mk.models.reference import prefill_logits
from mk.persistent.runtime import MegakernelTimeout

CONFIG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=None,
                     max_position_embeddings=64)
WAIT_S = 300  # bound on any one request in the interpreter


@pytest.fixture(scope="module")
def model():
    # A float32 cache: a slot's tokens then equal the request run alone (no rounding to differ in).
    return Llama.from_config(CONFIG, seed=4, max_batch_size=3, max_seq_len=40, dtype=torch.float32,
                             kv_dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(model):
    return ReferenceLlama(CONFIG, model.hf_weights())


class Collect:
    """A request's events, and an Event set when it ends."""

    def __init__(self):
        self.tokens, self.events, self.ended = [], [], threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if ev[0] == "tokens":
            self.tokens += ev[1]
        if ev[0] in ("done", "error"):
            self.ended.set()


class OnFirstToken(Collect):
    """A request's events; ``action()`` runs when its first token arrives."""

    def __init__(self, action):
        super().__init__()
        self.action = action

    def __call__(self, ev):
        super().__call__(ev)
        if ev[0] == "tokens" and len(self.tokens) == len(ev[1]):
            self.action()


def _run_second_during_first(scheduler, first: Request, second: Request) -> None:
    """Start ``scheduler`` and run ``first``; ``second`` arrives on its first token (so while
    it decodes); both end."""
    first.emit = OnFirstToken(lambda: scheduler.submit(second))
    scheduler.start()
    try:
        _run(scheduler, [first])
        assert second.emit.ended.wait(WAIT_S), "the second request never ended"
    finally:
        scheduler.stop()


def _run(scheduler, requests):
    for r in requests:
        scheduler.submit(r)
    for r in requests:
        assert r.emit.ended.wait(WAIT_S), "a request never ended"


def test_requests_that_join_and_leave_get_the_tokens_each_gets_alone(model, reference):
    """Five requests on three slots, prompts cut into pieces (prefill_chunk=3) between blocks
    of two steps: requests join as others leave, rows move, and the live batch shrinks and
    grows; each one's tokens are the reference's for it alone. A stop id ends one early."""
    prompts = [[1, 5, 9, 3], [7, 8, 2, 11, 4, 6, 13], [3, 3, 3], [9, 1], [40, 41, 42, 43, 44]]
    budgets = [5, 2, 6, 3, 3]
    want = [greedy_generate(reference, [p], n)[0] for p, n in zip(prompts, budgets)]
    stop = want[2][2]  # request 2 stops at its third token
    scheduler = Scheduler(model, read_every=2, prefill_chunk=3).start()
    try:
        reqs = [Request(prompt=p, max_tokens=n, emit=Collect(), stop_ids=frozenset([stop]) if i == 2 else frozenset())
                for i, (p, n) in enumerate(zip(prompts, budgets))]
        _run(scheduler, reqs)
    finally:
        scheduler.stop()
    for i, r in enumerate(reqs):
        expect = want[i][:want[i].index(stop) + 1] if i == 2 else want[i]
        assert r.emit.tokens == expect, i
        assert r.emit.events[-1] == ("done", "stop" if i == 2 else "length")
    counts = scheduler.metrics.snapshot()[0]
    assert counts["finished"] == 5 and counts["generated_tokens"] == sum(len(r.emit.tokens) for r in reqs)


def in_flight_at(monkeypatch, method: str) -> list[int]:
    """The blocks in flight each time the scheduler enters ``method`` (recorded as it runs)."""
    seen, real = [], getattr(Scheduler, method)

    def counting(self):
        seen.append(len(self.in_flight))
        real(self)

    monkeypatch.setattr(Scheduler, method, counting)
    return seen


def test_a_block_is_queued_behind_the_one_being_read(model, reference, monkeypatch):
    """While nobody joins or leaves, the device runs the next block while the host hands out
    a block's tokens: every read but the last finds another block in flight behind it (the
    GPU otherwise idles for the host's work between blocks). Tokens stay the reference's."""
    seen = in_flight_at(monkeypatch, "_read_block")
    prompt = [3, 1, 4, 1, 5]
    want = greedy_generate(reference, [prompt], 9)[0]
    scheduler = Scheduler(model, read_every=2).start()
    try:
        r = Request(prompt=prompt, max_tokens=9, emit=Collect())
        _run(scheduler, [r])
    finally:
        scheduler.stop()
    assert r.emit.tokens == want
    assert seen == [2, 2, 2, 1], seen  # 8 tokens after the prefill's first: blocks of 2, 2, 2, 2


def test_a_prompt_is_prefilled_while_a_block_of_the_live_streams_runs(model, reference, monkeypatch):
    """A prompt arriving while another request decodes is prefilled a piece at a time, each
    piece queued behind a block of the live stream (the device runs the block, then the
    piece; the host's launches of the piece overlap the block), never with the pipeline
    drained; both requests still get the reference's tokens. Every piece goes to the batch's
    last row (one row for every prompt: its prefill graphs are captured once per start and
    length), and the sequence moves to the row after the live ones when it goes live."""
    during = in_flight_at(monkeypatch, "_prefill_piece")
    pieces, real_piece = [], model.prefiller.piece

    def piece(row, ids, start, all_logits=False):
        pieces.append((row, start, ids.numel()))
        return real_piece(row, ids, start, all_logits)

    monkeypatch.setattr(model.prefiller, "piece", piece)
    first, second = [2, 7, 1, 8], [3, 14, 15, 9, 26, 5, 35]
    want = [greedy_generate(reference, [p], n)[0] for p, n in ((first, 12), (second, 3))]
    scheduler = Scheduler(model, read_every=2, prefill_chunk=2)
    b = Request(prompt=second, max_tokens=3, emit=Collect())
    a = Request(prompt=first, max_tokens=12, emit=Collect())
    _run_second_during_first(scheduler, a, b)
    assert a.emit.tokens == want[0] and b.emit.tokens == want[1]
    # The first prompt's 2 pieces with nothing live, the second's 4 each behind a block.
    assert during == [0, 0, 1, 1, 1, 1], during
    last = model.max_batch_size - 1
    assert pieces == [(last, 0, 2), (last, 2, 2), (last, 0, 2), (last, 2, 2), (last, 4, 2), (last, 6, 1)], pieces


def test_logprobs_and_sampling_choose_per_request(model, reference):
    """A greedy request with logprobs beside a sampled one: the greedy one's tokens are still
    the reference's and its logprobs the reference's log-softmax; the sampled one draws the
    same tokens for the same seed whatever runs beside it. Prompt logprobs (echo) too."""
    prompt = [2, 4, 6, 8, 10]
    want = greedy_generate(reference, [prompt], 3)[0]
    scheduler = Scheduler(model, read_every=2, prefill_chunk=2).start()
    try:
        greedy = Request(prompt=prompt, max_tokens=3, emit=Collect(), logprobs=2, prompt_logprobs=True)
        drawn = Request(prompt=[5, 6], max_tokens=4, emit=Collect(), temperature=0.8, top_k=20, seed=11)
        _run(scheduler, [greedy, drawn])
        again = Request(prompt=[5, 6], max_tokens=4, emit=Collect(), temperature=0.8, top_k=20, seed=11)
        _run(scheduler, [again])
    finally:
        scheduler.stop()
    assert greedy.emit.tokens == want
    assert drawn.emit.tokens == again.emit.tokens and all(0 <= t < CONFIG.vocab_size for t in drawn.emit.tokens)
    seq = prompt + want
    ref = torch.log_softmax(prefill_logits(reference, [seq])[0][0].float(), dim=-1)
    got = [(token, lp) for ev in greedy.emit.events if ev[0] == "tokens" for token, lp in zip(ev[1], ev[2])]
    for k, (token, (lp, top)) in enumerate(got):
        at = len(prompt) - 1 + k
        assert lp == pytest.approx(ref[at, token].item(), abs=1e-4)
        assert [t for t, _ in top] == torch.topk(ref[at], 2).indices.tolist()
    (prompt_lps,) = [ev[1] for ev in greedy.emit.events if ev[0] == "prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for k in range(1, len(prompt)):
        assert prompt_lps[k][0] == pytest.approx(ref[k - 1, prompt[k]].item(), abs=1e-4)


def test_a_failed_step_fails_its_requests_and_the_scheduler_serves_the_next(model, reference, monkeypatch):
    real = stream.HistoryReader.wait
    calls = {"n": 0}

    def wait_once_failing(self):
        calls["n"] += 1
        if calls["n"] == 1:
            real(self)
            raise MegakernelTimeout(0, 0, "step", 0, 0, 1)
        return real(self)

    monkeypatch.setattr(stream.HistoryReader, "wait", wait_once_failing)
    scheduler = Scheduler(model, read_every=2).start()
    try:
        first = Request(prompt=[1, 2, 3], max_tokens=4, emit=Collect())
        _run(scheduler, [first])
        after = Request(prompt=[4, 5], max_tokens=3, emit=Collect())
        _run(scheduler, [after])
    finally:
        scheduler.stop()
    assert first.emit.events[-1][0] == "error" and "decode step failed" in first.emit.events[-1][1]
    assert after.emit.tokens == greedy_generate(reference, [[4, 5]], 3)[0]
    assert scheduler.alive is False and scheduler.failed is None


def test_a_failed_block_fails_only_the_requests_in_it(model, reference, monkeypatch):
    """A request that goes live while a block of another is in flight is not in that block:
    when the block fails, the other request gets the error and this one goes on, with the
    reference's tokens (its row moved down into the failed one's)."""
    real, armed = stream.HistoryReader.wait, {"on": False, "failed": 0}

    def wait(self):
        out = real(self)
        if armed["on"] and not armed["failed"]:
            armed["failed"] += 1
            raise MegakernelTimeout(0, 0, "step", 0, 0, 1)
        return out

    monkeypatch.setattr(stream.HistoryReader, "wait", wait)
    scheduler = Scheduler(model, read_every=2)
    second = [6, 2, 8]

    # The second's first token: it is live, and a block of the first's is in flight.
    b = Request(prompt=second, max_tokens=5, emit=OnFirstToken(lambda: armed.update(on=True)))
    a = Request(prompt=[1, 2, 3], max_tokens=12, emit=Collect())
    _run_second_during_first(scheduler, a, b)
    assert armed["failed"] == 1
    assert a.emit.events[-1][0] == "error" and "decode step failed" in a.emit.events[-1][1]
    assert b.emit.tokens == greedy_generate(reference, [second], 5)[0]
    assert scheduler.failed is None


def test_prepare_warms_the_prefill_pieces_in_the_row_prompts_go_to(model, reference, monkeypatch):
    """prepare builds every batch size's step, then runs one piece of each shape the prefill
    replays as a graph (on a GPU; here the shapes are given, and run eagerly) into the row
    admitted prompts are prefilled into, with its progress counted; the zeros they leave in
    that row's cache do not reach a request prefilled there afterwards."""
    assert model.prefiller.piece_shapes(4) == []  # the CPU runs pieces eagerly: nothing to capture
    pieces, real_piece = [], model.prefiller.piece

    def piece(row, ids, start, all_logits=False):
        pieces.append((row, start, ids.numel()))
        return real_piece(row, ids, start, all_logits)

    monkeypatch.setattr(model.prefiller, "piece_shapes", lambda chunk: [(0, chunk), (chunk, chunk)])
    monkeypatch.setattr(model.prefiller, "piece", piece)
    scheduler = Scheduler(model, read_every=2, prefill_chunk=4)
    seen = []
    scheduler.prepare(progress=lambda done, total: seen.append((done, total)))
    n, last = model.max_batch_size, model.max_batch_size - 1
    assert seen == [(k, n + 2) for k in range(1, n + 3)]
    assert pieces == [(last, 0, 4), (last, 4, 4)]
    prompt = [9, 4, 1, 7, 3, 3]
    r = Request(prompt=prompt, max_tokens=4, emit=Collect())
    scheduler.start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            scheduler.prepare()
        _run(scheduler, [r])
    finally:
        scheduler.stop()
    assert r.emit.tokens == greedy_generate(reference, [prompt], 4)[0]


def test_bad_requests_are_refused_at_submit_and_a_full_queue_says_so(model):
    scheduler = Scheduler(model, max_queue=1)  # (not started: nothing leaves the queue)
    for kwargs, message in ((dict(prompt=[]), "empty"), (dict(prompt=[1, 96]), r"outside \[0, 96\)"),
                            (dict(prompt=[1] * 30, max_tokens=11), "exceed the 40 positions"),
                            (dict(prompt=[1], max_tokens=-1), "max_tokens"),
                            (dict(prompt=[1], logprobs=21), "logprobs")):
        with pytest.raises(ValueError, match=message):
            scheduler.submit(Request(**{"max_tokens": 1, "emit": print, **kwargs}))
    # Each free slot takes a request at the next boundary: those do not count against the queue.
    for _ in range(1 + model.max_batch_size):
        scheduler.submit(Request(prompt=[1], max_tokens=1, emit=print))
    with pytest.raises(QueueFull, match="1 requests are waiting"):
        scheduler.submit(Request(prompt=[1], max_tokens=1, emit=print))
    with pytest.raises(ValueError, match="prefill_chunk"):
        Scheduler(model, prefill_chunk=0)
