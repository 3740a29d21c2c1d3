"""The worker processes of a tensor-parallel engine, seen from rank 0: start them, send each step, notice
when one fails, and stop them. Chapter 07.

Rank 0 is the user's process: it schedules, builds the inputs and samples (`distributed/executor.py` drives
the ranks). `Workers` starts ranks 1..N-1 as their own program (`python -m nanoengine.distributed.worker`,
so the user's script is not imported again there), each running `worker_main`: join the process group,
assemble the same parts from the plan it is sent (the learner's pieces included), build its ModelRunner
(its shard of the model and KV cache), then run whatever rank 0 sends, in the same order. A step is sent once
per worker, pickled whole, over a socket pair (no size limit, no shared-memory names to clash), and every
rank then runs it in
lockstep: the all-reduces inside the forward keep them together.

Failure is loud and quick:
- a worker that raises sends its traceback and exits; rank 0's next collective fails at once (the peer's
  sockets close), and rank 0 raises `WorkerError` with that traceback;
- a worker killed by a signal is noticed the same way, or before the next step by its exit code;
- after any failure the others are stopped, so nothing hangs and no process is orphaned;
- Ctrl-C during a step is held until the step ends, so that the ranks never fall out of step; the workers
  ignore it themselves (the terminal sends it to them too) and rank 0 stops them.
The processes stop on `close()`, when the engine is garbage-collected, and at interpreter exit.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanoengine.distributed.group import ALREADY_IN_A_GROUP, COLLECTIVE_TIMEOUT, init_process_group
from nanoengine.engine.executor import call_on
from nanoengine.engine.model_runner import ModelRunner
from nanoengine.engine.parts import assemble
from nanoengine.errors import InvalidValueError

HOST = "127.0.0.1"  # every rank on this machine (see the README for spanning machines)
SHUTDOWN = "shutdown"
STARTUP_TIMEOUT_S = 120  # a worker must be up (imports done) within this


class WorkerError(RuntimeError):
    """A tensor-parallel worker raised, exited or was killed; the message carries its traceback or its end."""


def to_device(obj: Any, device: torch.device | str, copy: bool = False) -> Any:
    """obj with every tensor in it (inside lists, tuples, dicts and dataclasses) moved to device; copy=True
    copies even a tensor already there (a view pickles its whole storage; its copy only its own elements)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=copy)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device, copy) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device, copy) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device, copy)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


@contextmanager
def sigint_held() -> Iterator[None]:
    """Hold Ctrl-C until the block ends, then deliver it (main thread only: signals arrive there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[0])  # the default handler raises KeyboardInterrupt
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt


class WorkerProcess:
    """A worker started as its own program (subprocess.Popen), seen as a multiprocessing.Process is: `pid`,
    `sentinel` (a descriptor that turns readable when it ends: Linux's pidfd; None elsewhere, where its end is
    noticed by its socket closing), `is_alive`, `join`, `kill`, `exitcode` (negative: killed by a signal)."""

    def __init__(self, rank: int, plan: Any, port: int, threads: int) -> None:
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        fd = theirs.detach()
        package_root = str(Path(__file__).resolve().parents[2])  # importable there as it is here
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root,
                                                                      os.environ.get("PYTHONPATH")) if p)}
        try:
            self.popen = subprocess.Popen([sys.executable, "-m", "nanoengine.distributed.worker", str(fd)],
                                          pass_fds=(fd,), env=env)
        finally:
            os.close(fd)
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        data = pickle.dumps((plan, rank, port, threads), protocol=pickle.HIGHEST_PROTOCOL)
        self.conn.send_bytes(pickle.dumps((list(sys.path), data)))

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


def describe_exit(rank: int, proc: Any) -> str:
    code = proc.exitcode
    if code is None:
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) stopped answering"
    if code < 0:
        return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) was killed by "
                f"{signal.Signals(-code).name}")
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"


def stop(procs: list, conns: list[Connection], threads: int) -> None:
    """Ask every worker to stop, kill what does not within 5 s, and leave the process group."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps((SHUTDOWN, (), False)))
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


