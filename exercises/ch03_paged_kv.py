# Your exercises for book/03a_paged_blocks.ipynb, 03b_paged_attention.ipynb, 03c_online_softmax.ipynb, 03d_triton_kernel.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch03")`, from nanoengine.check) or: pytest tests/exercises/test_ch03_paged_kv.py
# Generated from solutions/ch03_paged_kv.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
"""Chapter 03, book/03a_paged_blocks.ipynb .. 03d_triton_kernel.ipynb: the paged KV cache.

Exercise 3.1: the slot mapping of a batch: where each new token's K/V goes in the cache.
Exercise 3.2: the attention metadata of a batch: decode block tables and context lengths, prefill chunks.
Exercise 3.3: the store step: write new K/V into their slots.
Exercise 3.4: paged decode attention by gathering each sequence's blocks.
Exercise 3.5: paged prefill attention over a cached prefix.
Exercise 3.6: paged decode attention read in place, one block at a time, with an online softmax (torch).
Exercise 3.7: a first Triton kernel: the softmax of each row of a matrix, one masked tile per row.
Exercise 3.8: paged decode attention as a Triton kernel, which the engine decodes with.
(`triton_row_softmax` and `triton_paged_decode`, given, launch them.)

A batch is a list of nanoengine ScheduledSeq (seq, num_new_tokens, is_prefill, start): sequence `seq`
computes positions start .. start + num_new_tokens - 1 this step. `start` is where the step begins.
`Scheduler.schedule()` commits a step before its forward pass: by the time the batch is laid out,
seq.num_computed_tokens already counts the step's new tokens, so read `start`, not num_computed_tokens.
seq.block_table lists its blocks. The tests of 3.1 and 3.2 use what this chapter teaches: decodes and whole
prompts (start 0). Chapter 04 adds prefix hits (the first seq.num_cached_tokens tokens sit in blocks the
prefix cache shares) and chapter 05 chunked prompts (a chunk starts after its earlier chunks); the rules
below already cover both, and the chapter's capstone runs them.

Cache layout per layer in these exercises: k_cache, v_cache [num_blocks, block_size, KVH, D]. Slot
s = block_id * block_size + offset is row s of the cache viewed as [num_blocks * block_size, KVH, D].
(nanoengine's torch backend stores heads first, [KVH, num_blocks, block_size, D], so that one head's blocks
are whole contiguous rows; the tests convert between the two.)

Exercises 3.7 and 3.8 need triton (the dev extra; Linux). Without it (macOS, Windows) this file still imports,
and the engine decodes with your 3.6 instead. Without CUDA, Triton runs kernels only in its interpreter, which
it chooses when a kernel is *defined*: so this file switches TRITON_INTERPRET=1 on, before the kernels below
are defined, when there is no GPU (unless you set the variable yourself).
"""

from __future__ import annotations

import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: Triton's interpreter runs the kernel in numpy
try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: only Exercises 3.7 and 3.8 need it
    triton = tl = None

from nanoengine.attention import AttentionMetadata  # the attention backends' input, see its fields


def batch_slot_mapping(scheduled: list[Any], block_size: int) -> list[int]:
    """Exercise 3.1: the cache slot of every new token of a batch, in the flat batch's row order.

    Rows: first every sequence with one new token (the decodes, and a one-token prompt), then every sequence
    with more (the prompts), each group in the batch's order; within a sequence, its positions in order from
    s.start. Position p of a sequence goes to slot block_table[p // block_size] * block_size + p % block_size.
    One more rule, for chapter 04's prefix hits: -1 when p < seq.num_cached_tokens (a shared prefix-cache
    block already holds its K/V: do not write it).
    """
    raise NotImplementedError("Exercise 3.1: the cache slot of every new token of a batch, in the flat batch's row order - see book/03a_paged_blocks.ipynb")


