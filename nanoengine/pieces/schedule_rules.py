"""The rules a scheduling step obeys, checked on the state it leaves (chapter 05, Exercises 5.1 and 5.2).

Each function here looks at one call (a `preempt_until_fits` or one `schedule` pick) against the state it
started from, and raises an AssertionError that names the rule and where it is explained
(`nanoengine.pieces.schedule_checks` drives the workloads and calls these at every step):

- `time_limit`: every call bounded in seconds, so a loop that never ends reports itself;
- `check_books`: ref counts equal the running tables that hold each block, no block free twice, no leak,
  every full computed block findable in the prefix cache under its chained hash;
- `check_victims`: a victim is reset (no blocks, 0 computed, WAITING, one more preemption), listed once and
  put back at the front of the queue;
- `check_pick`: the budget, `max_num_seqs`, the blocks a step's tokens need, running sequences first, and
  the two conventions the book requires (first come, first served admission; no admission in a step that
  preempted), each said to be a convention and why.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.engine.sequence import Sequence, SequenceStatus
from nanoengine.pieces.schedule_workloads import chained_hashes, where


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


# ------------------------------------------------------------------------------------ victims (5.1 and 5.2)
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


# ------------------------------------------------------------------------------------------ one step (5.2)
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
