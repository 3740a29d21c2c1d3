"""The CPU attention backend: the torch backend with decode attention done by a small C++ kernel that reads
K/V in place from the blocks. Chapter 06.

Why: the torch backend's decode gathers every sequence's blocks into a padded copy, then runs two batched
matmuls with 3-row queries; on CPU that moves the K/V bytes three times and runs the matmuls far below peak.
The kernel reads each K/V row once, in place, with no padded copy. Prefill, the store and the cache
layout are the torch backend's, so the two backends are interchangeable and tested equal. The kernel is
built and loaded by `nanoengine.kernels.cpu`.
"""

from __future__ import annotations

import torch

from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.attention.torch_backend import TorchAttention, TorchPrep
from nanoengine.kernels import cpu as cpu_kernels


class CPUAttention(TorchAttention):
    """The torch backend with its decode step replaced (a variant of it, as the learner's pieces are)."""
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.kernels = cpu_kernels.load()

    @classmethod
    def prepare(cls, meta: AttentionMetadata, kv_cache_shape: tuple[int, ...]) -> TorchPrep:
        """Only the store rows: the kernel reads the block tables itself."""
        return TorchPrep.for_store(meta.slot_mapping, kv_cache_shape)

    def decode(self, q: torch.Tensor, meta: AttentionMetadata, prep: TorchPrep) -> torch.Tensor:
        # q [B, num_heads, head_dim] -> [B, num_heads, head_dim]
        return self.kernels.paged_decode(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                         meta.decode_context_lens, self.scale)
