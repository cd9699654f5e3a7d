"""The HTTP side of ``mk serve``: OpenAI's completions, chat completions and models endpoints,
health and Prometheus metrics, over a :class:`~mk.engine.scheduler.Scheduler`.

Each HTTP request becomes one scheduler request a prompt. The scheduler's thread hands
their tokens to the event loop (``call_soon_threadsafe``); a handler turns them into text
(:class:`~mk.serve.text.StopText`), and answers once they are done, or streams them as
server-sent events ending in ``data: [DONE]``. Every wait is bounded: a handler checks, at
least every :data:`POLL_S` seconds, that its client is still there (else its requests are
cancelled, and their slots go back within one block) and that the scheduler still runs.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mk.engine.scheduler import QueueFull, Request
from mk.generate import TextStreamer
from mk.models.decoder import MIN_TEMPERATURE

from .protocol import ChatRequest, CompletionRequest, Unsupported
from .text import StopText

#: Seconds between a waiting handler's checks of its client and of the scheduler.
POLL_S = 0.25
#: ``max_tokens`` of a completion that gives none (as OpenAI's API).
DEFAULT_COMPLETION_TOKENS = 16
#: Seconds a client is told to wait before retrying when the queue is full.
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error the API answers with its status and OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.status}}, status_code=self.status, headers=self.headers)


class Gone(Exception):
    """The client went away."""


class _CountResponses:
    """Counts responses by path and status for /metrics. A plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` (``@app.middleware``) would keep a handler from ever seeing its
    client's disconnect, and a non-streamed request would then decode to its end for no one.
    A path the app does not serve counts as ``other`` (the label set stays bounded); an
    exception counts as the 500 the server's outermost layer answers it with."""

    def __init__(self, app, counts: dict, routes: list):
        self.app, self.counts, self.routes = app, counts, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if any(getattr(r, "path", None) == scope["path"] for r in self.routes) else "other"
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self._count(path, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:
                self._count(path, 500)
            raise

    def _count(self, path: str, status: int) -> None:
        self.counts[(path, status)] = self.counts.get((path, status), 0) + 1


def create_app(scheduler, tokenizer, name: str) -> FastAPI:
    """The server's app: ``scheduler`` (started) serves the requests; ``tokenizer`` (a
    :class:`~mk.models.tokenizer.Tokenizer`) reads and writes their text; ``name`` is the
    model's id in the API."""
    app = FastAPI(title="mk", description="mk's OpenAI-compatible server", docs_url=None, redoc_url=None)
    model = scheduler.model
    created = int(time.time())
    eos = frozenset(tokenizer.eos_token_ids or model.config.eos_token_ids)
    http_counts: dict[tuple[str, int], int] = {}
    app.add_middleware(_CountResponses, counts=http_counts, routes=app.router.routes)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: HttpRequest, e: StarletteHTTPException):  # 404, 405: OpenAI's shape too
        return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                        headers=getattr(e, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(_, e: RequestValidationError):
        return _validation_error(e).response()

    @app.exception_handler(Exception)
    async def internal(_, e: Exception):  # a defect of mk's: still OpenAI's shape, and the server goes on
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error").response()

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            raise ApiError(503, f"the scheduler is not running ({scheduler.failed or 'stopped'})", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "mk",
                                            "max_model_len": model.max_seq_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_prometheus(scheduler, http_counts), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        _check_request(body, name, model.config.vocab_size)
        prompts = []
        for p in body.prompts():
            ids = _encode(tokenizer, p, "prompt") if isinstance(p, str) else p
            prompts.append(ids)
        budget = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
        reqs = [_request(body, ids, budget, eos, logprobs=body.logprobs,
                         prompt_logprobs=body.echo and body.logprobs is not None) for ids in prompts]
        return await _serve(scheduler, tokenizer, http, body, reqs, "text_completion", name, echo=body.echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest):
        _check_request(body, name, model.config.vocab_size)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in body.messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        budget = body.token_budget()
        if budget is None:  # as OpenAI's API: up to what the context holds
            if len(ids) >= model.max_seq_len:
                raise ApiError(400, f"the conversation is {len(ids)} tokens with the chat template: it leaves no "
                               f"room for a reply in the {model.max_seq_len} positions a request may use",
                               param="messages")
            budget = model.max_seq_len - len(ids)
        req = _request(body, ids, budget, eos, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        return await _serve(scheduler, tokenizer, http, body, [req], "chat.completion", name)

    return app


def _validation_error(e: RequestValidationError) -> ApiError:
    """The first of pydantic's errors as one line naming the field."""
    errors = e.errors()
    err = errors[0]
    ctx = err.get("ctx") or {}
    if isinstance(ctx.get("error"), Unsupported):
        return ApiError(400, str(ctx["error"]), param=ctx["error"].param)
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if not loc and err.get("type") == "model_attributes_type":  # the body as a whole
        if isinstance(err.get("input"), (bytes, str)):  # (not parsed: no JSON content type)
            return ApiError(400, "the body was not read as JSON: send it with Content-Type: application/json")
        return ApiError(400, f"the body must be a JSON object, got {_json_type(err.get('input'))}")
    # A field of several accepted types fails once for each, its loc ending in the type's
    # name ("str", "list[int]", "TextPart"), where sibling fields' locs end in field names.
    tags = [str(x["loc"][-1]) for x in errors if tuple(x["loc"][:-1]) == tuple(err["loc"][:-1])]
    if len(tags) > 1 and all(_is_type_tag(t) for t in tags):
        field = ".".join(loc[:-1])
        return ApiError(400, f"{field}: got {_json_type(err.get('input'))}; it must be one of {', '.join(tags)}",
                        param=field)
    field = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return ApiError(400, f"unsupported field {field!r}: mk does not support it", param=field)
    if err.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err.get('msg')}")
    if err.get("type") == "missing":
        return ApiError(400, f"missing field {field!r}", param=field)
    return ApiError(400, f"{field}: {err.get('msg')}" if field else str(err.get("msg")), param=field)


def _is_type_tag(tag: str) -> bool:
    """Whether a pydantic error's last loc item names one type of a union (not a field: the
    request models' fields are lowercase words, none a type's name)."""
    return tag in ("str", "int", "float", "bool", "none") or "[" in tag or tag[:1].isupper()


def _json_type(value) -> str:
    """A value's JSON type, as a client wrote it."""
    for t, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"),
                    (list, "an array"), (dict, "an object")):
        if isinstance(value, t):
            return name
    return "null" if value is None else type(value).__name__


def _check_request(body, name: str, vocab_size: int) -> None:
    """What a body asks that this server's model cannot: another model, a stop id past its vocabulary."""
    if body.model is not None and body.model != name:
        raise ApiError(404, f"the model {body.model!r} does not exist here: this server serves {name!r}",
                       param="model")
    bad = [t for t in body.stop_ids() if t >= vocab_size]
    if bad:
        raise ApiError(400, f"stop: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="stop")


def _encode(tokenizer, text: str, param: str) -> list[int]:
    ids = tokenizer.encode(text)
    if not ids:
        raise ApiError(400, f"{param}: the text gives no tokens", param=param)
    return ids


def _request(body, ids: list[int], budget: int, eos: frozenset, logprobs: int | None = None,
             prompt_logprobs: bool = False) -> Request:
    """A scheduler request for ``ids`` under ``body``'s sampling fields."""
    greedy = body.temperature < MIN_TEMPERATURE
    return Request(prompt=ids, max_tokens=budget, emit=None, temperature=0.0 if greedy else body.temperature,
                   top_k=None if greedy else body.top_k, top_p=None if greedy else body.top_p,
                   seed=secrets.randbits(63) if body.seed is None else body.seed,
                   stop_ids=eos | frozenset(body.stop_ids()), logprobs=logprobs, prompt_logprobs=prompt_logprobs)


async def _serve(scheduler, tokenizer, http: HttpRequest, body, reqs: list[Request], kind: str, name: str,
                 echo: bool = False):
    """Submit ``reqs`` and answer: one JSON body, or with ``body.stream`` an event stream."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    for i, r in enumerate(reqs):
        r.emit = lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, ev))
    try:
        for k, r in enumerate(reqs):
            scheduler.submit(r)
    except QueueFull as e:
        for r in reqs[:k]:
            r.cancelled = True
        raise ApiError(429, f"the server is busy ({e}); retry later", "rate_limit_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ValueError as e:
        for r in reqs[:k]:
            r.cancelled = True
        raise ApiError(400, f"prompt {k}: {e}" if len(reqs) > 1 else str(e), param="prompt") from None
    answer = _Answer(tokenizer, body, reqs, kind, name, echo)
    if body.stream:
        return StreamingResponse(_stream(scheduler, http, events, answer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        while not answer.done():
            i, ev = await _next(scheduler, http, events)
            answer.take(i, ev)
    except Gone:
        answer.cancel()
        return JSONResponse({}, status_code=499)
    except BaseException:
        answer.cancel()
        raise
    if answer.failed:
        raise ApiError(500, answer.failed, "server_error")
    return answer.response_body()


async def _next(scheduler, http: HttpRequest, events: asyncio.Queue):
    """The next event of the request's scheduler requests (bounded waits: the client and the
    scheduler are checked every :data:`POLL_S` seconds)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                raise Gone() from None
            if not scheduler.alive:
                if scheduler.failed:
                    raise ApiError(500, f"the scheduler stopped ({scheduler.failed})", "server_error") from None
                raise ApiError(503, "the server is shutting down", "server_error") from None


async def _stream(scheduler, http: HttpRequest, events: asyncio.Queue, answer: "_Answer"):
    """Server-sent events: each piece of text as it comes, each choice's finish, usage if
    asked for, then ``[DONE]``. An error mid-stream is sent as an ``error`` event."""
    try:
        yield _sse(answer.chunk_start())
        while not answer.done():
            i, ev = await _next(scheduler, http, events)
            for chunk in answer.take(i, ev):
                yield _sse(chunk)
        if answer.failed:
            yield _sse({"error": {"message": answer.failed, "type": "server_error", "param": None, "code": 500}})
        elif answer.usage_wanted:
            yield _sse(answer.chunk_usage())
        yield "data: [DONE]\n\n"
    except (Gone, asyncio.CancelledError, GeneratorExit):
        answer.cancel()
        raise
    except ApiError as e:
        answer.cancel()
        yield _sse({"error": {"message": str(e), "type": e.kind, "param": None, "code": e.status}})
        yield "data: [DONE]\n\n"
    finally:
        answer.cancel()  # (no-op for requests that finished)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Answer:
    """One HTTP request's choices as their events arrive: text, logprobs, finish reasons,
    usage; the JSON body or the stream's chunks."""

    def __init__(self, tokenizer, body, reqs: list[Request], kind: str, name: str, echo: bool):
        self.tok, self.body, self.reqs, self.kind, self.name, self.echo = tokenizer, body, reqs, kind, name, echo
        self.chat = kind == "chat.completion"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        stops = body.stop_strings()
        self.texts = [StopText(tokenizer, r.prompt, stops) for r in reqs]
        self.pieces = [[] for _ in reqs]    # text pieces sent / to send
        self.tokens = [[] for _ in reqs]    # (id, logprob entry) of each completion token kept
        self.starts = [[] for _ in reqs]    # where each kept token's text starts in the completion text
        self.prompt_lps = [None for _ in reqs]
        self.finish = [None for _ in reqs]
        # A JSON body is built once at the end: only a stream makes chunks as tokens come.
        self.streamed = bool(body.stream)
        self.failed: str | None = None
        opts = body.stream_options
        self.usage_wanted = bool(opts and opts.include_usage)

    def done(self) -> bool:
        return self.failed is not None or all(f is not None for f in self.finish)

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancelled = True

    def take(self, i: int, ev: tuple) -> list[dict]:
        """Record event ``ev`` of choice ``i``; the stream chunks it makes (none when the
        answer is one JSON body)."""
        if self.finish[i] is not None or self.failed is not None:
            return []
        what = ev[0]
        if what == "prompt_logprobs":
            self.prompt_lps[i] = ev[1]
            return []
        if what == "error":
            self.failed = ev[1]
            self.cancel()
            return []
        if what == "tokens":
            text, kept, stopped = [], [], False
            for token, lp in zip(ev[1], ev[2]):
                self.starts[i].append(len(self.texts[i].text))  # (its logprobs' text_offset)
                piece, stopped = self.texts[i].put(token)
                text.append(piece)
                kept.append((token, lp))
                if stopped:
                    break
            self.tokens[i] += kept
            lps = [lp for _, lp in kept] if kept[0][1] is not None else None
            if stopped:
                self.reqs[i].cancelled = True   # its slot goes back at the next boundary
                self.finish[i] = "stop"
            if not (self.streamed and (any(text) or lps or stopped)):
                return []
            return [self._chunk(i, "".join(text), kept if lps else None, self.finish[i])]
        # "done": the scheduler stopped it (a stop id: "stop"; max_tokens: "length").
        piece = self.texts[i].end()
        self.finish[i] = "stop" if self.texts[i].stopped else ev[1]
        return [self._chunk(i, piece, None, self.finish[i])] if self.streamed else []

    # ------------------------------------------------------------------ shapes

    def _token_text(self, token: int) -> str:
        return self.tok.decode([token], skip_special_tokens=False)

    def _logprobs_completion(self, entries: list, offsets: list[int]) -> dict:
        """OpenAI's completion logprobs of ``entries`` [(id, (logprob, top) or None)] whose
        text starts at ``offsets`` in the choice's text."""
        return {"tokens": [self._token_text(token) for token, _ in entries],
                "token_logprobs": [None if lp is None else lp[0] for _, lp in entries],
                "top_logprobs": [None if lp is None else {self._token_text(t): v for t, v in lp[1]}
                                 for _, lp in entries],
                "text_offset": offsets}

    def _completion_offsets(self, i: int, starts: list[int]) -> list[int]:
        """Completion text ``starts`` of choice ``i`` as offsets in the text it returns
        (after the prompt's, with echo)."""
        base = len(self.texts[i].streamer.prompt_text) if self.echo else 0
        return [base + s for s in starts]

    def _logprobs_chat(self, entries: list) -> dict:
        def one(token, logprob):
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [dict(one(t, lp[0]), top_logprobs=[one(a, v) for a, v in lp[1]]) for t, lp in entries]}

    def _chunk(self, i: int, text: str, entries: list | None, finish: str | None) -> dict:
        """A stream chunk of choice ``i``: its new ``text``, its tokens' logprobs (``entries``:
        [(id, logprob)], or None), its finish reason once it has one."""
        if self.chat:
            choice = {"index": i, "delta": {"content": text} if text else {}, "finish_reason": finish,
                      "logprobs": self._logprobs_chat(entries) if entries else None}
        else:
            lps = None
            if entries:
                starts = self.starts[i][len(self.tokens[i]) - len(entries):]
                lps = self._logprobs_completion(entries, self._completion_offsets(i, starts))
            choice = {"index": i, "text": text, "finish_reason": finish, "logprobs": lps}
        return {"id": self.id, "object": self.kind + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.name, "choices": [choice]}

    def chunk_start(self) -> dict:
        """The stream's first chunk: chat's assistant role; a completion's echoed prompt."""
        if self.chat:
            choices = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                        "logprobs": None}]
        else:
            choices = [{"index": i, "text": self.texts[i].streamer.prompt_text if self.echo else "",
                        "finish_reason": None, "logprobs": None} for i in range(len(self.reqs))]
        return {"id": self.id, "object": self.kind + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.name, "choices": choices}

    def usage(self) -> dict:
        prompt = sum(len(r.prompt) for r in self.reqs)
        completion = sum(len(t) for t in self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk_usage(self) -> dict:
        return {"id": self.id, "object": self.kind + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.name, "choices": [], "usage": self.usage()}

    def response_body(self) -> dict:
        """The whole answer (not streamed)."""
        choices = []
        for i, r in enumerate(self.reqs):
            text = self.texts[i].text
            entries = self.tokens[i]
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": self.finish[i],
                                "logprobs": self._logprobs_chat(entries) if r.logprobs is not None else None})
                continue
            lps = None
            if r.logprobs is not None:
                offsets = self._completion_offsets(i, self.starts[i])
                if self.echo:
                    entries = list(zip(r.prompt, self.prompt_lps[i] or [None] * len(r.prompt))) + entries
                    offsets = _prompt_offsets(self.tok, r.prompt) + offsets
                end = len(self.texts[i].streamer.prompt_text if self.echo else "") + len(text)
                lps = self._logprobs_completion(entries, [min(o, end) for o in offsets])  # (past a stop string)
            choices.append({"index": i, "text": (self.texts[i].streamer.prompt_text if self.echo else "") + text,
                            "finish_reason": self.finish[i], "logprobs": lps})
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.name,
                "choices": choices, "usage": self.usage()}


def _prompt_offsets(tokenizer, prompt: list[int]) -> list[int]:
    """Where each prompt token's text starts in the prompt's text (echo's ``text_offset``),
    decoded as a completion's is: a token that begins a character it does not end (the UTF-8
    bytes of a byte-level vocabulary) stands at that character's start, as does the one that
    ends it; a special token takes no characters."""
    text, at, out = TextStreamer(tokenizer), 0, []
    for token in prompt:
        out.append(at)
        at += len(text.put(token))
    return out


def _prometheus(scheduler, http_counts: dict) -> str:
    """The scheduler's and the HTTP side's figures in Prometheus' text format."""
    counts, gauges, durations = scheduler.metrics.snapshot()
    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]):
        lines.append(f"# HELP mk_{name} {help_}")
        lines.append(f"# TYPE mk_{name} {kind}")
        lines.extend(f"mk_{name}{labels} {value}" for labels, value in samples)

    for key, help_ in (("received", "requests accepted into the queue"), ("rejected", "requests refused (queue full)"),
                       ("finished", "requests that finished"), ("failed", "requests that failed"),
                       ("cancelled", "requests cancelled (client gone or a stop string)")):
        metric(f"requests_{key}_total", "counter", help_, [("", counts.get(key, 0))])
    metric("prompt_tokens_total", "counter", "prompt tokens prefilled", [("", counts.get("prompt_tokens", 0))])
    metric("generated_tokens_total", "counter", "tokens generated", [("", counts.get("generated_tokens", 0))])
    metric("queue_depth", "gauge", "requests waiting for a slot", [("", gauges.get("queue_depth", 0))])
    metric("live_slots", "gauge", "slots decoding now", [("", gauges.get("live_slots", 0))])
    n, total, recent = durations.get("time_to_first_token_s", (0, 0.0, []))
    metric("time_to_first_token_seconds", "summary", "from arrival to the first token (quantiles: recent requests)",
           [(f'{{quantile="{q}"}}', recent[min(int(q * len(recent)), len(recent) - 1)] if recent else float("nan"))
            for q in (0.5, 0.9, 0.99)] + [("_sum", total), ("_count", n)])
    _, decode_s, _ = durations.get("decode_s", (0, 0.0, []))
    metric("decode_seconds_total", "counter", "seconds decode blocks ran", [("", decode_s)])
    metric("decode_tokens_per_second", "gauge", "tokens decoded per second of decode blocks (all slots)",
           [("", counts.get("decoded_tokens", 0) / decode_s if decode_s else 0.0)])
    metric("http_responses_total", "counter", "HTTP responses by path and status",
           [(f'{{path="{p}",status="{s}"}}', v) for (p, s), v in sorted(http_counts.items())])
    return "\n".join(lines) + "\n"
