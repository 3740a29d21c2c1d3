"""nanoengine.viz.overhead (chapter 06): the dispatch counter against op counts known by construction, the
step breakdown's arithmetic, the bucket padding against the engine's own DecodeGraphs.bucket_for, and the
figures drawn from those numbers."""

from __future__ import annotations

from collections import Counter

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from nanoengine.engine.graphs import DecodeGraphs  # noqa: E402
from nanoengine.viz import overhead  # noqa: E402


def test_count_ops_counts_each_dispatched_op():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    assert overhead.count_ops(lambda: torch.relu(x + y) * 2) == Counter(add=1, relu=1, mul=1)
    assert overhead.count_ops(lambda: [x.add_(1) for _ in range(5)]) == Counter(add_=5)
    assert overhead.count_ops(lambda: None) == Counter()
    assert overhead.count_ops(lambda: x.view(4, 3).t()) == Counter(view=1, t=1)  # views are ops too


def test_per_op_cost_and_median_are_positive_times():
    assert 0 < overhead.per_op_us(calls=50, repeats=3) < 1e4
    assert overhead.median_ms(lambda: None, iters=3) >= 0


def test_step_breakdown_arithmetic():
    row = overhead.step_breakdown("x", measured_ms=10.0, num_ops=1000, op_us=4.0, bytes_moved=2e9,
                                  bandwidth_gbs=100)
    assert row["overhead_ms"] == 4.0 and row["memory_ms"] == 20.0
    assert row["predicted_ms"] == 24.0 and row["rest_ms"] == -14.0


def test_bucket_padding_matches_the_engines_bucket_choice():
    graphs = DecodeGraphs(lambda inp: torch.zeros(inp.num_tokens, 2), "stand_in", 40, max_blocks=2,
                          hidden_size=2, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    graphs.capture()
    batches = list(range(1, 46))
    assert overhead.bucket_padding(batches, graphs.buckets) == [(n, graphs.bucket_for(n)) for n in batches]


def test_figures_draw_the_numbers_given():
    batches, buckets = [6, 6, 5, 3, 1, 9], [1, 2, 4, 8]
    ax = overhead.plot_bucket_padding(batches, buckets)
    heights = [p.get_height() for p in ax.patches]
    assert heights == [6, 6, 5, 3, 1, 9] + [2, 2, 3, 1, 0, 0]  # real rows, then padding (9: eager, none)
    plt.close("all")
    rows = [overhead.step_breakdown(f"c{i}", 5.0 * (i + 1), 100 * (i + 1), 3.0, 1e8, 10) for i in range(3)]
    ax = overhead.plot_step_breakdown(rows)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["c0", "c1", "c2"]
    assert len(ax.patches) == 9  # overhead, memory and measured bars per row
    plt.close("all")
