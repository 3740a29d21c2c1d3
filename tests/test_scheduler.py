"""Scheduler: token-budget continuous batching, chunked prefill, preemption, admission (chapter 05).

The rule-based hypothesis test drives random add / step / finish / abort sequences on tiny KV pools and
checks the bookkeeping after every operation, with a fake KV cache as the oracle: every slot records the
token prefix its K/V were computed for, so a wrong prefix hit or a block reused while still in use shows up
as a slot holding the wrong prefix.
"""

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.scheduler import Scheduler
from nanoengine.engine.sequence import Sequence, SequenceStatus
from nanoengine.sampling_params import SamplingParams

EOS = 9


def make(num_blocks=64, block_size=4, budget=64, max_seqs=8, max_model_len=128, caching=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, {EOS}, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                     max_model_len=max_model_len)


def seq_of(sched, tokens, **sp):
    sp.setdefault("max_tokens", 8)
    return Sequence(list(tokens), SamplingParams(**sp), sched.block_size)


def step(sched, token=1):
    """One engine step: schedule, then give a token to every seq that finished its prefill or decoded."""
    out = sched.schedule()
    finished = sched.update(out, [token] * len(out.sampled)).finished
    return out, finished


def plan(out):
    return [(s.seq.seq_id, s.num_new_tokens, s.is_prefill) for s in out.scheduled]


# ---------------------------------------------------------------- unit tests
def test_decode_first_then_new_prefills():
    sched = make(budget=16)
    a, b = seq_of(sched, range(5)), seq_of(sched, range(10, 13))
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 5, True), (b.seq_id, 3, True)]
    assert out.num_batched_tokens == 8 and out.cache_hits == [(a.seq_id, 0), (b.seq_id, 0)]
    c = seq_of(sched, range(20, 40))
    sched.add(c)
    out, _ = step(sched)
    # running decodes first (in running order), then the new prompt gets what is left of the budget
    assert plan(out) == [(a.seq_id, 1, False), (b.seq_id, 1, False), (c.seq_id, 14, True)]
    assert out.num_batched_tokens == 16


def test_chunked_prefill_splits_a_long_prompt():
    sched = make(budget=8)
    a = seq_of(sched, range(20))
    sched.add(a)
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        chunks.append(plan(out))
    assert chunks == [[(a.seq_id, 8, True)], [(a.seq_id, 8, True)], [(a.seq_id, 4, True)]]
    assert a.num_computed_tokens == 20 and a.num_tokens == 21  # the token comes with the last chunk only
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 1, False)]


def test_partial_chunk_gets_no_token_even_if_offered():
    sched = make(budget=4)
    a = seq_of(sched, range(10))
    sched.add(a)
    out = sched.schedule()
    assert out.sampled == []  # a chunk in the middle of the prompt samples nothing
    sched.update(out, [])
    assert a.num_tokens == 10 and a.num_computed_tokens == 4
    with pytest.raises(ValueError, match="got 1 tokens for a step that samples 0"):
        sched.update(out, [5])


def test_several_prefill_chunks_in_one_step():
    sched = make(budget=10)
    a, b, c = seq_of(sched, range(4)), seq_of(sched, range(10, 13)), seq_of(sched, range(20, 25))
    for s in (a, b, c):
        sched.add(s)
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 4, True), (b.seq_id, 3, True), (c.seq_id, 3, True)]
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 1, False), (b.seq_id, 1, False), (c.seq_id, 2, True)]


