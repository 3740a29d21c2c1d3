"""Linear layers whose parameters know how to load their slice of a checkpoint. Chapters 02 and 07.

`MergedLinear` fuses several Hugging Face projections (q/k/v, or gate/up) into one matmul; each part is
loaded into its rows by `weight_loader(param, loaded, shard_id)`.

On a CPU with bf16 support, `prepack_weights(model)` (chapter 06) reorders every weight once into oneDNN's
blocked layout. A plain `F.linear` reorders the weight on every call; decode steps multiply a few rows by
the whole weight, so that per-call reorder is much of their time (1.3-1.8x faster linears at batch 1-32 here).
The packed copy is an opaque oneDNN tensor beside the ordinary weight (which loading and tests still use).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def onednn_bf16_available() -> bool:
    """True when this torch build can run oneDNN bf16 linears on this CPU (asked by EngineConfig.resolve)."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackableLinear(nn.Linear):
    """nn.Linear whose weight can be prepacked for oneDNN on CPU (see the module docstring)."""

    packed_weight: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepack_weights(model: nn.Module) -> int:
    """Prepack every PackableLinear of a loaded bf16 model for oneDNN; returns how many were packed."""
    layers = [m for m in model.modules() if isinstance(m, PackableLinear)]
    for m in layers:
        m.prepack()
    return len(layers)


class Linear(PackableLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias.weight_loader = default_weight_loader


class MergedLinear(PackableLinear):
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
