"""Rotary position embedding (RoPE), "rotate half" (NeoX) layout as in Hugging Face Llama/Qwen3. Chapter 02.

x_rot = x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1] for the two halves of head_dim.
`torch.roll` by head_dim/2 gives [x2, x1]; the sign goes into a precomputed sin table [-sin, sin], so a
rotation is two multiplies and an add. The arithmetic runs in the activations' dtype, as in transformers.
The model builds one module and shares it with all its layers; it looks up cos/sin once per forward.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [head_dim/2]
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)  # [max_position, head_dim]
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)  # signed for rotate_half
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        self.kernels = None  # nanoengine's compiled CPU kernels, when the engine runs with them (chapter 06)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim] for these positions; reused while the same tensor comes back
        (every layer of one forward passes the same `positions`)."""
        last = self._last
        if last is None or last[0] is not positions or last[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            self._last = last = (positions, dtype, cos, sin)
        return last[2], last[3]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions [num_tokens]; q [num_tokens, num_heads, head_dim]; k [num_tokens, num_kv_heads, head_dim]
        if self.kernels is not None:  # one pass per tensor, reading cos/sin by position
            return (self.kernels.rotary(q, positions, self.cos, self.sin),
                    self.kernels.rotary(k, positions, self.cos, self.sin))
        cos, sin = self.lookup(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [num_tokens, heads, head_dim]; cos, sin [num_tokens, 1, head_dim] (sin signed: [-sin, sin])
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin
