# Your exercises for book/05a_admission.ipynb, 05b_scheduling_step.ipynb, 05c_inputs_and_logits.ipynb, 05d_sampling_and_loop.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch05")`, from nanoengine.check) or: pytest tests/exercises/test_ch05_continuous_batching.py
# Generated from solutions/ch05_continuous_batching.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
"""Chapter 05, book/05a_admission.ipynb .. 05d_sampling_and_loop.ipynb: continuous batching, the scheduler and
the sampler.

Exercise 5.0: admit waiting prompts into one step: prefix hits, the last token recomputed, same-step sharing.
Exercise 5.1: make room in the KV pool by preempting running sequences (your choice of victim).
Exercise 5.2: one scheduling step under a token budget.
Exercise 5.3: flatten a scheduled batch into the model's inputs.
Exercise 5.4: the logits filter chain: temperature, min-p, top-k, top-p.
Exercise 5.5: sample one token per row, each seeded request from its own generator.
Exercise 5.6: your own engine: the step loop over your pieces (schedule, inputs, forward, sample, update).

5.0 works on the engine's BlockManager, and 5.2 calls it for its admission pass (with the scheduler's
bookkeeping around it: the queues, the sequence limit, the output). 5.1 and 5.2 work on the engine's own
objects, so your scheduling step can drive the engine: `sched` is a
`nanoengine.engine.scheduler.Scheduler` (its `running` list, oldest first; its `waiting` deque; its
`block_manager`, with `can_allocate`, `allocate`, `free`, `blocks_needed`, `match_prefix` and
`cache_full_blocks`; `max_num_batched_tokens` and `max_num_seqs`). They return the engine's
`SchedulerOutput` of `ScheduledSeq(seq, num_new_tokens, is_prefill)`.

What each exercise needs from the others: 5.2 calls your 5.0 and 5.1; 5.5 calls your 5.4; 5.6 runs your
5.2, 5.3 and 5.5. While your 5.1 is still the untouched stub, 5.2's checks use the engine's preemption in
its place (and say so), and 5.6's use the engine's own 5.2, 5.3 or 5.5 for one still a stub, so you can
write those in any order; a stub 5.0 (part 05a, before 5.2) or 5.4 stops the checks of the exercise that
calls it, with a message that names it. The docstrings are contracts: what goes in, what comes out, what
must hold; the book's hints say how, and `show_solution("5.2")` (from nanoengine.check) prints a reference
answer when you want one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

import torch

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from nanoengine.engine.sequence import Sequence, SequenceStatus


def admit_prompts(bm: BlockManager, waiting: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
    """Exercise 5.0: admit waiting prompts into one step, as the scheduler's admission pass does.

    In: `bm`, the engine's BlockManager (with chapter 04's prefix cache: `match_prefix`, `can_allocate`,
    `allocate`, `free`, `cache_full_blocks`); `waiting`, new Sequences (empty block tables), in queue order;
    `budget`, the tokens this step may still compute.
    Out: [(seq, num_new_tokens)] for the admitted sequences, in order.
    What must hold (the checks compare with the engine's own admission on seeded pools):
    - in order, while budget is left, a sequence takes the cached blocks of its leading full blocks
      (`bm.match_prefix`) and records the hit tokens in `seq.num_cached_tokens`;
    - it computes from there, except that its last prompt token is always computed, even when every block
      hit: that token's logits give the first output token;
    - it computes as many of its remaining tokens as the budget allows (a chunk, if the budget is short);
    - a sequence whose new blocks do not fit leaves nothing behind (no blocks held, its counts 0), and
      admission stops there: first come, first served, so no later prompt overtakes it;
    - the blocks a sequence fills this step are in the cache before the next one is admitted
      (`bm.cache_full_blocks(seq, start + n)`), so an identical prompt in the same step shares them.
    Choose only: leave `seq.num_computed_tokens` where the step starts (its hits, or one less than the
    prompt), as `Scheduler.pick()` does. `Scheduler.schedule()` then commits the step before the forward
    pass: the new tokens count as computed from then on, and a step that fails is rolled back.
    """
    raise NotImplementedError("Exercise 5.0: admit waiting prompts into one step, as the scheduler's admission pass does - see book/05a_admission.ipynb")


def preempt_until_fits(sched: Scheduler, seq: Sequence, num_new_tokens: int, out: SchedulerOutput) -> bool:
    """Exercise 5.1: make room in the KV pool for `seq`'s next tokens by preempting running sequences.

    In: `sched` (its `running` list, oldest first, holds `seq`; its `waiting` deque; its `block_manager`),
    `seq`, the `num_new_tokens` it needs room for, and this step's `out` (a SchedulerOutput).
    Out: True when `seq` still runs and `sched.block_manager.can_allocate(seq, num_new_tokens)` holds; False
    when `seq` itself had to be preempted.
    What must hold afterwards (the checks test each rule, on states a tight pool reaches):
    - victims come from `seq` and the sequences after it in `sched.running`: the ones before it were already
      scheduled in this step;
    - nothing is preempted beyond need: stop once `seq` fits, or once `seq` itself was preempted;
    - a victim is out of `sched.running`, holds no block (its K/V are gone), has 0 computed tokens, is
      `SequenceStatus.WAITING` with `num_preemptions` one higher, and waits at the FRONT of `sched.waiting`
      (the book's first-come-first-served convention: it arrived before everything that waits);
    - every victim is in `out.preempted`, and every block that became free in `out.blocks_freed` (any order);
    - no other sequence changes.
    Which victim to take is your policy; the engine, like vLLM v1, takes the newest (the end of the list).
    """
    raise NotImplementedError("Exercise 5.1: make room in the KV pool for `seq`'s next tokens by preempting running sequences - see book/05a_admission.ipynb")


def schedule(sched: Scheduler) -> SchedulerOutput:
    """Exercise 5.2: one scheduling step: who computes how many tokens this step, under a token budget.

    In: `sched`, a Scheduler: `running` (oldest first), `waiting` (queue order), `block_manager`,
    `max_num_batched_tokens` (the step's token budget), `max_num_seqs`.
    Out: a SchedulerOutput: `scheduled`, one `ScheduledSeq(seq, n, is_prefill)` per sequence computing n
    tokens (`is_prefill`: `seq.is_prefill` before the step; a ScheduledSeq records `seq.num_computed_tokens`
    as where the step starts, so build it once that is set); `num_batched_tokens`, the sum of the n;
    `preempted` and `blocks_freed` (your 5.1); the block ids newly given to tables in `blocks_allocated`
    (not the prefix hits); `(seq_id, hit tokens)` per admitted sequence in `cache_hits`.
    Builds on your 5.0 and 5.1: `admit_prompts(sched.block_manager, waiting, budget)` admits from the front
    of the queue by 5.0's rules (prefix hits, the last prompt token always computed, chunking, first come,
    first served, same-step sharing), and `preempt_until_fits` makes room; this step does the scheduler's
    part around them (the budget, the two passes, the queues, the output).
    Choose only: the engine commits the step afterwards (the tokens count as computed then), so
    num_computed_tokens stays where each step starts.
    What must hold (the checks test each rule, with a fake model whose tokens are right only if every K/V a
    step reads is where it belongs):
    - budget: the n add up to at most `max_num_batched_tokens`; each n is at least 1 and at most what the
      sequence has not computed (a prompt longer than the budget left is cut: chunked prefill);
    - running sequences first: none with tokens to compute is passed over while budget is left (unless the
      step had to preempt);
    - room: a scheduled sequence holds the blocks for its tokens (`block_manager.allocate`); when the pool
      is short, your 5.1 makes room;
    - admission, with the budget the running sequences left: your 5.0 admits; each sequence it admits
      leaves `sched.waiting` and joins the end of `sched.running`, RUNNING, scheduled in the same step; at
      most `max_num_seqs` run (so hand your 5.0 no more of the queue than that leaves room for); one that is
      not admitted stays waiting, with no block and 0 computed tokens;
    - conventions the book requires (vLLM v1's): first come, first served (your 5.0 stops at a waiting
      sequence that does not fit); and a step that preempted admits no one;
    - sharing: the blocks a running sequence fills are registered in the prefix cache as soon as it is
      scheduled (`block_manager.cache_full_blocks(seq, start + n)`, as your 5.0 does for an admitted one), so
      an identical prompt admitted later in the same step hits them.
    The order you build the output in, which victim your 5.1 takes, and whether an n > 1 sibling waits for
    its first completion's prompt (`seq.wait_for`: leave it out of what your 5.0 sees) are yours.
    """
    raise NotImplementedError("Exercise 5.2: one scheduling step: who computes how many tokens this step, under a token budget - see book/05b_scheduling_step.ipynb")


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
    raise NotImplementedError("Exercise 5.3: the flat inputs of one scheduled batch, laid out as the engine's InputBuilder does - see book/05c_inputs_and_logits.ipynb")


def process_logits(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                   min_ps: list[float]) -> torch.Tensor:
    """Exercise 5.4: the filter chain of one batch, in vLLM's order; return new logits [B, V].

    In: `logits` [B, V] float32, one row per request; per row its temperature, top-k (-1: off), top-p
    (1.0: off) and min-p (0.0: off). Out: new logits [B, V], the input unchanged; a masked token is -inf.
    What must hold, row by row, in this order (vLLM v1's; the checks compare the kept tokens and their
    values with the engine's `apply_top_k_top_p_min_p`, and name the classic wrong orders):
    - the row is divided by its temperature (a greedy row, temperature 0, by 1);
    - min-p masks every token whose probability (softmax of the scaled row) is below min_p times the row's
      largest probability;
    - top-k keeps the top_k largest logits of what is left;
    - top-p, over what top-k kept renormalized (the softmax of the kept logits), keeps the smallest set of
      most likely tokens whose mass reaches top_p: a token stays when the mass of the tokens more likely
      than it is below top_p (so the most likely token always stays).
    """
    raise NotImplementedError("Exercise 5.4: the filter chain of one batch, in vLLM's order; return new logits [B, V] - see book/05c_inputs_and_logits.ipynb")


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
    raise NotImplementedError("Exercise 5.5: one token per row, each seeded request from its own generator - see book/05d_sampling_and_loop.ipynb")


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

        In: the state `add_request` and the steps before left (`self.sched`'s queues and block manager, each
        Sequence's token_ids). Out: the sequences this step finished.
        What must hold (the checks run your engine on prompts you did not choose, each run bounded in steps):
        - greedy tokens equal transformers'; a seeded request's sampled tokens depend neither on its batch nor
          on how its prompt was chunked (it draws from its own generator, `self.generators`; the others from
          `self.shared_generator`);
        - a scheduled sequence's `num_computed_tokens` grows by its `num_new_tokens`, once per step: your
          `schedule` only chooses; the model runs (`self.parts.logits`) on every step, also one that samples
          nothing (its forward writes that chunk's K/V);
        - each sampled token is appended to its own sequence's token_ids; the stop rules,
          `self.sched.stop_reason(seq, token)` -> (finish_reason or None, stop token or None), decide whether
          it finishes: FINISHED, with finish_reason and stop_reason, out of `self.sched.running`, its blocks
          back (`self.sched.block_manager.free`), its generator forgotten;
        - the block manager's books balance after every step; a tight pool preempts and gives the same
          tokens; chapter 05's workload takes fewer steps than static batching.
        Uses your 5.2, 5.3 and 5.5 (while one is still a stub the checks use the engine's own in its place).
        """
        raise NotImplementedError("Exercise 5.6: one step of your engine; return the sequences it finished - see book/05d_sampling_and_loop.ipynb")

    def generate(self, prompts: list[list[int]], params, max_steps: int = 1000) -> list[list[int]]:
        """Run every prompt to the end (one SamplingParams for all, or one each): the generated token ids.
        At most `max_steps` steps (RuntimeError after them: a loop that does not advance)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        for _ in range(max_steps):
            if all(seq.is_finished for seq in seqs):
                break
            self.step()
        else:
            raise RuntimeError(f"{max_steps} steps and not every request finished: does your step count the "
                               "scheduled tokens as computed, and stop a sequence at its max_tokens?")
        return [seq.token_ids[seq.num_prompt_tokens:] for seq in seqs]
