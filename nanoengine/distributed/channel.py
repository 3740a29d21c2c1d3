"""How rank 0's calls reach the other ranks of a tensor-parallel engine, and their replies and errors come
back. Chapter 07.

One interface, two ways:
- `BroadcastChannel`: a `torch.distributed` broadcast of the pickled call over a gloo group of its own (a
  fixed buffer of `FIRST` bytes, which a decode step's call fits, then the rest of a longer message), the
  replies by `gather_object`, a rank's traceback through the group's store. It works wherever the ranks
  are, on this machine or on several (the launcher's ranks use it). Its group never times out: an idle
  server's ranks wait for the next step as long as it takes; a peer that dies closes its sockets, which
  fails the wait at once.
- `PipeChannel`: a socket pair to each worker that rank 0 started on this machine (one pickled message per
  worker, beside Linux's pidfd that names how a worker ended). Measured against the broadcast on this
  machine (`python -m nanoengine.bench.tp_launch`), a step cost the same within the noise.
The messages (`Start`, then a `Call` per step or RPC, then `Shutdown`) are small dataclasses, pickled.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # local workers' store and group (a launcher's ranks use its MASTER_ADDR)
IDLE_TIMEOUT = timedelta(days=365)  # a worker waits for rank 0's next call as long as the engine idles
ERROR_KEY = "nanoengine/error/{rank}"


# ------------------------------------------------------------------ the messages (slots: quick to pickle)
@dataclass(slots=True)
class Start:
    """What every worker receives first: rank 0's sys.path (local workers; None for a launcher's, which have
    their own) and its plan, pickled inside so that the path is in place before the plan is read."""
    sys_path: list[str] | None
    pickled_plan: bytes

    @classmethod
    def of(cls, plan: Any, sys_path: list[str] | None) -> Start:
        return cls(sys_path, pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))

    def load_plan(self) -> Any:
        """The plan, after putting rank 0's sys.path (if sent) ahead of this process's."""
        if self.sys_path:
            sys.path[:0] = [p for p in self.sys_path if p not in sys.path]
        return pickle.loads(self.pickled_plan)  # (after the path: the plan may name the learner's files)


@dataclass(slots=True)
class Call:
    """Run `method` (a ModelRunner method's name, or a function) on `args`; `reply`: send the result back."""
    method: str | Callable
    args: tuple
    reply: bool = False


@dataclass(slots=True)
class Shutdown:
    """The message that ends a worker's loop."""


@dataclass(slots=True)
class Reply:
    """A local worker's answer over its pipe: a call's result (or "hello" once it has started)."""
    value: Any


@dataclass(slots=True)
class ErrorReply:
    """A local worker's traceback, sent over its pipe before it exits."""
    traceback: str


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


# ------------------------------------------------------------------ the channels


class Channel(ABC):
    """Rank 0 `send`s; a worker `receive`s, `reply`s and `post_error`s (the worker loop sees only this).
    How rank 0 reads replies and errors back is its `Ranks`' business (ranks.py): a pipe's are read beside
    the worker's exit sentinel, a broadcast channel's are gathered."""

    @abstractmethod
    def send(self, message: Any) -> None:
        """Rank 0: one message to every other rank."""

    @abstractmethod
    def receive(self) -> Any:
        """A worker: rank 0's next message (EOFError when rank 0 has gone)."""

    @abstractmethod
    def reply(self, obj: Any) -> None:
        """A worker: its reply to the message it received last."""

    @abstractmethod
    def post_error(self, text: str) -> None:
        """A worker: leave its traceback where rank 0 looks after a failed call."""


class BroadcastChannel(Channel):
    FIRST = 64 * 1024  # bytes every call broadcasts at once: an 8-byte length, then the pickled message

    def __init__(self, rank: int, size: int, store: dist.Store) -> None:
        self.rank, self.size, self.store = rank, size, store
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)  # every rank calls this, in order
        self.first = torch.zeros(self.FIRST, dtype=torch.uint8)  # [FIRST]

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        payload = torch.frombuffer(bytearray(len(data).to_bytes(8, "little") + data), dtype=torch.uint8)
        head = min(len(payload), self.FIRST)
        self.first[:head] = payload[:head]
        dist.broadcast(self.first, src=0, group=self.group)
        if len(payload) > self.FIRST:
            dist.broadcast(payload[self.FIRST:].clone(), src=0, group=self.group)

    def replies(self) -> list[Any]:
        """Rank 0: each other rank's reply (rank 1 first)."""
        gathered: list[Any] = [None] * self.size
        dist.gather_object(None, gathered, dst=0, group=self.group)
        return gathered[1:]

    def receive(self) -> Any:
        try:
            dist.broadcast(self.first, src=0, group=self.group)
            size = 8 + int.from_bytes(self.first[:8].numpy().tobytes(), "little")
            data = self.first[8:size].numpy().tobytes()
            if size > self.FIRST:
                rest = torch.empty(size - self.FIRST, dtype=torch.uint8)  # [the rest of the message]
                dist.broadcast(rest, src=0, group=self.group)
                data += rest.numpy().tobytes()
        except RuntimeError as e:  # its sockets closed: rank 0 has gone
            raise EOFError(str(e)) from e
        return pickle.loads(data)

    def reply(self, obj: Any) -> None:
        dist.gather_object(obj, None, dst=0, group=self.group)

    def post_error(self, text: str) -> None:
        self.store.set(ERROR_KEY.format(rank=self.rank), text)

    def error_of(self, rank: int) -> str | None:
        """The traceback rank `rank` posted, if it did."""
        key = ERROR_KEY.format(rank=rank)
        return self.store.get(key).decode() if self.store.check([key]) else None


class PipeChannel(Channel):
    """Rank 0 holds one connection per worker (`conns`); a worker holds its one (`conns == [conn]`)."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)  # OSError when the worker is gone: the caller asks why

    def receive(self) -> Any:
        try:
            return pickle.loads(self.conns[0].recv_bytes())
        except OSError as e:
            raise EOFError(str(e)) from e

    def reply(self, obj: Any) -> None:
        self.conns[0].send_bytes(pickle.dumps(Reply(obj)))

    def post_error(self, text: str) -> None:
        self.conns[0].send_bytes(pickle.dumps(ErrorReply(text)))
