"""Paged attention in plain PyTorch: runs on any device; the reference for faster kernels. Chapter 03.

K/V cache layout per layer, heads first: [num_kv_heads, num_blocks, block_size, head_dim]. Reading and
writing go through flat 2-D views of it, so each copy moves whole contiguous rows:
- store: [num_kv_heads * num_blocks * block_size, head_dim], one row per (kv head, slot);
- gather: [num_kv_heads * num_blocks, block_size * head_dim], one row per (kv head, block). Gathering a
  batch's block tables for every head gives [num_kv_heads, batch, tokens, head_dim] with no further copy,
  which is what the grouped-query matmuls want. (On CPU, `index_select` along dim 0 of a 2-D tensor is a
  row memcpy; along dim 1 of the 4-D cache it is not, and is slower.)
The row indices and the decode length mask depend only on the batch: `TorchAttention.prepare` computes them
once per step and every layer reads them from `meta.prepared`.
Decode: one gather for the whole batch, scores in fp32, length mask, softmax, matmul with V.
Prefill: per sequence, attend over (cached prefix + new tokens) with a causal mask shifted by the prefix.
The cache may hold a narrower dtype than the compute dtype (kv_cache_dtype="bfloat16" under float32): the
store rounds K/V to it, and what is gathered is cast up to the queries' dtype before the matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoengine.attention.base import AttentionBackend
from nanoengine.attention.metadata import AttentionMetadata, AttentionPrep


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_kv_heads, num_blocks, block_size, head_dim)


def per_head_rows(index: torch.Tensor, num_kv_heads: int, rows_per_head: int) -> torch.Tensor:
    """Rows of a heads-first flat view for `index` (slots or blocks) in every kv head, head-major:
    [num_kv_heads * len(index)]."""
    heads = torch.arange(num_kv_heads, device=index.device)[:, None] * rows_per_head  # [num_kv_heads, 1]
    return (index[None, :] + heads).flatten()


def store_index(slot_mapping: torch.Tensor,
                kv_cache_shape: tuple[int, ...]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(tokens to write or None for all, their rows in the slot view, head-major)."""
    num_kv_heads, num_blocks, block_size, _ = kv_cache_shape
    tokens = None
    keep = slot_mapping >= 0  # -1: the token's K/V already sits in a shared prefix-cache block
    if not bool(keep.all()):
        tokens = keep.nonzero().squeeze(1)
        slot_mapping = slot_mapping[tokens]
    return tokens, per_head_rows(slot_mapping, num_kv_heads, num_blocks * block_size)


def decode_index(block_tables: torch.Tensor, context_lens: torch.Tensor,
                 kv_cache_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of the block view for every kv head and table entry, mask [1, B, 1, L]: True = past context)."""
    num_kv_heads, num_blocks, block_size, _ = kv_cache_shape
    rows = per_head_rows(block_tables.flatten(), num_kv_heads, num_blocks)  # [kvh * B * max_blocks]
    positions = torch.arange(block_tables.shape[1] * block_size, device=block_tables.device)  # [L]
    mask = (positions[None, :] >= context_lens[:, None])[None, :, None, :]
    return rows, mask


@dataclass
class TorchPrep(AttentionPrep):
    """What every layer of one step reuses: store rows, and the decode gather rows and mask."""
    store_tokens: torch.Tensor | None
    store_rows: torch.Tensor
    decode_rows: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None

    @classmethod
    def for_store(cls, slot_mapping: torch.Tensor, kv_cache_shape: tuple[int, ...]) -> TorchPrep:
        return cls(*store_index(slot_mapping, kv_cache_shape))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             tokens: torch.Tensor | None, rows: torch.Tensor) -> None:
    head_dim = k.shape[-1]  # k, v [num_tokens, num_kv_heads, head_dim]
    if tokens is not None:
        k, v = k[tokens], v[tokens]
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # a bf16 cache under float32 compute: rounded here
    # sources [num_kv_heads * n, head_dim], head-major like rows
    k_cache.view(-1, head_dim).index_copy_(0, rows, k.transpose(0, 1).reshape(-1, head_dim))
    v_cache.view(-1, head_dim).index_copy_(0, rows, v.transpose(0, 1).reshape(-1, head_dim))


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V at its slot (block * block_size + offset; -1: already cached, skip)."""
    write_kv(k, v, k_cache, v_cache, *store_index(slot_mapping, k_cache.shape))


