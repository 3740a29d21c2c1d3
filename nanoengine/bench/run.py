"""`nanoengine bench`: nanoengine vs transformers on one workload, in one run, written to JSON. Chapter 08.

Throughput is output tokens per second with ignore_eos (every request produces exactly its output length),
stated as a ratio against the peer measured in the same run, next to the measured hardware ceilings.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from nanoengine import LLM, SamplingParams
from nanoengine.bench import hardware
from nanoengine.bench.peers import hf_static_batches
from nanoengine.bench.workload import WORKLOADS, make_workload


def run_engine(llm: LLM, workload) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == workload.num_output_tokens, "ignore_eos: every request must produce its full length"
    ttft = sorted(o.metrics.time_to_first_token for o in outs)
    tpot = sorted(o.metrics.time_per_output_token for o in outs if o.metrics.time_per_output_token)
    return {"seconds": seconds, "output_tokens": n_out, "output_tokens_per_s": n_out / seconds,
            "steps": llm.last_run_stats["steps"], "ttft_p50_s": ttft[len(ttft) // 2],
            "tpot_p50_s": tpot[len(tpot) // 2] if tpot else None}


def bench(model: str = "smollm2-135m", workload: str = "cpu-small", peer_batches: tuple[int, ...] = (8, 32),
          out_dir: str = "bench_results", **engine_options) -> dict:
    llm = LLM(model, **engine_options)
    cfg = llm.config
    wl = make_workload(workload, vocab_size=cfg.hf_config.vocab_size, **WORKLOADS[workload])
    result = {"model": model, "workload": workload, "num_requests": len(wl.prompts),
              "prompt_tokens": wl.num_prompt_tokens, "output_tokens": wl.num_output_tokens,
              "dtype": cfg.dtype, "engine_options": engine_options, "hardware": hardware.describe(cfg.device),
              "ceilings": {"gemm_gflops": hardware.gemm_peak_gflops(cfg.torch_dtype, cfg.device),
                           "memory_gbs": hardware.memory_bandwidth_gbs(cfg.device)}}
    result["nanoengine"] = run_engine(llm, wl)
    path = llm.engine.model_path
    del llm
    result["peers"] = [hf_static_batches(path, wl, b, cfg.torch_dtype, cfg.device) for b in peer_batches]
    best = max(p["output_tokens_per_s"] for p in result["peers"]) if result["peers"] else None
    if best:
        result["speedup_vs_best_peer"] = result["nanoengine"]["output_tokens_per_s"] / best
    hw = result["hardware"]
    name = f"{model}_{workload}_{hw['device']}_{hw['threads']}t_torch{hw['torch']}".replace("/", "-")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"{name}.json").write_text(json.dumps(result, indent=2))
    return result


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    opts = json.loads(args.engine_options) if args.engine_options else {}
    r = bench(args.model, args.workload, tuple(args.peer_batches), args.out_dir, **opts)
    eng = r["nanoengine"]
    print(f"nanoengine: {eng['output_tokens_per_s']:.1f} output tok/s ({eng['seconds']:.1f} s, {eng['steps']} steps)")
    for p in r["peers"]:
        print(f"{p['peer']}: {p['output_tokens_per_s']:.1f} output tok/s ({p['seconds']:.1f} s)")
    if "speedup_vs_best_peer" in r:
        print(f"speedup vs the best peer: {r['speedup_vs_best_peer']:.2f}x")
    c = r["ceilings"]
    print(f"ceilings: GEMM {c['gemm_gflops']:.0f} GFLOP/s ({r['dtype']}), copy {c['memory_gbs']:.1f} GB/s")
    return 0
