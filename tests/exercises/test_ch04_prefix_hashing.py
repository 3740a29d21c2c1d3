"""Exercises of chapter 04 (book/04a_block_hashes.ipynb .. 04b_ref_counts.ipynb), checked against nanoengine's
BlockManager (its chained xxhash, prefix matching, ref counts and LRU free list) on seeded random workloads. A
wrong answer is also compared with the classic mistakes (the LRU ends swapped, a MemoryError check that
forgets the cached free blocks a hit revives), so the message can say which one it looks like; each test also
checks that it names them. (Admission, with its same-step sharing and last-token recompute, is chapter 05's
5.0.)

4.3 and 4.4 compare behaviour, not block ids: which prefixes the cache holds, how many tables share each, how
many blocks are free, and the order in which the free list would evict cached prefixes (a free block that
holds no cached prefix is any such block: which one is taken is the allocator's business). Each table is
checked against the allocator's own state (hit blocks are the cache's blocks for the prompt's hashes, ref
counts count the live tables). The eviction order is behaviour: the engine evicts the least recently freed
block first, and the prefix hits of later requests (the capstone compares them step by step) depend on it."""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from ex_helpers import assert_detects, assert_equal, assert_same_list, book, engine_prefill, make_seq, with_hint

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams

CHAPTER = "ch04_prefix_hashing"
pytestmark = pytest.mark.xdist_group("ex_ch04")
NB = "04a_block_hashes.ipynb"  # (a message names the part that sets its exercise: ex_helpers.book)


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


def behaviour(ref_count, block_hash, hash_to_block, free_blocks) -> dict:
    """What a block pool does, without its block ids: the cached prefixes (hashes), how many tables hold
    each, the number of free blocks, and the order in which allocation would evict cached prefixes (each free
    block as the prefix it still serves, or None when it serves none)."""
    serves = [block_hash[b] if block_hash[b] is not None and hash_to_block.get(block_hash[b]) == b else None
              for b in free_blocks]
    return {"cached prefixes": sorted(hash_to_block),
            "tables sharing each cached prefix": {h: ref_count[b] for h, b in sorted(hash_to_block.items())},
            "free blocks": len(free_blocks),
            "eviction order (free list, front first: the cached prefix each block serves, or None)": serves}


def engine_behaviour(bm: BlockManager) -> dict:
    return behaviour([b.ref_count for b in bm.blocks], [b.hash for b in bm.blocks], bm.hash_to_block_id,
                     list(bm.free_block_ids))


def alloc_behaviour(alloc) -> dict:
    return behaviour(alloc.ref_count, alloc.block_hash, dict(alloc.hash_to_block), list(alloc.free_blocks))


def alloc_state(alloc) -> dict:
    return {"ref_count": list(alloc.ref_count), "block_hash": list(alloc.block_hash),
            "free_blocks": list(alloc.free_blocks), "hash_to_block": dict(alloc.hash_to_block)}


def compare_behaviour(alloc, bm: BlockManager, after: str, where: str) -> None:
    got, want = alloc_behaviour(alloc), engine_behaviour(bm)
    for name, value in want.items():
        if got[name] == value:
            continue
        if name == "cached prefixes":
            extra = sorted(set(got[name]) - set(value))[:3]
            missing = sorted(set(value) - set(got[name]))[:3]
            raise AssertionError(f"the prefixes your cache holds after {after}: you have {len(got[name])}, the "
                                 f"engine {len(value)}; hashes you have but the engine has not {extra}, hashes "
                                 f"you lack {missing} {where}")
        if isinstance(value, list):
            assert_same_list(got[name], value, f"{name} after {after}", where)
        else:
            bad = next(h for h in value if got[name].get(h) != value[h])
            raise AssertionError(f"{name} after {after}: the prefix with hash {bad} is held by {got[name].get(bad)} "
                                 f"of your tables, by {value[bad]} of the engine's {where}")


