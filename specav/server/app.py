"""The OpenAI-compatible HTTP API (FastAPI): routes, streaming, errors, authentication.

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events in the
OpenAI chunk format, ending with `data: [DONE]`, or answered whole), GET /v1/models, /health and
/metrics. With an API key configured, every route but /health needs `Authorization: Bearer KEY`.

Owns: checking a request before it reaches the engine (model name, prompt, context window,
types and ranges, each error a 4xx with an OpenAI-style body whose `param` names the field),
handing it to the engine loop (engine_loop.py: 429 when the server is full), turning its step
outputs into responses or stream chunks, and noticing a client that goes away (its request is
aborted, which frees its caches). Handlers only await queues: the engine runs on its own thread.

Must not know: tensors, how the engine steps.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specav.config import SamplingParams, ServerConfig
from specav.detokenize import token_bytes
from specav.prompts import encode_prompt, has_chat_template
from specav.request import FinishReason, StepOutput, TokenLogprob
from specav.server import estimator_state, protocol
from specav.server.engine_loop import EngineLoop, Overloaded, Refused
from specav.server.metrics import ServerMetrics
from specav.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest

log = logging.getLogger("specav.server")

DISCONNECT_POLL_SECONDS = 0.5  # how often a non-streaming handler checks that its client is still there
STOP_TIMEOUT_SECONDS = 60.0  # how long shutdown waits for the engine's current step


@dataclass(slots=True)
class _Tracker:
    """One request's timings and token counts, for metrics and usage."""

    metrics: ServerMetrics
    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    last: float | None = None
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def on_output(self, output: StepOutput) -> None:
        now = time.perf_counter()
        n = len(output.new_token_ids)
        if n:
            if self.last is None:
                self.metrics.on_first_token(now - self.arrival)
            else:
                self.metrics.on_tokens(now - self.last, n)
            self.last = now
        self.completion_tokens += n
        self.logprobs.extend(output.new_logprobs or [])
        if output.finished:
            self.metrics.on_finished(str(output.finish_reason), self.prompt_tokens, self.completion_tokens,
                                     now - self.arrival)

    def usage(self) -> dict[str, int]:
        return protocol.usage(self.prompt_tokens, self.completion_tokens)


