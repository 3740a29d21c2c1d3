"""Exercises of chapter 07 (book/07a_sharding.ipynb, 07b_real_ranks.ipynb). 7.1-7.4 are checked against the
shards nanoengine's own tensor-parallel layers load (MergedLinear, RowParallelLinear, Embedding with a
TPGroup), rank by rank, in one process: a stand-in group whose collectives return this rank's part is enough
to read what each rank holds. 7.5-7.7 run on two real gloo processes (one spawn for the module, ch07_ranks.py)
and are compared with the whole, unsharded layer in float64; planted classic mistakes check that each failure
message names its mistake."""

from __future__ import annotations

from pathlib import Path

import ch07_ranks
import pytest
import torch
from ex_helpers import assert_close, assert_detects, book, explained, looks_like

from nanoengine.layers.embedding import Embedding
from nanoengine.layers.linear import MergedLinear, RowParallelLinear
from nanoengine.layers.tp_group import TPGroup

CHAPTER = "ch07_tensor_parallelism"
pytestmark = pytest.mark.xdist_group("ex_ch07")
NB = "07a_sharding.ipynb"  # (a message names the part that sets its exercise: ex_helpers.book)


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


# ------------------------------------------------------------------------------ 7.5-7.7 on two real ranks
# One spawn for the module: two gloo processes run the learner's 7.5-7.7 and the planted wrong answers
# (ch07_ranks.py); each test compares what came back with the whole layer, computed here in float64.
SIZE = 2


@pytest.fixture(scope="module")
def ranks(ex, tmp_path_factory):
    from nanoengine.distributed.spawn import RankFailure, run_on_ranks
    from nanoengine.errors import WorkerError

    progress = str(tmp_path_factory.mktemp("ch07_ranks") / "rank")
    try:
        results = run_on_ranks(ch07_ranks.run_all, SIZE, ch07_ranks.impl_file(ex), progress, timeout=15)
    except WorkerError as e:
        where = "; ".join(f"rank {r} was running {p.read_text()}" for r in range(SIZE)
                          if (p := Path(f"{progress}{r}")).is_file())
        raise AssertionError(f"{e}: {where}. A rank that waits in a collective its peer never reaches waits "
                             "forever: every rank must call the same collectives, in the same order, with tensors "
                             f"of the same shape {book(NB, '7.5-7.7')}") from None
    failed = [r for r in results if isinstance(r, RankFailure)]
    if failed:
        raise AssertionError("the two ranks could not run the chapter 07 checks:\n"
                             + "\n".join(f"rank {f.rank}: {f.type_name}: {f.message}\n{f.traceback}" for f in failed))
    return results


def outputs(ranks, fn: str, candidate: str, where: str) -> list[dict]:
    """Each rank's {case: output} of one candidate; an exception on any rank is raised here, named (the
    stub's NotImplementedError as itself)."""
    per_rank = []
    for rank, results in enumerate(ranks):
        got = results[fn][candidate]
        for case, r in got.items():
            if "error" not in r:
                continue
            if r["error"] == "NotImplementedError":
                raise NotImplementedError(r["message"])
            hint = ""
            if fn == "vocab_parallel_embedding_forward" and r["error"] == "IndexError":
                hint = (" An id this rank does not hold was used as a row of its shard: mask the ids outside "
                        "the rank's range before the lookup (and zero their rows after it).")
            elif "timed out" in r["message"].lower() or "timeout" in r["message"].lower():
                hint = (" A rank waited in a collective its peer never reached: every rank must call the same "
                        "collectives, in the same order, with tensors of the same shape.")
            raise AssertionError(f"{fn} ({case}) raised {r['error']} on rank {rank}: {r['message']}.{hint} "
                                 f"{where}\n{r['traceback']}")
        per_rank.append({case: r["out"] for case, r in got.items()})
    return per_rank


def check_column(ranks, candidate: str) -> None:
    where = book(NB, "7.5")
    t = ch07_ranks.inputs()
    whole = torch.nn.functional.linear(t["x"], t["col_w"], t["col_b"])  # [tokens, out]: the whole layer
    whole_nb = torch.nn.functional.linear(t["x"], t["col_w"])
    per_rank = outputs(ranks, "column_parallel_forward", candidate, where)
    for rank, got in enumerate(per_rank):
        cols = ch07_ranks.shard(ch07_ranks.COL_OUT, rank, SIZE)
        summed = sum(whole[:, ch07_ranks.shard(ch07_ranks.COL_OUT, r, SIZE)] for r in range(SIZE))
        with explained(got["bias"], {"the ranks' slices summed by an all-reduce: a column-parallel layer's "
                                     "slices are different outputs, and it needs no communication": lambda: summed}):
            assert_close(got["bias"], whole[:, cols], f"rank {rank}: its output slice (columns {cols.start}.."
                         f"{cols.stop - 1} of the whole layer's output)", where, atol=1e-12, rtol=1e-12)
        assert_close(got["no bias"], whole_nb[:, cols], f"rank {rank}, bias None: its output slice", where,
                     atol=1e-12, rtol=1e-12)
        stacked = torch.cat([whole[:, ch07_ranks.shard(ch07_ranks.COL_OUT, r, SIZE)] for r in range(SIZE)])
        with explained(got["gathered"], {"the slices stacked along the tokens (dim 0); they are columns of one "
                                         "output: put them side by side, along the last dim": lambda: stacked}):
            assert_close(got["gathered"], whole, f"rank {rank}, gather=True: the whole output, every rank's "
                         "slice in rank order", where, atol=1e-12, rtol=1e-12)


