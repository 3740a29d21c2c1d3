"""Triton kernel: write each new token's K and V rows into the paged cache at its slot. Chapter 06.

One program per BLOCK_T tokens. Slot = physical block * block_size + offset in the block; slot -1 means
"skip": a padding row, or a token whose K/V already sits in a shared prefix-cache block (a masked-out row of
the tile). The program loads its tokens' [num_kv_heads, head_dim] rows of K and of V once and stores them
into every head's place in the cache. The cache is addressed through its strides, so any layout works: the
launcher takes it as a [num_kv_heads, num_blocks, block_size, head_dim] view (the torch/triton layout as it
is, flash-attn's [num_blocks, block_size, num_kv_heads, head_dim] permuted, with no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoengine.kernels.triton_common import pow2

BLOCK_T = 16  # tokens per program


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                    # new K, V: [num_tokens, num_kv_heads, head_dim]
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_head, stride_block, stride_slot,  # the caches' (same for K and V)
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # a [BLOCK_T tokens, BLOCK_H kv heads, BLOCK_D] tile, each axis padded to a power of two
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1)  # [BLOCK_T] int64; -1: padding, or cached
    t3, h3, d3 = t[:, None, None], h[None, :, None], d[None, None, :]
    mask = (slot >= 0)[:, None, None] & (h3 < NUM_KV_HEADS) & (d3 < HEAD_DIM)  # [BLOCK_T, BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + t3 * stride_kt + h3 * stride_kh + d3, mask=mask)
    v = tl.load(v_ptr + t3 * stride_vt + h3 * stride_vh + d3, mask=mask)
    row = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot  # [BLOCK_T] where each goes
    dst = row[:, None, None] + h3 * stride_head + d3
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] (any row strides) into k_cache, v_cache viewed as
    [num_kv_heads, num_blocks, block_size, head_dim]; slot_mapping [num_tokens] int64, -1 = skip."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    store_kv_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[2],
        BLOCK_T=BLOCK_T, BLOCK_H=pow2(num_kv_heads), BLOCK_D=pow2(head_dim))
