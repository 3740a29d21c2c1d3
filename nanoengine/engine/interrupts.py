"""Ctrl-C held back while the engine's books are being written. Chapter 05.

A step changes the scheduler's and the block manager's plain-Python state in two short stretches: when it is
scheduled (the batch picked, blocks allocated and hashed, tokens counted as computed) and when its tokens are
put in place (stop rules, blocks cached, text). A KeyboardInterrupt in the middle of either (Ctrl-C, or
"Interrupt kernel" in JupyterLab) would leave them half-written, so `held_interrupts()` defers it to the end
of the stretch, where it is raised as usual. Everywhere else, the forward included (where the time goes and
where Ctrl-C lands almost always), it is raised at once, and the engine undoes the step (`Scheduler.forget`).

Setting a signal handler is a system call (~6 us), too slow to do twice per stretch at every step, so the
first held stretch puts one handler in front of Python's standard one (`Held.handler`) and leaves it there:
outside a stretch it hands the signal on at once; inside, it keeps it until the stretch ends. A handler of
someone's own (set for a while, perhaps) is stood in front of for one stretch only, and put back after it.
Only the main thread receives signals, and only it can set their handlers: elsewhere (the server's engine
thread) this does nothing.
"""

from __future__ import annotations

import _signal  # signal.getsignal without its enum conversion, which costs ~2.5 us when a handler is set
import signal
import threading
from types import FrameType
from typing import Any

MAIN = threading.main_thread().ident
# Python's own handlers (and the raw ints `_signal.getsignal` gives for the two constants)
STANDARD = (signal.default_int_handler, signal.SIG_DFL, signal.SIG_IGN, int(signal.SIG_DFL),
            int(signal.SIG_IGN))


class Held:
    """The context manager `held_interrupts()` returns (one per process; stretches nest)."""

    def __init__(self) -> None:
        self.depth = 0  # open stretches
        self.caught: tuple[int, FrameType | None] | None = None  # a SIGINT that came during one
        self.behind: Any = None  # the standard handler ours stays in front of (Python's default, or none)
        self.stretch: Any = None  # a handler of someone's own that ours stands in front of for one stretch

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.depth:
            self.caught = self.caught or (signum, frame)
        else:
            self.hand_on(self.behind, signum, frame)

    @staticmethod
    def hand_on(handler: Any, signum: int, frame: FrameType | None) -> None:
        if callable(handler):
            handler(signum, frame)  # the default handler raises KeyboardInterrupt here
        elif handler == signal.SIG_DFL:
            raise KeyboardInterrupt

    def __enter__(self) -> None:
        if threading.get_ident() != MAIN:
            return
        if self.depth:
            self.depth += 1
            return
        current = _signal.getsignal(signal.SIGINT.value)
        if current is None:  # a handler not set from Python: it could not be handed on; hold nothing
            return
        if current != self.handler:
            if current in STANDARD:  # ours stays in front of it for good: no system call per stretch
                self.behind = current
            else:  # someone's own handler (perhaps for a while): in front of it for this stretch only
                self.stretch = current
            signal.signal(signal.SIGINT, self.handler)
        self.depth = 1

    def __exit__(self, *exc: Any) -> None:
        if not self.depth or threading.get_ident() != MAIN:
            return
        self.depth -= 1
        if self.depth:
            return
        target, caught = self.behind, self.caught
        self.caught = None
        if self.stretch is not None:
            target, self.stretch = self.stretch, None
            signal.signal(signal.SIGINT, target)  # theirs again
        if caught is not None:
            self.hand_on(target, *caught)


HELD = Held()


def held_interrupts() -> Held:
    """A `with` block during which a Ctrl-C waits, then is delivered when the block ends."""
    return HELD
