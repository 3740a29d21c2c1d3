"""The other ranks of a tensor-parallel engine, seen from rank 0: start or join them, send each call, notice
when one fails, and stop them. Chapter 07.

Rank 0 is the user's process: it schedules, builds the inputs and samples (`distributed/executor.py` drives
the ranks through a `Ranks`). Two kinds, one interface (`send`, `replies`, `lockstep`, `close`):
- `LocalWorkers`: rank 0 starts ranks 1..N-1 on this machine as their own program (`python -m
  nanoengine.distributed.worker`, so the user's script is not imported again there) and talks to each over a
  socket pair (`channel.PipeChannel`), watching its exit through Linux's pidfd;
- `LauncherRanks`: a launcher (torchrun) started every rank, on one machine or several (`launcher.py`); the
  calls travel by broadcast over a gloo group (`channel.BroadcastChannel`).
Every rank runs the same loop (`worker.serve_calls`): build its ModelRunner from rank 0's plan (its shard of
the model and KV cache, the learner's pieces included), then run rank 0's calls in order; the all-reduces
inside the forward keep them in lockstep.

Failure is loud and quick:
- a worker that raises posts its traceback and exits; rank 0's next collective fails at once (the peer's
  sockets close), and rank 0 raises `WorkerError` with that traceback;
- a worker killed by a signal (or a node whose launcher was killed: its ranks die with it) is noticed the
  same way, or, for a local worker, before the next step by its exit;
- after any failure the others are stopped (a launcher's ranks: rank 0 leaves the group, so their next
  collective fails and they exit), so nothing hangs and no process is orphaned;
- Ctrl-C during a step is held until the step ends, so that the ranks never fall out of step, for at most
  HOLD_S: a step that has not ended by then (or a second Ctrl-C) is abandoned, the workers are killed, and the
  engine is broken (build a new LLM); local workers run in a process group of their own, so the terminal's
  Ctrl-C reaches rank 0 alone, and each ends when rank 0 does.
The ranks stop on `close()`, when the engine is garbage-collected, and at interpreter exit.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanoengine.distributed import launcher
from nanoengine.distributed.channel import (
    HOST,
    BroadcastChannel,
    Call,
    ErrorReply,
    PipeChannel,
    Reply,
    Shutdown,
    Start,
    to_device,
)
from nanoengine.distributed.exits import exit_status
from nanoengine.distributed.group import ALREADY_IN_A_GROUP, COLLECTIVE_TIMEOUT, init_process_group
from nanoengine.engine.inputs import ModelInput
from nanoengine.errors import InvalidValueError, WorkerError

STARTUP_TIMEOUT_S = 120  # a worker must be up (imports done) within this


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


class Ranks(ABC):
    """Ranks 1..N-1 seen from rank 0, joined with it in one group (`group`: rank 0's TPGroup)."""
    size: int
    error: str | None = None  # why the group broke, once it has

    def send(self, method: str | Callable, args: tuple, reply: bool = False) -> None:
        """Send one call to every other rank (tensors travel by value, through host memory). A step's
        ModelInput goes as the input builder's host copy of it (`ModelInput.host_side`): copying its device
        tensors back would wait for the step in flight, and the host could never run ahead (overlap)."""
        self.check()
        self.check_sendable(method)
        args = tuple(a.host_side() if isinstance(a, ModelInput) else a for a in args)
        self.deliver(Call(method, to_device(args, "cpu", copy=True), reply))

    def check_sendable(self, method: str | Callable) -> None:  # noqa: B027 - a hook: nothing to refuse here
        """Refuse a call the other ranks cannot look up by name (pickle sends functions by name)."""

    @abstractmethod
    def deliver(self, message: Start | Call) -> None:
        """Put one message on the way to every other rank."""

    @abstractmethod
    def replies(self) -> list[Any]:
        """Every other rank's result of the last call sent with reply=True."""

    @abstractmethod
    def failure(self, within_s: float, during: BaseException) -> WorkerError | None:
        """Why a call failed, if another rank failed (or fails within `within_s`); None if the fault is
        ours."""

    @abstractmethod
    def close(self) -> None:
        """Stop (or leave) the other ranks; safe to call twice."""

    def check(self) -> None:
        """Raise if the group broke earlier."""
        if self.error is not None:
            raise WorkerError("the tensor-parallel workers were stopped after a failure "
                              f"({self.error.splitlines()[0]}); build a new LLM")

    def broken(self, err: Exception) -> Exception:
        """Record why the group broke, stop every worker, and return err to raise."""
        if self.error is None:
            self.error = str(err)
            self.close()
        return err

    @contextmanager
    def lockstep(self) -> Iterator[None]:
        """Wrap code every rank runs together (every call of MultiprocExecutor). Any failure inside breaks the
        group: a collective fails when a peer died or raised (then the peer's own error is what we raise), and
        if rank 0 raised, the workers are left waiting in a collective, so they are stopped either way. Ctrl-C
        waits for the block to end (`sigint_held`); one that waited too long abandons it, which stops the
        workers too."""
        try:
            with sigint_held(self.abandon):
                try:
                    yield
                except WorkerError:
                    raise
                except BaseException as e:
                    if self.abandoned:
                        raise
                    cause = self.failure(within_s=2, during=e)
                    self.broken(cause or e)
                    if cause is not None:
                        raise cause from e
                    raise
        except BaseException:
            if self.abandoned:  # (also when it came as the block ended)
                if self.error is None:
                    self.error = "interrupted (Ctrl-C) in the middle of a step"
                self.close()
            raise

    abandoned = False  # a Ctrl-C held too long stopped the other ranks in the middle of a call

    def abandon(self) -> None:
        """Stop the other ranks now, in the middle of a call (any thread may call it: the Ctrl-C timer's)."""
        self.abandoned = True
        self.kill()

    @abstractmethod
    def kill(self) -> None:
        """End the other ranks at once, wherever they are (or do nothing where they cannot be reached)."""


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
            # its own process group: the terminal's Ctrl-C (a notebook's interrupt) reaches rank 0 alone
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
