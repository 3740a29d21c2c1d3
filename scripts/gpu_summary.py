"""summary.md for scripts/gpu_check.sh: what a reader takes in at a glance, from the parts' own results.

Reads the work folder of one run (env.json, parts.tsv, graphs/, attention/, ops/, bench/, host/) and the
run's log.txt in --out; writes --out/summary.md and --out/checks.json (the graphs, attention and ops results
in one file). Standard library only, so it runs in a fraction of a second after every part, and whatever is
missing (a part skipped, timed out or failed) is said in a line, never an error.

Published figures beside the benchmark: nano-vllm's README (RTX 4070 Laptop, Qwen3-0.6B, the same 256
requests: 133,966 output tokens), and two user reports of vLLM on A100-class GPUs of the same bench.py.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

# (system, output tok/s, seconds, where, source)
PUBLISHED = [
    ("nano-vllm", 1434.13, 93.41, "RTX 4070 Laptop 8 GB", "nano-vllm's README"),
    ("vLLM", 1361.84, 98.37, "RTX 4070 Laptop 8 GB", "nano-vllm's README"),
    ("vLLM 0.20", 9530.43, 14.06, "A100 80GB PCIe", "a user's report (GeeeekExplorer/nano-vllm issue 245)"),
    ("vLLM 0.10.2", 8587.95, 15.60, "A800 80GB SXM4", "a user's report (nano-vllm-triton issue 1)"),
]
NANO_VLLM_OUTPUT_TOKENS = 133_966


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def first_json(folder: Path, want: str) -> dict | None:
    """The first JSON object in folder that has key `want`."""
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        data = load(p)
        if isinstance(data, dict) and want in data:
            return data
    return None


def log_section(log: str, name: str) -> str:
    """The output of part `name` in log.txt ('' when it did not run)."""
    m = re.search(rf"^===== {re.escape(name)} \(timeout.*?$(.*?)(?=^===== |\Z)", log, re.M | re.S)
    return m.group(1) if m else ""


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def parts_table(work: Path) -> tuple[list[dict], list[str]]:
    rows = []
    for line in (work / "parts.tsv").read_text().splitlines() if (work / "parts.tsv").exists() else []:
        name, status, seconds, timeout, note = (line.split("\t") + [""] * 5)[:5]
        rows.append({"name": name, "status": status, "seconds": seconds, "timeout": timeout, "note": note})
    lines = ["| part | status | s | timeout s | note |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['seconds']} | {r['timeout']} | {r['note'][:160]} |"
              for r in rows]
    return rows, lines


def status_of(parts: list[dict], name: str) -> str | None:
    """'ok', 'failed', 'timed out', 'skipped' or None (not run yet), for the last run of part `name`."""
    found = [p for p in parts if p["name"] == name]
    if not found:
        return None
    p = found[-1]
    return p["status"] + (f" ({p['note']})" if p["note"] and p["status"] != "ok" else "")


def token_rows(graphs: dict | None, attention: dict | None) -> list[tuple[str, str, str, str]]:
    """(check, model, dtype, result) for every backend comparison that ran."""
    rows = []
    for r in (attention or {}).get("correctness", []):
        if r["backend"] == "torch" and r["result"] == "reference":
            continue
        res = r["result"]
        if "equal" in r and "of" in r:
            res = "equal" if r["equal"] == r["of"] else f"**differs**: {r['equal']}/{r['of']} equal"
        rows.append((f"{r['backend']} vs torch", r["model"], r["dtype"], res))
    for r in (graphs or {}).get("tokens", []):
        if "error" in r:
            rows.append(("graphs, compiled vs eager", r["model"], r["dtype"], f"error: {r['error'][:160]}"))
            continue
        for what in ("graphs", "compiled"):
            same, agree = r.get(f"{what}_equal"), r.get(f"{what}_agree")
            res = "equal" if same else f"**differs**: {pct(agree)} of tokens agree"
            rows.append((f"{what} vs eager", r["model"], r["dtype"], res))
    return rows


def tests_summary(section: str) -> tuple[str, list[str]]:
    counts: dict[str, int] = {}
    for m in re.finditer(r"^\S+::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", section, re.M):
        counts[m.group(1).lower()] = counts.get(m.group(1).lower(), 0) + 1
    final = re.findall(r"^=+ (.*\d+ (?:passed|failed|skipped|error).*) in [\d.]+s", section, re.M)
    text = final[-1] if final else (", ".join(f"{v} {k}" for k, v in counts.items()) + " (cut short)"
                                    if counts else "")
    failed = [f"{m.group(1)}: {(m.group(2) or '')[:200]}"
              for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", section, re.M)]
    return text, failed


def bench_lines(bench: dict | None, mode: str) -> tuple[str, list[str]]:
    if bench is None:
        return "", []
    eng, roof, hw = bench["nanoengine"], bench["roofline"], bench.get("hardware", {})
    plan = bench.get("plan", {})
    where = hw.get("gpu") or hw.get("cpu") or hw.get("device", "?")
    tps = eng["output_tokens_per_s"]
    same = bench.get("workload") == "nano-vllm" and bench.get("output_tokens") == NANO_VLLM_OUTPUT_TOKENS
    of_limit = pct(roof.get("achieved_fraction_of_limit"))
    glance = (f"{num(tps)} output tok/s on the {bench['workload']} workload ({bench['model']}, "
              f"{bench['dtype']}), {of_limit} of the roofline limit")
    if same:
        (_, nano, *_), (_, vllm, *_) = PUBLISHED[:2]
        glance += (f"; {tps / nano:.2f}x nano-vllm's published {nano:,.0f} tok/s and {tps / vllm:.2f}x "
                   f"vLLM's {vllm:,.0f} (on an RTX 4070 Laptop, not this GPU)")
    spec = bench.get("workload_spec", {})
    system = f"**nanoengine** ({plan.get('attention_backend')} attention, {plan.get('decode_mode')})"
    lines = [f"## Benchmark: {bench['workload']} workload ({bench['num_requests']} requests, in "
             f"{spec.get('input_len')} / out {spec.get('output_len')} tokens, {bench['output_tokens']:,} "
             f"output tokens{', the same draw as nano-vllm' if same else ''})", "",
             "| system | where | output tok/s | seconds | of the roofline limit | source |",
             "|---|---|---|---|---|---|",
             f"| {system} | {where} | **{num(tps)}** | {eng['seconds']:.1f} | {of_limit} | this run |"]
    lines += [f"| {name} | {gpu} | {t:,.0f} | {s:.1f} | - | {src} |" for name, t, s, gpu, src in PUBLISHED]
    if not same:
        lines += ["", f"(a {mode} run: not nano-vllm's workload, so the published rows are not comparable)"]
    lat, oh = eng.get("latency", {}), eng.get("steps", {}).get("host_overhead_ms", {})
    tpot, ceil = (lat.get("tpot_s") or {}).get("p50"), bench.get("ceilings", {})
    lines += ["", f"roofline: {roof.get('bound')}-bound limit {num(roof.get('limit_output_tokens_per_s'))} "
              f"output tok/s, compute bound {num(roof.get('compute_bound_output_tokens_per_s'))} "
              f"({pct(roof.get('fraction_of_compute_bound'))} of it reached); measured GEMM "
              f"{num(ceil.get('gemm_gflops'))} GFLOP/s, copy {num(ceil.get('memory_gbs'))} GB/s"]
    if oh.get("mean") is not None:
        lines.append(f"host per decode step: schedule + inputs {oh['mean']:.2f} ms, postprocess "
                     f"{num(oh.get('postprocess_mean'), 2)} ms (mean batch {oh.get('mean_batch', 0):.0f}); "
                     f"TPOT p50 {num(None if tpot is None else 1e3 * tpot, 1)} ms; peak memory "
                     f"{num(bench.get('peak_memory', {}).get('mib'))} MiB")
    return glance, lines


def decode_lines(graphs: dict | None) -> list[str]:
    rows = [r for r in (graphs or {}).get("decode", []) if "batch" in r]
    if not rows:
        errors = [r["error"] for r in (graphs or {}).get("decode", []) if "error" in r]
        return [f"decode step: error: {errors[0][:200]}"] if errors else []
    lines = ["| batch | context | eager ms | graphs ms | graphs speed-up |", "|---|---|---|---|---|"]
    for r in rows:
        e, g = r.get("eager_ms"), r.get("graphs_ms")
        speedup = f"{e / g:.2f}x" if e and g else "-"
        lines.append(f"| {r['batch']} | {r['context']} | {num(e, 3)} | {num(g, 3)} | {speedup} |")
    return lines


def attention_lines(attention: dict | None) -> list[str]:
    rows = (attention or {}).get("decode_speed", [])
    if not rows:
        return []
    cols = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    cell = {(r["backend"], r["batch"], r["context"]): r for r in rows}
    lines = ["| backend | " + " | ".join(f"batch {b}, ctx {c}" for b, c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for name in backends:
        vals = []
        for b, c in cols:
            r = cell.get((name, b, c))
            vals.append("-" if r is None else "error" if "error" in r else
                        f"{r['us']:g} us ({pct(r['fraction_of_copy_bw'])})")
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    return lines


def ops_lines(ops: dict | None) -> list[str]:
    rows = (ops or {}).get("ops", [])
    if not rows:
        return []
    lines = ["| op | tokens | eager ms | compiled ms |", "|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['tokens']} | {r['eager_ms']:.3f} | {r['compiled_ms']:.3f} |" for r in rows]
    return lines


def summary(work: Path, out: Path, elapsed: int, budget: int, final: bool = False) -> str:
    env = load(work / "env.json") or {}
    log = (out / "log.txt").read_text(errors="replace") if (out / "log.txt").exists() else ""
    parts, parts_md = parts_table(work)
    graphs = load(work / "graphs" / "graphs_check.json")
    attention = load(work / "attention" / "attention_check.json")
    ops = load(work / "ops" / "graphs_check.json")
    bench = first_json(work / "bench", "roofline")
    host = first_json(work / "host", "host_only") or first_json(work / "host", "batches")
    (out / "checks.json").write_text(json.dumps({"graphs": graphs, "attention": attention, "ops": ops},
                                                indent=1))
    mods = env.get("modules", {})
    flash = env.get("flash_attn") or ("absent" if not mods.get("flash_attn") else mods["flash_attn"])
    mode = env.get("mode", "?")
    head = (f"# GPU check ({mode}): {env.get('gpu') or 'no GPU (CPU)'} · torch {env.get('torch', '?')} · "
            f"CUDA {env.get('cuda') or 'none'} · triton {env.get('triton') or 'absent'} · flash_attn {flash}")
    lines = [head, "",
             (f"done in {elapsed // 60} min {elapsed % 60} s" if final else
              f"cut short or still running: {elapsed // 60} min {elapsed % 60} s so far") +
             f" (budget {budget} s); installed nothing (the checkout on "
             "PYTHONPATH, pip without an index, Hugging Face offline).", ""]
    for why in env.get("problems", []):
        lines += [f"**Nothing could run: {why}**", ""]

    tokens = token_rows(graphs, attention)
    test_text, failed = tests_summary(log_section(log, "pytest"))
    glance_bench, bench_md = bench_lines(bench, mode)
    glance = []
    if tokens:
        by: dict[str, list[bool]] = {}
        for check, _, _, res in tokens:
            if not res.startswith("skipped"):
                by.setdefault(check, []).append(res == "equal")
        glance.append("tokens: " + " · ".join(f"{c}: {'equal' if all(v) else 'DIFFER'} in {sum(v)}/{len(v)}"
                                              for c, v in by.items()))
    for name, what in (("graphs", "graphs and compiled tokens, decode step"),
                       ("attention", "triton vs torch tokens, decode attention")):
        st = status_of(parts, name)
        if st and st != "ok":
            glance.append(f"{name} check ({what}): {st}")
    if test_text or status_of(parts, "pytest"):
        st = status_of(parts, "pytest")
        glance.append(f"tests: {test_text or 'no result'}" + (f" [{st}]" if st and st != "ok" else ""))
    if glance_bench:
        glance.append(f"benchmark: {glance_bench}")
    elif status_of(parts, "bench"):
        glance.append(f"benchmark: {status_of(parts, 'bench')}")
    if glance:
        lines += ["**At a glance**", ""] + [f"- {g}" for g in glance] + [""]

    if tokens:
        lines += ["## Tokens equal? (greedy: backends against torch, graphs and compiled ops against eager)",
                  "", "| check | model | dtype | result |", "|---|---|---|---|"]
        lines += [f"| {c} | {m} | {d} | {r} |" for c, m, d, r in tokens] + [""]
    if bench_md:
        lines += bench_md + [""]
    dec = decode_lines(graphs)
    if dec:
        model = "qwen3-0.6b-shape bf16" if mode == "full" else "tiny-qwen3 fp32, CPU stand-in graphs"
        lines += [f"## Decode step (forward + logits, {model})", ""] + dec + [""]
    att = attention_lines(attention)
    if att:
        bw = (attention or {}).get("copy_bandwidth_GBps")
        lines += [f"## Decode attention alone (Qwen3-0.6B heads, bf16): time, and K/V read as a share of the "
                  f"copy bandwidth ({num(bw)} GB/s)", ""] + att + [""]
    host_text = log_section(log, "host-only").strip().splitlines()
    if host or (host_text and status_of(parts, "host-only") == "ok"):
        lines += ["## Host work per decode step (bench --host-only, model stubbed)", "", "```"]
        lines += [ln for ln in host_text if not ln.startswith(("$ ", "[env]"))][-20:] + ["```", ""]
    op = ops_lines(ops)
    if op:
        lines += ["## Compiled vs eager ops", ""] + op + [""]
    if failed:
        lines += ["## Failed tests", ""] + [f"- {f}" for f in failed[:15]] + [""]
    lines += ["## Parts", ""] + parts_md + [""]
    notes = env.get("notes", [])
    if notes:
        lines += ["## Absent here", ""] + [f"- {n}" for n in notes] + [""]
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.name != "summary.md")
    lines.append(f"Files beside this one: {', '.join(files)} (log.txt: every part's output).")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="the run's work folder")
    ap.add_argument("--out", type=Path, required=True, help="where summary.md and checks.json go")
    ap.add_argument("--elapsed", type=int, default=0, help="seconds since the run started")
    ap.add_argument("--budget", type=int, default=0, help="the run's budget in seconds")
    ap.add_argument("--final", action="store_true", help="the run has finished")
    args = ap.parse_args()
    if not args.work.is_dir():
        raise SystemExit(f"gpu_summary.py: no work folder {args.work}")
    args.out.mkdir(parents=True, exist_ok=True)
    summary(args.work, args.out, args.elapsed, args.budget, args.final)


if __name__ == "__main__":
    main()
