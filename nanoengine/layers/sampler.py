"""Sampler: greedy, temperature, top-k, top-p, min-p, and per-request seeds. Chapter 05.

Sampling inverts the cumulative distribution: draw u ~ U[0, 1) per row and take the first token whose
cumulative probability exceeds u * (total mass). That is one random number per token, where the exponential
race (argmax(probs / q), q ~ Exp(1) for every vocabulary entry) needs 150k: on CPU drawing the race's noise
alone costs far more than the cumulative sum. A request with a seed draws its u from its own generator
(engine/sampling.py). Built with `compile=True` (chapter 06; the config decides, on CUDA by default), the
step from logits to the cumulative distribution (temperature, the filters, softmax, cumsum) runs as one
torch.compile'd function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor  # [B] fp32 (0 = greedy)
    top_ks: torch.Tensor | None  # [B] int64 (vocab = off) or None when no row filters
    top_ps: torch.Tensor | None  # [B] fp32 (1 = off)
    min_ps: torch.Tensor | None  # [B] fp32 (0 = off)
    generators: list[torch.Generator | None]  # per row; None = the engine's shared generator
    all_greedy: bool
    any_greedy: bool = True  # some row is greedy (known on the host: asking the device would sync)
    num_logprobs: int | None = None  # the most top logprobs a row asked for (None: no row asked; logprobs.py)
    any_min_tokens: bool = False  # some row's request has min_tokens (its stop ids may be held back)

    def __post_init__(self) -> None:
        # what every step that reuses this batch needs, made once: the rows with their own generator, and the
        # divisors of the logits (the temperatures; 1 for a greedy row, whose argmax is taken anyway)
        self.seeded = [(i, g) for i, g in enumerate(self.generators) if g is not None]
        self.divisors = (torch.where(self.temperatures == 0, 1.0, self.temperatures)
                         if self.any_greedy else self.temperatures)  # [B]


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_ks, top_ps, min_ps) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's allowed set: min-p, then top-k, then top-p on what is
    left. logits [B, V] fp32, already temperature-scaled."""
    if min_ps is not None:
        probs = torch.softmax(logits, dim=-1)
        too_small = probs < min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(too_small, float("-inf"))
    if top_ks is None and top_ps is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    V = logits.shape[-1]
    if top_ks is not None:  # top-k first, then top-p over what top-k kept (vLLM's order)
        beyond_k = torch.arange(V, device=logits.device)[None, :] >= top_ks[:, None]
        beyond_k[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(beyond_k, float("-inf"))
    if top_ps is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        beyond_p = cum_before >= top_ps[:, None]  # keep the smallest prefix whose mass reaches top_p
        beyond_p[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(beyond_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_cdf(logits: torch.Tensor, divisors: torch.Tensor, top_ks, top_ps, min_ps) -> torch.Tensor:
    """The cumulative distribution [B, V] of each row after temperature (`divisors`: the temperatures, 1 for a
    greedy row, whose token is taken by argmax anyway) and the filters; masked tokens add nothing."""
    scaled = logits / divisors[:, None]
    scaled = apply_top_k_top_p_min_p(scaled, top_ks, top_ps, min_ps)
    return torch.softmax(scaled, dim=-1).cumsum_(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, compile: bool = False) -> None:
        self.seed = seed
        self.shared_generators: dict[str, torch.Generator] = {}  # per device, for rows without a seed
        self.cdf = torch.compile(sampling_cdf, dynamic=True) if compile else sampling_cdf

    def shared_generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self.shared_generators:
            self.shared_generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self.shared_generators[key]

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # logits [B, V] fp32 -> next token ids [B]
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        divisors = batch.divisors.to(logits.device)
        cdf = self.cdf(logits, divisors, batch.top_ks, batch.top_ps, batch.min_ps)  # [B, V]
        u = torch.rand(cdf.shape[0], generator=self.shared_generator(cdf.device), device=cdf.device)  # [B]
        for i, gen in batch.seeded:  # a seeded request: its own stream, one draw per token
            u[i] = torch.rand((), generator=gen).item()
        # scale by the last entry (the total, 1 up to rounding) so u never falls past the last allowed token
        target = (u * cdf[:, -1])[:, None]  # [B, 1]
        sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        if batch.any_greedy:
            sampled = torch.where(batch.temperatures.to(logits.device) == 0, logits.argmax(dim=-1), sampled)
        return sampled
