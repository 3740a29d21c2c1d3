"""Compiled kernels, built, cached and loaded in one place. Chapters 03 and 06.

- `cpu`: the C++ CPU extension (paged decode attention; fused RMSNorm, rotary and SwiGLU).

The engine picks the kernels once (`for_config`) and passes them to the model when it is built: RMSNorm,
rotary and the MLP take them in their constructors, so no module is patched after construction.
`python -m nanoengine.kernels` builds them now (`make assets` does).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def for_config(config: Any) -> ModuleType | None:
    """The kernels a model runs with under this resolved EngineConfig: the CPU extension with
    attention_backend='cpu' (its glue kernels go with its attention kernel), else None (eager PyTorch)."""
    if config.attention_backend == "cpu":
        from nanoengine.kernels import cpu

        return cpu.load()
    return None
