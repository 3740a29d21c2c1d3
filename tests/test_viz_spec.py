"""nanoengine.viz.spec (chapter 09): the per-step sums of a verification record, counted by hand, and the
figure drawn from them."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from nanoengine.spec.verify import Verification  # noqa: E402
from nanoengine.viz.spec import plot_spec_steps, spec_steps  # noqa: E402

RECORD = [Verification(2, 0, 3, 3, 4), Verification(2, 1, 3, 0, 1), Verification(5, 0, 2, 1, 2),
          (7, 4, 0, 0, 1), Verification(8, 4, 3, 2, 2)]  # (the last: a stop string ended it at its 2nd token)


def test_spec_steps_sum_by_step():
    data = spec_steps(RECORD)
    assert data.steps == [2, 5, 7, 8]
    assert data.accepted == [3, 1, 0, 2] and data.rejected == [3, 1, 0, 1]
    assert data.tokens == [5, 2, 1, 2]
    assert data.acceptance_rate == 6 / 11
    assert spec_steps([]).acceptance_rate == 0.0


def test_plot_stacks_accepted_under_rejected():
    ax = plot_spec_steps(RECORD)
    accepted, rejected = ax.containers
    assert [b.get_height() for b in accepted] == [3, 1, 0, 2]
    assert [b.get_y() for b in rejected] == [3, 1, 0, 2]
    assert [b.get_height() for b in rejected] == [3, 1, 0, 1]
    assert "55% of drafts accepted" in ax.get_title()
    plt.close(ax.figure)
