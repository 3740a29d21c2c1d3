"""Speculative decoding (chapter 09): propose a few tokens cheaply, verify them in one forward of the model,
keep the longest accepted prefix plus the model's own next token.

- `ngram.py`: the n-gram (prompt lookup) proposer, plain Python;
- `draft.py`: the draft-model proposer, a small model on an engine of its own;
- `verify.py`: the acceptance rules (greedy: accept while the draft equals the model's token; sampling: the
  rejection-sampling rule) and the per-engine counts (acceptance rate, tokens per verification);
- `policy.py`: how many drafts a sequence asks for at a step (`AdaptiveK`: as many as its acceptance so far
  says pay, often none).
`Speculator` is the engine's draft source (engine/hooks.py; made by `make_speculator`): before a step is
scheduled it asks the proposer for the drafts of all the decoding sequences at once (`propose`: a draft model
decodes them as one batch) and puts them in each sequence's `spec_token_ids` (the scheduler gives each 1 + k
tokens of the budget); after the forward, before the scheduler's update, it keeps what the acceptance rule
accepts (`verify`); after the update it counts what it did (`counts`, and the policy learns from it) and
gives back the blocks that only rejected drafts wrote (`verified`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nanoengine.errors import InvalidValueError
from nanoengine.spec.ngram import NgramProposer, Proposer
from nanoengine.spec.policy import VERIFY_ROW_COST, AdaptiveK
from nanoengine.spec.verify import SpecCounts, accepted_tokens

if TYPE_CHECKING:
    from nanoengine.engine.scheduler import Scheduler, SchedulerOutput, StepUpdate
    from nanoengine.engine.sequence import Sequence


class Speculator:
    """Speculative decoding at the engine's draft-source hook (engine/hooks.py): drafts before a step is
    scheduled (`propose`, for all of its decoding sequences at once), kept tokens after its forward
    (`verify`), what it did after the update (`verified`). `policy` chooses how many drafts each sequence
    asks for (policy.py's AdaptiveK: as many as its acceptance says pay; None: always the proposer's k); a
    sequence that ends is forgotten (`release`)."""

    def __init__(self, proposer: Proposer,
                 accept: Callable[[list[int], list[int]], list[int]] = accepted_tokens,
                 policy: AdaptiveK | None = None) -> None:
        self.proposer = proposer
        self.accept = accept  # drafts, the model's tokens at their k + 1 positions -> the tokens kept
        self.policy = policy
        self.counts = SpecCounts()  # what it did in the engine's life
        self.rows: dict[int, int] = {}  # the step being verified: seq_id -> its first row of its tokens
        self.drafted: list[tuple[Sequence, int, int]] = []  # and (seq, drafts, tokens kept) per verification

    # ---------------------------------------------------------------- the draft-source hook
    def propose(self, scheduler: Scheduler) -> None:
        """Before a step is scheduled: each running sequence's drafts in its `spec_token_ids` (or none). A
        decoding sequence gets at most one fewer than the tokens it may still grow by (the model adds one of
        its own) and than the budget left after the sequences before it (their drafts aside: the scheduler
        cuts each to what is left when it comes). A sequence with structured outputs gets none: it decodes
        plainly (its drafts are not checked against its grammar)."""
        seqs: list[Sequence] = []
        limits: list[int] = []
        budget, max_len = scheduler.max_num_batched_tokens, scheduler.max_len
        for seq in scheduler.running:
            seq.spec_token_ids = []
            if budget <= 0:
                continue
            left = len(seq.token_ids) + seq.num_pending_tokens - seq.num_computed_tokens
            if left == 1 and not seq.num_pending_tokens and seq.sampling_params.structured_outputs is None:
                room = max_len - seq.num_tokens
                max_tokens = seq.sampling_params.max_tokens
                if max_tokens is not None:
                    room = min(room, max_tokens - seq.num_completion_tokens)
                if min(room, budget) > 1:
                    seqs.append(seq)
                    limits.append(min(room, budget) - 1)
            budget -= min(left, budget)
        if seqs:
            for seq, drafts in zip(seqs, self.propose_many(seqs, limits)):
                seq.spec_token_ids = list(drafts)

    def verify(self, out: SchedulerOutput, tokens: list[int]) -> list[int]:
        """After the forward: the step's tokens (1 + k rows per sampled sequence: the model's token at its
        last token and at each draft) -> the tokens each keeps (the drafts the acceptance rule accepts, then
        the model's own token), with its `spec_token_ids` cut to the drafts kept."""
        kept_tokens: list[int] = []
        self.rows, self.drafted = {}, []
        i = 0
        for seq in out.sampled:
            drafts = seq.spec_token_ids
            new = tokens[i:i + 1 + len(drafts)]
            self.rows[seq.seq_id], i = i, i + len(new)
            if not drafts or seq.is_finished:  # (a finished one's rows are ignored by the update)
                kept_tokens += new
                continue
            kept = self.accept(drafts, new)
            seq.spec_token_ids = kept[:-1]
            out.num_drafts -= len(drafts) - (len(kept) - 1)
            self.drafted.append((seq, len(drafts), len(kept)))
            kept_tokens += kept
        kept_tokens += tokens[i:]  # (a wrong count is the update's error to raise)
        return kept_tokens

    def verified(self, scheduler: Scheduler, out: SchedulerOutput, update: StepUpdate) -> None:
        """After the scheduler's update: each verification counted (`counts`: the drafts kept before a stop
        rule) and learnt by the policy, the rows of the update's tokens put back as the step's (what
        logprobs read), and the blocks that only rejected drafts wrote given back."""
        taken = {seq.seq_id: len(new) for seq, new in update.appended}
        bm = scheduler.block_manager
        for seq, num_drafts, num_kept in self.drafted:
            num_taken = taken.get(seq.seq_id, 0)
            self.counts.add(num_drafts, min(num_taken, num_kept - 1), num_taken, out.step, seq.seq_id)
            if self.policy is not None:
                self.policy.observe(seq.seq_id, num_drafts, num_kept - 1)
            seq.spec_token_ids = []
            if not seq.is_finished:
                out.blocks_freed += bm.truncate(seq, seq.num_tokens)  # only rejected drafts wrote them
        update.rows = [self.rows[seq.seq_id] for seq, _ in update.appended]
        self.rows, self.drafted = {}, []

    def release(self, seq: Sequence) -> None:
        """seq finished (stopped, aborted): drop what the policy and the proposer keep for it."""
        if self.policy is not None:
            self.policy.forget(seq.seq_id)
        forget = getattr(self.proposer, "forget", None)
        if forget is not None:
            forget(seq.seq_id)

    def close(self) -> None:
        """Stop a draft model's engine, if the proposer has one."""
        if hasattr(self.proposer, "close"):
            self.proposer.close()

    # ---------------------------------------------------------------- its parts
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

    def added(self, seqs: Any) -> None:
        pass

    def observe(self, step: Any, update: Any, stats: Any) -> None:
        """A step observer (engine/hooks.py): a decode-only step's forward time, what the policy's cost of a
        row is fit on."""
        if self.policy is not None and stats.decode_tokens and not stats.prefill_tokens:
            self.policy.step_cost.observe(stats.decode_tokens, stats.forward_s)


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
