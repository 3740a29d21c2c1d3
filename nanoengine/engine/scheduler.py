"""Scheduler: token-budget continuous batching with chunked prefill (vLLM v1 style). Chapter 05.

Every step has a budget of `max_num_batched_tokens` tokens. Running sequences go first, in order (a decode
costs one token, a half-done chunked prefill costs the rest of its prompt, capped by what is left of the
budget); then waiting sequences are admitted in order while budget and `max_num_seqs` allow, reusing
prefix-cache hits. When the KV pool runs out, the newest running sequence is preempted (its blocks are freed
and it is recomputed later). Pure Python over plain data: no torch.

A waiting sequence whose blocks do not fit ends admission for the step under the "fcfs" policy, as in vLLM
v1 (`vllm/v1/core/sched/scheduler.py`: `if new_blocks is None: ... break`): nothing overtakes it, so a long
prompt cannot starve behind a stream of short ones. "skip_ahead" tries up to SKIP_AHEAD_LIMIT later ones
(a short one may fit now) at the risk of that starvation; chapter 05 measures both. Either way the scan stops
where admission cannot go on, so a step's admission work is bounded by what it admits, however long the queue.

The scheduler is called twice per step, as in vLLM v1: `schedule()` before the forward, which picks the batch
(`pick`) and commits it, so that with overlap scheduling the next step can be scheduled before this one's
tokens are known (engine/pending.py); `update(out, tokens)` after it. If a step fails (an error in the
forward, Ctrl-C), `forget(steps)` undoes what committing it did. A decode may carry k drafts (speculative
decoding, chapter 09: `seq.spec_token_ids`, engine/hooks.py): it is scheduled with 1 + k tokens, cut to what
the budget and the free blocks allow. A step's records: engine/scheduler_output.py (importable here too).
"""

from __future__ import annotations

from collections import deque

from nanoengine.config import SCHEDULING_POLICIES
from nanoengine.engine import pending
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.scheduler_output import ScheduledSeq, SchedulerOutput, StepUpdate, admitted
from nanoengine.engine.sequence import Sequence, SequenceStatus
from nanoengine.errors import InvalidValueError

SKIP_AHEAD_LIMIT = 32  # "skip_ahead": waiting sequences that do not fit tried per step before admission stops


