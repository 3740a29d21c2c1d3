"""The engine's step trace (`RunTrace`) as JSON and back, for `GET /v1/trace`. Chapter 05 (appendix).

A server started with `--trace` records a `StepTrace` per step, as `LLM(..., trace=True)` does; the endpoint
sends the steps from `since` on, and `fetch_trace(url)` rebuilds a `RunTrace` that the book's widgets draw
(`BatchCompositionView(fetch_trace(url))`); `update_trace(trace, url)` fetches only the steps it lacks. JSON
turns the int keys of the snapshots into strings and tuples into lists; `trace_from_dict` turns them back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nanoengine.trace import RunTrace, ScheduledEntry, StepStats, StepTrace

_INT_KEYED = ("block_tables", "ref_counts", "block_hashes", "block_tokens", "seq_num_tokens")


def trace_to_dict(trace: RunTrace, since: int = 0) -> dict[str, Any]:
    """The trace's header and its steps from index `since` on (JSON-ready)."""
    steps = trace.steps[since:]
    return {"block_size": trace.block_size, "num_blocks": trace.num_blocks,
            "max_num_batched_tokens": trace.max_num_batched_tokens, "start_time": trace.start_time,
            "prompts": {str(k): v for k, v in trace.prompts.items()}, "since": since,
            "steps": [dataclasses.asdict(s) for s in steps]}


def step_from_dict(d: dict[str, Any]) -> StepTrace:
    d = dict(d)
    d["stats"] = StepStats(**d["stats"])
    d["scheduled"] = [ScheduledEntry(**e) for e in d["scheduled"]]
    d["cache_hits"] = [tuple(h) for h in d["cache_hits"]]
    for key in _INT_KEYED:
        d[key] = {int(k): v for k, v in d[key].items()}
    return StepTrace(**d)


def trace_from_dict(d: dict[str, Any]) -> RunTrace:
    return RunTrace(steps=[step_from_dict(s) for s in d["steps"]], block_size=d["block_size"],
                    num_blocks=d["num_blocks"], max_num_batched_tokens=d["max_num_batched_tokens"],
                    prompts={int(k): v for k, v in d["prompts"].items()}, start_time=d["start_time"])


def fetch_trace(base_url: str, since: int = 0, timeout: float = 30.0) -> RunTrace:
    """The trace (from step `since` on) of a server started with --trace (base_url like http://127.0.0.1:8000)."""
    import httpx

    url = f"{base_url.rstrip('/').removesuffix('/v1')}/v1/trace"
    r = httpx.get(url, params={"since": since}, timeout=timeout)
    r.raise_for_status()
    return trace_from_dict(r.json())


def update_trace(trace: RunTrace, base_url: str) -> RunTrace:
    """Append the server's steps after those `trace` has (fetching only those); returns `trace`."""
    new = fetch_trace(base_url, since=len(trace.steps))
    trace.steps.extend(new.steps)
    trace.prompts.update(new.prompts)
    return trace
