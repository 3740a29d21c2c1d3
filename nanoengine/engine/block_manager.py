"""BlockManager: the paged KV cache's bookkeeping. Chapters 03 (paged blocks) and 04 (prefix hashing).

The KV cache is cut into `num_blocks` fixed-size blocks of `block_size` token slots. Each sequence owns a
*block table* (logical block i -> physical block id). This module only does the bookkeeping, in plain
Python: which blocks are free, how many sequences share each block (`ref_count`), and the prefix cache.

Prefix cache (chapter 04): once a block is full and its K/V are computed, it gets a *chained* hash
(xxh64 of the previous block's hash + this block's token ids), so a hash names the whole prefix up to and
including the block. A new sequence whose leading blocks hash the same reuses those blocks instead of
recomputing them. Freed blocks keep their hash and go to the end of the free list; allocation takes from
the front, so the least-recently-freed cached block is evicted first (LRU).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable

import xxhash

from nanoengine.engine.sequence import Sequence

_U64 = (1 << 64) - 1


class Block:
    """One physical KV block: who uses it and, once full and computed, what it holds."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # None: not full / not cacheable yet
        self.token_ids: list[int] = []

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = None
        self.token_ids = []

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, hash={self.hash}, tokens={self.token_ids})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockManager: num_blocks must be >= 1, got {num_blocks}; "
                             "give the KV cache more memory (num_kvcache_blocks / kv_cache_memory_gb)")
        if block_size < 1:
            raise ValueError(f"BlockManager: block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # while a step is being scheduled: the blocks it hashes before their K/V exist (`forget_hashes` drops
        # them if the step never runs); None otherwise
        self.hashed_now: list[int] | None = None

    # ------------------------------------------------------------------ hashing
    @staticmethod
    def compute_hash(token_ids: list[int], prefix_hash: int | None) -> int:
        """xxh64 over (prefix hash as 8 little-endian bytes, if any) + token ids as little-endian int32."""
        h = xxhash.xxh64()
        if prefix_hash is not None:
            h.update((prefix_hash & _U64).to_bytes(8, "little"))
        arr = array("i", token_ids)
        if sys.byteorder != "little":
            arr.byteswap()
        h.update(arr.tobytes())
        return h.intdigest()

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens: the ceiling of num_tokens / block_size."""
        return -(-num_tokens // self.block_size)

    def fills_a_block(self, computed_before: int, computed_after: int) -> bool:
        """True when computing tokens computed_before..computed_after-1 completes at least one block."""
        return computed_after // self.block_size > computed_before // self.block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks seq needs to hold num_computed_tokens + num_new_tokens tokens."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    # ------------------------------------------------------------------ prefix cache lookup
    def match_prefix(self, seq: Sequence) -> int:
        """Reuse cached blocks for the leading full blocks of `seq` (a waiting sequence with an empty block
        table, being admitted); return the number of hit tokens. The caller sets `num_cached_tokens` /
        `num_computed_tokens`; to roll the hit back, call `free(seq)`."""
        if not self.enable_prefix_caching:
            return 0
        if seq.block_table:
            raise RuntimeError(f"match_prefix: seq {seq.seq_id} already has blocks {seq.block_table}; "
                               "prefix matching is only for a sequence with an empty block table "
                               "(free it first)")
        for block_id in self.cached_prefix(seq):
            block = self.blocks[block_id]
            if block.ref_count == 0:  # a cached free block: revive it
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        return len(seq.block_table) * self.block_size

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold seq's leading full blocks, in order: each one's chained hash is in the
        cache and its tokens are equal (a hash collision is a miss); the first miss ends the prefix."""
        hit_ids, num_full = [], seq.num_known_tokens // self.block_size
        hashes = self.hashes_of(seq, num_full)
        for i in range(num_full):
            block_id = self.hash_to_block_id.get(hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != seq.block_tokens(i):  # miss, collision
                break
            hit_ids.append(block_id)
        return hit_ids

    def hashes_of(self, seq: Sequence, num_blocks: int) -> list[int]:
        """`seq.block_hashes`, the chained hashes of seq's full blocks (known tokens only), extended to hold
        at least its first `num_blocks` (read those; it is not a copy). Each block is hashed once per
        sequence, so a waiting sequence tried at every step, or a long prompt whose blocks fill chunk by
        chunk, hashes nothing twice."""
        have = seq.block_hashes
        if len(have) < num_blocks:
            have += self.chain_hashes(seq, len(have), num_blocks, have[-1] if have else None)
        return have

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Are there enough free blocks to cover seq.num_computed_tokens + num_new_tokens tokens?"""
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Extend seq.block_table to cover num_computed_tokens + num_new_tokens tokens; the new block ids."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free_block_ids):
            raise RuntimeError(
                f"allocate: seq {seq.seq_id} needs {needed} more KV blocks but only "
                f"{len(self.free_block_ids)} are free (of {self.num_blocks}); "
                "call can_allocate first and preempt or wait")
        new_ids = []
        for _ in range(needed):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]  # evict from the prefix cache
            block.reset()
            new_ids.append(block_id)
        seq.block_table.extend(new_ids)
        return new_ids

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Hash and register every block of `seq` that is full and computed and has no hash yet.
        `num_computed_tokens` (default: seq.num_computed_tokens) may count the tokens this step is about to
        compute: the scheduler registers blocks as soon as they are scheduled, so a request admitted later in
        the same step already hits them. That is safe because every attention layer stores the whole batch's
        K/V before any sequence attends, and because a step that fails takes them out again (`hashed_now`
        records them while a step is scheduled; `forget_hashes`). A block holding a pending token waits: its
        hash needs the token's id."""
        if not self.enable_prefix_caching:
            return
        table = seq.block_table
        if num_computed_tokens is None:
            num_computed_tokens = seq.num_computed_tokens
        num_computed_tokens = min(num_computed_tokens, seq.num_known_tokens)
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = num_full  # hashed blocks form a prefix of the table: walk back to the first unhashed full one
        while start > 0 and self.blocks[table[start - 1]].hash is None:
            start -= 1
        hashes = self.hashes_of(seq, num_full)
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            block.hash = h = hashes[i]
            block.token_ids = seq.block_tokens(i)
            # if another block already holds this prefix, keep that mapping (this one stays a private copy)
            self.hash_to_block_id.setdefault(h, block.block_id)
            if self.hashed_now is not None:
                self.hashed_now.append(block.block_id)

    def forget_hashes(self, block_ids: Iterable[int]) -> None:
        """Take blocks out of the prefix cache: a step that hashed them when it was scheduled failed, so their
        K/V were never written (they stay in their tables, and are hashed again once computed)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = None, []

    def chain_hashes(self, seq: Sequence, start: int, stop: int, prefix_hash: int | None) -> list[int]:
        """The chained hashes of seq's full blocks start..stop-1, given the hash of block start-1 (what
        `hashes_of` computes each block with, once)."""
        return self.hash_blocks((seq.block_tokens(i) for i in range(start, stop)), prefix_hash)

    @classmethod
    def hash_blocks(cls, blocks: Iterable[list[int]], prefix_hash: int | None = None) -> list[int]:
        """The chained hashes of consecutive full blocks (each given by its token ids), the first chained
        onto `prefix_hash`: the names a prefix-cache lookup compares (the data-parallel router hashes a
        prompt's blocks with it too, serve/router.py)."""
        hashes = []
        for tokens in blocks:
            prefix_hash = cls.compute_hash(tokens, prefix_hash)
            hashes.append(prefix_hash)
        return hashes

    # ------------------------------------------------------------------ release
    def free(self, seq: Sequence) -> list[int]:
        """Drop seq's references and empty its table (`release`); return the blocks that became free."""
        freed = self.release(seq.block_table)
        seq.block_table.clear()
        seq.num_table_resets += 1
        return freed

    def release(self, block_table: list[int]) -> list[int]:
        """Drop one reference to each block of a table, last block first (so tail blocks are evicted first);
        return the blocks that became free (to the back of the free list, keeping their hash: they stay
        prefix-cache hits until they are reallocated)."""
        freed = []
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                freed.append(block_id)
        return freed

    def truncate(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Keep the blocks that hold seq's first `num_tokens` tokens and free the rest (speculative decoding's
        rollback, chapter 09: blocks that only rejected drafts wrote). Such blocks were never hashed (a hash
        needs known tokens), so they go back unhashed. Returns the blocks freed."""
        if self.blocks_for(num_tokens) >= len(seq.block_table):
            return []
        freed = self.rollback_blocks(seq.block_table, num_tokens)
        seq.num_table_resets += 1  # the table shrank: copies of it (the decode block tables) start afresh
        return freed

    def rollback_blocks(self, block_table: list[int], num_tokens: int) -> list[int]:
        """Shorten `block_table` in place to the blocks of its first `num_tokens` tokens, releasing the later
        ones (last first); returns the blocks freed (chapter 09's Exercise 9.4 replaces this)."""
        keep = self.blocks_for(num_tokens)
        freed = self.release(block_table[keep:])
        del block_table[keep:]
        return freed

    # ------------------------------------------------------------------ inspection
    def get_cached_free_block_ids(self) -> list[int]:
        """Free blocks that still hold a hash (reusable by a prefix hit), least-recently-freed first."""
        return [b for b in self.free_block_ids if self.blocks[b].hash is not None]

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """For tests: raise AssertionError if the bookkeeping is inconsistent with the given block tables."""
        refs = [0] * self.num_blocks
        for seq in seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        problems = []
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                problems.append(f"block {block.block_id}: ref_count={block.ref_count} but "
                                f"{refs[block.block_id]} block table(s) hold it")
            if (block.ref_count == 0) != (block.block_id in self.free_block_ids):
                problems.append(f"block {block.block_id}: ref_count={block.ref_count} but "
                                f"{'in' if block.block_id in self.free_block_ids else 'not in'} "
                                "the free list")
            if block.hash is not None and len(block.token_ids) != self.block_size:
                problems.append(f"block {block.block_id}: hashed but holds {len(block.token_ids)} tokens")
        for h, block_id in self.hash_to_block_id.items():
            if self.blocks[block_id].hash != h:
                problems.append(f"hash {h} maps to block {block_id} "
                                f"whose hash is {self.blocks[block_id].hash}")
        if problems:
            raise AssertionError("BlockManager invariants broken:\n  " + "\n  ".join(problems))
