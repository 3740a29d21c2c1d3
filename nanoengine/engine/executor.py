"""Executor: runs each step on every rank of the engine and returns what the driver needs. Chapters 05 and 07.

vLLM's executor/worker split: the engine's step loop hands a step's `ModelInput` to its executor (`execute`,
`launch`, `collective_rpc`, `close`); how many ranks there are, and where they run, is the executor's
business. Here: `UniprocExecutor`, one rank in this process; the tensor-parallel one, rank 0 here and the
other ranks in worker processes, is `nanoengine.distributed.executor.MultiprocExecutor`.

Overlap scheduling (chapter 06) lives here too: `launch` runs a step and draws its tokens without making the
caller wait, and hands back a `ForwardOutput` (mini-sglang's name) to wait on later. The executor keeps the
tokens of the step it launched last on the device (`last_tokens`), which the next step's pending input ids
refer to (engine/pending.py), so the host can build step N+1 before step N's tokens reach it. Where the
forward runs:
- on CUDA, in the caller's thread: kernels queue on the stream and the call returns; the tokens are copied to
  pinned memory behind an event, so waiting for them is waiting on that event, never a device sync;
- on CPU with overlap scheduling, on the executor's one thread (`run_on_thread`, which engine/overlap.py's
  loop calls: steps run in launch order, every other call queued behind them), while the caller's thread
  goes on with Python (torch and the C++ decode step release the GIL while they compute);
- otherwise in the caller's thread: `launch` returns when the step is done.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from nanoengine.engine.hooks import NO_REDUCTION, RowReducer
from nanoengine.engine.inputs import ModelInput
from nanoengine.engine.model_runner import ModelRunner
from nanoengine.layers.sampler import Sampler, SamplingBatch
from nanoengine.layers.tp_group import SINGLE

if TYPE_CHECKING:
    from nanoengine.engine.logits_masks import LogitsMask
    from nanoengine.engine.parts import EngineParts
    from nanoengine.layers import logprobs as lp
    from nanoengine.plan import EnginePlan


def call_on(runner: ModelRunner, method: str | Callable, args: tuple) -> Any:
    """runner.method(*args), or method(runner, *args) for a function (how `collective_rpc` runs code)."""
    return method(runner, *args) if callable(method) else getattr(runner, method)(*args)


class ForwardOutput:
    """A launched step's sampled tokens [num_sampled] int64: on the device, then on the host (`tokens()`
    waits for them: an event or a future says when), and when the forward and the draw ran where the host's
    clock sees them (`span`: CPU; None on CUDA, where they run on the device after the launch returned)."""

    def __init__(self, model_input: ModelInput) -> None:
        # held here so that the step's inputs are freed on the host's thread: freed on the forward's thread
        # (CPU overlap) when the pool drops the work item, they made it wait for the GIL until the host
        # blocked, and the next forward started late (views of the host buffers, which numpy arrays share)
        self.model_input = model_input
        self.device_tokens: torch.Tensor | None = None  # None: the step sampled no row
        self.span: tuple[float, float] | None = None  # perf_counter at the start and end of forward + draw
        self.host_tokens: torch.Tensor | None = None  # CUDA: a pinned copy, ready once `ready` has fired
        self.ready: torch.cuda.Event | None = None
        self.future: Future | None = None  # CPU overlap: the forward on the executor's thread
        # the step's logprobs, when a request asked (layers/logprobs.py): its sampled rows', its prompt rows'
        self.sampled_logprobs: lp.RowLogprobs | None = None
        self.prompt_logprobs: lp.RowLogprobs | None = None
        self.generator_states: list[tuple[torch.Generator, torch.Tensor]] = []

    def undo_draws(self) -> None:
        """Put the seeded generators back as they were before this step drew (the step failed)."""
        for generator, state in self.generator_states:
            generator.set_state(state)

    def set(self, tokens: torch.Tensor | None, span: tuple[float, float] | None,
            sampled_logprobs: lp.RowLogprobs | None = None,
            prompt_logprobs: lp.RowLogprobs | None = None) -> None:
        """The draw's tokens (where the forward ran) and the step's logprobs; on CUDA their copies to the host
        start behind an event, without a sync."""
        self.device_tokens, self.span = tokens, span
        self.sampled_logprobs, self.prompt_logprobs = sampled_logprobs, prompt_logprobs
        if tokens is not None and tokens.device.type == "cuda":
            self.host_tokens = to_host(tokens)
            for name in ("sampled_logprobs", "prompt_logprobs"):
                row = getattr(self, name)
                if row is not None:
                    setattr(self, name, type(row)(*map(to_host, row.tensors())))
            self.ready = torch.cuda.Event()
            self.ready.record()

    def tokens(self) -> list[int]:
        """The tokens, once they are known (raises what the step raised)."""
        if self.future is not None:
            self.future.result()
        if self.device_tokens is None:
            return []
        if self.ready is not None:
            self.ready.synchronize()
            return self.host_tokens.tolist()
        return self.device_tokens.tolist()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a CUDA tensor, started without waiting (ready once an event recorded after it
    fires)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class Executor(ABC):
    """Rank 0's ModelRunner (`runner`), the sampler that draws from its logits, and however the other ranks
    run."""
    runner: ModelRunner
    sampler: Sampler  # parts.sampler: the engine's, or the learner's (chapter 05)
    thread: ThreadPoolExecutor | None = None  # where steps run with overlap scheduling on CPU (run_on_thread)
    last_tokens: torch.Tensor | None = None  # the tokens of the step launched last, on rank 0's device

    def run_on_thread(self) -> None:
        """From now on, run every step (and every other call) on one thread of the executor's own, so that
        `launch` returns at once (see the module docstring)."""
        if self.thread is None:
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="nanoengine-forward")

    @property
    def num_kv_blocks(self) -> int:
        """The KV blocks every rank holds (the block manager manages this many)."""
        return self.runner.num_blocks

    @property
    def device(self) -> torch.device:
        """Rank 0's device, where the logits come back."""
        return self.runner.device

    def execute(self, model_input: ModelInput) -> torch.Tensor | None:
        """Run one step on every rank, in lockstep; rank 0's logits of the sampled rows [num_sampled, vocab]
        fp32 (then of its prompt-logprob rows, if any), or None when there are none."""
        return self.on_thread(self.run_step, model_input, self.last_tokens)

    def launch(self, model_input: ModelInput, sampling: SamplingBatch, reducer: RowReducer = NO_REDUCTION,
               mask: LogitsMask | None = None) -> ForwardOutput:
        """Run one step and draw its tokens with rank 0's sampler (the engine's, or the learner's) under
        `sampling` (one row per sampled row), without waiting where the device or the thread allows; its
        `tokens()` waits for them. `reducer`: the step's row reducer, run beside the draw (engine/hooks.py).
        `mask`: the step's logits masks (engine/logits_masks.py), None for none."""
        out = ForwardOutput(model_input)
        if self.thread is not None:
            out.future = self.thread.submit(self.run_and_draw, model_input, sampling, out, reducer, mask)
        else:
            try:
                self.run_and_draw(model_input, sampling, out, reducer, mask)
            except BaseException:
                out.undo_draws()  # (the caller never sees this output: put its draws back here)
                raise
        return out

    @torch.inference_mode()
    def run_and_draw(self, model_input: ModelInput, sampling: SamplingBatch, out: ForwardOutput,
                     reducer: RowReducer = NO_REDUCTION, mask: LogitsMask | None = None) -> None:
        start = time.perf_counter()
        logits = self.run_step(model_input, self.last_tokens)  # [num_sampled (+ prompt rows), vocab]
        num_sampled, drawn_from, tokens = model_input.num_sampled, None, None
        if num_sampled:
            rows = logits[:num_sampled]  # (the prompt-logprob rows come after the sampled ones)
            drawn_from = rows if mask is None else mask.apply(rows)  # [num_sampled, V]
            out.generator_states = [(g, g.get_state()) for _, g in sampling.seeded]
            tokens = self.sampler(drawn_from, sampling)  # [num_sampled]
        self.last_tokens = tokens
        reduced = reducer.reduce(logits, drawn_from, tokens, sampling, num_sampled)  # (logprobs; or nothing)
        out.set(tokens, (start, time.perf_counter()) if self.device.type == "cpu" else None, *reduced)

    def settle(self) -> None:
        """Wait for the steps launched on the thread (whatever they raise is dropped) and forget the last
        tokens: after a failed step, the next one reads nothing of the ones before."""
        if self.thread is not None:
            self.thread.submit(lambda: None).result()
        self.last_tokens = None

    def on_thread(self, fn: Callable, *args: Any) -> Any:
        """fn(*args), behind every step launched before it (on the forward thread, if there is one)."""
        return fn(*args) if self.thread is None else self.thread.submit(fn, *args).result()

    @abstractmethod
    def run_step(self, model_input: ModelInput, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """The step on every rank, with the last step's tokens for the input ids it reads from them."""

    def collective_rpc(self, method: str | Callable, *args: Any) -> list[Any]:
        """Run a ModelRunner method (or fn(runner, *args)) on every rank (vLLM's name); every rank's result,
        rank 0 first."""
        return self.on_thread(self.run_rpc, method, args)

    @abstractmethod
    def run_rpc(self, method: str | Callable, args: tuple) -> list[Any]:
        """collective_rpc, in the thread the steps run in."""

    def close(self) -> None:
        """Stop the ranks this executor started (and its thread); it cannot step afterwards."""
        if self.thread is not None:
            self.thread.shutdown(wait=True)
            self.thread = None
        self.stop_ranks()

    @abstractmethod
    def stop_ranks(self) -> None:
        """Stop whatever ranks this executor started."""


class UniprocExecutor(Executor):
    """One rank, in this process."""

    def __init__(self, plan: EnginePlan, parts: EngineParts) -> None:
        self.runner = ModelRunner(plan, parts, SINGLE)
        self.sampler = parts.sampler

    def run_step(self, model_input: ModelInput, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        return self.runner.execute(model_input, prev_tokens)

    def run_rpc(self, method: str | Callable, args: tuple) -> list[Any]:
        return [call_on(self.runner, method, args)]

    def stop_ranks(self) -> None:
        pass  # nothing was started
