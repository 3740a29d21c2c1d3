"""Ctrl-C during a call every tensor-parallel rank runs together: held until the call ends, so the ranks
never fall out of step, but for at most HOLD_S. Chapter 07.

A call still running by then (a kernel built on first use, a long prefill on a busy machine, a stuck rank),
or a second Ctrl-C, abandons it: the other ranks are stopped, so a collective waiting on them fails at once,
and KeyboardInterrupt is raised. `Ranks.lockstep` (ranks.py) wraps every call in `sigint_held`.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

HOLD_S = 3.0  # how long Ctrl-C waits for the step (or start-up) in progress to end before abandoning it


@contextmanager
def sigint_held(abandon: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold Ctrl-C until the block ends, then deliver it (main thread only: signals arrive there); but at
    most HOLD_S: a block still running then (a kernel built on first use, a long prefill on a busy machine, a
    rank that is stuck) is abandoned: `abandon()` runs (it stops the other ranks, so that a collective waiting
    on them fails at once) and KeyboardInterrupt is raised inside the block. A second Ctrl-C abandons at once.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    lock = threading.Lock()
    state: dict[str, Any] = {"frame": None, "timer": None, "expired": False, "done": False, "pending": False}

    def on_sigint(signum: int, frame: Any) -> None:
        with lock:
            state["pending"] = False  # (the expiry's interrupt, if it sent one, is this call)
            if state["done"]:  # as the block ended: one Ctrl-C is delivered below anyway
                return
            first = state["frame"] is None
            state["frame"] = state["frame"] or frame
            if first and not state["expired"]:
                timer = state["timer"] = threading.Timer(HOLD_S, expire)
                timer.daemon = True
                timer.start()
                return
        abandon()  # a second Ctrl-C, or the first one held too long
        raise KeyboardInterrupt

    def expire() -> None:  # the timer's thread
        with lock:
            if state["done"]:
                return
            state["expired"] = True
            abandon()  # from here: a collective the main thread waits in fails now
            state["pending"] = True  # then on_sigint raises in the main thread (a wait there ends: EINTR)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        with lock:
            state["done"] = True
            if state["timer"] is not None:
                state["timer"].cancel()
        deadline = time.monotonic() + 1  # the expiry's interrupt reaches on_sigint, not the handler restored
        while state["pending"] and time.monotonic() < deadline:
            time.sleep(0.001)
        signal.signal(signal.SIGINT, previous)
        if state["frame"] is not None:
            if callable(previous):
                previous(signal.SIGINT, state["frame"])  # the default handler raises KeyboardInterrupt
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt

