"""Decode steps replayed from graphs captured per batch-size bucket. Chapter 06.

A decode step at small batch is hundreds of tiny kernel launches, each costing more host time than GPU time.
A CUDA graph records the launches of one forward once and replays them with one call. A graph replays the
same kernels on the same memory, so:
- one graph per batch-size bucket (`batch_buckets`), all sharing one memory pool; a batch of n replays the
  smallest bucket >= n;
- every input lives in a static buffer sized for the largest bucket; a step copies its `ModelInput` in, and
  the rows from n up to the bucket are padding: token 0 at position 0, slot -1 (its K/V is stored nowhere)
  and context length 0 (its attention reads nothing); their outputs are never read;
- the block-table buffer is as wide as max_model_len needs; the columns past this step's width are cleared,
  so a shorter table (a batch that shrank, a sequence preempted and re-admitted with a new table) never
  reads an old block id;
- anything else runs eagerly: a step with a prefill chunk, a batch larger than the largest bucket.
The graph holds the whole forward the runner would run eagerly, the attention backend's `prepare` included,
so whichever backend is active is captured, if its `cuda_graphs` allows (attention/base.py; the torch
backend's store syncs with the host, so the config runs it eagerly, with a warning). Capturing and replaying
go through one small interface (`capture(fn)`, `replay()`): `CUDAGraph`, or its CPU stand-in `StandInGraph`.
Bucket choice, padding, static-buffer copies and stale-column clearing are the same code on both, which is
how they are tested on CPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from nanoengine.attention import AttentionMetadata
from nanoengine.engine.inputs import ModelInput

MAX_GRAPH_BATCH = 512  # no graph for larger decode batches: they run eagerly


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then steps of 16 up to max_num_seqs (capped at
    MAX_GRAPH_BATCH), always the last bucket, so every decode batch the scheduler can form has one."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = {b for b in (1, 2, 4, 8) if b < top} | set(range(16, top, 16)) | {top}
    return sorted(sizes)


def replayable(inp: ModelInput, bucket: int | None, max_blocks: int) -> bool:
    """Can a graph replay this step: decode only, a bucket for its batch, block tables that fit the buffer?"""
    return inp.is_decode_only and bucket is not None and inp.attn.decode_block_tables.shape[1] <= max_blocks


class CUDAGraph:
    """A CUDA graph of `fn`: capture warms `fn` up once on a side stream (lazy initialization and
    torch.compile happen outside the graph), then records its kernels into the shared pool."""

    def __init__(self, pool: tuple[int, int]) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class StandInGraph:
    """The CPU stand-in of a CUDA graph: capture records `fn` (which reads and writes only the static buffers)
    and runs it once; replay calls it again, on those same buffers."""

    def __init__(self, pool: None = None) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        fn()
        self.fn = fn

    def replay(self) -> None:
        self.fn()


GRAPH_KINDS: dict[str, type[CUDAGraph] | type[StandInGraph]] = {"cuda": CUDAGraph, "stand_in": StandInGraph}


class DecodeGraphs:
    """Static buffers, one graph per bucket, and the copies into the buffers before each replay.
    `forward(inp)` is the runner's eager forward -> [num_tokens, hidden]."""

    def __init__(self, forward: Callable[[ModelInput], torch.Tensor], kind: str, max_num_seqs: int,
                 max_blocks: int, hidden_size: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if kind not in GRAPH_KINDS:
            raise ValueError(f"graph kind {kind!r} does not exist; use one of {sorted(GRAPH_KINDS)}")
        self.forward, self.kind, self.block_size = forward, kind, block_size
        self.buckets = batch_buckets(max_num_seqs)
        n, dev = self.buckets[-1], device
        with torch.inference_mode():
            self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_bucket]
            self.positions = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_bucket]
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)  # [max_bucket], -1: none
            self.context_lens = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_bucket]; 0 = no context
            # [max_bucket, max_blocks]
            self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int64, device=dev)
            self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=dev)  # [max_bucket, hidden] output
        self.used_width = 0  # block-table columns that may hold a block id (all columns past it are 0)
        self.pool = torch.cuda.graph_pool_handle() if kind == "cuda" else None
        self.graphs: dict[int, CUDAGraph | StandInGraph] = {}
        self.replays: Counter[int] = Counter()  # bucket -> replays (what the tests and chapter 06 look at)

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    @torch.inference_mode()
    def capture(self, buckets: list[int] | None = None) -> None:
        """Capture a graph per bucket (all of them by default), largest first, so that the smaller ones
        reuse the pool memory the largest one took."""
        for bucket in sorted(buckets or self.buckets, reverse=True):
            graph = GRAPH_KINDS[self.kind](self.pool)
            graph.capture(self._step_fn(bucket))
            self.graphs[bucket] = graph

    def _step_fn(self, bucket: int) -> Callable[[], None]:
        """The forward over the first `bucket` rows of the static buffers, writing the static output."""
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:bucket], num_decode_seqs=bucket,
                                 decode_block_tables=self.block_tables[:bucket],
                                 decode_context_lens=self.context_lens[:bucket], prefill_query_starts=[],
                                 prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[],
                                 block_size=self.block_size)
        inp = ModelInput(self.input_ids[:bucket], self.positions[:bucket], meta)
        out = self.hidden[:bucket]  # [bucket, hidden]

        def step() -> None:
            out.copy_(self.forward(inp))

        return step

    def bucket_for(self, batch: int) -> int | None:
        """The smallest captured bucket that holds `batch` rows, or None (run eagerly)."""
        return next((b for b in self.buckets if b >= batch and b in self.graphs), None)

    def can_replay(self, inp: ModelInput) -> bool:
        """Can a captured graph replay this step (`replayable`)?"""
        return replayable(inp, self.bucket_for(inp.num_tokens), self.max_blocks)

    def load(self, inp: ModelInput) -> int:
        """Copy a decode step into the static buffers, padded up to its bucket; return the bucket."""
        n = inp.num_tokens
        bucket = self.bucket_for(n)
        meta = inp.attn
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(inp.input_ids)
        self.positions[:n].copy_(inp.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        # padding rows (see the module docstring), reading block 0 only
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.context_lens[n:bucket].zero_()
        self.block_tables[n:bucket, :width].zero_()
        # stale columns of a wider table, in every row (a later bucket reads them)
        if self.used_width > width:
            self.block_tables[:, width:self.used_width].zero_()
        self.used_width = width
        return bucket

    @torch.inference_mode()
    def replay(self, inp: ModelInput) -> torch.Tensor:
        """Run a decode step (`can_replay(inp)` must hold) by replay: hidden states [num_tokens, hidden], a
        view of the static output that the next replay overwrites."""
        bucket = self.load(inp)
        self.graphs[bucket].replay()
        self.replays[bucket] += 1
        return self.hidden[:inp.num_tokens]
