"""AttentionMetadata: what the attention backend needs to know about one batch. Chapter 03.

The batch is laid out decode sequences first (one query token each), then prefill sequences (one or more
new tokens each, possibly after a cached prefix). Token i of the flat batch belongs to one sequence.
`engine/inputs.py` builds it; `prepared` holds the backend's preparation (attention/base.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


class AttentionPrep:
    """What a backend's `prepare` derives from one step's metadata for every layer: its own subclass."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: new token slots (block * block_size + offset), -1: skip
    num_decode_seqs: int  # the first num_decode_seqs sequences have exactly one query token
    decode_block_tables: torch.Tensor | None  # [num_decode_seqs, max_blocks] int64 (padded with 0)
    decode_context_lens: torch.Tensor | None  # [num_decode_seqs] int64: tokens in cache incl. the new one
    # prefill sequences, as python ints (the torch backend loops over them):
    prefill_query_starts: list[int]  # offset of each prefill sequence's first new token in the flat batch
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]  # cached prefix + new tokens
    prefill_block_tables: list[torch.Tensor]  # each [num_blocks_of_seq] int64
    block_size: int = 16
    # set once per step by the model runner; metadata built by hand (tests, the book) may leave it None, and
    # each layer then prepares for itself
    prepared: AttentionPrep | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AttentionMetadata:
        """The metadata with its tensors on `device` (its step's preparation is made there, per step)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return dataclasses.replace(self, slot_mapping=move(self.slot_mapping),
                                   decode_block_tables=move(self.decode_block_tables),
                                   decode_context_lens=move(self.decode_context_lens),
                                   prefill_block_tables=[move(t) for t in self.prefill_block_tables],
                                   prepared=None)
