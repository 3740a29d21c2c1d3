"""AsyncEngine: one background thread steps the engine; HTTP handlers talk to it through queues.
Chapter 05 (appendix). The engine is an `LLMEngine`, or any that speaks the engine protocol
(nanoengine/engine/protocol.py: `nanoengine serve --engine module:factory`).

The engine is not thread-safe, so only the engine thread touches it. A handler `submit`s prompts and
SamplingParams through a thread-safe command queue and awaits their acceptance: the engine thread runs
`make_request` for every prompt (tokenizing, checking, admission), so a bad request fails before any of it is
queued, with the engine's own error. Then the handler reads events (new text, finished choices) from its
`RequestStream`, an asyncio queue that the engine thread fills after every step (one `call_soon_threadsafe`
per step for all streams); `messages.py` has both kinds of message, `live.py` each request's record. The
engine thread steps whenever there is work and sleeps on the command queue when there is none. With logprobs,
each event carries those of the tokens put in place since its choice's last event, and a choice's first event
the prompt's; with echo, the engine thread (the tokenizer's one user) decodes each prompt's text and first
token for the handler.
Scheduling, stop rules and detokenization are the engine's (`LLMEngine.step`); nothing here re-decides them.
`abort(stream)` (its client went away) frees its blocks within one step; `begin_shutdown(grace_s)` refuses
new requests and aborts the in-flight ones still running after `grace_s` (their streams end with
finish_reason "abort"); `stop()` ends the thread.

The limits (`ServerLimits`) that need the engine are applied here: prompt tokens and the queue's length when
a request is added, the first-token timeout before every step (a deque of deadlines in arrival order, so a
long queue costs nothing), and a stream's unread chunks when they are delivered. A step that raises is fatal:
every request in flight ends with the error (HTTP 500), /health reports it, nothing more is accepted, and
`on_fatal` tells the server to exit with a non-zero status (a supervisor restarts it), because an engine that
failed mid-step may hold a broken KV cache (tests inject such a failure: `faults.py`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nanoengine.outputs import RequestOutput
from nanoengine.sampling_params import SamplingParams
from nanoengine.serve.faults import FAULT_ENV, injected_fault
from nanoengine.serve.limits import ServerLimits
from nanoengine.serve.live import Live
from nanoengine.serve.messages import (
    Abort,
    AddRequests,
    Call,
    ChatPrompt,
    ChoiceDone,
    EngineStepError,
    Failed,
    RequestDone,
    RequestStream,
    ServerBusyError,
    Wake,
)
from nanoengine.serve.metrics import ServerMetrics
from nanoengine.serve.protocol import ProtocolError
from nanoengine.trace import RunTrace

if TYPE_CHECKING:  # the engine (and torch) load where one is built, not in the data-parallel front end
    from nanoengine.engine.llm_engine import LLMEngine
    from nanoengine.engine.step import StepResult

log = logging.getLogger("nanoengine.serve")
flag = ServerLimits.flag  # a limit's `nanoengine serve` flag, for messages
IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps on the command queue before looking again
MAX_TRACE_STEPS = 5_000  # a traced server stops recording after this many steps (each keeps a snapshot)


class AsyncEngine:
    def __init__(self, llm_engine: LLMEngine, metrics: ServerMetrics | None = None, trace: bool = False,
                 limits: ServerLimits | None = None, on_fatal: Callable[[], None] | None = None) -> None:
        """limits: what the server takes (ServerLimits' defaults when None). on_fatal: called (from the engine
        thread) after a step raised and every request in flight was failed."""
        self.llm_engine = llm_engine
        self.limits = limits or ServerLimits()
        self.on_fatal = on_fatal
        self.failure: str | None = None  # "ExceptionName: message" once a step raised
        self._fault = injected_fault()
        # first-token deadlines in arrival order, with the request ids only: a finished stream is not kept
        self._deadlines: deque[tuple[float, list[str]]] = deque()
        self.metrics = metrics or ServerMetrics(getattr(getattr(llm_engine, "config", None), "model", ""))
        self.metrics.on_plan(llm_engine.plan, llm_engine.load().num_blocks)
        self.trace_enabled = trace
        self.trace: RunTrace | None = None  # the step trace, when recording one (--trace)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Live] = {}  # engine request id -> its record (engine thread only)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False  # no new requests
        self._abort_at: float | None = None  # when in-flight requests are aborted (shutdown)
        self._stop = threading.Event()
        self._ids = 0

    # ------------------------------------------------------------------ handler side (event loop thread)
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        if self.trace_enabled:
            self.trace = self.llm_engine.start_trace()
        self._thread = threading.Thread(target=self._run, name="nanoengine-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def why_not_serving(self) -> str:
        if self.failure is not None:
            return f"the engine failed ({self.failure}); the server is exiting"
        return "the server is shutting down" if self._stopping else "the engine is not running"

    def new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}-{time.time_ns() % 10**9:09d}"

    async def submit(self, prompts: list[Any], params: SamplingParams, request_id: str,
                     conversation: ChatPrompt | None = None, echo: bool = False) -> RequestStream:
        """Queue one request per prompt (or one for the conversation); raises the engine's error for a bad
        one, in which case none is queued. echo: fill stream.echo (each prompt's text and first token)."""
        if not self.healthy:
            self.metrics.on_refused("unavailable")
            raise ServerBusyError(self.why_not_serving())
        n_prompts = 1 if conversation is not None else len(prompts)
        stream = RequestStream(request_id, n_prompts, params.n, self._loop)
        self._commands.put(AddRequests(stream, prompts, params, conversation, time.perf_counter(), echo))
        try:
            while not (await asyncio.wait({stream.accepted}, timeout=IDLE_WAIT_S))[0]:
                if not self._thread.is_alive():  # it ended before taking the request
                    raise ServerBusyError(self.why_not_serving())
        except asyncio.CancelledError:  # the client left before the engine thread took the request
            self.abort(stream)
            raise
        return stream.accepted.result()

    def abort(self, stream: RequestStream) -> None:
        """The client is gone: abort whatever of `stream` is still running (thread-safe, returns at once)."""
        if not stream.done:
            stream.done = True
            self._commands.put(Abort(stream))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(llm_engine), run in the engine thread between steps (reading the trace or the block manager)."""
        answer = self._loop.create_future()
        self._commands.put(Call(fn, answer))
        return await answer

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; abort the in-flight ones still running after grace_s seconds."""
        self._stopping = True
        self._abort_at = time.perf_counter() + grace_s
        self._commands.put(Wake())

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._stop.set()
        self._commands.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _resolve(self, fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        def done() -> None:
            if fut.cancelled():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        self._loop.call_soon_threadsafe(done)

    def _deliver(self, batch: list[tuple[RequestStream, list[Any]]]) -> None:
        if not batch:
            return
        limit = self.limits.max_unread_chunks

        def put() -> None:
            for stream, events in batch:
                for ev in events:
                    stream.queue.put_nowait(ev)
                if limit is not None and not stream.done and stream.queue.qsize() > limit:
                    log.warning("request %s: its client left %d chunks unread (%s %d); aborted",
                                stream.request_id, stream.queue.qsize(), flag("max_unread_chunks"), limit)
                    self.metrics.on_refused("unread_chunks")
                    self.abort(stream)  # frees its blocks; its client, should it read on, learns why:
                    stream.queue.put_nowait(Failed(ServerBusyError(
                        f"aborted: the client left more than {limit} stream chunks unread "
                        f"({flag('max_unread_chunks')})", retry_after=1)))
        self._loop.call_soon_threadsafe(put)

    def _run(self) -> None:
        eng, calls = self.llm_engine, 0
        while not self._stop.is_set():
            self._handle_commands(block=not eng.has_unfinished())
            now = time.perf_counter()
            if self._abort_at is not None and now >= self._abort_at and self._live:
                self._abort_all(None)
            if self._deadlines and self._deadlines[0][0] <= now:
                self._expire(now)
            if not eng.has_unfinished():
                self._publish(None)
                continue
            try:
                calls += 1
                if self._fault is not None and calls == self._fault[1]:
                    raise self._fault[0](f"injected by {FAULT_ENV} at step {calls}")
                result = eng.step()
            except Exception as e:  # noqa: BLE001 - fatal: every request in flight gets the error, then exit
                self._fail(e)
                break
            self._publish(result)  # (with overlap a call may launch a step and finish none: stats None)
        if self.failure is None:
            self._abort_all(None)
        self._refuse_pending()

    def _fail(self, e: Exception) -> None:
        """A step raised: fail every request in flight with it, refuse new ones, tell the server."""
        log.error("engine step failed; failing every request in flight and exiting:\n%s",
                  traceback.format_exc())
        self.failure = f"{type(e).__name__}: {e}"
        self._stopping = True
        self._abort_all(EngineStepError(f"the engine failed while stepping ({self.failure}); the server is "
                                        "exiting"))
        if self.on_fatal is not None:
            self.on_fatal()

    def _refuse_pending(self) -> None:
        """The thread ends: answer whatever is still queued (a request arriving meanwhile must not hang)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequests | Call):  # each has a handler awaiting its answer
                self._resolve(cmd.answer, error=ServerBusyError(self.why_not_serving()))

    def _expire(self, now: float) -> None:
        """Fail the requests whose first-token deadline passed before their first token came."""
        timeout = self.limits.first_token_timeout_s
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_ids = self._deadlines.popleft()
            lives = [self._live[rid] for rid in request_ids if rid in self._live]
            if any(live.request.metrics.first_token_time is None for live in lives):
                self.metrics.on_refused("first_token_timeout")
                self._fail_stream(lives[0].stream, ServerBusyError(
                    f"aborted: no first token within {timeout:g} s (the server's "
                    f"{flag('first_token_timeout_s')}); the server is overloaded, retry later",
                    retry_after=max(1, round(timeout / 10))))

    def _handle_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            match cmd:
                case AddRequests():
                    self._add(cmd)
                case Abort(stream):
                    self._abort_stream(stream)
                case Call(fn, answer):
                    try:
                        self._resolve(answer, fn(self.llm_engine))
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        self._resolve(answer, error=e)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, add: AddRequests) -> None:
        eng, stream, params = self.llm_engine, add.stream, add.params
        prompts, conversation = add.prompts, add.conversation
        if self._stopping:
            self._resolve(stream.accepted, error=ServerBusyError("the server is shutting down"))
            return
        try:
            if conversation is not None:
                prompts = [{"prompt_token_ids": conversation.token_ids(eng.tokenizer)}]
            reqs = [eng.make_request(p, params, f"{stream.request_id}-{i}") for i, p in enumerate(prompts)]
            if add.echo:
                decode = eng.tokenizer.decode
                stream.echo = [(r.prompt if r.prompt is not None else decode(r.prompt_token_ids),
                                decode(r.prompt_token_ids[:1])) for r in reqs]
        except Exception as e:  # noqa: BLE001 - the engine's error (bad prompt, too long) goes to the handler
            self._resolve(stream.accepted, error=e)
            return
        limits = self.limits
        longest = max(len(r.prompt_token_ids) for r in reqs)
        if limits.max_prompt_tokens is not None and longest > limits.max_prompt_tokens:
            self.metrics.on_refused("prompt_tokens")
            self._resolve(stream.accepted, error=ProtocolError(
                f"a prompt of {longest} tokens is longer than this server takes ({flag('max_prompt_tokens')} "
                f"{limits.max_prompt_tokens}); shorten it", "prompt" if conversation is None else "messages"))
            return
        waiting, new = eng.load().num_waiting, len(reqs) * params.n
        if limits.max_queued_seqs is not None and waiting + new > limits.max_queued_seqs:
            self.metrics.on_refused("queue_full")
            self._resolve(stream.accepted, error=ServerBusyError(
                f"the queue is full: {waiting} sequences wait and this request adds {new}, beyond the "
                f"server's {flag('max_queued_seqs')} {limits.max_queued_seqs}; retry later", retry_after=1))
            return
        for i, req in enumerate(reqs):
            req.metrics.arrival_time = add.arrival  # when the HTTP request came, not when this thread saw it
            eng.add(req)
            self._live[req.request_id] = Live(req, stream, i)
            stream.request_ids.append(req.request_id)
            self.metrics.on_admitted(len(req.prompt_token_ids) * params.n)  # per sequence, as hits count
        if limits.first_token_timeout_s is not None:
            self._deadlines.append((add.arrival + limits.first_token_timeout_s, stream.request_ids))
        self._resolve(stream.accepted, stream)

    def _abort_stream(self, stream: RequestStream) -> None:
        for rid in stream.request_ids:
            if rid in self._live:
                self._finish(self._live.pop(rid), aborted=True)

    def _fail_stream(self, stream: RequestStream, error: Exception) -> None:
        """Abort what is left of one request; its handler raises `error`."""
        self._abort_stream(stream)
        self._deliver([(stream, [Failed(error)])])

    def _abort_all(self, error: Exception | None) -> None:
        """Abort every live request; its stream ends with finish_reason 'abort', or with `error`."""
        batch: dict[int, tuple[RequestStream, list[Any]]] = {}
        for rid in list(self._live):
            live = self._live.pop(rid)
            n = live.stream.n
            events = batch.setdefault(id(live.stream), (live.stream, []))[1]
            if error is None:
                events.extend(ChoiceDone(live.prompt_index * n + i, "abort", None)
                              for i in range(n) if i not in live.reported)
                events.append(RequestDone(live.prompt_index, self._finish(live, aborted=True)))
                continue
            try:  # after a failed step the engine's state may be broken: the client hears of it regardless
                self._finish(live, aborted=True)
            except Exception:  # noqa: BLE001
                log.exception("could not abort request %s after the failure", rid)
            if not events:
                events.append(Failed(error))
        self._deliver(list(batch.values()))
        self._publish(None)

    def _finish(self, live: Live, aborted: bool = False) -> RequestOutput:
        req = live.request
        out = req.output()
        self.llm_engine.abort(req.request_id)  # frees its blocks (a finished request only lets go)
        reason = "abort" if aborted else (out.outputs[0].finish_reason or "abort")
        self.metrics.on_finished(reason, req.metrics)
        return out

    def _publish(self, result: StepResult | None = None) -> None:
        """After a step (its StepResult) or idle: send every stream its new events, update the metrics."""
        eng, batch = self.llm_engine, []
        stats = None if result is None else result.stats
        if result is not None:  # (deltas and tokens; an engine of one's own may keep no stats)
            texts: dict[str, list[tuple[int, str]]] = {}
            for req, index, text in result.deltas:
                texts.setdefault(req.request_id, []).append((index, text))
            # only the requests this step touched: a long queue costs nothing here
            touched = dict.fromkeys([*texts, *(seq.request_id for seq, _ in result.sampled)])
            for rid in touched:
                live = self._live.get(rid)
                if live is None:  # aborted meanwhile
                    continue
                events, tokens = live.events(texts.get(rid, ()))
                self.metrics.on_tokens(tokens)
                if live.request.finished:
                    del self._live[rid]
                    events.append(RequestDone(live.prompt_index, self._finish(live)))
                if events:
                    batch.append((live.stream, events))
            self._deliver(batch)
            trace = getattr(eng, "trace", None)  # (recording: --trace)
            if trace is not None and len(trace.steps) >= MAX_TRACE_STEPS:
                log.warning("nanoengine serve: the trace reached %d steps; it stops recording",
                            MAX_TRACE_STEPS)
                eng.stop_trace()
        self.metrics.on_step(stats, *eng.load())
