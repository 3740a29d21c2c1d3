# Your exercises for book/07a_sharding.ipynb, 07b_real_ranks.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch07")`, from nanoengine.check) or: pytest tests/exercises/test_ch07_tensor_parallelism.py
# Generated from solutions/ch07_tensor_parallelism.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
"""Chapter 07, book/07a_sharding.ipynb .. 07b_real_ranks.ipynb: splitting a model's weights across ranks.

Exercise 7.1: a rank's rows of a fused column-parallel weight (gate/up): its share of every part.
Exercise 7.2: a rank's fused q/k/v weight, sharded by heads (grouped-query attention aware).
Exercise 7.3: a row-parallel linear over simulated ranks: partial products, their sum, the bias once.
Exercise 7.4: a rank's part of a vocab-parallel embedding lookup.
Exercise 7.5: a column-parallel linear's forward on a real rank (no communication, or an all-gather).
Exercise 7.6: a row-parallel linear's forward on a real rank: all-reduce the partial sums, add the bias once.
Exercise 7.7: a vocab-parallel embedding's forward on a real rank: mask, look up, zero, all-reduce.

In 7.1-7.4 the ranks are simulated in one process: a function gets `rank` and `size` and returns what that
rank would hold or compute. The tests compare your shards with the ones nanoengine's own layers load
(`nanoengine/layers/linear.py`, `nanoengine/layers/embedding.py`).

7.5-7.7 run in real processes: every rank calls your function at the same time, in a `torch.distributed`
process group (gloo on CPU) that is already formed, and your function talks to the other ranks with
`torch.distributed`'s collectives (`dist.get_rank()`, `dist.get_world_size()`, `dist.all_reduce`,
`dist.all_gather`). The tests run them on two processes against the whole, unsharded layer; inside the engine
every tensor-parallel layer's forward is yours (nanoengine/pieces/ch07.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def shard_merged_rows(weight: torch.Tensor, part_sizes: list[int], rank: int, size: int) -> torch.Tensor:
    """Exercise 7.1: this rank's rows of a fused column-parallel weight.

    `weight` [sum(part_sizes), in_features] stacks several projections (gate_proj then up_proj: part_sizes
    [intermediate, intermediate]). Each rank keeps rank's 1/size of EVERY part's rows, so that it can apply
    SwiGLU to its own gate and up rows with no communication. Return them stacked in part order:
    [sum(part_sizes) / size, in_features].
    """
    raise NotImplementedError("Exercise 7.1: this rank's rows of a fused column-parallel weight - see book/07a_sharding.ipynb")


def shard_qkv(q_weight: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, num_heads: int,
              num_kv_heads: int, head_dim: int, rank: int, size: int) -> torch.Tensor:
    """Exercise 7.2: this rank's fused q/k/v weight, sharded by heads.

    q_weight [num_heads * head_dim, hidden], k_weight and v_weight [num_kv_heads * head_dim, hidden]; rows are
    head-major (head h is rows h * head_dim .. (h + 1) * head_dim). A rank keeps num_heads / size query heads
    and the num_kv_heads / size KV heads those queries read (with grouped-query attention, query head j reads
    KV head j // (num_heads / num_kv_heads)). Return its q rows, then k rows, then v rows:
    [(num_heads + 2 * num_kv_heads) / size * head_dim, hidden]. Raise ValueError, naming the counts, when size
    does not divide both head counts.
    """
    raise NotImplementedError("Exercise 7.2: this rank's fused q/k/v weight, sharded by heads - see book/07a_sharding.ipynb")


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Exercise 7.3: a row-parallel linear layer over `size` simulated ranks.

    x [tokens, in_features], weight [out_features, in_features], bias [out_features] or None. Rank r holds
    the r-th 1/size of the input columns: x[:, cols_r] (what the column-parallel layer before it produced) and
    weight[:, cols_r]. Return (partials, out): partials[r] = rank r's partial product [tokens, out_features],
    with the bias added on rank 0 only, and out = their sum (what the all-reduce gives every rank), which
    equals x @ weight.T + bias.
    """
    raise NotImplementedError("Exercise 7.3: a row-parallel linear layer over `size` simulated ranks - see book/07a_sharding.ipynb")


def vocab_parallel_embedding(ids: torch.Tensor, weight_shard: torch.Tensor, rank: int,
                             size: int) -> torch.Tensor:
    """Exercise 7.4: this rank's part of an embedding lookup over a vocabulary split in `size` equal shards.

    weight_shard [vocab / size, dim] holds vocabulary rows rank * vocab / size .. (rank + 1) * vocab / size.
    For ids [tokens], return [tokens, dim]: the embedding of each id this rank holds, and zeros for the ids
    other ranks hold, so that summing the ranks' results (the all-reduce) gives the full lookup.
    """
    raise NotImplementedError("Exercise 7.4: this rank's part of an embedding lookup over a vocabulary split in `size` equal shards - see book/07b_real_ranks.ipynb")


def column_parallel_forward(x: torch.Tensor, weight_shard: torch.Tensor, bias_shard: torch.Tensor | None,
                            gather: bool = False) -> torch.Tensor:
    """Exercise 7.5: a column-parallel linear's forward on this rank.

    x [tokens, in_features] is the whole input (every rank has it); weight_shard [out_features / size,
    in_features] and bias_shard [out_features / size] (or None) are this rank's output rows (rank r holds rows
    r * out / size .. (r + 1) * out / size). Return this rank's slice of the output, [tokens, out / size],
    with no communication; with gather=True, every rank's slice side by side in rank order, [tokens,
    out_features], on every rank (`dist.all_gather`).
    """
    raise NotImplementedError("Exercise 7.5: a column-parallel linear's forward on this rank - see book/07b_real_ranks.ipynb")


def row_parallel_forward(x_shard: torch.Tensor, weight_shard: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """Exercise 7.6: a row-parallel linear's forward on this rank.

    x_shard [tokens, in_features / size] is this rank's slice of the input (what the column-parallel layer
    before it produced), weight_shard [out_features, in_features / size] the matching input columns of the
    weight, bias [out_features] (or None) the whole bias, the same on every rank. Return the whole output
    x @ weight.T + bias [tokens, out_features] on every rank: the sum over ranks of the partial products
    (`dist.all_reduce`), with the bias counted once.
    """
    raise NotImplementedError("Exercise 7.6: a row-parallel linear's forward on this rank - see book/07b_real_ranks.ipynb")


def vocab_parallel_embedding_forward(ids: torch.Tensor, weight_shard: torch.Tensor) -> torch.Tensor:
    """Exercise 7.7: a vocab-parallel embedding's forward on this rank.

    ids [tokens] are token ids of the whole vocabulary (every rank has them); weight_shard [vocab / size, dim]
    holds this rank's vocabulary rows, rank * vocab / size .. (rank + 1) * vocab / size. Return the whole
    lookup [tokens, dim] on every rank: each rank looks up the ids it holds (at their row in its shard), zeros
    the rows of the ids it does not, and the ranks' parts are summed (`dist.all_reduce`).
    """
    raise NotImplementedError("Exercise 7.7: a vocab-parallel embedding's forward on this rank - see book/07b_real_ranks.ipynb")
