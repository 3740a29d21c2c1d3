"""One call's ops on a time axis, from `torch.profiler`, and the host time between them. Chapter 06.

- `profile_ops(fn)`: run `fn()` once under the profiler, inside a `record_function` range; return the ops
  called directly in that range (top level: an op's own sub-ops are inside its bar) as `OpSpan`s in
  microseconds from the range's start, and the range's length (`profile_step`: the fastest of a few calls);
- `gaps(spans, total_us)`: the stretches of [0, total_us] that no op covers: Python, the module calls, the
  dispatcher between ops; on a GPU, the time in which the host would be issuing the next launch;
- `plot_op_timeline(spans, total_us, zoom_us)`: the ops as bars on a time axis, the gaps left blank, with a
  zoom on a window where the ops are small.
The engine never imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from torch.profiler import ProfilerActivity, profile, record_function


class OpSpan(NamedTuple):
    name: str  # "aten::linear"
    start_us: float  # from the start of the profiled range
    end_us: float


def profile_ops(fn: Callable[[], Any], label: str = "profiled call") -> tuple[list[OpSpan], float]:
    """(top-level ops of `fn()` in start order, the range's length), both in microseconds, on the CPU."""
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function(label):
        fn()
    events = prof.events()
    ranges = [e for e in events if e.name == label]
    if len(ranges) != 1:
        raise RuntimeError(f"expected one profiler range named {label!r}, found {len(ranges)}")
    top = ranges[0]
    t0 = top.time_range.start
    spans = [OpSpan(e.name, e.time_range.start - t0, e.time_range.end - t0) for e in events
             if e.cpu_parent is not None and e.cpu_parent.id == top.id]
    return sorted(spans, key=lambda s: s.start_us), top.time_range.end - t0


def gaps(spans: Sequence[OpSpan], total_us: float) -> list[tuple[float, float]]:
    """The (start, end) stretches of [0, total_us] that no span covers (spans may overlap or nest)."""
    out, at = [], 0.0
    for s in sorted(spans, key=lambda s: s.start_us):
        start, end = max(s.start_us, 0.0), min(s.end_us, total_us)
        if start > at:
            out.append((at, start))
        at = max(at, end)
    if at < total_us:
        out.append((at, total_us))
    return out


def gap_share(spans: Sequence[OpSpan], total_us: float) -> float:
    """The share of [0, total_us] that no op covers."""
    return sum(b - a for a, b in gaps(spans, total_us)) / total_us if total_us > 0 else 0.0


def _short(name: str) -> str:
    return name.removeprefix("aten::")


def plot_op_timeline(spans: Sequence[OpSpan], total_us: float, zoom_us: tuple[float, float] | None = None,
                     title: str = "") -> Figure:
    """The ops as bars on a time axis (the gaps stay blank); below it, the window `zoom_us` enlarged, with
    the longer ops named. The longest op gets its own colour: in a small model's step it is the LM head."""
    longest = max(spans, key=lambda s: s.end_us - s.start_us, default=None)
    rows = 2 if zoom_us else 1
    fig, axes = plt.subplots(rows, 1, figsize=(10, 1.7 * rows + 0.6), squeeze=False)
    windows = [(0.0, total_us)] + ([zoom_us] if zoom_us else [])
    for ax, (lo, hi) in zip(axes[:, 0], windows, strict=True):
        shown = [s for s in spans if s.end_us > lo and s.start_us < hi]
        for s in shown:
            colour = "#E45756" if s is longest else "#4C78A8"
            ax.broken_barh([(s.start_us / 1e3, (s.end_us - s.start_us) / 1e3)], (0, 1), color=colour)
        ax.broken_barh([(a / 1e3, (b - a) / 1e3) for a, b in gaps(spans, total_us) if b > lo and a < hi],
                       (1.15, 0.35), color="#BBBBBB")
        if (lo, hi) != (0.0, total_us):
            for s in shown:  # name the ops wide enough to carry a label
                if (s.end_us - s.start_us) > (hi - lo) / 25:
                    ax.text((max(s.start_us, lo) + min(s.end_us, hi)) / 2e3, 0.5, _short(s.name), rotation=90,
                            ha="center", va="center", fontsize=6, color="white")
        ax.set_xlim(lo / 1e3, hi / 1e3)
        ax.set_ylim(0, 1.6)
        ax.set_yticks([0.5, 1.325], ["ops", "gaps"])
        ax.set_xlabel("ms from the start of the step")
    share = gap_share(spans, total_us)
    axes[0, 0].set_title(title or f"{len(spans)} top-level ops; gaps {share:.0%} of the call", fontsize=9)
    if zoom_us:
        axes[1, 0].set_title(f"zoom: {zoom_us[0] / 1e3:.2f} to {zoom_us[1] / 1e3:.2f} ms", fontsize=9)
        axes[0, 0].axvspan(zoom_us[0] / 1e3, zoom_us[1] / 1e3, color="#F58518", alpha=0.25, zorder=0)
    fig.tight_layout()
    return fig


@torch.inference_mode()
def profile_step(fn: Callable[[], Any], label: str = "decode step",
                 repeat: int = 3) -> tuple[list[OpSpan], float]:
    """`profile_ops` after one warm-up call, under inference mode (what the engine's step runs in): the
    fastest of `repeat` profiled calls, so that a moment the machine spent elsewhere is not drawn as a gap."""
    fn()
    return min((profile_ops(fn, label) for _ in range(repeat)), key=lambda run: run[1])
