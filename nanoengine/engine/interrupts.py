"""Ctrl-C held back while the engine's books are being written. Chapter 05.

A step changes the scheduler's and the block manager's plain-Python state in two short stretches: when it is
scheduled (the batch picked, blocks allocated and hashed, tokens counted as computed) and when its tokens are
put in place (stop rules, blocks cached, text). A KeyboardInterrupt in the middle of either (Ctrl-C, or
"Interrupt kernel" in JupyterLab) would leave them half-written, so `held_interrupts()` defers it to the end
of the stretch, where it is raised as usual. Everywhere else, the forward included (where the time goes and
where Ctrl-C lands almost always), it is raised at once, and the engine undoes the step (`Scheduler.forget`).

Setting a signal handler is a system call (~6 us), too slow to do twice per stretch at every step, so the
first held stretch puts one handler in front of the one in place (`Held.handler`): outside a stretch it hands
the signal on at once; inside, it keeps it until the stretch ends. Whatever handler is set later is wrapped
the same way at the next stretch. Only the main thread receives signals, and only it can set their handlers:
elsewhere (the server's engine thread) this does nothing.
"""

from __future__ import annotations

import _signal  # signal.getsignal without its enum conversion, which costs ~2.5 us when a handler is set
import signal
import threading
from types import FrameType
from typing import Any

MAIN = threading.main_thread().ident


class Held:
    """The context manager `held_interrupts()` returns (one per process; stretches nest)."""

    def __init__(self) -> None:
        self.depth = 0  # open stretches
        self.caught: tuple[int, FrameType | None] | None = None  # a SIGINT that came during one
        self.behind: Any = None  # the handler in place when ours was put in front of it

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.depth:
            self.caught = self.caught or (signum, frame)
        else:
            self.hand_on(signum, frame)

    def hand_on(self, signum: int, frame: FrameType | None) -> None:
        behind = self.behind
        if callable(behind):
            behind(signum, frame)  # the default handler raises KeyboardInterrupt here
        elif behind == signal.SIG_DFL:
            raise KeyboardInterrupt

    def __enter__(self) -> None:
        if threading.get_ident() != MAIN:
            return
        if self.depth:
            self.depth += 1
            return
        current = _signal.getsignal(signal.SIGINT.value)
        if current != self.handler:
            if current is None:  # a handler not set from Python: it could not be handed on; hold nothing
                return
            self.behind = current
            signal.signal(signal.SIGINT, self.handler)
        self.depth = 1

    def __exit__(self, *exc: Any) -> None:
        if not self.depth or threading.get_ident() != MAIN:
            return
        self.depth -= 1
        if not self.depth and self.caught is not None:
            caught, self.caught = self.caught, None
            self.hand_on(*caught)


HELD = Held()


def held_interrupts() -> Held:
    """A `with` block during which a Ctrl-C waits, then is delivered when the block ends."""
    return HELD
