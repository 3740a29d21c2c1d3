"""Your own engine (chapter 05's Exercise 5.6): the parts it is built over, and the checks it must pass.

The learner's `MyEngine` (exercises/ch05_continuous_batching.py) runs the step loop itself: their 5.2 picks
the batch, their 5.3 lays out the inputs, the model runs, their 5.5 draws, and their step puts the tokens in
place and retires finished sequences. What it is given, `ModelParts`, is only what a loop cannot be written
without: the engine's model over its weights and KV cache (`logits`), a fresh `Scheduler` whose block manager
owns that cache's blocks (the learner's prefix cache of chapter 04 when built with `use_exercises=["ch04"]`),
and the stop rules (`Scheduler.stop_reason`).

`check_engine(engine_class)` judges the engine on behaviour only, never on its internal state, each check
bounded in steps and in time (`run_check`: 60 s), with the engine's own 5.2, 5.3 or 5.5 standing in for one
that is still a stub (`stand_ins`), so the loop can be written first:
- greedy tokens equal transformers' on prompts the learner did not choose (two identical prompts admitted in
  one step, a prompt chunked so that a step computes only its middle, prefix hits, a request joining a
  running batch);
- after every step the block manager's books balance (`BlockManager.check_invariants`), a finished
  sequence holds no block and no place in the queues, a waiting one holds no block and no computed token;
  at the end every block is free;
- with a KV pool too small for the batch it preempts, and still gives the same tokens;
- a seeded request's sampled tokens (which, unlike tiny-qwen3's greedy ones, do not repeat) are the same
  prefilled in one step, in chunks (steps that sample nothing still run the forward) and in a batch;
- it needs fewer steps than static batching on chapter 05's workload (the cell measures the time).
Each failure is an `AssertionError` whose message says what broke and where to look. `your_pieces()` hands
chapter 11's engine the learner's chapter 05 pieces the same way (both in `pieces/stand_ins.py`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import torch

from nanoengine.attention import AttentionMetadata
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.inputs import ModelInput
from nanoengine.engine.scheduler import Scheduler
from nanoengine.engine.sequence import Sequence, SequenceStatus
from nanoengine.pieces.stand_ins import stand_ins, your_pieces  # noqa: F401  (your_pieces: the book's import)
from nanoengine.sampling_params import SamplingParams

MODEL = "tiny-qwen3"
BLOCK_SIZE = 16


def int64(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@dataclass
class ModelParts:
    """What a hand-written step loop runs over: one engine's model, KV cache and stop rules."""
    llm: Any  # the nanoengine LLM the model, cache and tokenizer come from (idle: its own loop never runs)
    block_manager_class: type[BlockManager]
    num_blocks: int
    block_size: int

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def plan(self) -> Any:
        """The engine's facts (EnginePlan: max_model_len, block_size, device, dtype, hf_config, ...)."""
        return self.llm.engine.plan

    def scheduler(self, max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                  num_blocks: int | None = None) -> Scheduler:
        """A fresh Scheduler (empty queues) whose block manager hands out `num_blocks` of the cache's
        blocks (default: all of them)."""
        blocks = min(num_blocks or self.num_blocks, self.num_blocks)
        self.llm.engine.executor.runner.kv_cache.zero_()  # a fresh engine, a fresh cache: no K/V left over
        return Scheduler(self.block_manager_class(blocks, self.block_size), self.llm.engine.eos_token_ids,
                         max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                         max_model_len=self.llm.engine.plan.max_model_len)

    @torch.inference_mode()
    def logits(self, flat: Any, scheduled: list) -> torch.Tensor:
        """One forward of the model over a step laid out by your Exercise 5.3 (`flat`, a FlatBatch) for the
        batch `scheduled`: it writes the K/V of every row into the cache, and returns the logits of its
        sampled rows, [len(flat.sample_rows), vocab] float32, in flat.sample_rows' order (no rows: [0, vocab];
        the forward still has to run, or the cache misses that chunk's K/V)."""
        prefills = [s for s in scheduled if s.num_new_tokens != 1]  # 5.3's order of the prefill chunks
        n_dec = len(flat.decode_context_lens)
        meta = AttentionMetadata(
            slot_mapping=int64(flat.slot_mapping), num_decode_seqs=n_dec,
            decode_block_tables=int64(flat.decode_block_tables) if n_dec else None,
            decode_context_lens=int64(flat.decode_context_lens) if n_dec else None,
            prefill_query_starts=list(flat.prefill_query_starts),
            prefill_query_lens=list(flat.prefill_query_lens),
            prefill_context_lens=list(flat.prefill_context_lens),
            prefill_block_tables=[int64(s.seq.block_table) for s in prefills], block_size=self.block_size)
        inp = ModelInput(int64(flat.input_ids), int64(flat.positions), meta, int64(flat.sample_rows))
        logits = self.llm.engine.executor.execute(inp)  # [num_sampled, vocab]; None when it samples nothing
        if logits is None:
            vocab = self.llm.engine.plan.hf_config.vocab_size
            return torch.empty(0, vocab, dtype=torch.float32)
        return logits


