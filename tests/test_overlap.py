"""Overlap scheduling (async_scheduling): step N+1 is scheduled and built while step N runs.

- the same tokens as without it, token for token, through everything that changes a schedule: greedy and
  seeded sampling, stop strings and stop ids, n > 1, chunked prefill, prefix hits, a tight KV pool with
  preemption, an abort while running, the learner's pieces;
- a sequence that finished is never scheduled again and never gets an extra token, and the block manager's
  books stay right every step (a hypothesis state machine over a stub executor);
- the CPU forward thread really overlaps: the host starts scheduling step N+1 while step N's forward is held
  (events, not timing).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from plans import plan_of

from nanoengine import LLM, SamplingParams
from nanoengine.bench.host import StubExecutor, stub_engine
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.engine.scheduler import Scheduler

pytestmark = pytest.mark.xdist_group("tiny")

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"
SHARED = "The paged KV cache stores keys and values in fixed-size blocks, so that "
PROMPTS = [SHARED + "one", "Hi", SHARED + "and two, a little longer than one", "x " * 40, SHARED + "three",
           "Once upon a time, in a land far away,"]
# chunked prefill (32 tokens a step), prefix hits (the shared prefix), and a pool tight enough to preempt
TIGHT = dict(dtype="float32", max_num_batched_tokens=32, num_kvcache_blocks=6, block_size=16, trace=True)


def outputs(outs) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


def mixed_params(stop_text: str, stop_id: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=24, stop=[stop_text]),
            SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True),
            SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11, max_tokens=18, ignore_eos=True)]


def test_overlap_on_equals_off_token_for_token():
    off = LLM("tiny-qwen3", async_scheduling=False, **TIGHT)
    on = LLM("tiny-qwen3", async_scheduling=True, **TIGHT)
    assert on.engine.executor.thread is not None and off.engine.executor.thread is None
    # a stop string (prompt 2) and a stop id (prompt 3) that their greedy runs reach
    probe = off.generate(PROMPTS[2:4], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    stop_text = probe[0].outputs[0].text[8:12]
    stop_id = probe[1].outputs[0].token_ids[6]
    params = mixed_params(stop_text, stop_id)
    steps = []
    for round in range(2):  # the second round hits the prefix cache left by the first
        want = off.generate(PROMPTS, params, use_tqdm=False)
        got = on.generate(PROMPTS, params, use_tqdm=False)
        assert outputs(got) == outputs(want), f"round {round}"
        assert on.engine.in_flight is None and not on.engine.has_unfinished()
        steps += on.trace.steps
    # one step of lateness: a sequence stopped by its token was already in the next step, whose row for it
    # goes to no one (a length stop is seen coming and costs nothing)
    assert sum(s.late_rows for s in on.engine.stats) > 0 and sum(s.late_rows for s in off.engine.stats) == 0
    assert any(c.stop_reason == stop_text for o in want for c in o.outputs), "the stop string should stop one"
    assert any(c.stop_reason == stop_id for o in want for c in o.outputs), "the stop id should stop one"
    assert any(s.preempted for s in steps), "the tight pool should have forced a preemption"
    assert any(s.cache_hits for s in steps), "the shared prefix should hit the prefix cache"
    assert any(e.prefill_tokens and e.num_computed_before for s in steps for e in s.scheduled), (
        "a prompt should have been prefilled in chunks")


def test_overlap_with_an_abort_while_running_equals_without():
    """A request aborted mid-run leaves the others' tokens as they were, and its own output holds no
    placeholder of the step that was in flight."""
    results = []
    for overlap in (False, True):
        eng = LLM("tiny-qwen3", async_scheduling=overlap, dtype="float32").engine
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        ids = [eng.add_request(p, params) for p in PROMPTS[:4]]
        for _ in range(6):
            eng.step()
        victim = eng.requests[ids[1]]
        eng.abort(ids[1])
        assert victim.seqs[0].finish_reason == "abort"
        assert all(t >= 0 for t in victim.output().outputs[0].token_ids)
        keep = [eng.requests[i] for i in ids if i != ids[1]]
        while eng.has_unfinished():
            eng.step()
        results.append([r.output().outputs[0].token_ids for r in keep])
        assert eng.block_manager.num_used_blocks == 0
    assert results[0] == results[1]


def test_the_learners_pieces_with_overlap_equal_the_engine_without():
    chapters = ["ch03", "ch04", "ch05"]  # the input layout, the prefix cache, the scheduler and sampler
    learner = LLM("tiny-qwen3", async_scheduling=True, use_exercises=chapters, exercises_dir=str(SOLUTIONS),
                  **TIGHT)
    engine = LLM("tiny-qwen3", async_scheduling=False, **TIGHT)
    params = mixed_params("the", 5)
    assert (outputs(learner.generate(PROMPTS, params, use_tqdm=False))
            == outputs(engine.generate(PROMPTS, params, use_tqdm=False)))


# ------------------------------------------------------------------------------------ the step in flight
class HeldForward(StubExecutor):
    """A stub whose i-th forward is held until the host starts scheduling step i + 1 (or `timeout` passes)."""

    def __init__(self, *args, timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timeout = timeout
        self.scheduled = threading.Condition()
        self.schedules = 0  # Scheduler.schedule calls so far
        self.overlapped: list[bool] = []  # per forward: did step i + 1's scheduling start meanwhile?

    def schedule_starts(self) -> None:
        with self.scheduled:
            self.schedules += 1
            self.scheduled.notify_all()

    def run_step(self, model_input, prev_tokens):
        step = len(self.overlapped) + 1
        with self.scheduled:
            self.overlapped.append(self.scheduled.wait_for(lambda: self.schedules > step, self.timeout))
        return super().run_step(model_input, prev_tokens)


def held_engine(overlap: bool, timeout: float) -> tuple[LLMEngine, HeldForward]:
    held: list[HeldForward] = []

    def executor(plan, parts, num_blocks, seed):
        held.append(HeldForward(plan, parts, num_blocks, seed, timeout=timeout))
        return held[0]

    class Watching(Scheduler):
        def schedule(self):
            held[0].schedule_starts()
            return super().schedule()

    eng = stub_engine("qwen3-0.6b-shape", overlap, 64, executor=executor, scheduler_class=Watching)
    return eng, held[0]


def test_the_host_schedules_step_n_plus_1_while_step_n_runs():
    eng, held = held_engine(overlap=True, timeout=10)
    for p in ([1, 2, 3], [4, 5, 6, 7]):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    eng.close()
    # every forward but the last (no step comes after it) saw the next step's scheduling start
    assert len(held.overlapped) == 6 and all(held.overlapped[:-1]), held.overlapped
    # without overlap the same check fails: the forward runs inside step() and nothing schedules meanwhile
    eng, held = held_engine(overlap=False, timeout=0.05)
    eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert held.overlapped and not any(held.overlapped)


class FinishedNeverComeBack(Scheduler):
    """The engine's scheduler, refusing to schedule a finished sequence or to free a finished one twice."""

    def schedule(self):
        out = super().schedule()
        late = [s.seq.seq_id for s in out.scheduled if s.seq.is_finished]
        assert not late, f"finished sequences {late} were scheduled again"
        return out


