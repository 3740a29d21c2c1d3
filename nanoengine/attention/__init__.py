"""Attention over the paged KV cache: backends behind one declared interface. Chapter 03.

`AttentionBackend` (base.py) is the interface: `kv_cache_shape`, a classmethod `prepare(meta,
kv_cache_shape)` the model runner calls once per step (what every layer then reads: an `AttentionPrep`),
`forward(q, k, v, meta)` = store the new K/V, then attend, and `cuda_graphs`, whether prepare and forward can
be captured in a CUDA graph. `BACKENDS` maps names to classes:
- `torch`: the reference, plain PyTorch on any device;
- `cpu`: the torch backend with decode attention in a C++ kernel that reads K/V in place;
- `triton`: Triton kernels (CUDA, or the interpreter on CPU);
- `flash_attn`: FlashAttention-2's paged kernels (CUDA), in its own cache layout.
Every backend is tested equal to the torch one. triton and flash_attn are imported only when a backend is
built, so both stay optional.
"""

from nanoengine.attention.base import AttentionBackend
from nanoengine.attention.cpu_backend import CPUAttention
from nanoengine.attention.flash_attn_backend import FlashAttnAttention
from nanoengine.attention.metadata import AttentionMetadata, AttentionPrep
from nanoengine.attention.torch_backend import TorchAttention
from nanoengine.attention.triton_backend import TritonAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionPrep", "BACKENDS", "TorchAttention",
           "get_backend"]

BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (TorchAttention, CPUAttention, TritonAttention, FlashAttnAttention)}


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} does not exist; use one of {', '.join(BACKENDS)}")
    return BACKENDS[name]
