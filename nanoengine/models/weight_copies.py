"""The weight copies an EnginePlan chose for CPU, made on one rank's shards once they are loaded. Chapter 08.

int8 copies (weight-only, or with int8 activations: W8A8; the weights then hold the dequantized values),
oneDNN-prepacked weights, bf16 copies for small batches (the C++ extension's bf16_linear), and bf16 matmuls
(oneDNN) for batches above the plan's measured row threshold (`prefill_dtype`, `prefill_dtype_min_rows`).
The plan decides which (plan.py, dtype_choice.py measures); the layers hold the copies and choose per batch
by its rows, so the runner's step never asks.
"""

from __future__ import annotations

import torch

from nanoengine.kernels import cpu as cpu_kernels
from nanoengine.layers.linear import prepack_weights, use_bf16_prefill, use_bf16_weights
from nanoengine.plan import EnginePlan


def prepare_weights(model: torch.nn.Module, plan: EnginePlan) -> None:
    """Give `model`'s layers the copies `plan` asks for (none on a plain plan)."""
    if plan.int8_weight_rows:
        from nanoengine.layers.quant import quantize_weights  # (imported only to quantize)

        quantize_weights(model, cpu_kernels.load(), plan.int8_weight_rows,
                         activations=plan.quantization == "w8a8")  # (int8 activations too: W8A8)
    if plan.prepack_weights:
        prepack_weights(model)
    if plan.bf16_weight_rows:
        use_bf16_weights(model, cpu_kernels.load(), plan.bf16_weight_rows)
    if plan.prefill_dtype != plan.dtype:
        use_bf16_prefill(model, plan.prefill_dtype_min_rows)
