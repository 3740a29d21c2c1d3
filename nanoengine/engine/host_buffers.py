"""HostBuffers: the host memory the input builder writes a step's inputs into. Chapters 03 and 06.

Allocated once and grown only when a step needs more, so a step allocates nothing: numpy views to fill, torch
views of the same memory to hand out. On CUDA the memory is pinned, so the copies to the device are
asynchronous (`non_blocking=True`, no host sync). The builder keeps two sets and uses them in turn, so a step
can be built while the one before still reads its inputs (overlap scheduling); a set is overwritten only after
its copies are done (its `copied` event). On CPU a ModelInput's tensors are views of these buffers, valid
until the build after next.
"""

from __future__ import annotations

import numpy as np
import torch


class HostBuffers:
    """One set of the buffers (see the module docstring). It keeps the decode block tables it last held
    (`InputBuilder.decode_block_tables`) and, on CUDA, the event of the last copies out of it (`copied`)."""

    def __init__(self, tokens: int, seqs: int, blocks: int, pin: bool) -> None:
        self.tokens, self.seqs, self.blocks, self.pin = tokens, seqs, blocks, pin
        self.copied = torch.cuda.Event() if pin else None
        self.decode_ids: list[tuple[int, int]] = []  # the last decode batch's sequences (id, table resets)
        self.decode_lens: list[int] = []  # and their table lengths
        self.dirty = (0, 0)  # rows and columns of decode_tables that may hold a block id

        def alloc(*shape: int) -> tuple[torch.Tensor, np.ndarray]:
            t = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
            return t, t.numpy()

        self.ids_t, self.ids = alloc(tokens)
        self.positions_t, self.positions = alloc(tokens)
        self.slots_t, self.slots = alloc(tokens)
        self.sample_rows_t, self.sample_rows = alloc(seqs)
        self.context_lens_t, self.context_lens = alloc(seqs)
        self.decode_tables_t, self.decode_tables = alloc(seqs, blocks)  # padded with 0
        self.prefill_tables_t, self.prefill_tables = alloc(seqs, blocks)

    def fits(self, tokens: int, seqs: int, blocks: int) -> bool:
        return tokens <= self.tokens and seqs <= self.seqs and blocks <= self.blocks

    def grown(self, tokens: int, seqs: int, blocks: int) -> HostBuffers:
        """Larger buffers (at least double what is short), for a step these do not fit."""
        def size(have: int, need: int) -> int:
            return have if need <= have else max(need, 2 * have)

        return HostBuffers(size(self.tokens, tokens), size(self.seqs, seqs), size(self.blocks, blocks),
                           self.pin)
