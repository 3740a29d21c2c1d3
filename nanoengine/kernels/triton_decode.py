"""Triton kernels: paged decode attention, one query token per sequence, split across programs. Chapter 06.

Grid: (sequence, kv head, split). A program takes one kv head's whole group of query heads (grouped-query
attention: 9 query heads over 3 kv heads is 3 rows each), so each K/V row is read once for the group, and
walks its share of the sequence's context in tiles of BLOCK_N tokens through the block table, folding each
tile into a running softmax (`attend_keys` in `triton_common`).

Split-KV (vLLM's "v2" paged attention splits the KV sequence, not K): at small batch, one program per
(sequence, kv head) leaves most of a GPU idle (batch 1 with 8 kv heads is 8 programs on 132 SMs) while each
walks thousands of tokens. So the context is cut into `num_splits` contiguous ranges, one program each, and
every program writes a partial result: its normalized output and the log of its softmax denominator (log-sum-
exp, `lse`). A second small kernel (launched only when there are splits; with one, the decode kernel writes
the output itself) merges the splits of each (sequence, head): with M = max lse, weights w_s = exp(lse_s - M),
out = sum_s w_s * out_s / sum_s w_s, which is exactly the softmax over the whole context. A split whose range
is empty (a short context among long ones) has lse = -inf and weight 0. A context of 0 (the padding rows of a
CUDA-graph batch) reads nothing and gives 0.

`choose_num_splits` picks the count on the host from the batch shape alone (no GPU sync): enough programs to
cover the GPU twice over, at least SPLIT_MIN_TOKENS tokens per split. Without a GPU (the interpreter) it is 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoengine.kernels.triton_common import LOG2E, attend_keys, dot_in_fp32, pow2

BLOCK_N = 64  # tokens per tile
SPLIT_MIN_TOKENS = 256  # a split shorter than this costs more to merge than it saves
MAX_SPLITS = 16


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per (sequence, kv head): 1 unless the batch's programs would leave the GPU's SMs idle."""
    if device.type != "cuda":
        return 1
    programs = batch * num_kv_heads
    want = -(-2 * torch.cuda.get_device_properties(device).multi_processor_count // programs)
    return max(1, min(want, -(-max_context // SPLIT_MIN_TOKENS), MAX_SPLITS))


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                        out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
                        stride_qb, stride_qh,  # q [B, num_heads, head_dim]
                        stride_ob, stride_oh,  # out, the same shape
                        stride_head, stride_block, stride_slot,  # caches [kvh, blocks, block_size, head_dim]
                        stride_table,  # block tables [B, max_blocks]
                        stride_pb, stride_ph, stride_ps,  # partial out [B, num_heads, splits, head_dim]
                        stride_lb, stride_lh,  # partial lse [B, num_heads, splits]
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_FP32: tl.constexpr, SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    context = tl.load(context_lens_ptr + seq)  # tokens in the cache, the new one included
    # this split's tokens [lo, hi): whole tiles, the same number for every split
    tiles_per_split = ((context + BLOCK_N - 1) // BLOCK_N + num_splits - 1) // num_splits
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(context, lo + tiles_per_split * BLOCK_N)

    g = tl.arange(0, BLOCK_G)  # query heads of this kv head's group (rows; padded for tl.dot)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g  # [BLOCK_G] query head ids
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0, tl.float32)
    q_pos = context - 1 + tl.full([BLOCK_G], 0, tl.int64)  # the new token's position: it sees every key
    table = block_tables_ptr + seq * stride_table
    m_i, l_i, acc = attend_keys(q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table,
                                kv_head * stride_head, lo, hi, d, d_mask, stride_block, stride_slot, qk_scale,
                                BLOCK_SIZE, BLOCK_N, DOT_FP32)

    # l_i == 0: nothing was read (an empty split, or a CUDA-graph padding row of context 0): output 0, not 0/0
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if not SPLIT:  # one program saw the whole context: the result is final
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        return
    # partial result: the normalized output, and log-sum-exp in log2 units (-inf for an empty split)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    rows = seq * stride_pb + heads * stride_ph + split * stride_ps  # [BLOCK_G]
    tl.store(part_out_ptr + rows[:, None] + d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + s, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S]
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty (a context of 0): no -inf - -inf
    w = tl.exp2(lse - top)  # [BLOCK_S] weights; 0 for empty or padded splits
    parts = tl.load(part_out_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(parts * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)  # [BLOCK_D]; 0 for a context of 0
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention: q [B, num_heads, head_dim] over each sequence's first context_lens[b] cached tokens.

    k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim] (a view of any layout); block_tables
    [B, max_blocks] int64, padded with any block id; num_splits: None = `choose_num_splits`. Writes into
    `out` ([B, num_heads, head_dim], e.g. rows of a larger batch) when given; returns it.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    assert q.stride(-1) == out.stride(-1) == k_cache.stride(-1) == 1, "head_dim must be contiguous"
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device)
    group = num_heads // num_kv_heads
    block_d = pow2(head_dim, 16)
    # partial results of every split (unused with one split: the kernel then writes `out` itself)
    part_out = torch.empty(batch, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=pow2(group, 16), BLOCK_D=block_d, BLOCK_N=BLOCK_N, DOT_FP32=dot_in_fp32(q.dtype),
        SPLIT=num_splits > 1)
    if num_splits == 1:
        return out
    merge_splits_kernel[(batch, num_heads)](
        part_out, part_lse, out, num_splits, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_S=pow2(num_splits))
    return out
