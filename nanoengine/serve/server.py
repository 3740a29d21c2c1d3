"""The server process: `Server` loads the model's engine, starts its thread, builds the app (`routes.py`) and
runs uvicorn on a bound socket (clean shutdown: `http.py`): `run()` in the foreground (`nanoengine serve`,
through `serve()`) or `start()` / `with Server(...)` from a background thread (the book). Chapter 05
(appendix).

Shutdown (SIGINT/SIGTERM): new requests get 503, the in-flight ones have `shutdown_grace_s` to finish, then
are aborted (their streams end with finish_reason "abort"), and the process exits with status 0. An engine
step that raises ends the server too: the requests in flight get the error (500), and `run()` returns 1.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import prometheus_client
import uvicorn

from nanoengine.distributed import launcher
from nanoengine.parsers import ParserOptions
from nanoengine.serve.async_engine import AsyncEngine
from nanoengine.serve.http import ShutdownUvicorn, base_url, bind_socket, check_access
from nanoengine.serve.limits import ServerLimits
from nanoengine.serve.protocol import ProtocolError
from nanoengine.serve.routes import build_app


class Server:
    """The whole server in this process: the model's engine, its thread, the app, uvicorn on a bound socket.
    `run()` serves in the foreground until SIGINT/SIGTERM (`nanoengine serve`); `start()` serves from a
    background thread (a notebook, a test) until `stop()`, or use it as a context manager:

        with Server("tiny-qwen3", port=0) as server:
            client = OpenAI(base_url=server.url, api_key="none")
    """

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 8000, *,
                 served_model_name: str | None = None, trace: bool = False, shutdown_grace_s: float = 2.0,
                 log_level: str = "info", engine_options: dict[str, Any] | None = None,
                 api_key: str | None = None, protect_metrics: bool = False,
                 limits: ServerLimits | None = None, parsers: ParserOptions | None = None,
                 engine: str | None = None) -> None:
        """api_key: the key every /v1 request must bear (`Authorization: Bearer <key>`; /metrics too with
        protect_metrics); None: no key, and a warning when the address is reachable from other machines.
        limits: what one request and the queue may be (ServerLimits; its defaults when None). parsers: how
        chats' thinking and tool calls are read (ParserOptions: --reasoning-parser, --tool-call-parser)."""
        from nanoengine.engine.protocol import load_engine
        from nanoengine.launch import build_engine
        from nanoengine.serve.metrics import ServerMetrics

        if (isinstance(shutdown_grace_s, bool) or not isinstance(shutdown_grace_s, (int, float))
                or not shutdown_grace_s >= 0):
            raise ProtocolError(f"shutdown_grace_s must be >= 0 seconds, got {shutdown_grace_s!r}",
                                "shutdown_grace")
        if limits is not None and not isinstance(limits, ServerLimits):
            raise ProtocolError(f"limits must be a ServerLimits, got {type(limits).__name__}", "limits")
        parsers = parsers or ParserOptions()
        self.warnings = check_access(host, api_key, protect_metrics)
        if (launch := launcher.launched()) is not None and launch.rank != 0:  # torchrun: rank 0 alone listens
            build_engine(model, **(engine_options or {}))  # serves rank 0's steps, then exits the process
        self.sock = bind_socket(host, port)
        try:  # ours, or an engine of one's own (`engine`: module:factory; nanoengine/engine/protocol.py)
            self.llm_engine = (build_engine(model, **(engine_options or {})) if engine is None
                               else load_engine(engine, model, **(engine_options or {})))
        except BaseException:
            self.sock.close()
            raise
        try:
            parsers.check_vocabulary(self.llm_engine.tokenizer, str(model))
        except ValueError:
            self.llm_engine.close()
            self.sock.close()
            raise
        prometheus_client.disable_created_metrics()  # no *_created series beside each counter (as vLLM does)
        self.name = served_model_name or str(model)
        self.exit_code = 0  # 1 once the engine failed
        self.async_engine = AsyncEngine(self.llm_engine, ServerMetrics(self.name), trace=trace, limits=limits,
                                        on_fatal=self._on_engine_failure)
        app = build_app(self.async_engine, self.name, api_key, protect_metrics, parsers)
        config = uvicorn.Config(app, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=int(shutdown_grace_s) + 2)
        self.grace_s = shutdown_grace_s
        self.uvicorn = ShutdownUvicorn(config,
                                       on_exit=lambda: self.async_engine.begin_shutdown(shutdown_grace_s))
        self.url = base_url(host, self.sock)
        self._thread: threading.Thread | None = None

    def describe(self) -> str:
        """The startup line: the served name, the URL, the engine's device and dtype, its KV blocks."""
        plan = self.llm_engine.plan
        device, dtype = getattr(plan, "device", "?"), getattr(plan, "dtype", "?")
        blocks = self.llm_engine.load().num_blocks
        return f"{self.name} on {self.url} ({device}, {dtype}, {blocks} KV blocks)"

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM (status 0) or an engine failure (1); returns the exit status."""
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self._close()
        return self.exit_code

    def _on_engine_failure(self) -> None:
        """From the engine thread, once every request in flight has its error: uvicorn lets their responses
        go out (within its graceful-shutdown time) and exits; `run()` returns 1."""
        self.exit_code = 1
        self.uvicorn.should_exit = True

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
        self.async_engine.begin_shutdown(self.grace_s)
        self.uvicorn.should_exit = True
        self._thread.join(self.grace_s + 10)
        self._thread = None

    def _close(self) -> None:
        self.async_engine.stop()
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
    for warning in server.warnings:
        print(f"nanoengine serve: warning: {warning}", file=sys.stderr, flush=True)
    code = server.run()
    if (failure := server.async_engine.failure) is not None:
        print(f"nanoengine serve: the engine failed ({failure}); exiting with status {code}", file=sys.stderr,
              flush=True)
    print("nanoengine serve: stopped", file=sys.stderr, flush=True)
    return code
