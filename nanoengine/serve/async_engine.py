"""AsyncEngine: one background thread steps the `LLMEngine`; HTTP handlers talk to it through queues.
Chapter 05 (appendix).

The engine is not thread-safe, so only the engine thread touches it. A handler `submit`s prompts and
SamplingParams through a thread-safe command queue and awaits their acceptance: the engine thread runs
`make_request` for every prompt (tokenizing, checking, admission), so a bad request fails before any of it is
queued, with the engine's own error. Then the handler reads events from its `RequestStream`, an asyncio queue
that the engine thread fills after every step (one `call_soon_threadsafe` per step for all streams):
`Delta(index, text)` for new text, `ChoiceDone(index, finish_reason, stop_reason)` when a completion finishes,
and `RequestDone` when the whole request has, with its RequestOutputs. The engine thread steps whenever there
is work and sleeps on the command queue when there is none. Scheduling, stop rules and detokenization are the
engine's (`LLMEngine.step`); nothing here re-decides them.

`abort(stream)` (a client that went away) frees the request's blocks in the engine thread's next loop, within
one step. `begin_shutdown(grace_s)` refuses new requests, lets the in-flight ones run for up to `grace_s`,
then aborts the rest (their streams end with finish_reason "abort"); `stop()` ends the thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.engine.request import Request
from nanoengine.outputs import RequestOutput
from nanoengine.sampling_params import SamplingParams
from nanoengine.serve.metrics import ServerMetrics
from nanoengine.tokenizer import apply_chat_template
from nanoengine.trace import RunTrace

log = logging.getLogger("nanoengine.serve")
IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps on the command queue before looking again
MAX_TRACE_STEPS = 5_000  # a traced server stops recording after this many steps (each keeps a snapshot)


class ServerBusyError(RuntimeError):
    """The server is shutting down, or its engine thread is gone, or its queue is full (HTTP 503; with
    `retry_after` seconds, a Retry-After header)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStepError(RuntimeError):
    """The engine raised while stepping; the requests in that batch were aborted (HTTP 500)."""


@dataclass
class Delta:
    index: int  # choice index: prompt number * n + completion number
    text: str


@dataclass
class ChoiceDone:
    index: int
    finish_reason: str
    stop_reason: int | str | None


@dataclass
class RequestDone:
    prompt_index: int
    output: RequestOutput


@dataclass
class Failed:
    error: Exception


@dataclass
class RequestStream:
    """A handler's side of one HTTP request (one or more prompts, n completions each)."""

    request_id: str
    num_prompts: int
    n: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: asyncio.Future | None = None
    outputs: list[RequestOutput | None] = field(default_factory=list)
    done: bool = False

    def __post_init__(self) -> None:
        self.accepted = self.loop.create_future()
        self.outputs = [None] * self.num_prompts

    async def events(self) -> AsyncIterator[Delta | ChoiceDone]:
        """Deltas and finished choices until every prompt's request is done; an engine failure raises."""
        remaining = self.num_prompts
        while remaining:
            ev = await self.queue.get()
            if isinstance(ev, RequestDone):
                self.outputs[ev.prompt_index] = ev.output
                remaining -= 1
            elif isinstance(ev, Failed):
                self.done = True
                raise ev.error
            else:
                yield ev
        self.done = True

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI's usage: prompt tokens once per prompt, completion tokens over every choice."""
        outs = [o for o in self.outputs if o is not None]
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class _Live:
    """The engine thread's record of one engine request."""

    request: Request
    stream: RequestStream
    prompt_index: int
    reported: set[int] = field(default_factory=set)  # completion indices whose ChoiceDone was sent
    num_tokens: int = 0  # completion tokens counted so far (for the generation-tokens metric)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, trace: bool = False,
                 max_queued_seqs: int | None = None) -> None:
        """max_queued_seqs: the most sequences waiting to be scheduled (a request of n completions counts n);
        a request that would go beyond it is refused (503 with Retry-After) instead of queued. None: no
        limit."""
        self.engine = engine
        self.max_queued_seqs = max_queued_seqs
        self.metrics = metrics or ServerMetrics(engine.config.model)
        self.trace_enabled = trace
        self.trace: RunTrace | None = None  # the step trace, when recording one (--trace)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine request id -> its record (engine thread only)
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
            self.trace = self.engine.start_trace()
        self._thread = threading.Thread(target=self._run, name="nanoengine-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}-{time.time_ns() % 10**9:09d}"

    async def submit(self, prompts: list[Any], params: SamplingParams, request_id: str,
                     conversation: list[dict] | None = None) -> RequestStream:
        """Queue one request per prompt (or one for the conversation); raises the engine's error for a bad
        one, in which case none is queued."""
        if not self.healthy:
            raise ServerBusyError("the server is shutting down" if self._stopping
                                  else "the engine is not running")
        n_prompts = 1 if conversation is not None else len(prompts)
        stream = RequestStream(request_id, n_prompts, params.n, self._loop)
        self._commands.put(("add", stream, prompts, params, conversation, time.perf_counter()))
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the client left before the engine thread took the request
            self.abort(stream)
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """The client is gone: abort whatever of `stream` is still running (thread-safe, returns at once)."""
        if not stream.done:
            stream.done = True
            self._commands.put(("abort", stream))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine), run in the engine thread between steps (reading the trace or the block manager)."""
        fut = self._loop.create_future()
        self._commands.put(("call", fn, fut))
        return await fut

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; abort the in-flight ones still running after grace_s seconds."""
        self._stopping = True
        self._abort_at = time.perf_counter() + grace_s
        self._commands.put(("wake",))

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._stop.set()
        self._commands.put(("wake",))
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

        def put() -> None:
            for stream, events in batch:
                for ev in events:
                    stream.queue.put_nowait(ev)
        self._loop.call_soon_threadsafe(put)

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._handle_commands(block=not eng.has_unfinished())
            if self._abort_at is not None and time.perf_counter() >= self._abort_at and self._live:
                self._abort_all(None)
            if not eng.has_unfinished():
                self._publish(None)
                continue
            try:
                steps = eng.step_count
                deltas = eng.step()
            except Exception as e:  # noqa: BLE001 - the server keeps serving; these requests get the error
                log.error("engine step failed:\n%s", traceback.format_exc())
                self._abort_all(EngineStepError(f"the engine failed while stepping: {type(e).__name__}: {e}"))
                continue
            # (with overlap a call may launch a step and finish none: nothing to publish yet)
            self._publish(eng.stats[-1] if eng.step_count > steps else None, deltas)
        self._abort_all(None)

    def _handle_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = cmd[0]
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                self._abort_stream(cmd[1])
            elif kind == "call":
                fn, fut = cmd[1:]
                try:
                    self._resolve(fut, fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    self._resolve(fut, error=e)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, stream: RequestStream, prompts: list[Any], params: SamplingParams,
             conversation: list[dict] | None, arrival: float) -> None:
        eng = self.engine
        if self._stopping:
            self._resolve(stream.accepted, error=ServerBusyError("the server is shutting down"))
            return
        try:
            if conversation is not None:
                prompts = [{"prompt_token_ids": apply_chat_template(eng.tokenizer, conversation)}]
            reqs = [eng.make_request(p, params, f"{stream.request_id}-{i}") for i, p in enumerate(prompts)]
        except Exception as e:  # noqa: BLE001 - the engine's error (bad prompt, too long) goes to the handler
            self._resolve(stream.accepted, error=e)
            return
        waiting, new = len(eng.scheduler.waiting), len(reqs) * params.n
        if self.max_queued_seqs is not None and waiting + new > self.max_queued_seqs:
            self._resolve(stream.accepted, error=ServerBusyError(
                f"the queue is full: {waiting} sequences wait and this request adds {new}, beyond the "
                f"server's --max-queued-seqs {self.max_queued_seqs}; retry later", retry_after=1))
            return
        for i, req in enumerate(reqs):
            req.metrics.arrival_time = arrival  # when the HTTP request came in, not when this thread saw it
            eng.add(req)
            self._live[req.request_id] = _Live(req, stream, i)
            self.metrics.on_admitted(len(req.prompt_token_ids) * params.n)  # per sequence, as hits count
        self._resolve(stream.accepted, stream)

    def _abort_stream(self, stream: RequestStream) -> None:
        for rid in [rid for rid, live in self._live.items() if live.stream is stream]:
            self._finish(self._live.pop(rid), aborted=True)

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
            output = self._finish(live, aborted=True)
            events.append(Failed(error) if error is not None else RequestDone(live.prompt_index, output))
        self._deliver(list(batch.values()))
        self._publish(None)

    def _finish(self, live: _Live, aborted: bool = False) -> RequestOutput:
        req = live.request
        out = req.output()
        self.engine.abort(req.request_id)  # frees its blocks (a finished request only lets go)
        reason = "abort" if aborted else (out.outputs[0].finish_reason or "abort")
        self.metrics.on_finished(reason, req.metrics)
        return out

    def _publish(self, stats: Any, deltas: list[tuple[Request, int, str]] = ()) -> None:
        """After a step (its stats and text deltas) or idle: send every stream its new events, update the
        metrics."""
        eng, batch = self.engine, []
        if stats is not None:
            texts: dict[str, list[tuple[int, str]]] = {}
            for req, index, text in deltas:
                texts.setdefault(req.request_id, []).append((index, text))
            # only the requests this step touched: a long queue costs nothing here
            touched = dict.fromkeys([*texts, *(seq.request_id for seq in eng.last_sampled)])
            for rid in touched:
                live = self._live.get(rid)
                if live is None:  # aborted meanwhile
                    continue
                events = self._events(live, texts.get(rid, ()))
                if live.request.finished:
                    del self._live[rid]
                    events.append(RequestDone(live.prompt_index, self._finish(live)))
                if events:
                    batch.append((live.stream, events))
            self._deliver(batch)
            if eng.trace is not None and len(eng.trace.steps) >= MAX_TRACE_STEPS:
                log.warning("nanoengine serve: the trace reached %d steps; it stops recording",
                            MAX_TRACE_STEPS)
                eng.trace = None
        sch, bm = eng.scheduler, eng.block_manager
        self.metrics.on_step(stats, len(sch.running), len(sch.waiting), bm.num_used_blocks, bm.num_blocks)

    def _events(self, live: _Live, texts: Any) -> list[Any]:
        """One request's new text (the engine's deltas) and newly finished choices, in that order."""
        n = live.stream.n
        events: list[Any] = [Delta(live.prompt_index * n + i, text) for i, text in texts]
        tokens = 0
        for c in live.request.completions:
            seq = c.seq
            tokens += seq.num_completion_tokens
            if seq.is_finished and seq.index not in live.reported:
                live.reported.add(seq.index)
                events.append(ChoiceDone(live.prompt_index * n + seq.index, seq.finish_reason,
                                         seq.stop_reason))
        self.metrics.on_tokens(tokens - live.num_tokens)
        live.num_tokens = tokens
        return events
