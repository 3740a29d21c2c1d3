"""How a child process ended, in words: a tensor-parallel worker's (`workers.py`) and a data-parallel
replica's (`serve/replicas.py`). Chapter 07.

Plain Python (no torch), so the data-parallel front end may import it.
"""

from __future__ import annotations

import signal


def exit_status(returncode: int) -> str:
    """How a process ended, from its return code (negative: a signal): 'exited with status 1', 'was killed by
    signal 9 (SIGKILL)'."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return f"was killed by signal {-returncode}"
