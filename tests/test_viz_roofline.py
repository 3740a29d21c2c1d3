"""nanoengine.viz.roofline (chapter 08): the roof is min(peak, intensity x bandwidth), and the figure draws
the points given, each above its hollow marker on the roof."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from nanoengine.viz.roofline import attainable_gflops, plot_roofline  # noqa: E402


def test_the_roof_by_hand():
    assert attainable_gflops(2.0, gemm_gflops=100.0, memory_gbs=10.0) == 20.0  # memory-bound: 2 x 10
    assert attainable_gflops(10.0, 100.0, 10.0) == 100.0  # at the balance both give the peak
    assert attainable_gflops(50.0, 100.0, 10.0) == 100.0  # compute-bound


def test_plot_draws_each_point_and_its_roof():
    points = [{"intensity": 1.0, "gflops": 4.0, "label": "batch 1"},
              {"intensity": 40.0, "gflops": 60.0, "label": "batch 64"}]
    fig, ax = plt.subplots()
    plot_roofline(ax, 100.0, 10.0, points, title="t")
    dots = [(line.get_xdata()[0], line.get_ydata()[0], line.get_markerfacecolor())
            for line in ax.get_lines() if line.get_marker() == "o"]
    filled = [(x, y) for x, y, face in dots if face != "none"]
    hollow = [(x, y) for x, y, face in dots if face == "none"]
    assert filled == [(1.0, 4.0), (40.0, 60.0)]
    assert hollow == [(1.0, pytest.approx(10.0)), (40.0, pytest.approx(100.0))]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "batch 1: 4.0 GFLOP/s, 40% of the roof" in labels
    assert "batch 64: 60.0 GFLOP/s, 60% of the roof" in labels
    roof = ax.get_lines()[0]
    assert all(y == pytest.approx(min(100.0, x * 10.0)) for x, y in zip(roof.get_xdata(), roof.get_ydata()))
    plt.close(fig)
