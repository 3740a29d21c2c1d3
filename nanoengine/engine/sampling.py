"""SamplingBatcher: each sampled row's request parameters, laid out for the sampler. Chapter 05.

The executor draws a step's tokens with the sampler (`layers/sampler.py`, or the learner's) under the step's
`SamplingBatch`: per-row temperatures and filters, as tensors only when some row filters. `batch(seqs)` lays
it out on the driver before the step is launched. A request with a seed gets its own generator, seeded with
seed + its completion index, kept until `release` (when it finishes or is aborted), so its samples do not
depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from nanoengine.engine.sequence import Sequence
from nanoengine.layers.sampler import SamplingBatch


class SamplingBatcher:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its own generator (seeded requests)
        self.last_seqs: list[Sequence] = []  # the sequences of the last batch laid out, and that batch
        self.last_batch: SamplingBatch | None = None

    def batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The SamplingBatch of a step's sampled rows (one per entry of `seqs`), on the logits' device."""
        if seqs != self.last_seqs:  # decode steps mostly sample the same sequences as the step before
            self.last_seqs, self.last_batch = seqs, self.layout(seqs)  # (by identity: no Sequence.__eq__)
        return self.last_batch

    def layout(self, seqs: list[Sequence]) -> SamplingBatch:
        params = [s.sampling_params for s in seqs]
        gens = []
        for s, p in zip(seqs, params):
            if p.seed is not None and not p.greedy:
                if s.seq_id not in self.generators:
                    self.generators[s.seq_id] = torch.Generator().manual_seed(p.seed + s.index)
                gens.append(self.generators[s.seq_id])
            else:
                gens.append(None)
        any_k = any(p.top_k > 0 for p in params)
        any_p = any(p.top_p < 1.0 for p in params)
        any_min_p = any(p.min_p > 0.0 for p in params)

        def rows(values: list, dtype: torch.dtype) -> torch.Tensor:  # [B] on the logits' device
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)  # no stream sync

        return SamplingBatch(
            temperatures=rows([p.temperature for p in params], torch.float32),
            top_ks=(rows([p.top_k if p.top_k > 0 else self.vocab_size for p in params], torch.int64)
                    if any_k else None),
            top_ps=rows([p.top_p for p in params], torch.float32) if any_p else None,
            min_ps=rows([p.min_p for p in params], torch.float32) if any_min_p else None,
            generators=gens, all_greedy=all(p.greedy for p in params),
            any_greedy=any(p.greedy for p in params),
            num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            any_min_tokens=any(p.min_tokens for p in params),
        )

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence's sampling state."""
        self.generators.pop(seq.seq_id, None)
        if seq in self.last_seqs:
            self.last_seqs, self.last_batch = [], None
