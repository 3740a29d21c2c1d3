"""Paged attention in plain PyTorch: runs on any device; the reference for faster kernels. Chapter 03.

K/V cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim].
Decode: gather each sequence's blocks, then grouped-query matmuls (scores in fp32) with a length mask.
Prefill: per sequence, attend over (cached prefix + new tokens) with a causal mask shifted by the prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoengine.attention.metadata import AttentionMetadata


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    # k, v [num_tokens, num_kv_heads, head_dim]; slot_mapping [num_tokens] (-1 = already cached, skip)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, num_kv_heads, head_dim]
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    flat_k.index_copy_(0, slot_mapping, k)
    flat_v.index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    # q [B, num_heads, head_dim]; block_tables [B, max_blocks]; context_lens [B]
    B, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = k_cache[block_tables].flatten(1, 2)  # [B, L, num_kv_heads, head_dim], L = max_blocks * block_size
    v = v_cache[block_tables].flatten(1, 2)
    L = k.shape[1]
    qg = q.view(B, num_kv_heads, group, head_dim)  # [B, kvh, group, head_dim]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, kvh, group, L]
    mask = torch.arange(L, device=q.device)[None, :] >= context_lens[:, None]  # [B, L]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))  # [B, kvh, group, head_dim]
    return out.reshape(B, num_heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q_len positions over k_len >= q_len keys (a cached prefix shifts the mask)."""
    # q [q_len, num_heads, head_dim]; k, v [k_len, num_kv_heads, head_dim]
    q_len, k_len = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
    if q_len == k_len:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos_q = torch.arange(k_len - q_len, k_len, device=q.device)
        mask = torch.arange(k_len, device=q.device)[None, :] <= pos_q[:, None]  # [q_len, k_len]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [q_len, num_heads, head_dim]


class TorchAttention(torch.nn.Module):
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
                ks, vs = k[start:end], v[start:end]
            else:
                ks, vs = gather_kv(k_cache, table, ctx), gather_kv(v_cache, table, ctx)
            out[start:end] = prefill_attention(q[start:end], ks, vs, self.scale)
        return out
