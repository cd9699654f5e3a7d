"""``python -m mk serve`` end to end on the CPU: a server process on 127.0.0.1 with a tiny
checkpoint (the interpreter), the official ``openai`` client for streaming and non-streaming
calls, raw HTTP for malformed requests. Tokens are checked against the float32 torch
reference (mk.models.reference) run on each request alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from mk.generate import DEFAULT_CONFIG
from mk.models import LlamaConfig, ReferenceLlama, greedy_generate, load_tokenizer, random_weights, save_weights
from mk.models.reference import prefill_logits
from tests.conftest import byte_level_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

SLOTS, QUEUE, POSITIONS = 3, 4, 48
#: Bound on the server's start (load, and build three steps in the interpreter) and on a call.
START_S, CALL_S = 300, 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    # Small enough for the interpreter to decode a few tokens a second at batch 3.
    config = LlamaConfig(**{**DEFAULT_CONFIG, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
                            "num_hidden_layers": 1,
                            "vocab_size": 288, "bos_token_id": 0, "eos_token_id": 1})
    weights = random_weights(config, seed=5, dtype=torch.bfloat16)
    save_weights(weights, config, folder)
    byte_level_tokenizer(folder)
    return folder, config, ReferenceLlama(config, {k: v.float() for k, v in weights.items()})


@pytest.fixture(scope="module")
def served(checkpoint):
    """The server process and its base URL."""
    folder = checkpoint[0]
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "mk", "serve", "--model", str(folder), "--port", str(port),
                             "--max-batch", str(SLOTS), "--max-queue", str(QUEUE), "--max-seq-len", str(POSITIONS),
                             "--kv-dtype", "float32", "--prefill-chunk", "8", "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + START_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}): {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.5)
    yield base, proc
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=CALL_S, max_retries=0)


def _alone(checkpoint, ids: list[int], n: int) -> list[int]:
    """The reference's greedy tokens for ``ids`` alone, cut after EOS (id 1) as the server stops."""
    out = greedy_generate(checkpoint[2], [ids], n)[0]
    return out[:out.index(1) + 1] if 1 in out else out


def _text(checkpoint, ids, new) -> str:
    tok = load_tokenizer(checkpoint[0])
    return tok.decode(ids + new)[len(tok.decode(ids)):]


def _post(base: str, path: str, body) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=CALL_S) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_concurrent_streams_each_get_the_tokens_of_their_request_alone(server, client, checkpoint):
    """Four streams on three slots (one waits for a slot, prompts prefilled a piece at a time
    between blocks): each stream's text is the reference's greedy text for its prompt alone."""
    tok = load_tokenizer(checkpoint[0])
    prompts = ["hello world", "the cat", "hello the cat, world", "cat"]
    budgets = [4, 2, 3, 5]
    got = [None] * len(prompts)

    def one(i):
        stream = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=budgets[i], temperature=0,
                                           stream=True)
        pieces, finish = [], None
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        got[i] = ("".join(pieces), finish)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_S)
    for i, p in enumerate(prompts):
        ids = tok.encode(p)
        new = _alone(checkpoint, ids, budgets[i])
        assert got[i] == (_text(checkpoint, ids, new), "stop" if new[-1] == 1 else "length"), i


def test_completion_with_logprobs_and_echo_is_the_reference_s(client, checkpoint):
    """lm-evaluation-harness's call: echo + logprobs, greedy; the prompt comes back with its
    logprobs (the first None), then the completion's, all the reference's log-softmax. Each
    token's text_offset is where the text decoded before it ends (a character cut across
    byte tokens: its start), in the body and in the stream alike."""
    tok = load_tokenizer(checkpoint[0])
    ids = tok.encode("the caté é")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, logprobs=1, echo=True)
    new = _alone(checkpoint, ids, 2)
    (choice,) = r.choices
    assert choice.text == tok.decode(ids + new)
    ref = torch.log_softmax(prefill_logits(checkpoint[2], [ids + new])[0][0], dim=-1)
    lps = choice.logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(ids) + len(new)
    for k in range(1, len(lps)):
        assert lps[k] == pytest.approx(ref[k - 1, (ids + new)[k]].item(), abs=1e-3), k
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(new)

    def before(k):  # the text of the first k tokens, less a character they do not finish
        return tok.decode((ids + new)[:k]).rstrip("\ufffd")

    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(len(ids))), "no character spans tokens"
    offsets = choice.logprobs.text_offset
    assert offsets == [len(before(k)) for k in range(len(ids + new))]
    assert all(choice.text.startswith(before(k)) for k in range(len(ids + new)))
    stream = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, logprobs=1, echo=True,
                                       stream=True)
    streamed = [o for c in stream if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == offsets[len(ids):]
    alone = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, logprobs=1)
    prompt_chars = len(tok.decode(ids))
    assert alone.choices[0].logprobs.text_offset == [o - prompt_chars for o in offsets[len(ids):]]


