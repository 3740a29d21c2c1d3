"""The HTTP server: FastAPI routes in OpenAI's shapes over the AsyncEngine, and `serve()` (uvicorn).
Chapter 05 (appendix).

    GET  /health                  200 while the engine thread runs (503 when shutting down)
    GET  /v1/models               the one served model
    POST /v1/completions          text or token-id prompts (a list of them too); stream=True for SSE chunks
    POST /v1/chat/completions     messages through the model's chat template
    GET  /metrics                 Prometheus text format
    GET  /v1/trace?since=K        the step trace (only with --trace), for the book's widgets

Streaming is server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; with
`stream_options={"include_usage": true}` a last chunk carries the usage, as OpenAI's does. Every error is
OpenAI's `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (unknown model, a bad field,
a prompt over max_model_len), naming the field; the server keeps serving after it. A client that disconnects
mid-request has its request aborted and its KV blocks freed within one engine step.

Shutdown (SIGINT/SIGTERM): new requests get 503, the in-flight ones have `shutdown_grace_s` to finish, then
are aborted (their streams end with finish_reason "abort"), and the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
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

DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for pydantic's errors: the first bad field (OpenAI's `param`), what was wrong, and how many."""
    errors = exc.errors()
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    field = loc[0] if loc else None
    where = ".".join(loc) or "the request body"
    if first.get("type") == "extra_forbidden":
        msg = f"unknown field {where!r}: nanoengine does not support it; leave it out"
    elif first.get("type") == "json_invalid":
        msg, field = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})", None
    elif first.get("type") == "missing":
        msg = f"{where} is required"
    else:
        msg = f"{where}: {first['msg']}, got {first.get('input')!r:.80}"
    same = sum(1 for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == loc[:1])
    if len(errors) > same:
        msg += f" (and {len(errors) - same} more problem(s) in other fields)"
    return msg, field


def error_param(exc: Exception) -> str | None:
    """OpenAI's `param` for an engine error: ProtocolError carries it; SamplingParams' messages start with it."""
    if getattr(exc, "param", None):
        return exc.param
    m = re.match(r"SamplingParams: (\w+)", str(exc))
    return m.group(1) if m else None


