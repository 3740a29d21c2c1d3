"""nanoengine.viz.overlap (chapter 06): a step's spans, a run's summary and the timeline's bars, on hand-made
StepStats whose every span is known, and the spans of real tiny-qwen3 runs with overlap off and on (what
holds whatever the timing: a forward inside its own launch without overlap, forwards in launch order with
it)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from nanoengine import LLM, SamplingParams  # noqa: E402
from nanoengine.trace import StepStats  # noqa: E402
from nanoengine.viz.overlap import COLORS, overlap_summary, plot_overlap_timeline, step_spans  # noqa: E402

pytestmark = pytest.mark.xdist_group("tiny")
MS = 1e-3


def stats(started, finishing, time, wait, fs, fe, handoff=0.5, advance=0.5, late=0) -> StepStats:
    """A decode step of 4 sequences (times in ms) that schedules 1 ms, builds 1 ms, hands off `handoff` ms
    (plus the wait), advances `advance` ms and finishes in (time - finishing - wait) ms."""
    post = advance + (time - finishing - wait)
    return StepStats(num_seqs=4, prefill_tokens=0, decode_tokens=4, used_blocks=4, num_blocks=16,
                     cache_hit_tokens=0, num_preempted=0, schedule_s=1 * MS, prepare_s=1 * MS,
                     forward_s=(handoff + wait) * MS, postprocess_s=post * MS, time=time * MS,
                     wait_s=wait * MS, started=started * MS, finishing=finishing * MS,
                     forward_start=None if fs is None else fs * MS,
                     forward_end=None if fe is None else fe * MS,
                     late_rows=late)


def without_overlap(n: int = 6) -> list[StepStats]:
    # step i: launch [10i, 10i+2] + the forward on the host's thread [10i+2, 10i+8] + [10i+8, 10i+9], finish
    # [10i+9, 10i+10] with nothing to wait for
    return [stats(10 * i, 10 * i + 9, 10 * i + 10, 0, 10 * i + 2, 10 * i + 8, handoff=6.5) for i in range(n)]


def with_overlap(n: int = 6, seen: bool = True) -> list[StepStats]:
    # step i: launched [10i-8, 10i-5] during forward i-1; forward [10i, 10i+9.9]; the host waits for it from
    # 10i+5 (after launching step i+1) to 10i+10, then finishes [10i+10, 10i+11], during forward i+1
    return [stats(10 * i - 8, 10 * i + 5, 10 * i + 11, 5, 10 * i if seen else None,
                  10 * i + 9.9 if seen else None, late=i % 2) for i in range(n)]


def spans_ms(s: StepStats) -> list[tuple]:
    return [(sp.row, sp.phase, round(sp.start / MS, 6), round(sp.end / MS, 6)) for sp in step_spans(s)]


def test_step_spans_cut_a_forward_run_on_the_hosts_thread_out_of_the_launch():
    assert spans_ms(without_overlap()[1]) == [("host", "launch", 10, 12), ("host", "launch", 18, 19),
                                              ("host", "finish", 19, 20), ("forward", "forward", 12, 18)]
    assert spans_ms(with_overlap()[1]) == [("host", "launch", 2, 5), ("host", "wait", 15, 20),
                                           ("host", "finish", 20, 21), ("forward", "forward", 10, 19.9)]
    assert [sp[1] for sp in spans_ms(with_overlap(seen=False)[1])] == ["launch", "wait", "finish"]


def test_summary_of_known_runs():
    off, on = overlap_summary(without_overlap(4)), overlap_summary(with_overlap(4))
    assert off == {"steps": 4, "step_ms": pytest.approx(10), "host_ms": pytest.approx(4), "hidden": 0.0,
                   "forward_ms": pytest.approx(6), "gap_ms": pytest.approx(4), "late_rows": 0}
    # all host work lies under a forward, but the first launch (before any forward) and the last finish
    # (after the last): 3 + 1 of 4 x 4 ms
    assert on == {"steps": 4, "step_ms": pytest.approx(10), "host_ms": pytest.approx(4),
                  "hidden": pytest.approx(12 / 16), "forward_ms": pytest.approx(9.9),
                  "gap_ms": pytest.approx(0.1), "late_rows": 2}
    cuda = overlap_summary(with_overlap(4, seen=False))
    assert cuda["gap_ms"] is None and cuda["forward_ms"] is None and cuda["hidden"] == 0.0


def bars(ax) -> list[tuple[str, float, float]]:
    return sorted((to_hex(p.get_facecolor()), round(p.get_x(), 6), round(p.get_width(), 6))
                  for p in ax.patches)


def test_timeline_draws_the_spans_in_view():
    fig = plot_overlap_timeline({"off": without_overlap(), "on": with_overlap()}, steps=4, zoom_ms=2)
    main, zoom = fig.axes
    # view: steps 1..4. Off, from forward 1's start (12 ms) to forward 4's end (48): 3 + 4 + 4 + 2 bars; on,
    # from 10 to 49.9, with the neighbours' spans that reach into it: 1 + 3 + 4 + 4 + 3 + 1
    assert len(main.patches) == 13 + 16
    assert [t.get_text() for t in main.texts] == ["1", "2", "3", "4"] * 2  # the forwards wholly in view
    forward = to_hex(COLORS["forward"])
    assert [b for b in bars(main) if b[0] == forward][:4] == [(forward, 0.0, 6.0), (forward, 0.0, 9.9),
                                                              (forward, 10.0, 6.0), (forward, 10.0, 9.9)]
    # the zoom: off at forward 3's end (38 ms): its last 0.4 ms, the launch's tail, the finish's first 0.6;
    # on at 39.9: forward 3, its wait and finish, forward 4
    assert len(zoom.patches) == 3 + 4
    assert [t.get_text() for t in main.get_yticklabels()] == ["off\nhost", "off\nforward", "on\nhost",
                                                              "on\nforward"]
    assert "CUDA" not in fig._suptitle.get_text()
    plt.close(fig)


def test_timeline_without_forward_spans_says_so():
    fig = plot_overlap_timeline({"cuda": with_overlap(seen=False)}, steps=4, zoom_ms=2)
    assert "CUDA" in fig._suptitle.get_text()
    assert fig.axes[0].patches and not fig.axes[0].texts
    assert to_hex(COLORS["forward"]) not in {b[0] for b in bars(fig.axes[0])}
    plt.close(fig)
    with pytest.raises(ValueError, match="at least one run"):
        plot_overlap_timeline({})


def test_real_runs_spans():
    prompts = ["Hello", "1, 2, 3,", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for on in (False, True):
        llm = LLM("tiny-qwen3", async_scheduling=on, dtype="float32", max_num_seqs=4, num_kvcache_blocks=16)
        llm.generate(prompts, params, use_tqdm=False)
        runs[on] = list(llm.engine.stats)
        assert len(runs[on]) == 6 and all(s.forward_start is not None for s in runs[on])
    # without overlap each forward runs inside its own launch, on the host's thread: none of the host's own
    # work is done beside a forward
    for s in runs[False]:
        assert [sp.phase for sp in step_spans(s)][:2] == ["launch", "launch"]
    assert overlap_summary(runs[False])["hidden"] == pytest.approx(0, abs=1e-9)
    # with it the forwards run on one thread in launch order, each after its launch began and before the
    # host finished its step
    for a, b in zip(runs[True], runs[True][1:]):
        assert a.forward_end <= b.forward_start
    for s in runs[True]:
        assert s.started <= s.forward_start and s.forward_end <= s.time
    fig = plot_overlap_timeline({str(on): stats for on, stats in runs.items()}, steps=3)
    assert len(fig.axes[0].texts) == 2 * 3
    plt.close(fig)