def check_own_state(alloc, tables: list[list[int]], after: str, where: str) -> None:
    """The allocator agrees with itself: each block's ref count is the number of live tables that hold it,
    the free list is exactly the blocks no table holds, and every cache entry names a block with that hash."""
    held = [0] * len(alloc.ref_count)
    for table in tables:
        for b in table:
            held[b] += 1
    wrong = [b for b in range(len(held)) if alloc.ref_count[b] != held[b]]
    if wrong:
        b = wrong[0]
        raise AssertionError(f"ref_count after {after}: block {b} has ref_count {alloc.ref_count[b]} but {held[b]} "
                             f"live block tables hold it {where}")
    free, unheld = set(alloc.free_blocks), {b for b in range(len(held)) if held[b] == 0}
    if free != unheld or len(free) != len(alloc.free_blocks):
        raise AssertionError(f"free_blocks after {after}: it must hold exactly the blocks no table holds; "
                             f"free but held {sorted(free - unheld)[:5]}, held by no table but not free "
                             f"{sorted(unheld - free)[:5]} {where}")
    stale = [(h, b) for h, b in alloc.hash_to_block.items() if alloc.block_hash[b] != h]
    if stale:
        raise AssertionError(f"hash_to_block after {after}: entry {stale[0][0]} -> block {stale[0][1]}, whose "
                             f"block_hash is {alloc.block_hash[stale[0][1]]} {where}")


