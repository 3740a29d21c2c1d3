"""A fault injected into the engine thread, for the server's failure tests. Chapter 05 (appendix).

`NANOENGINE_INJECT_FAULT=<ExceptionName>@<step>` (RuntimeError or MemoryError) makes the AsyncEngine raise
that exception in place of the engine's step number <step>, so a test sees what a real failure mid-step does:
every request in flight gets the error, and the server exits with status 1.
"""

from __future__ import annotations

import os

FAULT_ENV = "NANOENGINE_INJECT_FAULT"  # "RuntimeError@3" raises in place of the 3rd step
FAULTS = {"RuntimeError": RuntimeError, "MemoryError": MemoryError}


def injected_fault() -> tuple[type[Exception], int] | None:
    """The fault NANOENGINE_INJECT_FAULT asks for: (exception class, step number), or None."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    name, _, step = spec.partition("@")
    if name not in FAULTS or not step.isdigit() or int(step) < 1:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected <{'|'.join(FAULTS)}>@<step number >= 1>")
    return FAULTS[name], int(step)