def build_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    """The FastAPI app for one AsyncEngine (started and stopped by the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="nanoengine", lifespan=lifespan)
    max_model_len = engine.engine.config.max_model_len

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, field = validation_message(exc)
        return error_response(400, msg, param=field)

    @app.exception_handler(NanoengineError)
    async def on_bad_value(_: Request, exc: NanoengineError) -> JSONResponse:
        return error_response(400, str(exc), param=error_param(exc))

    @app.exception_handler(ServerBusyError)
    async def on_busy(_: Request, exc: ServerBusyError) -> JSONResponse:
        return error_response(503, str(exc), kind="service_unavailable")

    @app.exception_handler(EngineStepError)
    async def on_engine_error(_: Request, exc: EngineStepError) -> JSONResponse:
        return error_response(500, str(exc), kind="internal_server_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail),
                              kind="not_found_error" if exc.status_code == 404 else "invalid_request_error")

    def check_model(name: str) -> None:
        if name != model_name:
            raise ProtocolError(f"model {name!r} is not served here; this server serves {model_name!r} "
                                "(see GET /v1/models)", "model")

    async def wait(stream: RequestStream, request: Request) -> None:
        """Until the request is done; aborts it if the client goes away first."""
        async def drain() -> None:
            async for _ in stream.events():
                pass
        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    break
            if not task.cancelled():
                task.result()  # an engine failure raises here
        finally:
            if not task.done():
                task.cancel()
            engine.abort(stream)  # a no-op once it is done

    def sse(chunks: AsyncIterator[str], stream: RequestStream) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield f"data: {chunk}\n\n"
            except EngineStepError as e:
                err = ErrorResponse(error=ErrorInfo(message=str(e), type="internal_server_error", code=500))
                yield f"data: {err.model_dump_json()}\n\n"
            finally:  # also when the client disconnects: the stream is cancelled here, and aborted
                engine.abort(stream)
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            return error_response(503, "the engine is not running (shutting down?)", kind="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/trace")
    async def trace(since: int = 0) -> Response:
        if engine.trace is None:
            return error_response(404, "this server records no trace; start it with --trace", kind="not_found_error")
        if since < 0:
            raise ProtocolError(f"since must be >= 0, got {since}", "since")
        return JSONResponse(await engine.call(lambda _: trace_to_dict(engine.trace, since)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = body.sampling_params(COMPLETIONS_MAX_TOKENS)
        prompts = body.prompts()
        rid = engine.new_id("cmpl")
        stream = await engine.submit(prompts, params, rid)

        def reply(choices: list[CompletionChoice], usage: dict | None = None) -> CompletionResponse:
            return CompletionResponse(id=rid, model=model_name, choices=choices,
                                      usage=Usage(**usage) if usage else None)

        if body.stream:
            async def chunks() -> AsyncIterator[str]:
                async for ev in stream.events():
                    if isinstance(ev, Delta):
                        choice = CompletionChoice(index=ev.index, text=ev.text)
                    else:
                        choice = CompletionChoice(index=ev.index, text="", finish_reason=ev.finish_reason,
                                                  stop_reason=ev.stop_reason)
                    yield reply([choice]).model_dump_json()
                if body.include_usage:
                    yield reply([], stream.usage).model_dump_json()
            return sse(chunks(), stream)
        await wait(stream, request)
        choices = [CompletionChoice(index=i * params.n + c.index, text=c.text, finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason)
                   for i, out in enumerate(stream.outputs) for c in out.outputs]
        return JSONResponse(reply(choices, stream.usage).model_dump())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        conversation = body.conversation()
        params = body.sampling_params(None)
        rid = engine.new_id("chatcmpl")
        stream = await engine.submit([], params, rid, conversation=conversation)

        if body.stream:
            def chunk(choices: list[ChatChunkChoice], usage: dict | None = None) -> str:
                return ChatCompletionChunk(id=rid, model=model_name, choices=choices,
                                           usage=Usage(**usage) if usage else None).model_dump_json()

            async def chunks() -> AsyncIterator[str]:
                yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                             for i in range(params.n)])
                async for ev in stream.events():
                    if isinstance(ev, Delta):
                        yield chunk([ChatChunkChoice(index=ev.index, delta=ChatDelta(content=ev.text))])
                    elif isinstance(ev, ChoiceDone):
                        yield chunk([ChatChunkChoice(index=ev.index, delta=ChatDelta(),
                                                     finish_reason=ev.finish_reason)])
                if body.include_usage:
                    yield chunk([], stream.usage)
            return sse(chunks(), stream)
        await wait(stream, request)
        choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason) for c in stream.outputs[0].outputs]
        resp = ChatCompletionResponse(id=rid, model=model_name, choices=choices, usage=Usage(**stream.usage))
        return JSONResponse(resp.model_dump())

    return app


# ------------------------------------------------------------------------------------------ the process
def _bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: one the OS picks), so the printed address is the real one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ProtocolError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port "
                            "(0 lets the OS choose)", "port") from e
    sock.listen(2048)
    return sock


class Server:
    """The whole server in this process: the model's engine, its thread, the app, uvicorn on a bound socket.
    `run()` serves in the foreground until SIGINT/SIGTERM (`nanoengine serve`); `start()` serves from a
    background thread (a notebook, a test) until `stop()`, or use it as a context manager:

        with Server("tiny-qwen3", port=0) as server:
            client = OpenAI(base_url=server.url, api_key="none")
    """

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 8000, *,
                 served_model_name: str | None = None, trace: bool = False, shutdown_grace_s: float = 2.0,
                 log_level: str = "info", engine_options: dict[str, Any] | None = None) -> None:
        from nanoengine.engine.llm_engine import LLMEngine
        from nanoengine.serve.metrics import ServerMetrics

        if isinstance(shutdown_grace_s, bool) or not isinstance(shutdown_grace_s, (int, float)) \
                or not shutdown_grace_s >= 0:
            raise ProtocolError(f"shutdown_grace_s must be >= 0 seconds, got {shutdown_grace_s!r}", "shutdown_grace")
        self.sock = _bind(host, port)
        try:
            self.llm_engine = LLMEngine(model, **(engine_options or {}))
        except BaseException:
            self.sock.close()
            raise
        prometheus_client.disable_created_metrics()  # no *_created series beside each counter (as vLLM does)
        self.name = served_model_name or str(model)
        self.engine = AsyncEngine(self.llm_engine, ServerMetrics(self.name), trace=trace)
        config = uvicorn.Config(build_app(self.engine, self.name), log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=int(shutdown_grace_s) + 2)
        self.grace_s = shutdown_grace_s
        self.uvicorn = _Uvicorn(config, self.engine, shutdown_grace_s)
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{self.sock.getsockname()[1]}/v1"  # what the openai client takes
        self._thread: threading.Thread | None = None

    def describe(self) -> str:
        cfg = self.llm_engine.config
        return (f"{self.name} on {self.url} ({cfg.device}, {cfg.dtype}, {self.llm_engine.block_manager.num_blocks} "
                "KV blocks)")

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM; returns the exit status."""
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self._close()
        return 0

    def start(self, timeout: float = 30.0) -> Server:
        """Serve from a background thread; returns once uvicorn is up."""
        self._thread = threading.Thread(target=self.run, name="nanoengine-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start (see its log above)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """As SIGTERM does: no new requests, the running ones get the grace period, then uvicorn exits."""
        if self._thread is None:
            return
        self.engine.begin_shutdown(self.grace_s)
        self.uvicorn.should_exit = True
        self._thread.join(self.grace_s + 10)
        self._thread = None

    def _close(self) -> None:
        self.engine.stop()
        self.llm_engine.close()
        self.sock.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> int:
    """`nanoengine serve`: load the model, listen, serve until SIGINT/SIGTERM; returns the exit status.
    options: those of Server."""
    server = Server(model, host, port, **options)
    print(f"nanoengine serve: {server.describe()}", flush=True)
    code = server.run()
    print("nanoengine serve: stopped", file=sys.stderr, flush=True)
    return code


class _Uvicorn(uvicorn.Server):
    """uvicorn's Server, told about the engine: on the first SIGINT/SIGTERM the engine stops taking requests
    and aborts the in-flight ones after the grace period; a second SIGINT exits at once (uvicorn's rule)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine.begin_shutdown(self.grace_s)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """As uvicorn's, without re-raising the signal after the clean shutdown (so the exit status is 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handlers = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
