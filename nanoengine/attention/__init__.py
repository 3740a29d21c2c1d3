"""Attention over the paged KV cache. Chapter 03.

A backend stores the new tokens' K/V into the cache (at `slot_mapping`) and computes attention of the new
queries over each sequence's cached prefix plus themselves. `torch_backend` runs on any device and is the
reference; faster backends keep its interface and are tested equal to it.
"""

from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.attention.torch_backend import TorchAttention

__all__ = ["AttentionMetadata", "TorchAttention", "get_backend"]


def get_backend(name: str):
    if name == "torch":
        return TorchAttention
    if name == "cpu":
        from nanoengine.attention.cpu_backend import CPUAttention

        return CPUAttention
    raise ValueError(f"attention backend {name!r} is not available here; use attention_backend='torch' or 'cpu'")