class Scheduler:
    def __init__(self, block_manager: BlockManager, eos_token_ids: set[int], *, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, policy: str = "fcfs") -> None:
        """The engine's limits come from its plan: a step's token budget, the sequences running at once, the
        longest a sequence may grow (prompt + output), and the admission policy ("fcfs" or "skip_ahead")."""
        if policy not in SCHEDULING_POLICIES:
            raise InvalidValueError(f"Scheduler: policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.policy = policy
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.eos_token_ids = set(eos_token_ids)
        self.num_steps = 0  # steps committed
        # a sequence can never hold more tokens than the pool has slots (matters for max_tokens=None)
        self._max_len = min(self.max_model_len, block_manager.num_blocks * self.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def max_len(self) -> int:
        """The most tokens a sequence may hold here (max_model_len, or what the whole pool holds if less)."""
        return self._max_len

    # ------------------------------------------------------------------ admission
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, after checking it can ever run (ValueError otherwise)."""
        self.check_admission(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def check_admission(self, seq: Sequence) -> None:
        """Raise ValueError (saying what to change) if `seq` could never run; queue nothing."""
        prompt_len = seq.num_prompt_tokens
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                raise InvalidValueError(
                    f"prompt of {prompt_len} tokens leaves no room to generate within max_model_len="
                    f"{self.max_model_len}; shorten the prompt or raise max_model_len")
            total = prompt_len
        else:
            total = prompt_len + max_tokens
            if total > self.max_model_len:
                raise InvalidValueError(
                    f"prompt of {prompt_len} tokens + max_tokens={max_tokens} = {total} exceeds "
                    f"max_model_len={self.max_model_len}; "
                    "shorten the prompt, lower max_tokens or raise max_model_len")
        blocks = self.block_manager.blocks_for(total)
        num_blocks = self.block_manager.num_blocks
        if blocks > num_blocks:
            raise InvalidValueError(
                f"request of {total} tokens needs {blocks} KV blocks of {self.block_size} tokens and can "
                f"never fit the KV pool of {num_blocks} blocks; shorten the prompt or max_tokens, or give "
                "the cache more room (num_kvcache_blocks / kv_cache_memory_gb)")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ before the forward
    def schedule(self) -> SchedulerOutput:
        """This step's batch (`pick`), committed: its new tokens count as computed from now on (`start` keeps
        where the step starts), and each sequence it brings to its end holds the place of the token it samples
        (a pending token)."""
        bm = self.block_manager
        bm.hashed_now = hashed = []
        try:
            out = self.pick()
        finally:
            bm.hashed_now = None
        out.blocks_hashed = hashed
        out.step = self.num_steps
        self.num_steps += 1
        for seq in admitted(out):
            if seq.num_prompt_cached_tokens is None:  # its first admission (what outputs report, as vLLM)
                seq.num_prompt_cached_tokens = seq.num_cached_tokens
        sampled, prefill, drafts = out.sampled, 0, 0
        for s in out.scheduled:
            seq = s.seq
            extra = len(seq.spec_token_ids)  # drafts count as computed once they are kept (update)
            seq.num_computed_tokens = computed = s.start + s.num_new_tokens - extra
            if computed == len(seq.token_ids) + seq.num_pending_tokens:  # it reaches its end
                pending.hold_place(seq)
                sampled.append(seq)
                drafts += extra
            if s.is_prefill:
                prefill += s.num_new_tokens
        out.num_prefill_tokens, out.num_drafts = prefill, drafts
        return out

    def pick(self) -> SchedulerOutput:
        """Who runs this step and how many new tokens each (the policy; chapter 05's Exercise 5.2): the
        running sequences first, then the waiting ones. No admissions in a step that had to preempt: the pool
        is under pressure and the preempted ones would just be readmitted."""
        out = SchedulerOutput()
        budget = self.continue_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self.admit_waiting(out, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def continue_running(self, out: SchedulerOutput, budget: int) -> int:
        """The running sequences, oldest first, into `out`: decodes and the rest of chunked prefills, each cut
        to the token budget left, preempting the newest while blocks run out. Returns the budget left. This
        loop runs for every sequence of every step: the block manager's arithmetic (blocks_needed,
        fills_a_block) and seq.is_prefill are written out here."""
        bm, block_size, scheduled = self.block_manager, self.block_size, out.scheduled
        i, running = 0, self.running
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            total = len(seq.token_ids) + seq.num_pending_tokens  # seq.num_tokens
            need = total - computed  # the tokens it must compute
            if need == 0 or (seq.num_pending_tokens and pending.ends_at_length(seq, self._max_len)):
                i += 1  # nothing to compute until it has a token, or its pending token is its last
                continue
            n = need + len(seq.spec_token_ids)  # a decode verifies the drafts proposed for it (hooks.py)
            if n > budget:  # cut to the budget left (drafts first)
                n = budget
                del seq.spec_token_ids[max(n - need, 0):]
            if computed + n > len(seq.block_table) * block_size:  # needs blocks: most decodes do not
                if n > need and not bm.can_allocate(seq, n):  # no room for its drafts: a plain decode
                    seq.spec_token_ids, n = [], need
                while not bm.can_allocate(seq, n):
                    victim = running.pop()  # the newest; always at index >= i
                    out.blocks_freed += self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:  # it preempted itself; it was the last one
                    break
                out.blocks_allocated += bm.allocate(seq, n)
            if (computed + n) // block_size > computed // block_size:  # a block fills up this step
                bm.cache_full_blocks(seq, computed + n)  # hits for later admissions
            is_prefill = total - computed > 1 or computed < seq.num_prompt_tokens
            scheduled.append(ScheduledSeq(seq, n, is_prefill, computed))
            budget -= n
            i += 1
        return budget

    def admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """The waiting sequences, in order, into `out` while the budget and max_num_seqs allow (`admit`; the
        policy says where admission stops). Returns the budget left."""
        j, skipped = 0, 0
        may_skip = SKIP_AHEAD_LIMIT if self.policy == "skip_ahead" else 0  # fcfs: none
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            first = seq.wait_for
            if (first is not None and not first.is_finished
                    and first.num_computed_tokens < first.num_prompt_tokens):
                j += 1  # an n>1 sibling: wait for the first completion's prefill, then hit its blocks
                continue
            n = self.admit(seq, budget)
            if n is None:  # its blocks do not fit: admission stops here (fcfs), or tries the next one
                if skipped == may_skip:
                    break
                skipped += 1
                j += 1
                continue
            hits = seq.num_cached_tokens
            is_prefill = seq.is_prefill
            out.blocks_allocated += seq.block_table[hits // self.block_size:]  # after the cached ones: new
            del self.waiting[j]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, is_prefill))
            out.cache_hits.append((seq.seq_id, hits))
            budget -= n
        return budget

    def admit(self, seq: Sequence, budget: int) -> int | None:
        """Admit one waiting sequence (empty block table) into this step, or return None leaving nothing
        behind: reuse its cached leading blocks, compute from there (but always its last token: its logits
        give the first output token) as many tokens as the budget allows, and cache the blocks it fills now
        (`cache_full_blocks`). Returns its new tokens."""
        bm = self.block_manager
        # a sequence whose prompt rows are scored (prompt logprobs) computes its whole prompt (a prefix-cache
        # hit has no logits; vLLM does the same); the blocks it fills are still cached for others
        seq.num_cached_tokens = 0 if seq.scored_until else bm.match_prefix(seq)
        seq.num_computed_tokens = min(seq.num_cached_tokens, seq.num_tokens - 1)
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not bm.can_allocate(seq, n):
            bm.free(seq)  # undo the prefix hit; the blocks stay cached
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            return None
        bm.allocate(seq, n)
        bm.cache_full_blocks(seq, seq.num_computed_tokens + n)
        return n

    def forget(self, steps: list[SchedulerOutput]) -> None:
        """After a failed step: the committed, unfinished steps (in order) are undone, so nothing they never
        computed is reused. Blocks they hashed lose their hashes, the sequences they admitted go back to the
        front of the queue with no blocks, the others drop pending tokens and drafts (pending.py); preempted
        ones stay preempted."""
        if not steps:
            return
        bm = self.block_manager
        for out in steps:
            bm.forget_hashes(out.blocks_hashed)
        pending.forget(steps)
        undone = {seq.seq_id: seq for out in steps for seq in admitted(out)}
        for seq in reversed(undone.values()):  # the first admitted ends up first in the queue
            if seq.is_finished:  # aborted meanwhile: its blocks are free already
                continue
            bm.free(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            if not seq.num_preemptions:  # this was its first admission
                seq.num_prompt_cached_tokens = None
            seq.status = SequenceStatus.WAITING
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:  # preempted by the step after
                self.waiting.remove(seq)
            self.waiting.appendleft(seq)
        self.num_steps = min(out.step for out in steps)

    def _preempt(self, seq: Sequence) -> list[int]:
        """Free all of seq's blocks and send it to the front of the waiting queue (recomputed later)."""
        freed = self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        return freed

    # ------------------------------------------------------------------ after the forward
    def update(self, out: SchedulerOutput, tokens: list[int]) -> StepUpdate:
        """The step's tokens are known: per sequence of `out.sampled`, in order, the drafts it kept and the
        model's next token. They take their places (kept drafts count as computed), complete blocks are
        cached, and the stop rules apply token by token (the rest are never appended; a finished sequence's
        blocks go to `out.blocks_freed`). A sequence that finished meanwhile ignores its rows."""
        result = StepUpdate()
        bm, finished = self.block_manager, SequenceStatus.FINISHED
        if len(tokens) != out.num_rows:
            raise InvalidValueError(f"update: got {len(tokens)} tokens for a step that samples "
                                    f"{len(out.sampled)} sequences (+ {out.num_drafts} drafts kept); pass "
                                    "one per sequence of out.sampled, in order")
        block_size, appended, i = self.block_size, result.appended, 0
        eos, max_len = self.eos_token_ids, self._max_len
        for seq in out.sampled:
            extra = len(seq.spec_token_ids)  # the drafts it kept
            new = tokens[i:i + 1 + extra] if extra else [tokens[i]]
            row, i = i, i + len(new)
            if seq.status is finished:
                result.late_rows += len(new)
                continue
            seq.num_computed_tokens += extra
            seq.num_pending_tokens -= 1
            token_ids = seq.token_ids
            known = len(token_ids)
            taken = new
            for n, token in enumerate(new, 1):
                token_ids.append(token)
                reason, stop_reason = seq.check_stop(token, eos, max_len)  # (the stop rules)
                if reason is not None:
                    taken = new[:n]
                    break
            if len(token_ids) // block_size > known // block_size:  # most tokens complete no block
                bm.cache_full_blocks(seq)
            appended.append((seq, taken))
            result.rows.append(row)
            if reason is not None:
                out.blocks_freed += self._finish(seq, reason, stop_reason)
                result.finished.append(seq)
        return result

    def stop_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """(finish reason, stop token id) after `token` was appended; (None, None): go on (check_stop)."""
        return seq.check_stop(token, self.eos_token_ids, self._max_len)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               num_dropped: int = 0) -> bool:
        """Finish `seq` (e.g. its text reached a stop string): free its blocks and take it off the queues,
        dropping its last `num_dropped` tokens (a verification's kept tokens after the one that completed a
        stop string). True if it was still running or waiting; a sequence the stop rules already finished in
        this step only takes the new reason (a stop string wins over the length limit, as in vLLM)."""
        if num_dropped:
            del seq.token_ids[-num_dropped:]
        if seq.is_finished:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            return False
        self._finish(seq, reason, stop_reason)
        return True

    def abort(self, seq: Sequence) -> bool:
        """Remove an unfinished sequence wherever it is and free its blocks; False if already finished."""
        if seq.is_finished:
            return False
        self._finish(seq, "abort")
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> list[int]:
        seq.status = SequenceStatus.FINISHED
        seq.num_pending_tokens = 0  # tokens a step in flight samples past the end are never shown
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        return self.block_manager.free(seq)
