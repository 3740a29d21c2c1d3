"""Executor: runs each step on every rank of the engine and returns what the driver needs. Chapters 05 and 07.

vLLM's executor/worker split: the engine's step loop (`engine/llm_engine.py`) hands a step's `ModelInput` to
its executor and gets back the logits of the sampled rows; how many ranks there are, and where they run, is
the executor's business. The interface:
- `execute(model_input)`: the step on every rank, in lockstep; rank 0's logits [num_sampled, vocab] fp32, or
  None when no row is sampled;
- `collective_rpc(method, *args)`: a ModelRunner method (or fn(runner, *args)) on every rank, one result per
  rank, rank 0 first (vLLM's name);
- `close()`: stop whatever it started; it cannot step afterwards.
Here: `UniprocExecutor`, one rank in this process. The tensor-parallel executor, rank 0 here and the other
ranks in worker processes, is `nanoengine.distributed.executor.MultiprocExecutor`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from nanoengine.engine.inputs import ModelInput
from nanoengine.engine.model_runner import ModelRunner
from nanoengine.layers.tp_group import SINGLE

if TYPE_CHECKING:
    from nanoengine.engine.parts import EngineParts
    from nanoengine.plan import EnginePlan


def call_on(runner: ModelRunner, method: str | Callable, args: tuple) -> Any:
    """runner.method(*args), or method(runner, *args) for a function (how `collective_rpc` runs code)."""
    return method(runner, *args) if callable(method) else getattr(runner, method)(*args)


class Executor(ABC):
    """Rank 0's ModelRunner (`runner`) and however the other ranks run."""
    runner: ModelRunner

    @property
    def num_kv_blocks(self) -> int:
        """The KV blocks every rank holds (the block manager manages this many)."""
        return self.runner.num_blocks

    @property
    def device(self) -> torch.device:
        """Rank 0's device, where the logits come back."""
        return self.runner.device

    @abstractmethod
    def execute(self, model_input: ModelInput) -> torch.Tensor | None:
        """Run one step on every rank; rank 0's logits of the sampled rows [num_sampled, vocab] fp32."""

    @abstractmethod
    def collective_rpc(self, method: str | Callable, *args: Any) -> list[Any]:
        """Run a ModelRunner method (or fn(runner, *args)) on every rank;
        every rank's result, rank 0 first."""

    @abstractmethod
    def close(self) -> None:
        """Stop the ranks this executor started; it cannot step afterwards."""


class UniprocExecutor(Executor):
    """One rank, in this process."""

    def __init__(self, plan: EnginePlan, parts: EngineParts) -> None:
        self.runner = ModelRunner(plan, parts, SINGLE)

    def execute(self, model_input: ModelInput) -> torch.Tensor | None:
        return self.runner.execute(model_input)

    def collective_rpc(self, method: str | Callable, *args: Any) -> list[Any]:
        return [call_on(self.runner, method, args)]

    def close(self) -> None:
        pass  # nothing was started
