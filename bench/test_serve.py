"""``mk serve`` on one GPU, the Llama-3.2-1B shape (random bf16 weights), against ``generate``
on the same model in the same process:

- one stream through the server against ``generate`` at batch 1 (decode tokens/s);
- 8 concurrent greedy streams against ``generate`` at batch 8 (aggregate tokens/s), and with a
  float32 KV cache each stream's tokens against its request run alone;
- time to first token of requests that arrive while 7 streams decode (p50, p99), and the
  running streams' per-token time while they are prefilled, against their steady time;
- a load run: 200 requests from 32 concurrent clients, random arrivals and lengths, 10% of
  clients going away mid-stream and 5% malformed requests; every well-formed request is
  answered, each stream's tokens are counted against its usage, and GPU memory and the
  process's RSS are compared before and after; run twice, the second pass on a warm server.

The tokenizer is a word-level vocabulary ``t0 ... t<V-1>``: one word a token, so a stream's
text gives back its token ids exactly.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from _harness import NEW, PROMPT, measure_generate, prompts
from _llama_shapes import SHAPES, random_model

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

MAX_SEQ = 1024
CALL_S = 120  # bound on any one request
#: The load run: requests, concurrent clients, prompt and new-token lengths (uniform in each).
LOAD = dict(requests=200, clients=32, prompt=(8, 512), new=(8, 256))


def word_tokenizer(vocab: int):
    """mk's Tokenizer over a word-level vocabulary ``t0 ... t{vocab-1}`` (no BOS, no EOS)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from mk.models.tokenizer import Tokenizer

    hf = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return Tokenizer(hf, add_bos=False)


def words(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


class Server:
    """``model`` served on 127.0.0.1 by uvicorn on a thread of this process."""

    def __init__(self, model, tokenizer):
        from mk.engine.scheduler import Scheduler
        from mk.serve.app import create_app

        self.scheduler = Scheduler(model, max_queue=256)
        self.scheduler.prepare()
        self.scheduler.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.scheduler, tokenizer, "1b"), host="127.0.0.1",
                                                   port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self):
        return openai.OpenAI(base_url=self.base + "/v1", api_key="none", timeout=CALL_S, max_retries=0)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.scheduler.stop()


#: A client in a process of its own (a user's clients are not in the server's process, and
#: would share its interpreter lock): streams one greedy completion, prints its tokens and
#: their arrival times (time.monotonic, one clock for every process) as JSON. It sends one
#: 1-token request first, as a user's long-lived client (an editor, a harness) has: the
#: `openai` package's first request in a process costs it several ms of its own (lazy
#: imports, the connection, its first models), which are the client's, not the server's.
CLIENT = r"""
import json, sys, time
import openai
base, ids, n, start = json.loads(sys.argv[1])
client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
for _ in client.completions.create(model="1b", prompt=ids[:1], max_tokens=1, temperature=0, stream=True):
    pass
time.sleep(max(0.0, start - time.monotonic()))
sent, out, times = time.monotonic(), [], []
for chunk in client.completions.create(model="1b", prompt=ids, max_tokens=n, temperature=0, stream=True):
    for c in chunk.choices:
        new = [int(w[1:]) for w in c.text.split()]
        out += new
        times += [time.monotonic()] * len(new)
print(json.dumps(dict(tokens=out, times=times, sent=sent)))
"""


def client_processes(base: str, jobs: list[tuple[list[int], int]], start_in: float = 3.0) -> list[dict]:
    """Each job (ids, max_tokens) streamed by a client process of its own, all sending at
    once, ``start_in`` seconds from now (their imports done by then)."""
    import subprocess
    import sys

    start = time.monotonic() + start_in
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, json.dumps([base, ids, n, start])],
                              stdout=subprocess.PIPE, text=True) for ids, n in jobs]
    return [json.loads(p.communicate(timeout=CALL_S)[0]) for p in procs]


