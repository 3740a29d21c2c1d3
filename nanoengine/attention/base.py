"""The interface every attention backend implements. Chapter 03.

A backend is one module per decoder layer, built with the layer's head counts and scale, and bound to its
slice of the paged KV cache by the model runner (`bind_kv_cache`). The runner asks the class two things
before any step: the per-layer cache layout it wants (`kv_cache_shape`) and whether its `prepare` and
`forward` can be recorded in a CUDA graph (`cuda_graphs`: no host sync and no host read of device data in
either, which is what a graph capture needs). Each step, the runner calls `prepare(meta, kv_cache_shape)`
once, before the forward, and puts what it returns (the step's `AttentionPrep`) into `meta.prepared`; then
every layer's `forward(q, k, v, meta)` stores the new tokens' K/V at their slots (slot -1: skip) and attends
the new queries over each sequence's cached prefix plus themselves. A layer's output depends only on its
arguments and its cache, which a graph replay needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from nanoengine.attention.metadata import AttentionMetadata, AttentionPrep


class AttentionBackend(nn.Module, ABC):
    name: ClassVar[str]  # the registry's name for it (EngineConfig.attention_backend)
    cuda_graphs: ClassVar[bool]  # can its prepare and forward be captured in a CUDA graph?

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])  # bound by the model runner; empty: no cache yet

    @staticmethod
    @abstractmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """One layer's K (or V) cache layout for this many blocks."""

    @classmethod
    @abstractmethod
    def prepare(cls, meta: AttentionMetadata, kv_cache_shape: tuple[int, ...]) -> AttentionPrep:
        """What every layer of one step reads (index tensors, masks, lengths in the kernels' types)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Store k, v [num_tokens, num_kv_heads, head_dim] and attend q [num_tokens, num_heads, head_dim];
        returns [num_tokens, num_heads, head_dim]. With no cache bound (a warm-up forward, a test), prompts
        attend over their own new tokens only."""

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