def test_max_num_seqs_limits_admission():
    sched = make(max_seqs=2)
    seqs = [seq_of(sched, [i] * 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched)
    assert [s.seq for s in out.scheduled] == seqs[:2] and list(sched.waiting) == [seqs[2]]


def test_preemption_newest_first_under_tiny_pool():
    sched = make(num_blocks=4, block_size=2, budget=64)
    a, b = seq_of(sched, [1, 2, 3], max_tokens=5), seq_of(sched, [4, 5, 6], max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefill: 2 blocks each, pool full
    out, _ = step(sched)  # both decode within their second block
    assert out.preempted == [] and sched.block_manager.num_free_blocks == 0
    out, _ = step(sched)  # a needs a third block: the newest (b) is preempted
    assert out.preempted == [b] and plan(out) == [(a.seq_id, 1, False)]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1 and sched.waiting[0] is b and sched.running == [a]
    assert out.blocks_freed and set(out.blocks_allocated) <= set(out.blocks_freed)
    for _ in range(50):
        if not sched.has_unfinished():
            break
        step(sched)
    assert a.finish_reason == b.finish_reason == "length"
    assert a.num_completion_tokens == b.num_completion_tokens == 5
    assert sched.block_manager.num_free_blocks == 4


def test_current_seq_preempts_itself_when_it_is_the_newest():
    sched = make(num_blocks=5, block_size=2, budget=64)
    a, b = seq_of(sched, [1, 2, 3, 4], max_tokens=6), seq_of(sched, [5, 6, 7], max_tokens=6)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 1, False)] and out.preempted == [b]
    assert sched.running == [a] and list(sched.waiting) == [b]
    sched.block_manager.check_invariants([a, b])


def make_policy(policy, **kw):
    sched = make(**kw)
    return Scheduler(sched.block_manager, {EOS}, max_num_batched_tokens=sched.max_num_batched_tokens,
                     max_num_seqs=sched.max_num_seqs, max_model_len=sched.max_model_len, policy=policy)


@pytest.mark.parametrize("policy", ["fcfs", "skip_ahead"])
def test_a_waiting_request_that_does_not_fit(policy):
    """fcfs: admission stops at it (nothing overtakes it); skip_ahead: a later one that fits is admitted."""
    sched = make_policy(policy, num_blocks=8, block_size=4, budget=64)
    a = seq_of(sched, range(12), max_tokens=4)  # holds 4 blocks once decoding
    sched.add(a)
    step(sched)
    big = seq_of(sched, range(100, 120), max_tokens=4)  # 6 blocks: fits the pool, not now
    small = seq_of(sched, range(200, 206), max_tokens=2)
    sched.add(big)
    sched.add(small)
    out, _ = step(sched)
    if policy == "fcfs":
        assert plan(out) == [(a.seq_id, 1, False)] and list(sched.waiting) == [big, small]
    else:
        assert plan(out) == [(a.seq_id, 1, False), (small.seq_id, 6, True)] and list(sched.waiting) == [big]
    assert big.block_table == [] and big.num_computed_tokens == 0
    for _ in range(50):
        if not sched.has_unfinished():
            break
        step(sched)
    assert big.is_finished and small.is_finished and sched.block_manager.num_free_blocks == 8


def test_admission_work_is_bounded_by_what_it_admits(monkeypatch):
    """A long queue that cannot start costs a step almost nothing: fcfs tries one waiting prompt, skip_ahead
    at most SKIP_AHEAD_LIMIT + 1, and a waiting prompt's blocks are hashed once, not at every try."""
    from nanoengine.engine.scheduler import SKIP_AHEAD_LIMIT

    hashed = []
    real = BlockManager.compute_hash
    monkeypatch.setattr(BlockManager, "compute_hash",
                        staticmethod(lambda t, prefix: hashed.append(tuple(t)) or real(t, prefix)))
    for policy, tried in (("fcfs", 1), ("skip_ahead", SKIP_AHEAD_LIMIT + 1)):
        sched = make_policy(policy, num_blocks=8, block_size=4, budget=64, max_model_len=64)
        a = seq_of(sched, range(25), max_tokens=7)  # 7 of 8 blocks, then all 8
        sched.add(a)
        step(sched)
        backlog = [seq_of(sched, range(1000 + 100 * i, 1000 + 100 * i + 8), max_tokens=1) for i in range(200)]
        for s in backlog:
            sched.add(s)  # 2 blocks each: none fits while `a` runs
        hashed.clear()
        for _ in range(5):
            out, _ = step(sched)
            assert [x.seq for x in out.scheduled] == [a]
        assert sum(len(s.block_hashes) > 0 for s in backlog) == tried, policy  # the ones admission tried
        backlog_hashes = [t for t in hashed if t[0] >= 1000]  # (a's own blocks are hashed as they fill)
        assert len(backlog_hashes) == 2 * tried, (policy, backlog_hashes)  # 2 full blocks each, once


