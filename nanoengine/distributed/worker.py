"""A tensor-parallel worker: the loop every rank but 0 runs (`serve_calls`), the program rank 0 starts for
its local workers (`python -m nanoengine.distributed.worker FD RANK PORT THREADS PARENT`), and what a
launcher's ranks 1..N-1 do inside `LLM(...)` (`serve_launched_rank`). Chapter 07.

`serve_calls` builds the rank's ModelRunner from rank 0's plan, then runs rank 0's calls in order until it
is told to stop (or rank 0 goes away); it reads them from a `Channel` (channel.py), so it is the same loop for
a local worker and for a launcher's rank on another machine. A call that raises posts its traceback and ends
the process at once.

Local workers are started with this command, not with multiprocessing's spawn, so the user's script is never
imported again in a worker: a script that builds a tensor-parallel `LLM` at top level, without
`if __name__ == "__main__":`, works as vLLM users write it. FD is this process's end of a socket pair with
rank 0, whose first message (`Start`) carries rank 0's sys.path, so that a function `collective_rpc` sends by
name is importable here as it is there (its module's; one defined in the script is refused by rank 0).
PARENT is rank 0's pid: a local worker ends when rank 0 does (`exit_with`). Ctrl-C is rank 0's (workers.py).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from nanoengine.distributed import launcher
from nanoengine.distributed.channel import HOST, Channel, PipeChannel, Shutdown, to_device


def serve_calls(plan: Any, rank: int, group: Any, channel: Channel, local_rank: int) -> bool:
    """Build this rank's runner, then run rank 0's calls until Shutdown (True) or rank 0 is gone (False)."""
    from nanoengine.engine.executor import call_on
    from nanoengine.engine.model_runner import ModelRunner
    from nanoengine.engine.parts import assemble

    try:
        runner = ModelRunner(plan, assemble(plan), group, local_rank)
        while True:
            try:
                call = channel.receive()
            except EOFError:
                return False
            if isinstance(call, Shutdown):
                return True
            result = call_on(runner, call.method, to_device(call.args, runner.device))
            if call.reply:
                channel.reply(to_device(result, "cpu"))
    except BaseException:
        try:
            channel.post_error(traceback.format_exc())
        finally:
            os._exit(1)  # at once: rank 0's collectives fail as our sockets close


def serve_launched_rank(plan: Any, launch: launcher.Launched) -> None:
    """Ranks 1..N-1 under a launcher: join the group, serve rank 0's calls until it closes, then exit 0."""
    from nanoengine.distributed.launched_ranks import LauncherRanks

    launcher.exit_soon_when_told(launch.where)
    ranks = LauncherRanks(plan, launch)
    plan = ranks.receive_plan()  # rank 0's: every rank builds from the same plan
    told_to_stop = serve_calls(plan, launch.rank, ranks.group, ranks.channel, launch.local_rank)
    ranks.leave()
    if not told_to_stop:
        print(f"nanoengine: {launch.where}: rank 0 went away without closing the engine; stopping",
              file=sys.stderr, flush=True)
    raise SystemExit(0 if told_to_stop else 1)


def exit_with(parent: int) -> None:
    """End this process (status 1) as soon as rank 0, its parent, has ended: its sockets closing already
    fail a wait on them, but not when another process holds them too (one the user's code forked)."""
    if os.getppid() != parent:  # it ended before we looked
        os._exit(1)

    def watch() -> None:
        try:
            fd = os.pidfd_open(parent)  # readable once it has ended (Linux)
            select.select([fd], [], [])
        except (AttributeError, OSError):  # elsewhere: look now and then
            while os.getppid() == parent:
                time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, name="nanoengine-rank0-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us cleanly
    conn = Connection(int(argv[1]))
    rank, port, threads, parent = map(int, argv[2:6])
    exit_with(parent)
    channel = PipeChannel([conn])
    try:
        start = channel.receive()
    except EOFError:
        return  # rank 0 went away before sending anything
    import torch

    from nanoengine.distributed.group import init_process_group

    try:
        plan = start.load_plan()
        torch.set_num_threads(threads)
        channel.reply("hello")
        group = init_process_group(plan.dist_backend, HOST, port, rank, plan.tensor_parallel_size)
    except BaseException:
        try:
            channel.post_error(traceback.format_exc())
        finally:
            os._exit(1)
    told_to_stop = serve_calls(plan, rank, group, channel, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if told_to_stop else 1)  # at once: tearing torch down here only keeps rank 0 waiting


if __name__ == "__main__":
    main(sys.argv)
