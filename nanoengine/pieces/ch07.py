"""Chapter 07's pieces in the engine: each rank loads its shards of the weights with your
`shard_merged_rows` (7.1), and every tensor-parallel layer's forward is yours: the column-parallel linears
(q/k/v, gate/up) and the LM head run your `column_parallel_forward` (7.5), the row-parallel ones (o_proj,
down_proj) your `row_parallel_forward` (7.6) with its all-reduce, and the embedding your
`vocab_parallel_embedding_forward` (7.7).

Every tensor-parallel layer asks its `TPGroup` which rows or columns of a checkpoint tensor its rank holds,
and for its forward (nanoengine/layers/tp_group.py); `LearnerTPGroup` answers with your functions. Rows: each
part of a fused q/k/v or gate/up weight, the embedding and the LM head, as one-part calls of your 7.1 (q/k/v
rows are head-major, so a rank's rows are its whole heads: what your 7.2 builds for all three at once).
Columns (o_proj, down_proj): your 7.1 on the transposed weight. The forwards get the layer's weight and bias
and call `torch.distributed` themselves, in the process group the engine's ranks form; the LM head is your
7.5 with gather=True, of which rank 0 keeps the logits (it samples). With one rank there is nothing to
communicate and no process group, so the row-parallel layers, the embedding and the LM head run the engine's
own forwards; your 7.5 runs there too (it communicates only to gather). Your 7.3 and 7.4 simulate the ranks in
one process: the engine runs their ideas in 7.6 and 7.7.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from nanoengine.layers.tp_group import Matmul, TPGroup
from nanoengine.pieces.learner import check_result, piece


def full(loaded) -> torch.Tensor:
    """The whole tensor of a checkpoint tensor or lazy safetensors slice (your functions take tensors)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


def checked_shape(out, want: tuple, fn: Callable, what: str) -> torch.Tensor:
    """out, once it is a tensor of shape `want`; else the ExerciseError naming fn (`what`: for what input)."""
    got = tuple(getattr(out, "shape", ()))
    check_result(isinstance(out, torch.Tensor) and got == tuple(want), fn,
                 f"shape {got} {what}; it must be {want}")
    return out


@dataclass(frozen=True)
class LearnerTPGroup(TPGroup):
    shard_rows: Callable | None = None
    column_forward: Callable | None = None
    row_forward: Callable | None = None
    embed_forward: Callable | None = None

    def rows(self, loaded, n: int) -> torch.Tensor:
        out = self.shard_rows(full(loaded), [n], self.rank, self.size)
        want = (n // self.size,
                *tuple(loaded.shape if isinstance(loaded, torch.Tensor) else loaded.get_shape())[1:])
        return checked_shape(out, want, self.shard_rows,
                             f"for rank {self.rank} of {self.size} of a weight with {n} rows")

    def columns(self, loaded, n: int) -> torch.Tensor:
        return self.rows(full(loaded).T, n).T  # a rank's columns are its rows of the transpose

    def column_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        matmul: Matmul) -> torch.Tensor:
        out = self.column_forward(x, weight, bias)  # [num_tokens, out / N]
        return checked_shape(out, (x.shape[0], weight.shape[0]), self.column_forward,
                             f"on rank {self.rank} for {x.shape[0]} tokens and a weight shard "
                             f"{tuple(weight.shape)}")

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     matmul: Matmul) -> torch.Tensor:
        if self.size == 1:
            return super().row_parallel(x, weight, bias, matmul)
        out = self.row_forward(x, weight, bias)  # [num_tokens, out], all-reduced
        return checked_shape(out, (x.shape[0], weight.shape[0]), self.row_forward,
                             f"on rank {self.rank} for {x.shape[0]} tokens and a weight shard "
                             f"{tuple(weight.shape)}")

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return super().embed(ids, weight)
        out = self.embed_forward(ids, weight)  # [num_tokens, dim], all-reduced
        return checked_shape(out, (ids.shape[0], weight.shape[1]), self.embed_forward,
                             f"on rank {self.rank} for {ids.shape[0]} ids").to(weight.dtype)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, matmul: Matmul) -> torch.Tensor | None:
        if self.size == 1:
            return super().logits(hidden, weight, matmul)
        out = self.column_forward(hidden, weight, None, True)  # [num_seqs, vocab] on every rank
        checked_shape(out, (hidden.shape[0], weight.shape[0] * self.size), self.column_forward,
                      f"on rank {self.rank} with gather=True for {hidden.shape[0]} rows and {self.size} "
                      f"weight shards {tuple(weight.shape)}")
        return out.float() if self.rank == 0 else None  # rank 0 samples


def group_wrapper(module: ModuleType) -> Callable[[TPGroup], LearnerTPGroup]:
    """A rank's group, answering with your functions."""
    shard_rows = piece(module, "shard_merged_rows", "ch07")
    column = piece(module, "column_parallel_forward", "ch07")
    row = piece(module, "row_parallel_forward", "ch07")
    embed = piece(module, "vocab_parallel_embedding_forward", "ch07")

    def wrap(group: TPGroup) -> LearnerTPGroup:
        return LearnerTPGroup(group.rank, group.size, shard_rows, column, row, embed)
    return wrap
