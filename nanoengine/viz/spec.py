"""Speculative decoding, per step: how many drafts the model accepted and rejected. Chapter 09.

- `spec_steps(record)`: from an engine's `spec_counts.record` (one (step, seq_id, proposed, accepted, tokens)
  per verification, nanoengine.spec.verify.Verification), per engine step the drafts accepted, rejected and
  the tokens the verifications appended (the accepted drafts and the model's own token);
- `plot_spec_steps(record)`: those as stacked bars (accepted below, rejected above), with the step's tokens.
Built only from the record passed in; the engine never imports this module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.axes import Axes


@dataclass
class SpecSteps:
    """Per engine step with at least one verification (parallel lists, in step order)."""
    steps: list[int]
    accepted: list[int]
    rejected: list[int]
    tokens: list[int]  # appended by the step's verifications

    @property
    def acceptance_rate(self) -> float:
        proposed = sum(self.accepted) + sum(self.rejected)
        return sum(self.accepted) / proposed if proposed else 0.0


def spec_steps(record: Iterable[tuple[int, int, int, int, int]]) -> SpecSteps:
    """Sum a verification record by step: each entry is (step, seq_id, proposed, accepted, tokens)."""
    by_step: dict[int, list[int]] = {}
    for step, _seq_id, proposed, accepted, tokens in record:
        row = by_step.setdefault(step, [0, 0, 0])
        row[0] += accepted
        row[1] += proposed - accepted
        row[2] += tokens
    steps = sorted(by_step)
    return SpecSteps(steps, [by_step[s][0] for s in steps], [by_step[s][1] for s in steps],
                     [by_step[s][2] for s in steps])


def plot_spec_steps(record: Iterable[tuple[int, int, int, int, int]], ax: Axes | None = None,
                    title: str | None = None) -> Axes:
    """Stacked bars per engine step: drafts accepted (green) and rejected (grey); a dot marks the tokens the
    step's verifications appended."""
    data = spec_steps(record)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3))
    ax.bar(data.steps, data.accepted, color="#4caf50", label="drafts accepted")
    ax.bar(data.steps, data.rejected, bottom=data.accepted, color="#bdbdbd", label="drafts rejected")
    ax.plot(data.steps, data.tokens, "k.", label="tokens appended")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens")
    ax.set_title(title or f"speculative decoding: {data.acceptance_rate:.0%} of drafts accepted")
    ax.legend(loc="upper right", fontsize=8)
    return ax
