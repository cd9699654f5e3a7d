"""The OpenAI API's request bodies that ``mk serve`` reads (pydantic models), and the fields
it refuses: a field the API has and mk does not support, or one the API does not have, is a
400 naming it (never silently ignored)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mk.engine.scheduler import MAX_LOGPROBS

#: The most stop sequences a request may give (as OpenAI's API).
MAX_STOP = 4


class Unsupported(ValueError):
    """A request asks for something mk does not do; ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


#: Every body is read strictly: a string is not a boolean, nor true a number.
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: Union[str, list[Union[str, int]], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Fields of the API mk takes only at their neutral value.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _neutral(self):
        if self.n != 1:
            raise Unsupported("n", f"n={self.n}: mk returns one choice a prompt (n must be 1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise Unsupported(name, f"{name} is not supported (it must be 0)")
        if self.logit_bias:
            raise Unsupported("logit_bias", "logit_bias is not supported")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise Unsupported("stop", f"stop: at most {MAX_STOP} sequences, got {len(stops)}")
        if any(s == "" for s in stops):
            raise Unsupported("stop", "stop: an empty string stops nothing")
        if any(isinstance(s, int) and s < 0 for s in stops):
            raise Unsupported("stop", "stop: a token id must be >= 0")
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options is only for stream=true")
        return self

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if isinstance(s, str)]

    def stop_ids(self) -> list[int]:
        return [s for s in (self.stop if isinstance(self.stop, list) else []) if isinstance(s, int)]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int = 1
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_only(self):
        if self.best_of != 1:
            raise Unsupported("best_of", f"best_of={self.best_of}: not supported (it must be 1)")
        if self.suffix:
            raise Unsupported("suffix", "suffix (insertion) is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise Unsupported("prompt", "prompt is an empty list")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """Each prompt: a text or a list of ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _chat_only(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise Unsupported("max_completion_tokens", "max_tokens and max_completion_tokens differ; give one")
        return self

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
