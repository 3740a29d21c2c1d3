"""Triton kernel: paged prefill attention for prompt chunks whose earlier tokens are cached. Chapter 06.

A prefill sequence brings q_len new tokens at positions context - q_len .. context - 1: the last part of a
prompt whose first tokens came from the prefix cache, or one chunk of a chunked prefill. Their K/V are
stored into the cache first (`triton_store`), so the kernel reads every key, cached or new, from the
blocks, and the causal mask is shifted by the cached length: the query at position p sees keys 0..p.

Grid: (prefill sequence, tile of BLOCK_Q queries, kv head). The tile's rows are (query token, query head of
the kv head's group) pairs, BLOCK_Q * BLOCK_G of them, so K/V tiles are loaded once for the whole group and
the matrix products have enough rows for the tensor cores (vLLM's unified Triton attention does the same).
The key loop stops at the tile's last query position: tiles above the diagonal are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoengine.kernels.triton_common import LOG2E, attend_keys, dot_in_fp32, pow2

BLOCK_M = 64  # query rows per program: BLOCK_Q tokens x BLOCK_G heads
BLOCK_N = 64  # keys per tile


@triton.jit
def paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr,
                         query_starts_ptr, query_lens_ptr, context_lens_ptr, qk_scale,
                         stride_qt, stride_qh,  # q [num_tokens, num_heads, head_dim] (the flat batch)
                         stride_ot, stride_oh,  # out, the same shape
                         stride_head, stride_block, stride_slot,  # caches [kvh, blocks, block_size, head_dim]
                         stride_table,  # block tables [num_prefills, max_blocks]
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + seq)
    if q_tile * BLOCK_Q >= q_len:  # the grid covers the longest chunk; this one is shorter
        return
    q_start = tl.load(query_starts_ptr + seq)  # first row of this sequence in the flat batch
    context = tl.load(context_lens_ptr + seq)  # cached prefix + new tokens
    cached = context - q_len

    r = tl.arange(0, BLOCK_Q * BLOCK_G)  # tile rows
    q_idx = q_tile * BLOCK_Q + r // BLOCK_G  # [M] query token within the chunk
    g = r % BLOCK_G  # [M] query head within the group
    head = kv_head * GROUP + g
    row_mask = (q_idx < q_len) & (g < GROUP)
    q_pos = cached + q_idx  # [M] position in the sequence: the causal limit
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=mask, other=0.0)  # [M, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_Q * BLOCK_G], 0, tl.float32)
    acc = tl.full([BLOCK_Q * BLOCK_G, BLOCK_D], 0, tl.float32)
    end = tl.minimum(context, cached + (q_tile + 1) * BLOCK_Q)  # keys past the tile's last query: never seen
    table = block_tables_ptr + seq * stride_table
    m_i, l_i, acc = attend_keys(q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table,
                                kv_head * stride_head, 0, end, d, d_mask, stride_block, stride_slot, qk_scale,
                                BLOCK_SIZE, BLOCK_N, DOT_FP32)

    out = acc / l_i[:, None]  # every row saw key 0, so l_i > 0
    tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  block_tables: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                  context_lens: torch.Tensor, max_query_len: int, scale: float) -> torch.Tensor:
    """Causal attention of each prefill chunk's queries over its sequence's cached tokens (new ones stored).

    q, out: [num_tokens, num_heads, head_dim], the flat batch (prefill rows at query_starts[i] ..
    + query_lens[i]; other rows of `out` are left alone); k_cache, v_cache [num_kv_heads, num_blocks,
    block_size, head_dim] (a view of any layout); block_tables [num_prefills, max_blocks] int64;
    query_starts, query_lens, context_lens [num_prefills]; max_query_len: the longest chunk (sizes the grid).
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, _, block_size, _ = k_cache.shape
    num_prefills = query_lens.shape[0]
    if num_prefills == 0:
        return out
    assert q.stride(-1) == out.stride(-1) == k_cache.stride(-1) == 1, "head_dim must be contiguous"
    group = num_heads // num_kv_heads
    block_g = pow2(group)
    block_q = max(1, BLOCK_M // block_g)
    grid = (num_prefills, triton.cdiv(max_query_len, block_q), num_kv_heads)
    paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_starts, query_lens, context_lens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_G=block_g,
        BLOCK_D=pow2(head_dim, 16), BLOCK_N=BLOCK_N, DOT_FP32=dot_in_fp32(q.dtype))
    return out
