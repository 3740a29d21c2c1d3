"""`nanoengine bench --online --url URL`: the online workload driven over HTTP against `nanoengine serve`.
Chapter 08 (and 05's server appendix).

The same seeded requests and Poisson arrivals as the in-process online mode (`run.run_online`), sent as
streamed `/v1/completions` requests (token-id prompts, `ignore_eos`, the workload's temperature), each at its
scheduled arrival time, so served and in-process runs of one workload can be compared. Latencies are measured
at the client, from the scheduled arrival: TTFT is the first chunk that carries text, TPOT the gap between a
request's later tokens (its token count from the usage chunk), end-to-end the last chunk; they are summarized
by the same functions as the in-process bench (`metrics.request_latencies`, `metrics.throughput`). The
server's own step numbers (mean batch size, preemptions, prefix hits) come from its /metrics before and after.
With `--request-rate inf` every request arrives at once: as many concurrent clients as requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoengine.bench.metrics import request_latencies, throughput
from nanoengine.bench.workload import Workload, make_workload, poisson_arrivals

SERVER_COUNTERS = ("nanoengine_step_batch_size_sum", "nanoengine_step_batch_size_count",
                   "nanoengine_num_preemptions_total", "nanoengine_prefix_cache_hit_tokens_total",
                   "nanoengine_prompt_tokens_total")


@dataclass
class ClientMetrics:
    """One request's times at the client (perf_counter seconds), shaped like RequestMetrics."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0


def base_url(url: str) -> str:
    """http://host:port (the /v1 suffix is optional on the command line)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    return url.rstrip("/").removesuffix("/v1")


def server_counters(text: str) -> dict[str, float]:
    """The counters in SERVER_COUNTERS from a Prometheus text page (the unlabelled samples: a data-parallel
    server's totals over its replicas)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in SERVER_COUNTERS and not s.labels:
                values[s.name] = s.value
    return values


async def _one(client: Any, model: str, prompt: list[int], max_tokens: int, temperature: float,
               start: float, at: float) -> ClientMetrics:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    m = ClientMetrics(arrival_time=start + at)  # the scheduled arrival, as in the in-process online mode
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed a request: {chunk['error']['message']}")
            if m.first_token_time is None and any(c.get("text") for c in chunk["choices"]):
                m.first_token_time = time.perf_counter()
            if chunk.get("usage"):
                m.num_output_tokens = chunk["usage"]["completion_tokens"]
    m.finished_time = time.perf_counter()
    return m


async def _drive(url: str, wl: Workload, arrivals: list[float], timeout: float,
                 want: str | None) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = models[0]["id"]
        if want is not None and Path(want).name != Path(model).name:
            raise ValueError(f"--model {want} but the server at {url} serves {model!r}; "
                             "leave --model out with --url")
        before = server_counters((await client.get("/metrics")).text)
        start = time.perf_counter()
        metrics = await asyncio.gather(*(_one(client, model, p, n, wl.temperature, start, at)
                                         for p, n, at in zip(wl.prompts, wl.output_lens, arrivals)))
        seconds = time.perf_counter() - start
        after = server_counters((await client.get("/metrics")).text)
    return {"model": model, "metrics": list(metrics), "seconds": seconds,
            "server": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SERVER_COUNTERS}}