def model_parts(model: str = MODEL, num_blocks: int = 64, use_exercises: Any = (),
                exercises_dir: Any = None) -> ModelParts:
    """The parts of an engine over `model` (float32, eager, no overlap), with a KV cache of `num_blocks`
    blocks of 16 tokens. `use_exercises=["ch04"]` gives the scheduler your chapter 04 prefix cache;
    `["ch03"]` runs the model's attention on your chapter 03 pieces."""
    from nanoengine import LLM

    llm = LLM(model, dtype="float32", num_kvcache_blocks=num_blocks, block_size=BLOCK_SIZE,
              async_scheduling=False, use_exercises=list(use_exercises), exercises_dir=exercises_dir)
    return ModelParts(llm, type(llm.engine.block_manager), llm.engine.executor.num_kv_blocks, BLOCK_SIZE)


# ---------------------------------------------------------------------------------------------- the checks
def unseen_prompts(vocab: int, seed: int | None = None) -> list[list[int]]:
    """Prompts the learner did not choose: random token ids (a fresh seed each check unless given): two
    identical prompts of just over a block (admitted in the same step, the second hits the first's block),
    one long enough to be prefilled in chunks (a step computes only the middle of it), and a pair sharing a
    40-token prefix (a prefix hit)."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab) for _ in range(40)]
    twin = [rng.randrange(100, vocab) for _ in range(rng.randint(17, 20))]
    lengths = [rng.randint(50, 90), rng.randint(17, 33), rng.randint(5, 20)]
    prompts = [twin, list(twin)] + [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]
    prompts[4] = shared + prompts[4]
    prompts.append(shared + [rng.randrange(100, vocab) for _ in range(rng.randint(2, 9))])
    return prompts


def transformers_greedy(model_path: Any, prompts: list[list[int]], max_tokens: list[int],
                        eos_token_ids: set[int]) -> list[list[int]]:
    """The oracle: transformers' greedy tokens for each prompt alone, stopping at an end-of-sequence token."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # (a bar per load, in a notebook's check cell)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    finally:
        if shown:
            logging.enable_progress_bar()
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 eos_token_id=sorted(eos_token_ids), pad_token_id=sorted(eos_token_ids)[0])
            outs.append(got[0, len(prompt):].tolist())
    return outs


def first_difference(got: list[list[int]], want: list[list[int]], whose: str) -> str | None:
    """A message naming the first prompt and token where two runs differ, or None when they are equal."""
    for p, (a, b) in enumerate(zip(got, want)):
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            what = (f"generated token {i} is {a[i]}, {whose} {b[i]}" if i < min(len(a), len(b))
                    else f"yours generated {len(a)} tokens, {whose} {len(b)}")
            return f"prompt {p}: {what}"
    return None


