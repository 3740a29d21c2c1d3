"""Ctrl-C held back while the engine's books are being written. Chapter 05.

A step changes the scheduler's and the block manager's plain-Python state in two short stretches: when it is
scheduled (the batch picked, blocks allocated and hashed, tokens counted as computed) and when its tokens are
put in place (stop rules, blocks cached, text). A KeyboardInterrupt in the middle of either (Ctrl-C, or
"Interrupt kernel" in JupyterLab) would leave them half-written, so `held_interrupts()` defers it to the end
of the stretch, where it is raised as usual. Everywhere else, the forward included (where the time goes and
where Ctrl-C lands almost always), it is raised at once, and the engine undoes the step (`Scheduler.forget`).

Only the main thread receives signals, and only it can set their handlers: elsewhere (the server's engine
thread) this does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def held_interrupts() -> Iterator[None]:
    """Run the block with SIGINT deferred: a Ctrl-C that arrives meanwhile is delivered when it ends."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # (None: a handler not set from Python, which could not be put back)
        return
    caught: list[tuple[int, object]] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    except ValueError:  # not the main interpreter (signals cannot be set here)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])  # the default handler raises KeyboardInterrupt here
        elif caught and previous == signal.SIG_DFL:
            raise KeyboardInterrupt
