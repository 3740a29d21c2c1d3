# Your exercises for book/04a_block_hashes.ipynb, 04b_ref_counts.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch04")`, from nanoengine.check) or: pytest tests/exercises/test_ch04_prefix_hashing.py
# Generated from solutions/ch04_prefix_hashing.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
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
    raise NotImplementedError("Exercise 4.1: the chained hash of each full block of `token_ids` - see book/04a_block_hashes.ipynb")


def count_cached_tokens(token_ids: list[int], cached: dict[int, list[int]], block_size: int) -> int:
    """Exercise 4.2: how many leading tokens of a new prompt the prefix cache can serve.

    `cached` maps the hash of every cached block to the token ids that block holds. Walk the prompt's
    full blocks in order; a block is a hit when its chained hash is in `cached` AND the cached tokens
    equal the block's tokens (a different token list under the same hash is a collision: a miss).
    Stop at the first miss. Return hit blocks * block_size.
    """
    raise NotImplementedError("Exercise 4.2: how many leading tokens of a new prompt the prefix cache can serve - see book/04a_block_hashes.ipynb")


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
        raise NotImplementedError("Exercise 4.3: build the block table of a new prompt and compute it; return (table, hit tokens) - see book/04b_ref_counts.ipynb")

    def free(self, block_table: list[int]) -> list[int]:
        """Exercise 4.4: drop one sequence's references to its blocks; return the blocks that became free.

        Walk the table from its LAST block to its first; each block's ref_count drops by one, and a block
        that reaches 0 goes to the BACK of free_blocks. Freed blocks keep their hash and tokens (and their
        hash_to_block entry), so a later prompt can still hit them until they are reused. The free list's
        order is the order of eviction; the order of the list you return is yours.
        """
        raise NotImplementedError("Exercise 4.4: drop one sequence's references to its blocks; return the blocks that became free - see book/04b_ref_counts.ipynb")
