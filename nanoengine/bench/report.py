"""The benchmark's outputs: the table on stdout, the JSON file (named with model, workload, hardware and
versions) and the summary lines under the table. Chapter 08."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", str(text)).strip("-")


def result_name(result: dict[str, Any]) -> str:
    """<model>_<workload>[_online-rR]_<gpu or cpu model>_<threads>t_torch<v>_nanoengine<v>"""
    hw = result["hardware"]
    where = hw.get("gpu") or hw.get("cpu") or hw["device"]
    online = f"_online-r{result['request_rate']:g}" if result.get("online") else ""
    model = Path(str(result["model"])).name
    parts = [_slug(model), _slug(result["workload"]) + online, _slug(where), f"{hw['threads']}t",
             f"torch{_slug(hw['torch'])}", f"nanoengine{_slug(hw['nanoengine'])}"]
    return "_".join(parts)


def _clean(x: Any) -> Any:
    """NaN and infinities as None, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(result: dict[str, Any], out_dir: str | Path, name: str | None = None) -> Path:
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    path = path / f"{name or result_name(result)}.json"
    path.write_text(json.dumps(_clean(result), indent=1, allow_nan=False, default=str))
    return path


def _ms(summary: dict[str, Any] | None) -> str:
    if not summary or summary.get("p50") is None:
        return "-"
    return f"{1e3 * summary['p50']:.1f} / {1e3 * summary['p99']:.1f}"


def table(result: dict[str, Any]) -> str:
    """One row per system: throughput, seconds, nanoengine's speed-up over it, TTFT and TPOT p50 / p99."""
    eng = result["nanoengine"]
    head = (f"{'system':<24} {'out tok/s':>10} {'total tok/s':>12} {'seconds':>9} {'nanoengine x':>13} "
            f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17}")
    lines = [head, "-" * len(head)]
    lat = eng.get("latency", {})
    lines.append(f"{'nanoengine':<24} {eng['output_tokens_per_s']:>10.1f} {eng['total_tokens_per_s']:>12.1f} "
                 f"{eng['seconds']:>9.2f} {'1.00x':>13} {_ms(lat.get('ttft_s')):>17} "
                 f"{_ms(lat.get('tpot_s')):>17}")
    for p in result.get("peers", []):
        name = p.get("name", p["peer"])
        if "output_tokens_per_s" in p:
            speedup = f"{p['speedup']:.2f}x" if p.get("speedup") else "-"
            lines.append(f"{name:<24} {p['output_tokens_per_s']:>10.1f} {p['total_tokens_per_s']:>12.1f} "
                         f"{p['seconds']:>9.2f} {speedup:>13} {'-':>17} {'-':>17}")
        else:
            why = p.get("skipped") or f"error: {p.get('error')}"
            lines.append(f"{name:<24} {'skipped: ' + why if 'skipped' in p else why}")
    return "\n".join(lines)


def summary_lines(result: dict[str, Any]) -> list[str]:
    eng, c = result["nanoengine"], result["ceilings"]
    steps = eng["steps"]
    lines = []
    if result.get("online"):
        o = eng["online"]
        lines.append(f"online: Poisson arrivals at {o['request_rate']:g} req/s (offered), achieved "
                     f"{o['achieved_request_rate']:.2f} req/s; e2e latency p50/p99 "
                     f"{_ms(eng['latency']['e2e_s'])} ms")
    r, cost = result["roofline"], result["cost"]
    lines.append(f"roofline: {cost['flops'] / 1e12:.3f} TFLOP, {cost['bytes'] / 1e9:.2f} GB moved; "
                 f"measured GEMM {c['gemm_gflops']:.0f} GFLOP/s ({c['gemm_dtype']}, {c['threads']} threads), "
                 f"copy {c['memory_gbs']:.1f} GB/s")
    lines.append(f"  bounds: compute {r['compute_bound_s']:.3f} s, memory {r['memory_bound_s']:.3f} s -> "
                 f"{r['bound']}-bound limit {r['limit_s']:.3f} s; "
                 f"achieved {100 * r['achieved_fraction_of_limit']:.1f}% of the limit")
    lines.append(f"  compute-bound output tok/s {r['compute_bound_output_tokens_per_s']:.0f}; "
                 f"nanoengine reaches {100 * r['fraction_of_compute_bound']:.1f}% of the compute bound")
    oh = steps["host_overhead_ms"]
    if oh["mean"] is not None:
        lines.append(f"scheduler + input preparation: {oh['mean']:.3f} ms/step mean, "
                     f"{oh['p50']:.3f} ms p50 over {oh['num_steps']} {oh['overhead_steps']} "
                     f"(mean batch {oh['mean_batch']:.0f})")
    if oh.get("postprocess_mean") is not None:
        lines.append("postprocess (append, stop rules, detokenize): "
                     f"{oh['postprocess_mean']:.3f} ms/step mean over the same steps")
    ss = result.get("single_stream")
    if ss:
        ms, frac = ss["step_ms"], ss["step_fraction"]
        parts = ", ".join(f"{k} {ms[k]:.1f} ms ({100 * frac[k]:.0f}%)"
                          for k in ("linears", "attention", "other", "host"))
        rate = ss["decode_tokens_per_s"]
        lines.append(f"single stream ({ss['prompt_tokens']} prompt tokens): {rate:.1f} decode tok/s (TPOT "
                     f"{ss['tpot_ms']:.1f} ms); a profiled decode step {ss['profiled_step_ms']:.1f} ms: "
                     f"{parts}")
    batch, kv, pc = steps["batch_size"], steps["kv_use"], steps["prefix_cache"]
    lines.append(f"batch size: peak {batch['peak']}, mean {batch['mean']:.1f} over {steps['num_steps']} "
                 f"steps; KV cache use: peak {100 * kv['peak']:.1f}%, mean {100 * kv['mean']:.1f}% of "
                 f"{kv['num_blocks']} blocks")
    lines.append(f"prefix-cache hit rate: {100 * pc['hit_rate']:.1f}% "
                 f"({pc['hit_tokens']} of {pc['prompt_tokens']} prompt tokens); "
                 f"preemptions: {steps['preemptions']}")
    if "without_prefix_caching" in result:
        w = result["without_prefix_caching"]
        lines.append(f"without prefix caching: {w['output_tokens_per_s']:.1f} output tok/s "
                     f"({w['seconds']:.2f} s): "
                     f"prefix caching is {result['prefix_caching_speedup']:.2f}x faster")
    m = result["peak_memory"]
    lines.append(f"peak memory: {m['mib']:.0f} MiB ({m['what']})")
    for key, label in (("json_path", "JSON"), ("plot_path", "plot")):
        if result.get(key):
            lines.append(f"{label}: {result[key]}")
    return lines


def report(result: dict[str, Any]) -> str:
    return "\n".join([table(result), "", *summary_lines(result)])