def test_7_5_column_parallel_forward_on_two_ranks_equals_the_whole_layer(ex, ranks):
    check_column(ranks, "yours")
    assert_detects(lambda fn: check_column(ranks, fn.__name__), ch07_ranks.col_all_reduces_its_slice,
                   "needs no communication")
    assert_detects(lambda fn: check_column(ranks, fn.__name__), ch07_ranks.col_gathers_along_tokens,
                   "along the last dim")


def check_row(ranks, candidate: str) -> None:
    where = book(NB, "7.6")
    t = ch07_ranks.inputs()
    per_rank = outputs(ranks, "row_parallel_forward", candidate, where)
    for case, bias in (("bias", t["row_b"]), ("no bias", None)):
        whole = torch.nn.functional.linear(t["x"], t["row_w"], bias)  # [tokens, out]: the whole layer
        for rank, got in enumerate(per_rank):
            cols = ch07_ranks.shard(ch07_ranks.IN, rank, SIZE)
            partial = t["x"][:, cols] @ t["row_w"][:, cols].T  # [tokens, out]: this rank's partial sum
            variants = {f"the bias added on every rank before the all-reduce, so the sum counts it {SIZE} "
                        "times: add it once, after the all-reduce": lambda: whole + (SIZE - 1) * t["row_b"],
                        "this rank's partial sum alone: the partial products were never all-reduced "
                        "(dist.all_reduce sums them across the ranks)": lambda: partial,
                        "this rank's partial sum plus the bias: the partial products were never all-reduced "
                        "(dist.all_reduce sums them across the ranks)": lambda: partial + t["row_b"]}
            if bias is None:
                variants.pop(next(iter(variants)))
            with explained(got[case], variants):
                assert_close(got[case], whole, f"rank {rank}, {case}: the whole layer's output", where,
                             atol=1e-12, rtol=1e-12)


def test_7_6_row_parallel_forward_all_reduces_and_adds_the_bias_once(ex, ranks):
    check_row(ranks, "yours")
    assert_detects(lambda fn: check_row(ranks, fn.__name__), ch07_ranks.row_bias_on_every_rank,
                   "bias added on every rank")
    assert_detects(lambda fn: check_row(ranks, fn.__name__), ch07_ranks.row_no_all_reduce,
                   "never all-reduced")


def check_embedding(ranks, candidate: str) -> None:
    where = book(NB, "7.7")
    t = ch07_ranks.inputs()
    table, ids, rows = t["table"], t["ids"], ch07_ranks.VOCAB // SIZE
    whole = table[ids]  # [tokens, dim]: the whole embedding
    owner = ids // rows  # [tokens]: the rank holding each id
    per_rank = outputs(ranks, "vocab_parallel_embedding_forward", candidate, where)
    for rank, got in enumerate(per_rank):
        out = got["ids"]
        here = owner == rank
        part = torch.where(here[:, None], whole, torch.zeros_like(whole))  # this rank's part alone
        clamped = sum(table[ch07_ranks.shard(ch07_ranks.VOCAB, r, SIZE)][(ids - r * rows).clamp(0, rows - 1)]
                      for r in range(SIZE))
        variants = {"this rank's part alone: the ranks' parts were never all-reduced (dist.all_reduce "
                    "sums them)": lambda: part,
                    "every rank's lookup of every id, clamped to its shard: zero the rows of the ids a rank "
                    "does not hold before the all-reduce": lambda: clamped}
        if (isinstance(out, torch.Tensor) and out.shape == whole.shape and not looks_like(out, variants)
                and not torch.allclose(out, whole, atol=1e-12, rtol=1e-12)):
            right = torch.isclose(out, whole, atol=1e-12, rtol=1e-12).all(-1)  # [tokens]
            for r in range(SIZE):
                mine, others = owner == r, owner != r
                if not right[mine].all() and right[others].all():
                    first = r * rows
                    raise AssertionError(
                        f"rank {rank}: ids of rank {r}'s shard ({first}..{first + rows - 1}) come out wrong and "
                        f"the other ranks' ids right; look at the offset: id i is row i - {first} "
                        f"(i - rank * rows) of rank {r}'s shard {where}")
        with explained(out, variants):
            assert_close(out, whole, f"rank {rank}: the whole lookup of ids {ids.tolist()}", where,
                         atol=1e-12, rtol=1e-12)


def test_7_7_vocab_parallel_embedding_forward_on_two_ranks_equals_the_whole_table(ex, ranks):
    check_embedding(ranks, "yours")
    for wrong, phrase in ((ch07_ranks.emb_no_offset, "look at the offset"),
                          (ch07_ranks.emb_not_zeroed, "zero the rows"),
                          (ch07_ranks.emb_not_masked, "mask the ids"),
                          (ch07_ranks.emb_no_all_reduce, "never all-reduced")):
        assert_detects(lambda fn: check_embedding(ranks, fn.__name__), wrong, phrase)
