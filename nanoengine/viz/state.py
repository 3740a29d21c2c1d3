"""What the views show, as plain data computed from a `RunTrace`: the shared helpers, and the states of
chapters 03 (block table, KV usage) and 05 (batch composition) that the step timeline links.

Every view (HTML widget or matplotlib figure) draws one of these small dataclasses and nothing else, so tests
check the state and the drawings stay thin. No matplotlib, no ipywidgets, no torch here.

- `block_table_states(trace)`: the KV pool after each step, one `BlockCell` per physical block.
- `batch_composition_state(trace)`: one stacked bar per step, prefill / decode tokens per sequence.
- `kv_usage_state(trace)`: used and cached-free blocks, and the prefix-cache hit rate, over the steps.

The prefix tree (chapter 04) is in `nanoengine.viz.state_prefix`; the request timeline and run summary
(chapter 05) are in `nanoengine.viz.state_timeline`. Both build on the shared helpers here (palette and
colours, `check_trace`, `check_step`, `seq_ids`, `seq_colors`, `short_text`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from nanoengine.trace import RunTrace, StepTrace

# Owner colours: matplotlib's tab10 then its light tab20 partners, without the greys (greys mean "free").
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
)
FREE_COLOR = "#eeeeee"
CACHED_COLOR = "#fffbe6"  # free, but still holds a hashed prefix: a prefix-cache hit can revive it
PREEMPT_COLOR = "#d62728"
FINISH_COLOR = "#222222"
CACHED_EDGE_COLOR = "#b59a3a"  # the dashed outline of a cached-free block
HIT_COLOR = "#b7e4a6"  # prefix-tree node reused from the prefix cache at least once
MISS_COLOR = "#f7c4b8"  # prefix-tree node only ever computed
STEP_COLOR = "#ffd54f"  # highlights the current step in the batch chart
KV_USED_COLOR = "#5b8def"  # KV usage chart: blocks in use
KV_CACHED_COLOR = "#f3d98b"  # KV usage chart: free, still cached
HIT_RATE_COLOR = "#2ca02c"  # KV usage chart: cumulative prefix-cache hit rate

FREE, USED, SHARED, CACHED = "free", "used", "shared", "cached"


def ink(color: str) -> str:
    """Black or white, whichever reads better on the hex colour `color`."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"


def grid_columns(num_blocks: int) -> int:
    """Columns of the block-pool grid (the same in the widget and the static figure)."""
    if num_blocks <= 64:
        return min(num_blocks, 8)
    return 16 if num_blocks <= 512 else 32


def check_trace(trace: Any) -> RunTrace:
    """Raise a clear error unless `trace` is a recorded, non-empty RunTrace."""
    if trace is None:
        raise ValueError("no trace: create the engine with LLM(..., trace=True) and call generate() first, "
                         "then pass llm.trace")
    if not isinstance(trace, RunTrace):
        raise TypeError(f"expected a nanoengine.trace.RunTrace (llm.trace), got {type(trace).__name__}")
    if not trace.steps:
        raise ValueError("the trace has no steps: generate() recorded nothing (was the prompt list empty?)")
    return trace


def check_step(trace: RunTrace, step: int) -> int:
    n = len(trace.steps)
    if isinstance(step, bool):
        raise TypeError("step must be an int, got bool")
    step = operator.index(step)  # ints and numpy integers; TypeError otherwise
    if step < 0:
        step += n
    if not 0 <= step < n:
        raise IndexError(f"step {step} is outside this trace's steps 0..{n - 1}")
    return step


def seq_ids(trace: RunTrace) -> list[int]:
    """Every sequence id in the trace, in order."""
    ids = set(trace.prompts)
    for s in trace.steps:
        ids.update(e.seq_id for e in s.scheduled)
        ids.update(s.block_tables)
    return sorted(ids)


def seq_colors(trace: RunTrace) -> dict[int, str]:
    """One colour per sequence for the whole run (the same in every step and every view)."""
    return {sid: PALETTE[i % len(PALETTE)] for i, sid in enumerate(seq_ids(trace))}


def short_text(tokenizer: Any, token_ids: list[int] | tuple[int, ...], limit: int = 40) -> str:
    """Token ids as readable text (decoded when a tokenizer is given), cut to `limit` characters."""
    if not token_ids:
        return ""
    if tokenizer is not None:
        text = tokenizer.decode(list(token_ids))
        text = repr(text)[1:-1]  # show newlines and tabs as escapes
    else:
        text = "ids " + " ".join(str(t) for t in token_ids)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------- block table
