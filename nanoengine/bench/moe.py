"""The mixture-of-experts benchmark: decode speed of an MoE model at 1 and 32 streams, against transformers'
Qwen3MoeForCausalLM on the same prompts in the same run, and against the active-parameter bound.
Chapter 10 (the roofline is chapter 08's).

    python -m nanoengine.bench.moe                                       # tiny-qwen3-moe, 1 and 32 streams
    python -m nanoengine.bench.moe --model qwen3-30b-a3b-12l-shape --dtype bfloat16 --streams 1 8

Decode tok/s is measured by difference, the same way for both systems: B streams generate N tokens each
(greedy, no early stop), and B streams generate 1 token (the prefill and the first token); decode tok/s =
B * (N - 1) / (t_N - t_1). So the prompts' prefill is left out, and so is each system's fixed start-up.
nanoengine serves the B prompts as one continuous batch (prefix caching off: the prompts differ, and a hit
from the t_1 run would shorten the t_N one); transformers runs `generate` on the B prompts as one left-padded
static batch (its best case: all of them start and stop together). Each figure is the median of `--repeats`
runs after a warm-up.

The bound: a decode step must read every weight it multiplies at least once. One token reads the
active parameters (attention, router, top_k experts per layer, the LM head: `ModelShape`'s per-step bytes,
as the engine keeps them, `roofline.engine_shape`); a step of B tokens reads at most min(E, B * top_k)
experts per layer (`step_weight_bytes` counts that many: an upper bound on what routing touches, so the
bound it gives is optimistic for the engine by at most that). With the machine's measured copy bandwidth
(`hardware.memory_bandwidth_gbs`, the best of three: on a shared machine one can be slowed), bound tok/s =
B * bandwidth / step bytes; the share of it is measured / bound. The KV cache reads are left out (tiny next to
the weights at these lengths). JSON in `--out-dir`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from nanoengine import LLM, SamplingParams
from nanoengine.bench import hardware, roofline
from nanoengine.models.hf_config import ModelShape

PROMPT_TOKENS = 32


def step_weight_bytes(shape: ModelShape, batch: int) -> int:
    """Weight bytes a decode step of `batch` tokens reads: the active parameters of one token, plus the
    experts the other tokens may add, min(E, batch * top_k) per layer in all (see the module docstring).
    The experts are counted in the engine's dtype: they keep their stacked weights (plan.py: bf16 copies and
    int8 apply to the dense linears only), while ModelShape counts every linear at its weight bytes."""
    if not shape.experts:
        return shape.weight_bytes_per_step
    touched = min(shape.experts, batch * shape.experts_per_token)
    one_expert = 3 * shape.hidden * shape.expert_intermediate  # gate, up, down
    counted = shape.experts_per_token * (shape.weight_dtype_bytes or shape.dtype_bytes)  # by ModelShape
    extra = shape.layers * one_expert * (touched * shape.dtype_bytes - counted)
    return round(shape.weight_bytes_per_step + extra)


def prompts_of(batch: int, vocab: int) -> list[list[int]]:
    """`batch` different prompts of PROMPT_TOKENS token ids (seeded)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(1000, min(vocab, 100_000), (batch, PROMPT_TOKENS), generator=gen).tolist()


