"""The HTTP routes: a FastAPI app in OpenAI's shapes over the AsyncEngine, and OpenAI's error format.
Chapter 05 (appendix).

    GET  /health                  200 while the engine thread runs (503 when shutting down)
    GET  /v1/models               the one served model
    POST /v1/completions          text or token-id prompts (a list of them too); stream=True for SSE chunks
    POST /v1/chat/completions     messages through the model's chat template
    GET  /metrics                 Prometheus text format
    GET  /v1/trace?since=K        the step trace (only with --trace), for the book's widgets

Streaming is server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; with
`stream_options={"include_usage": true}` a last chunk carries the usage, as OpenAI's does. Both completion
endpoints stream through one function, `sse_lines`; they differ only in how an event becomes a chunk (and
chat's first chunk, the assistant's role). Every error is OpenAI's `{"error": {"message", "type", "param",
"code"}}`: 400 for a bad request (unknown model, a bad field, a prompt over max_model_len), naming the field;
the server keeps serving after it. A client that disconnects mid-request has its request aborted and its KV
blocks freed within one engine step.

With an API key (`--api-key`, or NANOENGINE_API_KEY), every /v1 route (and /metrics with --protect-metrics)
needs `Authorization: Bearer <key>`, compared in constant time; without it the answer is 401 in OpenAI's
error format, before the body is looked at. /health stays open, for the supervisor that probes it.

The limits (`limits.py`): a body over `max_body_bytes` is 413 before it is read whole (`BodyLimit`, an ASGI
middleware), `n` over `max_n` is 400 here; the rest are the engine thread's (async_engine.py). After an
engine failure /health is 503 naming it, and every request gets 503 until the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoengine.errors import NanoengineError
from nanoengine.serve.async_engine import (
    AsyncEngine,
    ChoiceDone,
    Delta,
    EngineStepError,
    RequestStream,
    ServerBusyError,
)
from nanoengine.serve.limits import ServerLimits
from nanoengine.serve.protocol import (
    COMPLETIONS_MAX_TOKENS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    ProtocolError,
    Usage,
)
from nanoengine.serve.trace_json import trace_to_dict
from nanoengine.tokenizer import CHAT_ROLES

T = TypeVar("T")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Event = Delta | ChoiceDone
ChunkOf = Callable[[list[Any], dict | None], BaseModel]  # (choices, usage or None) -> one chunk


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              protect_metrics: bool = False) -> FastAPI:
    """The FastAPI app for one AsyncEngine (started and stopped by the app's lifespan); with `api_key`, the
    /v1 routes (and /metrics with protect_metrics) need it."""
    max_model_len = engine.engine.plan.max_model_len
    app = FastAPI(title="nanoengine", lifespan=_lifespan(engine))
    if engine.limits.max_body_bytes is not None:
        app.add_middleware(BodyLimit, max_bytes=engine.limits.max_body_bytes, metrics=engine.metrics)
    add_error_handlers(app)
    auth = needs_key(api_key)
    add_info_routes(app, engine, model_name, max_model_len, auth, auth if protect_metrics else [])
    add_completion_routes(app, engine, model_name, auth)
    app.openapi = functools.partial(documented_openapi, app, model_name)
    return app


# ------------------------------------------------------------------------------------------ OpenAPI schema
ERROR_STATUSES = {
    400: "a bad request: `param` names the field (a value out of range, an unknown field, a prompt too long)",
    401: "no API key, or a wrong one (a server started with --api-key)",
    404: "not served here",
    413: f"the request body is over {ServerLimits.flag('max_body_bytes')}",
    500: "the engine failed while stepping; the server exits",
    503: "busy (the queue is full, or no first token in time: see Retry-After), shutting down, or failed",
}
ROUTE_ERRORS = {"/health": (413, 503), "/metrics": (401, 413), "/v1/models": (401, 413),
                "/v1/trace": (400, 401, 404, 413, 503), "/v1/completions": (400, 401, 413, 500, 503),
                "/v1/chat/completions": (400, 401, 413, 500, 503)}


def documented_openapi(app: FastAPI, model_name: str) -> dict[str, Any]:
    """FastAPI's schema, told what the routes really answer: OpenAI's error object for each status a route
    can give (not FastAPI's 422: a bad body is a 400 here), server-sent events beside JSON for a generation,
    Prometheus text for /metrics, and the one model name a request may ask for."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error.pop("$defs", {}), ErrorResponse=error)
        ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, operations in schema["paths"].items():
            for method, op in operations.items():
                responses = op["responses"]
                responses.pop("422", None)
                for status in ROUTE_ERRORS.get(path, ()):
                    responses[str(status)] = {"description": ERROR_STATUSES[status], "content": ref}
                if method == "post":
                    responses["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
                if path == "/metrics":
                    responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
        for body in ("CompletionRequest", "ChatCompletionRequest"):
            schemas[body]["properties"]["model"]["enum"] = [model_name]
        schemas["ChatMessage"]["properties"]["role"]["enum"] = list(CHAT_ROLES)
        app.openapi_schema = schema
    return app.openapi_schema


def needs_key(api_key: str | None) -> list:
    """The FastAPI dependencies of a route that needs the key: none without one."""
    if not api_key:
        return []
    want = f"Bearer {api_key}".encode()

    async def check_key(request: Request) -> None:
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, want):  # constant time: the answer's timing does not leak the key
            raise StarletteHTTPException(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                              "with the key this server was started with (--api-key)")

    return [Depends(check_key)]


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is 413 in OpenAI's error format, told by its
    Content-Length before a byte of it is read, or (chunked, no length) once it passes the limit."""

    def __init__(self, app: Any, max_bytes: int, metrics: Any) -> None:
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        messages, size = [], 0  # no length given: read it here, up to the limit
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()
        return await self.app(scope, replay, send)

    async def _refuse(self, send: Callable) -> None:
        self.metrics.on_refused("body_too_large")
        response = error_response(413, f"the request body is larger than this server takes ({self.max_bytes} "
                                       f"bytes, {ServerLimits.flag('max_body_bytes')}); send less",
                                  param=None)
        await response({"type": "http"}, None, send)


def _lifespan(engine: AsyncEngine) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            engine.stop()
    return lifespan


# ------------------------------------------------------------------------------------------ OpenAI's errors
def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for pydantic's errors: the first bad field (OpenAI's `param`), what was wrong, how many."""
    errors = exc.errors()
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    field = loc[0] if loc else None
    where = ".".join(loc) or "the request body"
    if first.get("type") == "extra_forbidden":
        msg = f"unknown field {where!r}: nanoengine does not support it; leave it out"
    elif first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        msg, field = f"the request body is not valid JSON ({reason})", None
    elif first.get("type") == "missing":
        msg = f"{where} is required"
    else:
        msg = f"{where}: {first['msg']}, got {first.get('input')!r:.80}"
    same = sum(1 for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == loc[:1])
    if len(errors) > same:
        msg += f" (and {len(errors) - same} more problem(s) in other fields)"
    return msg, field


def error_param(exc: Exception) -> str | None:
    """OpenAI's `param` for an engine error: ProtocolError carries it; SamplingParams' messages start
    with it."""
    if getattr(exc, "param", None):
        return exc.param
    m = re.match(r"SamplingParams: (\w+)", str(exc))
    return m.group(1) if m else None


async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    msg, field = validation_message(exc)
    return error_response(400, msg, param=field)


async def on_bad_value(_: Request, exc: NanoengineError) -> JSONResponse:
    return error_response(400, str(exc), param=error_param(exc))


async def on_busy(_: Request, exc: ServerBusyError) -> JSONResponse:
    response = error_response(503, str(exc), kind="service_unavailable")
    if exc.retry_after is not None:
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


async def on_engine_error(_: Request, exc: EngineStepError) -> JSONResponse:
    return error_response(500, str(exc), kind="internal_server_error")


async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    response = error_response(exc.status_code, str(exc.detail),
                              kind="not_found_error" if exc.status_code == 404 else "invalid_request_error")
    if exc.status_code == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body: a bad request 400, a busy server 503, an engine failure 500."""
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(NanoengineError, on_bad_value)
    app.add_exception_handler(ServerBusyError, on_busy)
    app.add_exception_handler(EngineStepError, on_engine_error)
    app.add_exception_handler(StarletteHTTPException, on_http)


# ------------------------------------------------------------------------------------------ the routes
def add_info_routes(app: FastAPI, engine: AsyncEngine, model_name: str, max_model_len: int, auth: list,
                    metrics_auth: list) -> None:
    """GET /health (always open), /v1/models, /metrics, /v1/trace."""

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            return error_response(503, engine.why_not_serving(), kind="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.get("/metrics", dependencies=metrics_auth)
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/trace", dependencies=auth)
    async def trace(since: int = 0) -> Response:
        if engine.trace is None:
            return error_response(404, "this server records no trace; start it with --trace",
                                  kind="not_found_error")
        if since < 0:
            raise ProtocolError(f"since must be >= 0, got {since}", "since")
        return JSONResponse(await engine.call(lambda _: trace_to_dict(engine.trace, since)))


def add_completion_routes(app: FastAPI, engine: AsyncEngine, model_name: str, auth: list) -> None:
    """POST /v1/completions and /v1/chat/completions: submit, then SSE chunks or one JSON reply."""

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model, model_name)
        params = check_n(body.sampling_params(COMPLETIONS_MAX_TOKENS), engine)
        prompts = body.prompts()
        rid = engine.new_id("cmpl")
        stream = await engine.submit(prompts, params, rid)
        reply = functools.partial(completion_response, rid, model_name)
        if body.stream:
            return sse_response(sse_lines(engine, stream, reply, completion_choice,
                                          include_usage=body.include_usage))
        await wait(engine, stream, request)
        return JSONResponse(reply(completion_choices(stream, params.n), stream.usage).model_dump())

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model, model_name)
        conversation = body.conversation()
        params = check_n(body.sampling_params(None), engine)
        rid = engine.new_id("chatcmpl")
        stream = await engine.submit([], params, rid, conversation=conversation)
        if body.stream:
            chunk = functools.partial(chat_chunk, rid, model_name)
            role = chat_role_choices(params.n)
            return sse_response(sse_lines(engine, stream, chunk, chat_chunk_choice, first=role,
                                          include_usage=body.include_usage))
        await wait(engine, stream, request)
        resp = ChatCompletionResponse(id=rid, model=model_name, choices=chat_choices(stream),
                                      usage=Usage(**stream.usage))
        return JSONResponse(resp.model_dump())


def check_n(params: Any, engine: AsyncEngine) -> Any:
    limits = engine.limits
    if limits.max_n is not None and params.n > limits.max_n:
        engine.metrics.on_refused("n")
        raise ProtocolError(f"n={params.n} completions is more than this server takes in one request "
                            f"({ServerLimits.flag('max_n')} {limits.max_n}); ask for fewer", "n")
    return params


def check_model(name: str, model_name: str) -> None:
    if name != model_name:
        raise ProtocolError(f"model {name!r} is not served here; this server serves {model_name!r} "
                            "(see GET /v1/models)", "model")


async def unless_gone(work: Awaitable[T], request: Request) -> T | None:
    """`work`'s result (its error raises here), or None if the client disconnected first (then `work` is
    cancelled); a non-streaming handler's wait."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()


async def wait(engine: AsyncEngine, stream: RequestStream, request: Request) -> None:
    """Until the request is done (an engine failure raises); aborts it if the client goes away first."""
    async def drain() -> None:
        async for _ in stream.events():
            pass
    try:
        await unless_gone(drain(), request)
    finally:
        engine.abort(stream)  # a no-op once it is done


# ------------------------------------------------------------------------------------------ streaming (SSE)
async def sse_lines(engine: AsyncEngine, stream: RequestStream, chunk: ChunkOf,
                    choice: Callable[[Event], Any], *, first: list[Any] | None = None,
                    include_usage: bool = False) -> AsyncIterator[str]:
    """A request stream's events as SSE `data:` lines, one chunk each. `chunk(choices, usage)` builds a
    chunk (a completion's or a chat's), `choice(event)` the one choice of an event's chunk. Before them a
    chunk of the `first` choices (chat's role), after them one of the usage (with include_usage); an engine
    failure is an error chunk. Then `data: [DONE]`; whatever ends the stream (a client that left too), the
    request is aborted."""
    try:
        if first is not None:
            yield _data(chunk(first, None))
        async for ev in stream.events():
            yield _data(chunk([choice(ev)], None))
        if include_usage:
            yield _data(chunk([], stream.usage))
    except EngineStepError as e:
        yield error_chunk(str(e), "internal_server_error", 500)
    except ServerBusyError as e:  # aborted: no first token in time, or the client stopped reading
        yield error_chunk(str(e), "service_unavailable", 503)
    finally:  # also when the client disconnects: the stream is cancelled here, and aborted
        engine.abort(stream)
    yield "data: [DONE]\n\n"


def sse_response(lines: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(lines, media_type="text/event-stream", headers=SSE_HEADERS)


def _data(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def error_chunk(message: str, kind: str, status: int) -> str:
    """The SSE line that ends a failed stream in place of its next chunk: OpenAI's error object."""
    return _data(ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status)))


# ------------------------------------------------------------------------------------------ the bodies
def _usage(usage: dict | None) -> Usage | None:
    return Usage(**usage) if usage else None


def completion_response(rid: str, model_name: str, choices: list[CompletionChoice],
                        usage: dict | None = None) -> CompletionResponse:
    """A completion's reply, and each of its SSE chunks (the same shape)."""
    return CompletionResponse(id=rid, model=model_name, choices=choices, usage=_usage(usage))


def completion_choice(ev: Event) -> CompletionChoice:
    if isinstance(ev, Delta):
        return CompletionChoice(index=ev.index, text=ev.text)
    return CompletionChoice(index=ev.index, text="", finish_reason=ev.finish_reason,
                            stop_reason=ev.stop_reason)


def completion_choices(stream: RequestStream, n: int) -> list[CompletionChoice]:
    """Every finished choice of every prompt, indexed prompt number * n + completion number."""
    return [CompletionChoice(index=i * n + c.index, text=c.text, finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason)
            for i, out in enumerate(stream.outputs) for c in out.outputs]


def chat_chunk(rid: str, model_name: str, choices: list[ChatChunkChoice],
               usage: dict | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=rid, model=model_name, choices=choices, usage=_usage(usage))


def chat_role_choices(n: int) -> list[ChatChunkChoice]:
    """A chat stream's first chunk: each choice's role, no content yet."""
    return [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(n)]


def chat_chunk_choice(ev: Event) -> ChatChunkChoice:
    if isinstance(ev, Delta):
        return ChatChunkChoice(index=ev.index, delta=ChatDelta(content=ev.text))
    return ChatChunkChoice(index=ev.index, delta=ChatDelta(), finish_reason=ev.finish_reason)


def chat_choices(stream: RequestStream) -> list[ChatChoice]:
    return [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason,
                       stop_reason=c.stop_reason) for c in stream.outputs[0].outputs]
