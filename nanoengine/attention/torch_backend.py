"""Paged attention in plain PyTorch: runs on any device; the reference for faster kernels. Chapter 03.

K/V cache layout per layer, heads first: [num_kv_heads, num_blocks, block_size, head_dim]. Gathering a
sequence's blocks along dim 1 then gives [num_kv_heads, tokens, head_dim] with no further copy, which
is what the grouped-query matmuls want (on CPU this layout made decode attention 2.5x faster than
[num_blocks, block_size, num_kv_heads, head_dim], which needs a transposing copy after the gather).
Decode: one index_select for the whole batch, scores in fp32, a length mask, softmax, matmul with V.
Prefill: per sequence, attend over (cached prefix + new tokens) with a causal mask shifted by the prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoengine.attention.metadata import AttentionMetadata


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_kv_heads, num_blocks, block_size, head_dim)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    # k, v [num_tokens, num_kv_heads, head_dim]; slot_mapping [num_tokens] (-1 = already cached, skip)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat_k = k_cache.view(num_kv_heads, -1, head_dim)  # [num_kv_heads, num_blocks * block_size, head_dim]
    flat_v = v_cache.view(num_kv_heads, -1, head_dim)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    flat_k.index_copy_(1, slot_mapping, k.transpose(0, 1))
    flat_v.index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens: [num_kv_heads, length, head_dim]."""
    num_kv_heads, _, block_size, head_dim = cache.shape
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(1, block_table[:num_blocks])  # [num_kv_heads, num_blocks, block_size, head_dim]
    return blocks.view(num_kv_heads, -1, head_dim)[:, :length]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    # q [B, num_heads, head_dim]; block_tables [B, max_blocks]; context_lens [B]
    B, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    flat_tables = block_tables.flatten()
    k = k_cache.index_select(1, flat_tables).view(num_kv_heads, B, -1, head_dim)  # [kvh, B, L, head_dim]
    v = v_cache.index_select(1, flat_tables).view(num_kv_heads, B, -1, head_dim)
    L = k.shape[2]
    qg = q.view(B, num_kv_heads, group, head_dim).transpose(0, 1)  # [kvh, B, group, head_dim]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [kvh, B, group, L]
    mask = torch.arange(L, device=q.device)[None, :] >= context_lens[:, None]  # [B, L]
    scores.masked_fill_(mask[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [kvh, B, group, head_dim]
    return out.transpose(0, 1).reshape(B, num_heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q_len positions over k_len >= q_len keys (a cached prefix shifts the mask)."""
    # q [q_len, num_heads, head_dim]; k, v [num_kv_heads, k_len, head_dim] (heads first)
    q_len, k_len = q.shape[0], k.shape[1]
    qt = q.transpose(0, 1)  # [num_heads, q_len, head_dim]
    if q_len == k_len:
        out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos_q = torch.arange(k_len - q_len, k_len, device=q.device)
        mask = torch.arange(k_len, device=q.device)[None, :] <= pos_q[:, None]  # [q_len, k_len]
        out = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [q_len, num_heads, head_dim]


class TorchAttention(torch.nn.Module):
    kv_cache_shape = staticmethod(kv_cache_shape)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])  # set by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache.numel():
            store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode_seqs
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                        meta.decode_context_lens, self.scale)
        for start, q_len, ctx, table in zip(meta.prefill_query_starts, meta.prefill_query_lens,
                                            meta.prefill_context_lens, meta.prefill_block_tables):
            end = start + q_len
            if ctx == q_len or not k_cache.numel():  # no cached prefix: attend over the new tokens directly
                ks, vs = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                ks, vs = gather_kv(k_cache, table, ctx), gather_kv(v_cache, table, ctx)
            out[start:end] = prefill_attention(q[start:end], ks, vs, self.scale)
        return out
