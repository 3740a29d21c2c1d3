"""nanoengine/bench/token_budget.py: the prefill-first illustration schedules prompt tokens before decodes
(checked on hand-worked steps), and the latency runs count what a step-by-step reading of the workload
predicts."""

from __future__ import annotations

import math

import pytest

from nanoengine.bench.token_budget import PrefillFirstScheduler, latency_run
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.scheduler import Scheduler
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams


def two_requests(cls: type[Scheduler]) -> tuple[Scheduler, Sequence, Sequence]:
    sched = cls(BlockManager(64, 4), set(), max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    old = Sequence(list(range(100, 104)), SamplingParams(max_tokens=8, ignore_eos=True), 4)
    sched.add(old)
    out = sched.schedule()  # its 4-token prompt, whole
    sched.update(out, [1])
    new = Sequence(list(range(200, 210)), SamplingParams(max_tokens=2, ignore_eos=True), 4)
    sched.add(new)
    return sched, old, new


def batch(sched: Scheduler) -> list[tuple[int, int]]:
    out = sched.schedule()
    sched.update(out, [1] * len(out.sampled))
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


def test_prefill_first_puts_prompt_tokens_before_decodes():
    # budget 8, one request decoding and a 10-token prompt waiting
    sched, old, new = two_requests(Scheduler)
    assert batch(sched) == [(old.seq_id, 1), (new.seq_id, 7)]  # the engine: the decode, then a 7-token chunk
    assert batch(sched) == [(old.seq_id, 1), (new.seq_id, 3)]
    sched, old, new = two_requests(PrefillFirstScheduler)
    assert batch(sched) == [(new.seq_id, 8)]  # the prompt takes the whole budget: the decode sits out
    assert sorted(batch(sched)) == sorted([(new.seq_id, 2), (old.seq_id, 1)])  # the rest, then the decode
    assert sorted(batch(sched)) == sorted([(old.seq_id, 1), (new.seq_id, 1)])


def test_prefill_first_refuses_a_pool_that_runs_out():
    # 3 blocks of 4: the first 8-token prompt takes 2, the second needs 2 more
    sched = PrefillFirstScheduler(BlockManager(3, 4), set(), max_num_batched_tokens=16, max_num_seqs=4,
                                  max_model_len=12)
    sched.add(Sequence(list(range(8)), SamplingParams(max_tokens=1, ignore_eos=True), 4))
    sched.add(Sequence(list(range(50, 58)), SamplingParams(max_tokens=1, ignore_eos=True), 4))
    with pytest.raises(RuntimeError, match="does not preempt"):
        sched.schedule()


@pytest.mark.parametrize("budget", [16, 64])
def test_latency_run_one_request_at_a_time(budget):
    # arrivals far apart: each prompt runs alone, its first token after ceil(prompt / budget) steps
    prompt_len, output_len = 40, 4
    r = latency_run(budget, "decode_first", num_requests=2, prompt_len=prompt_len, output_len=output_len,
                    arrive_every=20)
    assert r["tokens"] == [output_len, output_len]
    assert r["ttft_steps"] == [math.ceil(prompt_len / budget)] * 2
    assert r["decode_steps_skipped"] == 0
    assert len(r["itl_s"]) == 2 * (output_len - 1) and all(g > 0 for g in r["itl_s"])


def test_latency_run_prefill_first_skips_decodes_under_a_small_budget():
    kw = dict(num_requests=3, prompt_len=40, output_len=6, arrive_every=2)
    first = latency_run(16, "decode_first", **kw)
    prefill = latency_run(16, "prefill_first", **kw)
    assert first["decode_steps_skipped"] == 0 and prefill["decode_steps_skipped"] > 0
    assert first["tokens"] == prefill["tokens"] == [6, 6, 6]
    assert sum(prefill["ttft_steps"]) < sum(first["ttft_steps"])
    with pytest.raises(ValueError, match="order"):
        latency_run(16, "sideways", **kw)