def attention_metadata(scheduled: list[Any], block_size: int) -> AttentionMetadata:
    """Exercise 3.2: the AttentionMetadata of a batch, as nanoengine's InputBuilder lays it out.

    slot_mapping: your Exercise 3.1, as an int64 tensor. The decodes (one new token; the first rows):
    num_decode_seqs; decode_block_tables [num_decodes, max_blocks] int64, each row the sequence's block table
    padded to the longest one (the padding is never read: any block id does; nanoengine uses 0);
    decode_context_lens [num_decodes] int64, the tokens each attends over, the new one included (None and
    None when there are no decodes). The prompts (prefill chunks: chapter 05 splits a long prompt over steps),
    as lists in row order: prefill_query_starts (the chunk's first row in the flat batch), prefill_query_lens
    (its new tokens), prefill_context_lens (the tokens before the chunk + its new ones: s.start +
    num_new_tokens), prefill_block_tables (an int64 tensor each).
    """
    raise NotImplementedError("Exercise 3.2: the AttentionMetadata of a batch, as nanoengine's InputBuilder lays it out - see book/03a_paged_blocks.ipynb")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Exercise 3.3: write token i's key and value into cache slot slots[i], in place.

    k, v [T, KVH, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; slots [T] int64, where -1 means
    "do not write" (a prefix-cache block already holds the token's K/V, or the row is padding). Nothing else
    in the cache may change.
    """
    raise NotImplementedError("Exercise 3.3: write token i's key and value into cache slot slots[i], in place - see book/03a_paged_blocks.ipynb")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Exercise 3.4: attention of one new query token per sequence over that sequence's cached tokens.

    q [B, H, D]; block_tables [B, max_blocks] int64 (rows padded with junk block ids past each sequence's
    blocks); context_lens [B]: sequence b has context_lens[b] cached tokens, its own new token included.
    Gather each sequence's K/V from its blocks, then softmax(q.k * scale) over those tokens (float32) and
    weight the values; query head h uses kv head h // (H // KVH). Returns [B, H, D] in q's dtype.
    """
    raise NotImplementedError("Exercise 3.4: attention of one new query token per sequence over that sequence's cached tokens - see book/03b_paged_attention.ipynb")


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """Exercise 3.5: causal attention of a prefill chunk over its sequence's cached prefix and itself.

    q [q_len, H, D]: the queries of positions context_len - q_len .. context_len - 1 of one sequence, whose
    K/V (the prefix's and the chunk's own) are already stored in the cache; block_table [num_blocks] int64.
    Query i may see positions 0 .. context_len - q_len + i. Scores in float32, query head h uses kv head
    h // (H // KVH). Returns [q_len, H, D] in q's dtype.
    """
    raise NotImplementedError("Exercise 3.5: causal attention of a prefill chunk over its sequence's cached prefix and itself - see book/03b_paged_attention.ipynb")


def online_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Exercise 3.6: paged decode attention read in place, one KV block per tile, with an online softmax.

    Same arguments and result as Exercise 3.4, but never gather a sequence's K/V into one tensor: walk its
    block table, and for each block read k_cache[block] [block_size, KVH, D] where it lies (its first
    context_lens[b] - j * block_size slots, for the j-th block), fold its scores into a running max m, a
    running sum l and a running weighted sum of values acc (float32), rescaling l and acc by exp(m_old -
    m_new) whenever the max grows; the output is acc / l. Block table entries past a sequence's blocks may be
    -1 (never read them); a sequence with context_lens[b] == 0 (a padding row) gives zeros. Query head h uses
    kv head h // (H // KVH). Returns [B, H, D] in q's dtype.
    """
    raise NotImplementedError("Exercise 3.6: paged decode attention read in place, one KV block per tile, with an online softmax - see book/03c_online_softmax.ipynb")


def jit(fn):
    """triton.jit; without triton, a stand-in that says so when it is called (so this file still imports,
    and the engine, which then decodes with your 3.6, does not wait for a kernel it cannot run)."""
    if triton is not None:
        return triton.jit(fn)

    def needs_triton(*args, **kwargs):
        raise RuntimeError(f"{fn.__name__} needs triton: pip install -c constraints.txt triton (Linux)")
    return needs_triton


@jit
def masked_row_softmax_kernel(x_ptr, out_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
    """Exercise 3.7: the softmax of each row of a [rows, n_cols] float32 matrix, one program per row.

    Program r = tl.program_id(0) reads row r as one tile of BLOCK >= n_cols lanes (element (r, c) is at
    x_ptr + r * stride_row + c), computes exp(x - max) / sum(exp(x - max)) over the row's n_cols values, and
    writes it to out_ptr at the same offsets. Lanes c >= n_cols are padding: mask them in the load and the
    store, and keep them out of the max and the sum.
    """
    raise NotImplementedError("Exercise 3.7: the softmax of each row of a [rows, n_cols] float32 matrix, one program per row - see book/03c_online_softmax.ipynb")


def triton_row_softmax(x: torch.Tensor) -> torch.Tensor:
    """Launches your Exercise 3.7 kernel (given): the softmax of each row of x [rows, n_cols] float32."""
    if triton is None:
        raise RuntimeError("Exercise 3.7 needs triton: pip install -c constraints.txt triton (Linux)")
    x = x.contiguous()
    out = torch.empty_like(x)  # [rows, n_cols]
    masked_row_softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0),
                                             BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


@jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, scale,
                        stride_qb, stride_qh,  # q and out [B, H, D] (head_dim contiguous)
                        stride_block, stride_slot, stride_head,  # caches [num_blocks, block_size, KVH, D]
                        stride_table,  # block_tables [B, max_blocks]
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exercise 3.8: paged decode attention as a Triton kernel, one program per (sequence, kv head).

    Program (b, kvh) = (tl.program_id(0), tl.program_id(1)) computes the output rows of query heads
    kvh * GROUP .. kvh * GROUP + GROUP - 1 of sequence b, which all read kv head kvh: Exercise 3.6's loop
    over the sequence's blocks, each K/V row loaded once for the whole group. Tiles are padded to powers
    of two: BLOCK_G >= GROUP query heads, BLOCK_D >= HEAD_DIM, BLOCK_N >= BLOCK_SIZE slots; mask the padding
    in every load and store. Element (block, slot, kvh, d) of a cache is at k_cache_ptr + block *
    stride_block + slot * stride_slot + kvh * stride_head + d; element (b, h, d) of q or out at q_ptr +
    b * stride_qb + h * stride_qh + d. Write the output in out's dtype; a context of 0 writes zeros.
    """
    raise NotImplementedError("Exercise 3.8: paged decode attention as a Triton kernel, one program per (sequence, kv head) - see book/03d_triton_kernel.ipynb")


def triton_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Launches your Exercise 3.8 kernel (given): Exercise 3.6's arguments and result, one program per
    (sequence, kv head). The engine decodes with it under use_exercises=["ch03"] (with your 3.6 without
    triton)."""
    if triton is None:
        raise RuntimeError("Exercise 3.8 needs triton: pip install -c constraints.txt triton (Linux)")
    B, H, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)  # [B, H, D], q's strides
    if B == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "caches must share a layout"
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    group = H // kv_heads
    paged_decode_kernel[(B, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_D=triton.next_power_of_2(D), BLOCK_N=triton.next_power_of_2(block_size))
    return out
