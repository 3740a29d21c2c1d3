"""`nanoengine bench`: nanoengine and its peers on one seeded workload in one run. Chapter 08.

`bench(...)` measures the machine (GEMM peak, memory bandwidth), runs the workload through nanoengine
(offline: every request at once, as nano-vllm's bench.py; online: Poisson arrivals at a given rate), frees
the engine, runs the peers on the same requests, and returns one result dict: throughput, latencies, the
engine's per-step numbers, the roofline, peak memory, versions. It writes that dict as JSON into `out_dir`
and a figure into `figures_dir`; `main` (the CLI) prints the table.

Throughput counts output tokens with ignore_eos (every request produces exactly its output length).
Sampling is temperature 0.6 (as nano-vllm's bench), seeded through the engine's seed (`EngineConfig.seed`,
one shared generator), so a run on the same machine and schedule is reproducible.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from nanoengine import LLM, SamplingParams, assets
from nanoengine.bench import hardware
from nanoengine.bench.metrics import request_latencies, step_series, step_summary, throughput
from nanoengine.bench.peers import parse_peers, run_peers
from nanoengine.bench.plots import save_plot
from nanoengine.bench.report import report, write_json
from nanoengine.bench.roofline import engine_shape, roofline, shape_dict, workload_cost
from nanoengine.bench.step_profile import single_stream
from nanoengine.bench.workload import Workload, make_workload, poisson_arrivals


def _params(wl: Workload) -> list[SamplingParams]:
    return [SamplingParams(temperature=wl.temperature, max_tokens=n, ignore_eos=True) for n in wl.output_lens]


def _warm_up(llm: LLM) -> None:
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)


def _engine_numbers(llm: LLM, wl: Workload, outs_metrics: list, cached: list[int], seconds: float,
                    t0: float) -> dict[str, Any]:
    stats = list(llm.engine.stats)
    return {**throughput(wl.num_prompt_tokens, wl.num_output_tokens, seconds),
            "latency": request_latencies(outs_metrics),
            "steps": step_summary(stats, wl.num_prompt_tokens),
            "series": step_series(stats, t0 - llm.engine.start_time),
            "cached_tokens": cached}


def run_engine(llm: LLM, wl: Workload, quiet: bool = True) -> dict[str, Any]:
    """Offline: every request submitted at once, as nano-vllm's bench.py."""
    _warm_up(llm)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], _params(wl), use_tqdm=not quiet)
    seconds = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if n_out != wl.num_output_tokens:
        raise RuntimeError(f"ignore_eos: expected {wl.num_output_tokens} output tokens, "
                           f"the engine made {n_out}")
    return _engine_numbers(llm, wl, [o.metrics for o in outs], [o.num_cached_tokens for o in outs], seconds,
                           start)


def run_online(llm: LLM, wl: Workload, request_rate: float, seed: int = 0,
               quiet: bool = True) -> dict[str, Any]:
    """Online: request i is added when its Poisson arrival time has passed; TTFT counts from that scheduled
    arrival (so it includes queueing). Each finished request is released at once."""
    from tqdm.auto import tqdm

    arrivals = poisson_arrivals(len(wl), request_rate, seed)
    eng = llm.engine
    _warm_up(llm)
    params = _params(wl)
    reqs = [eng.make_request({"prompt_token_ids": p}, sp, final_only=True)
            for p, sp in zip(wl.prompts, params)]
    pending = deque(zip(arrivals, reqs))
    active, metrics, cached = [], {}, {}
    bar = tqdm(total=len(reqs), desc="Online requests", disable=quiet, dynamic_ncols=True)
    eng.clear_stats()
    start = time.perf_counter()
    try:
        while pending or active:
            now = time.perf_counter() - start
            while pending and pending[0][0] <= now:
                at, req = pending.popleft()
                req.metrics.arrival_time = start + at  # the scheduled arrival, not when the loop noticed it
                eng.add(req)
                active.append(req)
            if eng.has_unfinished():
                eng.step()
            elif pending:
                time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
            for req in [r for r in active if r.finished]:
                out = req.output()
                metrics[req.request_id], cached[req.request_id] = out.metrics, out.num_cached_tokens
                eng.abort(req.request_id)
                active.remove(req)
                bar.update(1)
    finally:
        for req in active:
            eng.abort(req.request_id)
        bar.close()
    seconds = time.perf_counter() - start
    order = [r.request_id for r in reqs]
    res = _engine_numbers(llm, wl, [metrics[i] for i in order], [cached[i] for i in order], seconds, start)
    res["online"] = {"request_rate": request_rate, "arrival_seed": seed, "last_arrival_s": arrivals[-1],
                     "achieved_request_rate": len(reqs) / seconds, "arrival_times": arrivals}
    return res