def test_chat_goes_through_the_template_and_stops_at_a_stop_string(client, checkpoint):
    tok = load_tokenizer(checkpoint[0])
    messages = [{"role": "user", "content": "hello"}]
    ids = tok.apply_chat_template(messages)
    new = _alone(checkpoint, ids, 6)
    full = _text(checkpoint, ids, new)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == full and r.choices[0].message.role == "assistant"
    stop = full[2:4] if len(full) >= 4 else None
    if stop:
        cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stop=stop,
                                             stream=True, stream_options={"include_usage": True})
        chunks = list(cut)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full[:full.find(stop)] and stop not in text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.prompt_tokens == len(ids)


def test_a_seed_draws_the_same_sample_and_models_lists_the_model(client):
    a, b = (client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0.9, top_p=0.9, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.parametrize("body, status, words", [
    (b'{"prompt": "hi", ', 400, "not valid JSON"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 2}, 400, "n=2"),
    ({"prompt": "hi", "tools": []}, 400, "unsupported field 'tools'"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": POSITIONS}, 400, f"exceed the {POSITIONS} positions"),
    ({"prompt": [9999]}, 400, "outside [0, 288)"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ({}, 400, "missing field 'prompt'"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream: Input should be a valid boolean"),
    ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens: Input should be a valid integer"),
    ({"prompt": 5}, 400, "prompt: got a number; it must be one of str, "),
    ({"prompt": "hi", "stop": [99999]}, 400, "stop: token id 99999 is outside the vocabulary [0, 288)"),
    ([1, 2], 400, "the body must be a JSON object, got an array"),
    ({"prompt": "hi", "temperature": "a", "top_p": "b"}, 400, "temperature: Input should be a valid number"),
])
def test_malformed_requests_get_a_400_in_openai_s_shape(server, body, status, words):
    code, answer, _ = _post(server, "/v1/completions", body)
    assert code == status and words in answer["error"]["message"], answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}


def test_every_refusal_is_in_openai_s_shape(server):
    """Not only the endpoints' own: no route, a wrong method, a body sent without a JSON
    content type, a conversation that leaves no room for a reply."""
    for req, status, words in (
            (urllib.request.Request(server + "/v1/nothing"), 404, "GET /v1/nothing: Not Found"),
            (urllib.request.Request(server + "/v1/models", data=b"{}"), 405, "POST /v1/models: Method Not Allowed"),
            (urllib.request.Request(server + "/v1/completions", data=b'{"prompt": "hi"}',
                                    headers={"Content-Type": "text/plain"}), 400, "Content-Type: application/json"),
            (urllib.request.Request(server + "/v1/chat/completions",
                                    data=json.dumps({"messages": [{"role": "user", "content": "x" * POSITIONS}]}).encode(),
                                    headers={"Content-Type": "application/json"}), 400, "leaves no room for a reply")):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=CALL_S)
        answer = json.loads(e.value.read())
        assert e.value.code == status and words in answer["error"]["message"], answer
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    text = urllib.request.urlopen(server + "/metrics", timeout=10).read().decode()
    assert 'mk_http_responses_total{path="other",status="404"}' in text, text


def _post_and_go(base: str, body: dict) -> socket.socket:
    """A request sent by a client that will not wait for its answer: close the socket it returns."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=CALL_S)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_a_full_queue_is_a_429_and_gone_clients_give_their_slots_back(server, client):
    """Two streams and a request not streamed hold the slots and four requests wait (as many
    as the queue holds): the next is refused with 429 and Retry-After. The three clients go
    away: their slots come back and the waiting requests and a new one are served; /metrics
    counts all of it."""
    before = _metrics(server)
    streams = [client.completions.create(model="tiny", prompt="hello", max_tokens=POSITIONS - 8, temperature=0,
                                         stream=True) for _ in range(SLOTS - 1)]
    whole = _post_and_go(server, {"prompt": "hello", "max_tokens": POSITIONS - 8, "temperature": 0})
    deadline = time.time() + CALL_S
    while _metrics(server)["mk_live_slots"] != SLOTS:
        assert time.time() < deadline   # (the streams' first chunk comes before their prefill)
        time.sleep(0.2)
    waiting = [threading.Thread(target=lambda: client.completions.create(model="tiny", prompt="cat", max_tokens=1))
               for _ in range(QUEUE)]
    for w in waiting:
        w.start()
    deadline = time.time() + CALL_S
    while _metrics(server)["mk_queue_depth"] != QUEUE:
        assert time.time() < deadline
        time.sleep(0.2)
    code, answer, headers = _post(server, "/v1/completions", {"prompt": "cat", "max_tokens": 2})
    assert code == 429 and headers.get("retry-after") == "1" and answer["error"]["type"] == "rate_limit_error"
    for s in streams:
        s.close()
    whole.close()
    for w in waiting:
        w.join(CALL_S)
        assert not w.is_alive()
    r = client.completions.create(model="tiny", prompt="cat", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    after = _metrics(server)
    grew = {k: after[k] - before.get(k, 0) for k in after if k.endswith("_total") or k.endswith("_count")}
    assert grew["mk_requests_rejected_total"] == 1 and grew["mk_requests_cancelled_total"] == SLOTS, grew
    assert grew["mk_requests_finished_total"] == QUEUE + 1, grew
    assert grew["mk_time_to_first_token_seconds_count"] == SLOTS + QUEUE + 1, grew
    assert after["mk_live_slots"] == 0 and after["mk_queue_depth"] == 0, after


def _metrics(server) -> dict[str, float]:
    """/metrics' samples without labels, by name."""
    text = urllib.request.urlopen(server + "/metrics", timeout=10).read().decode()
    return {name: float(value) for name, value in (line.split() for line in text.splitlines()
                                                     if line and not line.startswith("#") and "{" not in line)}


def test_the_readme_s_client_snippet_and_curl_line_run_against_the_server(server, capsys):
    """The README's serve examples, pointed at this server: the openai snippet streams the
    chat reply; the curl line's body is a valid completion request."""
    import re

    from tests.test_readme import README, SERVE_SNIPPETS, SERVED

    for snippet in SERVE_SNIPPETS:
        # (this server's cache is small, and the interpreter slow: a shorter reply)
        short = re.sub(r"max_tokens=\d+", "max_tokens=4", snippet.replace(SERVED, server))
        exec(compile(short, "README.md serve example", "exec"), {})
    assert capsys.readouterr().out.endswith("\n")
    (body,) = re.findall(r"-d '(\{.*?\})'", README.read_text())
    request = dict(json.loads(body), model="tiny", prompt="hello", max_tokens=2)
    code, answer, _ = _post(server, "/v1/completions", request)
    assert code == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length"), answer


@pytest.mark.parametrize("flags, env, words", [
    (["--max-batch", "0"], {}, "--max-batch must be in [1, "),
    (["--port", "70000"], {}, "--port must be in [1, 65535]"),
    (["--max-queue", "0"], {}, "--max-queue must be >= 1"),
    (["--prefill-chunk", "0"], {}, "--prefill-chunk must be >= 1"),
    ([], {"WORLD_SIZE": "2"}, "serving a tensor-parallel model (torchrun) is not built"),
    (["--host", "no.such.host.invalid"], {}, "--host 'no.such.host.invalid'"),
])
def test_serve_refuses_bad_flags_in_one_line_before_loading(checkpoint, capsys, monkeypatch, no_model, flags, env,
                                                           words):
    from mk.__main__ import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", "--model", str(checkpoint[0])] + flags) == 1
    err = capsys.readouterr().err
    assert err.startswith("mk: error: ") and words in err and len(err.strip().splitlines()) == 1, err


def test_serve_refuses_a_port_in_use(checkpoint, capsys, no_model):
    from mk.__main__ import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", "--model", str(checkpoint[0]), "--port", str(s.getsockname()[1])]) == 1
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_ctrl_c_answers_the_waiting_requests_and_stops_cleanly(served):
    """Last (it stops the module's server): SIGINT while a request not streamed decodes; it
    is answered with a 503 in OpenAI's shape within the graceful-shutdown bound, and the
    server exits as an interrupted command does (130), with no traceback."""
    import signal

    base, proc = served
    result = {}

    def wait():
        result["answer"] = _post(base, "/v1/completions", {"prompt": "hello", "max_tokens": POSITIONS - 8})

    t = threading.Thread(target=wait)
    t.start()
    deadline = time.time() + CALL_S
    while _metrics(base)["mk_live_slots"] != 1:
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    t.join(CALL_S)
    code, answer, _ = result["answer"]
    assert code == 503 and answer["error"]["message"] == "the server is shutting down", answer
    out, _ = proc.communicate(timeout=CALL_S)
    assert proc.returncode == 130 and "Traceback" not in out and out.rstrip().endswith("mk: interrupted"), out