class Workers:
    """Ranks 1..N-1 of a tensor-parallel engine, started by rank 0 (which joins the group here too)."""

    def __init__(self, plan: Any) -> None:
        if dist.is_initialized():  # before spawning anything (init_process_group checks again)
            raise RuntimeError(ALREADY_IN_A_GROUP)
        self.size = plan.tensor_parallel_size
        self.error: str | None = None  # why the group broke, once it has
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        threads_before = torch.get_num_threads()
        threads = max(1, threads_before // self.size) if plan.device == "cpu" else threads_before
        # the finalizer holds the lists, not self: it runs on close(), garbage collection or interpreter exit
        self._finalizer = weakref.finalize(self, stop, self.procs, self.conns, threads_before)
        torch.set_num_threads(threads)  # on CPU the ranks share the cores
        self.store = dist.TCPStore(HOST, 0, self.size, is_master=True, wait_for_workers=False,
                                   timeout=COLLECTIVE_TIMEOUT)  # port 0: the OS picks a free one
        try:
            for rank in range(1, self.size):
                proc = WorkerProcess(rank, plan, self.store.port, threads)
                self.procs.append(proc)
                self.conns.append(proc.conn)
            for i in range(len(self.procs)):
                self.receive(i, STARTUP_TIMEOUT_S, starting=True)  # "hello": up, and joining the group
            self.group = init_process_group(plan.dist_backend, HOST, self.store.port, 0, self.size,
                                            self.store)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------------------------------ messages
    def send(self, method: str | Callable, args: tuple, reply: bool = False) -> None:
        """Send one call to every worker (tensors travel by value, through host memory)."""
        self.check()
        if callable(method) and getattr(method, "__module__", None) == "__main__":
            raise InvalidValueError(
                f"collective_rpc: {getattr(method, '__qualname__', method)!r} is defined in your script "
                "(__main__), which the workers, their own program, do not import (pickle sends functions by "
                "name); define it in a module you import, or pass a ModelRunner method's name")
        data = pickle.dumps((method, to_device(args, "cpu", copy=True), reply),
                            protocol=pickle.HIGHEST_PROTOCOL)
        for i, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self.receive(i, timeout=5)  # the worker is gone: raises with why

    def replies(self) -> list[Any]:
        """Every worker's result of the last call sent with reply=True."""
        return [self.receive(i)[1] for i in range(len(self.conns))]

    def receive(self, i: int, timeout: float | None = None, starting: bool = False) -> tuple:
        """Worker i's next message; a WorkerError if it sent an error, ended, or was silent for `timeout`."""
        conn, proc, rank = self.conns[i], self.procs[i], i + 1
        ready = wait([x for x in (conn, proc.sentinel) if x is not None], timeout)
        msg = None
        if conn in ready:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                msg = None
        if msg is not None and msg[0] != "error":
            return msg
        if msg is not None:
            why = f"tensor-parallel worker rank {rank} failed:\n{msg[1]}"
        else:
            proc.join(1 if ready else 0)
            why = describe_exit(rank, proc) + ("" if ready else f" (no answer within {timeout} s)")
            if starting:
                why += (" while starting (`python -m nanoengine.distributed.worker`: its own error, if any, "
                        "is printed above)")
        raise self.broken(WorkerError(why))

    def check(self) -> None:
        """Raise if the group broke earlier, or if a worker has failed since the last call."""
        if self.error is not None:
            raise WorkerError("the tensor-parallel workers were stopped after a failure "
                              f"({self.error.splitlines()[0]}); build a new LLM")
        for i, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            if conn.poll() or not proc.is_alive():  # nothing is owed to us between calls: an error, or an end
                self.receive(i, timeout=1)
                raise self.broken(WorkerError(f"tensor-parallel worker rank {i + 1} "
                                              "sent an unexpected message"))

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
        if rank 0 raised, the workers are left waiting in a collective, so they are stopped either way."""
        with sigint_held():
            try:
                yield
            except WorkerError:
                raise
            except BaseException as e:
                cause = self.failed_worker(within_s=2)
                self.broken(cause or e)
                if cause is not None:
                    raise cause from e
                raise

    def failed_worker(self, within_s: float) -> WorkerError | None:
        """The error of a worker that has failed, or fails within `within_s` seconds; None if all are well."""
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs) if p.sentinel is not None}
        conns = {id(c): i for i, c in enumerate(self.conns)}
        for obj in wait([*self.conns, *sentinels], within_s):
            i = sentinels[obj] if obj in sentinels else conns[id(obj)]
            try:
                self.receive(i, timeout=1)
            except WorkerError as err:
                return err
        return None


def worker_main(plan: Any, rank: int, port: int, conn: Connection, threads: int) -> None:
    """A worker process: join the group, build this rank's ModelRunner, then serve rank 0's calls in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us cleanly
    try:
        torch.set_num_threads(threads)
        conn.send_bytes(pickle.dumps(("hello", rank)))
        group = init_process_group(plan.dist_backend, HOST, port, rank, plan.tensor_parallel_size)
        runner = ModelRunner(plan, assemble(plan), group)
        while True:
            try:
                method, args, reply = pickle.loads(conn.recv_bytes())
            except EOFError:
                break  # rank 0 is gone: nothing left to serve
            if method == SHUTDOWN:
                break
            result = call_on(runner, method, to_device(args, runner.device))
            if reply:
                conn.send_bytes(pickle.dumps(("ok", to_device(result, "cpu"))))
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        finally:
            os._exit(1)  # at once: rank 0's collectives fail as our sockets close
    if dist.is_initialized():
        dist.destroy_process_group()
