"""What one scheduling step decides and what its update did: the records the scheduler (engine/scheduler.py)
hands the engine, the input builder and the hooks. Plain data over Sequences: no torch. Chapter 05.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoengine.engine.sequence import Sequence


@dataclass(slots=True, init=False)
class ScheduledSeq:
    """One sequence in a step: its new tokens and where the step starts."""
    seq: Sequence
    num_new_tokens: int
    is_prefill: bool  # seq.is_prefill before this step
    start: int  # the first position the step computes (seq.num_computed_tokens when it was scheduled)

    def __init__(self, seq: Sequence, num_new_tokens: int, is_prefill: bool,
                 start: int | None = None) -> None:
        self.seq, self.num_new_tokens, self.is_prefill = seq, num_new_tokens, is_prefill
        self.start = seq.num_computed_tokens if start is None else start


@dataclass
class SchedulerOutput:
    """The whole step: who runs, who was preempted, prefix hits, blocks taken and freed; once committed, what
    it samples and the blocks it cached ahead of their K/V."""
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # running first, then newly admitted
    preempted: list[Sequence] = field(default_factory=list)
    cache_hits: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, hit tokens) per admitted seq
    blocks_allocated: list[int] = field(default_factory=list)
    blocks_freed: list[int] = field(default_factory=list)  # by preemption here; update adds finished seqs'
    num_batched_tokens: int = 0
    # set when the step is committed: the sequences it samples for (each brought to its end), in scheduled
    # order, as its tokens come back (a verifying sequence's 1 + k in a row); its prompt (or recomputed)
    # tokens; and its number
    sampled: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_drafts: int = 0  # drafts among its sampled rows (a draft source cuts it to those kept, before update)
    step: int = 0
    blocks_hashed: list[int] = field(default_factory=list)  # cached ahead of their K/V (Scheduler.forget)
    updated: bool = False  # its tokens are in place (the engine's finish): it can no longer be undone

    @property
    def num_rows(self) -> int:
        """The tokens its update takes: one per sampled sequence, and the drafts kept."""
        return len(self.sampled) + self.num_drafts


def admitted(out: SchedulerOutput) -> list[Sequence]:
    """The sequences a step admitted (waiting before it): the last of its scheduled ones, one per cache_hits
    entry."""
    if not out.cache_hits:
        return []
    tail = [s.seq for s in out.scheduled[-len(out.cache_hits):]]
    if [seq.seq_id for seq in tail] == [seq_id for seq_id, _ in out.cache_hits]:
        return tail
    ids = {seq_id for seq_id, _ in out.cache_hits}  # (a scheduling policy that lists them elsewhere)
    return [s.seq for s in out.scheduled if s.seq.seq_id in ids]


@dataclass
class StepUpdate:
    """What `Scheduler.update` did with a step's tokens."""
    appended: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # the tokens put in place
    rows: list[int] = field(default_factory=list)  # the step's row of each appended entry's first token
    finished: list[Sequence] = field(default_factory=list)  # by the stop rules
    late_rows: int = 0  # sampled rows whose sequence had finished meanwhile (aborted; overlap: stopped)
