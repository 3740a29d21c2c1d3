"""Compiled kernels, built, cached and loaded in one place. Chapters 03 and 06.

- `cpu`: the C++ CPU extension (paged decode attention; fused RMSNorm, rotary and SwiGLU; the bf16 linear;
  the whole decode step).
- `compiled`: the same fused ops through torch.compile (`torch_compile` in the plan; on CUDA by default).
- `triton_*`: the Triton kernels, attention and fused MoE (`triton_support` says whether they can run here).

The engine picks the model's kernels once (`for_plan`) and passes them to the model when it is built:
RMSNorm, rotary and the MLP take them in their constructors, so no module is patched after construction.
`python -m nanoengine.kernels` builds them now (`make assets` does); where the C++ kernels cannot be built,
`cpu.build_problem()` says why and the plan runs on torch's ops instead.
"""

from __future__ import annotations

from typing import Any

from nanoengine.kernels import cpu
from nanoengine.kernels.compiled import CompiledOps


def for_plan(plan: Any) -> Any:
    """The kernels a model runs with under this EnginePlan: the CPU extension with attention_backend='cpu'
    (its glue kernels go with its attention kernel), torch.compile'd ops with torch_compile, else None
    (eager PyTorch)."""
    if plan.attention_backend == "cpu":
        return cpu.load()
    if plan.torch_compile:
        return CompiledOps()
    return None
