"""Chapter 02, book/02a_layer_parts.ipynb .. 02b_layer_and_forward.ipynb: the Qwen3 forward pass from its
parts.

Exercise 2.1: RMSNorm.
Exercise 2.2: rotary position embedding (RoPE), "rotate half" layout.
Exercise 2.3: causal grouped-query attention.
Exercise 2.4: one Qwen3 decoder layer, equal to transformers' Qwen3DecoderLayer.
Exercise 2.5: the whole forward pass: logits equal to transformers' Qwen3ForCausalLM.

Shapes: one sequence of T tokens, no batch dimension. H query heads, KVH key/value heads, D = head_dim
(H * D need not equal the hidden size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# rope_theta(config) -> the RoPE base of a transformers config
from nanoengine.models.hf_config import rope_theta


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Exercise 2.1: RMSNorm over the last dimension, computed in float32.

    x * rsqrt(mean(x^2) + eps), computed in float32, cast back to x's dtype, then times `weight`.
    x [..., dim]; weight [dim]; returns [..., dim].
    """
    # BEGIN SOLUTION
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)
    # END SOLUTION


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Exercise 2.2: rotate each head's vector by its token's position (RoPE, "rotate half" layout).

    x [T, heads, D]; positions [T] (int). Pair dimension i with dimension i + D/2 (i < D/2); the pair at
    position p turns by angle p * theta^(-2i/D): (a, b) -> (a cos - b sin, b cos + a sin). Compute in
    float32 and return x's dtype and shape.
    """
    # BEGIN SOLUTION
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [D/2]
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [T, 1, D/2]
    a, b = x.float().chunk(2, dim=-1)  # each [T, heads, D/2]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)
    # END SOLUTION


def causal_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exercise 2.3: causal attention where groups of query heads share one key/value head.

    q [T, H, D]; k, v [T, KVH, D] with H a multiple of KVH: query head h uses kv head h // (H // KVH).
    Scores q.k / sqrt(D); token t attends to tokens 0..t; softmax over keys in float32.
    Returns [T, H, D] in q's dtype.
    """
    # BEGIN SOLUTION
    T, H, D = q.shape
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [T, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * D ** -0.5  # [H, T, T]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)  # [T, H, D]
    # END SOLUTION


def decoder_layer(layer: Any, x: torch.Tensor, positions: torch.Tensor, config: Any) -> torch.Tensor:
    """Exercise 2.4: one Qwen3 decoder layer with the weights of a transformers Qwen3DecoderLayer.

    `layer` holds layer.self_attn.{q,k,v,o}_proj, .q_norm, .k_norm; layer.mlp.{gate,up,down}_proj;
    layer.input_layernorm, layer.post_attention_layernorm (a Linear's weight is [out, in], no biases).

    x [T, hidden] -> [T, hidden]:
      h = rms_norm(x); q, k, v = projections of h, split into heads; q, k = q_norm(q), k_norm(k) per head;
      RoPE on q and k; causal GQA attention; x = x + o_proj(attention)
      h = rms_norm(x); x = x + down_proj(silu(gate_proj(h)) * up_proj(h))
    Use config.num_attention_heads, .num_key_value_heads, .head_dim, .rms_norm_eps and rope_theta(config).
    """
    # BEGIN SOLUTION
    T = x.shape[0]
    H, KVH, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps, theta = config.rms_norm_eps, rope_theta(config)
    attn, mlp = layer.self_attn, layer.mlp
    h = rms_norm(x, layer.input_layernorm.weight, eps)
    q = F.linear(h, attn.q_proj.weight).view(T, H, D)
    k = F.linear(h, attn.k_proj.weight).view(T, KVH, D)
    v = F.linear(h, attn.v_proj.weight).view(T, KVH, D)
    q, k = rms_norm(q, attn.q_norm.weight, eps), rms_norm(k, attn.k_norm.weight, eps)
    q, k = apply_rope(q, positions, theta), apply_rope(k, positions, theta)
    x = x + F.linear(causal_gqa_attention(q, k, v).reshape(T, H * D), attn.o_proj.weight)
    h = rms_norm(x, layer.post_attention_layernorm.weight, eps)
    return x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                        mlp.down_proj.weight)
    # END SOLUTION


@torch.inference_mode()
def qwen3_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Exercise 2.5: the logits of a transformers Qwen3ForCausalLM, computed with your decoder_layer.

    input_ids [T] -> logits [T, vocab] float32: embed (model.model.embed_tokens.weight), every layer in
    model.model.layers, the final rms_norm (model.model.norm), then the LM head: with tied embeddings
    (config.tie_word_embeddings) the embedding matrix itself, otherwise model.lm_head.weight.
    """
    # BEGIN SOLUTION
    config, inner = model.config, model.model
    x = inner.embed_tokens.weight[input_ids]  # [T, hidden]
    positions = torch.arange(input_ids.shape[0])
    for layer in inner.layers:
        x = decoder_layer(layer, x, positions, config)
    x = rms_norm(x, inner.norm.weight, config.rms_norm_eps)
    head = inner.embed_tokens.weight if config.tie_word_embeddings else model.lm_head.weight
    return F.linear(x, head).float()  # [T, vocab]
    # END SOLUTION
