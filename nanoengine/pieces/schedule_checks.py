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
itself. Where a check needs an earlier exercise that is still a stub, the engine's own piece stands in.
"""

from __future__ import annotations

import copy
import math
import random
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.engine.sequence import Sequence, SequenceStatus
from nanoengine.pieces.learner import is_stub
from nanoengine.pieces.schedule_workloads import (
    FakeModel,
    Workload,
    add_arrivals,
    alone,
    chained_hashes,
    where,
    workloads,
)


# ------------------------------------------------------------------------------------------ time limits
@contextmanager
def time_limit(seconds: float, what: str, exercise: str) -> Iterator[None]:
    """Raise AssertionError naming `what` when the block runs longer than `seconds` (a loop that never ends).
    Uses SIGALRM, so only on the main thread of a Unix process; elsewhere the block runs unbounded."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise AssertionError(f"{what} ran for more than {seconds:g} s: a loop that never ends? (a `while` "
                             "whose condition your code never changes, or an index never advanced) "
                             f"{where(exercise)}")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_books(sched: Scheduler, label: str, exercise: str, computed_full: bool = True) -> None:
    """The block manager's books against the running sequences' tables (only running sequences hold
    blocks), no block free twice, and (`computed_full`) every full computed block findable by its hash."""
    bm = sched.block_manager
    holders = list(sched.running)
    for seq in sched.waiting:
        if seq.block_table:
            raise AssertionError(f"{label}: sequence {seq.seq_id} waits in sched.waiting but holds blocks "
                                 f"{seq.block_table}: a waiting sequence holds none (a preempted one is "
                                 f"freed, "
                                 f"one that could not be admitted gives its hits back) {where(exercise)}")
    if len(set(bm.free_block_ids)) != len(bm.free_block_ids):
        twice = sorted({b for b in bm.free_block_ids if list(bm.free_block_ids).count(b) > 1})
        raise AssertionError(f"{label}: blocks {twice} are in the free list twice (freed twice) "
                             f"{where(exercise)}")
    try:
        bm.check_invariants(holders)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}\n(ref counts must equal the running sequences' tables that hold "
                             f"each block: no leak, no double free) {where(exercise)}") from None
    if not computed_full or not bm.enable_prefix_caching:
        return
    for seq in holders:
        for i, block_id in enumerate(seq.block_table):
            if bm.blocks[block_id].hash is not None and (i + 1) * bm.block_size > seq.num_computed_tokens:
                raise AssertionError(
                    f"{label}: block {i} of sequence {seq.seq_id} (block id {block_id}) is in the prefix "
                    f"cache, "
                    f"but only {seq.num_computed_tokens} of its tokens are computed: a block is registered "
                    f"once "
                    "the step that fills it is scheduled (cache_full_blocks(seq, start + n)), never before, "
                    "or "
                    f"a later admission would read K/V that were never written {where(exercise)}")
    for seq in holders:
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // bm.block_size
        for i, h in enumerate(chained_hashes(seq.token_ids, bm.block_size, full)):
            block = bm.blocks[seq.block_table[i]]
            if block.hash != h:
                raise AssertionError(
                    f"{label}: block {i} of sequence {seq.seq_id} (block id {block.block_id}) is full and "
                    "computed but not registered in the prefix cache under its chained hash (the book's "
                    "convention, chapter 04's and vLLM's: a block's hash chains its parent's, so equal "
                    "hashes mean equal whole prefixes and a hit is never another prefix's K/V): the blocks a "
                    "sequence fills are registered as it is scheduled (block_manager.cache_full_blocks(seq, "
                    "its computed tokens after the step)), so a later admission can hit them "
                    f"{where(exercise)}")


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


@dataclass
class Before:
    """What a check needs to know about the state a call started from."""
    running: list[Sequence]
    waiting: list[Sequence]
    tables: dict[int, list[int]]
    computed: dict[int, int]
    preemptions: dict[int, int]
    free: list[int]

    @classmethod
    def of(cls, sched: Scheduler) -> Before:
        seqs = list(sched.running) + list(sched.waiting)
        return cls(list(sched.running), list(sched.waiting), {s.seq_id: list(s.block_table) for s in seqs},
                   {s.seq_id: s.num_computed_tokens for s in seqs},
                   {s.seq_id: s.num_preemptions for s in seqs},
                   list(sched.block_manager.free_block_ids))


