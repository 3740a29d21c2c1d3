"""The tensor-parallel group as the layers see it: this process's rank, the group's size, and the two
collectives a sharded model needs. Chapter 07.

A layer is built with a `TPGroup` and asks it nothing else: which rows (`rows`) or columns (`columns`) of a
checkpoint tensor this rank holds, its part of a vocab-parallel embedding lookup (`vocab_partial`); the
row-parallel linears and the vocab-parallel embedding sum their partial results with `all_reduce`, and the LM
head `gather`s its vocabulary shards to rank 0, where sampling happens. With `size == 1` the collectives are
no-ops, so the single-process engine runs the same layers. (The learner's sharding, chapter 07's exercises,
runs inside the engine as a TPGroup whose `rows`, `columns` and `vocab_partial` are theirs:
nanoengine.pieces.)
Forming the process group itself is `nanoengine.distributed`'s job; a layer only calls the collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def shard(self, n: int) -> tuple[int, int]:
        """This rank's equal share of n rows: (start, length). n is divisible (EngineConfig checks)."""
        length = n // self.size
        return self.rank * length, length

    def rows(self, loaded, n: int) -> torch.Tensor:
        """This rank's share of the n rows of a checkpoint tensor, or of a lazy safetensors slice (then only
        those rows are read)."""
        first, length = self.shard(n)
        return loaded[first:first + length]

    def columns(self, loaded, n: int) -> torch.Tensor:
        """This rank's share of the n columns of a 2-D checkpoint tensor (or lazy slice)."""
        first, length = self.shard(n)
        return loaded[:, first:first + length]

    def vocab_partial(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of an embedding lookup: ids [num_tokens] -> [num_tokens, dim], the rows of the ids
        in its vocabulary shard `weight` [vocab / size, dim] and zeros for the others (an all-reduce sums
        them)."""
        local = ids - self.rank * weight.shape[0]  # [num_tokens]: row in this rank's shard
        here = (local >= 0) & (local < weight.shape[0])
        x = F.embedding(local.masked_fill(~here, 0), weight)  # [num_tokens, dim]
        return x.masked_fill(~here[:, None], 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (every rank gets the sum)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise minimum of x over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0 (None on the others)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


SINGLE = TPGroup()  # one process: every layer whole
