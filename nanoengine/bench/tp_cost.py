"""When tensor parallelism pays for decode: the bytes a decode step all-reduces against the weight bytes each
rank no longer reads, and the all-reduce time measured here over gloo. Chapter 07.

A decode step is bound by reading the weights: one rank reads all of them, at the device's memory bandwidth.
With N ranks each reads 1/N of every linear weight (the norms stay whole), so the step saves
    (1 - 1/N) * linear weight bytes / memory bandwidth,
and pays, in nanoengine's layout, 2 all-reduces per decoder layer (after o_proj and after down_proj) plus
one after the vocab-parallel embedding, each of [batch, hidden] activations, and a gather of the logits
[batch, vocab] (float32) to rank 0. A ring all-reduce of M bytes sends 2 (N - 1) / N * M bytes from every
rank, so one costs about
    latency + 2 (N - 1) / N * M / link bandwidth,
and the gather latency + (N - 1) / N * its bytes / link bandwidth. The weights saved do not grow with the
batch, the messages do: TP pays below a break-even batch (`break_even_batch`), if the per-step latency
alone does not already eat the saving. What the model leaves out, on purpose: the KV-cache reads (each rank
reads only its KV heads, which favours TP more at long contexts), compute (large batches stop being bound by
memory), and overlap of communication with compute.

The link figures are assumptions, stated where they are defined (`PCIE4_X16`, `NVLINK_H100`, `H100_HBM3`);
`measure_gloo_all_reduce` times real all-reduces between two processes on this machine
(nanoengine.distributed.spawn), to set beside them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from nanoengine.models.hf_config import ModelShape


@dataclass(frozen=True)
class Link:
    """How fast ranks talk: bandwidth in bytes/s per direction, and the fixed cost of one collective (s)."""
    name: str
    bandwidth: float
    latency: float


# Assumptions (round figures, not measurements): PCIe 4.0 x16 moves 32 GB/s raw per direction, ~25 GB/s in
# practice; H100 SXM NVLink 4 is 900 GB/s total, 450 GB/s per direction. The latencies are the order of a
# small NCCL all-reduce between two GPUs (a few microseconds over NVLink, more through the host's PCIe).
PCIE4_X16 = Link("PCIe 4.0 x16", 25e9, 15e-6)
NVLINK_H100 = Link("NVLink (H100)", 450e9, 5e-6)
# Between machines (chapter 07, "beyond one machine"): an InfiniBand NDR port moves 400 Gb/s = 50 GB/s per
# direction, ~20 us for a small NCCL all-reduce across two nodes; 100 Gb/s Ethernet with TCP ~11 GB/s and
# ~50 us (no RDMA: every message through both kernels' network stacks).
INFINIBAND_NDR = Link("InfiniBand NDR (2 nodes)", 50e9, 20e-6)
ETHERNET_100G = Link("100 Gb Ethernet, TCP (2 nodes)", 11e9, 50e-6)
LINKS = (NVLINK_H100, PCIE4_X16, INFINIBAND_NDR, ETHERNET_100G)
H100_HBM3 = 3.35e12  # bytes/s, an H100 SXM's memory bandwidth (assumed for every case)

QWEN3_0_6B = ModelShape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                        vocab=151936, tied=True, dtype_bytes=2, qk_norm=True)
QWEN3_8B = ModelShape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                      vocab=151936, tied=False, dtype_bytes=2, qk_norm=True)


@dataclass(frozen=True)
class DecodeTPCost:
    """One decode step of `batch` sequences over `ranks` ranks (times in seconds, sizes in bytes)."""
    model: str
    link: str
    ranks: int
    batch: int
    all_reduces: int  # per step: 2 per decoder layer + 1 after the embedding
    all_reduced_bytes: int  # the messages' total: all_reduces * batch * hidden * dtype bytes
    gathered_bytes: int  # the logits gathered to rank 0: batch * vocab * 4
    weight_bytes: int  # what one process reads per step
    weight_bytes_saved_per_rank: int  # (1 - 1/N) of the linear weights
    weights_time_one: float  # reading all the weights at memory bandwidth, one process
    weights_time_per_rank: float  # reading a rank's share
    comm_time: float  # the all-reduces and the gather over the link

    @property
    def saved_time(self) -> float:
        return self.weights_time_one - self.weights_time_per_rank

    @property
    def pays(self) -> bool:
        """Does the step get faster: the weight reads saved outweigh the communication added?"""
        return self.saved_time > self.comm_time

    @property
    def speedup(self) -> float:
        return self.weights_time_one / (self.weights_time_per_rank + self.comm_time)


def decode_tp_cost(shape: ModelShape, link: Link, batch: int, ranks: int = 2,
                   memory_bandwidth: float = H100_HBM3, model: str = "") -> DecodeTPCost:
    """The cost model of the module docstring for one decode step."""
    if ranks < 2 or batch < 1:
        raise ValueError(f"decode_tp_cost: ranks must be >= 2 and batch >= 1, got ranks={ranks}, "
                         f"batch={batch}")
    wbytes = shape.weight_dtype_bytes or shape.dtype_bytes
    sharded = (shape.linear_params + shape.lm_head_params) * wbytes  # split over the ranks
    weights = shape.weight_bytes_per_step
    per_rank = weights - sharded + sharded // ranks
    n = 2 * shape.layers + 1
    message = batch * shape.hidden * shape.dtype_bytes  # [batch, hidden]
    gathered = batch * shape.vocab * 4  # [batch, vocab] float32
    ring = 2 * (ranks - 1) / ranks
    comm = (n * (link.latency + ring * message / link.bandwidth)
            + link.latency + (ranks - 1) / ranks * gathered / link.bandwidth)
    return DecodeTPCost(model=model, link=link.name, ranks=ranks, batch=batch, all_reduces=n,
                        all_reduced_bytes=n * message, gathered_bytes=gathered, weight_bytes=weights,
                        weight_bytes_saved_per_rank=weights - per_rank,
                        weights_time_one=weights / memory_bandwidth,
                        weights_time_per_rank=per_rank / memory_bandwidth, comm_time=comm)


def break_even_batch(shape: ModelShape, link: Link, ranks: int = 2,
                     memory_bandwidth: float = H100_HBM3) -> int:
    """The largest batch for which TP still makes a decode step faster (0: not even at batch 1). The
    communication grows linearly with the batch and the saving does not, so this solves one line."""
    one, two = (decode_tp_cost(shape, link, b, ranks, memory_bandwidth) for b in (1, 2))
    per_seq = two.comm_time - one.comm_time  # seconds of communication per sequence in the batch
    fixed = one.comm_time - per_seq  # the latencies
    if one.saved_time <= one.comm_time:
        return 0
    return int((one.saved_time - fixed) / per_seq)


# ------------------------------------------------------------------------------ measured here
def time_all_reduces(batches: tuple[int, ...], hidden: int, dtype: torch.dtype,
                     iters: int) -> dict[int, float]:
    """On one rank of a formed group: median seconds of one all-reduce of [batch, hidden], per batch."""
    import torch.distributed as dist

    out = {}
    for batch in batches:
        x = torch.ones(batch, hidden, dtype=dtype)  # [batch, hidden]
        for _ in range(5):  # warm-up: the first calls connect and allocate
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        out[batch] = statistics.median(times)
    return out


def measure_gloo_all_reduce(batches: tuple[int, ...] = (1, 8, 64, 256), hidden: int = 1024,
                            dtype: torch.dtype = torch.bfloat16, iters: int = 50) -> dict[int, float]:
    """Median seconds of one gloo all-reduce of [batch, hidden] between two fresh processes on this machine
    (the slower rank's median, since a collective ends when both have it)."""
    from nanoengine.distributed.spawn import RankFailure, run_on_ranks

    results = run_on_ranks(time_all_reduces, 2, batches, hidden, dtype, iters)
    failed = [r for r in results if isinstance(r, RankFailure)]
    if failed:
        raise RuntimeError(f"measure_gloo_all_reduce: rank {failed[0].rank} raised {failed[0].type_name}: "
                           f"{failed[0].message}")
    return {b: max(r[b] for r in results) for b in batches}

