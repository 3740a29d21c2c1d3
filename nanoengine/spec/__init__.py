"""Speculative decoding (chapter 09): propose a few tokens cheaply, verify them in one forward of the model,
keep the longest accepted prefix plus the model's own next token.

- `ngram.py`: the n-gram (prompt lookup) proposer, plain Python;
- `draft.py`: the draft-model proposer, a small model on an engine of its own;
- `verify.py`: the acceptance rules (greedy: accept while the draft equals the model's token; sampling: the
  rejection-sampling rule) and the per-engine counts (acceptance rate, tokens per verification).
`Speculator` is what the scheduler holds (made by `make_speculator`): before a step it asks the proposer for
a decoding sequence's drafts (and gives it 1 + k tokens of the budget); after the step, in its update, it
asks which of them the model's tokens keep (`verify`, the acceptance rule, counted in `counts`), puts those
in place, and rolls back the blocks that only rejected drafts wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanoengine.errors import InvalidValueError
from nanoengine.spec.ngram import NgramProposer, Proposer
from nanoengine.spec.verify import SpecCounts, accepted_tokens


class Speculator:
    """Speculative decoding's two steps, for the scheduler: drafts before the forward, kept tokens after."""

    def __init__(self, proposer: Proposer,
                 accept: Callable[[list[int], list[int]], list[int]] = accepted_tokens) -> None:
        self.proposer = proposer
        self.accept = accept  # drafts, the model's tokens at their k + 1 positions -> the tokens kept
        self.counts = SpecCounts()  # what it did in the engine's life

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most max_tokens drafts to follow `token_ids`."""
        return self.proposer.propose(token_ids, max_tokens)

    def verify(self, drafts: list[int], verified: list[int]) -> list[int]:
        """The tokens a sequence keeps: the drafts the model's tokens at their k + 1 positions (`verified`)
        accept, then the model's own token (1 to k + 1 tokens)."""
        return self.accept(drafts, verified)

    def close(self) -> None:
        """Stop a draft model's engine, if the proposer has one."""
        if hasattr(self.proposer, "close"):
            self.proposer.close()


def make_speculator(spec: Any, plan: Any, tokenizer: Any, num_kv_blocks: int,
                    ngram_class: type = NgramProposer,
                    accept: Callable[[list[int], list[int]], list[int]] = accepted_tokens,
                    build_engine: Callable[..., Any] | None = None) -> Speculator | None:
    """The Speculator a SpeculativeConfig asks for (None without one), with `accept` (the engine's rule, or
    the learner's from chapter 09) and its proposer (`make_proposer`)."""
    if spec is None:
        return None
    return Speculator(make_proposer(spec, plan, tokenizer, num_kv_blocks, ngram_class, build_engine), accept)


def make_proposer(spec: Any, plan: Any, tokenizer: Any, num_kv_blocks: int, ngram_class: type = NgramProposer,
                  build_engine: Callable[..., Any] | None = None) -> Proposer:
    """The proposer a SpeculativeConfig asks for: the n-gram lookup (`ngram_class`: the engine's, or the
    learner's from chapter 09), or a draft model on an engine of its own (`draft.py`), which `build_engine`
    (nanoengine.launch's) makes."""
    if spec.method == "draft_model":
        from nanoengine.spec.draft import DraftModelProposer

        if build_engine is None:
            raise InvalidValueError("speculative_config method 'draft_model' needs an engine built by "
                                    "nanoengine.launch.build_engine (LLM, the server), which builds its "
                                    "draft's engine too")
        return DraftModelProposer.build(spec, plan, tokenizer, num_kv_blocks, build_engine)
    return ngram_class(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
