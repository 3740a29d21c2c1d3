"""Speculative decoding (chapter 09): propose a few tokens cheaply, verify them in one forward of the model,
keep the longest accepted prefix plus the model's own next token.

- `ngram.py`: the n-gram (prompt lookup) proposer, plain Python;
- `draft.py`: the draft-model proposer, a small model on an engine of its own;
- `verify.py`: the acceptance rules (greedy: accept while the draft equals the model's token; sampling: the
  rejection-sampling rule) and the per-engine counts (acceptance rate, tokens per verification);
- `policy.py`: how many drafts a sequence asks for at a step (`AdaptiveK`: as many as its acceptance so far
  says pay, often none).
`Speculator` is what the scheduler holds (made by `make_speculator`): before a step it asks the proposer for
the drafts of all the step's decoding sequences at once (`propose_many`: a draft model decodes them as one
batch; the scheduler gives each 1 + k tokens of the budget); after the step, in its update, it asks which of
them the model's tokens keep (`verify`, the acceptance rule, counted in `counts` and learnt by the policy),
puts those in place, and rolls back the blocks that only rejected drafts wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nanoengine.errors import InvalidValueError
from nanoengine.spec.ngram import NgramProposer, Proposer
from nanoengine.spec.policy import VERIFY_ROW_COST, AdaptiveK
from nanoengine.spec.verify import SpecCounts, accepted_tokens

if TYPE_CHECKING:
    from nanoengine.engine.sequence import Sequence


class Speculator:
    """Speculative decoding's two steps, for the scheduler: drafts before the forward (for all of a step's
    decoding sequences at once: `propose_many`), kept tokens after (`verify`, then `verified`). `policy`
    chooses how many drafts each sequence asks for (policy.py's AdaptiveK: as many as its acceptance says
    pay; None: always the proposer's k); a sequence that ends is forgotten (`forget`)."""

    def __init__(self, proposer: Proposer,
                 accept: Callable[[list[int], list[int]], list[int]] = accepted_tokens,
                 policy: AdaptiveK | None = None) -> None:
        self.proposer = proposer
        self.accept = accept  # drafts, the model's tokens at their k + 1 positions -> the tokens kept
        self.policy = policy
        self.counts = SpecCounts()  # what it did in the engine's life

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most max_tokens drafts to follow `token_ids` (the proposer's own, no policy)."""
        return self.proposer.propose(token_ids, max_tokens)

    def propose_many(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Drafts for each of a step's decoding sequences, at most its max_tokens and what the policy
        chooses for it, asked of the proposer in one batch (a draft model decodes them together)."""
        policy = self.policy
        if policy is not None:  # c as measured for a greedy sequence among len(seqs) decoding ones; a sampled
            # one's drafts change its draws, so they follow its tokens only (the prior c), as its seed must
            measured, prior = policy.step_cost.row_cost(len(seqs)), policy.step_cost.prior_cost(len(seqs))
            costs = [measured if s.sampling_params.temperature == 0 else prior for s in seqs]
            max_tokens = [min(policy.choose(s.seq_id, c), m) for s, c, m in zip(seqs, costs, max_tokens)]
        ks = max_tokens
        asked = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not asked:
            return drafts
        token_ids = [seqs[i].token_ids for i in asked]
        many = getattr(self.proposer, "propose_many", None)
        if many is not None:
            got = many(token_ids, [ks[i] for i in asked])
        else:  # a proposer with `propose` only (the learner's, a test's): one sequence at a time
            got = [self.proposer.propose(ids, ks[i]) for ids, i in zip(token_ids, asked)]
        for i, d in zip(asked, got):
            drafts[i] = d
        return drafts

    def verify(self, drafts: list[int], verified: list[int]) -> list[int]:
        """The tokens a sequence keeps: the drafts the model's tokens at their k + 1 positions (`verified`)
        accept, then the model's own token (1 to k + 1 tokens)."""
        return self.accept(drafts, verified)

    def verified(self, seq_id: int, step: int, num_drafts: int, num_accepted: int, num_counted: int,
                 num_tokens: int) -> None:
        """A verification is done: `num_accepted` of seq_id's `num_drafts` drafts were kept (what the policy
        learns from), `num_counted` of them before a stop rule (what `counts` counts) and `num_tokens`
        appended."""
        self.counts.add(num_drafts, num_counted, num_tokens, step, seq_id)
        if self.policy is not None:
            self.policy.observe(seq_id, num_drafts, num_accepted)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds` on the forward (what the policy's cost is fit
        on)."""
        if self.policy is not None:
            self.policy.step_cost.observe(rows, seconds)

    def forget(self, seq_id: int) -> None:
        """seq_id finished (stopped, aborted): drop what the policy and the proposer keep for it."""
        if self.policy is not None:
            self.policy.forget(seq_id)
        forget = getattr(self.proposer, "forget", None)
        if forget is not None:
            forget(seq_id)

    def close(self) -> None:
        """Stop a draft model's engine, if the proposer has one."""
        if hasattr(self.proposer, "close"):
            self.proposer.close()


def make_speculator(spec: Any, plan: Any, tokenizer: Any, num_kv_blocks: int,
                    ngram_class: type | None = None,
                    accept: Callable[[list[int], list[int]], list[int]] | None = None,
                    build_engine: Callable[..., Any] | None = None) -> Speculator | None:
    """The Speculator a SpeculativeConfig asks for (None without one), with `accept` (the learner's from
    chapter 09; None: the engine's rule), its proposer (`make_proposer`; `ngram_class` None: the
    engine's) and the adaptive number of drafts (policy.py: on by default, as there is no cost to it where
    drafts pay)."""
    if spec is None:
        return None
    ngram_class, accept = ngram_class or NgramProposer, accept or accepted_tokens
    measured = spec.row_cost == "measured"  # else fixed: the prior, never refit
    policy = AdaptiveK(spec.num_speculative_tokens, VERIFY_ROW_COST if measured else float(spec.row_cost),
                       measure=measured)
    return Speculator(make_proposer(spec, plan, tokenizer, num_kv_blocks, ngram_class, build_engine), accept,
                      policy)


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
