"""The n-gram proposer (prompt lookup decoding; vLLM's "ngram" method). Chapter 09.

No model: the proposal for a sequence is what followed the last time its last n tokens appeared, in the
prompt or the output so far. For a task that copies from its input (summarise, edit, answer from a passage)
the model often continues with a span it has already seen, and the lookup finds it for free. n goes from
`max_n` down to `min_n` (a longer match is a better predictor); among the places a suffix occurs, the most
recent one followed by k tokens wins (recent text predicts best), else the earliest (the longest
continuation: in a run "a a a a" the latest match is followed by one token only).
"""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    """What the scheduler asks for drafts (plain Python: any object with this method will do; one that also
    has `propose_many(token_ids_list, max_tokens_list)` is asked for a whole step's sequences at once)."""

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """At most max_tokens (and the proposer's own k) tokens to follow `token_ids`; [] for none."""
        ...


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, max_n: int = 4, min_n: int = 1) -> None:
        self.k = num_speculative_tokens
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) tokens that followed the latest earlier occurrence of the longest suffix
        of `token_ids` (n = max_n..min_n tokens); [] when no suffix occurs before. One pass over the places
        the last token occurred before, each matched backwards (a scheduler asks this for every decoding
        sequence at every step)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        size = len(token_ids)
        if k <= 0 or size < 2:
            return []
        last = token_ids[-1]
        ends = [e for e, t in enumerate(token_ids) if t == last]  # where an occurrence of a suffix ends
        ends.pop()  # (the suffix itself)
        best_n, latest_full, earliest = 0, None, None
        for e in reversed(ends):  # latest first
            n = 1
            while n < self.max_n and n <= e and token_ids[e - n] == token_ids[size - 1 - n]:
                n += 1
            if n < self.min_n or n < best_n:
                continue
            if n > best_n:  # a longer match: start over
                best_n, latest_full = n, None
            if latest_full is None and e + k < size:
                latest_full = e
            earliest = e
        if best_n == 0:
            return []
        e = latest_full if latest_full is not None else earliest
        return token_ids[e + 1:e + 1 + k]

    def propose_many(self, token_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """`propose` for each of a step's sequences (a lookup each: nothing to batch)."""
        return [self.propose(ids, m) for ids, m in zip(token_ids, max_tokens)]
