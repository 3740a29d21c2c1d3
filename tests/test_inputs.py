"""InputBuilder, tested on its own like the scheduler (no model): the flat layout (decodes first, then
prefill chunks), slots against a by-hand oracle, prefix-cache slots skipped, sampled rows, the kept
decode block tables == freshly padded ones through growth, batch changes and a reset (the block manager
emptying a table on preemption, then refilling it with other blocks), and the host buffers reused by every
step (grown only when a step needs more)."""

from __future__ import annotations

import random

import numpy as np
import torch

from nanoengine.engine.inputs import InputBuilder
from nanoengine.engine.scheduler import ScheduledSeq
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams


def fresh(decodes):
    width = max(len(s.seq.block_table) for s in decodes)
    return np.array([s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes])


def seq_with(tokens, table, computed, cached=0, block_size=4):
    seq = Sequence(list(tokens), SamplingParams(), block_size)
    seq.block_table, seq.num_computed_tokens, seq.num_cached_tokens = list(table), computed, cached
    return seq


def test_layout_slots_and_sampled_rows():
    bs = 4
    decoding = seq_with(range(100, 110), [7, 3, 9], computed=9)  # 10 tokens, the last one new
    chunk = seq_with(range(200, 212), [1, 5, 6], computed=0)  # a 12-token prompt, first 6 this step
    hit = seq_with(range(300, 309), [11, 12, 13], computed=8, cached=8)  # prefix hit: only the last token new
    tail = seq_with(range(400, 406), [2, 4], computed=2, cached=4)  # after a hit, computing from position 2
    scheduled = [ScheduledSeq(chunk, 6, True), ScheduledSeq(decoding, 1, False), ScheduledSeq(hit, 1, True),
                 ScheduledSeq(tail, 4, True)]
    inp, sample_seqs = InputBuilder(bs).build(scheduled)[:2]
    # decodes (one new token) first, in scheduled order, then the prefill chunks
    order = [(decoding, 9, 1), (hit, 8, 1), (chunk, 0, 6), (tail, 2, 4)]
    want_ids = [t for seq, start, n in order for t in seq.token_ids[start:start + n]]
    want_pos = [p for _, start, n in order for p in range(start, start + n)]
    want_slots = [-1 if p < seq.num_cached_tokens else seq.block_table[p // bs] * bs + p % bs
                  for seq, start, n in order for p in range(start, start + n)]
    assert inp.input_ids.tolist() == want_ids and inp.positions.tolist() == want_pos
    assert inp.attn.slot_mapping.tolist() == want_slots
    assert want_slots[8:10] == [-1, -1]  # the tail's positions 2 and 3 sit in its prefix-cache block
    meta = inp.attn
    assert meta.num_decode_seqs == 2 and not inp.is_decode_only and inp.num_tokens == 12
    assert meta.decode_context_lens.tolist() == [10, 9]
    assert meta.decode_block_tables.tolist() == [[7, 3, 9], [11, 12, 13]]
    assert meta.prefill_query_starts == [2, 8] and meta.prefill_query_lens == [6, 4]
    assert (meta.prefill_context_lens == [6, 6]
            and [t.tolist() for t in meta.prefill_block_tables] == [[1, 5, 6], [2, 4]])
    # every sequence that reaches its last token is sampled, at its last row; the half-done chunk is not
    assert inp.sample_rows.tolist() == [0, 1, 11] and sample_seqs == [decoding, hit, tail]
    assert meta.prepared is None  # preparing is the attention backend's, once per step in the model runner


def test_decode_only_batch_is_fixed_width():
    seqs = [seq_with(range(n), list(range(i * 4, i * 4 + -(-n // 4))), computed=n - 1)
            for i, n in enumerate((3, 9, 5))]
    inp = InputBuilder(4).build([ScheduledSeq(s, 1, False) for s in seqs]).inputs
    assert inp.is_decode_only and inp.sample_rows.tolist() == [0, 1, 2]
    assert inp.attn.decode_block_tables.shape == (3, 3) and inp.attn.slot_mapping.shape == (3,)


def test_kept_decode_tables_equal_fresh_ones():
    rng = random.Random(0)
    builder = InputBuilder(4, torch.device("cpu"))
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
        got = builder.build(decodes).inputs.attn.decode_block_tables.numpy()
        assert np.array_equal(got, fresh(decodes)), f"step {step}"


def test_host_buffers_take_turns_are_reused_and_grown_only_when_a_step_needs_more():
    """Steps write into two sets of host buffers in turn (pinned on CUDA, for copies without a host sync), so
    a step can be built while the one before still reads its inputs (overlap scheduling): a ModelInput's
    tensors are views of its set, valid until the build after next, and a step larger than its set grows that
    set once, after which it is reused again."""
    builder = InputBuilder(4, max_tokens=8, max_seqs=2, max_blocks=2)
    a_set, b_set = builder.sets
    seqs = [seq_with(range(10 * i, 10 * i + 5), [i, 10 + i], computed=4) for i in range(2)]
    steps = []
    for step in range(3):
        steps.append(builder.build([ScheduledSeq(s, 1, False) for s in seqs])[0])
        assert builder.host is (a_set, b_set)[step % 2]  # no new buffers, the sets in turn
        for s in seqs:  # the next decode step
            s.token_ids.append(90 + step)
            s.num_computed_tokens += 1
    first, second, third = steps
    for a, b, c in ((first.input_ids, second.input_ids, third.input_ids),
                    (first.positions, second.positions, third.positions),
                    (first.attn.slot_mapping, second.attn.slot_mapping, third.attn.slot_mapping),
                    (first.sample_rows, second.sample_rows, third.sample_rows),
                    (first.attn.decode_block_tables, second.attn.decode_block_tables,
                     third.attn.decode_block_tables)):
        # the same memory every other step, and the other set's in between
        assert a.data_ptr() == c.data_ptr() == a.untyped_storage().data_ptr() != b.data_ptr()
    assert second.input_ids.tolist() == [90, 90] and third.input_ids.tolist() == [91, 91]
    assert second.attn.decode_context_lens.tolist() == [6, 6] and second.positions.tolist() == [5, 5]
    assert third.attn.decode_block_tables.tolist() == [[0, 10], [1, 11]]
    big = seq_with(range(20), [1, 2, 3, 4, 5], computed=0)  # 20 prompt tokens, 5 blocks: more than they hold
    inp = builder.build([ScheduledSeq(big, 20, True)]).inputs  # set B's turn: it grows
    grown = builder.host
    assert grown is not b_set and grown.fits(20, 1, 5) and builder.sets == [a_set, grown]
    assert (inp.input_ids.tolist() == list(range(20))
            and inp.attn.prefill_block_tables[0].tolist() == [1, 2, 3, 4, 5])
    for want in (a_set, grown):
        again = builder.build([ScheduledSeq(s, 1, False) for s in seqs]).inputs
        assert builder.host is want and again.attn.decode_block_tables.tolist() == [[0, 10], [1, 11]]


def test_prompt_logprob_rows_follow_the_prompt_chunks():
    """A request with prompt logprobs gets a row for every prompt position of its chunk that predicts a prompt
    token (not the last prompt token's, which is sampled), a 1-token chunk laid out as a decode included;
    others get none. Each row's target is the next prompt token."""
    bs = 4
    wants = Sequence(list(range(500, 510)), SamplingParams(prompt_logprobs=2), bs)  # a 10-token prompt
    wants.block_table = [1, 2, 3]
    plain = seq_with(range(600, 606), [4, 5], computed=0)
    b = InputBuilder(bs)
    inp, _, rows, targets = b.build([ScheduledSeq(plain, 6, True), ScheduledSeq(wants, 4, True, start=0)])
    # plain's 6 rows first (scheduled first), then wants' positions 0..3, each predicting prompt token p + 1
    assert inp.scored_rows.tolist() == [6, 7, 8, 9]
    assert [(r.seq, r.first, r.count) for r in rows] == [(wants, 1, 4)]
    assert targets == [501, 502, 503, 504]
    inp, _, _, targets = b.build([ScheduledSeq(wants, 1, True, start=4)])  # a 1-token chunk: as a decode
    assert inp.scored_rows.tolist() == [0] and targets == [505]
    inp, sample_seqs, _, targets = b.build([ScheduledSeq(wants, 5, True, start=5)])  # to the end: sampled
    assert inp.scored_rows.tolist() == [0, 1, 2, 3] and targets == [506, 507, 508, 509]
    assert inp.sample_rows.tolist() == [4] and sample_seqs == [wants]
    second = Sequence(list(range(500, 510)), SamplingParams(prompt_logprobs=2), bs)
    second.index, second.block_table = 1, [1, 2, 3]  # n > 1: the first completion computes them
    inp, _, rows, _ = b.build([ScheduledSeq(second, 10, True, start=0)])
    assert inp.num_scored_rows == 0 and rows == []
