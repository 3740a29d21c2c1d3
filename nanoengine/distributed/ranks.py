"""The other ranks of a tensor-parallel engine, seen from rank 0: one interface (`send`, `replies`,
`lockstep`, `close`) over two kinds. Chapter 07.

Rank 0 is the user's process: it schedules, builds the inputs and samples. The others run worker.py's loop.
- `LocalWorkers` (workers.py): rank 0 starts ranks 1..N-1 on this machine (`channel.PipeChannel`);
- `LauncherRanks` (launched_ranks.py): a launcher (torchrun) started every rank, on one machine or several
  (`channel.BroadcastChannel`).
Failure is loud and quick:
- a rank that raises posts its traceback and exits; rank 0's next collective fails at once (the peer's
  sockets close), and rank 0 raises `WorkerError` with that traceback;
- a rank killed by a signal (or a node whose launcher was killed) is noticed the same way, or, for a local
  worker, before the next step by its exit;
- after any failure the others are stopped, so nothing hangs and no process is orphaned;
- Ctrl-C during a call is held until it ends, for at most HOLD_S (ctrl_c.py); then the call is abandoned, the
  other ranks are stopped, and the engine is broken (build a new LLM).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from nanoengine.distributed.channel import Call, Start, to_device
from nanoengine.distributed.ctrl_c import sigint_held
from nanoengine.engine.inputs import ModelInput
from nanoengine.errors import WorkerError


class Ranks(ABC):
    """Ranks 1..N-1 seen from rank 0, joined with it in one group (`group`: rank 0's TPGroup)."""
    size: int
    error: str | None = None  # why the group broke, once it has

    def send(self, method: str | Callable, args: tuple, reply: bool = False) -> None:
        """Send one call to every other rank (tensors travel by value, through host memory; a step's
        ModelInput as its host copy, `ModelInput.host_side`, so the host can run ahead of the step in
        flight)."""
        self.check()
        self.check_sendable(method)
        args = tuple(a.host_side() if isinstance(a, ModelInput) else a for a in args)
        self.deliver(Call(method, to_device(args, "cpu", copy=True), reply))

    def check_sendable(self, method: str | Callable) -> None:  # noqa: B027 - a hook: nothing to refuse here
        """Refuse a call the other ranks cannot look up by name (pickle sends functions by name)."""

    @abstractmethod
    def deliver(self, message: Start | Call) -> None:
        """Put one message on the way to every other rank."""

    @abstractmethod
    def replies(self) -> list[Any]:
        """Every other rank's result of the last call sent with reply=True."""

    @abstractmethod
    def failure(self, within_s: float, during: BaseException) -> WorkerError | None:
        """Why a call failed, if another rank failed (or fails within `within_s`); None if the fault is
        ours."""

    @abstractmethod
    def close(self) -> None:
        """Stop (or leave) the other ranks; safe to call twice."""

    def check(self) -> None:
        """Raise if the group broke earlier."""
        if self.error is not None:
            raise WorkerError("the tensor-parallel workers were stopped after a failure "
                              f"({self.error.splitlines()[0]}); build a new LLM")

    def broken(self, err: Exception) -> Exception:
        """Record why the group broke, stop every worker, and return err to raise."""
        if self.error is None:
            self.error = str(err)
            self.close()
        return err

    @contextmanager
    def lockstep(self) -> Iterator[None]:
        """Wrap code every rank runs together (every call of MultiprocExecutor). Any failure inside breaks the
        group (see the module docstring): if rank 0 raised, the workers are left waiting in a collective, so
        they are stopped either way. Ctrl-C waits for the block to end (`sigint_held`)."""
        try:
            with sigint_held(self.abandon):
                try:
                    yield
                except WorkerError:
                    raise
                except BaseException as e:
                    if self.abandoned:
                        raise
                    cause = self.failure(within_s=2, during=e)
                    self.broken(cause or e)
                    if cause is not None:
                        raise cause from e
                    raise
        except BaseException:
            if self.abandoned:  # (also when it came as the block ended)
                if self.error is None:
                    self.error = "interrupted (Ctrl-C) in the middle of a step"
                self.close()
            raise

    abandoned = False  # a Ctrl-C held too long stopped the other ranks in the middle of a call

    def abandon(self) -> None:
        """Stop the other ranks now, in the middle of a call (any thread may call it: the Ctrl-C timer's)."""
        self.abandoned = True
        self.kill()

    @abstractmethod
    def kill(self) -> None:
        """End the other ranks at once, wherever they are (or do nothing where they cannot be reached)."""

