"""The flash-attn backend: FlashAttention-2's paged kernels on CUDA, with the Triton store kernel. Chapter 03
(the interface), chapter 06 (why it is fast).

- cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], the one flash-attn's paged KV
  cache reads (each block is block_size tokens of all kv heads); flash-attn's paged path needs block_size
  to be a multiple of 256 (the config enforces it and picks 256);
- store: `kernels/triton_store.py`, through a [num_kv_heads, num_blocks, block_size, head_dim] view of the
  cache (a permute, no copy), so slot -1 (padding, prefix-cache hit) is skipped as in every backend;
- prefill: `flash_attn_varlen_func` with `block_table`: the queries are the chunks' new tokens, the keys every
  sequence's cached tokens (new ones already stored), cu_seqlens_k their context lengths; with fewer queries
  than keys, causal=True aligns the mask to the bottom right, which is the mask shifted by the cached prefix;
- decode: `flash_attn_with_kvcache` with q [B, 1, num_heads, head_dim], cache_seqlens = context lengths
  (the new token included, already stored) and the padded block tables.
flash-attn wants int32 lengths and tables: `prepare` converts them once per step. A sequence with no new
tokens never reaches attention here: the scheduler always recomputes a fully cached prompt's last token
(nano-vllm crashed on such a prompt of an exact multiple of the block size, sending flash-attn a zero-length
chunk).

`problem()` says whether flash-attn imports here, without the caller importing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, partial

import torch

from nanoengine.attention.base import AttentionBackend
from nanoengine.attention.metadata import AttentionMetadata, AttentionPrep
from nanoengine.attention.torch_backend import prompts_without_cache, self_attention


@cache
def problem() -> str | None:
    """None when flash_attn imports here (it needs CUDA), else why not."""
    try:
        import flash_attn  # noqa: F401
    except Exception as e:  # ImportError, or a build for another torch/CUDA (undefined symbol: OSError)
        return f"flash_attn does not import here ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]})"
    return None


@dataclass
class FlashAttnPrep(AttentionPrep):
    """What every layer of one step reuses: flash-attn's int32 lengths and tables."""
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32
    max_seqlen_q: int  # 0: no prefill in this step (then the tensors below are None)
    max_seqlen_k: int
    cu_seqlens_q: torch.Tensor | None = None  # [num_prefills + 1] int32: chunk starts in the prefill rows
    cu_seqlens_k: torch.Tensor | None = None  # [num_prefills + 1] int32: context starts, as if packed
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int32


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_blocks, block_size, num_kv_heads, head_dim)


def heads_first(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kvh, head_dim] seen as [kvh, num_blocks, block_size, head_dim] (no copy)."""
    return cache.permute(2, 0, 1, 3)


class FlashAttnAttention(AttentionBackend):
    name = "flash_attn"
    cuda_graphs = True  # prepare converts device tensors on the device; the prefill's cumulative lengths come
    # from host lists, but a graph only records decode steps
    kv_cache_shape = staticmethod(kv_cache_shape)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from nanoengine.kernels.triton_store import store_kv

        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache
        self.store_kv = store_kv

    @classmethod
    def prepare(cls, meta: AttentionMetadata, kv_cache_shape: tuple[int, ...]) -> FlashAttnPrep:
        from nanoengine.attention.triton_backend import padded_tables

        device = meta.slot_mapping.device

        def cumulative(lens: list[int]) -> torch.Tensor:
            return torch.tensor([0, *lens], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)

        nd = meta.num_decode_seqs
        p = FlashAttnPrep(meta.decode_block_tables.int() if nd else None,
                          meta.decode_context_lens.int() if nd else None,
                          max(meta.prefill_query_lens, default=0), max(meta.prefill_context_lens, default=0))
        if p.max_seqlen_q:
            p.cu_seqlens_q = cumulative(meta.prefill_query_lens)
            p.cu_seqlens_k = cumulative(meta.prefill_context_lens)
            p.prefill_block_tables = padded_tables(meta.prefill_block_tables, device).int()
        return p

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]
        if not self.k_cache.numel():  # no cache (profiling / tests): prompts over their own tokens
            return prompts_without_cache(q, k, v, meta, partial(self_attention, scale=self.scale))
        p = meta.prepared
        if not isinstance(p, FlashAttnPrep):  # metadata built by hand: prepare here
            p = self.prepare(meta, self.k_cache.shape)
        self.store_kv(k, v, heads_first(self.k_cache), heads_first(self.v_cache), meta.slot_mapping)
        nd = meta.num_decode_seqs
        out = torch.empty_like(q)
        if nd:
            dec = self.with_kvcache(q[:nd].unsqueeze(1), self.k_cache, self.v_cache,  # q [B, 1, heads, d]
                                    cache_seqlens=p.decode_context_lens, block_table=p.decode_block_tables,
                                    softmax_scale=self.scale, causal=True)
            if nd == q.shape[0]:
                return dec.squeeze(1)
            out[:nd] = dec.squeeze(1)
        if p.max_seqlen_q:
            out[nd:] = self.varlen(q[nd:], self.k_cache, self.v_cache, p.cu_seqlens_q, p.cu_seqlens_k,
                                   p.max_seqlen_q, p.max_seqlen_k, softmax_scale=self.scale, causal=True,
                                   block_table=p.prefill_block_tables)
        return out
