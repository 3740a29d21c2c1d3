"""Chapter 05's checks of a scheduling step (Exercises 5.1 and 5.2), on behaviour only.

No check compares your state with the engine's: a different correct policy (another preemption victim,
another freeing order, admitting more or less eagerly) passes. What is checked:

- the tokens: a `FakeModel` stands in for the model over a simulated paged KV cache. Each step writes, for
  every position it computes, a record of that position's whole prefix into the slot the sequence's block
  table gives (not under a prefix-cache hit, as the engine's input builder does), then every scheduled
  sequence reads back all its positions through its table. Its next token is a function of what it read,
  so a wrong prefix hit, a block shared by mistake or a victim that keeps its computed tokens changes the
  tokens, and the check names the first wrong read. The expected tokens come from the prompts alone;
- the books after every step: ref counts equal the tables that hold each block, no block free twice, no
  leak, every full computed block findable in the prefix cache under its chained hash;
- the contract's rules: the budget, `max_num_seqs`, the blocks a step's tokens need, a victim is reset and
  was not yet scheduled in its step, nothing preempted beyond need, and the two conventions the book
  requires (first come, first served admission; no admission in a step that preempted), each said to be a
  convention and why;
- outcomes: a tight pool preempts and the tokens stay right; two identical prompts admitted in the same step
  share the blocks the first one fills; every workload finishes within a stated number of steps.

Every run is bounded in steps and every call in seconds (`time_limit`), so a loop that never ends reports
itself. Where 5.2's check needs your 5.1 while it is still a stub, the engine's preemption stands in; your
5.0, which 5.2 calls for its admissions, does not (a stub 5.0 stops the check with a message naming it).

This module drives the workloads and judges the outcomes (`check_preempt` for 5.1, `check_schedule` for
5.2); the rules checked on every call (`time_limit`, the books, the victims, one step's pick) are in
`nanoengine.pieces.schedule_rules`, the fake model and the workloads in
`nanoengine.pieces.schedule_workloads`.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.engine.sequence import Sequence
from nanoengine.pieces.learner import is_stub
from nanoengine.pieces.schedule_rules import Before, check_books, check_pick, check_victims, time_limit
from nanoengine.pieces.schedule_workloads import FakeModel, Workload, add_arrivals, alone, where, workloads

__all__ = ["check_preempt", "check_schedule", "engine_preempt", "time_limit"]


# ------------------------------------------------------------------------------------------ 5.1
def engine_preempt(sched: Scheduler, seq: Sequence, num_new_tokens: int, out: SchedulerOutput) -> bool:
    """The engine's preemption (the newest running sequence first), standing in for a stub 5.1."""
    while not sched.block_manager.can_allocate(seq, num_new_tokens):
        victim = sched.running.pop()
        out.blocks_freed += sched._preempt(victim)
        out.preempted.append(victim)
        if victim is seq:
            return False
    return True


def check_one_preemption(fn: Callable, state: Scheduler, idx: int, n: int, label: str) -> tuple[bool, int]:
    """Call a 5.1 on a copy of `state` for running[idx] and n new tokens, and check its outcome."""
    sched = copy.deepcopy(state)
    seq = sched.running[idx]
    before = Before.of(sched)
    out = SchedulerOutput()
    with time_limit(5, f"preempt_until_fits ({label})", "5.1"):
        ret = fn(sched, seq, n, out)
    bm = sched.block_manager
    if not isinstance(ret, bool):
        raise AssertionError(f"{label}: preempt_until_fits returned {ret!r}; return True when `seq` still "
                             "runs "
                             f"and its tokens fit, False when it was preempted {where('5.1')}")
    check_victims(sched, before, out, label, "5.1", not_before=idx)
    check_books(sched, label, "5.1", computed_full=False)
    freed = sorted(set(bm.free_block_ids) - set(before.free))
    if sorted(out.blocks_freed) != freed:
        raise AssertionError(f"{label}: out.blocks_freed holds {sorted(out.blocks_freed)}, but the blocks "
                             "that "
                             f"became free are {freed} (add what block_manager.free returns; any order) "
                             f"{where('5.1')}")
    preempted_self = any(v is seq for v in out.preempted)
    if ret != (not preempted_self):
        raise AssertionError(f"{label}: returned {ret} but `seq` was {'' if preempted_self else 'not '}"
                             f"preempted: return True exactly when it still runs {where('5.1')}")
    if ret and not bm.can_allocate(seq, n):
        raise AssertionError(f"{label}: returned True but seq {seq.seq_id}'s {n} new tokens still do not fit "
                             f"({bm.blocks_needed(seq, n)} blocks needed, {bm.num_free_blocks} free): keep "
                             f"preempting until can_allocate is True {where('5.1')}")
    if out.preempted:
        last = out.preempted[-1]
        if preempted_self and last is not seq:
            raise AssertionError(f"{label}: after preempting `seq` itself ({seq.seq_id}) it went on to "
                                 "preempt "
                                 f"{[v.seq_id for v in out.preempted[out.preempted.index(seq) + 1:]]}: stop "
                                 f"right "
                                 f"there, its tokens need no room any more {where('5.1')}")
        if ret:  # nothing beyond need: without the last victim's blocks it did not fit
            still = {b for s in sched.running for b in s.block_table}
            only_last = [b for b in before.tables[last.seq_id] if b not in still]
            if bm.num_free_blocks - len(only_last) >= bm.blocks_needed(seq, n):
                raise AssertionError(
                    f"{label}: preempted {[v.seq_id for v in out.preempted]}, but seq {seq.seq_id}'s tokens "
                    f"already fit before the last one ({last.seq_id}) was preempted: stop as soon as they "
                    f"fit "
                    f"{where('5.1')}")
    for s in sched.running:  # the others are untouched
        if s.block_table != before.tables[s.seq_id] or s.num_computed_tokens != before.computed[s.seq_id]:
            raise AssertionError(f"{label}: sequence {s.seq_id} was not preempted but its blocks or computed "
                                 f"tokens changed; preemption touches its victims only {where('5.1')}")
    return ret, len(out.preempted)


