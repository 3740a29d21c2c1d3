"""What an engine step is while it runs (`LaunchedStep`) and what it gives back (`StepResult`); how busy the
engine is (`EngineLoad`); the plain step loop (`StepLoop`). Chapters 05 and 06.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from nanoengine.engine.executor import ForwardOutput
    from nanoengine.engine.inputs import PromptRows
    from nanoengine.engine.llm_engine import LLMEngine
    from nanoengine.engine.request import Request
    from nanoengine.engine.scheduler_output import SchedulerOutput
    from nanoengine.engine.sequence import Sequence
    from nanoengine.trace import StepStats


class StepTimes(NamedTuple):
    """perf_counter readings of one step's launch."""
    started: float  # scheduling began
    scheduled: float  # the scheduler returned (and committed the step)
    built: float  # its inputs and sampling parameters were laid out
    launched: float  # the executor returned (the forward runs on, or has run)


@dataclass
class LaunchedStep:
    """A step the engine has scheduled and started (with overlap scheduling one is in flight while the next
    launches): the executor's `forward` holds its tokens, on the device, then on the host."""
    scheduled: SchedulerOutput
    forward: ForwardOutput | None  # None: nothing was scheduled
    times: StepTimes
    prompt_rows: list[PromptRows] = field(default_factory=list)  # its prompt-logprob rows, in order

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing the scheduler did (a step that ran nothing but preempted is a step)."""
        return self.forward is None and not self.scheduled.preempted


class TextDelta(NamedTuple):
    request: Request
    index: int  # which completion of the request
    text: str


@dataclass
class StepResult:
    """What `LLMEngine.step()` returns for the step it finished (`LLM`, the server and the benchmarks read
    this, not the engine's attributes); `stats` is None when a call finished no step (overlap's first)."""
    deltas: list[TextDelta] = field(default_factory=list)  # new text, for every token that made some
    sampled: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # the tokens each sequence got
    finished: list[Request] = field(default_factory=list)  # the requests whose last completion ended here
    stats: StepStats | None = None


class EngineLoad(NamedTuple):
    """How busy the engine is between steps (what a server's queue limit and metrics read)."""
    num_running: int  # sequences running (scheduled in the last step or decoding)
    num_waiting: int  # sequences queued or preempted
    num_used_blocks: int
    num_blocks: int

class StepLoop:
    """One step per call: schedule -> launch -> finish."""

    in_flight: LaunchedStep | None = None  # (never one)

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def busy(self) -> bool:
        return False

    def step(self) -> StepResult:
        engine = self.engine
        return engine.finish_or_forget(engine.schedule_and_launch())

    def drain(self) -> StepResult:
        return StepResult()

    def forget(self) -> None:
        pass