@dataclass(frozen=True)
class BlockCell:
    """One physical KV block after a step."""

    block_id: int
    status: str  # "free" | "used" | "shared" (ref count > 1) | "cached" (free but still hashed)
    owners: tuple[int, ...]  # seq ids whose block tables hold it, in seq-id order
    ref_count: int  # the block manager's count (0 when free)
    colors: tuple[str, ...]  # one per owner; (FREE_COLOR,) or (CACHED_COLOR,) when nobody holds it
    fill: int  # token slots with computed K/V (0..block_size)
    hash: int | None = None  # chained prefix hash once full and computed
    tokens: tuple[int, ...] = ()  # the token ids of a hashed block
    last_owner: int | None = None  # for free / cached blocks: who held it last
    new: bool = False  # became used in this step

    @property
    def color(self) -> str:
        return self.colors[0]


@dataclass
class BlockTableState:
    """The KV pool and every running sequence's block table right after one step."""

    step: int
    num_blocks: int
    block_size: int
    cells: list[BlockCell]
    tables: dict[int, list[int]]  # running seq_id -> physical block ids (logical order)
    computed_tokens: dict[int, int]  # running seq_id -> tokens with K/V in the cache
    seq_colors: dict[int, str]  # the whole run's colours
    scheduled: list[tuple[int, int, int]]  # (seq_id, prefill tokens, decode tokens) this step
    cache_hits: list[tuple[int, int]]
    preempted: list[int]
    finished: list[int]
    num_free_blocks: int

    @property
    def ref_counts(self) -> dict[int, int]:
        """block_id -> ref count, for used blocks (the same shape as StepTrace.ref_counts)."""
        return {c.block_id: c.ref_count for c in self.cells if c.ref_count > 0}

    @property
    def colors(self) -> list[str]:
        return [c.color for c in self.cells]

    @property
    def shared(self) -> list[BlockCell]:
        return [c for c in self.cells if c.status == SHARED]

    @property
    def num_used(self) -> int:
        return sum(c.ref_count > 0 for c in self.cells)

    @property
    def num_cached(self) -> int:
        return sum(c.status == CACHED for c in self.cells)


def block_table_states(trace: RunTrace, upto: int | None = None) -> list[BlockTableState]:
    """The pool after every step 0..upto (all steps by default), computed in one pass over the trace."""
    trace = check_trace(trace)
    last = len(trace.steps) - 1 if upto is None else check_step(trace, upto)
    colors = seq_colors(trace)
    computed: dict[int, int] = {}  # seq_id -> tokens with K/V, replayed from the scheduled entries
    last_owner: dict[int, int] = {}
    prev_used: set[int] = set()
    states = []
    for s in trace.steps[: last + 1]:
        for sid in s.preempted:
            computed.pop(sid, None)
        for e in s.scheduled:
            computed[e.seq_id] = e.num_computed_before + e.prefill_tokens + e.decode_tokens
        for sid in s.finished:
            computed.pop(sid, None)
        states.append(_block_table_state(trace, s, colors, computed, last_owner, prev_used))
        prev_used = set(s.ref_counts)
        for sid, table in s.block_tables.items():
            for b in table:
                last_owner[b] = sid
    return states


def block_table_state(trace: RunTrace, step: int) -> BlockTableState:
    """The pool right after `step` (negative counts from the end)."""
    return block_table_states(trace, step)[-1]


def _block_table_state(trace: RunTrace, s: StepTrace, colors: dict[int, str], computed: dict[int, int],
                       last_owner: dict[int, int], prev_used: set[int]) -> BlockTableState:
    block_size = trace.block_size
    num_blocks = s.num_blocks or trace.num_blocks
    owners: dict[int, list[int]] = {}
    fill: dict[int, int] = {}
    for sid in sorted(s.block_tables):
        done = computed.get(sid, 0)
        for i, b in enumerate(s.block_tables[sid]):
            owners.setdefault(b, []).append(sid)
            fill[b] = max(fill.get(b, 0), min(block_size, max(0, done - i * block_size)))
    cached = set(s.cached_free_blocks)
    tokens = getattr(s, "block_tokens", {}) or {}
    cells = []
    for b in range(num_blocks):
        ref = s.ref_counts.get(b, 0)
        own = tuple(owners.get(b, ()))
        h = s.block_hashes.get(b)
        if own:
            status = SHARED if ref > 1 else USED
            cell_colors = tuple(colors[o] for o in own)
        elif b in cached:
            status, cell_colors = CACHED, (CACHED_COLOR,)
        else:
            status, cell_colors = FREE, (FREE_COLOR,)
        cells.append(BlockCell(
            block_id=b, status=status, owners=own, ref_count=ref, colors=cell_colors,
            fill=fill.get(b, block_size if status == CACHED else 0), hash=h, tokens=tuple(tokens.get(b, ())),
            last_owner=None if own else last_owner.get(b), new=ref > 0 and b not in prev_used))
    return BlockTableState(
        step=s.step, num_blocks=num_blocks, block_size=block_size, cells=cells,
        tables={sid: list(t) for sid, t in sorted(s.block_tables.items())},
        computed_tokens={sid: computed.get(sid, 0) for sid in sorted(s.block_tables)},
        seq_colors=colors,
        scheduled=[(e.seq_id, e.prefill_tokens, e.decode_tokens) for e in s.scheduled],
        cache_hits=list(s.cache_hits), preempted=list(s.preempted), finished=list(s.finished),
        num_free_blocks=s.num_free_blocks)


