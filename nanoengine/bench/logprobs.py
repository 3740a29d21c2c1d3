"""What logprobs cost: decode step time with and without them, at batch 1 and 32, and a prompt's prefill with
and without prompt logprobs. Chapter 05.

    python -m nanoengine.bench.logprobs                       # SmolLM2-135M
    python -m nanoengine.bench.logprobs --model tiny-qwen3    # a smoke run (seconds)

One engine; each batch size runs each setting (no logprobs, `logprobs=1`, `logprobs=20`) in turn, `--repeats`
times, alternating, greedy with ignore_eos. A decode step's time is the median interval between consecutive
decode steps at the full batch (the engine's StepStats clock: host and forward together, as a user sees it).
The prefill rows time one prompt of `--prompt-len` tokens computed whole, with and without
`prompt_logprobs=1` (the prompt's rows then go through the LM head too: [prompt, vocab] logits). JSON in
`--out-dir`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from nanoengine import LLM, SamplingParams

SETTINGS = {"none": None, "logprobs_1": 1, "logprobs_20": 20}


def decode_step_s(llm: LLM, batch: int, max_tokens: int, logprobs: int | None) -> float:
    """The median decode step (seconds) of `batch` requests decoding together."""
    eng = llm.engine
    prompts = [f"Request {i}: write a long story about the sea." for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    llm.generate(prompts, params, use_tqdm=False)
    stats = list(eng.stats)
    gaps = [b.time - a.time for a, b in zip(stats, stats[1:])
            if not b.prefill_tokens and b.decode_tokens == batch and not a.prefill_tokens]
    return statistics.median(gaps)


def prefill_s(llm: LLM, prompt_len: int, prompt_logprobs: int | None) -> float:
    """One prompt of `prompt_len` tokens, computed whole (no prefix-cache hit), to its first token."""
    ids = [int(t) for t in torch.randint(1000, 20000, (prompt_len,), generator=torch.Generator().manual_seed(
        time.perf_counter_ns()))]
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs),
                 use_tqdm=False)
    return time.perf_counter() - start


def measure(model: str, batches: list[int], max_tokens: int, repeats: int, prompt_len: int,
            threads: int | None) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model, max_num_seqs=max(batches))
    decode: dict[str, dict[str, list[float]]] = {str(b): {name: [] for name in SETTINGS} for b in batches}
    prefill: dict[str, list[float]] = {"none": [], "prompt_logprobs_1": []}
    for b in batches:  # a warm-up
        decode_step_s(llm, b, 8, None)
    for _ in range(repeats):
        for b in batches:
            for name, k in SETTINGS.items():
                decode[str(b)][name].append(decode_step_s(llm, b, max_tokens, k))
        prefill["none"].append(prefill_s(llm, prompt_len, None))
        prefill["prompt_logprobs_1"].append(prefill_s(llm, prompt_len, 1))
    ms = {b: {name: 1e3 * statistics.median(v) for name, v in row.items()} for b, row in decode.items()}
    from nanoengine.bench import hardware

    hw = hardware.describe(llm.engine.plan.device)
    hw["threads"] = torch.get_num_threads()
    llm.engine.close()
    return {"model": model, "workload": "logprobs", "hardware": hw, "dtype": str(llm.engine.plan.dtype),
            "decode_mode": llm.engine.plan.decode_mode.name, "max_tokens": max_tokens, "repeats": repeats,
            "decode_step_ms": ms,
            "decode_overhead": {b: {name: row[name] / row["none"] - 1 for name in SETTINGS if name != "none"}
                                for b, row in ms.items()},
            "prompt_len": prompt_len,
            "prefill_ms": {name: 1e3 * statistics.median(v) for name, v in prefill.items()}}


def table(result: dict[str, Any]) -> str:
    lines = [f"{'batch':>5} " + " ".join(f"{name:>12}" for name in SETTINGS) + "   (decode step, ms)"]
    for b, row in result["decode_step_ms"].items():
        over = result["decode_overhead"][b]
        cells = [f"{row['none']:>12.2f}"] + [f"{row[n]:>7.2f} {100 * over[n]:+3.0f}%" for n in SETTINGS
                                              if n != "none"]
        lines.append(f"{b:>5} " + " ".join(cells))
    pre = result["prefill_ms"]
    lines.append(f"prefill of {result['prompt_len']} tokens: {pre['none']:.1f} ms, with prompt_logprobs=1 "
                 f"{pre['prompt_logprobs_1']:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoengine.bench.logprobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="asset name, local folder or Hub id")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per request and run")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting (median), alternating")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out-dir", default="bench_results")
    args = p.parse_args(argv)
    result = measure(args.model, args.batches, args.max_tokens, args.repeats, args.prompt_len, args.threads)
    print(table(result))
    from nanoengine.bench.report import result_name, write_json

    print(f"JSON: {write_json(result, args.out_dir, f'logprobs_{result_name(result)}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