def gather_blocks(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Whole blocks by row of the block view: [len(rows), block_size * head_dim]."""
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    return cache.view(num_kv_heads * num_blocks, block_size * head_dim).index_select(0, rows)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens: [num_kv_heads, length, head_dim]."""
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    used = block_table[: -(-length // block_size)]  # the blocks that hold `length` tokens
    blocks = gather_blocks(cache, per_head_rows(used, num_kv_heads, num_blocks))
    return blocks.view(num_kv_heads, -1, head_dim)[:, :length]


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                 mask: torch.Tensor, scale: float) -> torch.Tensor:
    B, num_heads, head_dim = q.shape  # q: one new token per sequence, its K/V already stored
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    k = gather_blocks(k_cache, rows).view(num_kv_heads, B, -1, head_dim).to(q.dtype)  # [kvh, B, L, head_dim]
    v = gather_blocks(v_cache, rows).view(num_kv_heads, B, -1, head_dim).to(q.dtype)
    qg = q.view(B, num_kv_heads, group, head_dim).transpose(0, 1)  # [kvh, B, group, head_dim]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [kvh, B, group, L]
    scores.masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [kvh, B, group, head_dim]
    return out.transpose(0, 1).reshape(B, num_heads, head_dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of one query token per sequence over its cached tokens (block_tables [B, max_blocks]
    padded with any block id, context_lens [B] including the new token)."""
    return paged_decode(q, k_cache, v_cache, *decode_index(block_tables, context_lens, k_cache.shape), scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q_len positions over k_len >= q_len keys (a cached prefix shifts the
    mask)."""
    # q [q_len, num_heads, head_dim]; k, v [num_kv_heads, k_len, head_dim] (heads first)
    q_len, k_len = q.shape[0], k.shape[1]
    # a batch of one: on CPU, 4-D inputs take SDPA's fused (flash) kernel, which never holds the
    # [q_len, k_len] scores; 3-D ones its unfused math (4x to 7x slower at 2,048 tokens, SmolLM2's heads,
    # 1 thread)
    qt, kt, vt = q.transpose(0, 1)[None], k[None], v[None]  # [1, heads, len, head_dim]
    if q_len == k_len:  # no cached prefix: SDPA's own causal mask, which skips the blocks above the diagonal
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:  # the mask shifted by the prefix: query i sits at position k_len - q_len + i
        pos_q = torch.arange(k_len - q_len, k_len, device=q.device)
        visible = torch.arange(k_len, device=q.device)[None, :] <= pos_q[:, None]  # [q_len, k_len]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [q_len, num_heads, head_dim]


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prompt (chunk) with no cached prefix over its own tokens: q [T, num_heads,
    head_dim], k, v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""
    return prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), scale)


def prompts_without_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                          attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                          ) -> torch.Tensor:
    """Each prompt's `attend(q, k, v)` over its own new tokens, for a forward with no KV cache bound (the
    warm-up forward that measures peak memory, tests): any backend's answer there."""
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    for start, q_len in zip(meta.prefill_query_starts, meta.prefill_query_lens):
        s = slice(start, start + q_len)
        out[s] = attend(q[s], k[s], v[s])
    return out


class TorchAttention(AttentionBackend):
    """The reference backend: plain PyTorch on any device. Its forward is four steps, one method each
    (`store`, `decode`, `prompt_attention`, `prefix_attention`), so that a variant of it (the CPU kernels'
    decode, the learner's pieces in nanoengine.pieces) replaces just the ones it does differently."""
    name = "torch"
    cuda_graphs = False  # the store decides on the host which slots to skip (store_index)
    kv_cache_shape = staticmethod(kv_cache_shape)

    @classmethod
    def prepare(cls, meta: AttentionMetadata, kv_cache_shape: tuple[int, ...]) -> TorchPrep:
        """The store rows and (with decodes) the gather rows and length mask of one step, for every layer."""
        p = TorchPrep.for_store(meta.slot_mapping, kv_cache_shape)
        if meta.num_decode_seqs:
            p.decode_rows, p.decode_mask = decode_index(meta.decode_block_tables, meta.decode_context_lens,
                                                        kv_cache_shape)
        return p

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]
        if not self.k_cache.numel():  # no cache bound (attention/base.py)
            return prompts_without_cache(q, k, v, meta, self.prompt_attention)
        out = torch.empty_like(q)
        p = meta.prepared if meta.prepared is not None else self.prepare(meta, self.k_cache.shape)
        self.store(k, v, meta, p)
        nd = meta.num_decode_seqs
        if nd == q.shape[0]:  # a pure decode step (most steps): no copy into `out`
            return self.decode(q, meta, p)
        if nd:
            out[:nd] = self.decode(q[:nd], meta, p)
        for start, q_len, ctx, table in zip(meta.prefill_query_starts, meta.prefill_query_lens,
                                            meta.prefill_context_lens, meta.prefill_block_tables):
            s = slice(start, start + q_len)
            if ctx == q_len:  # no cached prefix: attend over the new tokens directly
                out[s] = self.prompt_attention(q[s], k[s], v[s])
            else:  # a chunk after a cached prefix (an earlier chunk, or prefix-cache hits)
                out[s] = self.prefix_attention(q[s], table, ctx)
        return out

    def store(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, prep: TorchPrep) -> None:
        """Write the new tokens' K/V [num_tokens, num_kv_heads, head_dim] at their slots (-1: skip)."""
        write_kv(k, v, self.k_cache, self.v_cache, prep.store_tokens, prep.store_rows)

    def decode(self, q: torch.Tensor, meta: AttentionMetadata, prep: TorchPrep) -> torch.Tensor:
        # q [num_decode_seqs, num_heads, head_dim], their K/V already stored
        return paged_decode(q, self.k_cache, self.v_cache, prep.decode_rows, prep.decode_mask, self.scale)

    def prompt_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A prompt chunk with no cached prefix: `self_attention`."""
        return self_attention(q, k, v, self.scale)

    def prefix_attention(self, q: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
        """Causal attention of a chunk's queries q [q_len, num_heads, head_dim] (the last q_len of context_len
        positions) over its sequence's cached tokens, the chunk's own already stored."""
        k = gather_kv(self.k_cache, block_table, context_len).to(q.dtype)  # [kv_heads, context_len, head_dim]
        v = gather_kv(self.v_cache, block_table, context_len).to(q.dtype)
        return prefill_attention(q, k, v, self.scale)
