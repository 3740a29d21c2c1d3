"""Every rank started by a launcher (torchrun), joined in its group, seen from rank 0 as `Ranks`; on ranks
1..N-1 the same class only joins and receives. Chapter 07.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch.distributed as dist

from nanoengine.distributed import launcher
from nanoengine.distributed.channel import BroadcastChannel, Call, Shutdown, Start
from nanoengine.distributed.group import ALREADY_IN_A_GROUP, COLLECTIVE_TIMEOUT, init_process_group
from nanoengine.distributed.ranks import Ranks
from nanoengine.errors import InvalidValueError, WorkerError


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class LauncherRanks(Ranks):
    """Every rank started by a launcher (torchrun), joined in its group; rank 0's side drives the others.
    The same class on ranks 1..N-1 only joins and receives (`receive_plan`, then `worker.serve_calls`)."""

    joined = False  # this process has joined its launcher's ranks once (they serve one engine, then exit)

    def __init__(self, plan: Any, launch: launcher.Launched) -> None:
        if dist.is_initialized():
            raise RuntimeError(ALREADY_IN_A_GROUP)
        if LauncherRanks.joined:
            raise InvalidValueError("under a launcher (torchrun) a job serves one tensor-parallel engine: "
                                    "the other ranks stopped when the first one closed; build one LLM per "
                                    "job (or keep the first one open)")
        LauncherRanks.joined = True
        launcher.die_with_parent(os.getppid())()  # a node whose torchrun is killed leaves no rank behind
        self.size, self.rank, self.local_rank = launch.world_size, launch.rank, launch.local_rank
        self.where = launch.where
        store = launcher.store(launch, COLLECTIVE_TIMEOUT)
        self.group = init_process_group(plan.dist_backend, launch.master_addr, launch.master_port,
                                        launch.rank, launch.world_size, store)
        self.channel = BroadcastChannel(launch.rank, launch.world_size, store)
        self._finalizer = weakref.finalize(self, self.shut_down, self.channel) if launch.rank == 0 else None
        if launch.rank == 0:
            self.deliver(Start.of(plan, None))

    @staticmethod
    def shut_down(channel: BroadcastChannel) -> None:
        """Rank 0, at close or exit: tell the others to stop, then leave the group."""
        try:
            channel.send(Shutdown())
        except RuntimeError:
            pass  # they are gone already
        leave_group()

    def receive_plan(self) -> Any:
        """Ranks 1..N-1: rank 0's plan, which every rank builds its runner from."""
        return self.channel.receive().load_plan()

    def leave(self) -> None:
        leave_group()

    def kill(self) -> None:
        """Nothing: the ranks may be on other machines. The launcher sends Ctrl-C to every rank, and each
        leaves within its STOP_GRACE_S (`launcher.exit_soon_when_told`), which fails rank 0's collective."""

    def deliver(self, message: Start | Call) -> None:
        self.channel.send(message)

    def replies(self) -> list[Any]:
        return self.channel.replies()

    def close(self) -> None:
        if self.error is not None:  # broken: leaving the group fails the others' next collective; they exit
            self._finalizer.detach()
            leave_group()
        else:
            self._finalizer()

    def failure(self, within_s: float, during: BaseException) -> WorkerError | None:
        # a rank that raises posts its traceback (the store acknowledges it) before it exits, so before its
        # sockets close and our collective fails: one look is enough, and a fault of our own costs none
        for rank in range(1, self.size):
            posted = self.channel.error_of(rank)
            if posted is not None:
                return WorkerError(f"tensor-parallel rank {rank} failed:\n{posted}")
        if isinstance(during, RuntimeError) and is_peer_gone(during):
            return WorkerError(f"a tensor-parallel rank stopped: {str(during).splitlines()[0]} (the launcher "
                               "started the ranks: its log on that machine says which one ended, and why)")
        return None


def is_peer_gone(err: RuntimeError) -> bool:
    """A collective that failed because a peer's connection closed or went silent."""
    text = str(err)
    return any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "Timed out",
                                   "timed out"))
