"""The small fused ops through torch.compile: RMSNorm with the residual add, rotary, SiLU-and-mul. Chapter 06.

Each is the eager layer's own function, handed to torch.compile (inductor), which fuses its elementwise ops
into one kernel: on a GPU, one launch and one pass over memory instead of several. `CompiledOps` has the C++
CPU extension's interface (`rms_norm(x, residual, weight, eps) -> (normed, residual)`,
`rotary(x, positions, cos, sin)`, `silu_and_mul(gate_up)`), so the layers take it the same way, in their
constructors (`nanoengine.kernels.for_plan` picks it when the plan says `torch_compile`). Compiling is
lazy: the first call of each shape compiles (the runner's warm-up and graph capture do it before any request).
On CPU inductor made these ops slower than eager (hence off by default there); on CUDA they save launches.
"""

from __future__ import annotations

import torch

from nanoengine.layers.activation import silu_and_mul
from nanoengine.layers.norm import rms_norm
from nanoengine.layers.rotary import apply_rotary


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual), x + residual), or (norm(x), None) without a residual; x [..., dim]."""
    if residual is not None:
        x = residual = x + residual
    return rms_norm(x, weight, eps), residual


def rotary_by_position(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] at `positions`, reading the [max_position, head_dim] tables."""
    return apply_rotary(x, cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype))


class CompiledOps:
    """The ops, each compiled once per instance (dynamic shapes: one graph for every batch size)."""

    def __init__(self) -> None:
        self.rms_norm = torch.compile(add_rms_norm, dynamic=True)
        self.rotary = torch.compile(rotary_by_position, dynamic=True)
        self.silu_and_mul = torch.compile(silu_and_mul, dynamic=True)
