"""Token embedding and the language-model head (tied to the embedding when the config says so), both
vocab-parallel under tensor parallelism: with N ranks, rank r holds vocabulary rows [r * V/N, (r + 1) * V/N)
of both tables (their forwards: `TPGroup.embed`, `TPGroup.logits`). Chapters 02 and 07.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoengine.layers.linear import PackableLinear, checkpoint_shape
from nanoengine.layers.tp_group import SINGLE, TPGroup


def vocab_rows_loader(tp: TPGroup):
    """Load this rank's vocabulary rows of an embedding-shaped [vocab, dim] checkpoint tensor."""
    def load(param: nn.Parameter, loaded) -> None:
        full = checkpoint_shape(loaded)
        if full != (param.shape[0] * tp.size, param.shape[1]):
            raise ValueError(f"shape mismatch: parameter {(param.shape[0] * tp.size, param.shape[1])} vs "
                             f"checkpoint {full}")
        param.data.copy_(tp.rows(loaded, full[0]))
    return load


class Embedding(nn.Embedding):
    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(vocab_size // tp.size, dim)
        self.tp = tp
        self.weight.weight_loader = vocab_rows_loader(tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, dim]
        return self.tp.embed(ids, self.weight)  # this rank's part, all-reduced


class LMHead(PackableLinear):
    """The output projection (no bias); full-vocabulary logits in float32 on rank 0 (None on other ranks)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(dim, vocab_size // tp.size, bias=False)
        self.tp = tp
        self.weight.weight_loader = vocab_rows_loader(tp)

    # [num_seqs, dim] -> [num_seqs, vocab] fp32
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.tp.logits(hidden, self.weight, self.matmul)
