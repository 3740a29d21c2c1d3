"""Cache-aware against round-robin routing over data-parallel replicas, side by side. Chapter 07 (beyond one
machine).

    python -m nanoengine.bench.routing --model smollm2-135m            # the measurement (about 5 minutes)
    python -m nanoengine.bench.routing --model tiny-qwen3 --num-requests 16 --prefix-len 256   # a smoke run

For each router in turn, one run: `nanoengine serve MODEL --data-parallel-size 2 --router R` in a
subprocess on loopback, driven over HTTP by the online bench (`online.run_served`: the same seeded
`multi-prefix` workload, several system prompts of 1,024 tokens with many questions each, at the same
Poisson arrivals), then stopped with SIGTERM. Figures: the prefix-cache hit rate (hit tokens / prompt tokens
over every replica, from the server's /metrics totals), output tokens/s, TTFT p50/p99 at the client, and
where the router sent the requests and why. Each replica's KV pool (`--num-kvcache-blocks`, by default from
the workload) holds about half of the system prompts and the running requests' own blocks: one replica
cannot keep every system prompt cached, two together can, which is where affinity pays. The JSON goes to
`--out-dir` (named with model, hardware and versions).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

from nanoengine.bench.online import run_served
from nanoengine.bench.workload import WORKLOADS, shared_prefix_workload

ROUTERS = ("cache_aware", "round_robin")
START_TIMEOUT_S = 600


def pool_blocks(prefix_len: int, num_prefixes: int, max_tail: int, max_num_seqs: int, block_size: int) -> int:
    """A replica's KV blocks: half the system prompts and a half more, plus every running sequence's own
    blocks (its suffix and output, and one partly shared block)."""
    prefix = -(-prefix_len // block_size)
    own = -(-max_tail // block_size) + 1
    return prefix * num_prefixes // 2 + prefix // 2 + max_num_seqs * own


def start_server(argv: list[str]) -> tuple[subprocess.Popen, str]:
    """`nanoengine serve ...` in a subprocess; returns it and its http://host:port once it listens (its
    stderr, the replicas' logs, goes to ours)."""
    proc = subprocess.Popen([sys.executable, "-m", "nanoengine", "serve", *argv], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + START_TIMEOUT_S
    for line in proc.stdout:
        found = re.search(r" on (http://\S+)/v1", line)
        if found:
            return proc, found.group(1)
        if time.monotonic() > deadline:
            break
    stop_server(proc)
    raise RuntimeError(f"the server did not start (exit status {proc.returncode}); see its output above")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def router_counts(url: str) -> dict[str, float]:
    """The router's requests by reason (summed over replicas) and by replica."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "nanoengine_router_requests_total" and s.value:
                for key in (s.labels["reason"], f"replica {s.labels['replica']}"):
                    out[key] = out.get(key, 0.0) + s.value
    return out


def run_router(router: str, args: argparse.Namespace, wl: Any, blocks: int) -> dict[str, Any]:
    argv = [args.model, "--port", "0", "--data-parallel-size", str(args.data_parallel_size),
            "--router", router, "--device", "cpu", "--dtype", args.dtype,
            "--block-size", str(args.block_size), "--num-kvcache-blocks", str(blocks),
            "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning",
            *(["--threads", str(args.threads)] if args.threads else [])]
    print(f"[{router}] nanoengine serve {' '.join(argv)}", file=sys.stderr, flush=True)
    proc, url = start_server(argv)
    try:
        r = run_served(url, wl, request_rate=args.request_rate, seed=args.seed)
        r["router"] = {"policy": router, **router_counts(url)}
        r["server_command"] = ["nanoengine", "serve", *argv]
        return r
    finally:
        stop_server(proc)


def summary(r: dict[str, Any]) -> dict[str, Any]:
    lat, st = r["latency"]["ttft_s"], r["server_steps"]
    return {"prefix_hit_rate": st["prefix_hit_rate"], "output_tokens_per_s": r["output_tokens_per_s"],
            "ttft_p50_s": lat["p50"], "ttft_p99_s": lat["p99"], "seconds": r["seconds"],
            "preemptions": st["preemptions"], "router": r["router"]}


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = f"{'router':<12} {'hit rate':>8} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}"
    lines = [head + "  routed"]
    for name, s in rows.items():
        routed = ", ".join(f"{k} {v:.0f}" for k, v in s["router"].items() if k != "policy")
        hit = "-" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.1%}"
        lines.append(f"{name:<12} {hit:>8} {s['output_tokens_per_s']:>10.1f} {1e3 * s['ttft_p50_s']:>12.0f} "
                     f"{1e3 * s['ttft_p99_s']:>12.0f}  {routed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    spec = WORKLOADS["multi-prefix"]
    p = argparse.ArgumentParser(prog="python -m nanoengine.bench.routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="asset name or local Hugging Face folder")
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated, run in this order")
    p.add_argument("--num-requests", type=int, default=32, help="questions over all system prompts")
    p.add_argument("--num-prefixes", type=int, default=spec["num_prefixes"], help="system prompts")
    p.add_argument("--prefix-len", type=int, default=spec["prefix_len"], help="tokens per system prompt")
    p.add_argument("--request-rate", type=float, default=0.5, help="Poisson arrivals, requests/s (inf: all "
                   "at once)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kvcache-blocks", type=int, default=None,
                   help="per replica (default: half the system prompts and a half more, plus the running "
                        "requests' own blocks)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per replica (default: the "
                   "server's, CPU cores // replicas)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_results")
    args = p.parse_args(argv)
    routers = args.routers.split(",")
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        p.error(f"--routers: unknown {unknown}; use {', '.join(ROUTERS)}")
    wl = shared_prefix_workload("multi-prefix", args.num_requests, args.prefix_len, spec["suffix_len"],
                                spec["output_len"], seed=args.seed, num_prefixes=args.num_prefixes)
    max_tail = spec["suffix_len"][1] + spec["output_len"][1]
    blocks = args.num_kvcache_blocks or pool_blocks(args.prefix_len, args.num_prefixes, max_tail,
                                                     args.max_num_seqs, args.block_size)
    runs = {r: run_router(r, args, wl, blocks) for r in routers}
    rows = {name: summary(r) for name, r in runs.items()}
    print(table(rows))
    from nanoengine.bench import hardware
    from nanoengine.bench.report import result_name, write_json
    from nanoengine.serve.replicas import replica_threads

    hw = hardware.describe("cpu")
    hw["threads"] = replica_threads(args.data_parallel_size, args.threads)
    result = {"model": args.model, "workload": "multi-prefix", "online": True,
              "request_rate": args.request_rate, "hardware": hw, "workload_spec": wl.spec,
              "data_parallel_size": args.data_parallel_size, "kv_blocks_per_replica": blocks,
              "max_num_seqs": args.max_num_seqs, "summary": rows, "runs": runs}
    path = write_json(result, args.out_dir, f"routing-dp{args.data_parallel_size}_{result_name(result)}")
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
