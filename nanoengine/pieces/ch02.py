"""Chapter 02's pieces in the engine: your RMSNorm and RoPE as the model's kernels, and your causal GQA
attention for the prompts' own tokens.

The model already takes its norms and rotary from a `kernels` object (the compiled CPU kernels use the same
seam, chapter 06): `Kernels` is one built from your `rms_norm` and `apply_rope`, so every RMSNorm of the
model (input, post-attention, q/k norms and the final one) and every rotation runs your code. Your
`causal_gqa_attention` becomes the attention backend's `prompt_attention`: the attention of a prompt (chunk)
with no cached prefix over its own tokens. Decode, and a chunk that continues a cached prefix, attend over the
paged KV cache: that is chapter 03's piece.
"""

from __future__ import annotations

from types import ModuleType

import torch

from nanoengine.attention import TorchAttention
from nanoengine.layers.activation import silu_and_mul
from nanoengine.pieces.learner import check_result, piece


class Kernels:
    """The model's kernels (rms_norm with the residual add, rotary, silu_and_mul) on your functions."""
    contiguous_only = False  # your functions get every tensor, strided views included (layers/norm.py)

    def __init__(self, module: ModuleType, rope_theta: float) -> None:
        self.norm = piece(module, "rms_norm", "ch02")
        self.rope = piece(module, "apply_rope", "ch02")
        self.rope_theta = rope_theta

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        if residual is not None:  # the decoder's fused add: residual = x + residual, then normalize it
            x = residual = x + residual
        out = self.norm(x, weight, eps)  # [..., dim]
        check_result(isinstance(out, torch.Tensor) and out.shape == x.shape, self.norm,
                     f"{_describe(out)} for x of shape {tuple(x.shape)}; it must return x's shape")
        return out, residual

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        # x [num_tokens, heads, head_dim]; your apply_rope computes its own angles from the model's theta
        out = self.rope(x, positions, self.rope_theta)
        check_result(isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype,
                     self.rope,
                     f"{_describe(out)} for x {tuple(x.shape)} {x.dtype}; it must return x's shape and dtype")
        return out

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)  # not an exercise: the engine's own


def with_prompt_attention(base: type[TorchAttention], module: ModuleType) -> type[TorchAttention]:
    """`base` (a torch-family attention backend) with your causal_gqa_attention for prompts' own tokens."""
    attend = piece(module, "causal_gqa_attention", "ch02")

    class LearnerPromptAttention(base):
        def prompt_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim]
            out = attend(q, k, v)
            check_result(isinstance(out, torch.Tensor) and out.shape == q.shape, attend,
                         f"{_describe(out)} for q of shape {tuple(q.shape)}; it must return q's shape")
            return out.to(q.dtype)

    return LearnerPromptAttention


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} ({x.dtype})"
    return f"a {type(x).__name__}"
