"""Ranks started by a launcher: torchrun on one machine or several, or RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set by hand (vLLM calls this the external launcher). Chapter 07.

Every rank runs the user's script. `launched()` reads what the launcher told this process (the one place
that reads those variables); the plan checks that `tensor_parallel_size` equals the launcher's world size.
The ranks join the launcher's group over its store (`launched_ranks.LauncherRanks`), and rank 0 drives them
as it drives its own workers: it schedules and samples, and every call travels to the others by a
`torch.distributed` broadcast over a gloo group (`channel.BroadcastChannel`), whether the peer is on this
machine or another. On ranks 1..N-1, `LLM(...)` never returns: `worker.serve_launched_rank` runs rank 0's
calls until rank 0 closes, then the process exits with status 0 (so the rest of the script runs on rank 0
alone). A launched rank dies with its launcher (Linux's parent-death signal), so killing a node's torchrun
leaves none of its ranks behind, and rank 0's next collective fails at once (`WorkerError`); told to stop, a
rank serves rank 0 a few seconds more, so a whole job stopped at once (SIGTERM) shuts down cleanly.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from nanoengine.errors import InvalidValueError

if TYPE_CHECKING:  # torch only where a store is made: the data-parallel front end reads launched() too
    import torch.distributed as dist

VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what env:// needs
OPTIONAL = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")  # default: RANK and WORLD_SIZE (one machine); never alone
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_GRACE_S = 5  # a rank told to stop (SIGTERM/SIGINT) serves rank 0 this long more: its own shutdown is 2 s


@dataclass(frozen=True)
class Launched:
    """What the launcher told this process: its rank among all, the ranks on its machine, where the store
    is."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store (every rank a client); else rank 0 hosts it

    @property
    def where(self) -> str:
        return f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}, store at " \
               f"{self.master_addr}:{self.master_port})"


def launched(environ: dict[str, str] | None = None) -> Launched | None:
    """This process's place among the launcher's ranks; None when no launcher started it (none of its
    variables is set) or it started one rank. Some of the variables without the others is an error naming
    both: a launcher sets them all, so a partial set is a mistake, not a single process."""
    env = os.environ if environ is None else environ
    given = [v for v in (*VARIABLES, *OPTIONAL) if env.get(v)]
    if not given:
        return None
    missing = [v for v in VARIABLES if not env.get(v)]
    if missing:  # a partial set is a mistake (a variable left over, or one not exported), never ignored
        def are(names: list[str]) -> str:
            return f"{', '.join(names)} {'is' if len(names) == 1 else 'are'}"
        raise InvalidValueError(f"{are(given)} set but {are(missing)} not: a launcher (torchrun) sets all of "
                                f"{', '.join(VARIABLES)}; set them all, or unset {', '.join(given)} to run "
                                "without one")
    try:
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        port = int(env["MASTER_PORT"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_size = int(env.get("LOCAL_WORLD_SIZE", size))
    except ValueError as e:
        raise InvalidValueError(f"the launcher's variables must be integers ({e}); check RANK, WORLD_SIZE, "
                                "LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_PORT") from None
    if not 0 <= rank < size:
        raise InvalidValueError(f"RANK={rank} must be in 0..WORLD_SIZE-1 (WORLD_SIZE={size})")
    if size == 1:
        return None
    return Launched(rank, size, local_rank, local_size, env["MASTER_ADDR"], port,
                    env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def store(launch: Launched, timeout: timedelta) -> dist.Store:
    """The launcher's store, as env:// finds it: torchrun's agent hosts it, or else rank 0 does."""
    import torch.distributed as dist

    return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                         is_master=launch.rank == 0 and not launch.agent_store, timeout=timeout,
                         wait_for_workers=False)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A function that asks Linux to send the calling process `sig` when its parent `parent` dies, even by
    SIGKILL (PR_SET_PDEATHSIG), and exits at once if the parent is gone already; a no-op off Linux. The C
    function is looked up here, so the result may also run in a forked child before exec (a Popen
    preexec_fn: pass this process's pid). A launcher's rank calls it on itself with its parent's pid."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def ask() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # it died before we asked
            os._exit(1)
    return ask


def exit_soon_when_told(where: str) -> None:
    """On SIGTERM or SIGINT (torchrun forwards them to every rank), keep serving rank 0 for STOP_GRACE_S,
    enough for it to drain its requests and send the stop when the whole job is told to stop, then exit 1:
    a rank stopped alone must not keep rank 0 waiting."""
    def leave_soon(signum: int, frame: Any) -> None:
        def leave() -> None:
            print(f"nanoengine: {where}: {signal.Signals(signum).name}, and rank 0 did not stop the engine "
                  f"within {STOP_GRACE_S} s; exiting", file=sys.stderr, flush=True)
            os._exit(1)
        timer = threading.Timer(STOP_GRACE_S, leave)
        timer.daemon = True
        timer.start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leave_soon)
