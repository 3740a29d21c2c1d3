"""Compiled kernels, built, cached and loaded in one place. Chapters 03 and 06.

- `cpu`: the C++ CPU extension (paged decode attention; fused RMSNorm, rotary and SwiGLU).
- `compiled`: the same fused ops through torch.compile (`torch_compile` in the config; on CUDA by default).

The engine picks the kernels once (`for_config`) and passes them to the model when it is built: RMSNorm,
rotary and the MLP take them in their constructors, so no module is patched after construction.
`python -m nanoengine.kernels` builds them now (`make assets` does).
"""

from __future__ import annotations

from typing import Any


def for_config(config: Any) -> Any:
    """The kernels a model runs with under this resolved EngineConfig: the CPU extension with
    attention_backend='cpu' (its glue kernels go with its attention kernel), torch.compile'd ops with
    torch_compile, else None (eager PyTorch)."""
    if config.attention_backend == "cpu":
        from nanoengine.kernels import cpu

        return cpu.load()
    if config.torch_compile:
        from nanoengine.kernels.compiled import CompiledOps

        return CompiledOps()
    return None