# ---------------------------------------------------------------------------------------- batch composition
@dataclass(frozen=True)
class BarSegment:
    step: int
    seq_id: int
    kind: str  # "prefill" | "decode"
    tokens: int
    bottom: int  # stacked: tokens below this segment in the step's bar
    color: str


@dataclass
class BatchCompositionState:
    """One stacked bar per step: how many prefill and decode tokens each sequence put in the batch."""

    num_steps: int
    segments: list[BarSegment]
    totals: list[int]  # sum of the segments per step
    num_batched_tokens: list[int]  # what the scheduler reported per step
    budgets: list[int]  # max_num_batched_tokens per step
    preempted: dict[int, list[int]]  # step -> seq ids preempted in it
    finished: dict[int, list[int]]
    admitted: dict[int, list[tuple[int, int]]]  # step -> (seq_id, prefix-cache hit tokens)
    seq_colors: dict[int, str]

    def bar(self, step: int) -> list[BarSegment]:
        return [g for g in self.segments if g.step == step]

    @property
    def max_budget(self) -> int:
        return max(self.budgets) if self.budgets else 0


def batch_composition_state(trace: RunTrace) -> BatchCompositionState:
    trace = check_trace(trace)
    colors = seq_colors(trace)
    segments, totals = [], []
    for s in trace.steps:
        bottom = 0
        for e in s.scheduled:
            for kind, n in (("prefill", e.prefill_tokens), ("decode", e.decode_tokens)):
                if n:
                    segments.append(BarSegment(s.step, e.seq_id, kind, n, bottom, colors[e.seq_id]))
                    bottom += n
        totals.append(bottom)
    return BatchCompositionState(
        num_steps=len(trace.steps), segments=segments, totals=totals,
        num_batched_tokens=[s.num_batched_tokens for s in trace.steps],
        budgets=[s.token_budget for s in trace.steps],
        preempted={s.step: list(s.preempted) for s in trace.steps if s.preempted},
        finished={s.step: list(s.finished) for s in trace.steps if s.finished},
        admitted={s.step: list(s.cache_hits) for s in trace.steps if s.cache_hits},
        seq_colors=colors)


# ---------------------------------------------------------------------------------------------- KV usage
@dataclass
class KVUsageState:
    """Pool occupancy and prefix-cache effectiveness over the steps."""

    num_blocks: int
    used_blocks: list[int]
    cached_free_blocks: list[int]
    hit_tokens: list[int]  # cumulative prefix-cache hit tokens
    prefill_tokens: list[int]  # cumulative prompt tokens actually computed
    preempt_steps: list[int]
    time: list[float]

    @property
    def usage(self) -> list[float]:
        return [u / self.num_blocks for u in self.used_blocks]

    @property
    def cached_fraction(self) -> list[float]:
        return [c / self.num_blocks for c in self.cached_free_blocks]

    @property
    def hit_rate(self) -> list[float]:
        """Cumulative share of prompt tokens served by the prefix cache instead of computed."""
        return [h / (h + p) if h + p else 0.0 for h, p in zip(self.hit_tokens, self.prefill_tokens)]


def kv_usage_state(trace: RunTrace) -> KVUsageState:
    trace = check_trace(trace)
    hits = prefill = 0
    hit_tokens, prefill_tokens = [], []
    for s in trace.steps:
        hits += sum(n for _, n in s.cache_hits)
        prefill += s.prefill_tokens
        hit_tokens.append(hits)
        prefill_tokens.append(prefill)
    num_blocks = trace.steps[0].num_blocks or trace.num_blocks
    return KVUsageState(
        num_blocks=num_blocks, used_blocks=[s.num_blocks - s.num_free_blocks for s in trace.steps],
        cached_free_blocks=[len(s.cached_free_blocks) for s in trace.steps], hit_tokens=hit_tokens,
        prefill_tokens=prefill_tokens, preempt_steps=[s.step for s in trace.steps if s.preempted],
        time=[s.time - trace.start_time for s in trace.steps])  # seconds since the run started
