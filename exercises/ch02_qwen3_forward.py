# Your exercises for book/02a_layer_parts.ipynb, 02b_layer_and_forward.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch02")`, from nanoengine.check) or: pytest tests/exercises/test_ch02_qwen3_forward.py
# Generated from solutions/ch02_qwen3_forward.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
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
    raise NotImplementedError("Exercise 2.1: RMSNorm over the last dimension, computed in float32 - see book/02a_layer_parts.ipynb")


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Exercise 2.2: rotate each head's vector by its token's position (RoPE, "rotate half" layout).

    x [T, heads, D]; positions [T] (int). Pair dimension i with dimension i + D/2 (i < D/2); the pair at
    position p turns by angle p * theta^(-2i/D): (a, b) -> (a cos - b sin, b cos + a sin). Compute in
    float32 and return x's dtype and shape.
    """
    raise NotImplementedError("Exercise 2.2: rotate each head's vector by its token's position (RoPE, 'rotate half' layout) - see book/02a_layer_parts.ipynb")


def causal_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exercise 2.3: causal attention where groups of query heads share one key/value head.

    q [T, H, D]; k, v [T, KVH, D] with H a multiple of KVH: query head h uses kv head h // (H // KVH).
    Scores q.k / sqrt(D); token t attends to tokens 0..t; softmax over keys in float32.
    Returns [T, H, D] in q's dtype.
    """
    raise NotImplementedError("Exercise 2.3: causal attention where groups of query heads share one key/value head - see book/02a_layer_parts.ipynb")


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
    raise NotImplementedError("Exercise 2.4: one Qwen3 decoder layer with the weights of a transformers Qwen3DecoderLayer - see book/02b_layer_and_forward.ipynb")


@torch.inference_mode()
def qwen3_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Exercise 2.5: the logits of a transformers Qwen3ForCausalLM, computed with your decoder_layer.

    input_ids [T] -> logits [T, vocab] float32: embed (model.model.embed_tokens.weight), every layer in
    model.model.layers, the final rms_norm (model.model.norm), then the LM head: with tied embeddings
    (config.tie_word_embeddings) the embedding matrix itself, otherwise model.lm_head.weight.
    """
    raise NotImplementedError("Exercise 2.5: the logits of a transformers Qwen3ForCausalLM, computed with your decoder_layer - see book/02b_layer_and_forward.ipynb")
