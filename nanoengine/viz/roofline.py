"""The roofline with measured points on it. Chapter 08.

`plot_roofline(ax, gemm_gflops, memory_gbs, points)` draws attainable GFLOP/s = min(peak, intensity x
bandwidth) on log-log axes, the machine balance (peak / bandwidth, where the two lines meet) and one labelled
point per measurement: `points` are dicts with "intensity" (FLOP/byte), "gflops" (achieved) and "label"
(e.g. the decode steps of `nanoengine.bench.decode_batches.decode_points`, one per batch size). Under each
point, a hollow marker on the roof says what that intensity allows. Drawn only from the numbers passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes

from nanoengine.viz.state import PALETTE


def attainable_gflops(intensity: float, gemm_gflops: float, memory_gbs: float) -> float:
    """The roof: min(peak, intensity x bandwidth), in GFLOP/s."""
    return min(gemm_gflops, intensity * memory_gbs)


def plot_roofline(ax: Axes, gemm_gflops: float, memory_gbs: float, points: Sequence[dict[str, Any]],
                  title: str | None = None) -> Axes:
    balance = gemm_gflops / memory_gbs
    xs = [p["intensity"] for p in points] + [balance]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = sorted({lo * (hi / lo) ** (k / 64) for k in range(65)} | {balance})
    ax.loglog(grid, [attainable_gflops(i, gemm_gflops, memory_gbs) for i in grid], color="k", lw=1.5,
              label=f"roof: min({gemm_gflops:.0f} GFLOP/s, intensity x {memory_gbs:.1f} GB/s)")
    ax.axvline(balance, color="#999999", ls=":", lw=1, label=f"machine balance {balance:.0f} FLOP/byte")
    for k, p in enumerate(points):
        color = PALETTE[k % len(PALETTE)]
        roof = attainable_gflops(p["intensity"], gemm_gflops, memory_gbs)
        ax.plot([p["intensity"]] * 2, [p["gflops"], roof], color=color, lw=0.8, ls="--")
        ax.plot([p["intensity"]], [roof], "o", mfc="none", color=color)
        ax.plot([p["intensity"]], [p["gflops"]], "o", color=color,
                label=f"{p['label']}: {p['gflops']:.1f} GFLOP/s, {100 * p['gflops'] / roof:.0f}% of the roof")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=7, loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    return ax
