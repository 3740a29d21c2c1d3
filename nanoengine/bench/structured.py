"""Structured outputs' benchmark: what a grammar mask costs per decode step, at batch 1 and 32. Chapter 05.

    python -m nanoengine.bench.structured                           # tiny-qwen3 (Qwen3's 152k vocabulary)
    python -m nanoengine.bench.structured --model smollm2-135m      # a real small model (49k vocabulary)

For each batch size, B identical requests decode `--max-tokens` tokens together (greedy, ignore_eos), once
without a grammar and once with one that never ends (`root ::= [a-z ]+ root`: every step of every row is
masked, and the end of sequence is never allowed), so both runs do the same number of steps. The decode step
time is the engine's own (StepStats: schedule + prepare + forward and draw + postprocess), the median over
the decode steps, then over `--repeats`; `mask_ms` is the difference (on a busy machine it is noisy at batch
1: the parts below are the steadier figure). Apart from the engine, the mask's two parts are timed on the
engine's own grammars: filling the bitmask from the matchers (`StructuredOutputs.mask`, on the host) and
applying it to a copy of the logits (`TokenMask.apply`). JSON in `--out-dir`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from nanoengine import LLM, SamplingParams
from nanoengine.structured import StructuredOutputsParams

ENDLESS = "root ::= [a-z ]+ root"  # masks every step; never allows the end of sequence
PROMPT = "Write a long story about a lighthouse keeper"


def decode_step_ms(llm: LLM, batch: int, params: SamplingParams) -> float:
    """The median decode step (ms: schedule + prepare + forward and draw + postprocess, the engine's
    StepStats) of `batch` identical requests decoding together."""
    llm.engine.clear_stats()
    llm.generate([PROMPT] * batch, params, use_tqdm=False)
    steps = [s.schedule_s + s.prepare_s + s.forward_s + s.postprocess_s for s in llm.engine.stats
             if not s.prefill_tokens]
    return 1e3 * statistics.median(steps)


def mask_parts_ms(llm: LLM, batch: int, repeats: int = 20) -> dict[str, float]:
    """The mask's fill (host) and apply (a copy of [batch, vocab] logits) per step, ms, on the engine's
    StructuredOutputs, with a matcher per row at its first token."""
    from nanoengine.engine.sequence import Sequence

    eng = llm.engine
    params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=ENDLESS))
    seqs = [Sequence([1], params, eng.plan.block_size) for _ in range(batch)]
    for s in seqs:
        eng.structured.add(s)
    logits = torch.randn(batch, eng.plan.hf_config.vocab_size, device=eng.executor.device)  # [B, V]
    try:
        mask = eng.structured.mask(seqs)
        mask.apply(logits)  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            mask = eng.structured.mask(seqs)
        t1 = time.perf_counter()
        for _ in range(repeats):
            mask.apply(logits)
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
    finally:
        for s in seqs:
            eng.structured.release(s)
    return {"fill_ms": 1e3 * (t1 - t0) / repeats, "apply_ms": 1e3 * (t2 - t1) / repeats}


def measure(model: str, batches: list[int], max_tokens: int, repeats: int, dtype: str,
            threads: int | None) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model, dtype=dtype, max_num_seqs=max(batches))
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    grammar = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(grammar=ENDLESS))
    rows = {}
    for batch in batches:
        decode_step_ms(llm, batch, plain)  # warm-up (and the grammar's compile, below)
        decode_step_ms(llm, batch, grammar)
        without = statistics.median(decode_step_ms(llm, batch, plain) for _ in range(repeats))
        with_mask = statistics.median(decode_step_ms(llm, batch, grammar) for _ in range(repeats))
        rows[str(batch)] = {"decode_step_ms_without": without, "decode_step_ms_with": with_mask,
                            "mask_ms": with_mask - without, **mask_parts_ms(llm, batch)}
    from nanoengine.bench import hardware

    hw = hardware.describe(llm.plan.device)
    hw["threads"] = torch.get_num_threads()
    import xgrammar

    vocab = llm.plan.hf_config.vocab_size
    llm.engine.close()
    return {"model": model, "workload": "structured-mask", "hardware": hw, "grammar": ENDLESS,
            "library": f"xgrammar {getattr(xgrammar, '__version__', '')}".strip(), "vocab_size": vocab,
            "max_tokens": max_tokens, "repeats": repeats, "dtype": dtype, "batches": rows}


def table(result: dict[str, Any]) -> str:
    head = (f"{'batch':>5} {'step ms without':>16} {'with mask':>10} {'mask ms':>8} {'fill ms':>8} "
            f"{'apply ms':>9}")
    lines = [head, "-" * len(head)]
    for batch, r in result["batches"].items():
        lines.append(f"{batch:>5} {r['decode_step_ms_without']:>16.2f} {r['decode_step_ms_with']:>10.2f} "
                     f"{r['mask_ms']:>8.2f} {r['fill_ms']:>8.3f} {r['apply_ms']:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoengine.bench.structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3", help="asset name or local Hugging Face folder")
    p.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each request decodes")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per batch and mode (median)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out-dir", default="bench_results")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    result = measure(args.model, batches, args.max_tokens, args.repeats, args.dtype, args.threads)
    print(table(result))
    from nanoengine.bench.report import result_name, write_json

    path = write_json(result, args.out_dir, f"structured_{result_name(result)}")
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
