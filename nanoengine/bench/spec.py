"""Speculative decoding's benchmark: acceptance, tokens per target forward, single-stream decode speed with
and without it. Chapter 09.

    python -m nanoengine.bench.spec                                         # SmolLM2-135M, 256 tokens a task
    python -m nanoengine.bench.spec --model tiny-qwen3 --max-tokens 32      # a smoke run (seconds)
    python -m nanoengine.bench.spec --draft-model smollm2-135m --draft-quantization int8   # + a draft model
    python -m nanoengine.bench.spec --compare-fixed --max-tokens 128 --repeats 2  # adaptive vs fixed k

One request at a time (a single stream: the memory-bound case speculation is for), greedy, the same number
of tokens with and without speculation (ignore_eos), for two tasks:
- `grounded`: correct the spelling of a passage given in the prompt (the answer copies most of it: n-gram
  lookup's best case);
- `free`: a story from a one-line instruction (little to copy: the lookup mostly misses or is rejected, and
  what speculation costs there shows).
For each: decode tokens/s without and with (from the first token to the last, so the prompt's prefill is
left out), the speedup, the drafts' acceptance rate, tokens per target forward (decode tokens / decode
steps; 1 without speculation), and whether both produced the same tokens (they must: greedy speculation is
exact). With `--draft-model` a third engine speculates with that draft (`--draft-quantization int8`: e.g.
the target itself in int8, a draft that agrees with it on most tokens at about half its cost per token).
The speculating engines choose how many drafts to verify by their acceptance (nanoengine/spec/policy.py);
`--compare-fixed` adds each one again without that policy (`ngram-fixed`: k drafts whenever a suffix
matches), for a before/after in one run. `c` is the cost of a draft in plain decode steps as each run
measured it (a verification of 1 + k rows, and the drafting, at 1 + c·k decode steps): the figure the
policy's VERIFY_ROW_COST stands for (noisy on a shared machine; measure it with --compare-fixed, whose runs
draft most).
Each engine runs each task once as a warm-up, then the engines take turns for the measured `--repeats`
(alternating, so that a slow spell of a shared machine falls on all of them). JSON in `--out-dir`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from nanoengine import LLM, SamplingParams

# a passage with three spelling mistakes (fixd, phisical, alocated) for the grounded task to correct
PASSAGE = ("The paged KV cache splits the keys and values of every sequence into fixd-size blocks. A block "
           "table maps each sequence's logical blocks to phisical ones, so memory is alocated on demand and "
           "freed blocks are reused at once. Because blocks are shared by reference, two requests with the "
           "same system prompt can point at the same physical blocks, and the prefix is computed only once. "
           "When the pool runs out, the scheduler preempts the newest request and recomputes it later.")
TASKS = {
    "grounded": [{"role": "user", "content": "Correct the spelling mistakes in this passage and write it out "
                  f"in full:\n\n{PASSAGE}"}],
    "free": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a map."}],
}


def run_task(llm: LLM, messages: list[dict], params: SamplingParams) -> dict[str, Any]:
    """One request alone: its tokens, decode tokens/s and decode steps, and what speculation did."""
    eng = llm.engine
    counts = dict(eng.spec_counts.as_dict())
    out = llm.chat(messages, params, use_tqdm=False)[0]
    m = out.metrics
    tokens = out.outputs[0].token_ids
    decode_steps = llm.last_run_stats["steps"] - 1  # (one prefill step: the prompt fits the budget)
    after = eng.spec_counts.as_dict()
    proposed, accepted = after["proposed"] - counts["proposed"], after["accepted"] - counts["accepted"]
    return {"tokens": tokens, "output_tokens": len(tokens),
            "decode_tok_s": (len(tokens) - 1) / (m.finished_time - m.first_token_time),
            "decode_steps": decode_steps, "tokens_per_forward": (len(tokens) - 1) / max(decode_steps, 1),
            "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else None}


def verify_row_cost(decode_s: float, plain_step_s: float, steps: int, drafts: int) -> float | None:
    """c of the policy's cost model (nanoengine/spec/policy.py VERIFY_ROW_COST), as a run measured it: a run
    of `steps` verifications of `drafts` drafts in all took decode_s = (steps + c·drafts) plain decode steps
    (drafting included: an n-gram lookup, a draft model's decodes). None with fewer drafts than steps (the
    timing's noise would be most of it)."""
    return (decode_s / plain_step_s - steps) / drafts if drafts >= steps else None


def measure(model: str, k: int, max_tokens: int, repeats: int, dtype: str, threads: int | None,
            prompt_lookup_max: int = 4, prompt_lookup_min: int = 2, draft_model: str | None = None,
            draft_quantization: str | None = None, compare_fixed: bool = False) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": prompt_lookup_max,
                       "prompt_lookup_min": prompt_lookup_min}}
    if draft_model is not None:
        specs["draft"] = {"method": "draft_model", "model": draft_model, "num_speculative_tokens": k,
                          "quantization": draft_quantization}
    engines = {"plain": LLM(model, dtype=dtype),
               **{name: LLM(model, dtype=dtype, speculative_config=spec) for name, spec in specs.items()}}
    if compare_fixed:  # the same proposers without the adaptive policy: k drafts whenever they have them
        for name, spec in list(specs.items()):
            specs[f"{name}-fixed"] = spec
            engines[f"{name}-fixed"] = llm = LLM(model, dtype=dtype, speculative_config=spec)
            llm.engine.drafts.policy = None
    tasks: dict[str, Any] = {}
    for task, messages in TASKS.items():
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for llm in engines.values():
            run_task(llm, messages, params)  # warm-up
        for _ in range(repeats):  # the engines in turn: a slow spell of a shared machine hits all of them
            for name, llm in engines.items():
                runs[name].append(run_task(llm, messages, params))
        plain = runs["plain"]
        tok_s = {name: statistics.median(r["decode_tok_s"] for r in rs) for name, rs in runs.items()}
        tasks[task] = {
            "decode_tok_s_plain": tok_s["plain"],
            "tokens_per_target_forward_plain": plain[-1]["tokens_per_forward"],
            "same_tokens": all(r["tokens"] == plain[0]["tokens"] for rs in runs.values() for r in rs),
            "output_tokens": len(plain[-1]["tokens"]),
            "text": engines["plain"].get_tokenizer().decode(plain[0]["tokens"])[:400],
            "runs": {name: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
                     for name, rs in runs.items()}}
        plain_step_s = (plain[-1]["output_tokens"] - 1) / tok_s["plain"] / max(plain[-1]["decode_steps"], 1)
        for name in specs:
            last = runs[name][-1]
            tasks[task] |= {f"decode_tok_s_{name}": tok_s[name],
                            f"verify_row_cost_{name}": verify_row_cost(
                                (last["output_tokens"] - 1) / tok_s[name], plain_step_s, last["decode_steps"],
                                last["proposed"]),
                            f"speedup_{name}": tok_s[name] / tok_s["plain"],
                            f"acceptance_rate_{name}": last["acceptance_rate"],
                            f"tokens_per_target_forward_{name}": last["tokens_per_forward"],
                            f"proposed_{name}": last["proposed"], f"accepted_{name}": last["accepted"]}
    device = engines["plain"].plan.device
    for llm in engines.values():
        llm.engine.close()
    from nanoengine.bench import hardware

    hw = hardware.describe(device)
    hw["threads"] = torch.get_num_threads()
    return {"model": model, "workload": f"spec-{'-'.join(specs)}-k{k}", "hardware": hw,
            "speculative_configs": specs, "adaptive": {name: not name.endswith("-fixed") for name in specs},
            "max_tokens": max_tokens,
            "repeats": repeats, "dtype": dtype, "tasks": tasks}


