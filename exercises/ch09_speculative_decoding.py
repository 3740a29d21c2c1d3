# Your exercises for book/09_speculative_decoding.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch09")`, from nanoengine.check) or: pytest tests/exercises/test_ch09_speculative_decoding.py
# Generated from solutions/ch09_speculative_decoding.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
"""Chapter 09, book/09_speculative_decoding.ipynb: speculative decoding with an n-gram proposer.

Exercise 9.1: propose the tokens that followed the latest earlier occurrence of the longest suffix.
Exercise 9.2: keep the drafts the model agrees with, plus the model's own next token.
Exercise 9.3: one rejection-sampling step, whose output is distributed as the target's p.
Exercise 9.4: roll the block table back past the rejected drafts.

9.1, 9.2 and 9.4 plug into the engine (`use_exercises=["ch09"]` with a speculative_config): your proposer
drafts, your rule decides what a verification keeps, your rollback frees the blocks rejected drafts wrote.
"""

from __future__ import annotations

from typing import Any

import torch


def propose_ngram(token_ids: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Exercise 9.1: up to k tokens that followed an earlier occurrence of a suffix of `token_ids`.

    Try n = max_n, max_n - 1, ..., min_n: the suffix is the last n tokens; an occurrence is an earlier
    place token_ids[s:s + n] equal to it (s + n < len(token_ids), so the suffix itself is not one). For the
    first (longest) n with any occurrence, take the latest occurrence that is followed by at least k tokens,
    or, if none is, the earliest one; return the up to k tokens after it. [] when no n has an occurrence
    (or k <= 0).
    """
    raise NotImplementedError("Exercise 9.1: up to k tokens that followed an earlier occurrence of a suffix of `token_ids` - see book/09_speculative_decoding.ipynb")


def accept_greedy(drafts: list[int], verified: list[int]) -> list[int]:
    """Exercise 9.2: the tokens a speculating sequence appends after one verification.

    `verified` holds the model's token at each of the len(drafts) + 1 positions (after the last real token,
    then after each draft). Keep drafts while each equals the model's token at its position; at the first
    mismatch append the model's token instead and stop; if all drafts are kept, append the model's token
    after the last one (the bonus token). Between 1 and len(drafts) + 1 tokens.
    """
    raise NotImplementedError("Exercise 9.2: the tokens a speculating sequence appends after one verification - see book/09_speculative_decoding.ipynb")


def rejection_step(p: torch.Tensor, q: torch.Tensor, draft: int, generator: torch.Generator) -> int:
    """Exercise 9.3: one speculative-sampling step: the token the sequence gets at this position.

    p [V] is the target model's distribution, q [V] the proposer's, and `draft` was drawn from q. Accept the
    draft with probability min(1, p[draft] / q[draft]) (draw u uniformly in [0, 1) with `generator`); on
    rejection, draw from max(0, p - q) normalized. Use `generator` for every draw (torch.rand,
    torch.multinomial) so that a seed reproduces the result.
    """
    raise NotImplementedError("Exercise 9.3: one speculative-sampling step: the token the sequence gets at this position - see book/09_speculative_decoding.ipynb")


def rollback_blocks(bm: Any, block_table: list[int], num_tokens: int) -> list[int]:
    """Exercise 9.4: after a verification, free the blocks of `block_table` past its first `num_tokens`.

    `bm` is the engine's BlockManager: `bm.block_size`, `bm.blocks[b].ref_count`, and `bm.free_block_ids`
    (an OrderedDict used as an ordered set: assigning `free_block_ids[b] = None` adds b). Keep the blocks that
    hold tokens 0..num_tokens-1 (ceil(num_tokens / block_size) of them); for each later block drop one
    reference, and add a block whose count reaches 0 to the free list. Shorten `block_table` in place and
    return the blocks that became free (in any order: any free block serves as well as another).
    """
    raise NotImplementedError("Exercise 9.4: after a verification, free the blocks of `block_table` past its first `num_tokens` - see book/09_speculative_decoding.ipynb")