def peak_memory(device: str) -> dict[str, Any]:
    if device.startswith("cuda"):
        return {"mib": torch.cuda.max_memory_allocated() / 2**20, "what": "torch.cuda.max_memory_allocated"}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"mib": kib / 1024,
            "what": "process peak RSS (ru_maxrss): the whole process, not just the KV cache"}


def bench(model: str = assets.DEFAULT_MODEL, workload: str | Workload = "cpu-small",
          num_requests: int | None = None, *, online: bool = False, request_rate: float | None = None,
          peers: list[str] | None = None, peer_batches: list[int] | None = None, threads: int | None = None,
          engine_options: dict[str, Any] | None = None, out_dir: str | Path | None = "bench_results",
          figures_dir: str | Path | None = "figures", compare_prefix_caching: bool = False, seed: int = 0,
          quiet: bool = False, step_profile: bool = True) -> dict[str, Any]:
    """Run the benchmark and return its result (also written to out_dir / figures_dir unless they are None).

    workload: a name from WORKLOADS or a Workload; num_requests takes its first N requests. peers: any of
    "hf", "vllm", "nano-vllm" (default all; vLLM and nano-vllm are recorded as skipped without a GPU).
    peer_batches: transformers static batch sizes (default 8, 32 on CPU; 64, 256 on CUDA).
    step_profile: after the workload, one stream's decode tokens/s and the split of its decode step into
    linears, attention, other and host (`bench/step_profile.py`; CPU only, a few seconds).
    """
    if num_requests is not None and (not isinstance(num_requests, int) or num_requests < 1):
        raise ValueError(f"--num-requests must be an integer >= 1, got {num_requests!r}")
    if request_rate is not None and not online:
        raise ValueError("--request-rate is for the online mode; add --online")
    if online and (request_rate is None or not request_rate > 0):
        raise ValueError(f"online mode needs --request-rate R with R > 0 requests/s, got {request_rate}")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    peers = parse_peers(None) if peers is None else list(peers)
    opts = dict(engine_options or {})
    if isinstance(workload, str):
        make_workload(workload, num_requests)  # a bad name or count fails before the model loads
    llm = LLM(model, **opts)
    plan = llm.plan
    if isinstance(workload, Workload):
        wl = workload.head(num_requests) if num_requests else workload
        vocab = plan.hf_config.vocab_size
        if max(max(p) for p in wl.prompts) >= vocab:
            raise ValueError(f"workload {wl.name!r} has token ids >= the model's vocabulary size {vocab}")
    else:
        wl = make_workload(workload, num_requests, vocab_size=plan.hf_config.vocab_size, seed=seed)
    device = plan.device
    if wl.name == "nano-vllm" and device == "cpu":
        print("nanoengine bench: warning: the nano-vllm workload (256 requests up to 2048 tokens) takes "
              "hours on a CPU; try --workload cpu-small", file=sys.stderr)
    if peer_batches is None:
        peer_batches = [64, 256] if device.startswith("cuda") else [8, 32]
    result: dict[str, Any] = {
        "model": str(model), "model_path": str(llm.engine.model_path), "workload": wl.name,
        "workload_spec": wl.spec, "num_requests": len(wl), "prompt_tokens": wl.num_prompt_tokens,
        "output_tokens": wl.num_output_tokens, "online": online, "request_rate": request_rate,
        "sampling": f"temperature {wl.temperature}, ignore_eos, seeded by the engine seed {plan.seed}",
        "dtype": plan.dtype, "engine_options": opts, "plan": plan.describe(),
        # how dtype was decided: given, the one candidate here, or timed (now or before) on this machine
        "dtype_choice": {"dtype": plan.dtype, "source": plan.dtype_source,
                         "ms_per_step": dict(plan.dtype_ms_per_step)},
        "hardware": hardware.describe(device), "kernel_paths": hardware.kernel_paths(plan)}
    result["ceilings"] = hardware.measure(hardware.gemm_dtype(plan), device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    eng = run_online(llm, wl, request_rate, seed, quiet) if online else run_engine(llm, wl, quiet)
    result["nanoengine"] = eng
    result["peak_memory"] = peak_memory(device)
    shape = engine_shape(plan)
    cost = workload_cost(shape, wl.prompt_lens, wl.output_lens, eng["steps"]["num_steps"],
                         eng["cached_tokens"])
    result["model_shape"] = shape_dict(shape)
    result["cost"] = cost
    c = result["ceilings"]
    result["roofline"] = roofline(cost, c["gemm_gflops"], c["memory_gbs"], eng["seconds"])
    if online:
        result["roofline"]["note"] = "online: the measured time includes waiting for arrivals"
    if step_profile and device == "cpu":
        result["single_stream"] = single_stream(llm, seed=seed)
    model_path = llm.engine.model_path
    del llm
    gc.collect()
    if compare_prefix_caching:
        llm = LLM(model, **{**opts, "enable_prefix_caching": False})
        off = run_online(llm, wl, request_rate, seed, quiet) if online else run_engine(llm, wl, quiet)
        del llm
        gc.collect()
        result["without_prefix_caching"] = {k: off[k] for k in ("seconds", "output_tokens_per_s",
                                                                "total_tokens_per_s")}
        result["without_prefix_caching"]["steps"] = {k: off["steps"][k] for k in ("num_steps", "batch_size",
                                                                                  "prefill_tokens")}
        result["prefix_caching_speedup"] = off["seconds"] / eng["seconds"]
    if online:
        result["peers"] = [{"peer": p, "name": p if p != "hf" else "transformers",
                            "skipped": "online mode: peers run offline only"} for p in peers]
    else:
        result["peers"] = run_peers(peers, model_path, wl, peer_batches, plan.torch_dtype, device, seed,
                                    quiet)
    for p in result["peers"]:
        if p.get("output_tokens_per_s"):
            p["speedup"] = eng["output_tokens_per_s"] / p["output_tokens_per_s"]
    if figures_dir is not None:
        result["plot_path"] = str(save_plot(result, figures_dir))
    if out_dir is not None:
        result["json_path"] = str(write_json(result, out_dir))
    return result


def main(args: Any) -> int:
    import json

    opts = json.loads(args.engine_options) if args.engine_options else {}
    if not isinstance(opts, dict):
        raise ValueError('--engine-options must be a JSON object, e.g. \'{"block_size": 32}\'')
    peers = [] if args.no_peers else parse_peers(args.peers)
    r = bench(args.model, args.workload, args.num_requests, online=args.online,
              request_rate=args.request_rate, peers=peers, peer_batches=args.peer_batches,
              threads=args.threads, engine_options=opts, out_dir=args.out_dir, figures_dir=args.figures_dir,
              compare_prefix_caching=args.compare_prefix_caching, seed=args.seed, quiet=args.quiet,
              step_profile=not args.no_step_profile)
    print(report(r))
    return 0
