"""The server's Prometheus metrics (`GET /metrics`, through prometheus-client). Chapter 05 (appendix).

Updated by the engine thread only: after every step from its `StepStats` (batch size, KV-cache use, prefix
hits, preemptions) and the scheduler's queues, and once per finished request from its `RequestMetrics`
(TTFT, TPOT, end-to-end latency). Each server has its own registry, so several can live in one process.
Names follow vLLM's where there is one (`nanoengine_` instead of `vllm:`).

The data-parallel front end's page (`data_parallel.py`): `render_replicas` gives every replica's samples with
a `replica="i"` label, and beside them the total over the replicas (a sum, or as `TOTALS` says); after them
come the front end's own counters (`FrontMetrics`: routed, lost and refused requests, replicas up).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanoengine.serve.router import REASONS, Router
from nanoengine.trace import StepStats

CACHE_CONFIG = ("block_size", "num_blocks", "enable_prefix_caching", "max_num_seqs")  # its labels
# how a family totals over data-parallel replicas when a sum would be wrong: the largest value, or the
# ratio of two totalled samples
TOTALS: dict[str, str | tuple[str, str]] = {
    "nanoengine_batch_size_peak": "max", "nanoengine_model_info": "max",
    "nanoengine_cache_config_info": "max",
    "nanoengine_kv_cache_usage_perc": ("nanoengine_kv_cache_used_blocks", "nanoengine_kv_cache_blocks"),
    "nanoengine_prefix_cache_hit_rate": ("nanoengine_prefix_cache_hit_tokens_total",
                                         "nanoengine_prompt_tokens_total"),
}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, {"registry": self.registry}
        self.running = Gauge("nanoengine_num_requests_running", "sequences in the running batch", **m)
        self.waiting = Gauge("nanoengine_num_requests_waiting", "sequences waiting for admission", **m)
        self.batch_size = Gauge("nanoengine_batch_size", "sequences in the last step", **m)
        self.peak_batch_size = Gauge("nanoengine_batch_size_peak", "most sequences in one step since start",
                                     **m)
        self.batch_hist = Histogram("nanoengine_step_batch_size", "sequences per step", buckets=BATCH_BUCKETS,
                                    **m)
        self.kv_used_blocks = Gauge("nanoengine_kv_cache_used_blocks", "KV blocks held by live sequences",
                                    **m)
        self.kv_blocks = Gauge("nanoengine_kv_cache_blocks", "KV blocks in the pool", **m)
        self.kv_usage = Gauge("nanoengine_kv_cache_usage_perc", "share of the KV pool in use (0..1)", **m)
        self.prompt_tokens = Counter("nanoengine_prompt_tokens", "prompt tokens of admitted sequences (n per "
                                     "request)", **m)
        self.generation_tokens = Counter("nanoengine_generation_tokens", "tokens generated", **m)
        self.prefix_hit_tokens = Counter("nanoengine_prefix_cache_hit_tokens", "prompt tokens served by the "
                                         "prefix cache", **m)
        self.prefix_hit_rate = Gauge("nanoengine_prefix_cache_hit_rate", "prefix-cache hit tokens / prompt "
                                     "tokens since start", **m)
        self.preemptions = Counter("nanoengine_num_preemptions", "sequences preempted (recomputed later)",
                                   **m)
        self.steps = Counter("nanoengine_engine_steps", "engine steps", **m)
        self.finished = Counter("nanoengine_request_success", "finished requests", ["finish_reason"], **m)
        self.aborted = Counter("nanoengine_request_aborted", "requests aborted (client gone, or shutdown)",
                               **m)
        self.refused = Counter("nanoengine_requests_refused", "requests refused or ended by a server limit, "
                               "or while the server could not serve", ["reason"], **m)
        self.ttft = Histogram("nanoengine_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, **m)
        self.tpot = Histogram("nanoengine_time_per_output_token_seconds", "mean gap between a request's "
                              "later tokens", buckets=LATENCY_BUCKETS, **m)
        self.e2e = Histogram("nanoengine_e2e_request_latency_seconds", "arrival to finish",
                             buckets=LATENCY_BUCKETS, **m)
        info = Gauge("nanoengine_model_info", "the served model", ["model"], registry=r)
        info.labels(model=model).set(1)
        self.cache_config = Gauge("nanoengine_cache_config_info", "the engine's KV cache and batch as "
                                  "planned", list(CACHE_CONFIG), registry=r)
        self._hits = self._prompt = self._peak = 0

    def on_plan(self, plan: Any, num_blocks: int) -> None:
        """The engine's plan (block size, prefix caching, batch size) and its KV pool, as labels."""
        values = {**{k: getattr(plan, k) for k in CACHE_CONFIG if hasattr(plan, k)}, "num_blocks": num_blocks}
        self.cache_config.labels(**{k: str(values.get(k, "")) for k in CACHE_CONFIG}).set(1)  # (what it has)

    def on_refused(self, reason: str) -> None:
        """reason: body_too_large, n, prompt_tokens, queue_full, first_token_timeout, unread_chunks or
        unavailable (shutting down, or the engine failed)."""
        self.refused.labels(reason=reason).inc()

    def on_admitted(self, num_prompt_tokens: int) -> None:
        self._prompt += num_prompt_tokens
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_step(self, stats: StepStats | None, num_running: int, num_waiting: int, used_blocks: int,
                num_blocks: int) -> None:
        """After a step (stats) or after handling submissions and aborts without a step (stats=None)."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_used_blocks.set(used_blocks)
        self.kv_blocks.set(num_blocks)
        self.kv_usage.set(used_blocks / num_blocks if num_blocks else 0.0)
        if stats is None or stats.num_seqs == 0:
            self.batch_size.set(0)
            return
        self.steps.inc()
        self.batch_size.set(stats.num_seqs)
        self.batch_hist.observe(stats.num_seqs)
        if stats.num_seqs > self._peak:
            self._peak = stats.num_seqs
            self.peak_batch_size.set(stats.num_seqs)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)
        if stats.cache_hit_tokens:
            self._hits += stats.cache_hit_tokens
            self.prefix_hit_tokens.inc(stats.cache_hit_tokens)
        self.prefix_hit_rate.set(self._hits / self._prompt if self._prompt else 0.0)

    def on_tokens(self, n: int) -> None:
        if n:
            self.generation_tokens.inc(n)

    def on_finished(self, finish_reason: str, metrics: Any) -> None:
        """A request whose completions all finished; metrics is its RequestMetrics (num_output_tokens set)."""
        if finish_reason == "abort":
            self.aborted.inc()
            return
        self.finished.labels(finish_reason=finish_reason).inc()
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.time_per_output_token is not None:
            self.tpot.observe(metrics.time_per_output_token)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def combine_replicas(pages: dict[int, str]) -> list[Any]:
    """The families of each replica's /metrics page (replica index -> Prometheus text) as one list of
    prometheus_client Metric families: each sample once per replica with a `replica` label, and once as the
    total over them (summed, or as TOTALS says). Only the replicas given count."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, list[float]]] = {}  # family -> (sample name, labels) -> one value a replica
    for replica, text in sorted(pages.items()):
        for fam in text_string_to_metric_families(text):
            out = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for sample in fam.samples:
                out.add_sample(sample.name, {**sample.labels, "replica": str(replica)}, sample.value)
                key = (sample.name, tuple(sorted(sample.labels.items())))
                totals.setdefault(fam.name, {}).setdefault(key, []).append(sample.value)
    summed = {key[0]: sum(v) for family in totals.values() for key, v in family.items() if not key[1]}
    for name, samples in totals.items():
        rule = TOTALS.get(name)
        for (sample_name, labels), values in samples.items():
            if isinstance(rule, tuple):
                num, den = (summed.get(s, 0.0) for s in rule)
                value = num / den if den else 0.0
            else:
                value = max(values) if rule == "max" else sum(values)
            families[name].add_sample(sample_name, dict(labels), value)
    return list(families.values())


