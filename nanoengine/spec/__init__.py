"""Speculative decoding (chapter 09): propose a few tokens cheaply, verify them in one forward of the model,
keep the longest accepted prefix plus the model's own next token.

- `ngram.py`: the n-gram (prompt lookup) proposer, plain Python;
- `draft.py`: the draft-model proposer, a small model on an engine of its own;
- `verify.py`: the acceptance rules (greedy: accept while the draft equals the model's token; sampling: the
  rejection-sampling rule) and the per-engine counts (acceptance rate, tokens per verification).
The scheduler asks the proposer for drafts and gives each speculating sequence 1 + k tokens of the budget;
the engine verifies them and the scheduler rolls back the blocks that only rejected drafts wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanoengine.errors import InvalidValueError
from nanoengine.spec.ngram import NgramProposer, Proposer


def make_proposer(spec: Any, plan: Any, tokenizer: Any, num_kv_blocks: int,
                  ngram_class: type = NgramProposer,
                  build_engine: Callable[..., Any] | None = None) -> Proposer | None:
    """The proposer a SpeculativeConfig asks for (None without one): the n-gram lookup (`ngram_class`: the
    engine's, or the learner's from chapter 09), or a draft model on an engine of its own (`draft.py`), which
    `build_engine` (nanoengine.launch's) makes."""
    if spec is None:
        return None
    if spec.method == "draft_model":
        from nanoengine.spec.draft import DraftModelProposer

        if build_engine is None:
            raise InvalidValueError("speculative_config method 'draft_model' needs an engine built by "
                                    "nanoengine.launch.build_engine (LLM, the server), which builds its "
                                    "draft's engine too")
        return DraftModelProposer.build(spec, plan, tokenizer, num_kv_blocks, build_engine)
    return ngram_class(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
