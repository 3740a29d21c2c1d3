"""Chapter 04, book/04a_block_hashes.ipynb .. 04b_ref_counts.ipynb: prefix caching with chained block hashes.

Exercise 4.1: the chained hash of every full block of a token sequence.
Exercise 4.2: how many tokens of a new prompt the prefix cache already holds.
Exercise 4.3: allocate a prompt's blocks, reusing cached blocks (ref counts, revived free blocks).
Exercise 4.4: free a sequence's blocks, keeping their hashes for later hits (LRU order).

`block_hash` is given: the exact hash nanoengine uses. It is not a convention you may change: with
use_exercises=["ch04"] your hashes name blocks in the engine's own prefix cache, beside blocks the engine
hashed itself, and a different hash would never hit them. 4.1-4.4 build a small model of the engine's
BlockManager (checked by what it does: hits, cached prefixes, ref counts, the order in which free blocks would
be evicted; not by which block id holds what). Admitting a prompt with these pieces (its hits, the last token
recomputed, same-step sharing) is chapter 05's Exercise 5.0, where the scheduler is taught.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict

import xxhash


def block_hash(token_ids: list[int], prefix_hash: int | None) -> int:
    """xxh64 over the previous block's hash (8 little-endian bytes; nothing for the first block) followed
    by this block's token ids (4-byte little-endian ints). Same as BlockManager.compute_hash."""
    h = xxhash.xxh64()
    if prefix_hash is not None:
        h.update(prefix_hash.to_bytes(8, "little"))
    ids = array("i", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    h.update(ids.tobytes())
    return h.intdigest()


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Exercise 4.1: the chained hash of each full block of `token_ids`.

    Block i holds token_ids[i * block_size:(i + 1) * block_size]; its hash is block_hash(its tokens,
    hash of block i - 1), or block_hash(its tokens, None) for block 0. A last, partial block gets no hash.
    Use the given block_hash: the engine's prefix cache looks your hashes up beside its own.
    """
    # BEGIN SOLUTION
    hashes: list[int] = []
    prefix = None
    for i in range(len(token_ids) // block_size):
        prefix = block_hash(token_ids[i * block_size:(i + 1) * block_size], prefix)
        hashes.append(prefix)
    return hashes
    # END SOLUTION


def count_cached_tokens(token_ids: list[int], cached: dict[int, list[int]], block_size: int) -> int:
    """Exercise 4.2: how many leading tokens of a new prompt the prefix cache can serve.

    `cached` maps the hash of every cached block to the token ids that block holds. Walk the prompt's
    full blocks in order; a block is a hit when its chained hash is in `cached` AND the cached tokens
    equal the block's tokens (a different token list under the same hash is a collision: a miss).
    Stop at the first miss. Return hit blocks * block_size.
    """
    # BEGIN SOLUTION
    hits = 0
    for i, h in enumerate(prefix_block_hashes(token_ids, block_size)):
        if cached.get(h) != token_ids[i * block_size:(i + 1) * block_size]:
            break
        hits += 1
    return hits * block_size
    # END SOLUTION


class PrefixCachingAllocator:
    """A small model of nanoengine's BlockManager: blocks, ref counts, a hash -> block map, an LRU free
    list."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref_count = [0] * num_blocks  # how many block tables hold each block
        self.block_hash: list[int | None] = [None] * num_blocks  # chained hash of a full, computed block
        self.block_tokens: list[list[int]] = [[] for _ in range(num_blocks)]  # tokens of a hashed block
        self.hash_to_block: dict[int, int] = {}  # the prefix cache: hash -> block id
        # free blocks, least recently freed first: take from the front, return to the back
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    def allocate(self, token_ids: list[int]) -> tuple[list[int], int]:
        """Exercise 4.3: build the block table of a new prompt and compute it; return (table, hit tokens).

        1. Hits: for each full block of the prompt in order, look its chained hash up in hash_to_block; a
           hit needs equal tokens in block_tokens. Stop at the first miss. A hit block gets ref_count + 1;
           if it was free (ref_count 0) it leaves free_blocks.
        2. Fresh blocks for the rest of the prompt (ceil(len / block_size) blocks in all), each popped from
           the FRONT of free_blocks. A popped block that is still the cache entry for its old hash is
           evicted (that hash leaves hash_to_block); reset it: ref_count 1, no hash, no tokens.
        3. The prompt is now computed: give every full block that has no hash yet its chained hash and
           tokens, and register hash -> block in hash_to_block unless that hash is already there.
        Raise MemoryError (changing nothing) if there are not enough free blocks.
        Which free block you take is behaviour, not bookkeeping: it decides which cached prefix is evicted
        (the least recently freed, at the front), and so which later prompts hit.
        """
        # BEGIN SOLUTION
        bs = self.block_size
        hashes = prefix_block_hashes(token_ids, bs)
        hit_blocks: list[int] = []
        for i, h in enumerate(hashes):
            b = self.hash_to_block.get(h)
            if b is None or self.block_tokens[b] != token_ids[i * bs:(i + 1) * bs]:
                break
            hit_blocks.append(b)
        num_needed = -(-len(token_ids) // bs) - len(hit_blocks)
        revived = sum(1 for b in hit_blocks if self.ref_count[b] == 0)
        if num_needed > len(self.free_blocks) - revived:
            raise MemoryError(f"need {num_needed} free blocks, have {len(self.free_blocks) - revived}")
        for b in hit_blocks:
            if self.ref_count[b] == 0:
                del self.free_blocks[b]
            self.ref_count[b] += 1
        table = list(hit_blocks)
        for _ in range(num_needed):
            b, _ = self.free_blocks.popitem(last=False)
            old = self.block_hash[b]
            if old is not None and self.hash_to_block.get(old) == b:
                del self.hash_to_block[old]
            self.ref_count[b], self.block_hash[b], self.block_tokens[b] = 1, None, []
            table.append(b)
        for i, h in enumerate(hashes):
            b = table[i]
            if self.block_hash[b] is None:
                self.block_hash[b], self.block_tokens[b] = h, token_ids[i * bs:(i + 1) * bs]
                self.hash_to_block.setdefault(h, b)
        return table, len(hit_blocks) * bs
        # END SOLUTION

    def free(self, block_table: list[int]) -> list[int]:
        """Exercise 4.4: drop one sequence's references to its blocks; return the blocks that became free.

        Walk the table from its LAST block to its first; each block's ref_count drops by one, and a block
        that reaches 0 goes to the BACK of free_blocks. Freed blocks keep their hash and tokens (and their
        hash_to_block entry), so a later prompt can still hit them until they are reused. The free list's
        order is the order of eviction; the order of the list you return is yours.
        """
        # BEGIN SOLUTION
        freed = []
        for b in reversed(block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_blocks[b] = None
                freed.append(b)
        return freed
        # END SOLUTION
