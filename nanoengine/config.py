"""EngineConfig: every engine option, validated in one place, plus the one place that picks
device, dtype and attention backend. Chapter 00.

Unknown options are an error (with a suggestion), never silently dropped.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "bfloat16", "float32", "float16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
# Block size each attention backend works best with (the torch backend gathers whole blocks).
DEFAULT_BLOCK_SIZE = {"torch": 16, "cpu": 16, "triton": 16, "flash_attn": 256}


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int | None = None
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_kvcache_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    prepack_weights: bool | None = None  # CPU bf16: oneDNN-packed linear weights; None = when supported
    tensor_parallel_size: int = 1
    seed: int = 0
    trace: bool = False
    # filled by resolve(): the model's Hugging Face config
    hf_config: Any = field(default=None, repr=False)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = [f.name for f in dataclasses.fields(cls) if f.name != "hf_config"]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"unknown engine option(s): {', '.join(hints)}. Valid options: {', '.join(names)}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"EngineConfig: {msg}")

        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        check(self.attention_backend in BACKENDS,
              f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        check(self.block_size is None or (isinstance(self.block_size, int) and self.block_size >= 1),
              f"block_size must be a positive integer, got {self.block_size!r}")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        check(self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1,
              "num_kvcache_blocks must be >= 1 (or None to size the cache from memory)")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")

    def resolve(self, hf_config: Any) -> EngineConfig:
        """Fill the 'auto' choices from the machine and the model's config (the one place for them)."""
        import torch

        self.hf_config = hf_config
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("EngineConfig: device='cuda' but CUDA is not available; use device='cpu' or 'auto'")
        if self.dtype == "auto":
            self.dtype = str(model_dtype(hf_config)).removeprefix("torch.")
        if self.device == "cpu" and self.dtype == "float16":
            # fp16 matmuls have no fast path on CPU (~400x slower than bf16 here)
            self.dtype = "bfloat16"
        if self.attention_backend in ("auto", "cpu"):
            self.attention_backend = self._pick_attention_backend()
        if self.block_size is None:
            self.block_size = DEFAULT_BLOCK_SIZE[self.attention_backend]
        if self.prepack_weights is not False:  # None (auto) or True (asked for)
            from nanoengine.layers.linear import onednn_bf16_available

            packable = self.device == "cpu" and self.dtype == "bfloat16" and onednn_bf16_available()
            if self.prepack_weights and not packable:
                raise ValueError("EngineConfig: prepack_weights=True needs device='cpu', dtype='bfloat16' and a "
                                 "torch build with oneDNN bf16 on this CPU; leave prepack_weights=None (auto)")
            self.prepack_weights = packable
        model_max = getattr(hf_config, "max_position_embeddings", None) or 4096
        if self.max_model_len is None:
            self.max_model_len = model_max
        elif self.max_model_len > model_max:
            raise ValueError(f"EngineConfig: max_model_len={self.max_model_len} is longer than the model's "
                             f"max_position_embeddings={model_max}; use max_model_len <= {model_max}")
        return self

    def _pick_attention_backend(self) -> str:
        """'cpu' (the C++ decode kernel) on CPU when it builds here, else 'torch'."""
        if self.device != "cpu":
            if self.attention_backend == "cpu":
                raise ValueError("EngineConfig: attention_backend='cpu' runs on device='cpu' only")
            return "torch"
        from nanoengine.attention import cpu_backend

        reason = cpu_backend.unavailable_reason()
        if reason is None:
            return "cpu"
        if self.attention_backend == "cpu":
            raise ValueError(f"EngineConfig: attention_backend='cpu' could not be built ({reason}); "
                             "install a C++ compiler or use attention_backend='torch'")
        cpu_backend.fall_back_warning(reason)
        return "torch"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


def model_dtype(hf_config: Any):
    """The dtype a checkpoint was saved in (transformers 5 says `dtype`, older configs `torch_dtype`)."""
    import torch

    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    if isinstance(dt, str):
        dt = getattr(torch, dt)
    return dt


def rope_theta(hf_config: Any) -> float:
    """RoPE base: transformers 5 writes rope_parameters['rope_theta'], older configs a top-level rope_theta."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 10000.0))
