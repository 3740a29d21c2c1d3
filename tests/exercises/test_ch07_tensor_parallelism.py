"""Exercises of book/07_tensor_parallelism.ipynb, checked against the shards nanoengine's own tensor-parallel
layers load (MergedLinear, RowParallelLinear, Embedding with a TPGroup), rank by rank, in one process: a
stand-in group whose collectives return this rank's part is enough to read what each rank holds."""

from __future__ import annotations

import pytest
import torch
from ex_helpers import assert_close, book

from nanoengine.layers.tp_group import TPGroup
from nanoengine.layers.embedding import Embedding
from nanoengine.layers.linear import MergedLinear, RowParallelLinear

CHAPTER = "ch07_tensor_parallelism"
pytestmark = pytest.mark.xdist_group("ex_ch07")
NB = "07_tensor_parallelism.ipynb"


class OneRank(TPGroup):
    """Rank `rank` of `size`, without the other processes: collectives return this rank's own part."""

    def all_reduce(self, x):
        return x

    def gather(self, x):
        return x


def test_7_1_shard_merged_rows_matches_the_gate_up_shards(ex):
    where = book(NB, "7.1")
    torch.manual_seed(71)
    hidden, inter = 8, 12
    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    fused = torch.cat([gate, up])  # [2 * inter, hidden]
    for size in (1, 2, 3, 4):
        for rank in range(size):
            layer = MergedLinear(hidden, {"gate": inter, "up": inter}, tp=OneRank(rank, size))
            layer.weight.weight_loader(layer.weight, gate, "gate")
            layer.weight.weight_loader(layer.weight, up, "up")
            got = ex.shard_merged_rows(fused, [inter, inter], rank, size)
            if isinstance(got, torch.Tensor) and got.shape == layer.weight.shape and size > 1:
                contiguous = fused[rank * got.shape[0]:(rank + 1) * got.shape[0]]
                if torch.equal(got, contiguous):
                    raise AssertionError(f"rank {rank} of {size}: this looks like a contiguous slice of the fused "
                                         "weight, so rank 0 would get only gate rows and the last rank only up "
                                         f"rows; take rank's share of EACH part {where}")
            assert_close(got, layer.weight.detach(), f"rank {rank} of {size}: its gate/up rows", where, atol=0, rtol=0)


def qkv_case(seed, heads, kv_heads, head_dim=4, hidden=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(heads * head_dim, hidden, generator=g), torch.randn(kv_heads * head_dim, hidden, generator=g),
            torch.randn(kv_heads * head_dim, hidden, generator=g))


def test_7_2_shard_qkv_by_heads_matches_the_engine(ex):
    where = book(NB, "7.2")
    head_dim = 4
    for heads, kv_heads, size in [(4, 2, 2), (8, 2, 2), (16, 8, 4), (9, 3, 3), (4, 4, 2), (6, 2, 1)]:
        q, k, v = qkv_case(heads * 10 + size, heads, kv_heads, head_dim)
        parts = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
        for rank in range(size):
            layer = MergedLinear(q.shape[1], parts, tp=OneRank(rank, size))
            for name, w in zip("qkv", (q, k, v)):
                layer.weight.weight_loader(layer.weight, w, name)
            got = ex.shard_qkv(q, k, v, heads, kv_heads, head_dim, rank, size)
            what = f"{heads} query / {kv_heads} KV heads, rank {rank} of {size}"
            if isinstance(got, torch.Tensor) and got.shape == layer.weight.shape and size > 1:
                q_rows = heads // size * head_dim
                ours_q = got[:q_rows]
                if not torch.equal(ours_q, layer.weight.detach()[:q_rows]) and torch.equal(
                        ours_q, q.view(heads, head_dim, -1)[rank::size].flatten(0, 1)):
                    raise AssertionError(f"{what}: this looks like query heads dealt round-robin (rank, rank + "
                                         f"size, ...); each rank keeps a contiguous run of heads, so that its "
                                         f"queries read only its own KV heads {where}")
            assert_close(got, layer.weight.detach(), f"{what}: its q/k/v rows", where, atol=0, rtol=0)
    q, k, v = qkv_case(0, 9, 3)
    try:
        ex.shard_qkv(q, k, v, 9, 3, head_dim, 0, 2)
    except ValueError as e:
        assert "9" in str(e) and "3" in str(e), f"the ValueError should name the head counts, got {e!r} {where}"
    else:
        raise AssertionError(f"shard_qkv with 9 query / 3 KV heads over 2 ranks should raise ValueError {where}")


def test_7_3_row_parallel_partials_sum_to_the_full_matmul(ex):
    where = book(NB, "7.3")
    torch.manual_seed(73)
    x, w, b = torch.randn(5, 12), torch.randn(7, 12), torch.randn(7)
    for size in (1, 2, 3, 4):
        for bias in (None, b):
            got = ex.row_parallel_linear(x, w, bias, size)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise AssertionError(f"return (partials, out), got {type(got).__name__} {where}")
            partials, out = got
            if len(partials) != size:
                raise AssertionError(f"{size} ranks: {len(partials)} partial products {where}")
            full = torch.nn.functional.linear(x, w, bias)
            if bias is not None and size > 1 and torch.allclose(out, full + (size - 1) * bias, atol=1e-5):
                raise AssertionError(f"{size} ranks: this looks like the bias added on every rank, so the sum "
                                     f"holds it {size} times; add it on rank 0 only {where}")
            for r in range(size):  # the engine's rank r: its input columns, its weight columns, its bias share
                layer = RowParallelLinear(12, 7, bias=bias is not None, tp=OneRank(r, size))
                layer.weight.weight_loader(layer.weight, w)
                if bias is not None:
                    layer.bias.weight_loader(layer.bias, bias)
                share = 12 // size
                with torch.no_grad():
                    want = layer(x[:, r * share:(r + 1) * share])
                assert_close(partials[r], want, f"{size} ranks, bias={bias is not None}: rank {r}'s partial product",
                             where)
            assert_close(out, full, f"{size} ranks, bias={bias is not None}: the sum of the partials", where)


def test_7_4_vocab_parallel_embedding_matches_the_engine(ex):
    where = book(NB, "7.4")
    torch.manual_seed(74)
    vocab, dim = 24, 5
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 1, 5, 6, 11, 12, 17, 18, 23, 7, 7])
    for size in (1, 2, 3, 4):
        total = torch.zeros(len(ids), dim)
        for rank in range(size):
            layer = Embedding(vocab, dim, OneRank(rank, size))
            layer.weight.weight_loader(layer.weight, table)
            shard = layer.weight.detach()
            got = ex.vocab_parallel_embedding(ids, shard, rank, size)
            with torch.no_grad():
                want = layer(ids)
            if isinstance(got, torch.Tensor) and got.shape == want.shape and size > 1 and torch.equal(
                    got, shard[ids.clamp(0, shard.shape[0] - 1)]) and not torch.equal(got, want):
                raise AssertionError(f"rank {rank} of {size}: this looks like looking the global ids up in the "
                                     f"shard directly; subtract the shard's first id, and zero the ids it does "
                                     f"not hold {where}")
            assert_close(got, want, f"rank {rank} of {size}: its part of the lookup", where)
            total += got
        assert_close(total, table[ids], f"{size} ranks: the sum of the ranks' parts", where)
