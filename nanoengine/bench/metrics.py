"""Benchmark metrics from plain numbers: percentiles, per-request latencies, per-step engine stats.
Chapter 08.

Definitions (all in seconds, per request):
- TTFT, time to first token = first_token_time - arrival_time (includes queueing when requests arrive
  over time, and the whole prefill);
- TPOT, time per output token = (finished_time - first_token_time) / (output tokens - 1): the mean gap
  between the request's later tokens (undefined for a one-token output);
- end-to-end latency = finished_time - arrival_time.

Throughput: output tokens / wall seconds, and total tokens (prompt + output) / wall seconds.

From the engine's per-step `StepStats`: batch size (sequences in a step) peak and mean over steps, KV-cache
use (used blocks / all blocks) peak and mean, prefix-cache hit rate (hit tokens / prompt tokens),
preemptions, and the host time per decode step spent outside the model: scheduler + input preparation, and
postprocess (appending tokens, stop rules, detokenization).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nanoengine.trace import StepStats

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default):
    rank (n - 1) * q / 100 in the sorted values. None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return None
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: Sequence[float], qs: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """{"mean", "p50", "p90", "p99"} of the values (None when there are none)."""
    vals = [v for v in values if v is not None]
    out: dict[str, float | None] = {"mean": sum(vals) / len(vals) if vals else None}
    for q in qs:
        out[f"p{q}"] = percentile(vals, q)
    return out


def request_latencies(metrics: Sequence[Any]) -> dict[str, Any]:
    """TTFT, TPOT and end-to-end latency summaries from RequestMetrics-like objects
    (arrival_time, first_token_time, finished_time, num_output_tokens)."""
    ttft, tpot, e2e = [], [], []
    for m in metrics:
        if m.first_token_time is not None:
            ttft.append(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            e2e.append(m.finished_time - m.arrival_time)
            if m.first_token_time is not None and m.num_output_tokens >= 2:
                tpot.append((m.finished_time - m.first_token_time) / (m.num_output_tokens - 1))
    return {"ttft_s": summarize(ttft), "tpot_s": summarize(tpot), "e2e_s": summarize(e2e),
            "samples": {"ttft_s": ttft, "tpot_s": tpot}}


def throughput(prompt_tokens: int, output_tokens: int, seconds: float) -> dict[str, float]:
    s = max(seconds, 1e-12)
    return {"seconds": seconds, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / s,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / s}


def step_summary(stats: Sequence[StepStats], prompt_tokens: int, big_batch: int = 200) -> dict[str, Any]:
    """Aggregate per-step engine stats.

    Host overhead per decode step = schedule_s + prepare_s on steps without prefill tokens, reported in ms
    (mean and p50) over the steps with at least `big_batch` sequences when there are any (the issue's target
    is "< 1 ms at batch 256"), else over all decode steps; `overhead_steps` says which.
    """
    steps = [s for s in stats if s.num_seqs > 0]
    if not steps:
        raise ValueError("no engine steps recorded: was the workload empty?")
    batch = [s.num_seqs for s in steps]
    kv = [s.used_blocks / s.num_blocks if s.num_blocks else 0.0 for s in steps]
    hits = sum(s.cache_hit_tokens for s in stats)
    decode = [s for s in steps if s.prefill_tokens == 0]
    big = [s for s in decode if s.num_seqs >= big_batch]
    chosen = big or decode
    overhead_ms = [1e3 * (s.schedule_s + s.prepare_s) for s in chosen]
    post_ms = [1e3 * s.postprocess_s for s in chosen]
    return {
        "num_steps": len(stats),
        "batch_size": {"peak": max(batch), "mean": sum(batch) / len(batch)},
        "kv_use": {"peak": max(kv), "mean": sum(kv) / len(kv), "num_blocks": steps[-1].num_blocks},
        "prefix_cache": {"hit_tokens": hits, "prompt_tokens": prompt_tokens,
                         "hit_rate": hits / prompt_tokens if prompt_tokens else 0.0},
        "preemptions": sum(s.num_preempted for s in stats),
        "prefill_tokens": sum(s.prefill_tokens for s in stats),
        "decode_tokens": sum(s.decode_tokens for s in stats),
        "host_overhead_ms": {
            "what": "schedule_s + prepare_s per decode step (no prefill tokens)",
            "overhead_steps": (f"decode steps with batch >= {big_batch}" if big
                               else f"decode steps (none with batch >= {big_batch})"),
            "num_steps": len(chosen),
            "mean_batch": sum(s.num_seqs for s in chosen) / len(chosen) if chosen else None,
            "mean": sum(overhead_ms) / len(overhead_ms) if overhead_ms else None,
            "p50": percentile(overhead_ms, 50),
            "postprocess_mean": sum(post_ms) / len(post_ms) if post_ms else None,
            "postprocess_p50": percentile(post_ms, 50),
        },
        "time_s": {k: sum(getattr(s, k) for s in stats)
                   for k in ("schedule_s", "prepare_s", "forward_s", "postprocess_s")},
    }


def step_series(stats: Sequence[StepStats], t0: float | None = None) -> dict[str, list]:
    """The per-step series, compactly (one list per field) for the JSON and the plots; time from t0
    (default: the end of the step before the first, approximated by the first step's start)."""
    if not stats:
        return {k: [] for k in ("time", "num_seqs", "prefill_tokens", "decode_tokens", "used_blocks")}
    if t0 is None:
        first = stats[0]
        t0 = first.time - first.duration_s
    return {"time": [round(s.time - t0, 6) for s in stats], "num_seqs": [s.num_seqs for s in stats],
            "prefill_tokens": [s.prefill_tokens for s in stats],
            "decode_tokens": [s.decode_tokens for s in stats],
            "used_blocks": [s.used_blocks for s in stats], "num_blocks": stats[0].num_blocks}
