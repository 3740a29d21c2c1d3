"""The key loop that the paged decode and prefill kernels share, as one Triton device function. Chapter 06.

`attend_keys` walks one sequence's keys for one kv head, BLOCK_N positions at a time:
1. K and V rows through the block table: position p sits in physical block table[p // BLOCK_SIZE], slot
   p % BLOCK_SIZE. Each token's row is looked up on its own, so a tile may span several small blocks or be
   a part of one large block: any block size works with any tile size.
2. scores of the query rows against the tile, with the causal mask: query row r sees positions <= q_pos[r]
   (a decode row's q_pos is its last position, so it sees every key; a prefill chunk's rows are shifted by
   the cached prefix).
3. FlashAttention's online softmax: keeping, for every query row, the largest score seen so far (m), the sum
   of exp(score - m) (l) and the exp-weighted sum of V rows (acc), one tile at a time, gives exactly
   softmax(scores) @ V at the end (acc / l) without ever holding all the scores. When a tile raises a row's
   maximum, the old l and acc are rescaled by exp(m_old - m_new).
It is one function, not three, because the interpreter pays milliseconds per call of a device function
(each call re-patches triton.language; tl.zeros, tl.cdiv, tl.max and tl.sum are such functions too, so the
kernels write tl.full(shape, 0) and integer ceilings), and the loop body runs for every tile of every program.

Scores are kept in log2 units (scale * log2(e) folded into one multiplier) so the exponentials are exp2,
the fast instruction on a GPU. All softmax arithmetic is float32.

DOT_FP32 upcasts K and V (and the caller upcasts Q) to float32 before the matrix products. The launchers
set it for float32 inputs and always under the interpreter, where bf16 arithmetic and bf16 `tl.dot` are
wrong (triton 3.8); on a GPU, bf16 inputs go to the tensor cores as bf16 with a float32 accumulator.
`input_precision="ieee"` keeps float32 products exact float32 (a GPU would otherwise use TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoengine.kernels.triton_support import fix_old_interpreter, is_interpreted

fix_old_interpreter()  # Triton 3.6's interpreter under NumPy >= 2.4

LOG2E = 1.4426950408889634  # softmax scale * LOG2E turns exp(x) into exp2(x)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """The DOT_FP32 flag for inputs of this dtype (see the module docstring)."""
    return dtype == torch.float32 or INTERPRETED


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least): tile sizes must be powers of two."""
    return max(triton.next_power_of_2(n), least)


@triton.jit
def attend_keys(q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_ptr, head_offset, lo, hi, d, d_mask,
                stride_block, stride_slot, qk_scale,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    """Fold keys lo..hi-1 of one sequence and kv head into the running softmax (m_i, l_i [M]; acc [M, BLOCK_D]
    float32) of the query rows q [M, BLOCK_D], row r seeing positions <= q_pos[r] [M]; returns the new
    (m_i, l_i, acc). Every row must see at least one key in the first tile (then m_i is finite)."""
    for start in range(lo, hi, BLOCK_N):
        # 1. the tile's K and V rows, through the block table
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        valid = pos < hi
        # [BLOCK_N] physical block of each
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
        # [BLOCK_N] int64 offsets
        rows = head_offset + block * stride_block + (pos % BLOCK_SIZE) * stride_slot
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # 2. scores, masked causally: log2 units
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, BLOCK_N]
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # 3. the online softmax: rescale what was summed under the old maximum, add this tile
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
        alpha = tl.exp2(m_i - m_new)  # [M]
        p = tl.exp2(s - m_new[:, None])  # [M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")  # [M, BLOCK_D]
        m_i = m_new
    return m_i, l_i, acc


INTERPRETED = is_interpreted(attend_keys)  # decided when the kernels were defined (TRITON_INTERPRET=1)