def test_failed_admission_rolls_back_prefix_hit():
    sched = make(num_blocks=6, block_size=4, budget=64)
    a = seq_of(sched, range(8), max_tokens=1)
    sched.add(a)
    step(sched)
    assert a.is_finished  # its 2 full blocks stay cached on the free list
    holder = seq_of(sched, range(50, 62), max_tokens=4)  # 3 blocks + 1 to come
    sched.add(holder)
    step(sched)
    b = seq_of(sched, list(range(8)) + list(range(30, 42)), max_tokens=4)  # hits 2, needs 3 more
    sched.add(b)
    out, _ = step(sched)
    assert plan(out) == [(holder.seq_id, 1, False)]
    assert b.block_table == [] and b.num_computed_tokens == 0 and list(sched.waiting) == [b]
    assert len(sched.block_manager.get_cached_free_block_ids()) == 2
    sched.block_manager.check_invariants([holder, b])


def test_siblings_wait_for_first_prefill_then_hit_its_blocks():
    sched = make(budget=4, block_size=4)
    sp = SamplingParams(n=3, max_tokens=4)
    first = Sequence(list(range(8)), sp, 4)
    sibs = [Sequence(list(range(8)), sp, 4) for _ in range(2)]
    for s in sibs:
        s.wait_for = first
    for s in (first, *sibs):
        sched.add(s)
    out, _ = step(sched)
    assert plan(out) == [(first.seq_id, 4, True)]
    out, _ = step(sched)
    assert plan(out) == [(first.seq_id, 4, True)]
    out, _ = step(sched)
    assert plan(out) == [(first.seq_id, 1, False), (sibs[0].seq_id, 1, True), (sibs[1].seq_id, 1, True)]
    assert out.cache_hits == [(sibs[0].seq_id, 8), (sibs[1].seq_id, 8)]
    assert sibs[0].num_cached_tokens == 8
    assert first.block_table[:2] == sibs[0].block_table == sibs[1].block_table
    assert sched.block_manager.blocks[first.block_table[0]].ref_count == 3


def test_sibling_of_aborted_first_is_not_stuck():
    sched = make(budget=4)
    first, sib = seq_of(sched, range(8)), seq_of(sched, range(8))
    sib.wait_for = first
    sched.add(first)
    sched.add(sib)
    step(sched)
    assert sched.abort(first) and first.finish_reason == "abort"
    out, _ = step(sched)
    assert plan(out) == [(sib.seq_id, 4, True)]


@pytest.mark.parametrize(("prompt", "max_tokens", "msg"), [
    (10, 7, r"10 tokens \+ max_tokens=7 = 17 exceeds max_model_len=16"),
    (16, None, r"prompt of 16 tokens leaves no room to generate within max_model_len=16"),
    (8, 8, r"needs 4 KV blocks.*can never fit the KV pool of 3 blocks"
           r".*num_kvcache_blocks / kv_cache_memory_gb"),
])
def test_admission_errors(prompt, max_tokens, msg):
    sched = make(num_blocks=3, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match=msg):
        sched.check_admission(seq_of(sched, range(prompt), max_tokens=max_tokens))
    with pytest.raises(ValueError, match=msg):
        sched.add(seq_of(sched, range(prompt), max_tokens=max_tokens))
    assert not sched.has_unfinished()


