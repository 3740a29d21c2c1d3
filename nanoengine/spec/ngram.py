"""The n-gram proposer (prompt lookup decoding; vLLM's "ngram" method). Chapter 09.

No model: the proposal for a sequence is what followed the last time its last n tokens appeared, in the
prompt or the output so far. For a task that copies from its input (summarise, edit, answer from a passage)
the model often continues with a span it has already seen, and the lookup finds it for free. n goes from
`max_n` down to `min_n` (a longer match is a better predictor); among the places a suffix occurs, the most
recent one followed by k tokens wins (recent text predicts best), else the earliest (the longest
continuation: in a run "a a a a" the latest match is followed by one token only).
"""

from __future__ import annotations


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, max_n: int = 4, min_n: int = 1) -> None:
        self.k = num_speculative_tokens
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) tokens that followed the latest earlier occurrence of the longest suffix
        of `token_ids` (n = max_n..min_n tokens); [] when no suffix occurs before."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        size = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = token_ids[size - n:]
            last = suffix[-1]
            found = None
            for start in range(size - n - 1, -1, -1):  # latest first; the suffix itself is excluded
                if token_ids[start + n - 1] == last and token_ids[start:start + n] == suffix:
                    found = start
                    if start + n + k <= size:
                        break
            if found is not None:
                return token_ids[found + n:found + n + k]
        return []
