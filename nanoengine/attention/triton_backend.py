"""The Triton attention backend: store, decode and prefill as Triton kernels over the paged cache. Chapter 03
(the interface), chapter 06 (the kernels, `nanoengine/kernels/triton_*.py`).

Same cache layout as the torch backend ([num_kv_heads, num_blocks, block_size, head_dim]), so the two are
interchangeable and tested equal. One step:
- `prepare` (once per step, for every layer): the prefill chunks' starts, lengths, contexts and one padded
  [num_prefills, max_blocks] block table as device tensors, and the decode split count;
- `forward` (per layer): store the new K/V at their slots (slot -1 skipped), then decode attention for the
  decode rows and paged prefill attention for the prefill rows, each writing its rows of one output.
Every key, cached or new, is read from the cache, so a chunk after a prefix hit or an earlier chunk needs no
special case.

On CUDA the kernels are compiled; on CPU they run in Triton's interpreter, which needs TRITON_INTERPRET=1
set before the kernels are imported (the config checks it; so does the constructor, in case the kernels
were first imported without it). triton itself is imported only when this backend is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from nanoengine.attention.base import AttentionBackend
from nanoengine.attention.metadata import AttentionMetadata, AttentionPrep
from nanoengine.attention.torch_backend import kv_cache_shape, prompts_without_cache, self_attention


@dataclass
class TritonPrep(AttentionPrep):
    """What every layer of one step reuses."""
    decode_num_splits: int  # split-KV programs per (decode sequence, kv head)
    prefill_max_query_len: int  # 0: no prefill in this step (then the tensors below are None)
    # [num_prefills] int64: each chunk's first row in the batch
    prefill_query_starts: torch.Tensor | None = None
    prefill_query_lens: torch.Tensor | None = None  # [num_prefills] int64
    prefill_context_lens: torch.Tensor | None = None  # [num_prefills] int64: cached prefix + new tokens
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int64, padded with block 0


def padded_tables(tables: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One [len(tables), longest] int64 tensor from ragged block tables (at least one), padded with 0."""
    return torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(device)


class TritonAttention(AttentionBackend):
    name = "triton"
    cuda_graphs = True  # prepare reads only shapes and host lists; the kernels take device tensors
    kv_cache_shape = staticmethod(kv_cache_shape)  # the torch backend's layout

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        from nanoengine.kernels import triton_decode, triton_prefill, triton_store, triton_support

        self.store_kv = triton_store.store_kv
        self.paged_decode = triton_decode.paged_decode
        self.paged_prefill = triton_prefill.paged_prefill
        self.interpreted = triton_support.is_interpreted(triton_store.store_kv_kernel)
        if not torch.cuda.is_available() and not self.interpreted:
            raise RuntimeError("TritonAttention: no CUDA here, and nanoengine's Triton kernels were imported "
                               "before TRITON_INTERPRET=1 was set, so they cannot run in the interpreter "
                               "either; set TRITON_INTERPRET=1 before anything imports nanoengine.kernels")

    @classmethod
    def prepare(cls, meta: AttentionMetadata, kv_cache_shape: tuple[int, ...]) -> TritonPrep:
        from nanoengine.kernels.triton_decode import choose_num_splits

        device = meta.slot_mapping.device
        num_kv_heads, _, block_size, _ = kv_cache_shape
        splits = 1
        if meta.num_decode_seqs:
            max_context = meta.decode_block_tables.shape[1] * block_size  # an upper bound, known on the host
            splits = choose_num_splits(meta.num_decode_seqs, num_kv_heads, max_context, device)

        if not meta.prefill_query_lens:  # a pure decode step (most steps): nothing to copy to the device
            return TritonPrep(splits, 0)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return TritonPrep(splits, max(meta.prefill_query_lens), ints(meta.prefill_query_starts),
                          ints(meta.prefill_query_lens), ints(meta.prefill_context_lens),
                          padded_tables(meta.prefill_block_tables, device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]
        if not self.k_cache.numel():  # no cache (profiling / tests): prompts over their own tokens
            return prompts_without_cache(q, k, v, meta, partial(self_attention, scale=self.scale))
        p = meta.prepared if isinstance(meta.prepared, TritonPrep) else self.prepare(meta, self.k_cache.shape)
        self.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        nd = meta.num_decode_seqs
        if nd:
            self.paged_decode(q[:nd], self.k_cache, self.v_cache, meta.decode_block_tables,
                              meta.decode_context_lens, self.scale, p.decode_num_splits, out=out[:nd])
        if p.prefill_max_query_len:
            self.paged_prefill(q, self.k_cache, self.v_cache, out, p.prefill_block_tables,
                               p.prefill_query_starts, p.prefill_query_lens, p.prefill_context_lens,
                               p.prefill_max_query_len, self.scale)
        return out
