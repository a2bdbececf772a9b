"""The OpenAI wire format: request bodies (pydantic, strict types, so a wrong type names its field),
error bodies, and the response and stream-chunk objects of /v1/completions and /v1/chat/completions.

Owns: what the JSON looks like, and turning a body's sampling fields into a `SamplingParams`
(whose own validation decides the allowed ranges; its error names the field, which becomes the
error body's `param`). Unknown fields are ignored, as OpenAI's API does.

Must not know: the engine, threads, tensors.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from specav.config import ConfigError, SamplingParams
from specav.request import TokenLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the target rules out reports this (as vLLM does)


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}


# ---- request bodies ----------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """The fields both routes share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM's); -1 and 0 mean off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # an extension (vLLM's)
    user: str | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n = {self.n} is not supported: specav returns one choice per request (n = 1); "
                                "send several requests instead", "n")

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise ApiError(400, f"logprobs = {self.logprobs} is invalid: allowed an integer in [0, 5]", "logprobs")

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"got {len(prompt)} prompts: specav takes one prompt per request", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt is empty: give at least one token of text", "prompt")
        return prompt


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise ApiError(400, "messages is empty: give at least one message", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# ---- sampling parameters ---------------------------------------------------------------------------

_FIELD = re.compile(r"^SamplingParams\.(\w+)")


def sampling_params(body: _SamplingBody, max_tokens: int, logprobs: int | None,
                    max_tokens_field: str = "max_tokens", logprobs_field: str = "logprobs") -> SamplingParams:
    """The body's sampling fields as SamplingParams (defaults from SamplingParams where absent)."""
    defaults = SamplingParams()
    values = dict(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=0 if body.top_k in (None, -1) else body.top_k,
        max_tokens=max_tokens, seed=body.seed,
        stop=() if body.stop is None else ((body.stop,) if isinstance(body.stop, str) else tuple(body.stop)),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias), logprobs=logprobs)
    try:
        return SamplingParams(**values)
    except ConfigError as e:
        match = _FIELD.match(str(e))
        name = match.group(1) if match else None
        param = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}.get(name, name)
        message = str(e).replace(f"SamplingParams.{name}", param, 1) if name else str(e)
        raise ApiError(400, message, param) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not key.strip().isdigit():
            raise ApiError(400, f"logit_bias key {key!r} is not a token id (a non-negative integer)", "logit_bias")
        out[int(key)] = value
    return out


# ---- responses -------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(request_id: str, model: str, text: str, finish_reason: str | None,
                        logprobs: dict | None, use: dict, created: int | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": use}


def completion_chunk(request_id: str, model: str, created: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None, with_usage: bool = False) -> dict[str, Any]:
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_response(request_id: str, model: str, text: str, finish_reason: str | None, logprobs: dict | None,
                  use: dict, created: int | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(request_id: str, model: str, created: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None, with_usage: bool = False) -> dict[str, Any]:
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, model: str, created: int, kind: str, use: dict) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": [], "usage": use}


def _logprob(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


def completion_logprobs(tokens: list[TokenLogprob], decode, offset: int) -> dict[str, Any]:
    """The completions format: parallel lists, text offsets counted from `offset` characters."""
    texts = [decode(t.token_id) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": [_logprob(t.logprob) for t in tokens],
            "top_logprobs": [{decode(i): _logprob(v) for i, v in t.top} for t in tokens], "text_offset": offsets}


def chat_logprobs(tokens: list[TokenLogprob], decode, top: bool, to_bytes) -> dict[str, Any]:
    """The chat format: one entry per token, with its own bytes and its most likely alternatives."""
    def entry(token_id: int, value: float) -> dict[str, Any]:
        return {"token": decode(token_id), "logprob": _logprob(value), "bytes": list(to_bytes(token_id))}

    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, v) for i, v in t.top] if top else []} for t in tokens]}