def check_victims(sched: Scheduler, before: Before, out: SchedulerOutput, label: str, exercise: str,
                  not_before: int | None) -> None:
    """Each victim is reset (no blocks, 0 computed, WAITING, one more preemption), listed once in
    out.preempted, back in the waiting queue ahead of everything that waited before; `not_before`: the
    running index before which nothing may be preempted (those were scheduled already)."""
    ids = [s.seq_id for s in out.preempted]
    if len(set(ids)) != len(ids):
        raise AssertionError(f"{label}: out.preempted lists a sequence twice ({ids}) {where(exercise)}")
    running_ids = {s.seq_id for s in sched.running}
    gone = [s for s in before.running if s.seq_id not in running_ids]
    if {s.seq_id for s in gone} != set(ids):
        raise AssertionError(f"{label}: the sequences that left sched.running are "
                             f"{[s.seq_id for s in gone]}, "
                             f"out.preempted lists {ids}: every victim leaves running and is listed in "
                             f"out.preempted {where(exercise)}")
    waiting = list(sched.waiting)
    for victim in out.preempted:
        vid = victim.seq_id
        if not_before is not None:
            idx = next(i for i, s in enumerate(before.running) if s is victim)
            if idx < not_before:
                raise AssertionError(
                    f"{label}: sequence {vid} (running index {idx}) was preempted, but the sequences before "
                    f"index {not_before} in sched.running were already scheduled in this step: preempting "
                    f"one "
                    "throws away tokens the step already counted. Choose victims among `seq` and the "
                    "sequences "
                    "after it (the engine takes the newest, the end of the list, as vLLM v1 does) "
                    f"{where(exercise)}")
        problems = []
        if victim.block_table:
            problems.append(f"it still holds blocks {victim.block_table} (free them: block_manager.free)")
        if victim.num_computed_tokens != 0:
            problems.append(f"num_computed_tokens is {victim.num_computed_tokens}: its K/V are gone with its "
                            "blocks, so it must be recomputed from token 0")
        if victim.status is not SequenceStatus.WAITING:
            problems.append(f"its status is {victim.status.name}, not WAITING")
        if victim.num_preemptions != before.preemptions[vid] + 1:
            problems.append(f"num_preemptions went from {before.preemptions[vid]} to "
                            f"{victim.num_preemptions} "
                            "(one more per preemption)")
        if not any(s is victim for s in waiting):
            problems.append("it is not in sched.waiting (it must be readmitted later)")
        if problems:
            raise AssertionError(f"{label}: preempted sequence {vid}: " + "; ".join(problems)
                                 + f" {where(exercise)}")
    old = [i for i, s in enumerate(waiting) if any(s is w for w in before.waiting)]
    new = [i for i, s in enumerate(waiting) if any(s is v for v in out.preempted)]
    if old and new and max(new) > min(old):
        raise AssertionError(
            f"{label}: a preempted sequence went behind sequences that were already waiting (queue now "
            f"{[s.seq_id for s in waiting]}). The book's convention is first come, first served: a victim "
            "arrived before everything that is waiting, so it goes to the FRONT of the queue (appendleft, as "
            f"vLLM v1's prepend_request) and is readmitted first {where(exercise)}")


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


def is_waiting_sibling(seq: Sequence) -> bool:
    first = seq.wait_for
    return first is not None and not first.is_finished and first.num_computed_tokens < first.num_prompt_tokens


