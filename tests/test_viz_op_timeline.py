"""nanoengine.viz.op_timeline: the ops of a profiled call and the gaps between them, against hand
arithmetic and against a call whose gaps are known sleeps."""

from __future__ import annotations

import time

import matplotlib

matplotlib.use("Agg")
import pytest
import torch

from nanoengine.viz.op_timeline import OpSpan, gap_share, gaps, plot_op_timeline, profile_ops, profile_step


def test_gaps_by_hand():
    spans = [OpSpan("a", 10, 20), OpSpan("b", 15, 30), OpSpan("c", 12, 14), OpSpan("d", 50, 60)]
    assert gaps(spans, 100) == [(0, 10), (30, 50), (60, 100)]
    assert gap_share(spans, 100) == pytest.approx((10 + 20 + 40) / 100)
    assert gaps([], 5) == [(0.0, 5)] and gaps([OpSpan("a", 0, 5)], 5) == []


def test_profile_ops_sees_the_ops_and_the_sleeps_between_them():
    x = torch.randn(64, 64)

    def fn():
        y = x @ x  # top level: matmul (its mm inside it)
        time.sleep(0.004)
        y = y + 1
        time.sleep(0.004)
        return y.sum()

    t = time.perf_counter()
    spans, total = profile_ops(fn, "three ops")
    wall = (time.perf_counter() - t) * 1e6
    assert [s.name for s in spans] == ["aten::matmul", "aten::add", "aten::sum"]
    assert all(0 <= s.start_us < s.end_us <= total for s in spans) and 8000 <= total <= wall
    between = gaps(spans, total)
    assert sum(b - a for a, b in between if a >= spans[0].end_us and b <= spans[-1].start_us) >= 8000
    assert 8000 / total <= gap_share(spans, total) <= 1


def test_profile_step_and_plot():
    lin = torch.nn.Linear(8, 8)
    spans, total = profile_step(lambda: lin(torch.randn(2, 8)).relu())
    assert [s.name for s in spans][-2:] == ["aten::linear", "aten::relu"]
    fig = plot_op_timeline(spans, total, zoom_us=(0, total / 2))
    assert len(fig.axes) == 2