def table(result: dict[str, Any]) -> str:
    head = (f"{'task':<10} {'method':<12} {'tok/s':>8} {'speedup':>8} {'accepted':>9} {'tok/forward':>12} "
            f"{'c':>5} {'same':>5}")
    lines = [head, "-" * len(head)]
    for task, t in result["tasks"].items():
        lines.append(f"{task:<10} {'plain':<12} {t['decode_tok_s_plain']:>8.1f} {'':>8} {'':>9} {1:>12.2f} "
                     f"{'':>5} {str(t['same_tokens']):>5}")
        for name in result["speculative_configs"]:
            rate = t[f"acceptance_rate_{name}"]
            rate = "-" if rate is None else f"{100 * rate:.0f}%"
            tok_s, speedup = t[f"decode_tok_s_{name}"], t[f"speedup_{name}"]
            c = t[f"verify_row_cost_{name}"]
            c = "-" if c is None else f"{c:.2f}"
            lines.append(f"{'':<10} {name:<12} {tok_s:>8.1f} {speedup:>7.2f}x {rate:>9} "
                         f"{t[f'tokens_per_target_forward_{name}']:>12.2f} {c:>5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoengine.bench.spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="asset name or local Hugging Face folder")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="2: a single repeated token proposes "
                   "nothing (in free text such proposals are almost always rejected)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per task")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per task and engine (median)")
    p.add_argument("--dtype", default="float32", help="float32: both engines bit-exact (in bf16 even a "
                   "prefix hit changes a greedy output: the rounding depends on the batch shape)")
    p.add_argument("--draft-model", default=None, help="also speculate with this draft model (asset name or "
                   "folder; it must share the model's tokenizer)")
    p.add_argument("--draft-quantization", default=None, choices=["int8"], help="the draft's weights")
    p.add_argument("--compare-fixed", action="store_true", help="also run each speculating engine "
                   "without the adaptive number of drafts (k whenever the proposer has them: "
                   "'<method>-fixed'), in the same run")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out-dir", default="bench_results")
    args = p.parse_args(argv)
    result = measure(args.model, args.num_speculative_tokens, args.max_tokens, args.repeats, args.dtype,
                     args.threads, args.prompt_lookup_max, args.prompt_lookup_min, args.draft_model,
                     args.draft_quantization, args.compare_fixed)
    print(table(result))
    from nanoengine.bench.report import result_name, write_json

    path = write_json(result, args.out_dir, f"spec_{result_name(result)}")
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
