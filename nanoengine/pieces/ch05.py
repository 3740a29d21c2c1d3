"""Chapter 05's pieces in the engine: a Scheduler whose step is your `schedule` (with your admission and
preemption), and a Sampler that draws with your `sample` (with your filter chain).

Your `schedule(sched)` already works on the engine's Scheduler state (its queues, budget and block manager),
so the subclass calls it as its `pick` (who runs and how many tokens each); the scheduler then commits your
SchedulerOutput, and the engine builds the inputs, runs the model and updates the sequences as it does with
its own. The sampler hands your `sample` each row's parameters as lists (top-k
-1, top-p 1.0 and min-p 0.0 when a row does not filter) and the engine's generators.
"""

from __future__ import annotations

from types import ModuleType

import torch

from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.errors import InvalidValueError
from nanoengine.layers.sampler import Sampler, SamplingBatch
from nanoengine.pieces.learner import check_result, piece


def scheduler_class(module: ModuleType, base: type[Scheduler] = Scheduler) -> type[Scheduler]:
    schedule = piece(module, "schedule", "ch05")

    class LearnerScheduler(base):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if self.policy != "fcfs":  # an option is done as asked, or refused
                raise InvalidValueError(
                    f"use_exercises: your Exercise 5.2 schedules first come, first served; scheduling_policy="
                    f"{self.policy!r} needs the engine's own scheduler (leave 'ch05' out of use_exercises, "
                    "or use scheduling_policy='fcfs')")

        def pick(self) -> SchedulerOutput:
            out = schedule(self)
            check_result(isinstance(out, SchedulerOutput), schedule,
                         f"a {type(out).__name__}; it must return a SchedulerOutput")
            return out

    return LearnerScheduler


class LearnerSampler(Sampler):
    def __init__(self, module: ModuleType, seed: int = 0) -> None:
        super().__init__(seed)
        self.sample = piece(module, "sample", "ch05")  # (it calls your process_logits)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # logits [B, V] fp32 -> next token ids [B]
        B, V = logits.shape

        def rows(t: torch.Tensor | None, off: float) -> list:
            return [off] * B if t is None else t.tolist()

        top_ks = [-1 if k >= V else k for k in rows(batch.top_ks, V)]
        tokens = self.sample(logits, batch.temperatures.tolist(), top_ks, rows(batch.top_ps, 1.0),
                             rows(batch.min_ps, 0.0), batch.generators, self.shared_generator(logits.device))
        check_result(len(tokens) == B, self.sample, f"{len(tokens)} tokens for {B} rows")
        return torch.tensor([int(t) for t in tokens], dtype=torch.int64, device=logits.device)
