"""Run one function on N fresh processes joined in a gloo group, and collect what each returns. Chapter 07.

`run_on_ranks(fn, size, *args)` spawns `size` processes, joins them in one `torch.distributed` group (gloo,
over a TCP store that this process hosts on a port the OS picks), calls `fn(*args)` on every rank at once
and returns the results by rank. What a rank raises comes back as a `RankFailure` (its type, message and
traceback) instead of its result, so the caller decides what to say; a collective that one rank never
reaches fails after `timeout` seconds instead of hanging. `fn` must be importable by name (defined at a
module's top level): spawned processes unpickle it by reference.

This is how chapter 07's exercise tests run the learner's collectives, and how the chapter measures the
all-reduce a decode step pays (nanoengine/bench/tp_cost.py). The engine's own ranks are started by
`workers.py`, which also keeps them alive between steps.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import get_context
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist

from nanoengine.distributed.group import init_process_group
from nanoengine.errors import WorkerError

START_S = 30  # what a fresh rank may take to start (import torch, join the group) on a busy machine


@dataclass(frozen=True)
class RankFailure:
    """What a rank raised instead of returning: the exception's type name, its message, the traceback."""
    rank: int
    type_name: str
    message: str
    traceback: str


def run_on_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 30.0) -> list[Any]:
    """fn(*args) on `size` fresh processes in one gloo group: each rank's result (or RankFailure), by rank."""
    ctx = get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, args, r, size, store.port, timeout, queue), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:  # a rank's start (importing torch) and its work, then a collective timeout at most
            rank, data = queue.get(timeout=timeout + START_S)
            results[rank] = pickle.loads(data)
    except Empty:
        silent = sorted(set(range(size)) - set(results))
        raise WorkerError(f"run_on_ranks: {len(silent)} of {size} ranks sent no result within "
                          f"{timeout + START_S:.0f} s (ranks {silent})") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(size)]


def _rank_main(fn: Callable[..., Any], args: tuple, rank: int, size: int, port: int, timeout: float,
               queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        init_process_group("gloo", "127.0.0.1", port, rank, size, timeout=timedelta(seconds=timeout))
        result: Any = fn(*args)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller, named
        result = RankFailure(rank, type(e).__name__, str(e), traceback.format_exc())
    try:
        # by value (the queue's own pickler would share tensors through fds this process takes away with it)
        queue.put((rank, pickle.dumps(result)))
    except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be pickled
        queue.put((rank, pickle.dumps(RankFailure(rank, type(e).__name__, str(e), traceback.format_exc()))))
    if dist.is_initialized():
        dist.destroy_process_group()
