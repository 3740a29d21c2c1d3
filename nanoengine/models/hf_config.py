"""Model-shape facts read from a Hugging Face config, in one place. Chapters 02, 03 and 08.

Configs differ in how they spell things: `head_dim` may be missing (then it is hidden / heads), the RoPE base
moved into `rope_parameters` in transformers 5, the checkpoint dtype is `dtype` or `torch_dtype`. The model,
the model runner's KV-cache sizing, the benchmark's roofline and the book all ask here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def head_dim(cfg: Any) -> int:
    """Size of one attention head: config.head_dim, or hidden_size // num_attention_heads without one."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def num_kv_heads(cfg: Any) -> int:
    """Key/value heads (grouped-query attention); configs without the field use one per query head."""
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def rope_theta(cfg: Any) -> float:
    """RoPE base: transformers 5 writes rope_parameters['rope_theta'],
    older configs a top-level rope_theta."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


def checkpoint_dtype(cfg: Any):
    """The torch dtype a checkpoint was saved in
    (transformers 5 says `dtype`, older configs `torch_dtype`)."""
    import torch

    dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
    return getattr(torch, dt) if isinstance(dt, str) else dt


def kv_bytes_per_token(cfg: Any, dtype_bytes: int) -> int:
    """K and V of one token in every layer: 2 x layers x kv heads x head_dim x bytes per element."""
    return _kv_bytes(cfg.num_hidden_layers, num_kv_heads(cfg), head_dim(cfg), dtype_bytes)


def _kv_bytes(layers: int, kv_heads: int, head_size: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_size * dtype_bytes


@dataclass(frozen=True)
class ModelShape:
    """The numbers that set a model's cost per token (the benchmark's roofline and chapter 08 read them)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    dtype_bytes: int
    qk_norm: bool = False  # Qwen3 normalizes q and k per head
    # bytes per weight as the engine reads them, if not dtype_bytes (int8 with its scales: 1 + 4 / group)
    weight_dtype_bytes: float | None = None

    @classmethod
    def from_hf_config(cls, cfg: Any, dtype_bytes: int = 2,
                       weight_dtype_bytes: float | None = None) -> ModelShape:
        return cls(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                   kv_heads=num_kv_heads(cfg), head_dim=head_dim(cfg), intermediate=cfg.intermediate_size,
                   vocab=cfg.vocab_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                   dtype_bytes=dtype_bytes, qk_norm=getattr(cfg, "model_type", "") == "qwen3",
                   weight_dtype_bytes=weight_dtype_bytes)

    @property
    def linear_params_per_layer(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h  # q, k, v, o
        mlp = 3 * h * self.intermediate  # gate, up, down
        return attn + mlp

    @property
    def linear_params(self) -> int:
        """Non-embedding linear parameters (all layers)."""
        return self.layers * self.linear_params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def norm_params(self) -> int:
        per_layer = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.layers * per_layer + self.hidden

    @property
    def weight_bytes_per_step(self) -> int:
        linears = (self.linear_params + self.lm_head_params) * (self.weight_dtype_bytes or self.dtype_bytes)
        return round(linears) + self.norm_params * self.dtype_bytes

    @property
    def kv_bytes_per_position(self) -> int:
        return _kv_bytes(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)