def check_books(engine: Any, step: int, everyone: list[Sequence]) -> None:
    """The state after a step: the block manager's invariants over the running sequences' tables, and each
    sequence's place for its status. Raises AssertionError naming the first thing wrong."""
    sched: Scheduler = engine.sched
    running, waiting = list(sched.running), list(sched.waiting)
    for seq in everyone:
        where = [name for name, q in (("sched.running", running), ("sched.waiting", waiting))
                 if any(s is seq for s in q)]
        if seq.is_finished:
            assert not seq.block_table and not where, (
                f"after step {step}, sequence {seq.seq_id} is finished ({seq.finish_reason}) but "
                + (f"still holds blocks {seq.block_table}" if seq.block_table else f"is still in {where[0]}")
                + ": when your step finishes a sequence it must take it out of sched.running and free its "
                "blocks (sched.block_manager.free(seq)) (Exercise 5.6)")
        elif seq.status is SequenceStatus.WAITING and seq.num_preemptions:
            assert not seq.block_table and seq.num_computed_tokens == 0, (
                f"after step {step}, sequence {seq.seq_id} was preempted (it waits in sched.waiting) but "
                "kept "
                + (f"blocks {seq.block_table}" if seq.block_table else
                   f"num_computed_tokens={seq.num_computed_tokens}")
                + ": its K/V are gone, so it must start over from 0 computed tokens with no blocks; look at "
                "what your engine does to a victim (Exercise 5.1's preempt_until_fits)")
        elif seq.status is SequenceStatus.RUNNING:
            assert where == ["sched.running"], (
                f"after step {step}, sequence {seq.seq_id} is RUNNING but is in {where or 'no queue'}")
            need = sched.block_manager.blocks_for(seq.num_computed_tokens)
            assert len(seq.block_table) == need, (
                f"after step {step}, sequence {seq.seq_id} has {seq.num_computed_tokens} computed tokens but "
                f"{len(seq.block_table)} blocks (it needs {need}): did your step count the scheduled tokens "
                "as computed (num_computed_tokens += num_new_tokens) exactly once? (Exercise 5.6)")
            assert seq.num_computed_tokens < seq.num_tokens, (
                f"after step {step}, sequence {seq.seq_id} has {seq.num_tokens} tokens, all computed: a step "
                "that computes a sequence's last token samples the next one, which your step must append to "
                "seq.token_ids (Exercise 5.6)")
    try:
        sched.block_manager.check_invariants(running)
    except AssertionError as e:
        raise AssertionError(f"after step {step}: {e}\n(only running sequences may hold blocks; Exercise 5.6 "
                             "frees a finished one, 5.1 a preempted one)") from None


def run(engine: Any, prompts: list[list[int]], params: list[SamplingParams],
        max_steps: int = 300) -> tuple[list[list[int]], int, int]:
    """Drive the engine step by step, checking the books after each: (each prompt's generated tokens, steps,
    preemptions). Bounded: `max_steps` steps (every check's workload needs far fewer)."""
    seqs = [engine.add_request(list(p), sp) for p, sp in zip(prompts, params)]
    steps = 0
    while not all(s.is_finished for s in seqs):
        assert steps < max_steps, (
            f"{max_steps} steps and {sum(not s.is_finished for s in seqs)} of {len(seqs)} requests still "
            "unfinished: does your step finish a sequence at max_tokens (sched.stop_reason) and count its "
            "tokens as computed? (Exercise 5.6)")
        engine.step()
        steps += 1
        check_books(engine, steps, seqs)
    bm = engine.sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks, (
        f"every request finished but {bm.num_blocks - bm.num_free_blocks} blocks are still held: each "
        "finished sequence's blocks must go back (Exercise 5.6)")
    return [s.token_ids[s.num_prompt_tokens:] for s in seqs], steps, sum(s.num_preemptions for s in seqs)


def static_steps(prompt_lens: list[int], output_lens: list[int], batch: int) -> int:
    """Steps a static server takes: per batch of `batch` requests in arrival order, one prefill step and a
    decode step for each token after the first of its longest output."""
    return sum(1 + max(output_lens[g:g + batch]) - 1 for g in range(0, len(prompt_lens), batch))


