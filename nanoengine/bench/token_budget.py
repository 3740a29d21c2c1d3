"""Chunked prefill's trade-off, measured on the engine: time to first token (TTFT) and inter-token latency
(ITL) against the token budget (`max_num_batched_tokens`), with the engine's decode-first order beside a
prefill-first one. Chapter 05.

The workload: requests with long prompts arrive one every few engine steps (by step count, so every run
sees the same arrivals), while the earlier ones decode. A small budget cuts each prompt into many chunks
(more steps before its first token) but keeps every step short (the running requests' next tokens come
quickly); a large budget does the opposite (Sarathi-Serve, Agrawal et al., OSDI 2024,
https://arxiv.org/abs/2403.02310).

`PrefillFirstScheduler` is an illustration, not an engine option: it spends the budget on prompt tokens
(chunks of running prompts, then admissions) before the decodes, the order of a scheduler that favours new
requests; a decode then waits whenever prompts fill the budget. It has no preemption, so it is run with a
pool that never runs out.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

from nanoengine.engine import pending
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.engine.parts import assemble
from nanoengine.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from nanoengine.engine.sequence import SequenceStatus
from nanoengine.sampling_params import SamplingParams

ORDERS = ("decode_first", "prefill_first")


class PrefillFirstScheduler(Scheduler):
    """An illustration (chapter 05), not an engine option: prompt tokens first (the rest of running prompts,
    oldest first, then waiting prompts in queue order), decodes with what is left of the budget. No
    preemption and no n>1 siblings: it raises when the pool runs out."""

    def pick(self) -> SchedulerOutput:
        bm = self.block_manager
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        def take(seq, n: int) -> None:
            nonlocal budget
            computed = seq.num_computed_tokens
            if bm.blocks_needed(seq, n):
                if not bm.can_allocate(seq, n):
                    raise RuntimeError("PrefillFirstScheduler does not preempt: give it a larger KV pool")
                out.blocks_allocated += bm.allocate(seq, n)
            if bm.fills_a_block(computed, computed + n):
                bm.cache_full_blocks(seq, computed + n)
            out.scheduled.append(ScheduledSeq(seq, n, seq.is_prefill))
            budget -= n

        def wants(seq) -> int:
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            return 0 if seq.num_pending_tokens and pending.ends_at_length(seq, self._max_len) else n

        for seq in [s for s in self.running if s.is_prefill]:  # 1) the rest of running prompts
            if budget > 0 and (n := wants(seq)):
                take(seq, n)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:  # 2) new prompts
            seq = self.waiting[0]
            n = self.admit(seq, budget)
            if n is None:
                raise RuntimeError("PrefillFirstScheduler does not preempt: give it a larger KV pool")
            out.blocks_allocated += seq.block_table[seq.num_cached_tokens // bm.block_size:]
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, True))
            out.cache_hits.append((seq.seq_id, seq.num_cached_tokens))
            budget -= n
        scheduled = {id(s.seq) for s in out.scheduled}
        for seq in self.running:  # 3) decodes, with what is left
            if budget > 0 and id(seq) not in scheduled and (n := wants(seq)):
                take(seq, n)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out


def latency_run(budget: int, order: str = "decode_first", *, model: str = "tiny-qwen3",
                num_requests: int = 4, prompt_len: int = 128, output_len: int = 12, arrive_every: int = 6,
                seed: int = 0, llm: Any = None) -> dict[str, Any]:
    """One run of the workload under a token budget and an order: TTFT in seconds per request (from its
    arrival), every inter-token gap in seconds, the step count, and how many steps a decoding request was
    left out of (`decode_steps_skipped`: 0 for decode-first). `llm`: an LLM whose model to reuse (the run
    gets a fresh engine over its executor; it needs room for every request at once)."""
    from nanoengine import LLM

    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if llm is None:
        llm = LLM(model, num_kvcache_blocks=num_requests * ((prompt_len + output_len) // 16 + 2),
                  block_size=16, enable_prefix_caching=False, max_num_seqs=num_requests,
                  max_num_batched_tokens=max(budget, 256))
    if budget > llm.plan.max_num_batched_tokens:
        raise ValueError(f"the engine was built for at most {llm.plan.max_num_batched_tokens} tokens a step, "
                         f"fewer than {budget}: build it with max_num_batched_tokens={budget}")
    # a fresh engine over the LLM's executor (its model and KV cache), built with this budget and scheduler
    plan = dataclasses.replace(llm.plan, max_num_batched_tokens=budget)
    cls = PrefillFirstScheduler if order == "prefill_first" else Scheduler
    eng = LLMEngine(llm.engine.config, plan, dataclasses.replace(assemble(plan), scheduler_class=cls),
                    llm.engine.executor, llm.engine.tokenizer)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(prompt_len)] for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    arrived: dict[str, float] = {}
    arrived_step: dict[str, int] = {}
    times: dict[str, list[float]] = {}
    at_step: dict[str, list[int]] = {}  # the step count at each token
    seqs: dict[str, Any] = {}
    steps = 0
    while steps == 0 or eng.has_unfinished() or len(arrived) < num_requests:
        if steps % arrive_every == 0 and len(arrived) < num_requests:
            rid = eng.add_request({"prompt_token_ids": prompts[len(arrived)]}, params)
            arrived[rid], seqs[rid] = time.perf_counter(), eng.requests[rid].seqs[0]
            times[rid], at_step[rid], arrived_step[rid] = [], [], steps
        eng.step()
        now = time.perf_counter()
        steps += 1
        for rid, seq in seqs.items():
            new = seq.num_known_tokens - seq.num_prompt_tokens - len(times[rid])
            times[rid] += [now] * new
            at_step[rid] += [steps] * new
    for rid in list(arrived):
        eng.abort(rid)
    ttft = [times[r][0] - arrived[r] for r in arrived]
    gaps = [b - a for r in arrived for a, b in zip(times[r], times[r][1:])]
    skipped = sum(b - a - 1 for r in arrived for a, b in zip(at_step[r], at_step[r][1:]))
    return {"budget": budget, "order": order, "steps": steps, "ttft_s": ttft, "itl_s": gaps,
            "ttft_steps": [at_step[r][0] - arrived_step[r] for r in arrived], "decode_steps_skipped": skipped,
            "tokens": [len(times[r]) for r in arrived]}


def budget_sweep(budgets: tuple[int, ...] = (16, 32, 64, 128, 256), orders: tuple[str, ...] = ORDERS,
                 model: str = "tiny-qwen3", **workload: Any) -> list[dict[str, Any]]:
    """`latency_run` for every budget and order on one engine (built once, with room for the largest
    budget), each summarized: median TTFT, mean, 90th-percentile and worst ITL, in milliseconds."""
    from nanoengine import LLM

    n = workload.get("num_requests", 4)
    per_seq = (workload.get("prompt_len", 128) + workload.get("output_len", 12)) // 16 + 2
    llm = LLM(model, num_kvcache_blocks=n * per_seq, block_size=16, enable_prefix_caching=False,
              max_num_seqs=n, max_num_batched_tokens=max(budgets))
    latency_run(max(budgets), llm=llm, **{**workload, "num_requests": 1})  # warm-up
    rows = []
    for order in orders:
        for budget in budgets:
            r = latency_run(budget, order, llm=llm, **workload)
            itl = sorted(r["itl_s"])
            rows.append({**r, "ttft_median_ms": 1e3 * statistics.median(r["ttft_s"]),
                         "itl_mean_ms": 1e3 * statistics.fmean(itl),
                         "itl_p90_ms": 1e3 * itl[int(0.9 * (len(itl) - 1))], "itl_max_ms": 1e3 * itl[-1]})
    return rows
