"""Rotary position embedding (RoPE), "rotate half" (NeoX) layout as in Hugging Face Llama/Qwen3. Chapter 02.

x_rot = x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1] for the two halves of head_dim.
`torch.roll` by head_dim/2 gives [x2, x1]; the sign goes into a precomputed sin table [-sin, sin], so a
rotation is two multiplies and an add. The arithmetic runs in the activations' dtype, as in transformers.
The model builds one module, shared by all its layers, and looks up cos/sin once per forward
(`angles(positions, dtype)`); every layer then rotates with what it is handed (`rotate`). Built with
`kernels` (the compiled CPU extension, chapter 06), the rotation reads the tables by position in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn


@dataclass
class RotaryAngles:
    """One forward's rotary inputs, shared by every layer."""
    positions: torch.Tensor  # [num_tokens]
    cos: torch.Tensor | None  # [num_tokens, 1, head_dim], None when the kernels read the tables themselves
    sin: torch.Tensor | None  # [num_tokens, 1, head_dim], signed [-sin, sin]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 kernels: ModuleType | None = None) -> None:
        super().__init__()
        # [head_dim/2]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        # [max_position, head_dim]; sin signed for rotate_half
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)
        self.kernels = kernels

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        """cos and sin of these positions in the activations' dtype (once per forward)."""
        if self.kernels is not None:
            return RotaryAngles(positions, None, None)
        return RotaryAngles(positions, self.cos[positions].unsqueeze(1).to(dtype),
                            self.sin[positions].unsqueeze(1).to(dtype))

    def rotate(self, angles: RotaryAngles, q: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [num_tokens, num_heads, head_dim]; k [num_tokens, num_kv_heads, head_dim]
        if self.kernels is not None:
            return (self.kernels.rotary(q, angles.positions, self.cos, self.sin),
                    self.kernels.rotary(k, angles.positions, self.cos, self.sin))
        return apply_rotary(q, angles.cos, angles.sin), apply_rotary(k, angles.cos, angles.sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate q and k at these positions in one call (`angles`, then `rotate`)."""
        return self.rotate(self.angles(positions, q.dtype), q, k)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [num_tokens, heads, head_dim]; cos, sin [num_tokens, 1, head_dim] (sin signed: [-sin, sin])
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin
