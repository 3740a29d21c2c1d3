"""Chapter 03, book/03_paged_kv.ipynb: the paged KV cache.

Exercise 3.1: the slot mapping of a batch: where each new token's K/V goes in the cache.
Exercise 3.2: the attention metadata of a batch: decode block tables and context lengths, prefill chunks.
Exercise 3.3: the store step: write new K/V into their slots.
Exercise 3.4: paged decode attention by gathering each sequence's blocks.
Exercise 3.5: paged prefill attention over a cached prefix.

A batch is a list of nanoengine ScheduledSeq (seq, num_new_tokens, is_prefill): sequence `seq` computes
positions seq.num_computed_tokens .. + num_new_tokens - 1 this step; seq.block_table lists its blocks, and
its first seq.num_cached_tokens tokens sit in blocks the prefix cache shares (chapter 04).

Cache layout per layer in these exercises: k_cache, v_cache [num_blocks, block_size, KVH, D]. Slot
s = block_id * block_size + offset is row s of the cache viewed as [num_blocks * block_size, KVH, D].
(nanoengine's torch backend stores heads first, [KVH, num_blocks, block_size, D], so that one head's blocks
are whole contiguous rows; the tests convert between the two.)
"""

from __future__ import annotations

from typing import Any

import torch

from nanoengine.attention import AttentionMetadata  # the attention backends' input, see its fields


def batch_slot_mapping(scheduled: list[Any], block_size: int) -> list[int]:
    """Exercise 3.1: the cache slot of every new token of a batch, in the flat batch's row order.

    Rows: first every sequence with one new token (the decodes), then every sequence with more (the prefill
    chunks), each group in the batch's order; within a sequence, its positions in order. Position p of a
    sequence goes to slot block_table[p // block_size] * block_size + p % block_size, or -1 when
    p < seq.num_cached_tokens (a prefix-cache block already holds its K/V: do not write it).
    """
    # BEGIN SOLUTION
    slots = []
    for group in ([s for s in scheduled if s.num_new_tokens == 1],
                  [s for s in scheduled if s.num_new_tokens > 1]):
        for s in group:
            seq, start = s.seq, s.seq.num_computed_tokens
            for p in range(start, start + s.num_new_tokens):
                cached = p < seq.num_cached_tokens
                slots.append(-1 if cached else seq.block_table[p // block_size] * block_size + p % block_size)
    return slots
    # END SOLUTION


def attention_metadata(scheduled: list[Any], block_size: int) -> AttentionMetadata:
    """Exercise 3.2: the AttentionMetadata of a batch, as nanoengine's InputBuilder lays it out.

    slot_mapping: your Exercise 3.1, as an int64 tensor. The decodes (one new token; the first rows):
    num_decode_seqs; decode_block_tables [num_decodes, max_blocks] int64, each row the sequence's block table
    padded with 0 to the longest one; decode_context_lens [num_decodes] int64, the tokens each attends over,
    the new one included (None and None when there are no decodes). The prefill chunks, as lists in row
    order: prefill_query_starts (the chunk's first row in the flat batch), prefill_query_lens (its new
    tokens), prefill_context_lens (cached prefix + new tokens), prefill_block_tables (an int64 tensor each).
    """
    # BEGIN SOLUTION
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    tables = ctx = None
    if decodes:
        width = max(len(s.seq.block_table) for s in decodes)
        tables = torch.tensor([s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes],
                              dtype=torch.int64)  # [num_decodes, max_blocks]
        ctx = torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes], dtype=torch.int64)
    starts, row = [], len(decodes)
    for s in prefills:
        starts.append(row)
        row += s.num_new_tokens
    return AttentionMetadata(
        slot_mapping=torch.tensor(batch_slot_mapping(scheduled, block_size), dtype=torch.int64),
        num_decode_seqs=len(decodes), decode_block_tables=tables, decode_context_lens=ctx,
        prefill_query_starts=starts, prefill_query_lens=[s.num_new_tokens for s in prefills],
        prefill_context_lens=[s.seq.num_computed_tokens + s.num_new_tokens for s in prefills],
        prefill_block_tables=[torch.tensor(s.seq.block_table, dtype=torch.int64) for s in prefills],
        block_size=block_size)
    # END SOLUTION


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Exercise 3.3: write token i's key and value into cache slot slots[i], in place.

    k, v [T, KVH, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; slots [T] int64, where -1 means
    "do not write" (a prefix-cache block already holds the token's K/V, or the row is padding). Nothing else
    in the cache may change.
    """
    # BEGIN SOLUTION
    flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, KVH, D], shares storage
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    keep = slots >= 0
    flat_k[slots[keep]] = k[keep]
    flat_v[slots[keep]] = v[keep]
    # END SOLUTION


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Exercise 3.4: attention of one new query token per sequence over that sequence's cached tokens.

    q [B, H, D]; block_tables [B, max_blocks] int64 (rows padded with junk block ids past each sequence's
    blocks); context_lens [B]: sequence b has context_lens[b] cached tokens, its own new token included.
    Gather each sequence's K/V from its blocks, then softmax(q.k * scale) over those tokens (float32) and
    weight the values; query head h uses kv head h // (H // KVH). Returns [B, H, D] in q's dtype.
    """
    # BEGIN SOLUTION
    B, H, D = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // block_size)]
        k = k_cache[blocks].reshape(-1, kv_heads, D)[:n]  # [n, KVH, D]
        v = v_cache[blocks].reshape(-1, kv_heads, D)[:n]
        k = k.repeat_interleave(H // kv_heads, dim=1).float()  # [n, H, D]
        v = v.repeat_interleave(H // kv_heads, dim=1).float()
        probs = (torch.einsum("hd,nhd->hn", q[b].float(), k) * scale).softmax(-1)  # [H, n]
        out[b] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out
    # END SOLUTION


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """Exercise 3.5: causal attention of a prefill chunk over its sequence's cached prefix and itself.

    q [q_len, H, D]: the queries of positions context_len - q_len .. context_len - 1 of one sequence, whose
    K/V (the prefix's and the chunk's own) are already stored in the cache; block_table [num_blocks] int64.
    Query i may see positions 0 .. context_len - q_len + i. Scores in float32, query head h uses kv head
    h // (H // KVH). Returns [q_len, H, D] in q's dtype.
    """
    # BEGIN SOLUTION
    q_len, H, D = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = block_table[: -(-context_len // block_size)]
    k = k_cache[blocks].reshape(-1, kv_heads, D)[:context_len]  # [context_len, KVH, D]
    v = v_cache[blocks].reshape(-1, kv_heads, D)[:context_len]
    k = k.repeat_interleave(H // kv_heads, dim=1).float()  # [context_len, H, D]
    v = v.repeat_interleave(H // kv_heads, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, q_len, context_len]
    pos_q = torch.arange(context_len - q_len, context_len)[:, None]  # [q_len, 1]
    future = torch.arange(context_len)[None, :] > pos_q  # [q_len, context_len]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # [q_len, H, D]
    # END SOLUTION
