"""Chapter 06, book/06a_step_cost.ipynb .. 06c_capture_and_overlap.ipynb: per-step overhead, and the decode
graphs that remove it.

Exercise 6.1: count a step's ops, and predict its time from per-op overhead and bytes moved.
Exercise 6.2: the batch sizes that get a graph, and the bucket a batch replays.
Exercise 6.3: copy a decode step into the static buffers, padded so that padding rows write nothing.
Exercise 6.4: capture one forward per bucket and replay it: the CPU stand-in of CUDA graphs.
Exercise 6.5: read a launched step's pending tokens into the next step's input ids, on the device.

The tests compare 6.1 with `nanoengine.viz.overhead.count_ops`, 6.2 and 6.3 with nanoengine's own
`nanoengine/engine/graphs.py` (batch_buckets, DecodeGraphs) on seeded inputs, 6.4 with tiny-qwen3's eager
forward (its output and its KV cache), and 6.5 with an engine that overlaps its steps (async_scheduling) on
yours.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanoengine.attention import AttentionMetadata
from nanoengine.engine.inputs import ModelInput

MAX_GRAPH_BATCH = 512  # no graph for larger decode batches: they run eagerly
BUFFERS = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")


def count_ops(fn: Callable[[], object]) -> Counter[str]:
    """Exercise 6.1: the aten ops that calling `fn()` dispatches, counted by name.

    Run fn() under a torch.utils._python_dispatch.TorchDispatchMode whose __torch_dispatch__(func, types,
    args, kwargs) counts func.overloadpacket.__name__ ("add" for aten.add.Tensor, "linear", "view", ...) and
    then runs func(*args, **kwargs). Return a Counter {op name: calls}. (A C++ extension bound with pybind11,
    like nanoengine's CPU kernels, is one call that dispatches only the aten ops it calls itself.)
    """
    # BEGIN SOLUTION
    counts: Counter[str] = Counter()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        fn()
    return counts
    # END SOLUTION


def predict_step_ms(num_ops: int, per_op_us: float, bytes_moved: float,
                    bandwidth_gbs: float) -> dict[str, float]:
    """Exercise 6.1: a step's time on one CPU thread, predicted from two costs that do not overlap there.

    overhead_ms = num_ops x per_op_us (the host's cost of dispatching each op, whatever its size), in ms;
    memory_ms = bytes_moved / (bandwidth_gbs x 1e9) (reading the weights and the KV cache), in ms;
    total_ms = overhead_ms + memory_ms. Return {"overhead_ms", "memory_ms", "total_ms"}.
    """
    # BEGIN SOLUTION
    overhead_ms = num_ops * per_op_us / 1e3
    memory_ms = bytes_moved / (bandwidth_gbs * 1e9) * 1e3
    return {"overhead_ms": overhead_ms, "memory_ms": memory_ms, "total_ms": overhead_ms + memory_ms}
    # END SOLUTION


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Exercise 6.2: the batch sizes that get a graph (any order: the engine sorts them).

    1, 2, 4 and 8, then every multiple of 16, up to max_num_seqs capped at MAX_GRAPH_BATCH; the cap itself
    (min(max_num_seqs, MAX_GRAPH_BATCH)) is always the last bucket, so that every batch the scheduler can form
    (up to the cap) has one. No size appears twice; none is larger than the cap.
    graph_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]; graph_buckets(3) == [1, 2, 3].
    """
    # BEGIN SOLUTION
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = {b for b in (1, 2, 4, 8) if b < top} | set(range(16, top, 16)) | {top}
    return sorted(sizes)
    # END SOLUTION


def pick_bucket(buckets: list[int], batch: int) -> int | None:
    """Exercise 6.2: the bucket a decode batch of `batch` rows replays.

    The smallest bucket >= batch, or None when the batch is larger than every bucket (it runs eagerly).
    `buckets` is sorted."""
    # BEGIN SOLUTION
    return next((b for b in buckets if b >= batch), None)
    # END SOLUTION


def load_static(bufs: dict[str, torch.Tensor], used_width: int, inp: ModelInput, bucket: int) -> int:
    """Exercise 6.3: copy a decode step into the static buffers, padded up to `bucket`; return the new width.

    `bufs` holds "input_ids", "positions", "slot_mapping", "context_lens" ([max_bucket] int64 each) and
    "block_tables" ([max_bucket, max_blocks] int64). They are allocated once and a captured graph reads them
    where they are: write into them in place (copy_, fill_, zero_), never replace them.
    `inp` is a decode-only ModelInput of n <= bucket rows: inp.input_ids, inp.positions [n];
    inp.attn.slot_mapping, inp.attn.decode_context_lens [n]; inp.attn.decode_block_tables [n, width].
    - rows 0..n-1: the step's values; the first `width` columns of their block tables;
    - rows n..bucket-1 are padding: slot -1 (its K/V is stored nowhere) and context length 0 (its attention
      reads nothing); its token, position and block table only need to be valid: token 0 at position 0 and a
      block table of zeros in the first `width` columns will do;
    - `used_width` is how many columns an earlier step may have left block ids in (every column past it is 0
      in every row). When this step is narrower, clear columns width..used_width-1 in EVERY row of the buffer:
      a later step with more rows, or a wider table, would read them.
    Return the number of columns that may hold a block id now: width.
    """
    # BEGIN SOLUTION
    n, meta = inp.num_tokens, inp.attn
    width = meta.decode_block_tables.shape[1]
    bufs["input_ids"][:n].copy_(inp.input_ids)
    bufs["positions"][:n].copy_(inp.positions)
    bufs["slot_mapping"][:n].copy_(meta.slot_mapping)
    bufs["context_lens"][:n].copy_(meta.decode_context_lens)
    bufs["block_tables"][:n, :width].copy_(meta.decode_block_tables)
    bufs["input_ids"][n:bucket].zero_()
    bufs["positions"][n:bucket].zero_()
    bufs["slot_mapping"][n:bucket].fill_(-1)
    bufs["context_lens"][n:bucket].zero_()
    bufs["block_tables"][n:bucket, :width].zero_()
    if used_width > width:
        bufs["block_tables"][:, width:used_width].zero_()
    return width
    # END SOLUTION


class StandInGraphs:
    """Exercise 6.4: one recorded forward per bucket over static buffers, replayed on them.

    `forward(inp) -> hidden [num_tokens, hidden_size]` is the model runner's eager forward (prepare
    the attention, run the model). What a CUDA graph keeps is the memory a forward read and wrote when it was
    captured, so:
    - __init__ allocates the static buffers once, sized for the largest bucket: the five of exercise 6.3
      (slot_mapping filled with -1) in `self.bufs`, and `self.out` [max_bucket, hidden_size] of `dtype`;
      `self.used_width = 0`;
    - capture() records, for every bucket bs, a function of no arguments that runs `forward` on a ModelInput
      built from the first bs rows of the buffers (a decode-only step: num_decode_seqs=bs, no prefill lists,
      no sampled rows: ModelInput(ids, positions, meta)) and copies the result into self.out[:bs]. It runs
      each function once (a capture runs the forward) and keeps it in `self.graphs[bs]`;
    - replay(inp) loads a decode step with your load_static (6.3), calls the bucket's recorded function, and
      returns self.out[:n], the step's own rows. It must not call `forward` on `inp` itself.
    """

    def __init__(self, forward: Callable[[ModelInput], torch.Tensor], buckets: list[int], max_blocks: int,
                 hidden_size: int, block_size: int, dtype: torch.dtype) -> None:
        """Exercise 6.4: allocate the static buffers and the output once, for the largest bucket."""
        # BEGIN SOLUTION
        self.forward, self.buckets, self.block_size = forward, sorted(buckets), block_size
        n = self.buckets[-1]
        self.bufs = {"input_ids": torch.zeros(n, dtype=torch.int64),
                     "positions": torch.zeros(n, dtype=torch.int64),
                     "slot_mapping": torch.full((n,), -1, dtype=torch.int64),
                     "context_lens": torch.zeros(n, dtype=torch.int64),
                     "block_tables": torch.zeros(n, max_blocks, dtype=torch.int64)}
        self.out = torch.zeros(n, hidden_size, dtype=dtype)  # [max_bucket, hidden]
        self.used_width = 0
        self.graphs: dict[int, Callable[[], None]] = {}
        # END SOLUTION

    @torch.inference_mode()
    def capture(self) -> None:
        """Exercise 6.4: record (and run once) one forward per bucket over the static buffers."""
        # BEGIN SOLUTION
        b = self.bufs
        for bs in sorted(self.buckets, reverse=True):
            meta = AttentionMetadata(slot_mapping=b["slot_mapping"][:bs], num_decode_seqs=bs,
                                     decode_block_tables=b["block_tables"][:bs],
                                     decode_context_lens=b["context_lens"][:bs],
                                     prefill_query_starts=[], prefill_query_lens=[], prefill_context_lens=[],
                                     prefill_block_tables=[], block_size=self.block_size)
            step_inp = ModelInput(b["input_ids"][:bs], b["positions"][:bs], meta)
            out = self.out[:bs]

            def step(step_inp: ModelInput = step_inp, out: torch.Tensor = out) -> None:
                out.copy_(self.forward(step_inp))

            step()
            self.graphs[bs] = step
        # END SOLUTION

    @torch.inference_mode()
    def replay(self, inp: ModelInput) -> torch.Tensor:
        """Exercise 6.4: load a decode step into the buffers, replay its bucket's forward, return its rows."""
        # BEGIN SOLUTION
        n = inp.num_tokens
        bs = pick_bucket(self.buckets, n)
        self.used_width = load_static(self.bufs, self.used_width, inp, bs)
        self.graphs[bs]()
        return self.out[:n]
        # END SOLUTION


def read_pending_ids(input_ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Exercise 6.5: the next step's input ids, with its pending tokens read from the step before's.

    With overlap scheduling a step is built before the step in flight has sampled, so a sequence whose input
    is that step's token gets a reference as its input id: -(row + 1), row `row` of the tokens the step in
    flight samples (`prev_tokens` [num_prev] int64: one per entry of that step's `out.sampled`, in that
    order). `input_ids` [num_tokens] int64 holds token ids (>= 0) and references (< 0). Return a new tensor
    [num_tokens]: every id as it is, every reference replaced by the token it names. Both tensors are on the
    device, and on a GPU prev_tokens may not be computed yet when this runs: nothing may read a value on the
    host (no .item(), .tolist(), int(...), `if` on a tensor, or boolean-mask indexing, whose size depends on
    the values), or the host would wait for the step in flight, which is what overlap avoids.
    read_pending_ids(tensor([5, -1, -3]), tensor([70, 71, 72])) == tensor([5, 70, 72]).
    """
    # BEGIN SOLUTION
    rows = (-1 - input_ids).clamp(min=0)  # [num_tokens]: a reference's row; 0 (any valid row) for an id
    return torch.where(input_ids >= 0, input_ids, prev_tokens[rows])
    # END SOLUTION
