"""The tensor-parallel group as the layers see it: this process's rank, the group's size, and the
collectives a sharded model needs. Chapter 07.

A layer is built with a `TPGroup` and asks it nothing else: which rows (`rows`) or columns (`columns`) of a
checkpoint tensor this rank holds when it loads, and its parallel forward (`column_parallel`, `row_parallel`,
`embed`, `logits`: each says what it communicates), to which it passes its own `matmul` (its packed or bf16
fast paths). With `size == 1` the collectives are no-ops, so the single-process engine runs the same layers.
Chapter 07's exercises run inside the engine as a TPGroup whose sharding and forwards are the learner's
(nanoengine.pieces.ch07). With `expert_parallel` (EngineConfig.enable_expert_parallel) each rank holds whole
experts, `shard(num_experts)` of them, instead of 1/N of every expert (layers/moe.py); the other layers shard
as always. Forming the process group itself is `nanoengine.distributed`'s job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

# a layer's matmul: (x, bias or None) -> x @ weight.T (+ bias), through the layer's fast paths
Matmul = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    # keyword-only, so that a subclass's own fields still follow rank and size positionally
    expert_parallel: bool = field(default=False, kw_only=True)

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

    def column_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        matmul: Matmul) -> torch.Tensor:
        """A column-parallel linear's forward: x [num_tokens, in] (whole on every rank), weight [out / N, in]
        and bias [out / N] this rank's output rows -> [num_tokens, out / N], this rank's output slice. No
        communication: the row-parallel layer after it takes exactly that slice as its input."""
        return matmul(x, bias)

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     matmul: Matmul) -> torch.Tensor:
        """A row-parallel linear's forward: x [num_tokens, in / N] and weight [out, in / N] this rank's input
        columns, bias [out] whole -> [num_tokens, out] on every rank: the all-reduced partial products, with
        the bias once (it joins rank 0's partial sum only)."""
        return self.all_reduce(matmul(x, bias if self.rank == 0 else None))

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A vocab-parallel embedding's forward: ids [num_tokens], weight [vocab / N, dim] this rank's rows ->
        [num_tokens, dim] on every rank (each token's row comes from the one rank that holds it)."""
        if self.size == 1:
            return F.embedding(ids, weight)
        return self.all_reduce(self.vocab_partial(ids, weight))

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, matmul: Matmul) -> torch.Tensor | None:
        """The LM head's forward: hidden [num_seqs, dim], weight [vocab / N, dim] this rank's vocabulary rows
        -> [num_seqs, vocab] float32 on rank 0, where sampling happens (None on the others), the ranks'
        slices side by side."""
        return self.gather(matmul(hidden, None).float())  # [num_seqs, vocab / N] per rank, gathered

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
