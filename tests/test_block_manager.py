"""BlockManager: allocation, ref counts, chained prefix hashing, LRU reuse of freed blocks
(chapters 03, 04)."""

import pytest

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams

BS = 4


def make_seq(tokens, bs=BS):
    return Sequence(list(tokens), SamplingParams(max_tokens=4), bs)


def run_prefill(bm, seq):
    """Admit seq like the scheduler does, compute its whole prompt in one go, cache its full blocks."""
    hits = bm.match_prefix(seq)
    seq.num_cached_tokens = hits
    seq.num_computed_tokens = min(hits, seq.num_tokens - 1)
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return hits


def test_allocate_and_free_counts():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10))
    assert bm.can_allocate(seq, 10)
    new = bm.allocate(seq, 10)
    assert new == [0, 1, 2] and seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    seq.num_computed_tokens = 10
    assert bm.allocate(seq, 2) == []  # still fits block 2
    assert bm.allocate(seq, 3) == [3]
    bm.check_invariants([seq])
    assert bm.free(seq) == [3, 2, 1, 0]  # tail first
    assert seq.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([seq])


def test_allocate_without_room_raises_clear_error():
    bm = BlockManager(2, BS)
    seq = make_seq(range(12))
    assert not bm.can_allocate(seq, 12)
    with pytest.raises(RuntimeError, match="needs 3 more KV blocks but only 2 are free"):
        bm.allocate(seq, 12)


def test_hash_chaining():
    h_a = BlockManager.compute_hash([1, 2, 3, 4], None)
    assert h_a == BlockManager.compute_hash([1, 2, 3, 4], None)  # deterministic
    # same tokens, different prefix -> different hash
    assert BlockManager.compute_hash([5, 6, 7, 8], h_a) != BlockManager.compute_hash([5, 6, 7, 8], None)
    assert BlockManager.compute_hash([5, 6, 7, 8], h_a) != BlockManager.compute_hash(
        [5, 6, 7, 8], BlockManager.compute_hash([1, 2, 3, 5], None))

    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8])
    run_prefill(bm, a)
    assert bm.blocks[a.block_table[1]].hash == BlockManager.compute_hash([5, 6, 7, 8], h_a)
    # the second block's tokens appear after a different first block: no hit at all
    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 1])
    assert run_prefill(bm, b) == 0
    # same first block: exactly one block hits
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 0, 1])
    assert run_prefill(bm, c) == BS
    assert c.block_table[0] == a.block_table[0] and bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_invariants([a, b, c])


def test_collision_guard(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda tokens, prefix: 42))
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    assert bm.hash_to_block_id == {42: a.block_table[0]}
    b = make_seq([7, 7, 7, 7, 5])  # same (constant) hash, different tokens
    assert bm.match_prefix(b) == 0
    assert b.block_table == [] and bm.blocks[a.block_table[0]].ref_count == 1
    bm.check_invariants([a, b])


def test_partial_blocks_are_not_cached_and_not_matched():
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 5, 6])
    run_prefill(bm, a)
    assert bm.blocks[a.block_table[1]].hash is None and len(bm.hash_to_block_id) == 1
    b = make_seq([1, 2, 3, 4, 5, 6])
    assert run_prefill(bm, b) == BS


def test_computed_but_not_full_or_full_but_not_computed():
    bm = BlockManager(8, BS)
    a = make_seq(range(8))
    bm.allocate(a, 8)
    a.num_computed_tokens = 6  # chunked prefill: block 1 is allocated and "full" of tokens, not computed
    bm.cache_full_blocks(a)
    assert bm.blocks[a.block_table[0]].hash is not None
    assert bm.blocks[a.block_table[1]].hash is None
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert bm.blocks[a.block_table[1]].hash == BlockManager.compute_hash(
        [4, 5, 6, 7], bm.blocks[a.block_table[0]].hash)


