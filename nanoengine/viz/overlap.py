"""Overlap scheduling seen on one clock: what the host and the forward did in each step. Chapter 06.

- `step_spans(stats)`: one step's `StepStats` as spans on the engine's clock: on the host row its launch
  (schedule, build, hand to the executor, advance), its wait for the tokens and its finish (append, stop
  rules, text); on the forward row the forward and the draw (CPU only: on CUDA the host's clock does not see
  them). A forward the host's own thread ran (no overlap) is cut out of the launch: the host row holds the
  host's Python only;
- `overlap_summary(stats)`: a run's decode steps in a few numbers: ms per step, the host's work per step, the
  part of it done while a forward ran, the forward's time and its idle gap between two steps, the late rows;
- `plot_overlap_timeline(runs)`: the spans of a few decode steps of each run, two rows per run, and beside
  them a zoom on the moment one forward ends.
Figures are built only from the StepStats records passed in; the engine never imports this module.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from nanoengine.trace import StepStats

COLORS = {"launch": "#4C78A8", "wait": "#DDDDDD", "finish": "#F58518", "forward": "#54A24B"}
LEGEND = {"launch": "host: schedule + build + launch", "wait": "host: waits for the step's tokens",
          "finish": "host: append, stop rules, text", "forward": "forward + draw"}


@dataclass(frozen=True)
class Span:
    row: str  # "host" or "forward"
    phase: str  # "launch", "wait", "finish" (host) or "forward"
    start: float  # seconds on the engine's clock
    end: float
    step: int  # the step's index in the records it came from


def step_spans(s: StepStats, step: int = 0) -> list[Span]:
    """The spans of one finished step (those of zero length left out). Its launch is [started, started +
    schedule_s + prepare_s + (forward_s - wait_s) + advance], where advance is the part of postprocess_s
    outside the finish span [finishing, time]; the finish span begins with the wait."""
    known = s.finishing + s.wait_s  # the tokens are on the host
    advance = max(s.postprocess_s - (s.time - known), 0.0)
    launch_end = s.started + s.schedule_s + s.prepare_s + (s.forward_s - s.wait_s) + advance
    fs, fe = s.forward_start, s.forward_end
    inline = fs is not None and fe is not None and s.started <= fs and fe <= launch_end + 1e-6
    launch = [(s.started, fs), (fe, launch_end)] if inline else [(s.started, launch_end)]
    spans = [Span("host", "launch", a, b, step) for a, b in launch]
    spans += [Span("host", "wait", s.finishing, known, step), Span("host", "finish", known, s.time, step)]
    if fs is not None and fe is not None:
        spans.append(Span("forward", "forward", fs, fe, step))
    return [sp for sp in spans if sp.end > sp.start]


def _union(spans: Sequence[Span]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for sp in sorted(spans, key=lambda sp: sp.start):
        if merged and sp.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], sp.end)
        else:
            merged.append([sp.start, sp.end])
    return [(a, b) for a, b in merged]


def _covered(sp: Span, union: Sequence[tuple[float, float]]) -> float:
    return sum(max(0.0, min(sp.end, b) - max(sp.start, a)) for a, b in union)


def _decode_pairs(stats: Sequence[StepStats]) -> list[tuple[StepStats, StepStats]]:
    """Neighbouring records that are both decode-only steps (the steady state)."""
    return [(a, b) for a, b in zip(stats, stats[1:]) if a.prefill_tokens == 0 and b.prefill_tokens == 0
            and a.decode_tokens and b.decode_tokens]


def overlap_summary(stats: Sequence[StepStats]) -> dict[str, float | int | None]:
    """A run's decode steps: `step_ms` (median time from one step's finish to the next's), `host_ms` (median
    host work per step: its launch and finish spans, not the wait), `hidden` (the fraction of all that host
    work done while some forward ran), `forward_ms` (median forward + draw) and `gap_ms` (median idle time of
    the forward between two decode steps), both None without forward spans, `late_rows` (over every step) and
    `steps` (decode steps)."""
    stats = list(stats)
    decodes = [(i, s) for i, s in enumerate(stats) if s.prefill_tokens == 0 and s.decode_tokens]
    pairs = _decode_pairs(stats)
    spans = [sp for i, s in enumerate(stats) for sp in step_spans(s, i)]
    host = [sp for sp in spans if sp.row == "host" and sp.phase != "wait"]
    forwards = _union([sp for sp in spans if sp.row == "forward"])
    decode_ids = {i for i, _ in decodes}
    per_step: dict[int, float] = {}
    for sp in host:
        if sp.step in decode_ids:
            per_step[sp.step] = per_step.get(sp.step, 0.0) + sp.end - sp.start
    total = sum(sp.end - sp.start for sp in host if sp.step in decode_ids)
    hidden = sum(_covered(sp, forwards) for sp in host if sp.step in decode_ids)
    gaps = [b.forward_start - a.forward_end for a, b in pairs
            if a.forward_end is not None and b.forward_start is not None]
    forward = [s.forward_end - s.forward_start for _, s in decodes
               if s.forward_start is not None and s.forward_end is not None]
    return {"steps": len(decodes),
            "step_ms": statistics.median(b.time - a.time for a, b in pairs) * 1e3 if pairs else float("nan"),
            "host_ms": statistics.median(per_step.values()) * 1e3 if per_step else float("nan"),
            "hidden": hidden / total if total else 0.0,
            "forward_ms": statistics.median(forward) * 1e3 if forward else None,
            "gap_ms": statistics.median(gaps) * 1e3 if gaps else None,
            "late_rows": sum(s.late_rows for s in stats)}


def _window(stats: Sequence[StepStats], steps: int) -> list[int]:
    """Indices of `steps` neighbouring decode-only records from the middle of the longest such stretch."""
    best: list[int] = []
    run: list[int] = []
    for i, s in enumerate(stats):
        if s.prefill_tokens == 0 and s.decode_tokens:
            run.append(i)
            if len(run) > len(best):
                best = list(run)
        else:
            run = []
    if not best:
        best = list(range(len(stats)))
    first = max(0, (len(best) - steps) // 2)
    return best[first:first + steps]


def _typical_boundary(window: Sequence[StepStats]) -> float:
    """The end of the forward (on CUDA: the moment the host had the tokens) of the step whose tokens reached
    the host after the median delay, among the view's steps: the zoom shows a typical step, not an outlier
    (now and then the host wakes up late, waiting for the GIL)."""
    def ended(s: StepStats) -> float:
        return s.forward_end if s.forward_end is not None else s.finishing + s.wait_s

    ranked = sorted(window, key=lambda s: s.finishing + s.wait_s - ended(s))
    return ended(ranked[len(ranked) // 2])


def _draw(ax: plt.Axes, spans: Sequence[Span], y: int, lo: float, hi: float, origin: float) -> None:
    """Draw the spans that meet [lo, hi], cut to it, in ms from origin: host on row y, forward on y + 1."""
    for sp in spans:
        a, b = max(sp.start, lo), min(sp.end, hi)
        if b <= a:
            continue
        ax.barh(y if sp.row == "host" else y + 1, (b - a) * 1e3, left=(a - origin) * 1e3, height=0.7,
                color=COLORS[sp.phase], edgecolor="white" if sp.phase == "forward" else "none", linewidth=0.5)


def plot_overlap_timeline(runs: Mapping[str, Sequence[StepStats]], steps: int = 6,
                          zoom_ms: float | None = None) -> Figure:
    """Two rows per run (host, forward) over `steps` neighbouring decode steps from the middle of each run, in
    ms from the start of the first one's forward (on CUDA: its launch), with every span of the run that
    falls in that view; and, on the right, the same rows around the moment one step's tokens became known
    (0: its forward ended; on CUDA, the host got them), for a typical step of the view (`_typical_boundary`),
    `zoom_ms` wide (by default three times the host's work per step, at least 1 ms). Each forward bar in view
    carries its step's index in its run."""
    if not runs:
        raise ValueError("plot_overlap_timeline needs at least one run of StepStats")
    records = {label: list(v) for label, v in runs.items()}
    if not all(_window(v, steps) for v in records.values()):
        raise ValueError("plot_overlap_timeline needs at least one step in every run")
    seen = all(s.forward_start is not None for v in records.values() for s in v)
    if zoom_ms is None:
        host = [x["host_ms"] for x in map(overlap_summary, records.values()) if x["host_ms"] == x["host_ms"]]
        zoom_ms = max(1.0, 3.0 * max(host, default=0.0))
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 1.5 * len(records) + 1.7), sharey=True,
                                   gridspec_kw={"width_ratios": [3, 1]})
    width = 0.0
    for k, stats in enumerate(records.values()):
        window = _window(stats, steps)
        first, last = stats[window[0]], stats[window[-1]]
        lo = first.forward_start if first.forward_start is not None else first.started
        hi = last.forward_end if last.forward_end is not None else last.time
        width = max(width, hi - lo)
        spans = [sp for i, s in enumerate(stats) for sp in step_spans(s, i)]
        _draw(ax, spans, 2 * k, lo, hi, lo)
        for sp in spans:
            if sp.row == "forward" and lo <= sp.start and sp.end <= hi:
                ax.text(((sp.start + sp.end) / 2 - lo) * 1e3, 2 * k + 1, str(sp.step), ha="center",
                        va="center", fontsize=7, color="white")
        at = _typical_boundary([stats[i] for i in window])
        _draw(zoom, spans, 2 * k, at - 0.2 * zoom_ms / 1e3, at + 0.8 * zoom_ms / 1e3, at)
    ax.set_yticks(range(2 * len(records)),
                  [f"{label}\n{row}" for label in records for row in ("host", "forward")], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, width * 1e3)
    ax.set_xlabel(f"ms: {steps} decode steps (the numbers are the steps' indices in their run)")
    zoom.set_xlim(-0.2 * zoom_ms, 0.8 * zoom_ms)
    zoom.axvline(0, color="#666666", lw=0.6, ls=":")
    zoom.set_xlabel("ms from the end of one forward" if seen else "ms from the host getting a step's tokens")
    zoom.set_title("zoom: one step to the next", fontsize=9)
    title = "Host and forward per step, on the engine's clock (StepStats)"
    if not seen:
        title += (":\nthe forward's span is not on the host's clock here (CUDA: it runs on the device after "
                  "the launch returns), so only the host's spans are drawn")
    fig.suptitle(title, fontsize=10)
    handles = [Patch(color=COLORS[p], label=LEGEND[p]) for p in COLORS if seen or p != "forward"]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="host: outside the step (the caller)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    return fig