def test_max_tokens_none_is_bounded_by_max_model_len_and_pool():
    sched = make(num_blocks=3, block_size=4, max_model_len=16)
    a = seq_of(sched, range(6), max_tokens=None)
    sched.add(a)
    for _ in range(20):
        if not sched.has_unfinished():
            break
        step(sched)
    assert a.finish_reason == "length" and a.num_tokens == 12  # the pool holds 12 tokens


@pytest.mark.parametrize(("kwargs", "tokens", "reason", "n_out"), [
    ({}, [1, 1, EOS], "stop", 3),
    ({"ignore_eos": True, "max_tokens": 4}, [1, EOS, EOS, 1], "length", 4),
    # min_tokens holds stop ids back in the logits (logits_masks.py); one that comes anyway stops
    ({"min_tokens": 2}, [EOS], "stop", 1),
    ({"stop_token_ids": [7]}, [1, 7], "stop", 2),
    ({"max_tokens": 3}, [1, 1, 1], "length", 3),
])
def test_finish_reasons(kwargs, tokens, reason, n_out):
    sched = make()
    a = seq_of(sched, range(3), **kwargs)
    sched.add(a)
    for t in tokens:
        assert not a.is_finished
        _, finished = step(sched, token=t)
    assert finished == [a] and a.finish_reason == reason and a.num_completion_tokens == n_out
    assert a.block_table == [] and not sched.has_unfinished()


def test_max_model_len_finishes_with_length():
    sched = make(max_model_len=6)
    a = seq_of(sched, range(4), max_tokens=None)
    sched.add(a)
    step(sched)
    _, finished = step(sched)
    assert finished == [a] and a.finish_reason == "length" and a.num_tokens == 6


def test_finish_and_abort():
    sched = make()
    a, b = seq_of(sched, range(4)), seq_of(sched, range(4, 8))
    sched.add(a)
    step(sched)
    sched.add(b)
    sched.finish(a, "stop")  # e.g. a stop string matched
    assert a.finish_reason == "stop" and a.block_table == [] and sched.running == []
    assert sched.abort(b) and b.is_finished and not sched.has_unfinished()
    assert not sched.abort(b) and not sched.abort(a)
    assert sched.block_manager.num_free_blocks == 64


def test_scheduler_takes_its_limits_by_name():
    """The engine's limits are concrete numbers from its plan, passed by name (no half-resolved config)."""
    with pytest.raises(TypeError, match="max_model_len"):
        Scheduler(BlockManager(4, 4), {EOS}, max_num_batched_tokens=8, max_num_seqs=2)