def check_preempt(fn: Callable) -> str:
    """Exercise 5.1 on states a tight pool reaches (the engine's scheduler and the fake model drive the
    workloads): ask room for more tokens than the free blocks hold, for a random running sequence."""
    cases = selfs = victims = 0
    for wl in workloads():
        rng = random.Random(wl.num_blocks * 7 + wl.budget)
        sched, fake, requests = wl.scheduler(), FakeModel(wl.block_size, "5.1"), []
        for step in range(400):
            add_arrivals(sched, wl, step, requests)
            if len(sched.running) >= 2 and rng.random() < 0.6:
                idx = rng.randrange(len(sched.running))
                seq = sched.running[idx]
                extra = rng.choice([1, 1, 2, len(sched.running)])
                n = (len(seq.block_table) + sched.block_manager.num_free_blocks + extra) * wl.block_size \
                    - seq.num_computed_tokens
                ret, k = check_one_preemption(
                    fn, sched, idx, n, f"preempt_until_fits(seq {seq.seq_id} at running index {idx} of "
                    f"{len(sched.running)}, {n} new tokens; {sched.block_manager.num_free_blocks} blocks "
                    f"free) at "
                    f"step {step} of the {wl.name} workload")
                cases, selfs, victims = cases + 1, selfs + (not ret), victims + k
            if not sched.has_unfinished() and step > wl.arrivals[-1].step:
                break
            out = sched.schedule()
            sched.update(out, fake.step(out, step))
    assert cases >= 40 and selfs and victims > cases, f"the workloads should make preemption cases: {cases}"
    return f"{cases} preemptions ({victims} victims, {selfs} of `seq` itself) reset and freed correctly"


# ------------------------------------------------------------------------------------------ 5.2
def plugged(schedule: Callable) -> type[Scheduler]:
    class Plugged(Scheduler):
        def pick(self) -> SchedulerOutput:
            out = schedule(self)
            if not isinstance(out, SchedulerOutput):
                raise AssertionError(f"schedule returned a {type(out).__name__}; it must return a "
                                     f"SchedulerOutput {where('5.2')}")
            return out
    return Plugged


@dataclass
class RunResult:
    tokens: list[list[int]]
    steps: int
    preemptions: int
    admitted_together_hits: list[int]  # per same-step duplicate: the hit tokens it got
    middle_chunks: int