def run_served(url: str, workload: str | Workload = "cpu-small", num_requests: int | None = None,
               request_rate: float = float("inf"), seed: int = 0, timeout: float = 3600.0,
               model: str | None = None) -> dict[str, Any]:
    """Drive the server at `url` with the workload's requests at Poisson arrivals; the result dict has the
    in-process bench's keys for throughput and latency (`output_tokens_per_s`, `latency`, ...). `model`: the
    model the server must be serving (an error before any request if it serves another)."""
    url = base_url(url)
    wl = workload if isinstance(workload, Workload) else make_workload(workload, num_requests, seed=seed)
    arrivals = poisson_arrivals(len(wl), request_rate, seed)
    got = asyncio.run(_drive(url, wl, arrivals, timeout, model))
    n_out = sum(m.num_output_tokens for m in got["metrics"])
    if n_out != wl.num_output_tokens:
        raise RuntimeError(f"ignore_eos: expected {wl.num_output_tokens} output tokens, "
                           f"the server made {n_out}")
    s = got["server"]
    steps = s["nanoengine_step_batch_size_count"]
    return {"url": url, "model": got["model"], "workload": wl.name, "num_requests": len(wl),
            **throughput(wl.num_prompt_tokens, wl.num_output_tokens, got["seconds"]),
            "latency": request_latencies(got["metrics"]),
            "online": {"request_rate": request_rate, "arrival_seed": seed, "last_arrival_s": arrivals[-1],
                       "achieved_request_rate": len(wl) / got["seconds"], "arrival_times": arrivals},
            "server_steps": {"num_steps": steps,
                             "mean_batch_size": (s["nanoengine_step_batch_size_sum"] / steps
                                                 if steps else None),
                             "preemptions": s["nanoengine_num_preemptions_total"],
                             "prefix_hit_tokens": s["nanoengine_prefix_cache_hit_tokens_total"],
                             "prompt_tokens": s["nanoengine_prompt_tokens_total"],
                             "prefix_hit_rate": (s["nanoengine_prefix_cache_hit_tokens_total"]
                                                 / s["nanoengine_prompt_tokens_total"]
                                                 if s["nanoengine_prompt_tokens_total"] else None)}}


def _ms(summary: dict[str, Any]) -> str:
    return "-" if summary.get("p50") is None else f"{1e3 * summary['p50']:.1f} / {1e3 * summary['p99']:.1f}"


def report_served(r: dict[str, Any]) -> str:
    lat, o, st = r["latency"], r["online"], r["server_steps"]
    rate = ("all at once" if o["request_rate"] == float("inf")
            else f"Poisson arrivals at {o['request_rate']:g} req/s")
    mean_batch = "-" if st["mean_batch_size"] is None else f"{st['mean_batch_size']:.1f}"
    return "\n".join([
        f"served: {r['model']} at {r['url']}, workload {r['workload']} "
        f"({r['num_requests']} requests, {rate})",
        f"  output {r['output_tokens_per_s']:.1f} tok/s, total {r['total_tokens_per_s']:.1f} tok/s in "
        f"{r['seconds']:.2f} s; achieved {o['achieved_request_rate']:.2f} req/s",
        f"  TTFT p50/p99 {_ms(lat['ttft_s'])} ms, TPOT p50/p99 {_ms(lat['tpot_s'])} ms, "
        f"e2e p50/p99 {_ms(lat['e2e_s'])} ms (at the client)",
        f"  server: {st['num_steps']:.0f} steps, mean batch {mean_batch}, "
        f"{st['preemptions']:.0f} preemptions, "
        f"{st['prefix_hit_tokens']:.0f} prefix-cache hit tokens"])


def main(args: Any) -> int:
    """`nanoengine bench --online --url URL [--request-rate R] [--workload W] [--num-requests N]`."""
    in_process_only = {"--engine-options": args.engine_options, "--threads": args.threads,
                       "--peer-batches": args.peer_batches,
                       "--compare-prefix-caching": args.compare_prefix_caching or None}
    given = [flag for flag, value in in_process_only.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} configure the in-process engine; with --url the server runs "
                         "with the options it was started with (nanoengine serve --help)")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests/s (or inf), got {args.request_rate}")
    rate = float("inf") if args.request_rate is None else args.request_rate
    from nanoengine.assets import DEFAULT_MODEL

    r = run_served(args.url, args.workload, args.num_requests, rate, args.seed,
                   model=None if args.model == DEFAULT_MODEL else args.model)
    print(report_served(r))
    if args.out_dir:
        from nanoengine.bench.report import _clean

        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        rate_s = "inf" if rate == float("inf") else f"{rate:g}"
        path = out / f"served_{Path(r['model']).name}_{r['workload']}_r{rate_s}.json"
        path.write_text(json.dumps(_clean(r), indent=1, allow_nan=False))
        print(f"JSON: {path}")
    return 0