def check_table(alloc, table: list[int], prompt: list[int], hits: int, what: str, where: str) -> None:
    """A prompt's table: one block per block_size tokens, its hit blocks the cache's blocks for the prompt's
    leading hashes, and every full block carrying its chained hash."""
    bs = alloc.block_size
    hashes = engine_hashes(prompt, bs)
    if len(table) != -(-len(prompt) // bs) or len(set(table)) != len(table):
        raise AssertionError(f"block table of {what}: {table}, expected {-(-len(prompt) // bs)} distinct blocks "
                             f"{where}")
    for i, h in enumerate(hashes):
        if i < hits // bs and alloc.hash_to_block.get(h) != table[i]:
            raise AssertionError(f"block table of {what}: block {i} is a hit, so it is the cached block of its "
                                 f"hash, {alloc.hash_to_block.get(h)}; yours is {table[i]} {where}")
        if alloc.block_hash[table[i]] != h:
            raise AssertionError(f"block_hash of block {table[i]} (full block {i} of {what}): "
                                 f"{alloc.block_hash[table[i]]}, expected its chained hash {h} {where}")


# ------------------------------------------------------------------------------ the classic mistakes
class RefAllocator:
    """The allocator of Exercises 4.3/4.4 written out with one classic mistake (`mode`), to name it."""

    def __init__(self, num_blocks: int, block_size: int, mode: str = "engine") -> None:
        self.mode, self.block_size = mode, block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list = [None] * num_blocks
        self.block_tokens: list = [[] for _ in range(num_blocks)]
        self.hash_to_block: dict = {}
        self.free_blocks = OrderedDict.fromkeys(range(num_blocks))

    def allocate(self, token_ids):
        bs = self.block_size
        hashes = engine_hashes(token_ids, bs)
        hit_blocks = []
        for i, h in enumerate(hashes):
            b = self.hash_to_block.get(h)
            if b is None or self.block_tokens[b] != token_ids[i * bs:(i + 1) * bs]:
                break
            hit_blocks.append(b)
        needed = -(-len(token_ids) // bs) - len(hit_blocks)
        revived = 0 if self.mode == "forget_revived" else sum(self.ref_count[b] == 0 for b in hit_blocks)
        if needed > len(self.free_blocks) - revived:
            raise MemoryError("pool full")
        for b in hit_blocks:
            if self.ref_count[b] == 0:
                del self.free_blocks[b]
            self.ref_count[b] += 1
        table = list(hit_blocks)
        for _ in range(needed):
            b, _ = self.free_blocks.popitem(last=self.mode == "pop_back")
            old = self.block_hash[b]
            if old is not None and self.hash_to_block.get(old) == b:
                del self.hash_to_block[old]
            self.ref_count[b], self.block_hash[b], self.block_tokens[b] = 1, None, []
            table.append(b)
        for i, h in enumerate(hashes):
            if self.block_hash[table[i]] is None:
                self.block_hash[table[i]], self.block_tokens[table[i]] = h, token_ids[i * bs:(i + 1) * bs]
                self.hash_to_block.setdefault(h, table[i])
        return table, len(hit_blocks) * bs

    def free(self, block_table):
        freed = []
        for b in (block_table if self.mode == "head_first" else reversed(block_table)):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_blocks[b] = None
                if self.mode == "free_to_front":
                    self.free_blocks.move_to_end(b, last=False)
                freed.append(b)
        return freed


ALLOC_MISTAKES = {
    "pop_back": "the LRU ends swapped in allocate: take fresh blocks from the FRONT of free_blocks "
                "(popitem(last=False)), the least recently freed, and free returns them to the back",
    "free_to_front": "the LRU ends swapped in free: a freed block goes to the BACK of free_blocks, so it is "
                     "evicted last; allocation takes from the front",
    "head_first": "freeing from the first block to the last: walk the table from its LAST block, so a "
                  "prefix's tail is evicted before its head, which more requests share",
}


def variant(mode: str):
    def make(num_blocks, block_size):
        return RefAllocator(num_blocks, block_size, mode)
    make.__name__ = mode
    return make


def summary(op: str, result):
    """What a result says without block ids: the hit tokens of an allocation, the number of freed blocks."""
    if op == "allocate":
        return result[1] if isinstance(result, tuple) and len(result) == 2 else result
    return len(result) if isinstance(result, list) else result


class Lockstep:
    """The classic-mistake allocators, run beside the learner's; those that agree with it at every step so
    far are named when it fails."""

    def __init__(self, num_blocks: int, bs: int, modes=ALLOC_MISTAKES):
        self.alive = {m: RefAllocator(num_blocks, bs, m) for m in modes}

    def step(self, op: str, arg, got, alloc) -> None:
        for m, ref in list(self.alive.items()):
            try:
                same = (summary(op, getattr(ref, op)(list(arg))) == summary(op, got)
                        and alloc_behaviour(ref) == alloc_behaviour(alloc))
            except Exception:
                same = False
            if not same:
                del self.alive[m]

    def hint(self) -> str:
        return "".join(f" This looks like {ALLOC_MISTAKES[m]}." for m in self.alive)

    @contextmanager
    def explained(self) -> Iterator[None]:
        try:
            yield
        except AssertionError as e:
            raise AssertionError(with_hint(str(e), self.hint())) from None


def run_workload(make, seed, bs, num_blocks, steps, free_prob, where):
    wl = Workload(seed, bs)
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, bs)
    alloc = make(num_blocks, bs)
    lock = Lockstep(num_blocks, bs)
    live = []  # (engine seq, your table)
    hits_seen = revived_seen = 0
    for step in range(steps):
        if live and rng.random() < free_prob:
            seq, table = live.pop(rng.randrange(len(live)))
            want = bm.free(seq)
            got = alloc.free(table)
            lock.step("free", table, got, alloc)
            what = f"step {step}, free({table})"
            with lock.explained():
                check_freed(got, table, alloc, len(want), what, where)
                compare_behaviour(alloc, bm, what, where)
                check_own_state(alloc, [t for _, t in live], what, where)
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
        lock.step("allocate", prompt, got, alloc)
        table, hits = got
        what = f"allocate(prompt of {len(prompt)} tokens) at step {step}"
        with lock.explained():
            assert_equal(hits, want_hits, f"hit tokens of {what}", where)
            check_table(alloc, list(table), prompt, hits, what, where)
            compare_behaviour(alloc, bm, what, where)
            check_own_state(alloc, [t for _, t in live] + [list(table)], what, where)
        live.append((seq, list(table)))
        hits_seen += want_hits > 0
        revived_seen += bool(cached_free & set(seq.block_table[: want_hits // bs]))
    return hits_seen, revived_seen


def check_freed(got, table: list[int], alloc, want_count: int, what: str, where: str) -> None:
    """free's result: the blocks of the table that no table holds any more (in any order), each once."""
    if not isinstance(got, list) or len(set(got)) != len(got):
        raise AssertionError(f"free must return a list of the blocks it freed, each once; got {got!r} after "
                             f"{what} {where}")
    now_free = sorted(b for b in set(table) if alloc.ref_count[b] == 0)
    assert_equal(sorted(got), now_free, f"the blocks freed by {what} (those of the table whose ref_count "
                 "reached 0)", where)
    assert_equal(len(got), want_count, f"how many blocks {what} freed", where)


def copy_state_into(alloc, bm: BlockManager) -> None:
    """Give an allocator exactly the engine's state (so one exercise is checked without the other)."""
    alloc.ref_count = [b.ref_count for b in bm.blocks]
    alloc.block_hash = [b.hash for b in bm.blocks]
    alloc.block_tokens = [list(b.token_ids) for b in bm.blocks]
    alloc.hash_to_block = dict(bm.hash_to_block_id)
    alloc.free_blocks = OrderedDict.fromkeys(bm.free_block_ids)


FORGET_REVIVED = ("a MemoryError check that forgets the cached free blocks this prompt's hits revive: they leave "
                  "free_blocks too, so only len(free_blocks) - revived blocks are left for the fresh ones")


def check_memory_error(make, where: str) -> None:
    """Not enough free blocks: MemoryError, nothing changed; once with hits on blocks in use, once with hits
    on cached free blocks (which the hit takes out of the free list)."""
    # 1. 1 hit block (in use) + 3 new, only 1 free
    alloc = make(3, 4)
    alloc.allocate([1, 2, 3, 4, 5])
    plain_raised = _raises_unchanged(alloc, [1, 2, 3, 4] + [9] * 9, where, "a 13-token prompt with 1 hit block "
                                     "in use and 3 new blocks to find, 1 free", "")
    # 2. a pool of 4 blocks, all free, 2 of them cached: a 20-token prompt hits those 2 and needs 3 more
    bm = BlockManager(4, 4)
    seq = make_seq(list(range(8)), 4)
    engine_prefill(bm, seq)
    bm.free(seq)
    alloc = make(4, 4)
    copy_state_into(alloc, bm)
    _raises_unchanged(alloc, list(range(8)) + [9] * 12, where, "a 20-token prompt whose 2 hit blocks are cached "
                      "free blocks and needs 3 more, with 4 blocks free in all",
                      f" This looks like {FORGET_REVIVED}." if plain_raised else "")


def _raises_unchanged(alloc, prompt, where, what, hint) -> bool:
    before = alloc_state(alloc)
    try:
        result = alloc.allocate(prompt)
    except MemoryError:
        assert_equal(alloc_state(alloc), before, f"state after the MemoryError of {what} (must be unchanged)", where)
        return True
    except NotImplementedError:
        raise
    except Exception as e:
        raise AssertionError(f"allocate of {what} should raise MemoryError, raised {type(e).__name__}: {e}.{hint} "
                             f"{where}") from None
    raise AssertionError(f"allocate of {what} should raise MemoryError, returned {result!r}.{hint} {where}")


def check_eviction(make, where: str) -> None:
    """Fresh prompts after three sequences were freed (tails first): with hashless blocks at the front of the
    free list and cached ones behind them, which cached prefixes do new blocks evict, and when? (A pool that
    only allocates cannot tell: all its free blocks are alike.)"""
    bs = 4
    bm = BlockManager(12, bs)
    seqs = [make_seq([100 * i + j for j in range(2 * bs + 1)], bs) for i in range(3)]  # 2 full blocks + 1 token
    for seq in seqs:
        engine_prefill(bm, seq)
    for i in (1, 0, 2):
        bm.free(seqs[i])
    alloc = make(12, bs)
    copy_state_into(alloc, bm)
    lock = Lockstep(12, bs)
    for ref in lock.alive.values():
        copy_state_into(ref, bm)
    live: list[list[int]] = []
    for k in range(6):
        prompt = [5000 + 10 * k + j for j in range(2 * bs)]  # two fresh blocks each
        engine_prefill(bm, make_seq(prompt, bs))
        got = alloc.allocate(prompt)
        lock.step("allocate", prompt, got, alloc)
        what = f"allocate(fresh prompt {k} of {len(prompt)} tokens) after three sequences were freed"
        with lock.explained():
            if not (isinstance(got, tuple) and len(got) == 2):
                raise AssertionError(f"allocate must return (block_table, hit_tokens), got {got!r} {where}")
            assert_equal(got[1], 0, f"hit tokens of {what}", where)
            check_table(alloc, list(got[0]), prompt, 0, what, where)
            compare_behaviour(alloc, bm, what, where)
            check_own_state(alloc, live + [list(got[0])], what, where)
        live.append(list(got[0]))


def test_4_3_allocate_with_hits_and_ref_counts(ex):
    where = book(NB, "4.3")
    # allocations only: hits on blocks other sequences hold (ref counts > 1), until the pool fills up
    hits, _ = run_workload(ex.PrefixCachingAllocator, seed=43, bs=4, num_blocks=150, steps=40, free_prob=0.0,
                           where=where)
    assert hits >= 5, "the workload should produce prefix hits"
    check_memory_error(ex.PrefixCachingAllocator, where)
    assert_detects(lambda make: check_memory_error(make, where), variant("forget_revived"), FORGET_REVIVED)
    check_eviction(ex.PrefixCachingAllocator, where)
    assert_detects(lambda make: check_eviction(make, where), variant("pop_back"), ALLOC_MISTAKES["pop_back"])


def check_free_alone(make, where: str) -> None:
    """free alone, from a state the engine built: shared blocks (ref count 2), partial tail blocks."""
    bs = 4
    bm = BlockManager(40, bs)
    system = list(range(100, 110))
    seqs = [make_seq(system + [i] * (2 + i), bs) for i in range(5)]
    for seq in seqs:
        engine_prefill(bm, seq)
    alloc = make(40, bs)
    copy_state_into(alloc, bm)
    lock = Lockstep(40, bs)
    for ref in lock.alive.values():
        copy_state_into(ref, bm)
    live = {i: list(seq.block_table) for i, seq in enumerate(seqs)}
    for i in (2, 0, 4, 1, 3):
        table = live.pop(i)
        want = bm.free(seqs[i])
        got = alloc.free(table)
        lock.step("free", table, got, alloc)
        with lock.explained():
            check_freed(got, table, alloc, len(want), f"free({table})", where)
            compare_behaviour(alloc, bm, f"free({table})", where)
            check_own_state(alloc, list(live.values()), f"free({table})", where)


def test_4_4_free_keeps_hashes_and_lru_order(ex):
    where = book(NB, "4.4")
    check_free_alone(ex.PrefixCachingAllocator, where)
    for mode in ("free_to_front", "head_first"):
        assert_detects(lambda make: check_free_alone(make, where), variant(mode), ALLOC_MISTAKES[mode])
    # frees mixed with allocations (needs your allocate from Exercise 4.3): freed blocks are revived
    for seed, bs, blocks in [(44, 4, 60), (45, 16, 24)]:
        hits, revived = run_workload(ex.PrefixCachingAllocator, seed=seed, bs=bs, num_blocks=blocks, steps=250,
                                     free_prob=0.45, where=where)
        assert hits >= 10 and revived >= 3, f"the workload should revive freed cached blocks ({hits}, {revived})"
