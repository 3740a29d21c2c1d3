"""The engine's declared hooks: where an extension enters the step without the core naming it. Chapter 05.

The core step is schedule -> launch -> finish (engine/llm_engine.py). An extension does not branch inside it;
it is one object the engine holds at one of these seams, chosen when the engine is built:
- **request checks** (logprobs' `max_logprobs`, engine/logprob_outputs.py; structured outputs' grammar
  compiled): `check(params)` as a request is made, raising InvalidValueError for an option it cannot serve;
- **draft source** (speculative decoding, nanoengine/spec/; without it `NoDrafts`): `DraftSource`, below;
- **logits masks** (structured outputs' grammars, `min_tokens`; chained by engine/logits_masks.py; without a
  grammar `NoGrammars`): `mask(seqs)` as a step is launched, on a copy of the logits before the sampler;
- **row reducer** (logprobs; without a request that asked `NO_REDUCTION`): `RowReducer`, below;
- **step loop** (chosen in `assemble()`, engine/parts.py): `step()`, `drain()`, `busy()`, `forget()`;
- **step observers** (a trace's recorder, trace.py; speculation's cost model): `StepObserver`, below;
- **attention layout** (engine/inputs.py's `AttentionLayout`): `metadata(builder, rows, decodes, prefills)`
  as a step's inputs are written, and `verify_as_decodes`.
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
    """The draft source (and step observer) of an engine that does not speculate: no drafts, the tokens as
    they came."""

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
    """The logits mask of an engine while no request has asked for structured outputs: no grammar, no mask.
    The engine holds what `for_request` returns."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Any) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids

    def for_request(self, params: Any) -> Any:
        """The grammars that serve a request with these SamplingParams: itself, or for one that asks for
        structured outputs the engine's grammars, made now (`made`; also LLMEngine.structured)."""
        return self if params.structured_outputs is None else self.made()

    def made(self) -> Any:
        """The engine's grammars (nanoengine/structured.py's StructuredOutputs, imported here)."""
        from nanoengine.structured import StructuredOutputs

        return StructuredOutputs(self.tokenizer, self.vocab_size, self.stop_token_ids)

    def check(self, params: Any) -> None:
        pass  # (it serves only requests without structured outputs: for_request)

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


class RowReducer(Protocol):
    """Reduces a step's logits after the draw, on the executor's side and the logits' device (logprobs:
    layers/logprobs.py's LogprobsWanted); what it returns goes with the step's tokens (ForwardOutput.set)."""

    def reduce(self, logits: Any, drawn_from: Any, tokens: Any, sampling: Any, num_sampled: int) -> tuple:
        ...


class NoReduction:
    """The row reducer of a step no request asked logprobs of: nothing."""

    def reduce(self, logits: Any, drawn_from: Any, tokens: Any, sampling: Any, num_sampled: int) -> tuple:
        return ()


NO_REDUCTION = NoReduction()


class StepObserver(Protocol):
    """Told about every request added (`added`) and every finished step (`observe`); it reads, and changes
    nothing the step did."""

    def added(self, seqs: list[Sequence]) -> None:
        ...

    def observe(self, step: LaunchedStep, update: StepUpdate, stats: StepStats) -> None:
        ...
