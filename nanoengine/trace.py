"""Per-step trace events: what the scheduler batched, what the block manager did, and how long it took.
Chapters 03 to 08.

The engine appends one `StepTrace` per step when tracing is on (`LLM(..., trace=True)`); widgets and the
benchmark read these plain records and never touch the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    prepare_s: float  # model runner: building the flat inputs and attention metadata on the host
    forward_s: float  # model runner: prepare + forward + sampling
    postprocess_s: float  # appending tokens, stop checks, detokenization
    time: float  # seconds since the engine was created, at the end of the step


@dataclass
class ScheduledEntry:
    seq_id: int
    prefill_tokens: int  # new prompt (or recomputed) tokens computed this step
    decode_tokens: int  # 0 or 1
    num_computed_before: int


@dataclass
class StepTrace:
    step: int
    scheduled: list[ScheduledEntry]
    token_budget: int
    num_batched_tokens: int
    blocks_allocated: list[int]
    blocks_freed: list[int]
    cache_hits: list[tuple[int, int]]  # (seq_id, prefix-cache hit tokens) for sequences admitted this step
    preempted: list[int]
    finished: list[int]
    num_free_blocks: int
    num_blocks: int
    # snapshot after the step: seq_id -> block table; block_id -> ref count (used blocks only);
    # block ids that are free but still hold a cached hash
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    ref_counts: dict[int, int] = field(default_factory=dict)
    cached_free_blocks: list[int] = field(default_factory=list)
    block_hashes: dict[int, int] = field(default_factory=dict)  # block_id -> chained hash (full, computed blocks)
    block_tokens: dict[int, list[int]] = field(default_factory=dict)  # block_id -> token ids (hashed blocks)
    seq_num_tokens: dict[int, int] = field(default_factory=dict)  # running seq_id -> tokens so far
    schedule_s: float = 0.0
    forward_s: float = 0.0
    postprocess_s: float = 0.0
    time: float = 0.0  # seconds since the run started

    @property
    def prefill_tokens(self) -> int:
        return sum(e.prefill_tokens for e in self.scheduled)

    @property
    def decode_tokens(self) -> int:
        return sum(e.decode_tokens for e in self.scheduled)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


@dataclass
class RunTrace:
    """The steps of one `generate` call plus what is needed to draw them."""

    steps: list[StepTrace] = field(default_factory=list)
    block_size: int = 16
    num_blocks: int = 0
    max_num_batched_tokens: int = 0
    prompts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> prompt token ids

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
