"""Exercises of book/04_prefix_hashing.ipynb, checked against nanoengine's BlockManager (its chained
xxhash, prefix matching, ref counts and LRU free list) on seeded random workloads."""

from __future__ import annotations

import copy
import random

import pytest
from ex_helpers import assert_equal, assert_same_list, book

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams

CHAPTER = "ch04_prefix_hashing"
pytestmark = pytest.mark.xdist_group("ex_ch04")
NB = "04_prefix_hashing.ipynb"


def make_seq(tokens, bs):
    return Sequence(list(tokens), SamplingParams(), bs)


def engine_prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit and compute a whole prompt the way the scheduler and model runner do; return hit tokens."""
    hits = bm.match_prefix(seq)
    seq.num_cached_tokens = hits
    seq.num_computed_tokens = min(hits, seq.num_tokens - 1)  # the last token is always recomputed
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return hits


def engine_hashes(tokens, bs):
    hashes, prefix = [], None
    for i in range(len(tokens) // bs):
        prefix = BlockManager.compute_hash(tokens[i * bs:(i + 1) * bs], prefix)
        hashes.append(prefix)
    return hashes


class Workload:
    """Prompts that share a few system prompts, as token ids."""

    def __init__(self, seed: int, bs: int):
        self.rng = random.Random(seed)
        self.bs = bs
        self.systems = [[self.rng.randrange(1000) for _ in range(self.rng.randint(bs, 5 * bs))] for _ in range(3)]

    def prompt(self) -> list[int]:
        r = self.rng
        head = list(r.choice(self.systems)) if r.random() < 0.8 else []
        if head and r.random() < 0.3:  # diverge inside the system prompt
            head = head[: r.randint(1, len(head))]
        return head + [r.randrange(1000) for _ in range(r.randint(1, 2 * self.bs))]


def test_4_1_prefix_block_hashes_match_block_manager(ex):
    where = book(NB, "4.1")
    rng = random.Random(41)
    for bs in (1, 4, 16):
        for _ in range(30):
            tokens = [rng.randrange(151_000) for _ in range(rng.randint(0, 70))]
            assert_same_list(ex.prefix_block_hashes(tokens, bs), engine_hashes(tokens, bs),
                             f"block hashes of {len(tokens)} tokens with block_size={bs}", where)
    # chained: changing a token of block 1 changes the hashes of blocks 1, 2, ... but not of block 0
    tokens = list(range(48))
    a = ex.prefix_block_hashes(tokens, 16)
    tokens[20] += 1
    b = ex.prefix_block_hashes(tokens, 16)
    assert_equal([x == y for x, y in zip(a, b)], [True, False, False],
                 "which block hashes stay the same after changing token 20 (block 1)", where)


def test_4_2_count_cached_tokens_matches_match_prefix(ex):
    where = book(NB, "4.2")
    for bs in (4, 16):
        wl = Workload(42 + bs, bs)
        bm = BlockManager(400, bs)
        seqs = []
        for _ in range(12):  # fill the cache; free some, so cached blocks sit in the free list too
            seq = make_seq(wl.prompt(), bs)
            engine_prefill(bm, seq)
            seqs.append(seq)
        for seq in seqs[::3]:
            bm.free(seq)
        for n in range(40):
            prompt = wl.prompt()
            oracle = copy.deepcopy(bm)
            if n % 10 == 9:  # a forged collision: a cached block whose tokens differ from the prompt's
                hashes = engine_hashes(prompt, bs)
                if hashes and hashes[0] in oracle.hash_to_block_id:
                    oracle.blocks[oracle.hash_to_block_id[hashes[0]]].token_ids = [-1] * bs
            cached = {h: list(oracle.blocks[b].token_ids) for h, b in oracle.hash_to_block_id.items()}
            want = oracle.match_prefix(make_seq(prompt, bs))
            got = ex.count_cached_tokens(prompt, cached, bs)
            assert_equal(got, want, f"cached tokens of a {len(prompt)}-token prompt (block_size={bs}, "
                         f"{len(cached)} cached blocks)", where)


def state_of(bm: BlockManager) -> dict:
    return {"ref_count": [b.ref_count for b in bm.blocks], "block_hash": [b.hash for b in bm.blocks],
            "free_blocks": list(bm.free_block_ids), "hash_to_block": dict(bm.hash_to_block_id)}


def compare_state(alloc, bm: BlockManager, after: str, where: str) -> None:
    want = state_of(bm)
    for name, value in want.items():
        got = getattr(alloc, name)
        got = dict(got) if name == "hash_to_block" else list(got)
        if name == "hash_to_block":
            if got != value:
                extra = sorted(set(got.items()) - set(value.items()))[:3]
                missing = sorted(set(value.items()) - set(got.items()))[:3]
                raise AssertionError(f"hash_to_block after {after}: entries you have but the engine has not "
                                     f"{extra}; entries you lack {missing} {where}")
        else:
            assert_same_list(got, value, f"{name} after {after}", where)


def run_workload(ex, seed, bs, num_blocks, steps, free_prob, where):
    wl = Workload(seed, bs)
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, bs)
    alloc = ex.PrefixCachingAllocator(num_blocks, bs)
    live = []  # (engine seq, your table)
    hits_seen = revived_seen = 0
    for step in range(steps):
        if live and rng.random() < free_prob:
            seq, table = live.pop(rng.randrange(len(live)))
            want = bm.free(seq)
            got = alloc.free(table)
            assert_same_list(got, want, f"blocks freed by free({table}) at step {step}", where)
            compare_state(alloc, bm, f"step {step}, free({table})", where)
            continue
        prompt = wl.prompt()
        try:  # skip prompts the pool cannot hold (the engine would make them wait)
            engine_prefill(copy.deepcopy(bm), make_seq(prompt, bs))
        except RuntimeError:
            continue
        seq = make_seq(prompt, bs)
        cached_free = set(bm.get_cached_free_block_ids())
        want_hits = engine_prefill(bm, seq)
        got = alloc.allocate(prompt)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"allocate must return (block_table, hit_tokens), got {got!r} {where}")
        table, hits = got
        what = f"allocate(prompt of {len(prompt)} tokens) at step {step}"
        assert_equal(hits, want_hits, f"hit tokens of {what}", where)
        assert_same_list(table, seq.block_table, f"block table of {what}", where)
        compare_state(alloc, bm, what, where)
        live.append((seq, list(table)))
        hits_seen += want_hits > 0
        revived_seen += bool(cached_free & set(seq.block_table[: want_hits // bs]))
    return hits_seen, revived_seen


def test_4_3_allocate_with_hits_and_ref_counts(ex):
    where = book(NB, "4.3")
    # allocations only: hits on blocks other sequences hold (ref counts > 1), until the pool fills up
    hits, _ = run_workload(ex, seed=43, bs=4, num_blocks=150, steps=40, free_prob=0.0, where=where)
    assert hits >= 5, "the workload should produce prefix hits"
    # not enough free blocks: MemoryError, nothing changed
    alloc = ex.PrefixCachingAllocator(3, 4)
    alloc.allocate([1, 2, 3, 4, 5])
    before = (list(alloc.ref_count), list(alloc.free_blocks), dict(alloc.hash_to_block))
    with pytest.raises(MemoryError):
        alloc.allocate([1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9])  # 1 hit block + 3 new, only 1 free
    assert_equal((list(alloc.ref_count), list(alloc.free_blocks), dict(alloc.hash_to_block)), before,
                 "state after a MemoryError (must be unchanged)", where)


def copy_state_into(alloc, bm: BlockManager) -> None:
    """Give your allocator exactly the engine's state (so Exercise 4.4 is checked without your allocate)."""
    from collections import OrderedDict

    alloc.ref_count = [b.ref_count for b in bm.blocks]
    alloc.block_hash = [b.hash for b in bm.blocks]
    alloc.block_tokens = [list(b.token_ids) for b in bm.blocks]
    alloc.hash_to_block = dict(bm.hash_to_block_id)
    alloc.free_blocks = OrderedDict.fromkeys(bm.free_block_ids)


