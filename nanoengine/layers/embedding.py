"""Token embedding and the language-model head (tied to the embedding when the config says so). Chapter 02."""

from __future__ import annotations

import torch
from torch import nn

from nanoengine.layers.linear import PackableLinear, default_weight_loader


class Embedding(nn.Embedding):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__(vocab_size, dim)
        self.weight.weight_loader = default_weight_loader


class LMHead(PackableLinear):
    """The output projection (no bias); logits in float32 for the sampler."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_seqs, dim] -> [num_seqs, vocab] fp32
        return super().forward(hidden).float()