def build_app(engine, config: ServerConfig = ServerConfig(), model: str = "default",
              state_identity: dict | None = None) -> FastAPI:
    """The app around an engine; starting it (its lifespan) starts the engine thread, stopping it
    stops the thread and saves the estimator's state when `config.estimator_state` is set."""
    names = list(config.served_model_name or (model,))
    metrics = ServerMetrics(engine.num_slots, engine.scorer)
    engine.step_listeners.append(metrics.on_step)
    loop = EngineLoop(engine, engine.config.max_batch_size + config.max_queued_requests,
                      on_idle=lambda: metrics.on_queue(len(engine.scheduler.waiting), len(engine.scheduler.running)))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        log.info("specav: serving %s on the engine thread (max %d running, %d queued)", names,
                 engine.config.max_batch_size, config.max_queued_requests)
        yield
        await asyncio.to_thread(loop.stop, STOP_TIMEOUT_SECONDS)
        if config.estimator_state and engine.scorer is not None and state_identity is not None:
            path = estimator_state.save(config.estimator_state, engine.scorer, state_identity)
            log.info("specav: saved the estimator's state to %s", path)

    app = FastAPI(title="specav", lifespan=lifespan)
    app.state.engine_loop, app.state.metrics, app.state.engine = loop, metrics, engine
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    _add_error_handlers(app, metrics)
    api = _Api(engine, loop, metrics, names)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await api.completion(body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        return await api.chat(body, http)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "specav",
                                            "max_model_len": engine.max_positions} for n in names]}

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _Api:
    """The two generation routes, sharing everything but their wire format."""

    def __init__(self, engine, loop: EngineLoop, metrics: ServerMetrics, names: Sequence[str]) -> None:
        self.engine, self.loop, self.metrics, self.names = engine, loop, metrics, list(names)
        self.tokenizer = engine.tokenizer

    # ---- checks ------------------------------------------------------------------------------

    def _model(self, name: str | None) -> str:
        if name is None:
            return self.names[0]
        if name not in self.names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.names}", "model",
                           code="model_not_found")
        return name

    def _params(self, body, prompt_ids: list[int], prompt_field: str, max_tokens: int | None, max_field: str,
                logprobs: int | None, logprobs_field: str) -> SamplingParams:
        context = self.engine.max_positions
        if len(prompt_ids) >= context:
            raise ApiError(400, f"the prompt is {len(prompt_ids)} tokens, but the context window is {context} "
                                "tokens (prompt and output together): shorten the prompt", prompt_field)
        room = context - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(SamplingParams().max_tokens, room)
        elif max_tokens > room:
            raise ApiError(400, f"{max_field} = {max_tokens} does not fit: the prompt is {len(prompt_ids)} tokens "
                                f"and the context window {context}, so {max_field} may be at most {room}", max_field)
        params = protocol.sampling_params(body, max_tokens, logprobs, max_field, logprobs_field)
        outside = [t for t, _ in params.logit_bias if t >= self.engine.vocab_size]
        if outside:
            raise ApiError(400, f"logit_bias token ids {outside} are outside the vocabulary "
                                f"(size {self.engine.vocab_size})", "logit_bias")
        return params

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise ApiError(400, "prompt is empty after tokenization", "prompt")
            return ids
        bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary "
                                f"(size {self.engine.vocab_size})", "prompt")
        return list(prompt)

    # ---- routes --------------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, http: Request):
        model = self._model(body.model)
        body.check_supported()
        prompt_ids = self._prompt_ids(body.single_prompt())
        params = self._params(body, prompt_ids, "prompt", body.max_tokens, "max_tokens", body.logprobs, "logprobs")
        fmt = _CompletionFormat(model, self._decode, body.logprobs is not None)
        return await self._respond(f"cmpl-{uuid.uuid4().hex}", prompt_ids, params, body, fmt, http)

    async def chat(self, body: ChatCompletionRequest, http: Request):
        model = self._model(body.model)
        body.check_supported()
        if not has_chat_template(self.tokenizer):
            raise ApiError(400, "this model has no chat template: use /v1/completions with a plain prompt", "messages")
        try:
            prompt_ids = encode_prompt(self.tokenizer, messages=body.conversation())
        except Exception as e:  # the template's own checks (role order, ...)
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
        max_tokens, field = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                             is not None else (body.max_tokens, "max_tokens"))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, prompt_ids, "messages", max_tokens, field, logprobs, "top_logprobs")
        fmt = _ChatFormat(model, self._decode, body.logprobs, body.top_logprobs is not None, self._bytes)
        return await self._respond(f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, params, body, fmt, http)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> bytes:
        return token_bytes(self.tokenizer, token_id)

    async def _respond(self, request_id: str, prompt_ids: list[int], params: SamplingParams, body, fmt, http):
        tracker = _Tracker(self.metrics, len(prompt_ids))
        try:
            outputs = self.loop.submit(request_id, prompt_ids, params)
        except Overloaded as e:
            raise ApiError(429, str(e)) from None
        if body.stream:
            events = self._stream(request_id, outputs, tracker, fmt, body.include_usage_in_stream())
            return StreamingResponse(events, media_type="text/event-stream")
        return await self._whole(request_id, outputs, tracker, fmt, http)

    async def _whole(self, request_id: str, outputs: asyncio.Queue, tracker: _Tracker, fmt, http: Request):
        text, finished, next_check = "", False, time.monotonic() + DISCONNECT_POLL_SECONDS
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(outputs.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    item = None
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
                    if await http.is_disconnected():
                        self.loop.abort(request_id)
                        return Response(status_code=499)
                if item is None:
                    continue
                _raise_if_failed(item)
                tracker.on_output(item)
                text, finished = item.text, item.finished
        finally:
            self.loop.release(request_id)
        return JSONResponse(fmt.response(request_id, text, str(item.finish_reason), tracker))

    async def _stream(self, request_id: str, outputs: asyncio.Queue, tracker: _Tracker, fmt,
                      include_usage: bool) -> AsyncIterator[str]:
        created, done = int(time.time()), False
        try:
            first = fmt.first_chunk(request_id, created, include_usage)
            if first is not None:
                yield _sse(first)
            while not done:
                item = await outputs.get()
                try:
                    _raise_if_failed(item)
                except ApiError as e:
                    yield _sse(e.body())
                    break
                tracker.on_output(item)
                done = item.finished
                if item.new_text or item.new_logprobs or done:
                    reason = str(item.finish_reason) if done else None
                    yield _sse(fmt.chunk(request_id, created, item, reason, include_usage))
            if done and include_usage:
                yield _sse(protocol.usage_chunk(request_id, fmt.model, created, fmt.chunk_object, tracker.usage()))
            yield "data: [DONE]\n\n"
            done = True
        finally:
            self.loop.release(request_id)
            if not done:
                self.loop.abort(request_id)  # the client went away mid-stream: free its request and caches


def _raise_if_failed(item: StepOutput | Refused) -> None:
    if isinstance(item, Refused):
        raise ApiError(400, item.message)
    if item.finish_reason == FinishReason.ERROR:
        raise ApiError(500, item.error or f"request {item.request_id} failed")
    if item.finish_reason == FinishReason.ABORT:
        raise ApiError(503, f"request {item.request_id} was aborted: the server is shutting down")


def _sse(payload: dict[str, Any]) -> str:
    import json

    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _CompletionFormat:
    chunk_object = "text_completion"

    def __init__(self, model: str, decode: Callable[[int], str], logprobs: bool) -> None:
        self.model, self.decode, self.logprobs = model, decode, logprobs
        self.offset = 0

    def first_chunk(self, request_id: str, created: int, include_usage: bool) -> dict | None:
        return None

    def chunk(self, request_id: str, created: int, item: StepOutput, reason: str | None, include_usage: bool) -> dict:
        logprobs = None
        if self.logprobs:
            logprobs = protocol.completion_logprobs(item.new_logprobs or [], self.decode, self.offset)
        self.offset += len(item.new_text)
        return protocol.completion_chunk(request_id, self.model, created, item.new_text, reason, logprobs,
                                         include_usage)

    def response(self, request_id: str, text: str, reason: str, tracker: _Tracker) -> dict:
        logprobs = protocol.completion_logprobs(tracker.logprobs, self.decode, 0) if self.logprobs else None
        return protocol.completion_response(request_id, self.model, text, reason, logprobs, tracker.usage())


class _ChatFormat:
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, decode: Callable[[int], str], logprobs: bool, top: bool,
                 to_bytes: Callable[[int], bytes]) -> None:
        self.model, self.decode, self.logprobs, self.top, self.to_bytes = model, decode, logprobs, top, to_bytes

    def first_chunk(self, request_id: str, created: int, include_usage: bool) -> dict | None:
        return protocol.chat_chunk(request_id, self.model, created, {"role": "assistant", "content": ""}, None,
                                   None, include_usage)

    def chunk(self, request_id: str, created: int, item: StepOutput, reason: str | None, include_usage: bool) -> dict:
        logprobs = self._logprobs(item.new_logprobs or [])
        delta = {"content": item.new_text} if item.new_text else {}
        return protocol.chat_chunk(request_id, self.model, created, delta, reason, logprobs, include_usage)

    def response(self, request_id: str, text: str, reason: str, tracker: _Tracker) -> dict:
        return protocol.chat_response(request_id, self.model, text, reason, self._logprobs(tracker.logprobs),
                                      tracker.usage())

    def _logprobs(self, tokens: list[TokenLogprob]) -> dict | None:
        return protocol.chat_logprobs(tokens, self.decode, self.top, self.to_bytes) if self.logprobs else None


# ---- errors and authentication -------------------------------------------------------------------

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: Sequence[Any]) -> str | None:
    """The field a validation error is about, as `messages[0].content` (union member tags dropped)."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item.isidentifier() and item not in _TYPE_TAGS and not item[0].isupper():
            parts.append(("." if parts else "") + item)
        else:
            break
    return "".join(parts) or None


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = _param(first.get("loc", ()))
    if param is None:
        return ApiError(400, "the request body must be a JSON object with the route's fields, sent with "
                             f"'Content-Type: application/json' ({first['msg']})")
    if first["type"] == "missing":
        return ApiError(400, f"{param} is required", param)
    got = first.get("input")
    shown = f" (got {got!r})" if got is not None and not isinstance(got, (dict, list)) else ""
    return ApiError(400, f"{param}: {first['msg']}{shown}", param)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def reply(error: ApiError) -> JSONResponse:
        metrics.refused.labels(status=str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return reply(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return reply(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return reply(ApiError(exc.status_code, str(exc.detail)))


class ApiKeyMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): 401 unless the Bearer key matches."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(header, self.expected):
                error = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