def test_4_4_free_keeps_hashes_and_lru_order(ex):
    where = book(NB, "4.4")
    # 1. free alone, from a state the engine built: shared blocks (ref count 2), partial tail blocks
    bs = 4
    bm = BlockManager(40, bs)
    system = list(range(100, 110))
    seqs = [make_seq(system + [i] * (2 + i), bs) for i in range(5)]
    for seq in seqs:
        engine_prefill(bm, seq)
    alloc = ex.PrefixCachingAllocator(40, bs)
    copy_state_into(alloc, bm)
    for seq in [seqs[i] for i in (2, 0, 4, 1, 3)]:
        table = list(seq.block_table)
        want = bm.free(seq)
        got = alloc.free(table)
        assert_same_list(got, want, f"blocks freed by free({table})", where)
        compare_state(alloc, bm, f"free({table})", where)
    # 2. frees mixed with allocations (needs your allocate from Exercise 4.3): freed blocks are revived
    for seed, bs, blocks in [(44, 4, 60), (45, 16, 24)]:
        hits, revived = run_workload(ex, seed=seed, bs=bs, num_blocks=blocks, steps=250, free_prob=0.45,
                                     where=where)
        assert hits >= 10 and revived >= 3, f"the workload should revive freed cached blocks ({hits}, {revived})"
