"""LLMEngine: the step loop that ties tokenizer, scheduler, input builder, executor and sampler together.
Chapters 00 and 05.

`add_request` turns a prompt into a Request of n Sequences, each with its Completion. Each `step` is:
schedule a batch, build its inputs, run it on every rank (the executor) for the logits of the sampled rows,
sample the next tokens, let the scheduler append them and apply the stop rules, hand each token to its
Completion for text, and record the step's numbers (and, with tracing on, its trace). Every decision lives in
the component that owns it; the loop only calls them in order. An engine is built by
`nanoengine.launch.build_engine` (settings -> plan -> parts -> executor), which `LLM` and the server call.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from itertools import count
from typing import Any

import torch

from nanoengine.config import EngineConfig
from nanoengine.engine.executor import Executor
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
from nanoengine.tokenizer import eos_token_ids
from nanoengine.trace import RunTrace, StepStats

STATS_KEPT = 100_000  # StepStats kept by an engine (~25 MB)


class LLMEngine:
    def __init__(self, config: EngineConfig, plan: EnginePlan, parts: EngineParts, executor: Executor,
                 tokenizer: Any) -> None:
        """The engine over a started executor (see nanoengine.launch.build_engine, which makes the rest)."""
        self.config = config  # what the user asked for
        self.plan = plan  # what it resolved to here
        self.model_path = plan.model_path
        self.tokenizer = tokenizer
        self.executor = executor
        self.block_manager = parts.block_manager_class(executor.num_kv_blocks, plan.block_size,
                                                       plan.enable_prefix_caching)
        self.eos_token_ids = eos_token_ids(plan.model_path, plan.hf_config, tokenizer)
        self.scheduler = parts.scheduler_class(self.block_manager, self.eos_token_ids,
                                               max_num_batched_tokens=plan.max_num_batched_tokens,
                                               max_num_seqs=plan.max_num_seqs,
                                               max_model_len=plan.max_model_len)
        self.inputs = InputBuilder(plan.block_size, executor.device, parts.attention_metadata,
                                   max_tokens=max(plan.max_num_batched_tokens, plan.max_model_len),
                                   max_seqs=plan.max_num_seqs, max_blocks=plan.max_blocks_per_seq)
        self.sampler = RequestSampler(parts.sampler, plan.hf_config.vocab_size, executor.device)
        self.requests: dict[str, Request] = {}
        self._request_ids = count()
        self.step_count = 0
        self.trace: RunTrace | None = None
        # one per step, the newest STATS_KEPT (a long-lived engine must not grow without bound);
        # LLM.generate clears it at the start of a run
        self.stats: deque[StepStats] = deque(maxlen=STATS_KEPT)
        self.start_time = time.perf_counter()  # the clock of StepStats.time and the traces

    # -------------------------------------------------------------------------------------- requests
    def make_request(self, prompt: Any, params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Tokenize and check a request without queueing it (so a batch can be checked before any is
        added)."""
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
        return Request(rid, text, ids, params, [Completion(s, self.tokenizer) for s in seqs],
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

    def close(self) -> None:
        """Stop the executor's ranks (tensor parallelism's worker processes)."""
        self.executor.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def start_trace(self) -> RunTrace:
        self.trace = RunTrace(block_size=self.plan.block_size, num_blocks=self.block_manager.num_blocks,
                              max_num_batched_tokens=self.plan.max_num_batched_tokens,
                              start_time=time.perf_counter() - self.start_time)
        return self.trace

    # -------------------------------------------------------------------------------------- one step
    def step(self) -> list[tuple[Request, int, str]]:
        """One engine step. Returns (request, completion index, text delta) for every token that made text."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        sampled: list[tuple[Sequence, int]] = []
        t2 = t1
        if out.scheduled:
            inp, sample_seqs = self.inputs.build(out.scheduled)
            t2 = time.perf_counter()
            sampled = self.next_tokens(inp, sample_seqs)
        t3 = time.perf_counter()
        finished = self.scheduler.postprocess(out, sampled)
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
        t4 = time.perf_counter()
        self.note_times(out, sampled, finished, t1, t3, t4)
        self.stats.append(StepStats.of(out, self.block_manager, (t0, t1, t2, t3, t4), self.start_time))
        if self.trace is not None:
            self.trace.record(out, finished, self.stats[-1], self.scheduler.running, self.block_manager)
        self.step_count += 1
        return deltas

    def next_tokens(self, inp: ModelInput, sample_seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Run a built step on every rank (the executor), then sample: (sequence, next token) for every
        sequence that reaches its last token in this step."""
        logits = self.executor.execute(inp)  # [len(sample_seqs), vocab] fp32, or None
        return [] if logits is None else list(zip(sample_seqs, self.sampler.sample(logits, sample_seqs)))

    def note_times(self, out: SchedulerOutput, sampled: list[tuple[Sequence, int]], finished: list[Sequence],
                   scheduled_at: float, sampled_at: float, now: float) -> None:
        """Request metrics (first scheduled, first token, finished);
        finished sequences let go of their state."""
        for s in out.scheduled:
            metrics = self.requests[s.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = scheduled_at
        for seq, _ in sampled:
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
