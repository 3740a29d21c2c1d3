"""Model-shape facts read from a Hugging Face config, in one place. Chapters 02, 03 and 08.

Configs differ in how they spell things: `head_dim` may be missing (then it is hidden / heads), the RoPE base
moved into `rope_parameters` in transformers 5, the checkpoint dtype is `dtype` or `torch_dtype`. The model,
the model runner's KV-cache sizing, the benchmark's roofline and the book all ask here.

A mixture-of-experts config (Qwen3-MoE) adds its routing facts, read and checked by `moe_config`:
every field the engine does not implement (shared experts, dense layers among the sparse ones, an activation
other than SiLU) is a CheckpointError naming the field, never silently ignored.
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
class MoEConfig:
    """A mixture-of-experts MLP's facts (every decoder layer has one; see `moe_config`)."""

    num_experts: int  # experts per layer (config num_experts, or num_local_experts)
    top_k: int  # experts each token is routed to (num_experts_per_tok)
    intermediate: int  # one expert's intermediate size (moe_intermediate_size)
    norm_topk_prob: bool  # renormalize the top-k routing probabilities to sum to 1


# fields that would change the MoE forward, and the value the engine implements: anything else is refused
_MOE_UNSUPPORTED = {
    "decoder_sparse_step": (1, "every layer sparse (decoder_sparse_step=1); dense MLP layers among the "
                               "sparse ones are not implemented yet"),
    "mlp_only_layers": ([], "no dense-MLP-only layers (mlp_only_layers=[])"),
    "shared_expert_intermediate_size": (0, "no shared expert (Qwen2-MoE's shared_expert is not implemented)"),
    "n_shared_experts": (0, "no shared experts"),
    "num_shared_experts": (0, "no shared experts"),
    "hidden_act": ("silu", "SwiGLU experts (hidden_act='silu')"),
}


def _num_experts(cfg: Any) -> int:
    return getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0


def moe_config(cfg: Any) -> MoEConfig | None:
    """The MoE facts of a config, checked; None for a dense model. A CheckpointError names each field the
    engine cannot honour (see _MOE_UNSUPPORTED) and what it supports."""
    from nanoengine.errors import CheckpointError

    experts = _num_experts(cfg)
    if not experts:
        return None
    for name, (want, what) in _MOE_UNSUPPORTED.items():
        got = getattr(cfg, name, None)
        if got is None or got == want or (not want and not got):
            continue
        raise CheckpointError(f"config.json: {name}={got!r} is not supported: nanoengine's "
                              f"mixture-of-experts layers need {what}; use a checkpoint without it")
    top_k = getattr(cfg, "num_experts_per_tok", None)
    inter = getattr(cfg, "moe_intermediate_size", None)
    if not top_k or not inter or not 1 <= top_k <= experts:
        raise CheckpointError(f"config.json: a mixture-of-experts config needs num_experts_per_tok between 1 "
                              f"and num_experts={experts} and a moe_intermediate_size, got "
                              f"num_experts_per_tok={top_k!r}, moe_intermediate_size={inter!r}")
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate=inter,
                     norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)))


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
    # mixture of experts (0: a dense MLP of `intermediate`): experts per layer, routed per token, and one
    # expert's intermediate size. The per-layer figures below count what one token reads (the router and
    # top_k experts): a batch-1 decode's bytes, and every token's flops; a batch of B tokens reads up to
    # min(E, B * top_k) experts, which this roofline does not model yet
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @classmethod
    def from_hf_config(cls, cfg: Any, dtype_bytes: int = 2,
                       weight_dtype_bytes: float | None = None) -> ModelShape:
        return cls(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                   kv_heads=num_kv_heads(cfg), head_dim=head_dim(cfg), intermediate=cfg.intermediate_size,
                   vocab=cfg.vocab_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                   dtype_bytes=dtype_bytes, qk_norm=getattr(cfg, "model_type", "") in ("qwen3", "qwen3_moe"),
                   weight_dtype_bytes=weight_dtype_bytes, **_moe_shape(cfg))

    @property
    def linear_params_per_layer(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h  # q, k, v, o
        if self.experts:  # the router, and the top_k experts one token runs
            mlp = h * self.experts + self.experts_per_token * 3 * h * self.expert_intermediate
        else:
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


def _moe_shape(cfg: Any) -> dict[str, int]:
    moe = moe_config(cfg)
    if moe is None:
        return {}
    return dict(experts=moe.num_experts, experts_per_token=moe.top_k, expert_intermediate=moe.intermediate)
