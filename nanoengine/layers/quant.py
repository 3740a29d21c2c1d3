"""int8 quantization of the linears and the LM head: weight-only (`quantization="int8"`) or with int8
activations too (`quantization="w8a8"`). Chapter 08.

Symmetric int8 with one float32 scale per output row and group of `group_size` input columns:

    s[n, g] = max |W[n, k]| over the group's columns k / 127,    q[n, k] = round(W[n, k] / s[n, g]),

and W is read back as q * s. Symmetric: zero is exact and no zero point is stored or subtracted; q lies in
[-127, 127], not [-128, 127], so that -max maps to -127 exactly (the code never needs -128). A group's error
is at most s / 2 per weight, so a group whose weights are all small keeps them precise even when another
group of the same row holds an outlier: that is why groups beat one scale per row (see the book's chapter 08
for the measured error per layer). `GROUP_SIZE` = 32 (llama.cpp's Q8_0 block): it divides every shard of
SmolLM2's and Qwen3's inputs under tensor parallelism, so a rank's groups are the whole model's groups
(quantizing each shard gives the same values as quantizing the whole weight), and its scales cost 4 / 32
bytes per weight on top of the int8 byte.

`quantize_weights(model, kernels, max_rows)` quantizes every linear of a loaded model (each rank its own
shard, after loading), gives each an int8 copy for batches of up to max_rows rows (the C++ `int8_linear`,
layers.linear.PackableLinear.use_int8), and replaces the weight by its dequantized values, so that larger
batches (prefill, through the ordinary matmul) run the same quantized model. A tied LM head gets its own
dequantized weight: the embedding keeps the checkpoint's rows.

W8A8 (`quantization="w8a8"`; `quantize_weights(..., max_rows=ALL_ROWS)`): the same int8 weights, laid out for
int8 dot products (`w8a8_pack`), and every batch, prefill included, goes through them: the kernel quantizes
each row of x per group of `group_size` columns as the weights are quantized (Q8_0's activations: scale =
max |x| / 127 over the group, xq = round(x * 127 / max |x|)), multiplies int8 by int8 into exact int32 sums
(AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw`, or plain loops), and scales each group's sum by both scales. The
rounding of the activations is the price (chapter 08 measures it); the gain is a quarter of float32's bytes
per weight and 64 multiply-adds per instruction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanoengine.errors import InvalidValueError

GROUP_SIZE = 32  # input columns per scale (see the module docstring)
# max_rows of quantization="w8a8": every batch through the int8 kernel (the plan's int8_weight_rows), which is
# what asks for the W8A8 layout (the runner passes the plan's rows)
ALL_ROWS = 1 << 30
INT8_MAX = 127  # symmetric: [-127, 127]


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def quantize_int8(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q [out, in] int8 in [-127, 127], scales [out, groups] float32), one scale per
    output row and group of group_size input columns (the last group of a row may be shorter). A group of
    zeros gets scale 0 (and q 0)."""
    if weight.dim() != 2 or group_size < 1:
        raise InvalidValueError(f"quantize_int8: a weight [out, in] and group_size >= 1, got shape "
                                f"{tuple(weight.shape)} and group_size={group_size}")
    out, cols = weight.shape
    group_size = min(group_size, cols)  # a group as wide as the row: one scale per output row
    groups = num_groups(cols, group_size)
    w = weight.float()
    padded = torch.nn.functional.pad(w, (0, groups * group_size - cols))  # [out, groups * group_size]
    scales = padded.view(out, groups, group_size).abs().amax(dim=2) / INT8_MAX  # [out, groups]
    per_column = scales.repeat_interleave(group_size, dim=1)[:, :cols]  # [out, in]
    q = torch.where(per_column > 0, w / per_column, torch.zeros_like(w)).round().clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """q [out, in] int8 and scales [out, groups] -> the float32 weight q * s [out, in]."""
    group_size = min(group_size, q.shape[1])
    return q.float() * scales.repeat_interleave(group_size, dim=1)[:, :q.shape[1]]


def quantize_weights(model: nn.Module, kernels: Any, max_rows: int, group_size: int = GROUP_SIZE,
                     activations: bool | None = None) -> int:
    """Quantize every PackableLinear of a loaded model (see the module docstring); returns how many.
    activations: int8 activations too (W8A8); None: where max_rows is ALL_ROWS."""
    from nanoengine.layers.linear import PackableLinear

    if activations is None:
        activations = max_rows >= ALL_ROWS
    if activations and group_size % 4:
        raise InvalidValueError(f"quantize_weights: W8A8 takes 4 columns per int8 dot product, so group_size "
                                f"must be a multiple of 4, got {group_size}; use GROUP_SIZE ({GROUP_SIZE})")
    layers = [m for m in model.modules() if isinstance(m, PackableLinear)]
    for m in layers:
        weight = m.weight.detach()
        q, scales = quantize_int8(weight, group_size)
        # its own parameter: a tied LM head leaves the embedding's rows as they are
        m.weight = nn.Parameter(dequantize_int8(q, scales, group_size).to(weight.dtype), requires_grad=False)
        m.use_int8(kernels, q, scales, group_size, max_rows, activations)
    return len(layers)
