"""Forming the process group of a tensor-parallel engine. Chapter 07.

`init_process_group` joins this process to the group over a TCP store on a port the OS picked (rank 0 hosts
it) and returns its rank's `TPGroup` (nanoengine.layers.tp_group: the collectives the layers call).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from nanoengine.layers.tp_group import TPGroup

# A collective waits at most this long for a peer that is alive but stuck; a peer that died is noticed at once
# (its sockets close). A step's collectives are one decoder layer apart, so this is only ever a backstop.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
ALREADY_IN_A_GROUP = ("this process already has a torch.distributed process group (another tensor-parallel "
                      "LLM still alive?); close it first (llm.close() or del llm)")


def init_process_group(backend: str, host: str, port: int, rank: int, size: int,
                       store: dist.Store | None = None,
                       timeout: timedelta = COLLECTIVE_TIMEOUT) -> TPGroup:
    """Join the group (rank 0 passes the store it hosts; the others connect to host:port)."""
    if dist.is_initialized():
        raise RuntimeError(ALREADY_IN_A_GROUP)
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return TPGroup(rank, size)
