"""Linear layers whose parameters know how to load their slice of a checkpoint. Chapters 02 and 07.

`MergedLinear` fuses several Hugging Face projections (q/k/v, or gate/up) into one matmul; each part is
loaded into its rows by `weight_loader(param, loaded, shard_id)`.
"""

from __future__ import annotations

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias.weight_loader = default_weight_loader


class MergedLinear(nn.Linear):
    """Several output projections stacked along the output dimension; parts named by `shard_ids`."""

    def __init__(self, in_features: int, part_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(part_sizes.values()), bias=bias)
        self.part_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in part_sizes.items():
            self.part_offsets[name] = (start, size)
            start += size
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        start, size = self.part_offsets[shard_id]
        if loaded.shape[0] != size:
            raise ValueError(f"part {shard_id!r}: expected {size} rows, checkpoint has {loaded.shape[0]}")
        param.data.narrow(0, start, size).copy_(loaded)