# ---------------------------------------------------------------- rule-based random test
VOCAB = 4  # small so prefixes repeat
PREFIXES = [[], [0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 1, 1], [2] * 9]
MAX_MODEL_LEN = 24


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 4), budget=st.integers(1, 12),
                max_seqs=st.integers(1, 4), caching=st.booleans())
    def setup(self, num_blocks, block_size, budget, max_seqs, caching):
        self.sched = make(num_blocks, block_size, budget, max_seqs, MAX_MODEL_LEN, caching)
        self.bm = self.sched.block_manager
        self.bs, self.budget, self.max_seqs, self.caching = block_size, budget, max_seqs, caching
        self.seqs: list[Sequence] = []
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> the prefix its K/V belong to

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, VOCAB - 1), max_size=6),
          max_tokens=st.none() | st.integers(1, 8), n=st.integers(1, 3), ignore_eos=st.booleans())
    def add(self, prefix, tail, max_tokens, n, ignore_eos):
        prompt = (prefix + tail) or [0]
        sp = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=ignore_eos)
        total = len(prompt) + (max_tokens or 0)
        fits = (len(prompt) < MAX_MODEL_LEN if max_tokens is None else total <= MAX_MODEL_LEN) \
            and -(-total // self.bs) <= self.bm.num_blocks
        first = None
        for _ in range(n):
            seq = Sequence(prompt, sp, self.bs)
            seq.wait_for = first
            try:
                self.sched.add(seq)
            except ValueError:
                assert not fits
                return
            assert fits
            self.seqs.append(seq)
            first = first or seq

    @rule(seed=st.integers(0, 2**32 - 1))
    def step(self, seed):
        self._step(random.Random(seed))

    @rule(i=st.integers(0, 100))
    def abort(self, i):
        live = [s for s in self.seqs if not s.is_finished]
        if not live:
            assert not any(self.sched.abort(s) for s in self.seqs)  # all finished already: nothing to abort
            return
        seq = live[i % len(live)]
        assert self.sched.abort(seq)
        assert seq.is_finished and seq.finish_reason == "abort" and seq.block_table == []

    @rule(i=st.integers(0, 100))
    def stop_string(self, i):
        if self.sched.running:
            seq = self.sched.running[i % len(self.sched.running)]
            self.sched.finish(seq, "stop")
            assert seq.is_finished and seq.block_table == []

    def _step(self, rng):
        sched, bm, bs = self.sched, self.bm, self.bs
        computed_before = [(seq, seq.num_computed_tokens) for seq in sched.running]
        out = sched.schedule()
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= self.budget
        assert len(sched.running) <= self.max_seqs
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        assert {id(s) for s in sched.running} >= {id(s.seq) for s in out.scheduled}
        for p in out.preempted:
            assert p.status == SequenceStatus.WAITING and p.block_table == [] and p.num_computed_tokens == 0
        if out.preempted:
            assert out.cache_hits == []
        bm.check_invariants(self.seqs)
        sampled = []
        # slots that held computed K/V before this step, of sequences that still hold them (not preempted)
        valid_before = {(seq.block_table[pos // bs], pos % bs)
                        for seq, n in computed_before if seq.block_table for pos in range(n)}
        written = {}
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = s.start
            assert seq.num_computed_tokens == start + n  # committed: the step's tokens count as computed
            assert n >= 1 and start + n <= seq.num_tokens and len(seq.block_table) * bs >= start + n
            for pos in range(start, start + n):  # "run the model": write this position's K/V
                slot = (seq.block_table[pos // bs], pos % bs)
                value = tuple(seq.token_ids[:pos + 1])
                # K/V someone already relies on, or that another sequence writes this step (a block shared
                # by a same-step prefix hit), may only be rewritten identically
                if slot in valid_before:
                    assert self.kv[slot] == value, f"overwrote computed K/V at {slot}"
                if slot in written:
                    assert written[slot] == value, f"two different writes to {slot} in one step"
                written[slot] = value
        self.kv.update(written)  # every layer stores the whole batch's K/V before anyone attends
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = s.start
            for pos in range(start + n):  # what this sequence's attention reads this step
                slot = (seq.block_table[pos // bs], pos % bs)
                assert self.kv.get(slot) == tuple(seq.token_ids[:pos + 1]), (seq, pos)
            if start + n == len(seq.token_ids):  # it reaches its last known token: the step samples for it
                sampled.append(seq)
        assert [id(s) for s in out.sampled] == [id(s) for s in sampled]
        tokens = [EOS if rng.random() < 0.1 else rng.randrange(VOCAB) for _ in sampled]
        finished = sched.update(out, tokens).finished
        for seq in finished:
            assert seq.is_finished and seq.block_table == [] and seq.finish_reason in ("stop", "length")
            sp = seq.sampling_params
            if seq.finish_reason == "length":
                assert seq.num_completion_tokens == sp.max_tokens or seq.num_tokens >= sched._max_len
            else:
                assert seq.token_ids[-1] == EOS and not sp.ignore_eos

    @invariant()
    def bookkeeping(self):
        if not hasattr(self, "sched"):
            return
        sched, bm, bs = self.sched, self.bm, self.bs
        bm.check_invariants(self.seqs)
        assert len(sched.running) <= self.max_seqs
        live = [s for s in self.seqs if not s.is_finished]
        assert sorted(map(id, live)) == sorted(map(id, [*sched.running, *sched.waiting]))
        for seq in sched.waiting:
            assert seq.status == SequenceStatus.WAITING and seq.block_table == []
        for seq in self.seqs:
            if seq.is_finished:
                assert seq.block_table == []
            sp = seq.sampling_params
            assert sp.max_tokens is None or seq.num_completion_tokens <= sp.max_tokens
            assert seq.num_tokens <= MAX_MODEL_LEN
        for seq in sched.running:
            assert seq.status == SequenceStatus.RUNNING
            prefix_hash = None
            for i in range(seq.num_computed_tokens // bs):  # full computed blocks
                block = bm.blocks[seq.block_table[i]]
                if self.caching:
                    prefix_hash = BlockManager.compute_hash(seq.block_tokens(i), prefix_hash)
                    assert block.token_ids == seq.block_tokens(i) and block.hash == prefix_hash
                else:
                    assert block.hash is None
            for pos in range(seq.num_computed_tokens):  # the oracle: every computed slot holds our prefix
                slot = (seq.block_table[pos // bs], pos % bs)
                assert self.kv[slot] == tuple(seq.token_ids[:pos + 1]), (seq, pos)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        rng = random.Random(0)
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self._step(rng)
            self.bookkeeping()
        assert not self.sched.has_unfinished(), "some sequences never finished"
        assert all(s.is_finished for s in self.seqs)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        self.bm.check_invariants(self.seqs)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         derandomize=True, database=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_same_step_admissions_share_a_prefix():
    """Blocks are registered when scheduled, so a request admitted later in the same step already hits them
    (each attention layer stores the whole batch's K/V before any sequence attends)."""
    sched = make(budget=64, block_size=4)
    a = seq_of(sched, list(range(10)) + [50, 51])
    b = seq_of(sched, list(range(10)) + [60])
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert out.cache_hits == [(a.seq_id, 0), (b.seq_id, 8)]
    assert plan(out) == [(a.seq_id, 12, True), (b.seq_id, 3, True)]
    assert a.block_table[:2] == b.block_table[:2]
    # a partial prefill chunk registers only the blocks it completes
    sched = make(budget=6, block_size=4)
    a, b = seq_of(sched, range(12)), seq_of(sched, range(12))
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 6, True)]
    assert [sched.block_manager.blocks[i].hash is not None for i in a.block_table] == [True, False]


def test_a_long_prompt_behind_a_stream_of_short_ones_starves_only_when_skipping_ahead():
    """Chapter 05's measurement: with skip_ahead the long prompt waits until the stream stops; with fcfs it
    waits for the running requests to finish, and the short ones behind it wait that long at most."""
    from nanoengine.bench.admission import long_prompt_behind_short_ones

    fcfs = long_prompt_behind_short_ones("fcfs")
    skip = long_prompt_behind_short_ones("skip_ahead")
    assert skip["long_prompt_wait_steps"] >= skip["stream_steps"] - 40, skip  # it starts when the stream ends
    assert fcfs["long_prompt_wait_steps"] < 50 and fcfs["short_max_wait_steps"] < 50, fcfs
    assert fcfs["steps"] == skip["steps"] and fcfs["tokens_per_step"] > 0.9 * skip["tokens_per_step"]


def test_the_backlog_benchmark_runs_its_case():
    """`bench --host-only --backlog` in small: the pool full, the queue left whole, every measured step the
    running decodes only (measure_backlog raises otherwise), under both policies."""
    from nanoengine.bench.host import measure_backlog

    for policy in ("fcfs", "skip_ahead"):
        r = measure_backlog("tiny-qwen3", 200, num_running=8, steps=5, scheduling_policy=policy)
        assert r["num_waiting"] == 200 and r["steps"] == 5 and r["step_ms"] > 0, r