def run_schedule(schedule: Callable, wl: Workload, max_steps: int, label: str) -> RunResult:
    """Drive a workload with `schedule` as the scheduler's pick, the fake model and the engine's own commit
    and update, checking the rules and the books at every step."""
    sched = wl.scheduler(plugged(schedule))
    fake, requests = FakeModel(wl.block_size, "5.2"), []
    preemptions = middle = 0
    together: list[int] = []
    last_arrival = wl.arrivals[-1].step
    for step in range(max_steps):
        add_arrivals(sched, wl, step, requests)
        if step > last_arrival and not sched.has_unfinished():
            break
        before = Before.of(sched)
        at = f"{label}, step {step}"
        with time_limit(5, f"schedule() at {at}", "5.2"):
            out = sched.pick()
        check_pick(sched, before, out, at)
        # identical prompts admitted in one step: the later one hits the blocks the earlier one fills
        admitted = [s for s in out.scheduled if any(s.seq is w for w in before.waiting)]
        for k, s in enumerate(admitted):
            for e in admitted[:k]:
                if e.seq.token_ids == s.seq.token_ids and e.seq.wait_for is None and s.seq.wait_for is None:
                    filled = (e.start + e.num_new_tokens) // wl.block_size * wl.block_size
                    want = min(filled, len(s.seq.token_ids) // wl.block_size * wl.block_size)
                    together.append(s.seq.num_cached_tokens)
                    if s.seq.num_cached_tokens < want:
                        raise AssertionError(
                            f"{at}: sequences {e.seq.seq_id} and {s.seq.seq_id} have the same prompt and "
                            f"were "
                            f"admitted in this step; {e.seq.seq_id} fills {filled // wl.block_size} blocks, "
                            f"yet {s.seq.seq_id} hit {s.seq.num_cached_tokens} tokens (expected {want}). "
                            "Register the blocks a sequence fills as soon as it is scheduled "
                            "(block_manager.cache_full_blocks(seq, its computed tokens after the step)), not "
                            "at the end of the step, so a later admission in the same step shares them "
                            f"{where('5.2')}")
        middle += any(s.is_prefill and s.start > 0 and s.start + s.num_new_tokens < s.seq.num_prompt_tokens
                      for s in out.scheduled)
        preemptions += len(out.preempted)
        out = commit(sched, out)
        sched.update(out, fake.step(out, step))
        check_books(sched, f"after {at}", "5.2")
    else:
        unfinished = [s.seq_id for s, _ in requests if not s.is_finished]
        raise AssertionError(f"{label}: {max_steps} steps and sequences {unfinished} are still unfinished "
                             "(the "
                             "engine's scheduler needs far fewer): does every step schedule what it can? (a "
                             "prompt longer than the budget is chunked; admission goes on while the budget, "
                             f"max_num_seqs and the free blocks allow) {where('5.2')}")
    bm = sched.block_manager
    held = bm.num_blocks - bm.num_free_blocks
    if held:
        raise AssertionError(f"{label}: every request finished but {held} blocks are still held (a leak) "
                             f"{where('5.2')}")
    return RunResult([s.token_ids[s.num_prompt_tokens:] for s, _ in requests], step, preemptions, together,
                     middle)


def commit(sched: Scheduler, picked: SchedulerOutput) -> SchedulerOutput:
    """The engine's commit of a step already picked (Scheduler.schedule without calling pick again)."""
    sched.pick = lambda: picked  # (an instance attribute for this one call)
    try:
        return Scheduler.schedule(sched)
    finally:
        del sched.pick


def step_bound(engine_steps: int) -> int:
    """The most steps a workload may take: half again the engine's own, plus 4."""
    return math.ceil(1.5 * engine_steps) + 4


def check_schedule(module: ModuleType) -> str:
    """Exercise 5.2 (with your 5.0 and 5.1; the engine's 5.1 while yours is a stub) on the workloads: the
    rules at every step, the books after it, the tokens of the fake model equal each prompt's run alone,
    preemption in the tight pool, identical prompts sharing within a step, and a bound on the steps. A stub
    5.0 that your 5.2 calls for its admissions stops the check with a NotImplementedError that names 5.0
    (check() shows "5.2 uses your 5.0, still todo"): 5.0 comes first, in part 05a."""
    schedule = module.schedule
    own_preempt = getattr(module, "preempt_until_fits", None)
    stand_in = own_preempt is not None and is_stub(own_preempt)
    if stand_in:
        module.preempt_until_fits = engine_preempt
    try:
        notes = []
        coverage = {"middle": 0, "together": 0, "preempted": 0}
        for wl in workloads():
            engine = run_schedule(Scheduler.pick, wl, 2000, f"the engine on the {wl.name} workload")
            bound = step_bound(engine.steps)
            mine = run_schedule(schedule, wl, bound, f"the {wl.name} workload (at most {bound} steps)")
            seqs = [(a.prompt, a.params) for a in wl.arrivals for _ in range(a.params.n)]
            max_len = min(wl.max_model_len, wl.num_blocks * wl.block_size)
            want = [alone(p, sp, max_len) for p, sp in seqs]
            assert engine.tokens == want, "test bug: the engine's scheduler and the oracle differ"
            for i, (got, exp) in enumerate(zip(mine.tokens, want)):
                if got != exp:
                    raise AssertionError(f"the {wl.name} workload: request {i} generated {got}, alone it "
                                         f"generates {exp} {where('5.2')}")
            if wl.name == "tight" and not mine.preemptions:
                raise AssertionError(f"the tight workload ({wl.num_blocks} blocks) never preempted: a "
                                     "running "
                                     "sequence that needs blocks makes room with preempt_until_fits "
                                     f"{where('5.2')}")
            coverage["middle"] += engine.middle_chunks
            coverage["together"] += len(engine.admitted_together_hits)
            coverage["preempted"] += engine.preemptions
            notes.append(f"{wl.name}: {mine.steps} steps (engine {engine.steps}), {mine.preemptions} "
                         "preemptions")
        assert all(coverage.values()), f"test bug: the workloads should cover every case: {coverage}"
    except NotImplementedError:
        admit = getattr(module, "admit_prompts", None)
        if admit is None or not is_stub(admit) or is_stub(schedule):  # (an untouched 5.2 is 5.2's todo)
            raise
        raise NotImplementedError(f"Exercise 5.0: your schedule (Exercise 5.2) admits through admit_prompts, "
                                  "which is still the stub: write 5.0 first, then 5.2's checks run "
                                  f"{where('5.0')}") from None
    finally:
        if stand_in:
            module.preempt_until_fits = own_preempt
    return ("tokens right, rules and books held at every step; " + "; ".join(notes)
            + (" (the engine's 5.1 stood in for your stub)" if stand_in else ""))
