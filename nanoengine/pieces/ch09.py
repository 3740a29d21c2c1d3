"""Chapter 09's pieces in the engine: speculative decoding's n-gram proposer (your 9.1), the rule that
decides which drafts a verification keeps (your 9.2), and the block manager's rollback past rejected drafts
(your 9.4).

They run only with speculation on (`speculative_config={"method": "ngram", ...}`; the plan refuses
use_exercises=["ch09"] without it). The proposer has NgramProposer's constructor and `propose`, and calls your
`propose_ngram`; the engine's verification calls your `accept_greedy` with each sequence's drafts and the
model's tokens; the BlockManager subclass's `rollback_blocks` (which `truncate` calls) frees the blocks
past the kept tokens with yours, over the engine's own ref counts and free list (on top of chapter 04's
block manager when both are chosen). Your 9.3 (rejection sampling with a draft distribution) has no place
here: an n-gram draft is a point mass, for which the rule is the engine's sampler followed by your 9.2
(nanoengine/spec/verify.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from nanoengine.engine.block_manager import BlockManager
from nanoengine.pieces.learner import check_result, piece


def ngram_proposer_class(module: ModuleType) -> type:
    propose_ngram = piece(module, "propose_ngram", "ch09")

    class LearnerNgramProposer:
        def __init__(self, num_speculative_tokens: int, max_n: int = 4, min_n: int = 1) -> None:
            self.k, self.max_n, self.min_n = num_speculative_tokens, max_n, min_n

        def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
            k = self.k if max_tokens is None else min(self.k, max_tokens)
            if k <= 0:
                return []
            drafts = propose_ngram(list(token_ids), k, self.max_n, self.min_n)
            check_result(isinstance(drafts, list) and len(drafts) <= k
                         and all(isinstance(t, int) for t in drafts), propose_ngram,
                         f"{drafts!r} for k={k}; it must return a list of at most k token ids")
            return drafts

    return LearnerNgramProposer


def accept(module: ModuleType) -> Callable[[list[int], list[int]], list[int]]:
    accept_greedy = piece(module, "accept_greedy", "ch09")

    def learner_accept(drafts: list[int], verified: list[int]) -> list[int]:
        kept = accept_greedy(list(drafts), list(verified))
        check_result(isinstance(kept, list) and 1 <= len(kept) <= len(drafts) + 1, accept_greedy,
                     f"{kept!r} for {len(drafts)} drafts; it must return 1 to len(drafts) + 1 tokens")
        return kept

    return learner_accept


def block_manager_class(module: ModuleType, base: type[BlockManager] = BlockManager) -> type[BlockManager]:
    rollback_blocks = piece(module, "rollback_blocks", "ch09")

    class LearnerRollbackBlockManager(base):
        def rollback_blocks(self, block_table: list[int], num_tokens: int) -> list[int]:
            keep = self.blocks_for(num_tokens)
            freed = rollback_blocks(self, block_table, num_tokens)
            check_result(isinstance(freed, list) and len(block_table) == keep, rollback_blocks,
                         f"{freed!r}, leaving a table of {len(block_table)} blocks; it must keep the "
                         f"{keep} blocks that hold {num_tokens} tokens and return the freed ones")
            return freed

    return LearnerRollbackBlockManager
