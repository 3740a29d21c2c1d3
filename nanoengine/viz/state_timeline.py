"""What the chapter 05 schedule views show, as plain data computed from a `RunTrace`.

- `request_timeline_state(trace)`: one lane per sequence: waiting, prefill, decode, stalled, preempted, done.
- `run_summary(trace)`: a run's totals (steps, tokens, preemptions, recomputed tokens, chunked prefills).

The shared helpers (`check_trace`, `seq_ids`, `seq_colors`) live in `nanoengine.viz.state`. No matplotlib,
no ipywidgets, no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoengine.trace import RunTrace
from nanoengine.viz.state import check_trace, seq_colors, seq_ids

# ---------------------------------------------------------------------------------------- request timeline
WAIT, PREFILL, DECODE, STALLED, PREEMPTED, DONE = "wait", "prefill", "decode", "stalled", "preempted", "done"


@dataclass
class RequestTimelineState:
    """One lane per sequence, one cell per step: what the sequence did in that step.

    "wait": queued (before its first admission, or after a preemption); "prefill" / "decode": in the batch
    (`tokens` says how many); "stalled": running but left out of the batch (the budget ran out before its
    turn); "preempted": its blocks were freed in this step; "done": finished in an earlier step. All prompts
    are taken to arrive before step 0, as with `LLM.generate`.
    """

    num_steps: int
    seq_ids: list[int]
    kinds: dict[int, list[str]]
    tokens: dict[int, list[int]]
    finished_step: dict[int, int]
    seq_colors: dict[int, str]


def request_timeline_state(trace: RunTrace) -> RequestTimelineState:
    trace = check_trace(trace)
    ids = seq_ids(trace)
    kinds = {sid: [] for sid in ids}
    tokens = {sid: [] for sid in ids}
    finished: dict[int, int] = {}
    for s in trace.steps:
        sched = {e.seq_id: e for e in s.scheduled}
        preempted, running = set(s.preempted), set(s.block_tables)
        for sid in ids:
            e = sched.get(sid)
            if e is not None:
                kind, n = (PREFILL, e.prefill_tokens) if e.prefill_tokens else (DECODE, e.decode_tokens)
            elif sid in preempted:
                kind, n = PREEMPTED, 0
            elif sid in finished:
                kind, n = DONE, 0
            elif sid in running:
                kind, n = STALLED, 0
            else:
                kind, n = WAIT, 0
            kinds[sid].append(kind)
            tokens[sid].append(n)
        for sid in s.finished:
            finished.setdefault(sid, s.step)
    return RequestTimelineState(len(trace.steps), ids, kinds, tokens, finished, seq_colors(trace))


@dataclass
class RunSummary:
    steps: int
    sequences: int
    prompt_tokens: int
    computed_tokens: int  # every token position the model ran over (prefill, recompute and decode)
    preemptions: int
    recomputed_tokens: int  # prefill tokens beyond each sequence's first full computation (after preemption)
    chunked_steps: int  # steps holding a prompt chunk that stops short of the prompt's end
    mean_batch_tokens: float
    budget: int
    seconds: float  # wall time of the run's steps

    @property
    def mean_fill(self) -> float:
        return self.mean_batch_tokens / self.budget if self.budget else 0.0


def run_summary(trace: RunTrace) -> RunSummary:
    trace = check_trace(trace)
    computed = sum(s.num_batched_tokens for s in trace.steps)
    prefill = sum(s.prefill_tokens for s in trace.steps)
    first_admission = {}
    for s in trace.steps:
        for sid, n in s.cache_hits:
            first_admission.setdefault(sid, n)
    # a preempted sequence recomputes its prompt and what it had generated: prefill tokens beyond each
    # prompt (minus its first prefix hit) are recomputation
    recomputed = prefill - sum(len(p) - first_admission.get(sid, 0) for sid, p in trace.prompts.items())
    prompts = trace.prompts
    chunked = sum(any(e.prefill_tokens
                      and e.num_computed_before + e.prefill_tokens < len(prompts.get(e.seq_id, ()))
                      for e in s.scheduled) for s in trace.steps)
    return RunSummary(
        steps=len(trace.steps), sequences=len(trace.prompts), prompt_tokens=trace.prompt_tokens,
        computed_tokens=computed, preemptions=sum(len(s.preempted) for s in trace.steps),
        recomputed_tokens=max(0, recomputed), chunked_steps=chunked,
        mean_batch_tokens=computed / len(trace.steps), budget=trace.max_num_batched_tokens,
        seconds=trace.steps[-1].time - trace.start_time)
