"""The data-parallel replicas as processes: each an ordinary `nanoengine serve` on loopback, started, read,
and stopped from the front end (`data_parallel.py`). Chapter 07 (beyond one machine).

A `Replica` runs `python -m nanoengine serve MODEL --port 0 ...` (the OS picks its port, which it prints on
its first line; no race for one), its output copied to our stderr with each line prefixed, and dies with
the front end however that ends (Linux's PR_SET_PDEATHSIG: SIGTERM, its own clean shutdown). Its
environment (`replica_env`) holds its torch threads (`replica_threads`: the cores split between the
replicas), the front end's API key and, on GPUs, its own devices (`gpus_for`: its tensor-parallel size of
the visible ones, in order). How it ended reads as `distributed.exits.exit_status` says.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from typing import Any

from nanoengine.distributed import launcher
from nanoengine.distributed.exits import exit_status
from nanoengine.errors import InvalidValueError


class Replica:
    """One `nanoengine serve` process on loopback; its output goes to our stderr, each line prefixed."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str]) -> None:
        self.index = index
        dies_with_us = launcher.die_with_parent(os.getpid(), signal.SIGTERM)  # its own clean shutdown
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, preexec_fn=dies_with_us)
        self.url: str | None = None  # http://127.0.0.1:PORT, once it listens
        self.about = ""  # its startup line's (device, dtype, KV blocks)
        self.ready = threading.Event()  # it printed its address, or its output ended
        self.tail: deque[str] = deque(maxlen=20)  # its last lines, for a startup failure's message
        self._reader = threading.Thread(target=self._read, name=f"replica-{index}-log", daemon=True)

    def start_reading(self) -> None:
        """Its output to our stderr, from a thread (started once every replica is forked: no thread may run
        while another replica forks)."""
        self._reader.start()

    @property
    def name(self) -> str:
        return f"replica {self.index} (pid {self.proc.pid})"

    def wait_listening(self) -> None:
        """Until it prints its address; a RuntimeError with how it ended and its last output if it ends
        first."""
        while not self.ready.wait(0.5):
            pass
        if self.url is None:
            self.wait(5)
            lines = "\n  ".join(self.tail) or "(no output)"
            raise RuntimeError(f"{self.name} did not start: it {self.status()}; its last output:\n  {lines}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            found = re.search(r" on (http://\S+)/v1 ?(.*)", line) if self.url is None else None
            if found:
                self.url, self.about = found.group(1), found.group(2)
                self.ready.set()
                continue
            self.tail.append(line)
            print(f"nanoengine serve [replica {self.index}]: {line.removeprefix('nanoengine serve: ')}",
                  file=sys.stderr, flush=True)
        self.ready.set()

    def status(self) -> str | None:
        """How it ended ('exited with status 1', ...), or None while it runs."""
        code = self.proc.poll()
        return None if code is None else exit_status(code)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Until it exits (SIGKILL after `timeout` seconds); its output read to the end."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._reader.ident is not None:  # started
            self._reader.join(5)


def start_replicas(size: int, argv: list[str], threads: int, key: str,
                   gpus: list[list[str]] | None) -> list[Replica]:
    """`size` replicas running `argv`, each reading its output once all are forked."""
    replicas = [Replica(i, argv, replica_env(threads, key, gpus and gpus[i])) for i in range(size)]
    for r in replicas:
        r.start_reading()
    return replicas


def replica_env(threads: int, key: str, gpus: list[str] | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NANOENGINE_API_KEY": key, "PYTHONUNBUFFERED": "1"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def gpus_for(size: int, engine_options: dict[str, Any]) -> list[list[str]] | None:
    """Each replica's GPUs (its tensor-parallel size of the visible ones, in order), None on a CPU; an error
    with too few GPUs."""
    if engine_options.get("device") == "cpu":
        return None
    import torch

    count, tp = torch.cuda.device_count(), engine_options.get("tensor_parallel_size", 1)
    if count == 0:
        return None
    if count < size * tp:
        raise InvalidValueError(f"--data-parallel-size {size} gives each replica its own {tp} GPU(s), but "
                                f"{count} are visible; use fewer replicas, or --device cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    return [ids[i * tp:(i + 1) * tp] for i in range(size)]


def replica_threads(size: int, threads: int | None = None) -> int:
    """Torch threads per replica: `threads`, or the cores this process may run on split between them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return threads or max(1, cores // size)