# the requests of a check: greedy, each its own length; the budget chunks the long prompts and the batch limit
# makes a request join a batch already running
MAX_TOKENS = [9, 7, 14, 6, 11, 8]
BUDGET, MAX_SEQS = 32, 3
TIGHT_BLOCKS = 7  # too few for three sequences at once: the engine must preempt


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]


@functools.lru_cache(maxsize=4)
def _expected(model_path: str, prompts: tuple[tuple[int, ...], ...], eos: frozenset[int]) -> list[list[int]]:
    return transformers_greedy(model_path, [list(p) for p in prompts], MAX_TOKENS, set(eos))


def expected_tokens(parts: ModelParts, prompts: list[list[int]]) -> list[list[int]]:
    """Transformers' greedy tokens for the check's prompts (kept for the next check on the same prompts)."""
    engine = parts.llm.engine
    return _expected(str(engine.model_path), tuple(map(tuple, prompts)), frozenset(engine.eos_token_ids))


def check_same_tokens(engine_class: type, parts: ModelParts, seed: int | None = None) -> str:
    """Greedy tokens equal transformers' on unseen prompts, the books balanced after every step."""
    prompts = unseen_prompts(parts.llm.engine.plan.hf_config.vocab_size, seed)
    engine = engine_class(parts, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS)
    got, steps, _ = run(engine, prompts, greedy_params())
    differs = first_difference(got, expected_tokens(parts, prompts), "transformers'")
    assert differs is None, (f"your engine's greedy tokens differ from transformers': {differs} (prompt "
                             f"lengths {[len(p) for p in prompts]}, budget {BUDGET}); the checks of 5.2, 5.3 "
                             "and 5.5 "
                             "show which piece, or look at how your step matches each sampled row to its "
                             "sequence (flat.sample_seq_ids) (Exercise 5.6)")
    return (f"{len(prompts)} unseen prompts, {sum(map(len, got))} tokens equal to transformers' in "
            f"{steps} steps")


def check_tight_pool(engine_class: type, parts: ModelParts, seed: int | None = None) -> str:
    """With a pool too small for the batch the engine preempts and still gives transformers' tokens."""
    prompts = unseen_prompts(parts.llm.engine.plan.hf_config.vocab_size, seed)
    engine = engine_class(parts, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
                          num_blocks=TIGHT_BLOCKS)
    got, steps, preempted = run(engine, prompts, greedy_params())
    differs = first_difference(got, expected_tokens(parts, prompts), "transformers'")
    assert differs is None, (f"with {TIGHT_BLOCKS} KV blocks ({preempted} preemptions) your engine's tokens "
                             f"differ from transformers': {differs}; a preempted sequence must come back "
                             "with all its tokens, recomputed (Exercises 5.1 and 5.6)")
    assert preempted, (f"with {TIGHT_BLOCKS} KV blocks your engine never preempted, yet three of these "
                       "prompts cannot run at once: does your step run your schedule (5.2)? (Exercise 5.6)")
    return f"{TIGHT_BLOCKS} KV blocks: {preempted} preemptions, the same tokens, every block back at the end"


def chapter_workload() -> tuple[list[list[int]], list[int]]:
    """Chapter 05's workload (its first cell): 8 requests, prompts of 8-128 tokens, 4-40 new tokens."""
    rng = random.Random(5)
    prompt_lens = [rng.randint(8, 128) for _ in range(8)]
    output_lens = [rng.randint(4, 40) for _ in range(8)]
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in prompt_lens], output_lens


