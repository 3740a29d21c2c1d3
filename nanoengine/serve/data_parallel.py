"""`nanoengine serve MODEL --data-parallel-size N`: N engine replicas behind one OpenAI-compatible address.
Chapter 07 (beyond one machine; serving is chapter 05's appendix).

Each replica is an ordinary `nanoengine serve` process on loopback (`--port 0`: the OS picks its port, which
it prints; no race for one), with the user's engine options and limits, `cores // N` torch threads on a CPU
(or one GPU each), and a random API key in its environment that only this front end knows. The front end is
a small FastAPI app in this process: it reads each request's body, asks the router (`router.py`) for a
replica and forwards the body there unchanged (a stream chunk by chunk), so every answer, error and limit is
the replica's own; only the API key and the body limit are checked here first, as a single server does.

The router sees token ids: the prompt as the replica will see it (a text prompt through `encode_text`, a
chat through the engine's `apply_chat_template`), its full blocks hashed with the block manager's chained
hash at the replicas' block size (which each replica reports in /metrics, `nanoengine_cache_config_info`).

    GET  /health    200 {"status": "ok", "replicas": [...]} while a replica is up; 503 when none is
    GET  /metrics   every replica's families labelled replica="i", their totals, the router's counters
    GET  /v1/models the replicas' one model;  GET /v1/trace?replica=I&since=K: replica I's step trace
    POST /v1/completions, /v1/chat/completions: forwarded; the answer names its replica in the
                    `x-nanoengine-replica` header

A replica that exits is reported (stderr, /health, /metrics) and gets no more requests; each of its
requests in flight fails with 503 naming the replica, its pid and how it ended (a stream: an error chunk,
then `data: [DONE]`); the others serve on. When none is left the front end answers 503 and exits with
status 1. SIGINT/SIGTERM: the replicas get SIGTERM (their own shutdown grace lets in-flight requests finish),
the front end waits for them and exits with status 0. A replica dies with the front end, however that ends
(Linux's PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from nanoengine.config import EngineConfig
from nanoengine.distributed import launcher
from nanoengine.distributed.exits import exit_status
from nanoengine.errors import InvalidValueError
from nanoengine.flags import engine_flags
from nanoengine.serve.limits import ServerLimits
from nanoengine.serve.metrics import combine_replicas
from nanoengine.serve.router import POLICIES, REASONS, NoReplicaError, Router, prompt_block_hashes
from nanoengine.serve.routes import (
    SSE_HEADERS,
    BodyLimit,
    add_error_handlers,
    error_chunk,
    error_response,
    needs_key,
    unless_gone,
)
from nanoengine.serve.server import ShutdownUvicorn, bind_socket, check_access

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
REPLICA_HEADER = "x-nanoengine-replica"
POLL_S = 0.2  # how often the front end looks for replicas that exited
EXIT_WAIT_S = 2.0  # after a broken connection, how long to wait for its replica's exit to show
PASSED_ON = ("retry-after", "www-authenticate")  # response headers of a replica's error kept for the client


class Replica:
    """One `nanoengine serve` process on loopback; its output goes to our stderr, each line prefixed."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str]) -> None:
        self.index = index
        dies_with_us = launcher.die_with_parent(os.getpid(), signal.SIGTERM)  # its own clean shutdown
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, preexec_fn=dies_with_us)
        self.url: str | None = None  # http://127.0.0.1:PORT, once it listens
        self.about = ""  # its startup line's (device, dtype, KV blocks)
        self.ready = threading.Event()  # it printed its address, or its output ended
        self.tail: deque[str] = deque(maxlen=20)  # its last lines, for a startup failure's message
        self._reader = threading.Thread(target=self._read, name=f"replica-{index}-log", daemon=True)

    def start_reading(self) -> None:
        """Its output to our stderr, from a thread (started once every replica is forked: no thread may run
        while another replica forks)."""
        self._reader.start()

    @property
    def name(self) -> str:
        return f"replica {self.index} (pid {self.proc.pid})"

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            found = re.search(r" on (http://\S+)/v1 ?(.*)", line) if self.url is None else None
            if found:
                self.url, self.about = found.group(1), found.group(2)
                self.ready.set()
                continue
            self.tail.append(line)
            print(f"nanoengine serve [replica {self.index}]: {line.removeprefix('nanoengine serve: ')}",
                  file=sys.stderr, flush=True)
        self.ready.set()

    def status(self) -> str | None:
        """How it ended ('exited with status 1', ...), or None while it runs."""
        code = self.proc.poll()
        return None if code is None else exit_status(code)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Until it exits (SIGKILL after `timeout` seconds); its output read to the end."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._reader.ident is not None:  # started
            self._reader.join(5)