def decode_rate(run: Callable[[int], None], batch: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Decode tok/s of `run(n)` (B streams, n tokens each) by difference (the module docstring)."""
    run(max_tokens)  # warm-up
    full, first = [], []
    for _ in range(repeats):
        for n, times in ((max_tokens, full), (1, first)):
            t0 = time.perf_counter()
            run(n)
            times.append(time.perf_counter() - t0)
    t_n, t_1 = statistics.median(full), statistics.median(first)
    return {"decode_tok_s": batch * (max_tokens - 1) / (t_n - t_1), "seconds_n": t_n, "seconds_1": t_1,
            "runs_n": full, "runs_1": first}


def engine_runner(llm: LLM, prompts: list[list[int]]) -> Callable[[int], None]:
    def run(n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
    return run


def hf_runner(model: Any, prompts: list[list[int]], pad_id: int) -> Callable[[int], None]:
    ids = torch.tensor(prompts)  # equal lengths: the batch needs no padding, but say so anyway
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad_id)
        assert out.shape[1] == ids.shape[1] + n
    return run


def measure(model: str, streams: list[int], max_tokens: int, repeats: int, dtype: str, threads: int | None,
            peers: bool = True) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    from nanoengine.engine.parts import moe_pieces

    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=max(streams))
    plan = llm.plan
    shape = roofline.engine_shape(plan)
    if not shape.experts:
        raise SystemExit(f"{model} is not a mixture-of-experts model")
    bandwidth = max(hardware.memory_bandwidth_gbs(plan.device) for _ in range(3))  # a ceiling: the best
    rows: list[dict[str, Any]] = []
    for batch in streams:
        prompts = prompts_of(batch, shape.vocab)
        step_bytes = step_weight_bytes(shape, batch)
        bound = batch * bandwidth * 1e9 / step_bytes
        row = {"streams": batch, "step_weight_bytes": step_bytes, "bound_tok_s": bound,
               "nanoengine": decode_rate(engine_runner(llm, prompts), batch, max_tokens, repeats)}
        row["nanoengine"]["share_of_bound"] = row["nanoengine"]["decode_tok_s"] / bound
        rows.append(row)
        print(f"nanoengine, {batch} streams: {row['nanoengine']['decode_tok_s']:.1f} decode tok/s",
              file=sys.stderr, flush=True)
    experts_forward = moe_pieces(plan).experts.__name__
    llm.engine.close()
    del llm
    gc.collect()  # the engine's weights go before transformers loads its copy
    peer: dict[str, Any] = {"skipped": "--no-peers"}
    if peers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(plan.model_path, dtype=plan.torch_dtype)
        hf = hf.to(plan.device).eval()
        peer = {"name": f"transformers {type(hf).__name__}", "experts_implementation":
                str(getattr(hf.config, "_experts_implementation", None))}
        for row in rows:
            prompts = prompts_of(row["streams"], shape.vocab)
            hf_row = decode_rate(hf_runner(hf, prompts, plan.hf_config.eos_token_id or 0), row["streams"],
                                 max_tokens, repeats)
            hf_row["share_of_bound"] = hf_row["decode_tok_s"] / row["bound_tok_s"]
            row["transformers"] = hf_row
            row["speedup"] = row["nanoengine"]["decode_tok_s"] / hf_row["decode_tok_s"]
        del hf
    hw = hardware.describe(plan.device)
    hw["threads"] = torch.get_num_threads()
    return {"model": model, "workload": f"moe-decode-{'-'.join(f's{b}' for b in streams)}", "hardware": hw,
            "dtype": plan.dtype, "attention_backend": plan.attention_backend,
            "decode_mode": plan.decode_mode.value, "experts_forward": experts_forward,
            "prompt_tokens": PROMPT_TOKENS, "max_tokens": max_tokens, "repeats": repeats,
            "memory_gbs": bandwidth, "shape": roofline.shape_dict(shape),
            "active_bytes_per_token": step_weight_bytes(shape, 1), "peer": peer, "rows": rows}


def table(result: dict[str, Any]) -> str:
    head = (f"{'streams':>7} {'system':<14} {'decode tok/s':>13} {'bound tok/s':>12} {'of bound':>9} "
            f"{'nanoengine x':>13}")
    lines = [head, "-" * len(head)]
    for row in result["rows"]:
        for name in ("nanoengine", "transformers"):
            if name not in row:
                continue
            r = row[name]
            speedup = "1.00x" if name == "nanoengine" else f"{row['speedup']:.2f}x"
            lines.append(f"{row['streams']:>7} {name:<14} {r['decode_tok_s']:>13.1f} "
                         f"{row['bound_tok_s']:>12.0f} {100 * r['share_of_bound']:>8.1f}% {speedup:>13}")
    shape = result["shape"]
    lines.append(f"active weights per token {result['active_bytes_per_token'] / 1e6:.1f} MB "
                 f"({shape['experts_per_token']} of {shape['experts']} experts per layer); "
                 f"measured copy bandwidth {result['memory_gbs']:.1f} GB/s; {result['dtype']}, "
                 f"{result['hardware']['threads']} threads; experts: {result['experts_forward']}, "
                 f"attention: {result['attention_backend']}, decode: {result['decode_mode']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoengine.bench.moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-moe", help="an MoE asset name or local Hugging Face folder")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32], help="concurrent streams (batch sizes)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per stream")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per figure (median)")
    p.add_argument("--dtype", default="auto", help="the engine's dtype rule (auto: the plan's), used by both")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-peers", action="store_true", help="leave transformers out")
    p.add_argument("--out-dir", default="bench_results")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (decode is measured from the second token on)")
    result = measure(args.model, args.streams, args.max_tokens, args.repeats, args.dtype, args.threads,
                     not args.no_peers)
    print(table(result))
    from nanoengine.bench.report import result_name, write_json

    path = write_json(result, args.out_dir, f"moe_{result_name(result)}")
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
