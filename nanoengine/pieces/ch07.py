"""Chapter 07's pieces in the engine: each rank loads its shards of the weights with your
`shard_merged_rows` (7.1) and looks up its vocabulary shard with your `vocab_parallel_embedding` (7.4).

Every tensor-parallel layer asks its `TPGroup` which rows or columns of a checkpoint tensor its rank holds,
and for its part of the embedding lookup; `LearnerTPGroup` answers with your functions. Rows: each part of a
fused q/k/v or gate/up weight, the embedding and the LM head, as one-part calls of your 7.1 (q/k/v rows are
head-major, so a rank's rows are its whole heads: what your 7.2 builds for all three at once). Columns
(o_proj, down_proj): your 7.1 on the transposed weight. Your 7.3 simulates all ranks in one process, so it has
no place in a real rank; the engine's row-parallel layer does the same sum with an all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from nanoengine.layers.tp_group import TPGroup
from nanoengine.pieces.learner import check_result, piece


def full(loaded) -> torch.Tensor:
    """The whole tensor of a checkpoint tensor or lazy safetensors slice (your functions take tensors)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


@dataclass(frozen=True)
class LearnerTPGroup(TPGroup):
    shard_rows: Callable | None = None
    lookup: Callable | None = None

    def rows(self, loaded, n: int) -> torch.Tensor:
        out = self.shard_rows(full(loaded), [n], self.rank, self.size)
        want = (n // self.size,
                *tuple(loaded.shape if isinstance(loaded, torch.Tensor) else loaded.get_shape())[1:])
        check_result(isinstance(out, torch.Tensor) and tuple(out.shape) == want, self.shard_rows,
                     f"shape {tuple(getattr(out, 'shape', ()))} for rank {self.rank} of {self.size} of a "
                     f"weight with {n} rows; it must be {want}")
        return out

    def columns(self, loaded, n: int) -> torch.Tensor:
        return self.rows(full(loaded).T, n).T  # a rank's columns are its rows of the transpose

    def vocab_partial(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = self.lookup(ids, weight, self.rank, self.size)
        check_result(isinstance(out, torch.Tensor) and out.shape == (ids.shape[0], weight.shape[1]),
                     self.lookup,
                     f"shape {tuple(getattr(out, 'shape', ()))} for {ids.shape[0]} ids; it must be "
                     f"[{ids.shape[0]}, {weight.shape[1]}]")
        return out.to(weight.dtype)


def group_wrapper(module: ModuleType) -> Callable[[TPGroup], LearnerTPGroup]:
    """A rank's group, answering with your functions."""
    shard_rows = piece(module, "shard_merged_rows", "ch07")
    lookup = piece(module, "vocab_parallel_embedding", "ch07")

    def wrap(group: TPGroup) -> LearnerTPGroup:
        return LearnerTPGroup(group.rank, group.size, shard_rows, lookup)
    return wrap
