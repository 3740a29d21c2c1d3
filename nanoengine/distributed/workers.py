"""Ranks 1..N-1 started by rank 0 on this machine, each as its own program (worker.py says why), talked to
over a socket pair and watched through Linux's pidfd. Chapter 07.

They run in a process group of their own, so the terminal's Ctrl-C (or a notebook's interrupt, sent to the
kernel's process group) reaches rank 0 alone, which stops them. They stop on `close()`, when the engine is
garbage-collected, and at interpreter exit.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanoengine.distributed import launcher
from nanoengine.distributed.channel import HOST, Call, ErrorReply, PipeChannel, Reply, Shutdown, Start
from nanoengine.distributed.exits import exit_status
from nanoengine.distributed.group import ALREADY_IN_A_GROUP, COLLECTIVE_TIMEOUT, init_process_group
from nanoengine.distributed.ranks import Ranks
from nanoengine.errors import InvalidValueError, WorkerError

STARTUP_TIMEOUT_S = 120  # a worker must be up (imports done) within this


class WorkerProcess:
    """A worker started as its own program (subprocess.Popen), seen as a multiprocessing.Process is: `pid`,
    `sentinel` (a descriptor that turns readable when it ends: Linux's pidfd; None elsewhere, where its end is
    noticed by its socket closing), `is_alive`, `join`, `kill`, `exitcode` (negative: killed by a signal)."""

    def __init__(self, rank: int, port: int, threads: int) -> None:
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        fd = theirs.detach()
        package_root = str(Path(__file__).resolve().parents[2])  # importable there as it is here
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root,
                                                                      os.environ.get("PYTHONPATH")) if p)}
        for var in launcher.VARIABLES:  # a launcher's variables are not this worker's
            env.pop(var, None)
        try:
            self.popen = subprocess.Popen([sys.executable, "-m", "nanoengine.distributed.worker", str(fd),
                                           str(rank), str(port), str(threads), str(os.getpid())],
                                          pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL, process_group=0)
        finally:
            os.close(fd)
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()

    def close(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


def stop(procs: list, conns: list[Connection], threads: int) -> None:
    """Ask every worker to stop, kill what does not within 5 s, and leave the process group."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(Shutdown()))
        except OSError:
            pass
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        proc.close()
    for conn in conns:
        conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)


class LocalWorkers(Ranks):
    """Ranks 1..N-1 started by rank 0 on this machine (which joins the group here too)."""

    def __init__(self, plan: Any) -> None:
        if dist.is_initialized():  # before spawning anything (init_process_group checks again)
            raise RuntimeError(ALREADY_IN_A_GROUP)
        self.size = plan.tensor_parallel_size
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.local_rank = 0
        threads_before = torch.get_num_threads()
        threads = max(1, threads_before // self.size) if plan.device == "cpu" else threads_before
        # the finalizer holds the lists, not self: it runs on close(), garbage collection or interpreter exit
        self._finalizer = weakref.finalize(self, stop, self.procs, self.conns, threads_before)
        torch.set_num_threads(threads)  # on CPU the ranks share the cores
        self.store = dist.TCPStore(HOST, 0, self.size, is_master=True, wait_for_workers=False,
                                   timeout=COLLECTIVE_TIMEOUT)  # port 0: the OS picks a free one
        self.channel = PipeChannel(self.conns)
        try:
            for rank in range(1, self.size):
                proc = WorkerProcess(rank, self.store.port, threads)
                self.procs.append(proc)
                self.conns.append(proc.conn)
            self.deliver(Start.of(plan, list(sys.path)))
            for i in range(len(self.procs)):
                self.receive(i, STARTUP_TIMEOUT_S, starting=True)  # "hello": up, and joining the group
            self.group = init_process_group(plan.dist_backend, HOST, self.store.port, 0, self.size,
                                            self.store)
        except BaseException:  # (Ctrl-C included): they serve nothing yet, so they end at once
            self.kill()
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check_sendable(self, method: str | Callable) -> None:
        """A function of the user's script: the workers, their own program, never import it. (A launcher's
        ranks all run the script, so there it is found.)"""
        if callable(method) and getattr(method, "__module__", None) == "__main__":
            raise InvalidValueError(
                f"collective_rpc: {getattr(method, '__qualname__', method)!r} is defined in your script "
                "(__main__), which the workers, their own program, do not import (pickle sends functions by "
                "name); define it in a module you import, or pass a ModelRunner method's name")

    def close(self) -> None:
        self._finalizer()

    def kill(self) -> None:
        for proc in list(self.procs):
            if proc.is_alive():
                proc.kill()

    def deliver(self, message: Start | Call) -> None:
        try:
            self.channel.send(message)
        except OSError:  # a worker is gone: find which, and raise with why
            for i in range(len(self.conns)):
                if not self.procs[i].is_alive():
                    self.receive(i, timeout=5)
            raise

    def replies(self) -> list[Any]:
        return [self.receive(i).value for i in range(len(self.conns))]

    def receive(self, i: int, timeout: float | None = None, starting: bool = False) -> Reply:
        """Worker i's next message; a WorkerError if it sent an error, ended, or was silent for `timeout`."""
        conn, proc, rank = self.conns[i], self.procs[i], i + 1
        ready = wait([x for x in (conn, proc.sentinel) if x is not None], timeout)
        msg = None
        if conn in ready:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                msg = None
        if isinstance(msg, Reply):
            return msg
        if isinstance(msg, ErrorReply):
            why = f"tensor-parallel worker rank {rank} failed:\n{msg.traceback}"
        else:
            proc.join(1 if ready else 0)
            code = proc.exitcode
            why = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                   + ("stopped answering" if code is None else exit_status(code))
                   + ("" if ready else f" (no answer within {timeout} s)"))
            if starting:
                why += (" while starting (`python -m nanoengine.distributed.worker`: its own error, if any, "
                        "is printed above)")
        raise self.broken(WorkerError(why))

    def check(self) -> None:
        """Raise if the group broke earlier, or if a worker has failed since the last call."""
        super().check()
        for i, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            if conn.poll() or not proc.is_alive():  # nothing is owed to us between calls: an error, or an end
                self.receive(i, timeout=1)
                raise self.broken(WorkerError(f"tensor-parallel worker rank {i + 1} "
                                              "sent an unexpected message"))

    def failure(self, within_s: float, during: BaseException) -> WorkerError | None:
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs) if p.sentinel is not None}
        conns = {id(c): i for i, c in enumerate(self.conns)}
        for obj in wait([*self.conns, *sentinels], within_s):
            i = sentinels[obj] if obj in sentinels else conns[id(obj)]
            try:
                self.receive(i, timeout=1)
            except WorkerError as err:
                return err
        return None


