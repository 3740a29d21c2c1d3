"""Chapter 06's pieces in the engine: decode steps replayed by your stand-in graphs (6.2-6.4).

The model runner asks its graphs two things, `can_replay(inp)` and `replay(inp)`, and captures them once
(`capture()`). `LearnerGraphs` answers with your code: your `graph_buckets` chooses the buckets, your
`pick_bucket` (with the engine's rule: a decode-only step whose block tables fit) decides which steps replay,
and your `StandInGraphs` records one forward per bucket over its static buffers and replays it, loading each
step with your `load_static`. It is the CPU stand-in of a CUDA graph, so it runs on CPU only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import ModuleType

import torch

from nanoengine.engine.graphs import replayable
from nanoengine.engine.inputs import ModelInput
from nanoengine.pieces.learner import check_result, piece


def graphs_factory(module: ModuleType) -> Callable[..., LearnerGraphs]:
    """Decode graphs built as the engine builds its own (DecodeGraphs' arguments), on your pieces."""
    def make(forward: Callable[[ModelInput], torch.Tensor], kind: str, max_num_seqs: int, max_blocks: int,
             hidden_size: int, block_size: int, dtype: torch.dtype, device: torch.device) -> LearnerGraphs:
        return LearnerGraphs(module, forward, max_num_seqs, max_blocks, hidden_size, block_size, dtype)
    return make


class LearnerGraphs:
    def __init__(self, module: ModuleType, forward: Callable[[ModelInput], torch.Tensor], max_num_seqs: int,
                 max_blocks: int, hidden_size: int, block_size: int, dtype: torch.dtype) -> None:
        buckets = piece(module, "graph_buckets", "ch06")
        self.pick_bucket = piece(module, "pick_bucket", "ch06")
        self.buckets = sorted(buckets(max_num_seqs))
        check_result(bool(self.buckets) and self.buckets[-1] >= min(max_num_seqs, 1), buckets,
                     f"{self.buckets!r} for max_num_seqs={max_num_seqs}")
        self.max_blocks = max_blocks
        self.graphs = piece(module, "StandInGraphs", "ch06")(forward, self.buckets, max_blocks, hidden_size,
                                                             block_size, dtype)
        self.capture_fn = piece(module, "StandInGraphs.capture", "ch06")
        self.replay_fn = piece(module, "StandInGraphs.replay", "ch06")
        self.replays: Counter[int] = Counter()  # bucket -> replays

    def capture(self, buckets: list[int] | None = None) -> None:
        self.capture_fn(self.graphs)

    def can_replay(self, inp: ModelInput) -> bool:
        return replayable(inp, self.pick_bucket(self.buckets, inp.num_tokens), self.max_blocks)

    def replay(self, inp: ModelInput) -> torch.Tensor:
        out = self.replay_fn(self.graphs, inp)  # [num_tokens, hidden]
        check_result(isinstance(out, torch.Tensor) and out.shape[0] == inp.num_tokens, self.replay_fn,
                     f"shape {tuple(getattr(out, 'shape', ()))} for a decode step of {inp.num_tokens} rows")
        self.replays[self.pick_bucket(self.buckets, inp.num_tokens)] += 1
        return out
