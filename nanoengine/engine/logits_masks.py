"""Logits masks: what a step forbids its sampled rows before the sampler draws. Chapter 05.

A mask is anything with `apply(logits) -> logits`: it returns a new tensor [num_sampled, V] with the
forbidden tokens at -inf, and leaves the raw logits as they are (the "raw" logprobs read them; "processed"
logprobs read what the sampler drew from). The engine lays out a step's masks on the host and hands them to
the executor as one (`chain`):
- the grammars of structured outputs (`nanoengine.structured.TokenMask`);
- `min_tokens`, as vLLM's min-tokens logits processor: until a sequence has `min_tokens` output tokens, its
  stop token ids and (unless `ignore_eos`) the end-of-sequence ids are never drawn (`min_tokens_mask`). A
  verifying sequence's rows (speculative decoding) each count the drafts before them, so a draft of a
  stop id before `min_tokens` is rejected like any token the model cannot draw.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nanoengine.engine.sequence import Sequence


class LogitsMask(Protocol):
    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...


@dataclass
class BannedTokens:
    """Single tokens forbidden on single rows: row `rows[i]` may not draw token `token_ids[i]`."""
    rows: torch.Tensor  # [M] int64
    token_ids: torch.Tensor  # [M] int64

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        banned = logits.clone()  # [num_sampled, V]
        rows = self.rows.to(logits.device, non_blocking=True)
        ids = self.token_ids.to(logits.device, non_blocking=True)
        banned[rows, ids] = float("-inf")
        return banned


@dataclass
class MaskChain:
    masks: list[LogitsMask]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for mask in self.masks:
            logits = mask.apply(logits)
        return logits


def chain(*masks: LogitsMask | None) -> LogitsMask | None:
    """The masks given (None: none), applied in turn; None when there are none."""
    present = [m for m in masks if m is not None]
    if len(present) <= 1:
        return present[0] if present else None
    return MaskChain(present)


class MinTokens:
    """The engine's `min_tokens` mask, chained over the grammars' mask (`over`) as a step is launched."""

    def __init__(self, eos_token_ids: Iterable[int], vocab_size: int) -> None:
        self.eos_token_ids, self.vocab_size = eos_token_ids, vocab_size

    def over(self, mask: Any, seqs: list[Sequence], sampling: Any) -> LogitsMask | None:
        """`mask` (the grammars', or None), then the stop ids held back until `min_tokens` where a row holds
        any back (`sampling`: the step's SamplingBatch, which knows whether a row asked)."""
        if sampling is None or not sampling.any_min_tokens:
            return mask
        return chain(mask, min_tokens_mask(seqs, self.eos_token_ids, self.vocab_size, mask))


def min_tokens_mask(seqs: list[Sequence], eos_token_ids: Iterable[int], vocab_size: int,
                    grammar: Any = None) -> BannedTokens | None:
    """The stop ids each sampled row (`seqs`: the sequence of each row, a verifying sequence's 1 + k rows in a
    row) may not draw because its sequence has fewer than `min_tokens` output tokens before that row's token;
    None when no row is held back. A row whose grammar (`grammar`: the step's TokenMask) allows nothing but
    stop tokens keeps them: the grammar's end wins, as nothing else could be drawn."""
    rows: list[int] = []
    ids: list[int] = []
    eos = [t for t in eos_token_ids if t < vocab_size]
    before, run = None, 0  # the sequence of the row before, and this row's place among its sequence's rows
    for row, seq in enumerate(seqs):
        run = run + 1 if seq is before else 0
        before = seq
        params = seq.sampling_params
        # the output tokens before this row's: the known and pending ones before its place, and its drafts
        made = seq.num_tokens - 1 - seq.num_prompt_tokens + run
        if made >= params.min_tokens:
            continue
        stops = [t for t in params.stop_token_ids if t < vocab_size] + ([] if params.ignore_eos else eos)
        if stops and not (grammar is not None and only_stops_allowed(grammar, row, stops)):
            rows += [row] * len(stops)
            ids += stops
    if not rows:
        return None
    return BannedTokens(torch.tensor(rows, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64))


def only_stops_allowed(grammar: Any, row: int, stops: list[int]) -> bool:
    """Whether the grammar mask allows row `row` nothing but tokens of `stops` (its grammar is complete)."""
    if row not in grammar.rows:
        return False
    bits = grammar.bitmask[row].clone()  # [ceil(V / 32)] int32: bit j of word w = token 32 * w + j
    for t in stops:
        w, j = divmod(t, 32)
        if w < bits.shape[0]:
            bits[w] &= ~(1 << j) if j < 31 else 0x7FFFFFFF
    return not bool(bits.any())