def replica_env(threads: int, key: str, gpus: list[str] | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NANOENGINE_API_KEY": key, "PYTHONUNBUFFERED": "1"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def gpus_for(size: int, engine_options: dict[str, Any]) -> list[list[str]] | None:
    """Each replica's GPUs (its tensor-parallel size of the visible ones, in order), None on a CPU; an error
    with too few GPUs."""
    if engine_options.get("device") == "cpu":
        return None
    import torch

    count, tp = torch.cuda.device_count(), engine_options.get("tensor_parallel_size", 1)
    if count == 0:
        return None
    if count < size * tp:
        raise InvalidValueError(f"--data-parallel-size {size} gives each replica its own {tp} GPU(s), but "
                                f"{count} are visible; use fewer replicas, or --device cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    return [ids[i * tp:(i + 1) * tp] for i in range(size)]


def replica_threads(size: int, threads: int | None = None) -> int:
    """Torch threads per replica: `threads`, or the cores this process may run on split between them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return threads or max(1, cores // size)


class FrontMetrics:
    """The front end's own counters (beside the replicas' families on /metrics)."""

    def __init__(self, size: int) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("nanoengine_router_requests", "requests sent to each replica, by why "
                              "(affinity, over_bound, least_loaded, round_robin)", ["replica", "reason"],
                              registry=r)
        self.lost = Counter("nanoengine_router_lost_requests", "requests in flight on a replica when it "
                            "exited or its connection broke", ["replica"], registry=r)
        self.refused = Counter("nanoengine_router_requests_refused", "requests the front end refused "
                               "(body_too_large, unavailable)", ["reason"], registry=r)
        self.in_flight = Gauge("nanoengine_router_in_flight", "requests in flight on each replica",
                               ["replica"], registry=r)
        self.up = Gauge("nanoengine_router_replica_up", "1 while the replica runs, 0 once it exited",
                        ["replica"], registry=r)
        self.num_up = Gauge("nanoengine_router_replicas_up", "replicas running", registry=r)
        for i in range(size):
            for reason in REASONS:
                self.routed.labels(replica=str(i), reason=reason)
            self.lost.labels(replica=str(i))

    def on_refused(self, reason: str) -> None:
        self.refused.labels(reason=reason).inc()

    def render(self, router: Router) -> bytes:
        for i, (n, up) in enumerate(zip(router.in_flight, router.up)):
            self.in_flight.labels(replica=str(i)).set(n)
            self.up.labels(replica=str(i)).set(int(up))
        self.num_up.set(router.num_up)
        return generate_latest(self.registry)


class _Families:
    """Parsed metric families as a registry for generate_latest."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


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
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{self.sock.getsockname()[1]}/v1"
        self.replicas = [Replica(i, argv, replica_env(self.threads, self._key, gpus and gpus[i]))
                         for i in range(size)]
        for r in self.replicas:
            r.start_reading()
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
        """Until every replica listens; reads the block size and batch size they report."""
        for r in self.replicas:
            while not r.ready.wait(0.5):
                pass
            if r.url is None:
                r.wait(5)
                lines = "\n  ".join(r.tail) or "(no output)"
                raise RuntimeError(f"{r.name} did not start: it {r.status()}; its last output:\n  {lines}")
        configs = set()
        for r in self.replicas:
            page = httpx.get(f"{r.url}/metrics", headers=self._auth, timeout=30).text
            found = re.search(r'nanoengine_cache_config_info\{([^}]*)\}', page)
            labels = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1))) if found else {}
            configs.add((int(labels.get("block_size", 0)), int(labels.get("max_num_seqs", 0))))
        if len(configs) != 1 or 0 in next(iter(configs)):
            raise RuntimeError(f"the replicas report different or no KV block sizes: {sorted(configs)}")
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
            return error_response(503, self.why_not_serving(), kind="service_unavailable")
        body = await request.body()
        try:
            choice = self.router.choose(self.block_hashes(path, body))
        except NoReplicaError:
            self.metrics.on_refused("unavailable")
            return error_response(503, self.why_not_serving(), kind="service_unavailable")
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
            return self.unavailable(await self.lost(r, e))
        if upstream is None:  # the client left: the cancelled send closed its connection; the replica aborts
            finish()
            return Response(status_code=499)
        mine = {REPLICA_HEADER: str(r.index)}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self.relay(upstream, r, finish), status_code=upstream.status_code,
                                     media_type="text/event-stream", headers={**SSE_HEADERS, **mine})
        try:
            content = await unless_gone(upstream.aread(), request)
        except httpx.TransportError as e:
            return self.unavailable(await self.lost(r, e))
        finally:
            await upstream.aclose()  # a client that left: the replica sees its connection close, and aborts
            finish()
        if content is None:
            return Response(status_code=499)  # nobody reads it
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
            yield (tail + error_chunk(await self.lost(r, e), "service_unavailable", 503)
                   + "data: [DONE]\n\n").encode()
        finally:
            await upstream.aclose()
            finish()

    @staticmethod
    def unavailable(message: str) -> Response:
        """503 for a request its replica lost: the client may retry it at once (another replica takes it)."""
        response = error_response(503, message, kind="service_unavailable")
        response.headers["Retry-After"] = "0"
        return response

    async def lost(self, r: Replica, error: Exception) -> str:
        """A request's connection to replica r broke: why, for its client (and r marked down if it exited)."""
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
            return self.unavailable(await self.lost(r, e))
        return Response(got.content, got.status_code, media_type=got.headers.get("content-type"),
                        headers={REPLICA_HEADER: str(r.index)})

    async def metrics_page(self) -> bytes:
        up = [r for r in self.replicas if self.router.up[r.index]]
        got = await asyncio.gather(*(self.client.get(r.url + "/metrics", headers=self._auth, timeout=10)
                                     for r in up), return_exceptions=True)
        pages = {r.index: g.text for r, g in zip(up, got) if isinstance(g, httpx.Response)
                 and g.status_code == 200}
        return generate_latest(_Families(combine_replicas(pages))) + self.metrics.render(self.router)

    def health(self) -> Response:
        if self.stopping or not self.router.num_up:
            return error_response(503, self.why_not_serving(), kind="service_unavailable")
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
                return error_response(503, self.why_not_serving(), kind="service_unavailable")
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
