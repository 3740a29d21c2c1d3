"""LLMEngine: the step loop that ties tokenizer, scheduler, input builder, executor and sampler together.
Chapters 00 and 05.

`add_request` turns a prompt into a Request of n Sequences, each with its Completion. Each `step` is:
schedule a batch, build its inputs, run it on every rank (the executor) for the logits of the sampled rows,
sample the next tokens, let the scheduler append them and apply the stop rules, hand each token to its
Completion for text, and record the step's numbers (and, with tracing on, its trace). Every decision lives in
the component that owns it; the loop only calls them in order. An engine is built by
`nanoengine.launch.build_engine` (settings -> plan -> parts -> executor), which `LLM` and the server call.

With speculative decoding (chapter 09) the scheduler schedules each decode with its drafts, every position of
them is sampled, and `verify` keeps the accepted ones (nanoengine.spec.verify) token by token, as if each had
been a step of its own: the stop rules and stop strings see every token, and the first to stop ends it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch

from nanoengine.config import EngineConfig
from nanoengine.engine.executor import Executor, LaunchedStep, SampledTokens
from nanoengine.engine.inputs import InputBuilder, ModelInput
from nanoengine.engine.parts import EngineParts
from nanoengine.engine.request import Completion, Request, check_token_ids, parse_prompt
from nanoengine.engine.sampling import RequestSampler
from nanoengine.engine.scheduler import ScheduledSeq, SchedulerOutput
from nanoengine.engine.sequence import Sequence
from nanoengine.errors import InvalidTypeError, InvalidValueError
from nanoengine.outputs import RequestMetrics
from nanoengine.plan import EnginePlan
from nanoengine.sampling_params import SamplingParams
from nanoengine.spec import make_proposer
from nanoengine.spec.verify import SpecCounts
from nanoengine.tokenizer import eos_token_ids
from nanoengine.trace import RunTrace, StepStats

STATS_KEPT = 100_000  # StepStats kept by an engine (~25 MB)


@dataclass
class InFlight:
    """A launched step: what the host needs to finish it once its tokens are known."""
    out: SchedulerOutput
    sample_seqs: list[Sequence]  # the sequence of each sampled row
    taken: list[int]  # the rows whose sequences hold a place for the token (Scheduler.advance)
    tokens: SampledTokens | LaunchedStep | None  # None: nothing was scheduled
    times: list[float]  # started, scheduled, built, launched, advanced (perf_counter)


class LLMEngine:
    def __init__(self, config: EngineConfig, plan: EnginePlan, parts: EngineParts, executor: Executor,
                 tokenizer: Any, build_engine: Callable[..., Any] | None = None) -> None:
        """The engine over a started executor (see nanoengine.launch.build_engine, which makes the rest and
        hands itself down as `build_engine`, for a draft model's engine)."""
        self.config = config  # what the user asked for
        self.plan = plan  # what it resolved to here
        self.model_path = plan.model_path
        self.tokenizer = tokenizer
        self.executor = executor
        self.block_manager = parts.block_manager_class(executor.num_kv_blocks, plan.block_size,
                                                       plan.enable_prefix_caching)
        self.eos_token_ids = eos_token_ids(plan.model_path, plan.hf_config, tokenizer)
        self.spec_counts = SpecCounts()  # what speculative decoding did (stays zero without it)
        self.accept = parts.accept  # which drafts a verification keeps
        self.proposer = make_proposer(config.speculative_config, plan, tokenizer, executor.num_kv_blocks,
                                      parts.ngram_proposer_class, build_engine)
        self.scheduler = parts.scheduler_class(self.block_manager, self.eos_token_ids,
                                               max_num_batched_tokens=plan.max_num_batched_tokens,
                                               max_num_seqs=plan.max_num_seqs,
                                               max_model_len=plan.max_model_len,
                                               policy=plan.scheduling_policy, proposer=self.proposer)
        self.inputs = InputBuilder(plan.block_size, executor.device, parts.attention_metadata,
                                   max_tokens=max(plan.max_num_batched_tokens, plan.max_model_len),
                                   max_seqs=plan.max_num_seqs, max_blocks=plan.max_blocks_per_seq)
        self.sampler = RequestSampler(parts.sampler, plan.hf_config.vocab_size, executor.device)
        self.requests: dict[str, Request] = {}
        self._request_ids = count()
        self.step_count = 0
        self.in_flight: InFlight | None = None  # the step launched and not yet finished (overlap)
        # (sequence, token) for each token the last finished step gave (each finished sequence among them):
        # what changed, for a server that publishes per step without walking every request it holds
        self.last_sampled: list[tuple[Sequence, int]] = []
        self.trace: RunTrace | None = None
        # one per step, the newest STATS_KEPT (a long-lived engine must not grow without bound);
        # LLM.generate clears it at the start of a run
        self.stats: deque[StepStats] = deque(maxlen=STATS_KEPT)
        self.start_time = time.perf_counter()  # the clock of StepStats.time and the traces

    # -------------------------------------------------------------------------------------- requests
    def make_request(self, prompt: Any, params: SamplingParams | None = None,
                     request_id: str | None = None, final_only: bool = False) -> Request:
        """Tokenize and check a request without queueing it (so a batch can be checked before any is
        added). final_only: its text is read only once it is done, so `step` makes no deltas for it and
        (without stop strings) it is detokenized once, at the end (see Completion)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidTypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = parse_prompt(prompt, self.tokenizer, self.plan.hf_config.vocab_size)
        check_token_ids(params.stop_token_ids, self.plan.hf_config.vocab_size, "stop_token_ids")
        rid = request_id if request_id is not None else str(next(self._request_ids))
        if rid in self.requests:
            raise InvalidValueError(f"request id {rid!r} is already in use")
        seqs = [Sequence(ids, params, self.plan.block_size) for _ in range(params.n)]
        for i, s in enumerate(seqs):
            s.index, s.request_id = i, rid
            if i and self.plan.enable_prefix_caching:
                s.wait_for = seqs[0]  # siblings share the first one's prompt blocks through the prefix cache
        self.scheduler.check_admission(seqs[0])
        return Request(rid, text, ids, params, [Completion(s, self.tokenizer, final_only) for s in seqs],
                       RequestMetrics(time.perf_counter()))

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for s in request.seqs:
            self.scheduler.add(s)
        if self.trace is not None:
            self.trace.add_prompts(request.seqs)

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
            self.sampler.release(s)
        if not self.scheduler.has_unfinished():
            self.drain()  # a step in flight now samples for no one: finish it, so the engine is idle

    def close(self) -> None:
        """Stop the executor's ranks (tensor parallelism's worker processes), and a draft model's engine."""
        self.executor.close()
        if hasattr(self.proposer, "close"):
            self.proposer.close()

    def has_unfinished(self) -> bool:
        """Sequences to run, or a step in flight to finish."""
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def start_trace(self) -> RunTrace:
        self.trace = RunTrace(block_size=self.plan.block_size, num_blocks=self.block_manager.num_blocks,
                              max_num_batched_tokens=self.plan.max_num_batched_tokens,
                              start_time=time.perf_counter() - self.start_time)
        return self.trace

    # -------------------------------------------------------------------------------------- one step
    def step(self) -> list[tuple[Request, int, str]]:
        """One engine step. Returns (request, completion index, text delta) for every token that made text.

        A step is launched (schedule, build, hand to the executor, count its tokens as computed: `launch`)
        and later finished (its tokens appended, stop rules, text, numbers: `finish`). Without overlap each
        step finishes before the next is launched. With `async_scheduling` a call launches step N+1, then
        finishes step N, whose forward ran meanwhile: the host's work for one hides behind the device's for
        the other (chapter 06)."""
        try:
            launched = self.launch()
            done = [self.in_flight] if self.in_flight is not None else []
            self.in_flight = None
            if launched.tokens is not None and self.plan.async_scheduling:
                self.in_flight = launched
            elif launched.tokens is not None or launched.out.preempted or not done:
                done.append(launched)  # (an empty launch after a finished one is not a step)
            return [delta for step in done for delta in self.finish(step)]
        except BaseException:
            self.forget_steps_in_flight()
            raise

    def forget_steps_in_flight(self) -> None:
        """After a step failed (or was interrupted): as if the launched, unfinished steps never ran. The
        executor's thread finishes what it holds, the tokens they sampled are dropped, and each sequence that
        waited for one goes back to computing its last known token, so the engine can step again."""
        self.in_flight = None
        self.executor.settle()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.num_pending_tokens:
                seq.drop_pending()
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)

    def launch(self) -> InFlight:
        """Schedule a step, build its inputs and start it on the executor with its draw; its tokens count as
        computed and its sampled sequences hold the places of their next tokens (Scheduler.advance)."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        if not out.scheduled:
            return InFlight(out, [], [], None, [t0, t1, t1, t1, t1])
        inp, sample_seqs = self.inputs.build(out.scheduled)
        draw = self.sampler.drawer(sample_seqs)
        t2 = time.perf_counter()
        tokens = self.executor.launch(inp, draw)
        t3 = time.perf_counter()
        taken = self.scheduler.advance(out, sample_seqs)
        return InFlight(out, sample_seqs, taken, tokens, [t0, t1, t2, t3, time.perf_counter()])

    def finish(self, step: InFlight) -> list[tuple[Request, int, str]]:
        """Wait for a launched step's tokens, put each in its place (stop rules: Scheduler.resolve), hand it
        to its Completion for text (stop strings), and record the step's numbers."""
        t_wait = time.perf_counter()
        tokens = step.tokens.get() if step.tokens is not None else []
        t_known = time.perf_counter()
        finished: list[Sequence] = []
        sampled: list[tuple[Sequence, int]] = []
        verifying: list[tuple[Sequence, list[int]]] = []  # speculating sequences and their rows' tokens
        late = 0
        for row in step.taken:
            seq = step.sample_seqs[row]
            if seq.is_finished:  # aborted, or stopped by the token before (sampled after this was launched)
                late += 1
                continue
            if seq.spec_token_ids:
                verifying.append((seq, tokens[row:row + len(seq.spec_token_ids) + 1]))
                continue
            token = tokens[row]
            if self.scheduler.resolve(seq, token, step.out):
                finished.append(seq)
            sampled.append((seq, token))
        t_resolved = time.perf_counter()
        deltas = []
        for seq, token in sampled:
            req = self.requests[seq.request_id]
            completion = req.completions[seq.index]
            delta = completion.push(token)
            if (completion.stop_string is not None
                    and self.scheduler.finish(seq, "stop", completion.stop_string)):
                finished.append(seq)
            if delta:
                deltas.append((req, seq.index, delta))
        for seq, verified in verifying:
            deltas += self.verify(seq, verified, step.out, sampled, finished)
        t_end = time.perf_counter()
        t0, t1, t2, t3, t_advanced = step.times
        self.note_times(step.out, sampled, finished, t1, t_known, t_end)
        self.last_sampled = sampled
        clock = self.start_time
        ran = step.tokens.ran if step.tokens is not None else None
        stats = StepStats.of(step.out, self.block_manager, clock, schedule_s=t1 - t0,
                             prepare_s=t2 - t1, forward_s=(t3 - t2) + (t_known - t_wait),
                             postprocess_s=(t_advanced - t3) + (t_end - t_known),
                             detokenize_s=t_end - t_resolved, wait_s=t_known - t_wait, end=t_end,
                             started=t0 - clock, finishing=t_wait - clock,
                             forward_start=None if ran is None else ran[0] - clock,
                             forward_end=None if ran is None else ran[1] - clock, late_rows=late)
        self.stats.append(stats)
        if self.trace is not None:
            self.trace.record(step.out, finished, stats, self.scheduler.running, self.block_manager)
        self.step_count += 1
        return deltas

    def verify(self, seq: Sequence, verified: list[int], out: SchedulerOutput,
               sampled: list[tuple[Sequence, int]], finished: list[Sequence]
               ) -> list[tuple[Request, int, str]]:
        """A speculating sequence's step: the model's tokens at its k + 1 positions decide which drafts it
        keeps (`accepted_tokens`); each kept token is resolved and pushed in turn, as a step of its own would
        (the first that stops it ends it: the rest are never appended), and the blocks only rejected drafts
        wrote are freed. Adds to `sampled` and `finished`; returns the text deltas."""
        drafts = seq.spec_token_ids
        new = self.accept(drafts, verified)
        req = self.requests[seq.request_id]
        completion = req.completions[seq.index]
        deltas = []
        for i, token in enumerate(new):
            if i:
                self.scheduler.accept_draft(seq)
            if self.scheduler.resolve(seq, token, out):
                finished.append(seq)
            sampled.append((seq, token))
            delta = completion.push(token)
            stop = completion.stop_string
            if stop is not None and self.scheduler.finish(seq, "stop", stop):
                finished.append(seq)
            if delta:
                deltas.append((req, seq.index, delta))
            if seq.is_finished:
                break
        else:
            self.scheduler.rollback(seq, out)
        self.spec_counts.add(len(drafts), min(i + 1, len(new) - 1), i + 1, self.step_count, seq.seq_id)
        seq.spec_token_ids = []
        return deltas

    def drain(self) -> list[tuple[Request, int, str]]:
        """Finish the step in flight, if any (overlap scheduling), so the engine is idle."""
        step, self.in_flight = self.in_flight, None
        try:
            return self.finish(step) if step is not None else []
        except BaseException:
            self.forget_steps_in_flight()
            raise

    def next_tokens(self, inp: ModelInput, sample_seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Run a built step on every rank (the executor), then sample: (sequence, next token) for every
        sequence that reaches its last token in this step (the synchronous form of a step, for the book)."""
        logits = self.executor.execute(inp)  # [len(sample_seqs), vocab] fp32, or None
        return [] if logits is None else list(zip(sample_seqs, self.sampler.sample(logits, sample_seqs)))

    def note_times(self, out: SchedulerOutput, sampled: list[tuple[Sequence, int]], finished: list[Sequence],
                   scheduled_at: float, sampled_at: float, now: float) -> None:
        """Request metrics (first scheduled, first token, finished);
        finished sequences let go of their state."""
        for s in out.scheduled:
            if not s.is_prefill:  # a decode was scheduled before
                continue
            req = self.requests.get(s.seq.request_id)  # None: aborted while the step ran
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = scheduled_at
        for seq, _ in sampled:
            if seq.num_completion_tokens != 1:  # not its first token
                continue
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = sampled_at
        for seq in finished:
            self.sampler.release(seq)
            req = self.requests[seq.request_id]
            if req.finished and req.metrics.finished_time is None:
                req.metrics.finished_time = now

    # -------------------------------------------------------------------------------------- one prompt
    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] (float32) of one prompt through the engine's model and KV cache, in
        one prefill: the book's way to compare the engine with transformers (chapter 02)."""
        if self.in_flight is not None:
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
            inp, _ = self.inputs.build([ScheduledSeq(seq, seq.num_tokens, True)])
            every_row = dataclasses.replace(inp, sample_rows=torch.arange(inp.num_tokens,
                                                                          device=inp.input_ids.device))
            return self.executor.execute(every_row)  # [T, vocab]
        finally:
            self.block_manager.free(seq)