def timed_stream(client, ids: list[int], max_tokens: int, **kw) -> dict:
    """A greedy completion streamed: its tokens and the arrival time of each."""
    t0 = time.monotonic()
    out, times, usage, finish = [], [], None, None
    for chunk in client.completions.create(model="1b", prompt=ids, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            new = words(c.text)
            out += new
            times += [time.monotonic()] * len(new)
            finish = c.finish_reason or finish
    return dict(tokens=out, times=times, sent=t0, usage=usage, finish=finish)


@pytest.fixture(scope="module")
def served(gpu_env):
    from mk.models import Llama, LlamaConfig

    cfg = LlamaConfig(**SHAPES["1b"])
    model = Llama(cfg, random_model(cfg), device="cuda", dtype=torch.bfloat16, max_batch_size=8,
                  max_seq_len=MAX_SEQ, name="llama-1b")
    baseline = {b: measure_generate(_NoBenchmark(), model, b, gpu_env["copy_Bps"]) for b in (1, 8)}
    server = Server(model, word_tokenizer(cfg.vocab_size))
    yield model, server, baseline
    server.stop()


class _NoBenchmark:
    """measure_generate's benchmark argument when pytest-benchmark times nothing here."""

    @staticmethod
    def pedantic(fn, rounds: int, warmup_rounds: int = 0):
        for _ in range(rounds):
            fn()


def test_one_stream_against_generate(record, served):
    model, server, base = served
    client = server.client()
    ids = prompts(1, model.config.vocab_size)[0]
    timed_stream(client, ids, 16)  # warm
    runs = [client_processes(server.base, [(ids, NEW)], start_in=2.0)[0] for _ in range(3)]
    for r in runs:
        assert len(r["tokens"]) == NEW
    per_token = statistics.median((r["times"][-1] - r["times"][0]) / (NEW - 1) for r in runs)
    ttft = statistics.median(r["times"][0] - r["sent"] for r in runs)
    row = dict(op="one_stream", prompt=PROMPT, new_tokens=NEW, server_ms_per_token=per_token * 1e3,
               server_tokens_per_s=1 / per_token, generate_ms_per_token=base[1]["generate_ms_per_token"],
               generate_tokens_per_s=base[1]["tokens_per_s"], of_generate=base[1]["generate_ms_per_token"] / 1e3 /
               per_token, server_time_to_first_token_ms=ttft * 1e3,
               generate_time_to_first_token_ms=base[1]["time_to_first_token_ms"])
    record("serve", **row)
    print(row)


def test_eight_streams_against_generate(record, served):
    model, server, base = served
    ids = prompts(8, model.config.vocab_size)
    results = client_processes(server.base, [(p, NEW) for p in ids])
    assert all(len(r["tokens"]) == NEW for r in results)
    # Aggregate decode rate while all eight decode: from the last first token to the first last token.
    start, end = max(r["times"][0] for r in results), min(r["times"][-1] for r in results)
    if end <= start:  # (they never all decoded at once: the whole span instead)
        start, end = min(r["times"][0] for r in results), max(r["times"][-1] for r in results)
    inside = sum(sum(start <= t <= end for t in r["times"]) for r in results)
    agg = inside / (end - start)
    row = dict(op="eight_streams", prompt=PROMPT, new_tokens=NEW, server_tokens_per_s=agg,
               generate_tokens_per_s=base[8]["tokens_per_s"], of_generate=agg / base[8]["tokens_per_s"])
    record("serve", **row)
    print(row)


def test_streams_equal_their_request_alone_with_a_float32_cache(record):
    """The scheduler on a float32-KV model: 4 concurrent greedy requests of other lengths
    (joining and leaving: steps for 1 to 4 rows) against each run alone through ``generate``."""
    from mk.engine.scheduler import Request, Scheduler
    from mk.models import Llama, LlamaConfig

    cfg = LlamaConfig(**SHAPES["1b"])
    model = Llama(cfg, random_model(cfg, seed=1), device="cuda", dtype=torch.bfloat16, max_batch_size=8,
                  max_seq_len=512, kv_dtype=torch.float32, name="llama-1b-f32kv")
    rng = random.Random(0)
    reqs = [([rng.randrange(cfg.vocab_size) for _ in range(rng.randint(8, 200))], rng.randint(8, 128))
            for _ in range(4)]
    alone = [model.generate([p], max_new_tokens=n)[0][len(p):] for p, n in reqs]
    got = [[] for _ in reqs]
    done = [threading.Event() for _ in reqs]
    sched = Scheduler(model).start()
    for i, (p, n) in enumerate(reqs):
        def emit(ev, i=i):
            if ev[0] == "tokens":
                got[i] += ev[1]
            elif ev[0] in ("done", "error"):
                done[i].set()
        sched.submit(Request(prompt=p, max_tokens=n, emit=emit))
    assert all(d.wait(CALL_S) for d in done)
    sched.stop()
    same = sum(g == a for g, a in zip(got, alone))
    tokens_same = sum(x == y for g, a in zip(got, alone) for x, y in zip(g, a))
    record("serve", op="float32_cache_equality", requests=len(reqs), requests_equal=same,
           tokens_equal=tokens_same, tokens=sum(len(a) for a in alone))
    assert same == len(reqs), [(len(g), len(a), next((k for k, (x, y) in enumerate(zip(g, a)) if x != y), None))
                               for g, a in zip(got, alone)]


def test_time_to_first_token_while_seven_streams_decode(record, served):
    model, server, _ = served
    vocab = model.config.vocab_size
    long = prompts(7, vocab)
    client = server.client()
    timed_stream(client, long[0][:1], 1)  # the client's own first request, before it is timed
    runs = []
    streams = threading.Thread(target=lambda: runs.extend(
        client_processes(server.base, [(p, MAX_SEQ - PROMPT - 8) for p in long], start_in=2.0)))
    streams.start()
    time.sleep(2.5)  # steady decoding
    arrivals, ttft = [], []
    for k in range(12):
        ids = [(k * 131 + t * 17) % vocab for t in range(512)]
        a = time.monotonic()
        r = timed_stream(client, ids, 1)
        arrivals.append((a, r["times"][0]))
        ttft.append(r["times"][0] - a)
    streams.join(CALL_S)
    times = runs[0]["times"]
    window = 8  # tokens (one block)

    def per_token(i):
        return (times[i + window] - times[i]) / window

    before = [per_token(i) for i in range(len(times) - window) if times[i + window] < arrivals[0][0]]
    steady = statistics.median(before or [per_token(i) for i in range(len(times) - window)])
    during = [per_token(i) for i in range(len(times) - window)
              if any(a <= times[i + window] and times[i] <= b for a, b in arrivals)]
    ttft.sort()
    row = dict(op="first_token_under_load", streams=7, prompt=512, arrivals=len(ttft),
               time_to_first_token_p50_ms=ttft[len(ttft) // 2] * 1e3,
               time_to_first_token_p99_ms=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3,
               steady_ms_per_token=steady * 1e3, during_prefill_ms_per_token_max=max(during, default=0) * 1e3,
               during_prefill_ms_per_token_mean=statistics.mean(during or [0]) * 1e3,
               during_over_steady_max=max(during, default=0) / steady)
    record("serve", **row)
    print(row)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _load_once(server, plan: list[dict], vocab: int) -> tuple[list, float]:
    """One pass of the load run's ``plan``: each request's outcome, and the wall time."""
    outcomes = [None] * len(plan)
    lock = threading.Lock()
    queue = list(range(len(plan)))

    def worker():
        client = server.client()
        while True:
            with lock:
                if not queue:
                    return
                k = queue.pop(0)
            p = plan[k]
            time.sleep(p["delay"])
            ids = [(k * 7919 + t * 31) % vocab for t in range(p["prompt"])]
            try:
                if p["kind"] == "malformed":
                    bad = b'{"prompt": [1, 2' if k % 40 == 7 else json.dumps({"prompt": ids, "n": 2}).encode()
                    req = urllib.request.Request(server.base + "/v1/completions", data=bad,
                                                 headers={"Content-Type": "application/json"})
                    try:
                        urllib.request.urlopen(req, timeout=CALL_S)
                        outcomes[k] = ("malformed", 200)
                    except urllib.error.HTTPError as e:
                        outcomes[k] = ("malformed", e.code)
                elif p["kind"] == "disconnect":
                    stream = client.completions.create(model="1b", prompt=ids, max_tokens=p["new"], temperature=0,
                                                       stream=True)
                    for n, _ in enumerate(stream):
                        if n == 3:
                            break
                    stream.close()
                    outcomes[k] = ("disconnected", None)
                elif p["stream"]:
                    r = timed_stream(client, ids, p["new"])
                    ok = len(r["tokens"]) == r["usage"] and r["finish"] in ("stop", "length")
                    outcomes[k] = ("stream", ok and r["usage"] == p["new"])
                else:
                    r = client.completions.create(model="1b", prompt=ids, max_tokens=p["new"], temperature=0)
                    n = len(words(r.choices[0].text))
                    outcomes[k] = ("plain", n == r.usage.completion_tokens == p["new"])
            except Exception as e:  # recorded: the run must not lose a request
                outcomes[k] = ("exception", f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    workers = [threading.Thread(target=worker) for _ in range(LOAD["clients"])]
    for w in workers:
        w.start()
    for w in workers:
        w.join(600)
    wall = time.perf_counter() - t0
    assert not any(w.is_alive() for w in workers), "the load run hung"
    deadline = time.time() + 10
    while (server.scheduler.live or server.scheduler.waiting.qsize()) and time.time() < deadline:
        time.sleep(0.1)
    return outcomes, wall


def test_load_run(record, served):
    """The load run twice over the same plan: the first pass warms what a server keeps (its
    prefill graphs, pinned buffers, the allocator's pools), so memory is compared across the
    second, as a long-running server sees it."""
    import gc

    model, server, _ = served
    vocab = model.config.vocab_size
    rng = random.Random(1)
    plan = []
    for k in range(LOAD["requests"]):
        kind = "malformed" if k % 20 == 7 else "disconnect" if k % 10 == 3 else "normal"
        plan.append(dict(kind=kind, prompt=rng.randint(*LOAD["prompt"]), new=rng.randint(*LOAD["new"]),
                         delay=rng.random() * 0.2,
                         stream=rng.random() < 0.7 or kind == "disconnect"))
    for run in (1, 2):
        gc.collect()  # (what earlier tests left goes now, not during the run)
        torch.cuda.synchronize()
        mem0, rss0 = torch.cuda.memory_allocated(), _rss_mib()
        outcomes, wall = _load_once(server, plan, vocab)
        gc.collect()
        torch.cuda.synchronize()
        mem1, rss1 = torch.cuda.memory_allocated(), _rss_mib()
        bad = [(k, o) for k, o in enumerate(outcomes) if o is None or o[0] == "exception" or o[1] is False
               or (o[0] == "malformed" and o[1] != 400)]
        counts, gauges, _ = server.scheduler.metrics.snapshot()
        row = dict(op="load_run", run=run, requests=len(plan), clients=LOAD["clients"], wall_s=wall,
                   answered=sum(1 for o in outcomes if o and o[0] in ("stream", "plain") and o[1]),
                   malformed_400=sum(1 for o in outcomes if o and o[0] == "malformed" and o[1] == 400),
                   disconnected=sum(1 for o in outcomes if o and o[0] == "disconnected"), failures=len(bad),
                   gpu_memory_delta_mib=(mem1 - mem0) / 2**20, rss_delta_mib=rss1 - rss0, rss_mib=rss1,
                   generated_tokens=counts.get("generated_tokens", 0), live_after=gauges.get("live_slots"))
        record("serve", **row)
        print(row)
        assert not bad, bad[:5]
        assert not server.scheduler.live
    assert mem1 - mem0 < 64 * 2**20, "GPU memory grew across the warm pass"
    assert rss1 - rss0 < 32, "the process's RSS grew across the warm pass"