def test_generated_tokens_are_cached_too():
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3])
    run_prefill(bm, a)
    a.token_ids.append(4)
    bm.allocate(a, 1)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    assert bm.blocks[a.block_table[0]].token_ids == [1, 2, 3, 4]
    b = make_seq([1, 2, 3, 4, 9])
    assert run_prefill(bm, b) == BS


def test_fully_cached_prompt_recomputes_last_token():
    bm = BlockManager(8, BS)
    a = make_seq(range(8))
    run_prefill(bm, a)
    b = make_seq(range(8))
    hits = bm.match_prefix(b)
    assert hits == 8 and b.block_table == a.block_table
    b.num_computed_tokens = min(hits, b.num_tokens - 1)
    assert b.num_computed_tokens == 7
    assert bm.can_allocate(b, 1) and bm.allocate(b, 1) == []  # the last token goes into the shared block
    bm.check_invariants([a, b])


def test_revive_cached_free_block_on_hit():
    bm = BlockManager(4, BS)
    a = make_seq(range(9))
    run_prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert bm.get_cached_free_block_ids() == [table[1], table[0]]  # tail freed first; partial block uncached
    b = make_seq(list(range(8)) + [42, 43])
    assert bm.match_prefix(b) == 8
    assert b.block_table == table[:2]
    assert all(bm.blocks[i].ref_count == 1 for i in table[:2])
    assert table[0] not in bm.free_block_ids and table[1] not in bm.free_block_ids
    bm.check_invariants([b])
    # rolling the hit back puts them back on the free list, still cached
    assert sorted(bm.free(b)) == sorted(table[:2])
    assert sorted(bm.get_cached_free_block_ids()) == sorted(table[:2])
    bm.check_invariants([b])


def test_lru_reuse_order():
    bm = BlockManager(4, BS)
    popular = make_seq([1, 1, 1, 1, 0])
    once = make_seq([2, 2, 2, 2, 0])
    run_prefill(bm, popular)
    run_prefill(bm, once)
    p_table, o_table = list(popular.block_table), list(once.block_table)
    p_block, o_block = p_table[0], o_table[0]
    bm.free(once)  # freed earlier ...
    bm.free(popular)  # ... the popular prefix is freed later
    assert list(bm.free_block_ids) == o_table[::-1] + p_table[::-1]
    # a new unrelated request needing 3 blocks evicts the earlier-freed ones first
    other = make_seq([3] * 12)
    bm.allocate(other, 12)
    assert p_block not in other.block_table and o_block in other.block_table
    assert o_block not in bm.hash_to_block_id.values()  # evicted
    again = make_seq([1, 1, 1, 1, 5])
    assert bm.match_prefix(again) == BS and again.block_table == [p_block]
    gone = make_seq([2, 2, 2, 2, 5])
    assert bm.match_prefix(gone) == 0
    bm.check_invariants([other, again, gone])


def test_duplicate_content_keeps_first_mapping():
    bm = BlockManager(8, BS)
    a, b = make_seq(range(5)), make_seq(range(5))
    for s in (a, b):  # both admitted in the same step: neither can hit the other
        bm.allocate(s, 5)
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.cache_full_blocks(s)
    h = bm.blocks[a.block_table[0]].hash
    assert h == bm.blocks[b.block_table[0]].hash and bm.hash_to_block_id[h] == a.block_table[0]
    bm.free(b)
    bm.allocate(make_seq(range(100, 120)), 20)  # evicts b's copy: must not drop a's mapping
    assert bm.hash_to_block_id[h] == a.block_table[0]


def test_prefix_caching_off():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(range(8))
    assert run_prefill(bm, a) == 0
    assert bm.hash_to_block_id == {} and all(b.hash is None for b in bm.blocks)
    b = make_seq(range(8))
    assert run_prefill(bm, b) == 0 and set(a.block_table).isdisjoint(b.block_table)


def test_check_invariants_catches_leaks():
    bm = BlockManager(4, BS)
    a = make_seq(range(4))
    bm.allocate(a, 4)
    with pytest.raises(AssertionError, match="ref_count=1 but 0 block table"):
        bm.check_invariants([])
