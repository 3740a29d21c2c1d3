"""Attention over the paged KV cache. Chapter 03.

A backend is a per-layer module with one interface:
- `kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)`: its per-layer cache layout;
- `plan(meta, kv_cache_shape)`, a classmethod the model runner calls once per step, before the forward: what
  every layer of the step reads (index tensors, masks), returned as an `AttentionPlan` in `meta.plan`;
- `forward(q, k, v, meta)`: store the new tokens' K/V into the cache (at `slot_mapping`) and attend the new
  queries over each sequence's cached prefix plus themselves.
Backends: `torch` (the reference, any device), `cpu` (the C++ decode kernel), `triton` (Triton kernels: CUDA,
or the interpreter on CPU) and `flash_attn` (CUDA). Faster backends keep the torch backend's interface and are
tested equal to it; each is imported only when asked for, so triton and flash-attn stay optional. A layer's
output depends only on its arguments and its cache, which a CUDA graph needs.
"""

from nanoengine.attention.metadata import AttentionMetadata, AttentionPlan
from nanoengine.attention.torch_backend import TorchAttention

__all__ = ["AttentionMetadata", "AttentionPlan", "TorchAttention", "get_backend"]


def get_backend(name: str | type[TorchAttention]) -> type[TorchAttention]:
    """The backend class of a name; a backend class is its own answer (the learner's pieces, chapter 03)."""
    if isinstance(name, type):
        return name
    if name == "torch":
        return TorchAttention
    if name == "cpu":
        from nanoengine.attention.cpu_backend import CPUAttention

        return CPUAttention
    if name == "triton":
        from nanoengine.attention.triton_backend import TritonAttention

        return TritonAttention
    if name == "flash_attn":
        from nanoengine.attention.flash_attn_backend import FlashAttnAttention

        return FlashAttnAttention
    raise ValueError(f"attention backend {name!r} does not exist; use 'torch', 'cpu', 'triton' or 'flash_attn'")
