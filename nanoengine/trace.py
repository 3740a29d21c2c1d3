"""Per-step records: what the scheduler batched, what the block manager did, and how long it took.
Chapters 03 to 08.

Every step appends a `StepStats` (a few numbers, always on: the benchmark reads them). With tracing on
(`LLM(..., trace=True)`) it also appends a `StepTrace`: the step's `StepStats` plus who was scheduled, the
block events the scheduler reported, and a snapshot of the block tables and the prefix cache. Widgets read
these plain records and never touch the engine. Both use one clock: seconds since the engine was created.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepStats:
    """A few numbers per step, always recorded (cheap, unlike StepTrace): what the benchmark reads."""
    num_seqs: int  # sequences in the batch
    prefill_tokens: int
    decode_tokens: int
    used_blocks: int  # KV blocks held by running sequences after the step
    num_blocks: int
    cache_hit_tokens: int  # prompt tokens served from the prefix cache for sequences admitted this step
    num_preempted: int
    schedule_s: float  # scheduler
    prepare_s: float  # input builder: the flat inputs and attention metadata, and the sampler's parameters
    forward_s: float  # the host's time on the forward: launching it, and waiting for its tokens (wait_s)
    postprocess_s: float  # after the tokens are known: Scheduler.update (tokens in place, stop rules), text
    time: float  # seconds since the engine was created, at the end of the step
    detokenize_s: float = 0.0  # the part of postprocess_s in Completion.push (text and stop strings)
    wait_s: float = 0.0  # the part of forward_s the host sat waiting for the step's tokens
    started: float = 0.0  # when the step was launched (scheduling began), on the same clock as `time`
    finishing: float = 0.0  # when the host turned to finishing it (waiting for its tokens)
    # when the forward and the draw ran, where the host's clock sees them (CPU; None on CUDA, where they run
    # on the device after the launch returned)
    forward_start: float | None = None
    forward_end: float | None = None
    late_rows: int = 0  # sampled rows whose sequence had finished meanwhile (overlap: its step came late)

    @property
    def duration_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.postprocess_s

    @property
    def host_s(self) -> float:
        """The host's own work for the step: all but waiting for the device."""
        return self.duration_s - self.wait_s

    @classmethod
    def of(cls, out: Any, block_manager: Any, clock_start: float, end: float, **times: Any) -> StepStats:
        """The numbers of one step from its (committed) SchedulerOutput, the block manager after it, and its
        times (the `*_s` fields, and the moments already on the engine's clock; `end` is perf_counter, the
        engine's clock started at clock_start)."""
        prefill = out.num_prefill_tokens
        return cls(num_seqs=len(out.scheduled), prefill_tokens=prefill,
                   decode_tokens=out.num_batched_tokens - prefill,
                   used_blocks=block_manager.num_used_blocks, num_blocks=block_manager.num_blocks,
                   cache_hit_tokens=sum(h for _, h in out.cache_hits), num_preempted=len(out.preempted),
                   time=end - clock_start, **times)


@dataclass
class ScheduledEntry:
    seq_id: int
    prefill_tokens: int  # new prompt (or recomputed) tokens computed this step
    decode_tokens: int  # 0 or 1
    num_computed_before: int


