"""Overlap scheduling's step loop (`async_scheduling`). Chapter 06.

`OverlapLoop` launches step N+1 before it finishes step N, whose forward ran meanwhile, so the host's work for
one hides behind the device's for the other (mini-sglang's shape: one object owns the step in flight and the
error a step deferred). It stands in for the engine's plain `StepLoop` (step.py: schedule -> launch ->
finish, one step per call) when the engine is built with overlap (`assemble()` chooses it); `LLMEngine.step`,
`drain` and `has_unfinished` ask whichever loop the engine holds (`LLMEngine.loop`).

On CUDA the forward's kernels run while the host goes on; on CPU the loop has the executor run its steps on a
thread of their own (`Executor.run_on_thread`), so the host's Python runs beside the forward (torch and the
C++ decode step release the GIL while they compute).

The rules of the overlap loop:
- a call launches the next step, then finishes the one in flight; the first call finishes none, and a step
  that runs nothing is finished at once;
- a step in flight that sampled a sequence with structured outputs is finished first: the next step's grammar
  mask needs its tokens. If the step after it then fails, the finished step's result is returned and the error
  raised by the next call (or by `drain`): nothing that was done is lost;
- whatever fails, the committed steps not yet finished are undone (`LLMEngine.forget_steps`), in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanoengine.engine.interrupts import held_interrupts
from nanoengine.engine.step import LaunchedStep, StepResult

if TYPE_CHECKING:
    from nanoengine.engine.llm_engine import LLMEngine


class OverlapLoop:
    """Overlap scheduling: one step in flight while the next is scheduled (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        if engine.executor.device.type == "cpu":  # (on CUDA the kernels queue, and the launch returns)
            engine.executor.run_on_thread()
        self.in_flight: LaunchedStep | None = None  # launched, not yet finished
        self.deferred_error: BaseException | None = None  # for the next step() or drain() to raise

    def busy(self) -> bool:
        """A step in flight to finish, or an error to raise."""
        return self.in_flight is not None or self.deferred_error is not None

    def step(self) -> StepResult:
        self.raise_deferred()
        first = None
        step = self.in_flight
        if step is not None and self.engine.grammars.samples_grammar(step.scheduled.sampled):
            first = self.drain()  # its result is this call's (the step launched below stays in flight)
        try:
            result = self.launch_next()
        except BaseException as error:
            if first is None:
                raise
            # nothing the drained step finished is lost: its result now, the error at the next call
            self.deferred_error = error  # (busy says there is one)
            return first
        return result if first is None else first

    def launch_next(self) -> StepResult:
        """Launch the next step, then finish the one in flight (or the new one, if it runs nothing)."""
        engine, before = self.engine, self.in_flight
        try:
            launched = engine.schedule_and_launch()  # (undone by itself if that fails)
        except BaseException:
            self.undo([before])
            raise
        if launched.is_empty:
            done, self.in_flight = before or launched, None
        else:
            done, self.in_flight = before, launched  # it runs while the step before finishes
        try:
            return engine.finish(done)
        except BaseException:
            self.undo([done, self.in_flight])
            raise

    def drain(self) -> StepResult:
        """Finish the step in flight, if any, so the engine is idle; an error that a step deferred is raised
        here, if no step raised it since."""
        self.raise_deferred()
        step, self.in_flight = self.in_flight, None
        return self.engine.finish_or_forget(step)

    def raise_deferred(self) -> None:
        if self.deferred_error is not None:  # raised after the step before it, whose result came first
            error, self.deferred_error = self.deferred_error, None
            raise error

    def undo(self, steps: list[LaunchedStep | None]) -> None:
        """The committed steps among `steps` whose tokens are not in place, undone (in order)."""
        self.in_flight = None
        with held_interrupts():  # (a second Ctrl-C waits until the steps are undone)
            self.engine.forget_steps([s for s in steps if s is not None and not s.scheduled.updated])

    def forget(self) -> None:
        self.in_flight = None
