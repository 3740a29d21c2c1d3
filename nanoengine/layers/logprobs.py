"""Logprobs: what a request asked to see of the model's distribution, reduced on the device. Chapter 05.

A request with `SamplingParams.logprobs=k` gets, for each generated token, its log probability, its rank (1 is
the most likely; tokens as likely as it count ahead of it, as in vLLM) and the k most likely tokens with
theirs; `prompt_logprobs=k` the same for every prompt token after the first, at the row of the token before
it. The reduction runs where the logits are (`row_logprobs`: a logsumexp, a gather, a count and a top-k per
row), so only [rows, k + 2] numbers travel to the host, never [rows, vocab].

Which distribution (`EngineConfig.logprobs_mode`, vLLM's names):
- "raw_logprobs" (vLLM v1's default): log_softmax of the model's logits, before temperature and filters;
- "processed_logprobs": the distribution the token was drawn from, after temperature, min-p, top-k and top-p
  (tokens the filters removed have logprob -inf). Prompt logprobs are always raw: no token is drawn there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoengine.layers.sampler import SamplingBatch, apply_top_k_top_p_min_p

RAW, PROCESSED = "raw_logprobs", "processed_logprobs"


@dataclass
class LogprobsWanted:
    """What one step's logprobs are: for its sampled rows (the top `sampled_k`; None: no sampled row asked),
    and for its prompt rows, which come after the sampled rows in the logits (`prompt_targets`: each one's
    next prompt token; the top `prompt_k`)."""
    sampled_k: int | None = None
    mode: str = RAW
    prompt_targets: torch.Tensor | None = None  # [P] int64
    prompt_k: int = 0

    def reduce(self, logits: torch.Tensor | None, drawn_from: torch.Tensor | None,
               tokens: torch.Tensor | None, sampling: SamplingBatch,
               num_sampled: int) -> tuple[RowLogprobs | None, RowLogprobs | None]:
        """A row reducer after the draw (what the executor returns with the step's tokens): the sampled rows'
        logprobs and the prompt rows'. `logits` [S (+ P), V]: the model's, the prompt rows after the sampled
        ones; `drawn_from` [S, V]: what the tokens [S] were drawn from (masked: grammars, min_tokens)."""
        sampled = prompt = None
        if logits is not None and logits.shape[0] > num_sampled:
            prompt = prompt_logprobs(logits[num_sampled:], self)
        if tokens is not None and self.sampled_k is not None:
            of = drawn_from if self.mode == PROCESSED else logits[:num_sampled]
            sampled = sampled_logprobs(of, tokens, sampling, self)
        return sampled, prompt


@dataclass
class RowLogprobs:
    """Per row: its own token's logprob and rank, and the top k tokens with their logprobs."""
    token_logprobs: torch.Tensor  # [R] fp32
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor  # [R, k] int64
    top_logprobs: torch.Tensor  # [R, k] fp32

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.token_logprobs, self.ranks, self.top_ids, self.top_logprobs

    def rows(self) -> list[tuple[float, int, list[int], list[float]]]:
        """(logprob, rank, top ids, top logprobs) per row, as Python numbers (on the host)."""
        return list(zip(*(t.tolist() for t in self.tensors())))


def row_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> RowLogprobs:
    """Reduce logits [R, V] fp32 to the log probabilities of each row's `tokens` [R] and of its top k. A
    logprob is a logit less its row's logsumexp, so only the R * (k + 1) numbers kept are subtracted (no
    [R, V] log_softmax is written), and ranks and the top k are read off the logits (the same order)."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
    own = logits.gather(-1, tokens[:, None])  # [R, 1]
    ranks = (logits >= own).sum(dim=-1, dtype=torch.int32).long()  # [R]: 1 for the most likely token
    top = logits.topk(k, dim=-1)  # [R, k] each
    return RowLogprobs((own - lse).squeeze(-1), ranks, top.indices, top.values - lse)


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingBatch,
                     wanted: LogprobsWanted) -> RowLogprobs:
    """The sampled rows' logprobs: logits [S, V] fp32 (the model's), tokens [S] drawn from them."""
    if wanted.mode == PROCESSED:
        divisors = sampling.divisors.to(logits.device)
        logits = apply_top_k_top_p_min_p(logits / divisors[:, None], sampling.top_ks, sampling.top_ps,
                                         sampling.min_ps)  # [S, V]
    return row_logprobs(logits.float(), tokens, wanted.sampled_k)


def prompt_logprobs(logits: torch.Tensor, wanted: LogprobsWanted) -> RowLogprobs:
    """The prompt rows' logprobs: logits [P, V] fp32, each row's next prompt token in `prompt_targets`."""
    targets = wanted.prompt_targets.to(logits.device)  # [P]
    return row_logprobs(logits.float(), targets, wanted.prompt_k)
