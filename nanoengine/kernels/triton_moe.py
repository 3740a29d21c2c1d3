"""Triton kernels: the fused mixture-of-experts forward, as vLLM's fused_moe does it. Chapter 10.

`triton_fused_experts(x, weights, ids, w13, w2)` computes what `layers.moe.grouped_experts` does,
sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), in three steps:

1. Align (`align_by_expert`, torch ops on the device): the T * k (token, expert) pairs are numbered
   p = t * k + j and sorted by expert; each expert's run of pairs is padded up to a multiple of BLOCK_M with
   the pad id T * k, so every block of BLOCK_M sorted slots belongs to one expert (`block_expert`). Nothing is
   read back to the host: the buffers are sized for the worst case (every expert padded by BLOCK_M - 1), and
   the programs past the real end (`num_padded`, on the device) return at once. So the forward has the same
   shapes for every routing, as a CUDA graph needs.
2. `w13_silu_kernel`, a grouped GEMM: the program for (block, tile of BLOCK_N intermediate columns) gathers
   its block's token rows of x, multiplies them by its expert's gate rows and up rows of w13 (two float32
   accumulators, along the hidden size in BLOCK_K steps), and writes silu(gate) * up into h [T * k, I], at
   each pair's own row.
3. `w2_weighted_kernel`, the second grouped GEMM: h's rows of the block times the expert's w2, scaled by the
   pair's routing weight, into y [T * k, H]; then y.view(T, k, H).sum(1) adds each token's k experts.

An expert no token chose has no block, so its weights are never read; a block is one expert's weight tiles
read once for up to BLOCK_M tokens (at decode, most blocks hold one or two rows: the step is bound by reading
the chosen experts' weights, as the roofline says). Pad slots load x rows as 0 and store nothing.

Precision as the attention kernels (`triton_common`): float32 inputs (and everything under the interpreter)
multiply in float32 (`input_precision="ieee"`: no TF32); bf16 on a GPU goes to the tensor cores with float32
accumulators. The interpreter runs this on CPU for the tests (slow: tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoengine.kernels.triton_common import dot_in_fp32, pow2

BLOCK_M = 16  # sorted (token, expert) slots per block: tl.dot's smallest tile on a GPU
BLOCK_N = 64  # output columns per program
BLOCK_K = 64  # reduction step


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pair_ids [S], block_expert [S // block_m], num_padded [1]), all on ids' device, no sync.

    pair_ids lists the pairs p = t * k + j sorted by expert (token order within one), each expert's run padded
    to a multiple of block_m with the pad id T * k; S = the worst case, T * k + E * (block_m - 1), rounded up
    to a whole block. block_expert[b] is the expert of block b; num_padded the slots in use (the rest is pad).
    """
    flat = ids.flatten()  # [P] expert of each pair, P = T * k
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] pairs per expert (bincount would sync)
    padded = (counts + block_m - 1) // block_m * block_m  # [E] each expert's run, whole blocks
    ends = padded.cumsum(0)  # [E] where each expert's run ends in the sorted slots
    order = flat.argsort(stable=True)  # [P] pair ids grouped by expert
    expert_of = flat[order]  # [P]
    first = counts.cumsum(0) - counts  # [E] index in `order` of each expert's first pair
    rank = torch.arange(num_pairs, device=ids.device) - first[expert_of]  # [P] place within its expert
    slots = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    pair_ids = torch.full((slots,), num_pairs, dtype=torch.int64, device=ids.device)  # [S] pad everywhere
    pair_ids[ends[expert_of] - padded[expert_of] + rank] = order
    block_start = torch.arange(0, slots, block_m, device=ids.device)  # [S // block_m]
    block_expert = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1)
    return pair_ids, block_expert, ends[-1:]


@triton.jit
def w13_silu_kernel(x_ptr, w13_ptr, h_ptr, pair_ids_ptr, block_expert_ptr, num_padded_ptr,
                    num_pairs, hidden, inter,
                    stride_xt,  # x [T, H]
                    stride_we, stride_wn,  # w13 [E, 2I, H]
                    stride_hp,  # h [P, I]
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_FP32: tl.constexpr):
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    if block * BLOCK_M >= tl.load(num_padded_ptr):  # past the last expert's run: nothing to do
        return
    expert = tl.load(block_expert_ptr + block)
    pair = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_mask = pair < num_pairs  # pad slots: no row
    token = pair // TOP_K  # [BLOCK_M] the row of x each pair reads
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] intermediate columns
    n_mask = n < inter
    w_expert = w13_ptr + expert * stride_we

    gate = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    up = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & n_mask[None, :]
        # the expert's gate rows n and up rows inter + n, transposed as loaded: [BLOCK_K, BLOCK_N]
        w_gate = tl.load(w_expert + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_expert + (inter + n)[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        gate += tl.dot(a, w_gate, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        up += tl.dot(a, w_up, input_precision="ieee")
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
    tl.store(h_ptr + pair[:, None] * stride_hp + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def w2_weighted_kernel(h_ptr, w2_ptr, y_ptr, weights_ptr, pair_ids_ptr, block_expert_ptr, num_padded_ptr,
                       num_pairs, hidden, inter,
                       stride_hp,  # h [P, I]
                       stride_we, stride_wn,  # w2 [E, H, I]
                       stride_yp,  # y [P, H]
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_FP32: tl.constexpr):
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + block)
    pair = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_mask = pair < num_pairs
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden columns of the output
    n_mask = n < hidden
    w_expert = w2_ptr + expert * stride_we

    acc = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < inter
        a = tl.load(h_ptr + pair[:, None] * stride_hp + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_expert + n[None, :] * stride_wn + k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision="ieee")
    routing = tl.load(weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)  # [BLOCK_M]
    acc = acc * routing[:, None]
    tl.store(y_ptr + pair[:, None] * stride_yp + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def triton_fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor) -> torch.Tensor:
    """`grouped_experts` as two grouped-GEMM Triton kernels: x [T, H], weights and ids [T, k], w13 [E, 2I, H],
    w2 [E, H, I] -> [T, H] (see the module docstring)."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w2.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    assert x.stride(-1) == w13.stride(-1) == w2.stride(-1) == 1, "the last dimension must be contiguous"
    num_pairs = num_tokens * top_k
    pair_ids, block_expert, num_padded = align_by_expert(ids, num_experts)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [P, I] silu(gate) * up per pair
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [P, H] weighted expert outputs
    flat_weights = weights.reshape(num_pairs)  # [P] pair p = t * k + j
    dot_fp32 = dot_in_fp32(x.dtype)
    # tiles no larger than the sizes need (small test shapes), at least 16 (tl.dot's minimum)
    tile_h, tile_i = min(BLOCK_N, pow2(hidden, 16)), min(BLOCK_N, pow2(inter, 16))
    num_blocks = block_expert.numel()
    w13_silu_kernel[(num_blocks, triton.cdiv(inter, tile_i))](
        x, w13, h, pair_ids, block_expert, num_padded, num_pairs, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_M=BLOCK_M, BLOCK_N=tile_i, BLOCK_K=min(BLOCK_K, tile_h), DOT_FP32=dot_fp32)
    w2_weighted_kernel[(num_blocks, triton.cdiv(hidden, tile_h))](
        h, w2, y, flat_weights, pair_ids, block_expert, num_padded, num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=tile_h, BLOCK_K=min(BLOCK_K, tile_i), DOT_FP32=dot_fp32)
    return y.view(num_tokens, top_k, hidden).sum(1)  # [T, H]
