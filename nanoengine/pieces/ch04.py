"""Chapter 04's pieces in the engine: a BlockManager whose chained block hashes (4.1), prefix-cache lookup
(4.2) and freeing (4.4) are yours. (Admitting a prompt is chapter 05's 5.0; the scheduler stays the engine's.)

The engine's BlockManager splits its work into the steps the exercises build: `chain_hashes` (the chained hash
of a sequence's full blocks), `cached_prefix` (which leading blocks the cache holds) and `release` (drop a
table's references, tail first, onto the back of the LRU free list). This subclass runs each on your code:
your `prefix_block_hashes`, your `count_cached_tokens` over a read-only view of the engine's cache, and your
`PrefixCachingAllocator.free` over the engine's own ref counts and free list. Allocating fresh blocks stays
the engine's: it grows a sequence chunk by chunk and token by token, where your 4.3 allocates a whole prompt
at once (the same steps; its tests compare them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import ModuleType

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.sequence import Sequence
from nanoengine.errors import ExerciseError
from nanoengine.pieces.learner import check_result, piece


class CachedBlocks(Mapping):
    """The engine's prefix cache as exercise 4.2 sees it: the hash of every cached block -> its token ids."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm

    def __getitem__(self, h: int) -> list[int]:
        return list(self.bm.blocks[self.bm.hash_to_block_id[h]].token_ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.bm.hash_to_block_id)

    def __len__(self) -> int:
        return len(self.bm.hash_to_block_id)


class BlockField:
    """One field of every Block as a list (block id -> value), e.g. ref_count, for the allocator's methods."""

    def __init__(self, bm: BlockManager, name: str) -> None:
        self.blocks, self.name = bm.blocks, name

    def __getitem__(self, block_id: int):
        return getattr(self.blocks[block_id], self.name)

    def __setitem__(self, block_id: int, value) -> None:
        setattr(self.blocks[block_id], self.name, value)

    def __len__(self) -> int:
        return len(self.blocks)


class AllocatorState:
    """The engine's BlockManager state under the names of exercise 4.3/4.4's PrefixCachingAllocator, so its
    methods run on the engine's blocks themselves (no copy): the free list and the hash map are the
    engine's."""

    def __init__(self, bm: BlockManager) -> None:
        self.block_size = bm.block_size
        self.ref_count = BlockField(bm, "ref_count")
        self.block_hash = BlockField(bm, "hash")
        self.block_tokens = BlockField(bm, "token_ids")
        self.hash_to_block = bm.hash_to_block_id
        self.free_blocks = bm.free_block_ids


def block_manager_class(module: ModuleType) -> type[BlockManager]:
    hashes_of = piece(module, "prefix_block_hashes", "ch04")
    count_cached = piece(module, "count_cached_tokens", "ch04")
    free = piece(module, "PrefixCachingAllocator.free", "ch04")

    class LearnerBlockManager(BlockManager):
        def chain_hashes(self, seq: Sequence, start: int, stop: int, prefix_hash: int | None) -> list[int]:
            hashes = list(hashes_of(seq.token_ids[: stop * self.block_size], self.block_size))
            check_result(len(hashes) == stop, hashes_of, f"{len(hashes)} hashes for {stop} full blocks of "
                         f"{self.block_size} tokens; it must return one per full block")
            return hashes[start:stop]

        def cached_prefix(self, seq: Sequence) -> list[int]:
            size = self.block_size
            full = seq.num_tokens // size
            hits = count_cached(list(seq.token_ids), CachedBlocks(self), size)
            check_result(isinstance(hits, int) and 0 <= hits <= full * size and hits % size == 0,
                         count_cached,
                         f"{hits!r} cached tokens for a prompt of {seq.num_tokens} tokens; "
                         f"it must be a whole number of blocks of {size}, at most {full * size}")
            hashes = self.chain_hashes(seq, 0, hits // size, None)
            missing = [i for i, h in enumerate(hashes) if h not in self.hash_to_block_id]
            if missing:
                raise ExerciseError(f"use_exercises: your Exercise 4.2 counted {hits} cached tokens, but "
                                    f"block {missing[0]}'s hash (your 4.1) is not in the cache")
            return [self.hash_to_block_id[h] for h in hashes]

        def release(self, block_table: list[int]) -> list[int]:
            freed = free(AllocatorState(self), list(block_table))
            check_result(isinstance(freed, list), free,
                         f"{type(freed).__name__}; it must return the freed blocks")
            return freed

    return LearnerBlockManager
