"""What every HTTP app of ours needs, the single-engine server's (`routes.py`, `server.py`) and the
data-parallel front end's (`data_parallel.py`): one copy of each. Chapter 05 (appendix).

- errors in OpenAI's format, `{"error": {"message", "type", "param", "code"}}`: `error_response`,
  `service_unavailable` (503, with Retry-After when given), and the app's exception handlers
  (`add_error_handlers`: a bad request is 400 naming the field, never FastAPI's 422);
- the API key (`needs_key`): `Authorization: Bearer <key>`, compared in constant time, else 401;
- the body limit (`BodyLimit`, ASGI middleware): 413 before a body over the limit is read whole;
- server-sent events: `sse_response`, `sse_data` (one `data:` line), `error_chunk` (OpenAI's error object
  in place of the next chunk), `DONE` (`data: [DONE]`);
- a client that goes away: `unless_gone` (a non-streaming handler's wait), `client_gone` (499: nobody reads
  it);
- the socket and the process: `bind_socket`, `is_loopback`, `check_access` (the API key settings, and a
  warning for an open port), `base_url`, `ShutdownUvicorn` (uvicorn, with our own step before its shutdown
  on SIGINT/SIGTERM, and exit status 0 after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import re
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoengine.errors import NanoengineError
from nanoengine.serve.limits import ServerLimits
from nanoengine.serve.messages import EngineStepError, ServerBusyError
from nanoengine.serve.protocol import ProtocolError
from nanoengine.serve.responses import ErrorInfo, ErrorResponse

T = TypeVar("T")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"  # the line that ends every stream
CLIENT_GONE = 499  # nginx's "client closed request": the status of an answer nobody reads


# ------------------------------------------------------------------------------------------ OpenAI's errors
def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def service_unavailable(message: str, retry_after: int | None = None) -> JSONResponse:
    """503 (busy, shutting down, failed, or no replica); with `retry_after` seconds, a Retry-After header."""
    response = error_response(503, message, kind="service_unavailable")
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


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
    return service_unavailable(str(exc), exc.retry_after)


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


# ------------------------------------------------------------------------------------------ the API key
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


# ------------------------------------------------------------------------------------------ the body limit
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


# ------------------------------------------------------------------------------------------ streaming (SSE)
def sse_response(lines: AsyncIterator[str | bytes], status_code: int = 200,
                 headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(lines, status_code=status_code, media_type="text/event-stream",
                             headers={**SSE_HEADERS, **(headers or {})})


def sse_data(chunk: BaseModel) -> str:
    """One chunk as an SSE event: its `data:` line."""
    return f"data: {chunk.model_dump_json()}\n\n"


def error_chunk(message: str, kind: str, status: int) -> str:
    """The SSE line that ends a failed stream in place of its next chunk: OpenAI's error object."""
    return sse_data(ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status)))


# ------------------------------------------------------------------------------------------ a client gone
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


def client_gone() -> Response:
    return Response(status_code=CLIENT_GONE)


# ------------------------------------------------------------------------------------------ socket, process
def bind_socket(host: str, port: int) -> socket.socket:
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


def base_url(host: str, sock: socket.socket) -> str:
    """The OpenAI base URL of a server listening on `sock`: http://HOST:PORT/v1 (what the openai client
    takes)."""
    url_host = f"[{host}]" if ":" in host else host
    return f"http://{url_host}:{sock.getsockname()[1]}/v1"


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host` (127.0.0.1, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_access(host: str, api_key: str | None, protect_metrics: bool) -> list[str]:
    """Checks the API key settings; returns the warnings to print (an open port reachable from elsewhere)."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ProtocolError("api_key must be a non-empty string (or None for no key)", "api_key")
    if protect_metrics and api_key is None:
        raise ProtocolError("protect_metrics needs an api_key to protect /metrics with", "protect_metrics")
    return [] if api_key or is_loopback(host) else [
        f"serving on {host}, reachable from other machines, without an API key: anyone who can reach the "
        "port can use the model; pass --api-key (or set NANOENGINE_API_KEY)"]


class ShutdownUvicorn(uvicorn.Server):
    """uvicorn's Server, calling `on_exit` on SIGINT/SIGTERM (the engine stops taking requests and aborts the
    in-flight ones after the grace period; the data-parallel front end stops its replicas) before its own
    graceful shutdown; a second SIGINT exits at once (uvicorn's rule)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_exit()
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
