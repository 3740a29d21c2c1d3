"""Which of a C++ kernel's paths this build has, for the int8 and W8A8 kernel tests (test_quant.py,
test_w8a8.py): each asks int8_linear for every path on a tiny packed weight."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def int8_paths_built(kernels: Any, packed: torch.Tensor, scales: torch.Tensor,
                     paths: Sequence[str]) -> list[str]:
    """The paths of `paths` that int8_linear runs for this packed 16 x 4 weight (group 4); one that is not
    compiled here must say so ("not in this build"), any other error fails the test."""
    built = []
    for path in paths:
        try:
            kernels.int8_linear(torch.zeros(1, 4), packed, scales, None, 16, 4, path)
            built.append(path)
        except RuntimeError as e:
            assert "not in this build" in str(e)
    return built
