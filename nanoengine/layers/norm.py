"""RMSNorm, computed in float32 like Hugging Face's Llama/Qwen3 (then cast back). Chapter 02.

Built with `kernels` (chapter 06: the compiled CPU extension, or the same ops through torch.compile), it runs
one fused pass instead of the eager ops. Kernels that need contiguous rows (the compiled ones) get them and
strided tensors take the eager ops; kernels that take any tensor say so with `contiguous_only = False`
(the learner's RMSNorm plugged in by nanoengine.pieces, which must see every norm).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., dim]
    """x * rsqrt(mean(x^2) + eps) in float32 (one fused op), cast back, then the learned scale."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, kernels: ModuleType | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernels = kernels
        self.contiguous_only = getattr(kernels, "contiguous_only", True)  # see the module docstring

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if self.kernels is not None and (x.is_contiguous() or not self.contiguous_only):
            return self.kernels.rms_norm(x, None, self.weight, self.eps)[0]
        return rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused `residual = x + residual; return norm(residual), residual` (one pass in the decoder)."""
        if self.kernels is not None and (not self.contiguous_only
                                         or (x.is_contiguous() and residual.is_contiguous())):
            normed, residual = self.kernels.rms_norm(x, residual, self.weight, self.eps)
            return normed, residual
        residual = x + residual
        return self.forward(residual), residual
