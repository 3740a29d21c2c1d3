"""`nanoengine serve MODEL --data-parallel-size N`: N engine replicas behind one OpenAI-compatible address.
Chapter 07 (beyond one machine; serving is chapter 05's appendix).

Each replica is an ordinary `nanoengine serve` process on loopback (`replicas.py`), with the user's engine
options and limits, `cores // N` torch threads on a CPU (or its own GPUs), and a random API key in its
environment that only this front end knows. The front end is a small FastAPI app in this process: it reads
each request's body, asks the router (`router.py`) for a replica and forwards the body there unchanged (a
stream chunk by chunk), so every answer, error and limit is the replica's own; only the API key and the body
limit are checked here first, as a single server does (with the same code: `http.py`).

The router sees token ids: the prompt as the replica will see it (a text prompt through `encode_text`, a
chat through the engine's `apply_chat_template`), its full blocks hashed with the block manager's chained
hash at the replicas' block size (which each replica reports at `GET /server_info`).

    GET  /health    200 {"status": "ok", "replicas": [...]} while a replica is up; 503 when none is
    GET  /metrics   every replica's families labelled replica="i", their totals, the router's counters
    GET  /v1/models the replicas' one model;  GET /v1/trace?replica=I&since=K: replica I's step trace
    POST /v1/completions, /v1/chat/completions: forwarded; the answer names its replica in the
                    `x-nanoengine-replica` header

A replica that exits is reported (stderr, /health, /metrics) and gets no more requests; each of its
requests in flight fails with 503 naming the replica, its pid and how it ended (a stream: an error chunk,
then `data: [DONE]`); the others serve on. When none is left the front end answers 503 and exits with
status 1. SIGINT/SIGTERM: the replicas get SIGTERM (their own shutdown grace lets in-flight requests finish),
the front end waits for them and exits with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from nanoengine.config import EngineConfig
from nanoengine.errors import InvalidValueError
from nanoengine.flags import engine_flags
from nanoengine.serve.http import (
    DONE,
    BodyLimit,
    ShutdownUvicorn,
    add_error_handlers,
    base_url,
    bind_socket,
    check_access,
    client_gone,
    error_chunk,
    error_response,
    needs_key,
    service_unavailable,
    sse_response,
    unless_gone,
)
from nanoengine.serve.limits import ServerLimits
from nanoengine.serve.metrics import FrontMetrics, render_replicas
from nanoengine.serve.replicas import Replica, gpus_for, replica_threads, start_replicas
from nanoengine.serve.router import POLICIES, NoReplicaError, Router, prompt_block_hashes

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
REPLICA_HEADER = "x-nanoengine-replica"
POLL_S = 0.2  # how often the front end looks for replicas that exited
EXIT_WAIT_S = 2.0  # after a broken connection, how long to wait for its replica's exit to show
PASSED_ON = ("retry-after", "www-authenticate")  # response headers of a replica's error kept for the client


class DataParallelServer:
    """N `nanoengine serve` replicas and the front end that routes between them; `run()` serves in the
    foreground (from the main thread: a replica ends with the thread that started it) until SIGINT/SIGTERM
    (status 0) or until every replica is gone (status 1)."""

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 8000, *, size: int = 2,
                 policy: str | None = None, max_in_flight: int | None = None, threads: int | None = None,
                 served_model_name: str | None = None, trace: bool = False, shutdown_grace_s: float = 2.0,
                 log_level: str = "info", engine_options: dict[str, Any] | None = None,
                 api_key: str | None = None, protect_metrics: bool = False,
                 limits: ServerLimits | None = None) -> None:
        """size: replicas (>= 2); policy: the router's (router.POLICIES; cache_aware when None);
        max_in_flight: the router's bound (the replicas' max_num_seqs when None); threads: torch threads per
        replica (CPU cores // size when None). The rest as `server.Server`'s, for each replica."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise InvalidValueError(f"--data-parallel-size must be an integer >= 2 for replicas (1: one "
                                    f"engine in this process, the plain `nanoengine serve`), got {size!r}")
        policy = policy or "cache_aware"
        if policy not in POLICIES:
            raise InvalidValueError(f"--router must be one of {', '.join(POLICIES)}, got {policy!r}")
        if max_in_flight is not None and policy != "cache_aware":
            raise InvalidValueError("--router-max-in-flight bounds cache-aware routing; leave it out with "
                                    f"--router {policy}")
        if threads is not None and threads < 1:
            raise InvalidValueError(f"--threads must be >= 1, got {threads}")
        self.router = Router(size, policy, max_in_flight or 1)  # checks the bound (set below when None)
        self.warnings = check_access(host, api_key, protect_metrics)
        self.limits = limits or ServerLimits()
        self.name = served_model_name or str(model)
        self.grace_s, self.api_key, self.protect_metrics = shutdown_grace_s, api_key, protect_metrics
        self.policy = policy
        engine_options = dict(engine_options or {})
        EngineConfig.from_kwargs(model=str(model), **engine_options)  # a bad option: one error, no replica
        gpus = gpus_for(size, engine_options)
        self.threads = replica_threads(size, threads)
        self._key = secrets.token_urlsafe(24)  # only this front end talks to the replicas
        argv = [sys.executable, "-m", "nanoengine", "serve", str(model), "--host", "127.0.0.1", "--port", "0",
                "--served-model-name", self.name, "--log-level", log_level, "--shutdown-grace",
                str(shutdown_grace_s), "--threads", str(self.threads), "--protect-metrics",
                *(["--trace"] if trace else []), *self.limits.as_flags(), *engine_flags(engine_options)]
        self.sock = bind_socket(host, port)  # first: a port in use fails before any model loads
        self.url = base_url(host, self.sock)
        self.replicas = start_replicas(size, argv, self.threads, self._key, gpus)
        self.exit_code = 0
        self.stopping = False
        try:
            from nanoengine.assets import resolve_model
            from nanoengine.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(resolve_model(model))  # while the replicas load
            self._await_replicas()
            self.router.max_in_flight = max_in_flight or self.max_num_seqs
            prometheus_client.disable_created_metrics()  # as a single server's page: no *_created series
            self.metrics = FrontMetrics(size)
            config = uvicorn.Config(self.build_app(), log_level=log_level, access_log=False,
                                    timeout_graceful_shutdown=int(shutdown_grace_s) + 5)
            self.uvicorn = ShutdownUvicorn(config, on_exit=self.begin_shutdown)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ starting and stopping
    def _await_replicas(self) -> None:
        """Until every replica listens; reads the block size and batch size they report (/server_info)."""
        for r in self.replicas:
            r.wait_listening()
        configs = set()
        for r in self.replicas:
            got = httpx.get(f"{r.url}/server_info", headers=self._auth, timeout=30)
            if got.status_code != 200:
                raise RuntimeError(f"{r.name} answered GET /server_info with {got.status_code}: {got.text}")
            configs.add((got.json()["block_size"], got.json()["max_num_seqs"]))
        if len(configs) != 1:
            raise RuntimeError(f"the replicas report different KV block or batch sizes: {sorted(configs)}")
        self.block_size, self.max_num_seqs = next(iter(configs))

    def describe(self) -> str:
        bound = "" if self.policy != "cache_aware" else f", at most {self.router.max_in_flight} in flight"
        return (f"{self.name} on {self.url} (data parallel: {len(self.replicas)} replicas of {self.threads} "
                f"thread(s), router {self.policy}{bound}, block size {self.block_size})")

    def begin_shutdown(self) -> None:
        """SIGINT/SIGTERM: no new requests here; the replicas begin their own graceful shutdown."""
        self.stopping = True
        for r in self.replicas:
            r.terminate()

    def close(self) -> None:
        for r in self.replicas:
            r.terminate()
        for r in self.replicas:
            r.wait(self.grace_s + 10)
        self.sock.close()

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM (status 0) or every replica is gone (1); returns the exit status."""
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.close()
        return self.exit_code

    @property
    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._key}"}

    async def _watch(self) -> None:
        """Notice replicas that exit (not while shutting down); with none left, exit with status 1."""
        while not self.stopping:
            for r in self.replicas:
                if self.router.up[r.index] and r.status() is not None:
                    self._mark_down(r)
            await asyncio.sleep(POLL_S)

    def _mark_down(self, r: Replica) -> None:
        if not self.router.up[r.index] or self.stopping:
            return
        self.router.mark_down(r.index)
        left = self.router.num_up
        print(f"nanoengine serve: {r.name} {r.status()}; {left} of {len(self.replicas)} replicas serve on",
              file=sys.stderr, flush=True)
        if left == 0:
            print("nanoengine serve: no replica is left; exiting with status 1", file=sys.stderr, flush=True)
            self.exit_code = 1
            self.uvicorn.should_exit = True

    def why_not_serving(self) -> str:
        if self.stopping:
            return "the server is shutting down"
        gone = "; ".join(f"{r.name} {r.status()}" for r in self.replicas if r.status() is not None)
        return f"no replica is left to serve ({gone}); the server is exiting"

    # ------------------------------------------------------------------ routing and forwarding
    def block_hashes(self, path: str, body: bytes) -> list[int]:
        """The prompt's full-block hashes, as its replica will name them; [] for a body that is not a valid
        request (the replica answers it with the error) or with round-robin routing."""
        from nanoengine.serve.protocol import ChatCompletionRequest, CompletionRequest
        from nanoengine.tokenizer import apply_chat_template, encode_text

        if self.policy != "cache_aware":
            return []
        try:
            if path == CHAT:
                ids = apply_chat_template(self.tokenizer, ChatCompletionRequest.model_validate_json(body)
                                          .conversation())
            else:
                prompt = CompletionRequest.model_validate_json(body).prompts()[0]  # the request's first
                ids = encode_text(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        except Exception:  # noqa: BLE001 - a bad request: no affinity, and the replica says what is wrong
            return []
        return prompt_block_hashes(ids, self.block_size)

    async def forward(self, request: Request, path: str) -> Response:
        if self.stopping or not self.router.num_up:
            self.metrics.on_refused("unavailable")
            return service_unavailable(self.why_not_serving())
        body = await request.body()
        try:
            choice = self.router.choose(self.block_hashes(path, body))
        except NoReplicaError:
            self.metrics.on_refused("unavailable")
            return service_unavailable(self.why_not_serving())
        r = self.replicas[choice.replica]
        self.metrics.routed.labels(replica=str(r.index), reason=choice.reason).inc()
        self.router.start(r.index)
        finished = False

        def finish() -> None:
            nonlocal finished
            if not finished:
                finished = True
                self.router.finish(r.index)

        headers = {**self._auth, "content-type": request.headers.get("content-type", "application/json")}
        send = self.client.send(self.client.build_request("POST", r.url + path, content=body,
                                                          headers=headers), stream=True)
        try:  # a non-streamed answer's headers come with its whole body: meanwhile, watch the client
            upstream = await unless_gone(send, request)
        except httpx.TransportError as e:
            finish()
            return service_unavailable(await self.lost(r, e), retry_after=0)
        if upstream is None:  # the client left: the cancelled send closed its connection; the replica aborts
            finish()
            return client_gone()
        mine = {REPLICA_HEADER: str(r.index)}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return sse_response(self.relay(upstream, r, finish), upstream.status_code, headers=mine)
        try:
            content = await unless_gone(upstream.aread(), request)
        except httpx.TransportError as e:
            return service_unavailable(await self.lost(r, e), retry_after=0)
        finally:
            await upstream.aclose()  # a client that left: the replica sees its connection close, and aborts
            finish()
        if content is None:
            return client_gone()
        kept = {k: upstream.headers[k] for k in PASSED_ON if k in upstream.headers}
        return Response(content, upstream.status_code, headers={**kept, **mine},
                        media_type=upstream.headers.get("content-type"))

    async def relay(self, upstream: httpx.Response, r: Replica,
                    finish: Callable[[], None]) -> AsyncIterator[bytes]:
        """A replica's stream, chunk by chunk; if it breaks, an error chunk naming the replica, then
        [DONE]."""
        ended = True  # the last chunk ended an SSE event
        try:
            async for chunk in upstream.aiter_raw():
                ended = chunk.endswith(b"\n\n")
                yield chunk
        except httpx.TransportError as e:
            tail = "" if ended else "\n\n"
            yield (tail + error_chunk(await self.lost(r, e), "service_unavailable", 503) + DONE).encode()
        finally:
            await upstream.aclose()
            finish()

    async def lost(self, r: Replica, error: Exception) -> str:
        """A request's connection to replica r broke: why, for its client (and r marked down if it exited).
        Its 503 says Retry-After: 0: another replica takes the request at once."""
        self.metrics.lost.labels(replica=str(r.index)).inc()
        deadline = time.monotonic() + EXIT_WAIT_S
        while r.status() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if r.status() is None:
            return (f"the connection to {r.name} broke ({type(error).__name__}: {error}); the request is "
                    "lost: retry it")
        self._mark_down(r)
        left = self.router.num_up
        serving = f"{left} replica(s) serve on" if left else "no replica is left; the server is exiting"
        return f"{r.name} {r.status()} while serving this request, which is lost; retry it ({serving})"

    async def get(self, r: Replica, path: str, params: dict | None = None) -> Response:
        """A GET forwarded to replica r, its answer as it is."""
        try:
            got = await self.client.get(r.url + path, params=params, headers=self._auth)
        except httpx.TransportError as e:
            return service_unavailable(await self.lost(r, e), retry_after=0)
        return Response(got.content, got.status_code, media_type=got.headers.get("content-type"),
                        headers={REPLICA_HEADER: str(r.index)})

    async def metrics_page(self) -> bytes:
        up = [r for r in self.replicas if self.router.up[r.index]]
        got = await asyncio.gather(*(self.client.get(r.url + "/metrics", headers=self._auth, timeout=10)
                                     for r in up), return_exceptions=True)
        pages = {r.index: g.text for r, g in zip(up, got) if isinstance(g, httpx.Response)
                 and g.status_code == 200}
        return render_replicas(pages) + self.metrics.render(self.router)

    def health(self) -> Response:
        if self.stopping or not self.router.num_up:
            return service_unavailable(self.why_not_serving())
        replicas = [{"replica": r.index, "pid": r.proc.pid, "up": self.router.up[r.index],
                     "in_flight": self.router.in_flight[r.index], "status": r.status() or "running"}
                    for r in self.replicas]
        return JSONResponse({"status": "ok", "replicas_up": self.router.num_up, "replicas": replicas})

    # ------------------------------------------------------------------ the app
    def build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10), limits=limits)
            watch = asyncio.create_task(self._watch())
            try:
                yield
            finally:
                watch.cancel()
                await self.client.aclose()

        app = FastAPI(title="nanoengine (data parallel)", lifespan=lifespan)
        if self.limits.max_body_bytes is not None:
            app.add_middleware(BodyLimit, max_bytes=self.limits.max_body_bytes, metrics=self.metrics)
        add_error_handlers(app)
        auth = needs_key(self.api_key)
        metrics_auth = auth if self.protect_metrics else []

        @app.get("/health")
        async def health() -> Response:
            return self.health()

        @app.get("/metrics", dependencies=metrics_auth)
        async def metrics() -> Response:
            return Response(await self.metrics_page(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models", dependencies=auth)
        async def models() -> Response:
            up = [r for r in self.replicas if self.router.up[r.index]]
            if not up:
                return service_unavailable(self.why_not_serving())
            return await self.get(up[0], "/v1/models")

        @app.get("/v1/trace", dependencies=auth)
        async def trace(replica: int = 0, since: int = 0) -> Response:
            if not 0 <= replica < len(self.replicas):
                return error_response(400, f"replica must be in 0..{len(self.replicas) - 1}, got {replica}",
                                      param="replica")
            return await self.get(self.replicas[replica], "/v1/trace", {"since": since})

        @app.post(COMPLETIONS, dependencies=auth)
        async def completions(request: Request) -> Response:
            return await self.forward(request, COMPLETIONS)

        @app.post(CHAT, dependencies=auth)
        async def chat(request: Request) -> Response:
            return await self.forward(request, CHAT)

        return app


def serve_data_parallel(model: str, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> int:
    """`nanoengine serve --data-parallel-size N`: start the replicas, serve until SIGINT/SIGTERM or until
    every replica is gone; returns the exit status. options: those of DataParallelServer."""
    try:
        server = DataParallelServer(model, host, port, **options)
    except RuntimeError as e:  # a replica did not start (the others are stopped)
        print(f"nanoengine serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"nanoengine serve: {server.describe()}", flush=True)
    for r in server.replicas:
        print(f"nanoengine serve: {r.name} on port {r.url.rsplit(':', 1)[1]} {r.about}", flush=True)
    for warning in server.warnings:
        print(f"nanoengine serve: warning: {warning}", file=sys.stderr, flush=True)
    code = server.run()
    print("nanoengine serve: stopped", file=sys.stderr, flush=True)
    return code
