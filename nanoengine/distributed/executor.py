"""MultiprocExecutor: a tensor-parallel engine's ranks, rank 0's ModelRunner in this process and the others
driven through a `Ranks` (ranks.py), stepped in lockstep. Chapter 07.

Every call (a step, an RPC) is sent to the other ranks, then run here; the collectives inside the forward
keep the ranks together, and rank 0 alone gets the gathered logits (so only its sampler draws: the ranks can
never disagree on a token).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from nanoengine.distributed.ctrl_c import HOLD_S
from nanoengine.distributed.launched_ranks import LauncherRanks
from nanoengine.distributed.launcher import Launched
from nanoengine.distributed.workers import LocalWorkers
from nanoengine.engine.executor import Executor, call_on
from nanoengine.engine.inputs import ModelInput
from nanoengine.engine.model_runner import ModelRunner
from nanoengine.engine.parts import EngineParts
from nanoengine.plan import EnginePlan


class MultiprocExecutor(Executor):
    def __init__(self, plan: EnginePlan, parts: EngineParts, launch: Launched | None = None) -> None:
        # started (or joined); they build their runners from rank 0's plan while rank 0 builds its own
        self.workers = LocalWorkers(plan) if launch is None else LauncherRanks(plan, launch)
        try:
            with self.workers.lockstep():
                self.runner = ModelRunner(plan, parts, self.workers.group, self.workers.local_rank)
            self.sampler = parts.sampler
        except BaseException:  # (Ctrl-C included) no engine: stop them now, not when the traceback is dropped
            self.workers.close()
            raise

    def run_step(self, model_input: ModelInput, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        with self.workers.lockstep():
            self.workers.send("execute", (model_input,))  # they take prev_tokens from rank 0 (ModelRunner)
            return self.runner.execute(model_input, prev_tokens)

    def run_rpc(self, method: str | Callable, args: tuple) -> list[Any]:
        with self.workers.lockstep():
            self.workers.send(method, args, reply=True)
            mine = call_on(self.runner, method, args)
            return [mine, *self.workers.replies()]

    def settle(self) -> None:
        """After a failed step (Ctrl-C included) with overlap on CPU: the steps on the forward thread get
        HOLD_S to end; one that does not (a rank is stuck) is abandoned: the workers are stopped, so its
        collectives fail now instead of holding this thread (and the interpreter's exit) forever."""
        if self.thread is not None:
            try:
                self.thread.submit(lambda: None).result(timeout=HOLD_S)
            except FutureTimeout:
                self.workers.abandon()
        super().settle()

    def stop_ranks(self) -> None:
        self.workers.close()
