"""A decode step's time against the rows it computes: B sequences decoding one token each, and one sequence
verifying k drafts (1 + k rows). Chapters 06 (the small-batch linears' register tiles) and 09 (what a
verification costs, against a decode).

    python -m nanoengine.bench.step_rows                              # SmolLM2-135M, the engine's dtype
    python -m nanoengine.bench.step_rows --quantization int8          # its int8 weights
    python -m nanoengine.bench.step_rows --prefill-dtype bfloat16     # bf16 activations above the threshold
    python -m nanoengine.bench.step_rows --model tiny-qwen3 --steps 4 # a smoke run (seconds)

Each point runs its requests through one engine (greedy, `ignore_eos`, random prompts of `prompt_len`
tokens, all in one prefill step) and takes the median of its decode steps' forward times (StepStats.forward_s:
the forward and the draw, without the host's scheduling). Verification rows come from `FixedDrafts`, which
proposes the last token k times: how many rows a step has decides its time, not what they hold; the
speculator's policy is off so that every step verifies k. The points alternate between the two kinds, and
each is run `repeats` times (the best median kept), so a slow spell on a shared machine hits them alike.
The JSON (`--out-dir`) has each point's ms and its ratio to the 1-row step, and the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch

from nanoengine import LLM, SamplingParams

BATCHES = (1, 2, 4, 8, 16, 32)  # sequences decoding one token each
DRAFTS = (2, 4, 7)  # one sequence verifying k drafts: 1 + k rows


class FixedDrafts:
    """A proposer that drafts the last token k times (the time of a verification depends on its rows only)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        return [token_ids[-1]] * (self.k if max_tokens is None else min(self.k, max_tokens))


def step_ms(llm: LLM, batch: int, drafts: int, prompt_len: int, steps: int, rng: random.Random) -> float:
    """The median forward ms of the decode steps of `batch` sequences, each verifying `drafts` drafts."""
    speculator = llm.engine.drafts
    speculator.proposer, speculator.policy = FixedDrafts(drafts), None
    vocab = min(llm.plan.hf_config.vocab_size, 10_000)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)]} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=(steps + 1) * (drafts + 1), ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    rows = batch * (drafts + 1)
    times = [s.forward_s for s in llm.engine.stats if not s.prefill_tokens and s.decode_tokens == rows]
    if len(times) < 2:
        raise RuntimeError(f"batch {batch} with {drafts} drafts: fewer than 2 decode steps of {rows} rows "
                           "(not enough KV blocks, or a token budget below the prompts?)")
    return statistics.median(times[1:]) * 1e3  # (the first follows the prefill)


def measure(model: str, quantization: str | None, dtype: str, prompt_len: int, steps: int, repeats: int,
            batches: tuple[int, ...] = BATCHES, drafts: tuple[int, ...] = DRAFTS,
            prefill_dtype: str = "auto") -> dict[str, Any]:
    from nanoengine.bench import hardware

    llm = LLM(model, dtype=dtype, quantization=quantization, prefill_dtype=prefill_dtype,
              max_num_batched_tokens=max(max(batches) * prompt_len, 512),
              speculative_config={"method": "ngram", "num_speculative_tokens": max(drafts)})
    rng = random.Random(0)
    decodes = [(f"{b} seqs", b, 0) for b in batches]
    verifications = [(f"1 + {k} rows", 1, k) for k in drafts]
    points = decodes + verifications
    order = [p for pair in zip_longest(decodes, verifications) for p in pair if p is not None]  # in turn
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, b, k in order:
            ms = step_ms(llm, b, k, prompt_len, steps, rng)
            best[name] = min(best.get(name, ms), ms)
    base = best[points[0][0]]
    rows = [{"point": name, "sequences": b, "drafts": k, "rows": b * (k + 1), "ms": round(best[name], 3),
             "x_one_row": round(best[name] / base, 3)} for name, b, k in points]
    plan = llm.plan
    llm.close()
    return {"model": model, "dtype": plan.dtype, "quantization": quantization,
            "prefill_dtype": [plan.prefill_dtype, plan.prefill_dtype_min_rows], "prompt_len": prompt_len,
            "steps": steps, "repeats": repeats, "threads": torch.get_num_threads(),
            "hardware": hardware.describe(plan.device), "points": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m nanoengine.bench.step_rows",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", choices=["int8", "w8a8"], default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefill-dtype", default="auto",
                    help="'bfloat16': bf16 activations above the measured row threshold")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12, help="decode steps per point")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out-dir", default="bench_results")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.model, args.quantization, args.dtype, args.prompt_len, args.steps, args.repeats,
                     prefill_dtype=args.prefill_dtype)
    for p in result["points"]:
        print(f"{p['point']:>12}: {p['ms']:8.2f} ms  {p['x_one_row']:5.2f}x one row", file=sys.stderr)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bf16 = "_bf16rows" if args.prefill_dtype != "auto" else ""
    name = f"step_rows_{Path(args.model).name}_{args.quantization or result['dtype']}{bf16}.json"
    (out / name).write_text(json.dumps(result, indent=1))
    print(f"JSON: {out / name}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
