"""Speculative decoding (chapter 09): propose a few tokens cheaply, verify them in one forward of the model,
keep the longest accepted prefix plus the model's own next token.

- `ngram.py`: the n-gram (prompt lookup) proposer, plain Python;
- `verify.py`: the acceptance rules (greedy: accept while the draft equals the model's token; sampling: the
  rejection-sampling rule) and the per-engine counts (acceptance rate, tokens per verification).
The scheduler asks the proposer for drafts and gives each speculating sequence 1 + k tokens of the budget;
the engine verifies them and the scheduler rolls back the blocks that only rejected drafts wrote.
"""

from __future__ import annotations

from typing import Any

from nanoengine.spec.ngram import NgramProposer, Proposer


def make_proposer(spec: Any, plan: Any, tokenizer: Any, ngram_class: type = NgramProposer) -> Proposer | None:
    """The proposer a SpeculativeConfig asks for (None without one): the n-gram lookup (`ngram_class`: the
    engine's, or the learner's from chapter 09)."""
    if spec is None:
        return None
    return ngram_class(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