class _Families:
    """Parsed metric families as a registry for generate_latest."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def render_replicas(pages: dict[int, str]) -> bytes:
    """The replicas' pages (replica index -> Prometheus text) as one page: `combine_replicas`' families."""
    return generate_latest(_Families(combine_replicas(pages)))


class FrontMetrics:
    """The front end's own counters (beside the replicas' families on /metrics)."""

    def __init__(self, size: int) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("nanoengine_router_requests", "requests sent to each replica, by why "
                              "(affinity, over_bound, least_loaded, round_robin)", ["replica", "reason"],
                              registry=r)
        self.lost = Counter("nanoengine_router_lost_requests", "requests in flight on a replica when it "
                            "exited or its connection broke", ["replica"], registry=r)
        self.refused = Counter("nanoengine_router_requests_refused", "requests the front end refused "
                               "(body_too_large, unavailable)", ["reason"], registry=r)
        self.in_flight = Gauge("nanoengine_router_in_flight", "requests in flight on each replica",
                               ["replica"], registry=r)
        self.up = Gauge("nanoengine_router_replica_up", "1 while the replica runs, 0 once it exited",
                        ["replica"], registry=r)
        self.num_up = Gauge("nanoengine_router_replicas_up", "replicas running", registry=r)
        for i in range(size):
            for reason in REASONS:
                self.routed.labels(replica=str(i), reason=reason)
            self.lost.labels(replica=str(i))

    def on_refused(self, reason: str) -> None:
        self.refused.labels(reason=reason).inc()

    def render(self, router: Router) -> bytes:
        for i, (n, up) in enumerate(zip(router.in_flight, router.up)):
            self.in_flight.labels(replica=str(i)).set(n)
            self.up.labels(replica=str(i)).set(int(up))
        self.num_up.set(router.num_up)
        return generate_latest(self.registry)
