"""AttentionMetadata: what the attention backend needs to know about one batch. Chapter 03.

The batch is laid out decode sequences first (one query token each), then prefill sequences (one or more
new tokens each, possibly after a cached prefix). Token i of the flat batch belongs to one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) per new token; -1 = skip
    num_decode_seqs: int  # the first num_decode_seqs sequences have exactly one query token
    decode_block_tables: torch.Tensor | None  # [num_decode_seqs, max_blocks] int64 (padded with 0)
    decode_context_lens: torch.Tensor | None  # [num_decode_seqs] int64: tokens in cache incl. the new one
    # prefill sequences, as python ints (the torch backend loops over them):
    prefill_query_starts: list[int]  # offset of each prefill sequence's first new token in the flat batch
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]  # cached prefix + new tokens
    prefill_block_tables: list[torch.Tensor]  # each [num_blocks_of_seq] int64
    block_size: int = 16
    # per-step values a backend derives once and every layer reuses (index tensors, masks), by backend name
    memo: dict[str, Any] = field(default_factory=dict)
