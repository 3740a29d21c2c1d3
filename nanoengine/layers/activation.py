"""SwiGLU: silu(gate) * up, on the fused gate_up projection. Chapter 02."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up  # [num_tokens, intermediate]
