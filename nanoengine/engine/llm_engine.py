"""LLMEngine: the step loop that ties tokenizer, scheduler, input builder, executor and sampler together.
Chapters 00 and 05.

`add_request` turns a prompt into a Request of n Sequences, each with its Completion. Each `step` is:
- schedule: the scheduler picks the batch and commits it, once, before the forward (`Scheduler.schedule`);
- launch: the input builder lays it out; the executor runs it on every rank and draws its tokens;
- finish: once the tokens are known, the scheduler puts them in place and applies the stop rules
  (`Scheduler.update`), each Completion turns its tokens into text (stop strings), and the step is recorded.
Extensions enter at declared hooks (engine/hooks.py: request checks, drafts, logits masks, row reducers, the
step loop, step observers), which the engine calls without knowing who is behind them. The loop comes from the
parts (`assemble()`): `StepLoop` (engine/step.py) runs one step per call; overlap scheduling (chapter 06) is
engine/overlap.py's `OverlapLoop`. `nanoengine.launch.build_engine` builds an engine (settings -> plan ->
parts -> executor) for `LLM` and the server.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING, Any

import torch

from nanoengine.config import EngineConfig
from nanoengine.engine.executor import Executor
from nanoengine.engine.hooks import DraftSource, NoGrammars, StepObserver, draft_source
from nanoengine.engine.inputs import InputBuilder
from nanoengine.engine.interrupts import held_interrupts
from nanoengine.engine.logits_masks import MinTokens
from nanoengine.engine.logprob_outputs import LogprobOutputs
from nanoengine.engine.parts import EngineParts
from nanoengine.engine.request import Request, check_token_ids, new_request
from nanoengine.engine.sampling import SamplingBatcher
from nanoengine.engine.scheduler_output import ScheduledSeq, SchedulerOutput, StepUpdate
from nanoengine.engine.sequence import Sequence
from nanoengine.engine.step import EngineLoad, LaunchedStep, StepLoop, StepResult, StepTimes, TextDelta
from nanoengine.errors import InvalidValueError
from nanoengine.plan import EnginePlan
from nanoengine.sampling_params import SamplingParams
from nanoengine.tokenizer import eos_token_ids
from nanoengine.trace import RunTrace, StepStats, TraceRecorder

if TYPE_CHECKING:
    from nanoengine.engine.overlap import OverlapLoop
    from nanoengine.spec.verify import SpecCounts
    from nanoengine.structured import StructuredOutputs

STATS_KEPT = 100_000  # StepStats kept by an engine (~25 MB)


class LLMEngine:
    def __init__(self, config: EngineConfig, plan: EnginePlan, parts: EngineParts, executor: Executor,
                 tokenizer: Any, build_engine: Callable[..., Any] | None = None) -> None:
        """The engine over a started executor (see nanoengine.launch.build_engine, which makes the rest and
        hands itself down as `build_engine`, for a draft model's engine). Its hooks (engine/hooks.py): the
        request checks, the draft source, the logits masks, the row reducer, the step loop and the step
        observers."""
        self.config = config  # what the user asked for
        self.plan = plan  # what it resolved to here
        self.model_path = plan.model_path
        self.tokenizer = tokenizer
        self.executor = executor
        self.block_manager = parts.block_manager_class(executor.num_kv_blocks, plan.block_size,
                                                       plan.enable_prefix_caching)
        self.eos_token_ids = eos_token_ids(plan.model_path, plan.hf_config, tokenizer)
        self.drafts: DraftSource = draft_source(config, plan, parts, tokenizer, executor.num_kv_blocks,
                                                build_engine)  # speculative decoding's, or none
        # told of every request and step: the draft source (its cost model), and a trace's recorder while
        # one records (start_trace)
        self.observers: list[StepObserver] = [self.drafts]
        self.scheduler = parts.scheduler_class(self.block_manager, self.eos_token_ids,
                                               max_num_batched_tokens=plan.max_num_batched_tokens,
                                               max_num_seqs=plan.max_num_seqs,
                                               max_model_len=plan.max_model_len,
                                               policy=plan.scheduling_policy)
        self.inputs = InputBuilder(plan.block_size, executor.device, parts.attention_layout,
                                   max_tokens=max(plan.max_num_batched_tokens, plan.max_model_len),
                                   max_seqs=plan.max_num_seqs, max_blocks=plan.max_blocks_per_seq)
        self.sampling = SamplingBatcher(plan.hf_config.vocab_size, executor.device)
        # what steps reduce, where it goes; it checks what a request asks (max_logprobs)
        self.logprobs = LogprobOutputs(tokenizer, config.logprobs_mode, config.max_logprobs)
        # grammars of structured outputs: none until a request asks (NoGrammars.for_request, `structured`),
        # so nanoengine/structured.py and its library are imported only then
        self.grammars: StructuredOutputs | NoGrammars = NoGrammars(tokenizer, plan.hf_config.vocab_size,
                                                                   self.eos_token_ids)
        self._grammars_made = threading.Lock()  # (the server compiles a request's grammar on another thread)
        self.min_tokens = MinTokens(self.eos_token_ids, plan.hf_config.vocab_size)  # (over the grammars)
        self.requests: dict[str, Request] = {}
        self._request_ids = count()
        self.step_count = 0  # steps finished
        # one step at a time, or overlap scheduling's loop (a step in flight while the next is scheduled):
        # the parts' choice (assemble)
        self.loop: StepLoop | OverlapLoop = parts.loop(self)
        self.trace: RunTrace | None = None  # what start_trace records into (its recorder: an observer)
        # one per step, the newest STATS_KEPT (a long-lived engine must not grow without bound);
        # LLM.generate clears it at the start of a run (clear_stats)
        self.stats: deque[StepStats] = deque(maxlen=STATS_KEPT)
        self.start_time = time.perf_counter()  # the clock of StepStats.time and the traces

    # -------------------------------------------------------------------------------------- requests
    def make_request(self, prompt: Any, params: SamplingParams | None = None,
                     request_id: str | None = None, final_only: bool = False) -> Request:
        """Tokenize and check a request without queueing it (so a batch can be checked before any is
        added). final_only: its text is read only once it is done, so `step` makes no deltas for it and
        (without stop strings) it is detokenized once, at the end (see Completion)."""
        rid = request_id if request_id is not None else str(next(self._request_ids))
        if rid in self.requests:
            raise InvalidValueError(f"request id {rid!r} is already in use")
        req = new_request(prompt, params, self.tokenizer, self.plan.hf_config.vocab_size, rid,
                          self.plan.block_size, final_only)
        params = req.params
        self.logprobs.check(params)  # (request checks: engine/hooks.py) at most max_logprobs
        with self._grammars_made:  # the grammars that serve it (made when a request first asks for one)
            grammars = self.grammars = self.grammars.for_request(params)
        grammars.check(params)  # its grammar compiled now (cached): a bad schema fails here
        seqs = req.seqs
        for s in seqs[1:] if self.plan.enable_prefix_caching else ():
            s.wait_for = seqs[0]  # siblings share the first one's prompt blocks through the prefix cache
        self.scheduler.check_admission(seqs[0])
        return req

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for s in request.seqs:
            self.scheduler.add(s)
            self.grammars.add(s)
        for observer in self.observers:
            observer.added(request.seqs)

    def add_request(self, prompt: Any, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        req = self.make_request(prompt, params, request_id)
        self.add(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Forget a request: its unfinished sequences are aborted (blocks freed);
        finished ones just let go."""
        req = self.requests.pop(request_id, None)
        for s in req.seqs if req is not None else ():
            self.scheduler.abort(s)
            self.sampling.release(s)
            self.grammars.release(s)
            self.drafts.release(s)
        if not self.scheduler.has_unfinished():
            self.drain()  # a step in flight now samples for no one: finish it, so the engine is idle

    @property
    def structured(self) -> StructuredOutputs:
        """The engine's grammars of structured outputs (nanoengine/structured.py), made on first use."""
        with self._grammars_made:
            grammars = self.grammars = self.grammars.made()
        return grammars

    @property
    def spec_counts(self) -> SpecCounts:
        """What speculative decoding did (zero without it)."""
        counts = self.drafts.counts
        if counts is None:
            from nanoengine.spec.verify import SpecCounts

            counts = SpecCounts()
        return counts

    def close(self) -> None:
        """Stop the executor's ranks (tensor parallelism's worker processes), and a draft model's engine."""
        self.executor.close()
        self.drafts.close()

    def has_unfinished(self) -> bool:
        """Sequences to run, a step in flight to finish, or an error to raise."""
        return self.scheduler.has_unfinished() or self.loop.busy()

    def start_trace(self) -> RunTrace:
        """Record a StepTrace of every step from now on, into the RunTrace returned (`stop_trace` ends it)."""
        self.stop_trace()
        self.trace = RunTrace(block_size=self.plan.block_size, num_blocks=self.block_manager.num_blocks,
                              max_num_batched_tokens=self.plan.max_num_batched_tokens,
                              start_time=time.perf_counter() - self.start_time)
        self.observers.append(TraceRecorder(self.trace, self.scheduler, self.block_manager))
        return self.trace

    def stop_trace(self) -> None:
        self.observers = [o for o in self.observers if not isinstance(o, TraceRecorder)]
        self.trace = None

    def clear_stats(self) -> None:
        """Forget the StepStats recorded so far (a run's own start)."""
        self.stats.clear()

    def load(self) -> EngineLoad:
        sch, bm = self.scheduler, self.block_manager
        return EngineLoad(len(sch.running), len(sch.waiting), bm.num_used_blocks, bm.num_blocks)

    # -------------------------------------------------------------------------------------- one step
    def step(self) -> StepResult:
        """One engine step: schedule -> launch -> finish, and its result. With overlap scheduling
        (`async_scheduling`, chapter 06) a call launches step N+1 and then finishes step N (the first call
        finishes none): engine/overlap.py's `OverlapLoop`. A failed step is undone (`forget_steps`)."""
        return self.loop.step()

    def schedule_and_launch(self) -> LaunchedStep:
        """Schedule a step (a draft source's drafts first) and launch it; if that fails, the step is undone
        (`forget_steps`) before the error is raised."""
        out, started = None, time.perf_counter()
        try:
            self.drafts.propose(self.scheduler)  # speculative decoding's drafts, if any (hooks.py)
            with held_interrupts():
                out = self.scheduler.schedule()  # before the forward: the batch, committed
            return self.launch(out, started)  # its inputs laid out; the forward and the draw started
        except BaseException:
            with held_interrupts():  # (a second Ctrl-C waits until the step is undone)
                self.forget_steps([] if out is None else [LaunchedStep(out, None, None)])
            raise

    def finish_or_forget(self, step: LaunchedStep | None) -> StepResult:
        """`finish` a launched step; if that fails before its tokens are in place, the step is undone."""
        try:
            return self.finish(step)
        except BaseException:
            if step is not None and not step.scheduled.updated:
                with held_interrupts():
                    self.forget_steps([step])
            raise

    def launch(self, out: SchedulerOutput, started: float | None = None) -> LaunchedStep:
        """Lay out a committed step's inputs and sampling parameters and start it on the executor (its tokens
        come back in its ForwardOutput). `started`: when scheduling began (perf_counter; for StepStats)."""
        scheduled = time.perf_counter()
        started = scheduled if started is None else started
        if not out.scheduled:
            return LaunchedStep(out, None, StepTimes(started, scheduled, scheduled, scheduled))
        inp, sample_seqs, prompt_rows, targets = self.inputs.build(out.scheduled)
        sampling = self.sampling.batch(sample_seqs)  # (the sequence of each sampled row)
        wanted = self.logprobs.wanted(sampling, prompt_rows, targets)  # row reducer (NO_REDUCTION: none)
        # logits masks: structured outputs' grammars (None: no row has one), then min_tokens' stop ids
        mask = self.min_tokens.over(self.grammars.mask(sample_seqs), sample_seqs, sampling)
        built = time.perf_counter()
        forward = self.executor.launch(inp, sampling, wanted, mask)
        return LaunchedStep(out, forward, StepTimes(started, scheduled, built, time.perf_counter()),
                            prompt_rows)

    def finish(self, step: LaunchedStep | None) -> StepResult:
        """Wait for a launched step's tokens, put them in place (Scheduler.update: stop rules, speculation's
        verification), hand each sequence's new tokens to its Completion for text (stop strings), and record
        the step's numbers."""
        if step is None:
            return StepResult()
        t_wait = time.perf_counter()
        tokens = step.forward.tokens() if step.forward is not None else []  # (where Ctrl-C usually lands)
        t_known = time.perf_counter()
        with held_interrupts():  # the books are written whole
            tokens = self.drafts.verify(step.scheduled, tokens)  # the drafts the model's tokens keep
            update = self.scheduler.update(step.scheduled, tokens)
            step.scheduled.updated = True  # from here on the step is done: a later error does not undo it
            self.drafts.verified(self.scheduler, step.scheduled, update)
            self.grammars.advance(update.appended)  # the grammars' matchers take the tokens put in place
            self.logprobs.deliver(step, update, self.requests)  # the logprobs to the requests that asked
            t_updated = time.perf_counter()
            deltas = self.detokenize(update, t_known)
            t_end = time.perf_counter()
            finished = self.note_times(step, update, t_end)
            stats = self.record(step, update, t_wait, t_known, t_updated, t_end)
        return StepResult(deltas, update.appended, finished, stats)

    def detokenize(self, update: StepUpdate, sampled_at: float) -> list[TextDelta]:
        """Each sequence's new tokens to its Completion: the text deltas. A completion whose text reached a
        stop string finishes its sequence (the tokens after the one that completed it are dropped). A
        request's first token is timed here (`sampled_at`: when the step's tokens reached the host)."""
        deltas, requests = [], self.requests
        for seq, new in update.appended:
            req = requests[seq.request_id]
            if len(seq.token_ids) - seq.num_prompt_tokens == len(new):  # its first tokens
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = sampled_at
            completion = req.completions[seq.index]
            if completion.deferred:  # its text is made once, at the end
                continue
            delta = completion.push(new, seq.is_finished)
            stop = completion.stop_string
            if stop is not None and self.scheduler.finish(seq, "stop", stop, completion.num_dropped):
                update.finished.append(seq)
            if delta:
                deltas.append(TextDelta(req, seq.index, delta))
        return deltas

    def record(self, step: LaunchedStep, update: StepUpdate, t_wait: float, t_known: float,
               t_updated: float, t_end: float) -> StepStats:
        """The step's StepStats (kept in `stats`) and, with tracing on, its StepTrace."""
        times, clock, forward = step.times, self.start_time, step.forward
        span = forward.span if forward is not None else None
        stats = StepStats.of(step.scheduled, self.block_manager, clock,
                             schedule_s=times.scheduled - times.started,
                             prepare_s=times.built - times.scheduled,
                             forward_s=(times.launched - times.built) + (t_known - t_wait),
                             postprocess_s=t_end - t_known, detokenize_s=t_end - t_updated,
                             wait_s=t_known - t_wait, end=t_end, started=times.started - clock,
                             finishing=t_wait - clock, late_rows=update.late_rows,
                             forward_start=None if span is None else span[0] - clock,
                             forward_end=None if span is None else span[1] - clock)
        self.stats.append(stats)
        for observer in self.observers:  # (a trace, speculation's cost model)
            observer.observe(step, update, stats)
        self.step_count += 1
        return stats

    def forget_steps(self, steps: list[LaunchedStep]) -> None:
        """After a step failed (or was interrupted): as if the committed, unfinished steps (in order) never
        ran. The executor's thread finishes what it holds, the seeded generators are put back as they were
        before the first of them drew, and the scheduler undoes their commits (`Scheduler.forget`: pending
        tokens, the prefix cache, admissions), so the engine can step again."""
        self.loop.forget()
        self.executor.settle()
        for step in reversed(steps):  # the first step's states are put back last
            if step.forward is not None:
                step.forward.undo_draws()
        self.scheduler.forget([step.scheduled for step in steps])

    def drain(self) -> StepResult:
        """Finish the step in flight, if any (overlap scheduling), so the engine is idle; an error that a step
        deferred is raised here, if no step raised it since."""
        return self.loop.drain()

    @property
    def in_flight(self) -> LaunchedStep | None:
        """The step launched and not yet finished (overlap scheduling), if any."""
        return self.loop.in_flight

    def note_times(self, step: LaunchedStep, update: StepUpdate, now: float) -> list[Request]:
        """Request metrics (first scheduled, finished); finished sequences let go of their sampling state.
        Returns the requests this step finished."""
        for s in step.scheduled.scheduled if step.scheduled.num_prefill_tokens else ():
            if not s.is_prefill:  # a decode was scheduled before
                continue
            req = self.requests.get(s.seq.request_id)  # None: aborted while the step ran
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = step.times.scheduled
        done = []
        for seq in update.finished:
            self.sampling.release(seq)
            self.grammars.release(seq)
            self.drafts.release(seq)
            req = self.requests[seq.request_id]
            if req.finished and req.metrics.finished_time is None:
                req.metrics.finished_time = now
                done.append(req)
        return done

    # -------------------------------------------------------------------------------------- one prompt
    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] (float32) of one prompt through the engine's model and KV cache, in
        one prefill: the book's way to compare the engine with transformers (chapter 02)."""
        if self.loop.busy():
            raise InvalidValueError("prompt_logits needs an idle engine, but a step is in flight; call "
                                    "engine.drain() first")
        seq = Sequence(check_token_ids(list(token_ids), self.plan.hf_config.vocab_size), SamplingParams(),
                       self.plan.block_size)
        if not self.block_manager.can_allocate(seq, seq.num_tokens):
            raise InvalidValueError(f"a prompt of {seq.num_tokens} tokens needs "
                                    f"{self.block_manager.blocks_for(seq.num_tokens)} KV blocks, "
                                    f"{self.block_manager.num_free_blocks} are free; finish or abort the "
                                    "running requests, or give the cache more room (num_kvcache_blocks / "
                                    "kv_cache_memory_gb)")
        self.block_manager.allocate(seq, seq.num_tokens)
        try:
            inp = self.inputs.build([ScheduledSeq(seq, seq.num_tokens, True)]).inputs
            every_row = dataclasses.replace(inp, sample_rows=torch.arange(inp.num_tokens,
                                                                          device=inp.input_ids.device))
            return self.executor.execute(every_row)  # [T, vocab]
        finally:
            self.block_manager.free(seq)
