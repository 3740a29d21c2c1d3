"""Step traces of an engine of one's own, seen from outside it. Chapter 11.

The step-trace widgets (nanoengine/viz: `show_timeline`, `BatchCompositionView`, ...) draw a `RunTrace`,
which the engine's own `LLMEngine` records from its scheduler's output at each step. An engine that only
speaks the engine protocol (nanoengine/engine/protocol.py) says less: its `step()` returns the tokens, the
text and the finished requests, not what it scheduled. `traced(engine)` records the same `RunTrace` without
asking the engine for more: it keeps every Sequence of the requests it adds, and around each `step()` compares
them before and after (computed tokens, status, block table, preemptions, prefix-cache hits) and snapshots
the block manager (`engine.sched.block_manager`, where chapter 11's MyEngine keeps it). So a different design
is traced alike, as long as its sequences and block manager are the engine's types.

`LLM.from_engine(traced(engine))` then behaves as `LLM(..., trace=True)`: each `generate` leaves its RunTrace
in `llm.trace`. What outside cannot see is reported as such: blocks allocated and freed within one step by a
sequence that finished in it are not in the step's lists, and a step's time is not split into its parts (the
whole step is `forward_s`; chapter 11's profile cell splits it) unless the engine's StepResult carries its own
StepStats, which are then kept as they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from nanoengine.engine.sequence import Sequence, SequenceStatus
from nanoengine.engine.step import StepResult
from nanoengine.trace import RunTrace, StepStats


@dataclass(frozen=True)
class Before:
    """A sequence as it was before a step."""
    num_computed: int
    num_tokens: int
    status: SequenceStatus
    block_table: tuple[int, ...]
    num_preemptions: int


class TracedPlan:
    """The engine's plan, with `trace` on (what `LLM.generate` asks before it starts a trace)."""

    trace = True

    def __init__(self, plan: Any) -> None:
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plan, name)


class TracedEngine:
    """`engine`, speaking the same protocol, with `start_trace` / `stop_trace` as LLMEngine has them."""

    def __init__(self, engine: Any, block_manager: Any = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.plan = TracedPlan(engine.plan)
        bm = block_manager or getattr(getattr(engine, "sched", None), "block_manager", None)
        if bm is None:
            raise ValueError(f"traced({type(engine).__name__}): no block manager to snapshot; keep your "
                             "scheduler at self.sched (its block_manager), or pass block_manager=")
        self.block_manager = bm
        self.budget = getattr(getattr(engine, "sched", None), "max_num_batched_tokens", 0)
        self.seqs: list[Sequence] = []  # every sequence added and not yet seen finished
        self.trace: RunTrace | None = None
        self.clock = time.perf_counter()

    # the protocol, passed through
    def make_request(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.make_request(*args, **kwargs)

    def add(self, request: Any) -> None:
        self.engine.add(request)
        self.seqs += request.seqs
        if self.trace is not None:
            self.trace.add_prompts(request.seqs)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def load(self) -> Any:
        return self.engine.load()

    def close(self) -> None:
        self.engine.close()

    def start_trace(self) -> RunTrace:
        self.trace = RunTrace(block_size=self.plan.block_size, num_blocks=self.block_manager.num_blocks,
                              max_num_batched_tokens=self.budget,
                              start_time=time.perf_counter() - self.clock)
        return self.trace

    def stop_trace(self) -> None:
        self.trace = None

    def step(self) -> StepResult:
        self.seqs = [s for s in self.seqs if not s.is_finished]
        before = {s.seq_id: Before(s.num_computed_tokens, s.num_tokens, s.status, tuple(s.block_table),
                                   s.num_preemptions) for s in self.seqs}
        started = time.perf_counter()
        result = self.engine.step()
        end = time.perf_counter()
        out, finished = self.observed(before)
        bm = self.block_manager
        stats = result.stats
        if stats is None:
            prefill = sum(s.num_new_tokens for s in out.scheduled if s.is_prefill)
            decode = sum(s.num_new_tokens for s in out.scheduled if not s.is_prefill)
            stats = StepStats(num_seqs=len(out.scheduled), prefill_tokens=prefill, decode_tokens=decode,
                              used_blocks=bm.num_used_blocks, num_blocks=bm.num_blocks,
                              cache_hit_tokens=sum(h for _, h in out.cache_hits),
                              num_preempted=len(out.preempted), schedule_s=0.0, prepare_s=0.0,
                              forward_s=end - started, postprocess_s=0.0, time=end - self.clock,
                              started=started - self.clock, finishing=started - self.clock)
            result.stats = stats
        if self.trace is not None:
            running = [s for s in self.seqs if s.status is SequenceStatus.RUNNING]
            self.trace.record(out, finished, stats, running, bm)
        return result

    def observed(self, before: dict[int, Before]) -> tuple[SimpleNamespace, list[Sequence]]:
        """What the step did, from the sequences before and after it: the SchedulerOutput fields the trace
        reads (scheduled, preempted, cache hits, blocks allocated and freed), and the sequences it
        finished."""
        out = SimpleNamespace(scheduled=[], preempted=[], cache_hits=[], blocks_allocated=[], blocks_freed=[])
        finished = []
        for seq in self.seqs:
            b = before[seq.seq_id]
            preempted = seq.num_preemptions > b.num_preemptions
            if preempted:
                out.preempted.append(seq)
            waiting = SequenceStatus.WAITING  # admitted: waiting before (or preempted here), not waiting now
            admitted = (b.status is waiting or preempted) and seq.status is not waiting
            if admitted:  # its prefix-cache hits count as computed without being computed by the step
                start = min(seq.num_cached_tokens, b.num_tokens - 1)
                out.cache_hits.append((seq.seq_id, seq.num_cached_tokens))
            else:
                start = b.num_computed
            n = seq.num_computed_tokens - start
            if n > 0:
                is_prefill = b.num_tokens - start > 1 or start < seq.num_prompt_tokens
                out.scheduled.append(SimpleNamespace(seq=seq, num_new_tokens=n, is_prefill=is_prefill,
                                                     start=start))
            table = set(seq.block_table)
            hit_blocks = seq.num_cached_tokens // self.block_manager.block_size if admitted else 0
            out.blocks_allocated += [k for k in seq.block_table[hit_blocks:] if k not in b.block_table]
            out.blocks_freed += [k for k in b.block_table if k not in table and k not in out.blocks_freed
                                 and self.block_manager.blocks[k].ref_count == 0]  # (shared ones: held)
            if seq.is_finished and b.status is not SequenceStatus.FINISHED:
                finished.append(seq)
        return out, finished


def traced(engine: Any, block_manager: Any = None) -> TracedEngine:
    """`engine` with step traces: `LLM.from_engine(traced(engine))` records a RunTrace of each generate in
    `llm.trace`, for the step-trace widgets (viz/)."""
    return TracedEngine(engine, block_manager)