class OverlapMachine(RuleBasedStateMachine):
    """Random requests (stub tokens are ids 0..63, so stop ids fire), steps and aborts, with overlap on."""

    def __init__(self) -> None:
        super().__init__()
        # a tight pool (preemptions happen), chunked prefills and a few sequences at once
        self.eng = stub_engine("qwen3-0.6b-shape", True, 24, scheduler_class=FinishedNeverComeBack,
                               block_size=16, max_num_batched_tokens=48, max_num_seqs=6)
        self.reqs = {}

    @rule(prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 12),
          stops=st.lists(st.integers(0, 63), max_size=3), n=st.integers(1, 2), seed=st.integers(0, 3))
    def add(self, prompt_len, max_tokens, stops, n, seed):
        params = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens, stop_token_ids=stops,
                                ignore_eos=True)
        rid = self.eng.add_request(list(range(100, 100 + prompt_len)), params)
        self.reqs[rid] = self.eng.requests[rid]

    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            self.eng.step()

    @rule(data=st.data())
    def abort(self, data):
        live = [rid for rid, r in self.reqs.items() if rid in self.eng.requests and not r.finished]
        if live:
            self.eng.abort(data.draw(st.sampled_from(live)))

    @invariant()
    def books_balance_and_outputs_are_whole(self):
        sched = self.eng.scheduler
        live = sched.running + list(sched.waiting)
        self.eng.block_manager.check_invariants(live)
        assert not [s for s in live if s.is_finished]
        for r in self.reqs.values():
            for seq in r.seqs:
                ids = seq.completion_token_ids
                assert all(0 <= t < 64 for t in ids), f"a placeholder reached an output: {ids}"
                p = seq.sampling_params
                assert len(ids) <= p.max_tokens
                if seq.finish_reason == "length":
                    assert len(ids) == p.max_tokens, "a length stop ends at max_tokens, no extra token"
                if seq.is_finished and seq.finish_reason == "stop":
                    assert ids[-1] in p.stop_token_ids and not set(ids[:-1]) & set(p.stop_token_ids)
                if not seq.is_finished:
                    assert not set(ids) & set(p.stop_token_ids), "it went on past a stop id"

    def teardown(self):
        while self.eng.has_unfinished():
            self.eng.step()
        self.books_balance_and_outputs_are_whole()
        assert self.eng.block_manager.num_used_blocks == 0 and self.eng.in_flight is None
        self.eng.close()


OverlapMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
test_overlap_state_machine = OverlapMachine.TestCase


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_stats_split_the_host_time(overlap):
    """Each finished step records how long the host waited for its tokens (a part of forward_s) and how
    long it detokenized (a part of postprocess_s)."""
    llm = LLM("tiny-qwen3", async_scheduling=overlap, dtype="float32")
    llm.engine.add_request("Hello there", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while llm.engine.has_unfinished():
        llm.engine.step()
    stats = list(llm.engine.stats)
    assert len(stats) == 5 and all(0 <= s.wait_s <= s.forward_s for s in stats)
    assert all(0 <= s.detokenize_s <= s.postprocess_s for s in stats) and any(s.detokenize_s for s in stats)
    assert all(s.host_s == pytest.approx(s.duration_s - s.wait_s) for s in stats)
    # the forward's own span, on the engine's clock, inside the step's (from its launch to its end)
    assert all(s.started <= s.forward_start <= s.forward_end <= s.time for s in stats)
    assert all(s.started <= s.finishing <= s.time for s in stats)
    if overlap:  # the next step is launched while this one runs, and before this one is finished
        assert any(b.started < a.forward_end for a, b in zip(stats, stats[1:]))


def test_with_sampled_ids_reads_the_pending_ids_from_the_last_tokens():
    """-(row + 1) in the input ids stands for row `row` of the step before's tokens."""
    llm = LLM("tiny-qwen3", dtype="float32", async_scheduling=False)
    runner = llm.engine.executor.runner
    from nanoengine.engine.inputs import ModelInput

    inp = ModelInput(torch.tensor([5, -1, 7, -3]), torch.zeros(4, dtype=torch.int64), None, prev_sampled=3)
    got = runner.with_sampled_ids(inp, torch.tensor([40, 41, 42]))
    assert got.input_ids.tolist() == [5, 40, 7, 42]
    with pytest.raises(RuntimeError, match="order they were built"):
        runner.with_sampled_ids(inp, torch.tensor([40, 41]))


def test_async_scheduling_defaults_to_where_it_pays(monkeypatch):
    """On by default on CUDA (kernels run while the host goes on), off on CPU (a step is almost all forward
    there) and with trace=True; what is asked for is kept."""
    assert plan_of(device="cpu").async_scheduling is False
    assert plan_of(device="cpu", async_scheduling=True).async_scheduling is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = dict(device="cuda", attention_backend="torch", enforce_eager=True)
    assert plan_of(**cuda).async_scheduling is True
    assert plan_of(**cuda, trace=True).async_scheduling is False
    assert plan_of(**cuda, async_scheduling=False).async_scheduling is False