def check_beats_static(engine_class: type, parts: ModelParts, batch: int = 4) -> str:
    """On chapter 05's workload, at most `batch` requests at once, fewer steps than static batching."""
    prompts, output_lens = chapter_workload()
    engine = engine_class(parts, max_num_batched_tokens=512, max_num_seqs=batch)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    got, steps, _ = run(engine, prompts, params)
    assert [len(t) for t in got] == output_lens, (
        f"your engine generated {[len(t) for t in got]} tokens, asked {output_lens} (ignore_eos): the "
        "step must stop a sequence exactly at max_tokens (sched.stop_reason) (Exercise 5.6)")
    static = static_steps([len(p) for p in prompts], output_lens, batch)
    assert steps < static, (f"your engine took {steps} steps on chapter 05's workload, static batching "
                            f"{static}: a finished request should leave at once and a waiting one join the "
                            "next step (Exercise 5.6)")
    return f"chapter 05's workload in {steps} steps, static batching {static}"


def seeded_params(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=max_tokens, ignore_eos=True)


def check_seeded(engine_class: type, parts: ModelParts, seed: int | None = None) -> str:
    """Sampled tokens, which unlike tiny-qwen3's greedy ones do not repeat: a seeded request gives the same
    tokens prefilled in one step, prefilled in chunks of 8 (steps that sample nothing) and in a batch."""
    rng = random.Random(seed)
    vocab = parts.llm.engine.plan.hf_config.vocab_size
    prompt = [rng.randrange(100, vocab) for _ in range(40)]
    one_step, _, _ = run(engine_class(parts, max_num_batched_tokens=256), [prompt], [seeded_params()])
    chunked, steps, _ = run(engine_class(parts, max_num_batched_tokens=8), [prompt], [seeded_params()])
    differs = first_difference(chunked, one_step, "prefilled in one step")
    assert differs is None, (
        f"a seeded request (temperature 1, seed 11) prefilled in chunks of 8 vs in one step: {differs}. A "
        f"step "
        "that only prefills the middle of a prompt samples nothing, but its forward must still run "
        "(self.parts.logits): it writes that chunk's K/V, which every later token attends to (Exercise 5.6)")
    others = [[rng.randrange(100, vocab) for _ in range(20)], [rng.randrange(100, vocab) for _ in range(70)]]
    batch, _, _ = run(engine_class(parts, max_num_batched_tokens=16, seed=3), [others[0], prompt, others[1]],
                      [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True), seeded_params(),
                       SamplingParams(temperature=0.7, top_k=20, max_tokens=4, ignore_eos=True)])
    differs = first_difference([batch[1]], one_step, "alone")
    assert differs is None, (
        f"a seeded request in a batch of 3 vs alone: {differs}: each sampled row draws with its own "
        "sequence's generator (self.generators), the others with self.shared_generator (Exercise 5.6)")
    return f"a seeded request's {len(one_step[0])} sampled tokens equal in one step, in chunks and in a batch"


def run_check(check: Any, engine_class: type, parts: ModelParts, *args: Any) -> str:
    """One check, bounded in time (60 s), with the engine's own pieces standing in for stubs."""
    from nanoengine.pieces.schedule_checks import time_limit

    if not callable(getattr(engine_class, "step", None)) or not callable(getattr(engine_class, "add_request",
                                                                               None)):
        raise AssertionError(f"{getattr(engine_class, '__name__', engine_class)} has no step() or "
                             "add_request(): start from the class in the exercise file (Exercise 5.6)")
    with stand_ins(engine_class) as stood_in, time_limit(60, f"{check.__name__} of your engine", "5.6"):
        result = check(engine_class, parts, *args)
    return result + (f" (the engine's own {', '.join(stood_in)} stood in for your stubs)" if stood_in else "")


def check_engine(engine_class: type, parts: ModelParts, seed: int | None = None) -> list[str]:
    """Every check above, in order, each bounded in steps and in time; AssertionError at the first that
    fails. The engine's own 5.2, 5.3 or 5.5 stands in for one that is still a stub."""
    return [run_check(check_same_tokens, engine_class, parts, seed),
            run_check(check_tight_pool, engine_class, parts, seed),
            run_check(check_seeded, engine_class, parts, seed),
            run_check(check_beats_static, engine_class, parts)]
