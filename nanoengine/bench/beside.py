"""`nanoengine bench --engine module:factory`: an engine of one's own measured beside nanoengine. Chapter 05.

Both run the same seeded workload offline (every request at once) through `LLM` (the other engine through
`LLM.from_engine`: it speaks the engine protocol, nanoengine/engine/protocol.py), after one warm-up request
each: output and total tokens/s, TTFT, TPOT and end-to-end percentiles, and the ratio of their throughputs.
Their outputs' lengths are checked (ignore_eos: every request makes exactly its output length), not their
tokens: a sampled workload differs between engines. One result dict, written as JSON.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from nanoengine import LLM, SamplingParams
from nanoengine.bench.metrics import request_latencies, throughput
from nanoengine.bench.report import write_json
from nanoengine.bench.workload import Workload, make_workload
from nanoengine.engine.protocol import load_engine


def run(llm: LLM, wl: Workload, temperature: float, quiet: bool = True) -> dict[str, Any]:
    """One engine on the workload: throughput and latencies."""
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=not quiet)
    seconds = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    if made != wl.num_output_tokens:
        raise RuntimeError(f"ignore_eos: expected {wl.num_output_tokens} output tokens, the engine made "
                           f"{made}")
    return {**throughput(wl.num_prompt_tokens, wl.num_output_tokens, seconds),
            "latency": request_latencies([o.metrics for o in outs])}


def bench_beside(engine: str, model: str, workload: str = "smoke", num_requests: int | None = None, *,
                 seed: int = 0, temperature: float = 0.0, engine_options: dict[str, Any] | None = None,
                 out_dir: str | Path | None = "bench_results", quiet: bool = True) -> dict[str, Any]:
    """`engine` (module:factory, called with `model`) and nanoengine (LLM(model, **engine_options)) on one
    workload; temperature 0 by default (an engine of one's own may decode greedily only)."""
    ours = LLM(model, **(engine_options or {}))
    wl = make_workload(workload, num_requests, vocab_size=ours.plan.hf_config.vocab_size, seed=seed)
    result: dict[str, Any] = {"model": str(model), "workload": wl.name, "workload_spec": wl.spec,
                              "num_requests": len(wl), "engine": engine, "temperature": temperature,
                              "nanoengine": run(ours, wl, temperature, quiet)}
    ours.close()
    del ours
    gc.collect()
    yours = LLM.from_engine(load_engine(engine, model))
    try:
        result["yours"] = run(yours, wl, temperature, quiet)
    finally:
        yours.close()
    result["yours_over_nanoengine"] = (result["yours"]["output_tokens_per_s"]
                                       / result["nanoengine"]["output_tokens_per_s"])
    if out_dir is not None:
        result["json_path"] = str(write_json(result, out_dir, f"beside_{wl.name}_{engine.replace(':', '-')}"))
    return result


def report(result: dict[str, Any]) -> str:
    """The table: each engine's tokens/s and its TTFT and TPOT (p50 / p99, ms)."""
    def ms(summary: dict[str, Any]) -> str:
        if summary.get("p50") is None:
            return "-"
        return f"{1e3 * summary['p50']:.1f} / {1e3 * summary['p99']:.1f}"

    lines = [f"{result['workload']} ({result['num_requests']} requests), {result['model']}",
             f"{'engine':<12} {'out tok/s':>10} {'TTFT ms p50/p99':>18} {'TPOT ms p50/p99':>18}"]
    for name in ("nanoengine", "yours"):
        r = result[name]
        lines.append(f"{name:<12} {r['output_tokens_per_s']:>10.1f} {ms(r['latency']['ttft_s']):>18} "
                     f"{ms(r['latency']['tpot_s']):>18}")
    lines.append(f"yours / nanoengine: {result['yours_over_nanoengine']:.2f}x output tokens/s")
    return "\n".join(lines)
