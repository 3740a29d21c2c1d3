"""Chapter 05, book/05_continuous_batching.ipynb: continuous batching, the scheduler and the sampler.

Exercise 5.1: make room in the KV pool by preempting the newest running sequences.
Exercise 5.2: one scheduling step under a token budget.
Exercise 5.3: flatten a scheduled batch into the model's inputs.
Exercise 5.4: the logits filter chain: temperature, min-p, top-k, top-p.
Exercise 5.5: sample one token per row, each seeded request from its own generator.
Exercise 5.6: your own engine: the step loop over your pieces (schedule, inputs, forward, sample, update).

5.1 and 5.2 work on the engine's own objects, so your scheduling step can drive the engine: `sched` is a
`nanoengine.engine.scheduler.Scheduler` (its `running` list, oldest first; its `waiting` deque; its
`block_manager`, with `can_allocate`, `allocate`, `free`, `blocks_needed`, `match_prefix` and
`cache_full_blocks`; `max_num_batched_tokens` and `max_num_seqs`). They return the engine's
`SchedulerOutput` of `ScheduledSeq(seq, num_new_tokens, is_prefill)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanoengine.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from nanoengine.engine.sequence import Sequence, SequenceStatus


def preempt_until_fits(sched: Scheduler, seq: Sequence, num_new_tokens: int, out: SchedulerOutput) -> bool:
    """Exercise 5.1: preempt the newest running sequences until `seq`'s next tokens fit the KV pool.

    While `sched.block_manager.can_allocate(seq, num_new_tokens)` is False, preempt the NEWEST running
    sequence, the last of `sched.running` (`seq` itself, when it is the newest):
    - take it out of `sched.running` and free its blocks (`block_manager.free(victim)` returns the block ids
      that became free: add them to `out.blocks_freed`);
    - its K/V are gone, so it starts over: `num_computed_tokens = 0`, status `SequenceStatus.WAITING`,
      `num_preemptions += 1`; it goes to the FRONT of `sched.waiting` (`appendleft`);
    - append it to `out.preempted`.
    Stop as soon as `seq` fits, or right after preempting `seq` itself. Return True if `seq` is still
    running (its tokens now fit), False if it was preempted.
    """
    # BEGIN SOLUTION
    bm = sched.block_manager
    while not bm.can_allocate(seq, num_new_tokens):
        victim = sched.running.pop()
        out.blocks_freed += bm.free(victim)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        sched.waiting.appendleft(victim)
        out.preempted.append(victim)
        if victim is seq:
            return False
    return True
    # END SOLUTION


def schedule(sched: Scheduler) -> SchedulerOutput:
    """Exercise 5.2: one scheduling step; the same decisions as `Scheduler.pick`.

    `Scheduler.pick()` is the half of `Scheduler.schedule()` that chooses the batch; `schedule()` then commits
    it (the tokens count as computed). Yours chooses and does not commit: after it, each sequence's
    num_computed_tokens is still where its step starts. The rules a step obeys (the tests compare its output
    and the state it leaves with `pick`'s):

    - Budget: the step computes at most `sched.max_num_batched_tokens` tokens in all. A scheduled sequence
      computes as many of its not-yet-computed tokens as the budget still allows (a decode: 1; a prompt: the
      rest of it, cut to the budget: chunked prefill). A sequence with nothing to compute is not scheduled;
      nothing is tried once the budget is spent.
    - Order: running sequences before waiting ones; running oldest first (the order of `sched.running`),
      waiting in queue order.
    - Room: a sequence's tokens are scheduled only with their blocks allocated. A running sequence that needs
      new blocks (`block_manager.blocks_needed`) makes room with your `preempt_until_fits` first; if that
      preempted the sequence itself, no later running sequence is scheduled in this step.
    - Admission happens only in a step that preempted nothing, and only while fewer than
      `sched.max_num_seqs` sequences run. An admitted sequence starts from its prefix-cache hits
      (`block_manager.match_prefix`, kept in `num_cached_tokens`) but always computes its last prompt token,
      whose logits give its first new token; it joins the end of `sched.running`, RUNNING.
    - First come, first served: the first waiting sequence whose blocks do not fit ends admission for the
      step; its hits are given back (`block_manager.free`) and its token counts reset to 0. An n>1 sibling
      whose first completion (`seq.wait_for`, unfinished) has not computed its whole prompt is passed over,
      without ending admission.
    - Sharing within the step: the blocks a sequence fills are registered in the prefix cache as soon as it
      is scheduled (`block_manager.cache_full_blocks(seq, its computed tokens after this step)`), so a later
      admission in the same step hits them.
    - Output: `ScheduledSeq(seq, n, is_prefill)` in the order scheduled, `is_prefill` as it was before the
      step; `preempted` and `blocks_freed` from your 5.1; every allocated block id in `blocks_allocated`;
      `(seq_id, hit tokens)` per admitted sequence in `cache_hits`; the tokens used in `num_batched_tokens`.
    """
    # BEGIN SOLUTION
    bm = sched.block_manager
    out = SchedulerOutput()
    budget = sched.max_num_batched_tokens
    i = 0
    while i < len(sched.running) and budget > 0:
        seq = sched.running[i]
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if n == 0:
            i += 1
            continue
        if bm.blocks_needed(seq, n) and not preempt_until_fits(sched, seq, n, out):
            break
        out.blocks_allocated += bm.allocate(seq, n)
        bm.cache_full_blocks(seq, seq.num_computed_tokens + n)
        out.scheduled.append(ScheduledSeq(seq, n, seq.is_prefill))
        budget -= n
        i += 1
    if not out.preempted:
        j = 0
        while j < len(sched.waiting) and budget > 0 and len(sched.running) < sched.max_num_seqs:
            seq = sched.waiting[j]
            first = seq.wait_for
            if (first is not None and not first.is_finished
                    and first.num_computed_tokens < first.num_prompt_tokens):
                j += 1
                continue
            hits = bm.match_prefix(seq)
            seq.num_cached_tokens = hits
            seq.num_computed_tokens = min(hits, seq.num_tokens - 1)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.can_allocate(seq, n):
                bm.free(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            is_prefill = seq.is_prefill
            out.blocks_allocated += bm.allocate(seq, n)
            bm.cache_full_blocks(seq, seq.num_computed_tokens + n)
            del sched.waiting[j]
            seq.status = SequenceStatus.RUNNING
            sched.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, is_prefill))
            out.cache_hits.append((seq.seq_id, hits))
            budget -= n
    out.num_batched_tokens = sched.max_num_batched_tokens - budget
    return out
    # END SOLUTION


@dataclass
class FlatBatch:
    """One step's model inputs as plain lists (the fields of the engine's ModelInput and
    AttentionMetadata)."""
    input_ids: list[int] = field(default_factory=list)  # one row per new token: decodes first, then chunks
    positions: list[int] = field(default_factory=list)
    # cache slot of each row, -1 if a cached block holds it
    slot_mapping: list[int] = field(default_factory=list)
    decode_block_tables: list[list[int]] = field(default_factory=list)  # one row per decode, padded with 0
    decode_context_lens: list[int] = field(default_factory=list)  # tokens each decode attends over
    prefill_query_starts: list[int] = field(default_factory=list)  # first row of each prefill chunk
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_context_lens: list[int] = field(default_factory=list)  # cached prefix + chunk
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits give a sequence's next token
    sample_seq_ids: list[int] = field(default_factory=list)  # the sequence of each sampled row


def build_inputs(scheduled: list[ScheduledSeq], block_size: int) -> FlatBatch:
    """Exercise 5.3: the flat inputs of one scheduled batch, laid out as the engine's InputBuilder does.

    Each ScheduledSeq computes positions start .. start + num_new_tokens - 1 of its sequence (`start`: where
    the step begins; the scheduler has already counted these tokens in seq.num_computed_tokens). The
    sequence's known tokens are seq.token_ids.
    - Decodes first: every ScheduledSeq with exactly ONE new token (a prefill whose prompt hit the prefix
      cache up to its last token counts too), in scheduled order; then every other one (prefill chunks),
      in scheduled order.
    - Per row: the token id at that position, the position, and the slot
      block_table[pos // block_size] * block_size + pos % block_size, or -1 when pos < num_cached_tokens
      (a shared prefix-cache block already holds that K/V: it is not written again).
    - Decodes: their block tables, padded with 0 to the longest, and their context length (start + 1).
    - Prefill chunks: the row where each starts, its length, and its context length (start + new).
    - Sampled rows: the row of a sequence's last token, only when this step reaches the end of its known
      tokens (a chunk in the middle of a prompt produces no token), with that sequence's id, in row order.
    """
    # BEGIN SOLUTION
    flat = FlatBatch()
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    prefills = [s for s in scheduled if s.num_new_tokens != 1]
    for group in (decodes, prefills):
        for s in group:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            if group is prefills:
                flat.prefill_query_starts.append(len(flat.input_ids))
                flat.prefill_query_lens.append(n)
                flat.prefill_context_lens.append(start + n)
            for pos in range(start, start + n):
                flat.input_ids.append(seq.token_ids[pos])
                flat.positions.append(pos)
                block = seq.block_table[pos // block_size]
                flat.slot_mapping.append(-1 if pos < seq.num_cached_tokens
                                         else block * block_size + pos % block_size)
            if start + n == len(seq.token_ids):
                flat.sample_rows.append(len(flat.input_ids) - 1)
                flat.sample_seq_ids.append(seq.seq_id)
    width = max((len(s.seq.block_table) for s in decodes), default=0)
    flat.decode_block_tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes]
    flat.decode_context_lens = [s.start + 1 for s in decodes]
    return flat
    # END SOLUTION


def process_logits(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                   min_ps: list[float]) -> torch.Tensor:
    """Exercise 5.4: the filter chain of one batch, in vLLM's order; return new logits [B, V].

    `logits` [B, V] float32, one row per request; the lists give each row's parameters.
    1. Temperature: divide row b by temperatures[b] (a greedy row, temperature 0, is divided by 1).
    2. min-p (skip when min_ps[b] is 0): mask every token whose probability (softmax of the scaled row) is
       below min_ps[b] times the row's largest probability.
    3. top-k (skip when top_ks[b] is -1): keep the top_ks[b] largest logits of what is left.
    4. top-p (skip when top_ps[b] is 1.0): over what top-k kept, renormalized (softmax of the kept logits),
       keep the smallest set of most likely tokens whose probability mass reaches top_ps[b]: sorted from the
       most likely, a token stays when the mass of the tokens BEFORE it is below top_ps[b] (so the most
       likely token always stays).
    "Mask" means: set the logit to -inf. Do not change the input tensor.
    """
    # BEGIN SOLUTION
    temps = torch.tensor(temperatures, dtype=torch.float32)
    x = logits / torch.where(temps == 0, 1.0, temps)[:, None]  # [B, V]
    out = []
    for b in range(x.shape[0]):
        row = x[b]
        if min_ps[b] > 0:
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < min_ps[b] * probs.max(), float("-inf"))
        if top_ks[b] != -1 or top_ps[b] < 1.0:
            values, order = row.sort(descending=True)
            if top_ks[b] != -1:
                values = values.clone()
                values[top_ks[b]:] = float("-inf")
            if top_ps[b] < 1.0:
                probs = torch.softmax(values, dim=-1)
                before = probs.cumsum(dim=-1) - probs
                drop = before >= top_ps[b]
                drop[0] = False
                values = values.masked_fill(drop, float("-inf"))
            row = torch.empty_like(row).scatter_(0, order, values)
        out.append(row)
    return torch.stack(out)
    # END SOLUTION


def sample(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
           min_ps: list[float], generators: list[torch.Generator | None],
           shared_generator: torch.Generator) -> list[int]:
    """Exercise 5.5: one token per row, each seeded request from its own generator.

    - A greedy row (temperature 0) takes the argmax of its raw logits; an all-greedy batch needs no random
      numbers at all.
    - Every other row draws its token with the probabilities of the softmax of its filtered logits (your
      `process_logits`; a masked token has probability 0), using random numbers from its own generator,
      `generators[b]`, when the request has a seed, and from `shared_generator` when it has none (None). A
      seeded request's tokens then depend on its seed only, not on the other rows of its batch.
    The checks judge what you draw, not how: greedy rows, the support, the frequencies of many draws, and a
    seeded row alone vs in a batch. (The engine's Sampler inverts the cumulative distribution with one
    uniform number per row; any exact method passes.)
    """
    # BEGIN SOLUTION
    greedy = [t == 0 for t in temperatures]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()
    cdf = torch.softmax(process_logits(logits, temperatures, top_ks, top_ps, min_ps), dim=-1).cumsum(dim=-1)
    u = torch.rand(cdf.shape[0], generator=shared_generator)  # [B]
    for b, gen in enumerate(generators):
        if gen is not None:
            u[b] = torch.rand((), generator=gen).item()
    target = (u * cdf[:, -1])[:, None]  # [B, 1]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)
    argmax = logits.argmax(dim=-1)
    return [int(argmax[b]) if greedy[b] else int(tokens[b]) for b in range(len(greedy))]
    # END SOLUTION


class MyEngine:
    """Your own engine over the engine's model: your step loop, your 5.2 scheduling, your 5.3 inputs, your
    5.5 sampling. `parts` (`nanoengine.pieces.own_engine.model_parts()`) holds what a loop is written over:

    - `parts.scheduler(max_num_batched_tokens, max_num_seqs, num_blocks)`: a fresh Scheduler, its queues
      empty and its block manager handing out the model's KV cache blocks (your chapter 04 prefix cache with
      `model_parts(use_exercises=["ch04"])`);
    - `parts.logits(flat, scheduled)`: the model's forward over a step your 5.3 laid out, the logits of
      its sampled rows [len(flat.sample_rows), vocab] in that order.
    """

    def __init__(self, parts, max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                 num_blocks: int | None = None, seed: int = 0) -> None:
        self.parts = parts
        self.sched = parts.scheduler(max_num_batched_tokens, max_num_seqs, num_blocks)
        self.shared_generator = torch.Generator().manual_seed(seed)  # draws of the requests without a seed
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> a seeded request's own generator

    def add_request(self, prompt_ids: list[int], params) -> Sequence:
        """Queue one request (a prompt's token ids and its SamplingParams); returns its Sequence, whose
        token_ids grow as your steps generate."""
        seq = Sequence(prompt_ids, params, self.sched.block_size)
        self.sched.add(seq)
        if params.seed is not None:
            self.generators[seq.seq_id] = torch.Generator().manual_seed(params.seed)
        return seq

    def step(self) -> list[Sequence]:
        """Exercise 5.6: one step of your engine; return the sequences it finished.

        1. Schedule with your `schedule(self.sched)` (5.2). It picks the batch and allocates its blocks but
           does not count the tokens as computed: after it, each scheduled sequence's num_computed_tokens
           grows by its num_new_tokens (the forward below computes their K/V).
        2. Lay the batch out with your `build_inputs` (5.3) and run the model: `self.parts.logits(flat,
           out.scheduled)`. A step whose batch samples no row (only mid-prompt chunks) ends here.
        3. Draw one token per sampled row with your `sample` (5.5), each row with its sequence's
           SamplingParams (temperature, top_k, top_p, min_p) and generator (`self.generators`, None for a
           request without a seed), and `self.shared_generator`.
        4. Update: append each token to its sequence's token_ids, then ask the stop rules
           (`self.sched.stop_reason(seq, token)` -> (finish_reason or None, stop token or None)). A sequence
           that stops is FINISHED with that finish_reason and stop_reason: it leaves `self.sched.running`, its
           blocks go back (`self.sched.block_manager.free(seq)`), and it forgets its generator.
        The checks judge behaviour, not your code: greedy tokens equal transformers', the block manager's
        books balance after every step, a tight pool preempts and gives the same tokens, fewer steps than
        static batching.
        """
        # BEGIN SOLUTION
        out = schedule(self.sched)
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        flat = build_inputs(out.scheduled, self.sched.block_size)
        if not flat.sample_rows:
            return []
        logits = self.parts.logits(flat, out.scheduled)  # [num_sampled, vocab]
        by_id = {s.seq.seq_id: s.seq for s in out.scheduled}
        seqs = [by_id[i] for i in flat.sample_seq_ids]
        params = [seq.sampling_params for seq in seqs]
        tokens = sample(logits, [p.temperature for p in params], [p.top_k for p in params],
                        [p.top_p for p in params], [p.min_p for p in params],
                        [self.generators.get(seq.seq_id) for seq in seqs], self.shared_generator)
        finished = []
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(int(token))
            reason, stop_token = self.sched.stop_reason(seq, int(token))
            if reason is not None:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason, seq.stop_reason = reason, stop_token
                self.sched.running.remove(seq)
                self.sched.block_manager.free(seq)
                self.generators.pop(seq.seq_id, None)
                finished.append(seq)
        return finished
        # END SOLUTION

    def generate(self, prompts: list[list[int]], params) -> list[list[int]]:
        """Run every prompt to the end (one SamplingParams for all, or one each): the generated token ids."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while not all(seq.is_finished for seq in seqs):
            self.step()
        return [seq.token_ids[seq.num_prompt_tokens:] for seq in seqs]
