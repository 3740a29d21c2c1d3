"""Where a decode step's time goes, measured on the machine at hand, and what the graph buckets pad.
Chapter 06.

- `count_ops(fn)`: the aten ops a call dispatches, by name (a TorchDispatchMode that counts and runs each op);
- `per_op_us()`: the host's cost of dispatching one tiny op (a 1-element add), median over many calls;
- `median_ms(fn)`: the median wall time of a call;
- `step_breakdown(...)`: one configuration's measured step next to the two costs that predict it: ops x per-op
  cost (dispatch overhead) and bytes / bandwidth (memory);
- `plot_step_breakdown(rows)`: those rows as stacked bars beside the measured time;
- `bucket_padding(batches, buckets)` / `plot_bucket_padding(...)`: the rows each decode step of a real run
  computed for nothing, padded up to its graph bucket.
Figures are built only from the numbers passed in (a real run's measurements and trace); the engine never
imports this module.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from torch.utils._python_dispatch import TorchDispatchMode


class _Counting(TorchDispatchMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> Counter[str]:
    """The aten ops that `fn()` dispatches, by name ("add", "linear", "view", ...). A pybind11 extension call
    (nanoengine's CPU kernels) is not an aten op: only the aten ops it calls itself are counted."""
    counts: Counter[str] = Counter()
    with _Counting(counts):
        fn()
    return counts


def median_ms(fn: Callable[[], Any], iters: int = 7, warmup: int = 1) -> float:
    """Median milliseconds of fn() over `iters` calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def per_op_us(calls: int = 2000, repeats: int = 5) -> float:
    """Microseconds the host spends on one tiny op (a 1-element add: no arithmetic to speak of), median of
    `repeats` loops of `calls` ops: Python, the dispatcher, allocating the output."""
    a, b = torch.ones(1), torch.ones(1)

    def loop() -> None:
        for _ in range(calls):
            torch.add(a, b)

    return median_ms(loop, iters=repeats) * 1e3 / calls


def step_breakdown(name: str, measured_ms: float, num_ops: int, op_us: float, bytes_moved: float,
                   bandwidth_gbs: float) -> dict[str, Any]:
    """One configuration's row: measured step time, dispatch overhead (ops x per-op cost), memory time
    (bytes / bandwidth), their sum, and the rest (measured - predicted: arithmetic, kernels' own work,
    noise)."""
    overhead_ms = num_ops * op_us / 1e3
    memory_ms = bytes_moved / (bandwidth_gbs * 1e9) * 1e3
    return {"name": name, "measured_ms": measured_ms, "num_ops": num_ops, "overhead_ms": overhead_ms,
            "memory_ms": memory_ms, "predicted_ms": overhead_ms + memory_ms,
            "rest_ms": measured_ms - overhead_ms - memory_ms}


def plot_step_breakdown(rows: Sequence[dict[str, Any]], ax: Axes | None = None) -> Axes:
    """Per configuration: the predicted costs stacked (dispatch overhead, memory) and the measured step beside
    them, in ms on a log axis (a tiny model's step and a real one's differ by orders of magnitude)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.2))
    y = range(len(rows))
    over = [r["overhead_ms"] for r in rows]
    mem = [r["memory_ms"] for r in rows]
    ax.barh([i + 0.18 for i in y], over, height=0.34, color="#E45756", label="ops x per-op cost")
    ax.barh([i + 0.18 for i in y], mem, left=over, height=0.34, color="#4C78A8", label="bytes / bandwidth")
    ax.barh([i - 0.18 for i in y], [r["measured_ms"] for r in rows], height=0.34, color="#999999",
            label="measured")
    for i, r in enumerate(rows):
        ax.text(r["measured_ms"], i - 0.18, f" {r['measured_ms']:.1f} ms", va="center", fontsize=8)
        ax.text(r["predicted_ms"], i + 0.18, f" {r['predicted_ms']:.1f} ms ({r['num_ops']} ops)", va="center",
                fontsize=8)
    ax.set_yticks(list(y), [r["name"] for r in rows], fontsize=8)
    ax.set_xscale("log")
    smallest = min(v for r in rows for v in (r["overhead_ms"], r["measured_ms"]) if v > 0)
    ax.set_xlim(smallest / 2, 3 * max(max(r["measured_ms"], r["predicted_ms"]) for r in rows))
    ax.set_xlabel("one decode step (ms, log scale)")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, frameon=False)
    return ax


def bucket_padding(batches: Sequence[int], buckets: Sequence[int]) -> list[tuple[int, int | None]]:
    """(batch, bucket it replays) for each decode step's batch size;
    None: larger than every bucket (eager)."""
    ordered = sorted(buckets)
    return [(n, next((b for b in ordered if b >= n), None)) for n in batches]


def plot_bucket_padding(batches: Sequence[int], buckets: Sequence[int], ax: Axes | None = None) -> Axes:
    """One bar per decode step of a run: its real rows, and on top the padding rows up to its bucket."""
    pairs = bucket_padding(batches, buckets)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.6))
    steps = range(len(pairs))
    real = [n for n, _ in pairs]
    pad = [(b - n) if b is not None else 0 for n, b in pairs]
    ax.bar(steps, real, color="#4C78A8", width=1.0, label="rows of real sequences")
    ax.bar(steps, pad, bottom=real, color="#F2B701", width=1.0, label="padding rows (slot -1, context 0)")
    for b in sorted(set(buckets)):
        if b <= max(real + [1]) * 2:
            ax.axhline(b, color="#bbbbbb", lw=0.6, ls=":", zorder=0)
    total = sum(b for _, b in pairs if b is not None)
    ax.set_title(f"{len(pairs)} decode steps: {sum(pad)} of {total} replayed rows are padding "
                 f"({sum(pad) / max(total, 1):.0%}); dotted lines are the buckets", fontsize=9)
    ax.set_xlabel("decode step")
    ax.set_ylabel("rows")
    ax.legend(fontsize=8)
    return ax
