"""The OpenAI routes: a FastAPI app in OpenAI's shapes over the AsyncEngine. Chapter 05 (appendix).

    GET  /health                  200 while the engine thread runs (503 when shutting down)
    GET  /v1/models               the one served model
    GET  /server_info             what the engine was planned with (block size, lengths, batch, device, ...)
    POST /v1/completions          text or token-id prompts (a list of them too); stream=True for SSE chunks
    POST /v1/chat/completions     messages through the model's chat template
    GET  /metrics                 Prometheus text format
    GET  /v1/trace?since=K        the step trace (only with --trace), for the book's widgets

Streaming is server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; with
`stream_options={"include_usage": true}` a last chunk carries the usage, as OpenAI's does. Both completion
endpoints stream through one function, `sse_lines`; they differ only in how an event becomes a chunk (and
chat's first chunk, the assistant's role: `choices.py`; a parsed chat's event may make several). Every
error is OpenAI's error object (`http.py`): 400 for a bad request (unknown model, a bad field, a prompt over
max_model_len), naming the field; the server keeps serving after it. A client that disconnects mid-request
has its request aborted and its KV blocks freed within one engine step.

Agents: with `--reasoning-parser qwen3` a chat's thinking comes back as `reasoning_content` (streamed before
the content); `tools` with tool_choice "required" or a named function are enforced by a grammar, and "auto"
(with `--enable-auto-tool-choice --tool-call-parser hermes`) reads the calls the model wrote; calls come back
as `tool_calls` (nanoengine/parsers.py, nanoengine/tools.py, `choices.ChatChunks`). A grammar waits for the
end of the thinking.

With an API key (`--api-key`, or NANOENGINE_API_KEY), every /v1 route and /server_info (and /metrics with
--protect-metrics) needs `Authorization: Bearer <key>`; without it the answer is 401 in OpenAI's error
format, before the body is looked at. /health stays open, for the supervisor that probes it.

The limits (`limits.py`): a body over `max_body_bytes` is 413 before it is read whole (`http.BodyLimit`),
`n` over `max_n` is 400 here; the rest are the engine thread's (async_engine.py). After an engine failure
/health is 503 naming it, and every request gets 503 until the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from nanoengine.flags import engine_flag
from nanoengine.parsers import ParserOptions
from nanoengine.serve.async_engine import AsyncEngine
from nanoengine.serve.choices import (
    ChatChunks,
    ChatParsing,
    CompletionChunks,
    CompletionShape,
    chat_choices,
    chat_chunk,
    chat_chunk_choice,
    chat_role_choices,
    completion_choices,
    completion_response,
)
from nanoengine.serve.http import (
    DONE,
    BodyLimit,
    add_error_handlers,
    error_chunk,
    error_response,
    needs_key,
    service_unavailable,
    sse_data,
    sse_response,
    unless_gone,
)
from nanoengine.serve.limits import ServerLimits
from nanoengine.serve.messages import ChatPrompt, EngineStepError, Event, RequestStream, ServerBusyError
from nanoengine.serve.protocol import (
    COMPLETIONS_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
)
from nanoengine.serve.responses import (
    ChatCompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ServerInfo,
    Usage,
)
from nanoengine.serve.trace_json import trace_to_dict
from nanoengine.structured import StructuredOutputsError
from nanoengine.tools import parameters_grammars

ChunkOf = Callable[[list[Any], dict | None], BaseModel]  # (choices, usage or None) -> one chunk


def build_app(async_engine: AsyncEngine, model_name: str, api_key: str | None = None,
              protect_metrics: bool = False, parsers: ParserOptions | None = None) -> FastAPI:
    """The FastAPI app for one AsyncEngine (started and stopped by the app's lifespan); with `api_key`, the
    /v1 routes and /server_info (and /metrics with protect_metrics) need it; parsers: how chats' thinking and
    tool calls are read (none by default)."""
    llm_engine = async_engine.llm_engine  # read here, before its thread starts (the plan never changes)
    info = ServerInfo.of(model_name, llm_engine.plan, llm_engine.load().num_blocks)
    app = FastAPI(title="nanoengine", lifespan=_lifespan(async_engine))
    limits = async_engine.limits
    if limits.max_body_bytes is not None:
        app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, metrics=async_engine.metrics)
    add_error_handlers(app)
    auth = needs_key(api_key)
    add_info_routes(app, async_engine, info, auth, auth if protect_metrics else [])
    add_completion_routes(app, async_engine, model_name, auth, parsers or ParserOptions())
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
                "/server_info": (401, 413),
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
        app.openapi_schema = schema
    return app.openapi_schema


def _lifespan(async_engine: AsyncEngine) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            async_engine.stop()
    return lifespan


# ------------------------------------------------------------------------------------------ the routes
def add_info_routes(app: FastAPI, async_engine: AsyncEngine, info: ServerInfo, auth: list,
                    metrics_auth: list) -> None:
    """GET /health (always open), /v1/models, /server_info, /metrics, /v1/trace."""

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.healthy:
            return service_unavailable(async_engine.why_not_serving())
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=info.model, max_model_len=info.max_model_len)])

    @app.get("/server_info", dependencies=auth)
    async def server_info() -> ServerInfo:
        return info

    @app.get("/metrics", dependencies=metrics_auth)
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/trace", dependencies=auth)
    async def trace(since: int = 0) -> Response:
        if async_engine.trace is None:
            return error_response(404, "this server records no trace; start it with --trace",
                                  kind="not_found_error")
        if since < 0:
            raise ProtocolError(f"since must be >= 0, got {since}", "since")
        return JSONResponse(await async_engine.call(lambda _: trace_to_dict(async_engine.trace, since)))


def add_completion_routes(app: FastAPI, async_engine: AsyncEngine, model_name: str, auth: list,
                          parsers: ParserOptions) -> None:
    """POST /v1/completions and /v1/chat/completions: submit, then SSE chunks or one JSON reply."""

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model, model_name)
        params = check_n(body.sampling_params(COMPLETIONS_MAX_TOKENS), async_engine)
        check_logprobs(params.logprobs, "logprobs", async_engine)
        prompts = body.prompts()
        rid = async_engine.new_id("cmpl")
        stream = await submit(async_engine, body, prompts, params, rid, echo=bool(body.echo))
        reply = functools.partial(completion_response, rid, model_name)
        shape = CompletionShape.of(body)
        if body.stream:
            return sse_response(sse_lines(async_engine, stream, reply, CompletionChunks(shape, stream),
                                          include_usage=body.include_usage))
        await wait(async_engine, stream, request)
        return JSONResponse(reply(completion_choices(stream, params.n, shape), stream.usage).model_dump())

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model, model_name)
        conversation = body.conversation()
        tags, auto = parsers.reasoning_tags, parsers.enable_auto_tool_choice
        params = check_n(body.sampling_params(None, tags, auto), async_engine)
        check_logprobs(params.logprobs, "top_logprobs", async_engine)
        tools, tool_choice = body.tool_list(), body.effective_tool_choice(auto)
        await check_tool_schemas(async_engine, tools)
        prompt = ChatPrompt(conversation, tools or None, dict(body.chat_template_kwargs or {}), tags)
        rid = async_engine.new_id("chatcmpl")
        stream = await submit(async_engine, body, [], params, rid, conversation=prompt)
        tool_parser = (None if tool_choice == "none" else parsers.tool_call_parser if tool_choice == "auto"
                       else "hermes")  # a forced call's grammar writes Hermes blocks
        parsing = ChatParsing(parsers.reasoning_parser, tool_parser, prompt.thinking)
        if body.stream:
            chunk = functools.partial(chat_chunk, rid, model_name)
            role = chat_role_choices(params.n)
            choice = (ChatChunks(parsing, params.logprobs) if parsing.active
                      else functools.partial(chat_chunk_choice, top_logprobs=params.logprobs))
            return sse_response(sse_lines(async_engine, stream, chunk, choice, first=role,
                                          include_usage=body.include_usage))
        await wait(async_engine, stream, request)
        resp = ChatCompletionResponse(id=rid, model=model_name, usage=Usage(**stream.usage),
                                      choices=chat_choices(stream, params.logprobs, parsing))
        return JSONResponse(resp.model_dump())


async def submit(async_engine: AsyncEngine, body: Any, prompts: list[Any], params: Any, request_id: str,
                 **kwargs: Any) -> RequestStream:
    """async_engine.submit. Structured outputs: the grammar is compiled here first, in a worker thread (the
    engine thread then finds it in the cache, and steps on meanwhile); one the library cannot compile is a 400
    whose `param` is the request field that asked for it (response_format, structured_outputs, guided_*)."""
    try:
        if params.structured_outputs is not None:
            await asyncio.to_thread(grammars(async_engine, body.structured_field()).compile,
                                    params.structured_outputs)
        return await async_engine.submit(prompts, params, request_id, **kwargs)
    except StructuredOutputsError as e:
        e.param = body.structured_field() or ("tools" if getattr(body, "tools", None) else e.param)
        raise


def grammars(async_engine: AsyncEngine, param: str | None) -> Any:
    """The engine's structured outputs (what compiles a request's grammar); a 400 naming `param` for an engine
    that has none (an engine of one's own: nanoengine/engine/protocol.py)."""
    found = getattr(async_engine.llm_engine, "structured", None)
    if found is None:
        raise ProtocolError("this engine does not support structured outputs (grammars, forced tool calls); "
                            "leave them out", param or "structured_outputs")
    return found


async def check_tool_schemas(async_engine: AsyncEngine, tools: list[dict]) -> None:
    """Each tool's parameters schema compiled (in a worker thread; cached): one the grammar library cannot
    compile is a 400 naming `tools`, whatever the tool_choice."""
    for i, grammar in parameters_grammars(tools):
        try:
            await asyncio.to_thread(grammars(async_engine, "tools").compile, grammar)
        except StructuredOutputsError as e:
            raise ProtocolError(f"tools[{i}].function.parameters: {e}", "tools") from None


def check_n(params: Any, async_engine: AsyncEngine) -> Any:
    limits = async_engine.limits
    if limits.max_n is not None and params.n > limits.max_n:
        async_engine.metrics.on_refused("n")
        raise ProtocolError(f"n={params.n} completions is more than this server takes in one request "
                            f"({ServerLimits.flag('max_n')} {limits.max_n}); ask for fewer", "n")
    return params


def check_logprobs(k: int | None, param: str, async_engine: AsyncEngine) -> None:
    """k top logprobs per token, at most the engine's max_logprobs (the engine refuses more too; this names
    the server's flag)."""
    limit = getattr(getattr(async_engine.llm_engine, "config", None), "max_logprobs", None)
    if k is not None and limit is not None and k > limit:
        raise ProtocolError(f"{param}={k} is more than this server's max_logprobs ({limit}); ask for at most "
                            f"{limit}, or start the server with {engine_flag('max_logprobs')} {k}", param)


def check_model(name: str, model_name: str) -> None:
    if name != model_name:
        raise ProtocolError(f"model {name!r} is not served here; this server serves {model_name!r} "
                            "(see GET /v1/models)", "model")


async def wait(async_engine: AsyncEngine, stream: RequestStream, request: Request) -> None:
    """Until the request is done (an engine failure raises); aborts it if the client goes away first."""
    async def drain() -> None:
        async for _ in stream.events():
            pass
    try:
        await unless_gone(drain(), request)
    finally:
        async_engine.abort(stream)  # a no-op once it is done


async def sse_lines(async_engine: AsyncEngine, stream: RequestStream, chunk: ChunkOf,
                    choice: Callable[[Event], Any], *, first: list[Any] | None = None,
                    include_usage: bool = False) -> AsyncIterator[str]:
    """A request stream's events as SSE `data:` lines, one chunk each. `chunk(choices, usage)` builds a
    chunk (a completion's or a chat's), `choice(event)` the one choice of an event's chunk. Before them a
    chunk of the `first` choices (chat's role), after them one of the usage (with include_usage); an engine
    failure is an error chunk. Then `data: [DONE]`; whatever ends the stream (a client that left too), the
    request is aborted."""
    try:
        if first is not None:
            yield sse_data(chunk(first, None))
        async for ev in stream.events():
            made = choice(ev)  # one chunk's choice, or a list of them (a parsed chat's)
            for c in made if isinstance(made, list) else [made]:
                yield sse_data(chunk([c], None))
        if include_usage:
            yield sse_data(chunk([], stream.usage))
    except EngineStepError as e:
        yield error_chunk(str(e), "internal_server_error", 500)
    except ServerBusyError as e:  # aborted: no first token in time, or the client stopped reading
        yield error_chunk(str(e), "service_unavailable", 503)
    finally:  # also when the client disconnects: the stream is cancelled here, and aborted
        async_engine.abort(stream)
    yield DONE
