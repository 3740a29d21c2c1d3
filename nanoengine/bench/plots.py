"""The benchmark's figure, drawn from a result dict (the same one written to JSON). Chapter 08.

`plot_result(result)` draws three panels: (a) output tokens/s of nanoengine and each measured peer with the
roofline bounds as horizontal lines, (b) batch size and KV-cache use over the run, (c) the distribution
(empirical CDF) of time to first token and time per output token. `save_plot` writes it as PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from nanoengine.viz.state import PALETTE

ENGINE_COLOR, PEER_COLOR = PALETTE[0], "#999999"


def _measured(peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in peers if "output_tokens_per_s" in p]


def plot_throughput(result: dict[str, Any], ax) -> None:
    eng = result["nanoengine"]
    rows = [("nanoengine", eng["output_tokens_per_s"], ENGINE_COLOR)]
    rows += [(p["name"], p["output_tokens_per_s"], PEER_COLOR) for p in _measured(result.get("peers", []))]
    names, vals, colors = zip(*rows)
    bars = ax.bar(range(len(rows)), vals, color=colors)
    for b, v in zip(bars, vals):
        ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
    roof = result.get("roofline")
    top = max(vals)
    if roof:
        lines = [("compute bound", roof["compute_bound_output_tokens_per_s"], "#d62728"),
                 ("roofline limit", roof["limit_output_tokens_per_s"], "#2ca02c")]
        for label, v, c in lines:
            ax.axhline(v, color=c, ls="--", lw=1, label=f"{label}: {v:.0f} tok/s")
            top = max(top, v)
        if top / max(min(vals), 1e-9) > 30:  # the bound is far above the bars: log scale, bars from below
            ax.set_yscale("log")
            ax.set_ylim(min(vals) / 3, top * 2)
        ax.legend(fontsize=7, loc="upper right")
    ax.set_ylabel("output tokens/s")
    ax.set_title("(a) throughput vs peers and the machine's bound", fontsize=9)


def plot_batch_and_kv(result: dict[str, Any], ax) -> None:
    series = result["nanoengine"].get("series") or {}
    t = series.get("time", [])
    if not t:
        ax.text(0.5, 0.5, "no per-step series", ha="center", transform=ax.transAxes)
        return
    ax.step(t, series["num_seqs"], where="post", color=ENGINE_COLOR, lw=1)
    ax.set_ylim(0, max(series["num_seqs"]) * 1.1 + 0.5)
    ax.set_xlabel("seconds")
    ax.set_ylabel("batch size (sequences)", color=ENGINE_COLOR)
    ax2 = ax.twinx()
    nb = max(series.get("num_blocks") or 1, 1)
    used = [100 * u / nb for u in series["used_blocks"]]
    ax2.plot(t, used, color=PALETTE[1], lw=1)
    ax2.set_ylabel(f"KV cache used (% of {nb} blocks)", color=PALETTE[1])
    ax2.set_ylim(0, 105 if max(used) > 50 else max(used) * 1.2 + 1e-3)
    ax.set_title("(b) batch size and KV-cache use over the run", fontsize=9)


def plot_latency_cdf(result: dict[str, Any], ax) -> None:
    samples = result["nanoengine"].get("latency", {}).get("samples", {})
    drawn, lo, hi = False, float("inf"), 0.0
    for key, label, color in (("ttft_s", "time to first token", PALETTE[2]),
                              ("tpot_s", "time per output token", PALETTE[3])):
        xs = sorted(samples.get(key) or [])
        if xs:
            ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step([1e3 * xs[0]] + [1e3 * x for x in xs], ys, where="post", color=color,
                    label=f"{label} ({len(xs)} req.)")
            drawn, lo, hi = True, min(lo, xs[0]), max(hi, xs[-1])
    if drawn and hi > 30 * lo > 0:  # TTFT and TPOT far apart: log scale, plain numbers on the ticks
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    if drawn:
        ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title("(c) latency distribution (nanoengine)", fontsize=9)


def plot_result(result: dict[str, Any]) -> Figure:
    """The three panels on a new Figure (not registered with pyplot, so no GUI backend is involved)."""
    fig = Figure(figsize=(15, 4), layout="constrained")
    axes = fig.subplots(1, 3)
    plot_throughput(result, axes[0])
    plot_batch_and_kv(result, axes[1])
    plot_latency_cdf(result, axes[2])
    hw = result.get("hardware", {})
    where = hw.get("gpu") or f"{hw.get('cpu', '?')}, {hw.get('threads', '?')} threads"
    fig.suptitle(f"nanoengine bench: {result['model']}, workload {result['workload']}"
                 f"{' (online)' if result.get('online') else ''}, "
                 f"{result['num_requests']} requests on {where}",
                 fontsize=10)
    return fig


def save_plot(result: dict[str, Any], figures_dir: str | Path, name: str | None = None) -> Path:
    """Write bench_<workload>[_online].png into figures_dir; returns its path."""
    fig = plot_result(result)
    path = Path(figures_dir)
    path.mkdir(parents=True, exist_ok=True)
    name = name or f"bench_{result['workload']}{'_online' if result.get('online') else ''}.png"
    fig.savefig(path / name, dpi=110)
    return path / name
