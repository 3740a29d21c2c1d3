"""Chapter 03, book/03_paged_kv.ipynb: the paged KV cache.

Exercise 3.1: the slot mapping: where each new token's K/V goes in the cache.
Exercise 3.2: when a sequence needs new blocks.
Exercise 3.3: the store step: write new K/V into their slots.
Exercise 3.4: paged decode attention by gathering each sequence's blocks.
Exercise 3.5: KV cache bytes per token of a model config.

Cache layout per layer in these exercises: k_cache, v_cache [num_blocks, block_size, KVH, D]. Slot
s = block_id * block_size + offset is row s of the cache viewed as [num_blocks * block_size, KVH, D].
(nanoengine's torch backend stores heads first, [KVH, num_blocks, block_size, D], so that one head's blocks
are whole contiguous rows; the tests convert between the two.)
"""

from __future__ import annotations

from typing import Any

import torch

from nanoengine.models.hf_config import head_dim  # head_dim(config) -> the head size of a transformers config


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Exercise 3.1: the cache slot of each token position start, start+1, ..., end-1 of a sequence.

    Position p lives in logical block p // block_size, at offset p % block_size; `block_table[i]` is the
    physical block holding logical block i.
    """
    # BEGIN SOLUTION
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    # END SOLUTION


def new_blocks_needed(num_computed_tokens: int, num_new_tokens: int, num_blocks_held: int,
                      block_size: int) -> int:
    """Exercise 3.2: how many more blocks a sequence needs for its next tokens.

    The sequence holds `num_blocks_held` blocks and has `num_computed_tokens` tokens cached; it is about to
    compute `num_new_tokens` more. Return 0 when the blocks it holds have room for them all.
    """
    # BEGIN SOLUTION
    total = num_computed_tokens + num_new_tokens
    return max(0, -(-total // block_size) - num_blocks_held)
    # END SOLUTION


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Exercise 3.3: write token i's key and value into cache slot slots[i], in place.

    k, v [T, KVH, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; slots [T] int64, where -1 means
    "already cached, do not write". Nothing else in the cache may change.
    """
    # BEGIN SOLUTION
    flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, KVH, D], shares storage
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    keep = slots >= 0
    flat_k[slots[keep]] = k[keep]
    flat_v[slots[keep]] = v[keep]
    # END SOLUTION


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
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


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Exercise 3.5: bytes of KV cache one token occupies: a key and a value vector per KV head per layer.

    Use config.num_hidden_layers, .num_key_value_heads and the head size head_dim(config) (config.head_dim,
    or hidden_size // num_attention_heads when the config has none).
    """
    # BEGIN SOLUTION
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * elem
    # END SOLUTION