@dataclass
class StepTrace:
    step: int
    stats: StepStats
    scheduled: list[ScheduledEntry]
    token_budget: int
    blocks_allocated: list[int]  # as the scheduler reported them (allocations for new tokens)
    blocks_freed: list[int]  # by preemption and by finishing sequences
    cache_hits: list[tuple[int, int]]  # (seq_id, prefix-cache hit tokens) for sequences admitted this step
    preempted: list[int]
    finished: list[int]
    # snapshot after the step: seq_id -> block table; block_id -> ref count (used blocks only);
    # block ids that are free but still hold a cached hash
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    ref_counts: dict[int, int] = field(default_factory=dict)
    cached_free_blocks: list[int] = field(default_factory=list)
    # block_id -> chained hash (full, computed blocks)
    block_hashes: dict[int, int] = field(default_factory=dict)
    block_tokens: dict[int, list[int]] = field(default_factory=dict)  # block_id -> token ids (hashed blocks)
    seq_num_tokens: dict[int, int] = field(default_factory=dict)  # running seq_id -> tokens so far

    # the step's numbers, read from its StepStats
    @property
    def prefill_tokens(self) -> int:
        return self.stats.prefill_tokens

    @property
    def decode_tokens(self) -> int:
        return self.stats.decode_tokens

    @property
    def num_batched_tokens(self) -> int:
        return self.stats.prefill_tokens + self.stats.decode_tokens

    @property
    def num_blocks(self) -> int:
        return self.stats.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.stats.num_blocks - self.stats.used_blocks

    @property
    def kv_usage(self) -> float:
        return self.stats.used_blocks / self.stats.num_blocks

    @property
    def time(self) -> float:
        return self.stats.time


@dataclass
class RunTrace:
    """The steps of one `generate` call plus what is needed to draw them."""

    steps: list[StepTrace] = field(default_factory=list)
    block_size: int = 16
    num_blocks: int = 0
    max_num_batched_tokens: int = 0
    prompts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> prompt token ids
    start_time: float = 0.0  # on the steps' clock (seconds since the engine was created)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> StepTrace:
        return self.steps[i]

    @property
    def hit_tokens(self) -> int:
        return sum(n for s in self.steps for _, n in s.cache_hits)

    def hit_tokens_by_seq(self) -> list[tuple[int, int]]:
        return [hit for s in self.steps for hit in s.cache_hits]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts.values())

    def add_prompts(self, seqs: list[Any]) -> None:
        for s in seqs:
            self.prompts[s.seq_id] = list(s.prompt_token_ids)

    def record(self, out: Any, finished: list[Any], stats: StepStats, running: list[Any],
               block_manager: Any) -> StepTrace:
        """Append the step that produced SchedulerOutput `out` (after its update), with a snapshot of the
        running sequences and the block manager."""
        bm = block_manager
        entries = [ScheduledEntry(s.seq.seq_id, s.num_new_tokens if s.is_prefill else 0,
                                  0 if s.is_prefill else 1, s.start) for s in out.scheduled]
        hashed = [b for b in bm.blocks if b.hash is not None]
        step = StepTrace(
            step=len(self.steps), stats=stats, scheduled=entries, token_budget=self.max_num_batched_tokens,
            blocks_allocated=list(out.blocks_allocated), blocks_freed=list(out.blocks_freed),
            cache_hits=list(out.cache_hits), preempted=[s.seq_id for s in out.preempted],
            finished=[s.seq_id for s in finished],
            block_tables={s.seq_id: list(s.block_table) for s in running},
            ref_counts={b.block_id: b.ref_count for b in bm.blocks if b.ref_count > 0},
            cached_free_blocks=bm.get_cached_free_block_ids(),
            block_hashes={b.block_id: b.hash for b in hashed},
            block_tokens={b.block_id: list(b.token_ids) for b in hashed},
            seq_num_tokens={s.seq_id: s.num_tokens for s in running})
        self.steps.append(step)
        return step


class TraceRecorder:
    """A step observer (engine/hooks.py) that records each of an engine's steps, and each request's prompt,
    into a RunTrace (`LLMEngine.start_trace`)."""

    def __init__(self, trace: RunTrace, scheduler: Any, block_manager: Any) -> None:
        self.trace, self.scheduler, self.block_manager = trace, scheduler, block_manager

    def added(self, seqs: list[Any]) -> None:
        self.trace.add_prompts(seqs)

    def observe(self, step: Any, update: Any, stats: StepStats) -> None:
        self.trace.record(step.scheduled, update.finished, stats, self.scheduler.running, self.block_manager)
