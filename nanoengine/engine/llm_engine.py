"""LLMEngine: the step loop that ties tokenizer, scheduler, input builder and model runner together.
Chapters 00 and 05.

`add_request` turns a prompt into a Request of n Sequences, each with its Completion. Each `step` is:
schedule a batch, build its inputs, run the model, let the scheduler append the tokens and apply the stop
rules, hand each token to its Completion for text, and record the step's numbers (and, with tracing on, its
trace). Every decision lives in the component that owns it; the loop only calls them in order.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import count
from typing import Any

import torch

from nanoengine import assets
from nanoengine.config import EngineConfig
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.inputs import InputBuilder
from nanoengine.engine.model_runner import ModelRunner
from nanoengine.engine.request import Completion, Request, check_token_ids, parse_prompt
from nanoengine.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from nanoengine.engine.sequence import Sequence
from nanoengine.errors import CheckpointError, InvalidTypeError, InvalidValueError
from nanoengine.outputs import RequestMetrics
from nanoengine.sampling_params import SamplingParams
from nanoengine.tokenizer import eos_token_ids, load_tokenizer
from nanoengine.trace import RunTrace, StepStats

STATS_KEPT = 100_000  # StepStats kept by an engine (~25 MB)


class LLMEngine:
    def __init__(self, model: str = assets.DEFAULT_MODEL, **engine_options: Any) -> None:
        from transformers import AutoConfig

        self.config = EngineConfig.from_kwargs(model=str(model), **engine_options)
        self.model_path = assets.resolve_model(model)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.config.resolve(hf_config)
        self.tokenizer = load_tokenizer(self.model_path)
        if len(self.tokenizer) > hf_config.vocab_size:
            raise CheckpointError(f"{self.model_path}: the tokenizer has {len(self.tokenizer)} tokens but the model's "
                                  f"vocab_size is {hf_config.vocab_size}; the tokenizer files belong to another model")
        self.runner = ModelRunner(self.config, self.model_path)
        pieces = self.runner.pieces  # the learner's, with use_exercises (nanoengine.pieces); else None
        block_manager_class = pieces.block_manager_class(BlockManager) if pieces else BlockManager
        self.block_manager = block_manager_class(self.runner.num_blocks, self.config.block_size,
                                                 self.config.enable_prefix_caching)
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config, self.tokenizer)
        scheduler_class = pieces.scheduler_class(Scheduler) if pieces else Scheduler
        self.scheduler = scheduler_class(self.config, self.block_manager, self.eos_token_ids)
        self.inputs = InputBuilder(self.config.block_size, self.runner.device,
                                   pieces.attention_metadata() if pieces else None)
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
        """Tokenize and check a request without queueing it (so a batch can be checked before any is added)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidTypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = parse_prompt(prompt, self.tokenizer, self.config.hf_config.vocab_size)
        check_token_ids(params.stop_token_ids, self.config.hf_config.vocab_size, "stop_token_ids")
        rid = request_id if request_id is not None else str(next(self._request_ids))
        if rid in self.requests:
            raise InvalidValueError(f"request id {rid!r} is already in use")
        seqs = [Sequence(ids, params, self.config.block_size) for _ in range(params.n)]
        for i, s in enumerate(seqs):
            s.index, s.request_id = i, rid
            if i and self.config.enable_prefix_caching:
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

    def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        req = self.make_request(prompt, params, request_id)
        self.add(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Forget a request: its unfinished sequences are aborted (blocks freed); finished ones just let go."""
        req = self.requests.pop(request_id, None)
        for s in req.seqs if req is not None else ():
            self.scheduler.abort(s)
            self.runner.release(s)

    def close(self) -> None:
        """Stop the tensor-parallel workers (see ModelRunner.close)."""
        self.runner.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def start_trace(self) -> RunTrace:
        self.trace = RunTrace(block_size=self.config.block_size, num_blocks=self.block_manager.num_blocks,
                              max_num_batched_tokens=self.config.max_num_batched_tokens,
                              start_time=time.perf_counter() - self.start_time)
        return self.trace

    # -------------------------------------------------------------------------------------- one step
    def step(self) -> list[tuple[Request, int, str]]:
        """One engine step. Returns (request, completion index, text delta) for every token that made text."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        inp = self.inputs.build(out.scheduled) if out.scheduled else None
        t2 = time.perf_counter()
        sampled = self.runner.run(inp) if inp is not None else []
        t3 = time.perf_counter()
        finished = self.scheduler.postprocess(out, sampled)
        deltas = []
        for seq, token in sampled:
            req = self.requests[seq.request_id]
            completion = req.completions[seq.index]
            delta = completion.push(token)
            if completion.stop_string is not None and self.scheduler.finish(seq, "stop", completion.stop_string):
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

    def note_times(self, out: SchedulerOutput, sampled: list[tuple[Sequence, int]], finished: list[Sequence],
                   scheduled_at: float, sampled_at: float, now: float) -> None:
        """Request metrics (first scheduled, first token, finished); finished sequences let go of their state."""
        for s in out.scheduled:
            metrics = self.requests[s.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = scheduled_at
        for seq, _ in sampled:
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = sampled_at
        for seq in finished:
            self.runner.release(seq)
            req = self.requests[seq.request_id]
            if req.finished and req.metrics.finished_time is None:
                req.metrics.finished_time = now

    # -------------------------------------------------------------------------------------- one prompt
    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] (float32) of one prompt through the engine's model and KV cache, in
        one prefill: the book's way to compare the engine with transformers (chapter 02)."""
        seq = Sequence(check_token_ids(list(token_ids), self.config.hf_config.vocab_size), SamplingParams(),
                       self.config.block_size)
        if not self.block_manager.can_allocate(seq, seq.num_tokens):
            raise InvalidValueError(f"a prompt of {seq.num_tokens} tokens needs {self.block_manager.blocks_for(seq.num_tokens)} "
                             f"KV blocks, {self.block_manager.num_free_blocks} are free; finish or abort the running "
                             "requests, or give the cache more room (num_kvcache_blocks / kv_cache_memory_gb)")
        self.block_manager.allocate(seq, seq.num_tokens)
        try:
            return self.runner.prompt_logits(self.inputs.build([ScheduledSeq(seq, seq.num_tokens, True)]))  # [T, vocab]
        finally:
            self.block_manager.free(seq)
