# Your exercises for book/03_paged_kv.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch03")`, from nanoengine.check) or: pytest tests/exercises/test_ch03_paged_kv.py
# Generated from solutions/ch03_paged_kv.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
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
    raise NotImplementedError("Exercise 3.1: the cache slot of each token position start, start+1, ..., end-1 of a sequence - see book/03_paged_kv.ipynb")


def new_blocks_needed(num_computed_tokens: int, num_new_tokens: int, num_blocks_held: int,
                      block_size: int) -> int:
    """Exercise 3.2: how many more blocks a sequence needs for its next tokens.

    The sequence holds `num_blocks_held` blocks and has `num_computed_tokens` tokens cached; it is about to
    compute `num_new_tokens` more. Return 0 when the blocks it holds have room for them all.
    """
    raise NotImplementedError("Exercise 3.2: how many more blocks a sequence needs for its next tokens - see book/03_paged_kv.ipynb")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Exercise 3.3: write token i's key and value into cache slot slots[i], in place.

    k, v [T, KVH, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; slots [T] int64, where -1 means
    "already cached, do not write". Nothing else in the cache may change.
    """
    raise NotImplementedError("Exercise 3.3: write token i's key and value into cache slot slots[i], in place - see book/03_paged_kv.ipynb")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Exercise 3.4: attention of one new query token per sequence over that sequence's cached tokens.

    q [B, H, D]; block_tables [B, max_blocks] int64 (rows padded with junk block ids past each sequence's
    blocks); context_lens [B]: sequence b has context_lens[b] cached tokens, its own new token included.
    Gather each sequence's K/V from its blocks, then softmax(q.k * scale) over those tokens (float32) and
    weight the values; query head h uses kv head h // (H // KVH). Returns [B, H, D] in q's dtype.
    """
    raise NotImplementedError("Exercise 3.4: attention of one new query token per sequence over that sequence's cached tokens - see book/03_paged_kv.ipynb")


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Exercise 3.5: bytes of KV cache one token occupies: a key and a value vector per KV head per layer.

    Use config.num_hidden_layers, .num_key_value_heads and the head size head_dim(config) (config.head_dim,
    or hidden_size // num_attention_heads when the config has none).
    """
    raise NotImplementedError("Exercise 3.5: bytes of KV cache one token occupies: a key and a value vector per KV head per layer - see book/03_paged_kv.ipynb")
