"""Decode steps measured at several batch sizes, each one a point on the roofline. Chapter 08 (chapter 02
works out the batch-1 point by hand and points here).

For each batch size b, `decode_points` sends b requests of `prompt_len` seeded random token ids through the
engine at once (greedy, `ignore_eos`, `steps + 1` output tokens each). Their prompts must fit in one step (the
token budget), so the first step prefills all of them and every later step decodes all b sequences at the same
context: the i-th decode step feeds each sequence the token at position prompt_len + i, context
prompt_len + i + 1. From the run's `StepStats`:
  step time = the median gap between the ends of consecutive decode steps (what a step costs the run, the
              host's work included; the first decode step, which follows the prefill, is not timed);
  FLOPs and bytes of each decode step from `roofline.decode_step_cost` on the engine's shape (`engine_shape`),
  so a point's intensity is FLOPs / bytes and its achieved rate FLOPs / step time.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from nanoengine import SamplingParams
from nanoengine.bench.roofline import decode_step_cost, engine_shape

BATCH_SIZES = (1, 4, 16, 64)


def decode_points(llm: Any, batch_sizes: Sequence[int] = BATCH_SIZES, prompt_len: int = 8, steps: int = 6,
                  seed: int = 0) -> list[dict[str, Any]]:
    """One dict per batch size: batch, step_s (median), step_times_s, flops and bytes per step (the mean
    over the timed steps), intensity (FLOP/byte) and gflops achieved (see the module docstring)."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the gaps between decode steps are timed), got {steps}")
    plan = llm.plan
    shape = engine_shape(plan)
    rng = random.Random(seed)
    vocab = min(plan.hf_config.vocab_size, 10_001)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    points = []
    for b in batch_sizes:
        if b * prompt_len > plan.max_num_batched_tokens or b > plan.max_num_seqs:
            raise ValueError(f"batch {b} of {prompt_len}-token prompts does not fit in one step (token "
                             f"budget {plan.max_num_batched_tokens}, max_num_seqs {plan.max_num_seqs})")
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)]} for _ in range(b)]
        llm.generate(prompts, params, use_tqdm=False)
        stats = [s for s in llm.engine.stats if s.num_seqs]
        first = stats[0]
        decodes = [s for s in stats[1:] if s.prefill_tokens == 0 and s.decode_tokens == b]
        if first.prefill_tokens != b * prompt_len or len(decodes) != steps:
            raise RuntimeError(f"batch {b}: expected one prefill of {b * prompt_len} tokens, then {steps} "
                               f"decode steps of {b}; got prefill {[s.prefill_tokens for s in stats]}, "
                               f"decode {[s.decode_tokens for s in stats]} (not enough KV blocks?)")
        gaps = [after.time - before.time for before, after in zip(decodes, decodes[1:])]
        costs = [decode_step_cost(shape, [prompt_len + i + 1] * b) for i in range(1, steps)]  # the timed ones
        flops = sum(c["flops"] for c in costs) / len(costs)
        nbytes = sum(c["bytes"] for c in costs) / len(costs)
        step_s = statistics.median(gaps)
        points.append({"batch": b, "step_s": step_s, "step_times_s": gaps, "flops": flops, "bytes": nbytes,
                       "intensity": flops / nbytes, "gflops": flops / step_s / 1e9,
                       "context": [prompt_len + 2, prompt_len + steps]})
    llm.engine.clear_stats()
    return points
