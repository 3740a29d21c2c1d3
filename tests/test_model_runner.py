"""ModelRunner's kept decode block tables == freshly padded ones, through growth, batch changes and a reset
(the block manager emptying a table on preemption, then refilling it with other blocks)."""

from __future__ import annotations

import random

import numpy as np
import torch

from nanoengine.engine.model_runner import ModelRunner
from nanoengine.engine.scheduler import ScheduledSeq
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams


def fresh(decodes):
    width = max(len(s.seq.block_table) for s in decodes)
    return np.array([s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes])


def test_kept_decode_tables_equal_fresh_ones():
    rng = random.Random(0)
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device = 4, torch.device("cpu")
    runner.reset_decode_tables()
    seqs = [Sequence([1, 2, 3], SamplingParams(), 4) for _ in range(5)]
    for s in seqs:
        s.block_table = [rng.randrange(1000)]
    for step in range(200):
        batch = [s for s in seqs if rng.random() < 0.9] or seqs[:1]  # sometimes a sequence sits out
        for s in batch:
            if rng.random() < 0.3:
                s.block_table.append(rng.randrange(1000))  # a table grows at its end
        if rng.random() < 0.05:  # preemption: emptied, then refilled with other blocks (maybe longer)
            s = rng.choice(seqs)
            n = len(s.block_table)
            s.block_table.clear()
            s.num_table_resets += 1
            s.block_table.extend(rng.randrange(1000) for _ in range(n + rng.randint(0, 2)))
        decodes = [ScheduledSeq(s, 1, False) for s in batch]
        got = runner.decode_block_tables(decodes)
        assert np.array_equal(got, fresh(decodes)), f"step {step}"
