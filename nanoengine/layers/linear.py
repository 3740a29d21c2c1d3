"""Linear layers whose parameters know how to load their slice of a checkpoint. Chapters 02 and 07.

`MergedLinear` fuses several Hugging Face projections (q/k/v, or gate/up) into one matmul; each part is
loaded into its rows by `weight_loader(param, loaded, shard_id)`, which reads only its rank's share (of a lazy
slice: models/loader.py). Tensor parallelism (chapter 07) splits the two kinds of projection differently, so
that a decoder layer needs one all-reduce per half: column-parallel `MergedLinear` holds 1/N of every part's
output rows (q/k/v rows are head-major, so a rank's rows are whole heads: GQA's query heads and the KV heads
they read), row-parallel `RowParallelLinear` (o_proj, down_proj) 1/N of the input columns (their forwards:
`TPGroup.column_parallel`, `TPGroup.row_parallel`).

CPU fast paths (chapter 08), each a copy of the weight beside the ordinary one (which loading and tests use):
- `prepack_weights(model)`, on a CPU with bf16 support: every weight reordered once into oneDNN's blocked
  layout (an opaque oneDNN tensor). A plain `F.linear` reorders the weight on every call; decode steps
  multiply a few rows by the whole weight, so that per-call reorder is much of their time.
- `use_bf16_weights(model, kernels, max_rows)`, where oneDNN has no fast bf16 path (an AVX2-only CPU, which
  runs bf16 checkpoints in float32): a bfloat16 copy for the C++ kernel `bf16_linear`, for batches of up to
  `max_rows` rows. `bf16_pack` lays it out in blocks of 8 rows, each one sequential stream (with AVX-512, in
  column pairs of 16-row blocks, one 64-byte line per pair, widened 16 lanes at a time: `bf16_linear`'s
  "avx512" path; kernels/csrc/bf16_linear.cpp says why its AVX512-BF16 dot-product path is not the default).
  A decode step streams every weight once, so half the bytes is about twice the speed. For a bf16 checkpoint
  the copy is exact (the float32 weight is a widened bf16) and the sums are float32, so the output is the
  float32 linear's up to the order of the sums. Larger batches (prefill) keep the float32 matmul; in bf16
  (asked for on such a CPU) they run in float32 and round once, as a bf16 matmul rounds (torch's own bf16
  matmul has no fast path on such a CPU).
- `use_bf16_prefill(model, min_rows)`, with prefill_dtype="bfloat16" (opt-in): batches of over `min_rows` rows
  of a bf16 checkpoint run in float32 (prefill chunks, and the fused decode step's larger batches, which pass
  it to the C++ `Linear`) round their activations to bf16 and multiply a bf16 copy packed for oneDNN (AMX
  tiles where the CPU has them), the sums and the bias in float32. The plan turns it on, and sets `min_rows`,
  where it measured faster than the other paths (dtype_choice.prefill_choice); the rounding changes the
  results slightly, which is why it is not the default.
- quantization="int8" or "w8a8" (layers/quant.py): an int8 copy (`use_int8`: the C++ kernel `int8_linear`,
  half of bf16's bytes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.errors import InvalidValueError
from nanoengine.layers.tp_group import SINGLE, TPGroup

# use_bf16_prefill's default `min_rows`. On a Xeon with AMX (1 thread, SmolLM2's four linears of a layer) bf16
# beat float32 and the C++ bf16_linear at every size from 64 rows: 1.75 against 4.42 and 6.52 ms at 64 rows,
# 4.3 against 23.5 and 38.6 at 256, 7.1 against 38.9 and 65.4 at 512
BF16_PREFILL_MIN_ROWS = 64


def checkpoint_shape(loaded) -> tuple[int, ...]:
    """Shape of a checkpoint tensor, or of a lazy safetensors slice (read nothing yet)."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    """A replicated parameter: the whole checkpoint tensor."""
    if tuple(param.shape) != checkpoint_shape(loaded):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} "
                         f"vs checkpoint {checkpoint_shape(loaded)}")
    param.data.copy_(loaded[...])


def onednn_bf16_available() -> bool:
    """True when this torch build can run oneDNN bf16 linears on this CPU (asked by EngineConfig.resolve)."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackableLinear(nn.Linear):
    """nn.Linear whose weight can be prepacked for oneDNN on CPU (see the module docstring)."""

    packed_weight: torch.Tensor | None = None
    bf16_weight: torch.Tensor | None = None  # bf16 copy for small batches, packed by the kernels' bf16_pack
    bf16_max_rows: int = 0
    kernels: Any = None
    int8_weight: torch.Tensor | None = None  # int8 copy for small batches, packed by the kernels' int8_pack
    int8_scales: torch.Tensor | None = None  # its float32 scales, per output row and group of input columns
    int8_group_size: int = 0
    int8_max_rows: int = 0
    bf16_prefill_weight: torch.Tensor | None = None  # oneDNN-packed bf16 copy, larger batches (prefill_dtype)
    bf16_min_rows: int = BF16_PREFILL_MIN_ROWS  # batches of more rows than this multiply it

    def prepack(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def use_bf16(self, kernels: Any, max_rows: int) -> None:
        """Multiply batches of up to max_rows rows with a bf16 copy of the weight (the C++ `bf16_linear`)."""
        # [ceil(out / 8), in, 8], or with AVX-512 [ceil(out / 16), ceil(in / 2), 16, 2]
        self.bf16_weight = kernels.bf16_pack(self.weight.detach())
        self.bf16_max_rows, self.kernels = max_rows, kernels

    def use_bf16_prefill(self, min_rows: int = BF16_PREFILL_MIN_ROWS) -> None:
        """Multiply float32 batches of over min_rows rows in bf16 (see the module docstring): the weight
        packed for oneDNN where this torch has its bf16 path, else a plain bf16 copy (the same products).
        The layer's bf16 copies come first (`use_bf16`): their kernels run it."""
        if self.kernels is None:
            raise InvalidValueError("use_bf16_prefill: the layer has no C++ kernels yet; call use_bf16 first")
        w = self.weight.detach().bfloat16()  # [out, in]
        packable = onednn_bf16_available()
        self.bf16_prefill_weight = torch.ops.mkldnn._reorder_linear_weight(w) if packable else w
        self.bf16_min_rows = min_rows

    def use_int8(self, kernels: Any, q: torch.Tensor, scales: torch.Tensor, group_size: int,
                 max_rows: int, activations: bool = False) -> None:
        """Multiply batches of up to max_rows rows with int8 weights q [out, in] and their scales [out,
        groups] (the C++ `int8_linear`; layers.quant makes them); activations: int8 activations too (W8A8)."""
        if activations:  # [ceil(out / 16), ceil(in / 4), 16, 4] int8, [ceil(out / 16), groups, 2, 16] float32
            self.int8_weight, self.int8_scales = kernels.w8a8_pack(q, scales, group_size)
        else:  # [ceil(out / 16), in, 16] int8 and [ceil(out / 16), groups, 16] float32
            self.int8_weight, self.int8_scales = kernels.int8_pack(q, scales)
        self.int8_group_size, self.int8_max_rows, self.kernels = group_size, max_rows, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else None
        if self.int8_weight is not None and rows is not None and rows <= self.int8_max_rows:
            return self.kernels.int8_linear(x, self.int8_weight, self.int8_scales, bias, self.out_features,
                                            self.int8_group_size)  # [rows, out]
        if (self.bf16_prefill_weight is not None and rows is not None and rows > self.bf16_min_rows
                and x.dtype == torch.float32):
            # [rows, out]: rounded to bf16, oneDNN's bf16 matmul, back to float32 (+ bias), as the fused step
            return self.kernels.onednn_bf16_linear(x, self.bf16_prefill_weight, bias)
        if self.bf16_weight is not None and rows is not None and rows <= self.bf16_max_rows:
            return self.kernels.bf16_linear(x, self.bf16_weight, bias, self.out_features)  # [rows, out]
        copies = self.bf16_weight is not None or self.int8_weight is not None
        if copies and rows is not None and x.dtype == torch.bfloat16 and self.packed_weight is None:
            # no fast bf16 matmul on this CPU: float32, rounded once as bf16's is
            y = F.linear(x.float(), self.weight.float(), None if bias is None else bias.float())
            return y.to(x.dtype)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def prepack_weights(model: nn.Module) -> int:
    """Prepack every PackableLinear of a loaded bf16 model for oneDNN; returns how many were packed."""
    layers = [m for m in model.modules() if isinstance(m, PackableLinear)]
    for m in layers:
        m.prepack()
    return len(layers)


def use_bf16_weights(model: nn.Module, kernels: Any, max_rows: int) -> int:
    """Give every PackableLinear of a loaded model a bf16 weight copy for batches of up to max_rows rows (see
    the module docstring); returns how many. A float32 weight must be exactly representable in bf16 (a bf16
    checkpoint), so that the copy changes no value: InvalidValueError otherwise."""
    layers = [m for m in model.modules() if isinstance(m, PackableLinear)]
    for m in layers:
        w = m.weight.detach()
        if w.dtype == torch.float32 and not torch.equal(w.to(torch.bfloat16).float(), w):
            raise InvalidValueError(f"use_bf16_weights: a float32 weight {tuple(w.shape)} is not exactly "
                                    "bf16 (not a bf16 checkpoint); "
                                    "rounding it would change the model's results")
    for m in layers:
        m.use_bf16(kernels, max_rows)
    return len(layers)


def use_bf16_prefill(model: nn.Module, min_rows: int = BF16_PREFILL_MIN_ROWS) -> int:
    """Give every PackableLinear of a loaded model with bf16 weight copies (a bf16 checkpoint in float32) a
    bf16 weight for batches of over min_rows rows (prefill_dtype="bfloat16"); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, PackableLinear) and m.bf16_weight is not None]
    for m in layers:
        m.use_bf16_prefill(min_rows)
    return len(layers)


class MergedLinear(PackableLinear):
    """Several output projections stacked along the output dimension, parts named by shard id; column-parallel
    under tensor parallelism: this rank holds its 1/N of each part's rows (`part_sizes` are the full
    sizes)."""

    def __init__(self, in_features: int, part_sizes: dict[str, int], bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__(in_features, sum(part_sizes.values()) // tp.size, bias=bias)
        self.tp = tp
        self.part_sizes = dict(part_sizes)
        self.part_offsets: dict[str, tuple[int, int]] = {}  # part -> (first row here, rows here)
        start = 0
        for name, size in part_sizes.items():
            self.part_offsets[name] = (start, size // tp.size)
            start += size // tp.size
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        start, size = self.part_offsets[shard_id]
        full = checkpoint_shape(loaded)
        if full[0] != self.part_sizes[shard_id] or full[1:] != tuple(param.shape[1:]):
            raise ValueError(f"part {shard_id!r}: expected {(self.part_sizes[shard_id], *param.shape[1:])}, "
                             f"checkpoint has {full}")
        param.data.narrow(0, start, size).copy_(self.tp.rows(loaded, full[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out / N]
        return self.tp.column_parallel(x, self.weight, self.bias, self.matmul)


class RowParallelLinear(PackableLinear):
    """A projection whose input columns are split across ranks: y = all_reduce(x_here @ W_here^T) + b. With
    one rank it is a plain linear layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE) -> None:
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        full = checkpoint_shape(loaded)
        if full != (param.shape[0], param.shape[1] * self.tp.size):
            raise ValueError(f"shape mismatch: parameter {(param.shape[0], param.shape[1] * self.tp.size)} "
                             f"vs checkpoint {full}")
        param.data.copy_(self.tp.columns(loaded, full[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in / N] -> [num_tokens, out]
        return self.tp.row_parallel(x, self.weight, self.bias, self.matmul)
