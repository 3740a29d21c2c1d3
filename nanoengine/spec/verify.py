"""Verifying proposals: which drafted tokens a sequence keeps. Chapter 09.

The model runs once over [last token, d_1, ..., d_k] and gives, at each of those k + 1 positions, its own
token t_i for the position after it (argmax, or a draw from its distribution). `accepted_tokens` keeps the
drafts while they equal the model's tokens, then adds the model's token at the first mismatch (or after the
last draft): 1 to k + 1 new tokens per forward, each one exactly what decoding without speculation would have
produced there (greedy), since every kept draft was the model's own choice given the tokens before it.

With sampling the rule is rejection sampling (Leviathan et al. 2023, Chen et al. 2023): a draft d drawn from
the proposer's distribution q is accepted with probability min(1, p(d) / q(d)), and on rejection the token is
drawn from the normalized max(0, p - q). The accepted token is then distributed as p exactly
(`rejection_sample`; tests/test_spec.py checks it by chi-square). The n-gram proposer is deterministic, q is a
point mass on d: accept with probability p(d), else draw from p without d, which is the same as drawing t ~ p
and accepting when t == d. So for it the engine draws each position's token with its ordinary sampler and
applies `accepted_tokens` to those, as in greedy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


def accepted_tokens(drafts: list[int], verified: list[int]) -> list[int]:
    """The tokens a speculating sequence appends: drafts[:a] + [verified[a]], a = the length of the longest
    prefix of `drafts` equal to `verified` (the model's tokens at the k + 1 positions, len(drafts) + 1)."""
    a = 0
    while a < len(drafts) and drafts[a] == verified[a]:
        a += 1
    return verified[:a + 1]  # (verified[i] == drafts[i] for i < a)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """One verification step per row: the draft (drawn from draft_probs) where it is accepted, with
    probability min(1, p(d) / q(d)), else a draw from the normalized max(0, p - q); a row whose draft is -1
    (the bonus position after the last draft) draws from p. target_probs, draft_probs [R, V]; draft_tokens [R]
    int64 -> tokens [R] int64, each distributed as p."""
    has_draft = draft_tokens >= 0  # [R]
    d = draft_tokens.clamp(min=0)[:, None]  # [R, 1]
    p_d = target_probs.gather(1, d).squeeze(1)  # [R]
    q_d = draft_probs.gather(1, d).squeeze(1)  # [R]
    u = torch.rand(p_d.shape, generator=generator, device=p_d.device)  # [R]
    accept = has_draft & (u * q_d < p_d)  # u < p/q without dividing by q
    residual = torch.where(has_draft[:, None], (target_probs - draft_probs).clamp(min=0), target_probs)
    empty = residual.sum(dim=1, keepdim=True) <= 0  # p == q: every draft is accepted anyway
    residual = torch.where(empty, target_probs, residual)  # [R, V]
    resampled = torch.multinomial(residual, 1, generator=generator).squeeze(1)  # [R]
    return torch.where(accept, d.squeeze(1), resampled)


class Verification(NamedTuple):
    """One speculating sequence's verification in one engine step."""
    step: int  # the step it ran in (SchedulerOutput.step: the steps the scheduler committed before it)
    seq_id: int
    proposed: int  # drafts verified
    accepted: int  # of them kept
    tokens: int  # appended (the kept drafts and the model's own token, unless a stop came first)


RECORD_LEN = 10_000  # verifications kept in SpecCounts.record (the latest ones)


@dataclass
class SpecCounts:
    """What speculation did in an engine's life: drafts proposed and accepted, and the verifications (one
    per speculating sequence per step) with the tokens they gave; `record` keeps the latest RECORD_LEN
    verifications one by one (chapter 09's per-step figure is drawn from it)."""
    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    tokens: int = 0  # appended by the verifications (accepted drafts + the model's own token)
    record: deque[Verification] = field(default_factory=lambda: deque(maxlen=RECORD_LEN), repr=False)

    def add(self, num_drafts: int, num_accepted: int, num_tokens: int, step: int, seq_id: int) -> None:
        self.proposed += num_drafts
        self.accepted += num_accepted
        self.verifications += 1
        self.tokens += num_tokens
        self.record.append(Verification(step, seq_id, num_drafts, num_accepted, num_tokens))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"proposed": self.proposed, "accepted": self.accepted, "verifications": self.verifications,
                "tokens": self.tokens, "acceptance_rate": self.acceptance_rate,
                "tokens_per_verification": self.tokens / self.verifications if self.verifications else 0.0}
