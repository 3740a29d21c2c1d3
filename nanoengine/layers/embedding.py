"""Token embedding and the language-model head (tied to the embedding when the config says so). Chapter 02."""

from __future__ import annotations

import torch
from torch import nn

from nanoengine.layers.linear import default_weight_loader


class Embedding(nn.Embedding):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__(vocab_size, dim)
        self.weight.weight_loader = default_weight_loader


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_seqs, dim] -> [num_seqs, vocab] fp32
        return torch.nn.functional.linear(hidden, self.weight).float()