def check_pick(sched: Scheduler, before: Before, out: SchedulerOutput, label: str) -> None:
    """The rules one scheduling step obeys (before it is committed)."""
    ex = "5.2"
    budget, bm = sched.max_num_batched_tokens, sched.block_manager
    seen: set[int] = set()
    total = 0
    running_now = list(sched.running)
    for s in out.scheduled:
        seq, n = s.seq, s.num_new_tokens
        if seq.seq_id in seen:
            raise AssertionError(f"{label}: sequence {seq.seq_id} is scheduled twice {where(ex)}")
        seen.add(seq.seq_id)
        if not any(r is seq for r in running_now) or seq.status is not SequenceStatus.RUNNING:
            raise AssertionError(
                f"{label}: sequence {seq.seq_id} is scheduled but is "
                + ("preempted (in sched.waiting): a sequence scheduled earlier in the step was chosen as a "
                   "victim, so its tokens have no blocks; victims come from the sequences not yet scheduled"
                   if any(v is seq for v in out.preempted) else
                   f"{seq.status.name} and not in sched.running: a scheduled sequence is RUNNING in "
                   "sched.running") + f" {where(ex)}")
        if n < 1 or s.start + n > seq.num_tokens:
            raise AssertionError(
                f"{label}: sequence {seq.seq_id} is scheduled with {n} new tokens from position {s.start} "
                f"but "
                f"has {seq.num_tokens} tokens: a scheduled sequence computes 1 to {seq.num_tokens - s.start} "
                "of its not-yet-computed tokens" + (" (a full prefix hit still computes the last prompt "
                "token: "
                "its logits give the first new token, so num_computed_tokens = min(hits, num_tokens - 1))"
                if n < 1 and seq.num_computed_tokens >= seq.num_tokens else "") + f" {where(ex)}")
        if len(seq.block_table) < bm.blocks_for(s.start + n):
            need = bm.blocks_for(s.start + n)
            raise AssertionError(f"{label}: sequence {seq.seq_id} computes up to position {s.start + n - 1} "
                                 f"but holds {len(seq.block_table)} blocks (it needs {need}): allocate "
                                 f"before scheduling {where(ex)}")
        total += n
    if total > budget:
        raise AssertionError(f"{label}: the step schedules {total} tokens, over the budget of {budget} "
                             f"(max_num_batched_tokens) {where(ex)}")
    if out.num_batched_tokens != total:
        raise AssertionError(f"{label}: out.num_batched_tokens is {out.num_batched_tokens}, the scheduled "
                             f"sequences compute {total} {where(ex)}")
    if len(sched.running) > max(sched.max_num_seqs, len(before.running)):
        raise AssertionError(f"{label}: {len(sched.running)} sequences run, max_num_seqs is "
                             f"{sched.max_num_seqs} {where(ex)}")
    check_victims(sched, before, out, label, ex, not_before=None)
    # running sequences first: none with work left is passed over while budget remains
    if total < budget and not out.preempted:
        for seq in before.running:
            if (any(r is seq for r in running_now) and seq.num_tokens > before.computed[seq.seq_id]
                    and seq.seq_id not in seen):
                raise AssertionError(f"{label}: running sequence {seq.seq_id} has tokens to compute and the "
                                     f"step used {total} of {budget} tokens, but it was not scheduled "
                                     f"{where(ex)}")
    admitted = [w for w in before.waiting if any(r is w for r in running_now)]
    readmitted = [v for v in out.preempted if any(r is v for r in running_now)]  # a victim back at once
    hits = sorted((w.seq_id, w.num_cached_tokens) for w in admitted + readmitted)
    if sorted(out.cache_hits) != hits:
        raise AssertionError(f"{label}: out.cache_hits is {sorted(out.cache_hits)}, the admitted sequences' "
                             f"(seq_id, hit tokens) are {hits} {where(ex)}")
    new_blocks = []
    for s in out.scheduled:
        old = before.tables.get(s.seq.seq_id, [])
        table = s.seq.block_table
        new_blocks += table[len(old):] if old else table[s.seq.num_cached_tokens // bm.block_size:]
    if sorted(out.blocks_allocated) != sorted(new_blocks):
        raise AssertionError(f"{label}: out.blocks_allocated is {sorted(out.blocks_allocated)}, the blocks "
                             f"newly given to tables (prefix hits aside) are {sorted(new_blocks)} "
                             f"{where(ex)}")
    for w in admitted + readmitted:
        if w.seq_id not in seen:
            raise AssertionError(f"{label}: sequence {w.seq_id} moved to sched.running but is not scheduled: "
                                 f"admit a sequence together with its first tokens {where(ex)}")
    if (admitted or readmitted) and out.preempted:
        raise AssertionError(
            f"{label}: the step preempted {[v.seq_id for v in out.preempted]} and admitted "
            f"{[w.seq_id for w in admitted + readmitted]}. The book's convention (vLLM v1's): no admission "
            f"in a step that "
            "preempted; the pool is short of blocks, and an admission would take the blocks just freed while "
            f"the victim waits {where(ex)}")
    if admitted:  # first come, first served: the admitted ones are a prefix of the queue
        last = max(i for i, w in enumerate(before.waiting) if any(a is w for a in admitted))
        for w in before.waiting[:last]:
            if not any(a is w for a in admitted) and not is_waiting_sibling(w):
                raise AssertionError(
                    f"{label}: sequence {w.seq_id} waited ahead of {[a.seq_id for a in admitted]} but was "
                    f"not "
                    "admitted while a later one was. The book's convention is first come, first served (vLLM "
                    "v1's): the first waiting sequence that does not fit ends admission for the step, so a "
                    f"long prompt is never overtaken forever by short ones {where(ex)}")
    for w in before.waiting:
        if not any(a is w for a in admitted) and (w.num_computed_tokens or w.block_table):
            raise AssertionError(
                f"{label}: sequence {w.seq_id} stays waiting with "
                f"num_computed_tokens={w.num_computed_tokens} "
                f"and blocks {w.block_table}: one that is not admitted gives its prefix hits back "
                f"(block_manager.free) and starts from 0 computed tokens {where(ex)}")


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
    """Exercise 5.2 (with your 5.1, or the engine's while yours is a stub) on the workloads: the rules at
    every step, the books after it, the tokens of the fake model equal each prompt's run alone, preemption
    in the tight pool, identical prompts sharing within a step, and a bound on the steps."""
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
    finally:
        if stand_in:
            module.preempt_until_fits = own_preempt
    return ("tokens right, rules and books held at every step; " + "; ".join(notes)
            + (" (the engine's 5.1 stood in for your stub)" if stand_in else ""))
