"""A Llama-family decoder (Llama, SmolLM2; Qwen3 = this + per-head q/k RMSNorm). Chapter 02.

Inputs are a flat batch of new tokens from many sequences ([num_tokens]); the attention layer reads and
writes the paged KV cache through the batch's AttentionMetadata. The model is built with its attention backend
and, optionally, compiled `kernels` (chapter 06) that its norms, rotary and MLP use. Under tensor parallelism
(chapter 07) it is built with its rank's `TPGroup`: each rank holds 1/N of the query and KV heads and of the
MLP's intermediate rows, its attention reads its own heads' KV cache, and o_proj and down_proj each end in an
all-reduce. Norms, rotary and the residual stream are whole on every rank.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from nanoengine.attention import AttentionBackend, AttentionMetadata, TorchAttention
from nanoengine.layers.activation import silu_and_mul
from nanoengine.layers.embedding import Embedding, LMHead
from nanoengine.layers.linear import MergedLinear, RowParallelLinear
from nanoengine.layers.moe import ENGINE_MOE, MoEPieces
from nanoengine.layers.norm import RMSNorm
from nanoengine.layers.rotary import RotaryAngles, RotaryEmbedding
from nanoengine.layers.tp_group import SINGLE, TPGroup
from nanoengine.models import hf_config


class Attention(nn.Module):
    def __init__(self, config: Any, qk_norm: bool, backend: type[AttentionBackend], rotary: RotaryEmbedding,
                 kernels: ModuleType | None = None, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size  # this rank's heads
        self.num_kv_heads = hf_config.num_kv_heads(config) // tp.size
        self.head_dim = hf_config.head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        n = tp.size
        self.qkv_proj = MergedLinear(config.hidden_size,
                                     {"q": self.q_size * n, "k": self.kv_size * n, "v": self.kv_size * n},
                                     bias, tp)
        self.o_proj = RowParallelLinear(self.q_size * n, config.hidden_size, bias, tp)
        self.rotary_emb = rotary  # one module shared by all layers
        self.attn = backend(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)

    def forward(self, angles: RotaryAngles, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb.rotate(angles, q, k)
        out = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: Any, kernels: ModuleType | None = None, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias, tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, tp)
        self.kernels = kernels  # the compiled CPU kernels' fused SwiGLU (chapter 06), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        # [T, I/N]
        act = self.kernels.silu_and_mul(gate_up) if self.kernels is not None else silu_and_mul(gate_up)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, qk_norm: bool, backend: type[AttentionBackend], rotary: RotaryEmbedding,
                 kernels: ModuleType | None = None, tp: TPGroup = SINGLE,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, qk_norm, backend, rotary, kernels, tp)
        self.mlp = MLP(config, kernels, tp) if mlp is None else mlp  # a mixture of experts brings its own
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(self, angles: RotaryAngles, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_add(x, residual)
        x = self.self_attn(angles, x, meta)
        x, residual = self.post_attention_layernorm.forward_add(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    # checkpoint name fragment -> (our fused parameter fragment, part id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: Any, attention_backend: type[AttentionBackend] = TorchAttention,
                 kernels: ModuleType | None = None, tp: TPGroup = SINGLE,
                 moe: MoEPieces = ENGINE_MOE) -> None:
        """moe: the router and expert forward an MoE model's layers compute with (EngineParts.moe)."""
        super().__init__()
        self.config = config
        self.moe_pieces = moe
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(hf_config.head_dim(config), config.max_position_embeddings,
                                          hf_config.rope_theta(config), kernels)
        self.layers = nn.ModuleList(DecoderLayer(config, self.qk_norm, attention_backend, self.rotary_emb,
                                                 kernels, tp, self.make_mlp(config, kernels, tp))
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_mlp(self, config: Any, kernels: ModuleType | None, tp: TPGroup) -> nn.Module | None:
        """A decoder layer's MLP, or None for the dense SwiGLU `MLP` (Qwen3-MoE returns its experts)."""
        return None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Hand layer i its K and V caches: views of kv_cache [2, num_layers, *the backend's layer layout]."""
        for i, layer in enumerate(self.layers):
            layer.self_attn.attn.bind_kv_cache(kv_cache[0, i], kv_cache[1, i])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        angles = self.rotary_emb.angles(positions, x.dtype)  # once; every layer rotates with it
        residual = None
        for layer in self.layers:
            x, residual = layer(angles, x, residual, meta)
        x, _ = self.norm.forward_add(x, residual)
        return x  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)  # [num_seqs, vocab] fp32 (on rank 0; None on the other ranks)
