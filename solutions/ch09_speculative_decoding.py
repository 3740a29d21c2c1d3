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
    # BEGIN SOLUTION
    size = len(token_ids)
    if k <= 0:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        if n <= 0:
            break
        suffix = token_ids[size - n:]
        starts = [s for s in range(size - n) if token_ids[s:s + n] == suffix]
        if not starts:
            continue
        full = [s for s in starts if s + n + k <= size]
        s = full[-1] if full else starts[0]
        return token_ids[s + n:s + n + k]
    return []
    # END SOLUTION


def accept_greedy(drafts: list[int], verified: list[int]) -> list[int]:
    """Exercise 9.2: the tokens a speculating sequence appends after one verification.

    `verified` holds the model's token at each of the len(drafts) + 1 positions (after the last real token,
    then after each draft). Keep drafts while each equals the model's token at its position; at the first
    mismatch append the model's token instead and stop; if all drafts are kept, append the model's token
    after the last one (the bonus token). Between 1 and len(drafts) + 1 tokens.
    """
    # BEGIN SOLUTION
    kept = []
    for draft, token in zip(drafts, verified):
        kept.append(token)
        if draft != token:
            return kept
    return kept + [verified[len(drafts)]]
    # END SOLUTION


def rejection_step(p: torch.Tensor, q: torch.Tensor, draft: int, generator: torch.Generator) -> int:
    """Exercise 9.3: one speculative-sampling step: the token the sequence gets at this position.

    p [V] is the target model's distribution, q [V] the proposer's, and `draft` was drawn from q. Accept the
    draft with probability min(1, p[draft] / q[draft]) (draw u uniformly in [0, 1) with `generator`); on
    rejection, draw from max(0, p - q) normalized. Use `generator` for every draw (torch.rand,
    torch.multinomial) so that a seed reproduces the result.
    """
    # BEGIN SOLUTION
    u = torch.rand((), generator=generator)
    if u * q[draft] < p[draft]:  # u < p/q, without dividing by a zero q
        return int(draft)
    residual = (p - q).clamp(min=0)  # [V]
    if residual.sum() <= 0:  # p == q: a draft is never rejected (kept for safety)
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    # END SOLUTION


def rollback_blocks(bm: Any, block_table: list[int], num_tokens: int) -> list[int]:
    """Exercise 9.4: after a verification, free the blocks of `block_table` past its first `num_tokens`.

    `bm` is the engine's BlockManager: `bm.block_size`, `bm.blocks[b].ref_count`, and `bm.free_block_ids`
    (an OrderedDict used as an ordered set: assigning `free_block_ids[b] = None` adds b). Keep the blocks that
    hold tokens 0..num_tokens-1 (ceil(num_tokens / block_size) of them); for each later block drop one
    reference, and add a block whose count reaches 0 to the free list. Shorten `block_table` in place and
    return the blocks that became free (in any order: any free block serves as well as another).
    """
    # BEGIN SOLUTION
    keep = -(-num_tokens // bm.block_size)
    freed = []
    for block_id in reversed(block_table[keep:]):
        block = bm.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            bm.free_block_ids[block_id] = None
            freed.append(block_id)
    del block_table[keep:]
    return freed
    # END SOLUTION
