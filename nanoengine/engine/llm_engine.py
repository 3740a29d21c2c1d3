"""LLMEngine: the step loop that ties tokenizer, scheduler, block manager and model runner together.
Chapters 00 and 05.

`add_request` turns a prompt into n Sequences; each `step` schedules one batch, runs it, appends the
sampled tokens, applies stop rules, detokenizes incrementally and (with tracing on) records a StepTrace.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from nanoengine import assets
from nanoengine.config import EngineConfig
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.model_runner import ModelRunner
from nanoengine.engine.scheduler import Scheduler
from nanoengine.engine.sequence import Sequence
from nanoengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoengine.sampling_params import SamplingParams
from nanoengine.tokenizer import IncrementalDetokenizer, load_tokenizer
from nanoengine.trace import RunTrace, ScheduledEntry, StepStats, StepTrace

STATS_KEPT = 100_000  # StepStats kept by an engine (~25 MB)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    texts: list[str] = field(default_factory=list)
    stop_reasons: list[Any] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        outs = [CompletionOutput(index=i, text=self.texts[i], token_ids=list(s.completion_token_ids),
                                 finish_reason=s.finish_reason, stop_reason=self.stop_reasons[i])
                for i, s in enumerate(self.seqs)]
        self.metrics.num_output_tokens = self.seqs[0].num_completion_tokens
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             self.metrics, self.seqs[0].num_cached_tokens)


def eos_token_ids(model_path, hf_config, tokenizer) -> set[int]:
    """Every id the model may use to end a turn: generation_config's eos ids, config's, the tokenizer's."""
    ids: set[int] = set()

    def add(value):
        if value is None:
            return
        ids.update(value if isinstance(value, list) else [value])

    gen = model_path / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids


