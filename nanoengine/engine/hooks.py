"""The engine's declared hooks: where an extension enters the step without the core naming it. Chapter 05.

The core step is schedule -> launch -> finish (engine/llm_engine.py). An extension does not branch inside it;
it is one object the engine holds at one of these seams, chosen when the engine is built:

- **draft source** (speculative decoding, nanoengine/spec/; without it `NoDrafts`): `propose(scheduler)`
  before `schedule`, `verify(out, tokens)` before `update`, `verified(scheduler, out, update)` after it,
  `release(seq)` when a sequence ends;
- **logits masks** (structured outputs' grammars, `min_tokens`; chained by engine/logits_masks.py; without a
  grammar `NoGrammars`): `mask(seqs)` as a step is launched, on a copy of the logits before the sampler;
- **step observers** (a trace's recorder, trace.py; speculation's cost model): `added(seqs)` as a request is
  added, `observe(step, update, stats)` after each step is finished.

A sequence states what a step computes for it: its tokens not yet computed plus the drafts a draft source put
in `spec_token_ids` (verified in the same pass), and how many rows it samples (1 + its drafts). The scheduler
and the input builder read that, and never ask who drafted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nanoengine.engine.scheduler import Scheduler, SchedulerOutput, StepUpdate
    from nanoengine.engine.sequence import Sequence
    from nanoengine.engine.step import LaunchedStep
    from nanoengine.trace import StepStats


class DraftSource(Protocol):
    """Proposes tokens for the model to verify in the same forward (speculative decoding, chapter 09)."""

    def propose(self, scheduler: Scheduler) -> None:
        """Before a step is scheduled: set each running sequence's `spec_token_ids` (its drafts, or [])."""

    def verify(self, out: SchedulerOutput, tokens: list[int]) -> list[int]:
        """After the forward: the step's tokens (1 + k rows per sampled sequence) -> the tokens each keeps,
        with its `spec_token_ids` cut to the drafts kept (what `Scheduler.update` then puts in place)."""

    def verified(self, scheduler: Scheduler, out: SchedulerOutput, update: StepUpdate) -> None:
        """After `Scheduler.update`: what the verification did (counts, policy), and the blocks that only the
        rejected drafts wrote given back."""

    def release(self, seq: Sequence) -> None:
        """`seq` ended (stopped, aborted): forget what is kept for it."""

    def close(self) -> None:
        """Stop what it runs (a draft model's engine)."""

    @property
    def counts(self) -> Any:
        """What it did (nanoengine/spec/verify.py's SpecCounts), or None."""


def draft_source(config: Any, plan: Any, parts: Any, tokenizer: Any, num_kv_blocks: int,
                 build_engine: Any = None) -> Any:
    """The engine's draft source: speculative decoding's `Speculator` where `config.speculative_config` asks
    for it (with the learner's chapter 09 pieces where `parts` has them; `build_engine` makes a draft model's
    engine), else `NoDrafts`. nanoengine/spec/ is imported only then."""
    if config.speculative_config is None:
        return NoDrafts()
    from nanoengine.spec import make_speculator

    return make_speculator(config.speculative_config, plan, tokenizer, num_kv_blocks,
                           parts.ngram_proposer_class, parts.accept, build_engine)


class NoDrafts:
    """The draft source of an engine that does not speculate: no drafts, the tokens as they came. (It is a
    step observer too, that observes nothing.)"""

    counts = None  # (what an engine reports as its speculation counts: see LLMEngine.spec_counts)

    def added(self, seqs: Any) -> None:
        pass

    def observe(self, step: Any, update: Any, stats: Any) -> None:
        pass

    def propose(self, scheduler: Any) -> None:
        pass

    def verify(self, out: Any, tokens: list[int]) -> list[int]:
        return tokens

    def verified(self, scheduler: Any, out: Any, update: Any) -> None:
        pass

    def release(self, seq: Any) -> None:
        pass

    def close(self) -> None:
        pass


class NoGrammars:
    """The logits mask of an engine while no request has asked for structured outputs: no grammar, no mask
    (LLMEngine.structured makes the grammars, nanoengine/structured.py, on first use)."""

    def add(self, seq: Any) -> None:
        pass

    def release(self, seq: Any) -> None:
        pass

    def samples_grammar(self, seqs: Any) -> bool:
        return False

    def advance(self, appended: Any) -> None:
        pass

    def mask(self, seqs: Any) -> None:
        return None


class StepObserver(Protocol):
    """Told about every request added and every finished step (a trace, a cost model); it reads, and changes
    nothing the step did."""

    def added(self, seqs: list[Sequence]) -> None:
        ...

    def observe(self, step: LaunchedStep, update: StepUpdate, stats: StepStats) -> None:
        ...