class LLMEngine:
    def __init__(self, model: str = "smollm2-135m", **engine_options: Any) -> None:
        from transformers import AutoConfig

        self.config = EngineConfig.from_kwargs(model=str(model), **engine_options)
        self.model_path = assets.resolve_model(model)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.config.resolve(hf_config)
        self.tokenizer = load_tokenizer(self.model_path)
        self.runner = ModelRunner(self.config, self.model_path)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config, self.tokenizer)
        self.scheduler = Scheduler(self.config, self.block_manager, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.seq_to_request: dict[int, tuple[Request, int]] = {}
        self._request_ids = count()
        self.step_count = 0
        self.trace: RunTrace | None = None
        # one per step, the newest STATS_KEPT (a long-lived engine must not grow without bound);
        # LLM.generate clears it at the start of a run
        self.stats: deque[StepStats] = deque(maxlen=STATS_KEPT)
        self.start_time = time.perf_counter()

    # -------------------------------------------------------------------------------------- requests
    def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_ids(list(prompt["prompt_token_ids"]))
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {list(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: give at least one character or token id")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, self.check_ids(list(prompt))
        raise TypeError(f"a prompt is a string, a list of token ids or a dict; got {type(prompt).__name__}")

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.config.hf_config.vocab_size
        if not ids:
            raise ValueError("empty prompt: give at least one token id")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def make_request(self, prompt: Any, params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Tokenize and check a request without queueing it (so a batch can be checked before any is added)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        rid = request_id if request_id is not None else str(next(self._request_ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seqs = [Sequence(ids, params, self.config.block_size) for _ in range(params.n)]
        for i, s in enumerate(seqs):
            s.index, s.request_id = i, rid
            if i and self.config.enable_prefix_caching:
                s.wait_for = seqs[0]  # siblings share the first one's prompt blocks through the prefix cache
        self.scheduler.check_admission(seqs[0])
        detoks = [IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) for _ in seqs]
        return Request(rid, text, ids, params, seqs, detoks, RequestMetrics(time.perf_counter()),
                       [""] * params.n, [None] * params.n)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for i, s in enumerate(request.seqs):
            self.seq_to_request[s.seq_id] = (request, i)
            self.scheduler.add(s)
            if self.trace is not None:
                self.trace.prompts[s.seq_id] = list(request.prompt_token_ids)

    def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        req = self.make_request(prompt, params, request_id)
        self.add(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Forget a request: its unfinished sequences are aborted (blocks freed); finished ones just let go."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for s in req.seqs:
            if not s.is_finished:
                self.scheduler.abort(s.seq_id)
                s.finish_reason = "abort"
            self.seq_to_request.pop(s.seq_id, None)
            self.runner.release(s.seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def start_trace(self) -> RunTrace:
        self.trace = RunTrace(block_size=self.config.block_size, num_blocks=len(self.block_manager.blocks),
                              max_num_batched_tokens=self.config.max_num_batched_tokens)
        self.trace_start = time.perf_counter()
        return self.trace

    # -------------------------------------------------------------------------------------- one step
    def step(self) -> list[tuple[Request, int, str]]:
        """One engine step. Returns (request, completion index, text delta) for every new token."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        sampled = self.runner.run(out.scheduled) if out.scheduled else {}
        t2 = time.perf_counter()
        for s in out.scheduled:
            req = self.seq_to_request[s.seq.seq_id][0]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t1
        finished = list(self.scheduler.postprocess(out, sampled))
        deltas = []
        for seq_id, token in sampled.items():
            req, i = self.seq_to_request[seq_id]
            seq = req.seqs[i]
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = t2
            delta = req.detoks[i].push(token)
            if seq.is_finished:
                delta += req.detoks[i].flush()
                if token in req.params.stop_token_ids:
                    req.stop_reasons[i] = token
            text = req.texts[i] + delta
            stop = self.find_stop_string(req.params, seq, text, len(delta))
            if stop is not None:
                cut, stop_str = stop
                delta = delta[: max(0, len(delta) - (len(text) - cut))]
                text = text[:cut]
                req.stop_reasons[i] = stop_str
                if not seq.is_finished:
                    self.scheduler.finish(seq, "stop")
                    finished.append(seq)
                else:
                    seq.finish_reason = "stop"
            req.texts[i] = text
            if delta:
                deltas.append((req, i, delta))
        now = time.perf_counter()
        for seq in finished:
            req, _ = self.seq_to_request[seq.seq_id]
            self.runner.release(seq.seq_id)
            if req.finished and req.metrics.finished_time is None:
                req.metrics.finished_time = now
        num_prefill = sum(s.num_new_tokens for s in out.scheduled if s.is_prefill)
        self.stats.append(StepStats(
            num_seqs=len(out.scheduled), prefill_tokens=num_prefill,
            decode_tokens=out.num_batched_tokens - num_prefill, used_blocks=self.block_manager.num_used_blocks,
            num_blocks=len(self.block_manager.blocks), cache_hit_tokens=sum(h for _, h in out.cache_hits),
            num_preempted=len(out.preempted), schedule_s=t1 - t0, prepare_s=self.runner.last_prepare_s,
            forward_s=t2 - t1, postprocess_s=now - t2, time=now - self.start_time))
        if self.trace is not None:
            self.record(out, finished, t1 - t0, t2 - t1, now - t2)
        self.step_count += 1
        return deltas

    @staticmethod
    def find_stop_string(params: SamplingParams, seq: Sequence, text: str, new_chars: int):
        """(cut position, stop string) if a stop string now appears in the text, else None."""
        if not params.stop_strings or seq.num_completion_tokens <= params.min_tokens or not new_chars:
            return None
        best = None
        for stop in params.stop_strings:
            start = max(0, len(text) - new_chars - len(stop) + 1)
            idx = text.find(stop, start)
            if idx != -1:
                cut = idx + len(stop) if params.include_stop_str_in_output else idx
                if best is None or idx < best[2]:
                    best = (cut, stop, idx)
        return None if best is None else best[:2]

    def record(self, out, finished, schedule_s, forward_s, post_s) -> None:
        bm = self.block_manager
        # postprocess advanced num_computed_tokens by num_new_tokens; is_prefill is as scheduled
        entries = [ScheduledEntry(s.seq.seq_id, s.num_new_tokens if s.is_prefill else 0, 0 if s.is_prefill else 1,
                                  s.seq.num_computed_tokens - s.num_new_tokens)
                   for s in out.scheduled]
        used = {b.block_id: b.ref_count for b in bm.blocks if b.ref_count > 0}
        prev = self.trace.steps[-1].ref_counts if self.trace.steps else {}
        tables = {s.seq_id: list(s.block_table) for s in self.scheduler.running}
        self.trace.steps.append(StepTrace(
            step=len(self.trace.steps), scheduled=entries, token_budget=self.config.max_num_batched_tokens,
            num_batched_tokens=out.num_batched_tokens,
            # block events as the difference of the used-block sets before and after the step
            blocks_allocated=sorted(used.keys() - prev.keys()), blocks_freed=sorted(prev.keys() - used.keys()),
            cache_hits=list(out.cache_hits),
            preempted=[s.seq_id for s in out.preempted], finished=[s.seq_id for s in finished],
            num_free_blocks=bm.num_free_blocks, num_blocks=len(bm.blocks), block_tables=tables,
            ref_counts=used, cached_free_blocks=bm.get_cached_free_block_ids(),
            block_hashes={b.block_id: b.hash for b in bm.blocks if b.hash is not None},
            block_tokens={b.block_id: list(b.token_ids) for b in bm.blocks if b.hash is not None},
            seq_num_tokens={s.seq_id: s.num_tokens for s in self.scheduler.running},
            schedule_s=schedule_s, forward_s=forward_s, postprocess_s=post_s,
            time=time.perf_counter() - self.trace_start,
        ))
