"""The chapter 05 views against real engine runs: the request lanes and run totals say what the trace says,
and ScheduleExplorer's sliders switch between real runs of the same requests."""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET

import pytest

from nanoengine.viz import ScheduleExplorer, request_timeline_state, run_summary
from nanoengine.viz import html as vhtml


@pytest.fixture(scope="module")
def runs(tiny_qwen3_path):
    from nanoengine import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(20, 80))] for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(6, 20), ignore_eos=True) for _ in prompts]
    out = {}
    for budget, blocks in [(16, 10), (64, 10), (16, 40), (64, 40)]:
        llm = LLM("tiny-qwen3", trace=True, block_size=16, num_kvcache_blocks=blocks,
                  max_num_batched_tokens=budget, max_num_seqs=4)
        llm.generate(prompts, params, use_tqdm=False)
        out[budget, blocks] = llm.trace
    assert any(s.preempted for s in out[16, 10].steps), (
        "the small pool must preempt: shrink num_kvcache_blocks")
    assert not any(s.preempted for s in out[64, 40].steps)
    return prompts, params, out


def test_lanes_follow_the_trace(runs):
    prompts, params, traces = runs
    for trace in traces.values():
        st = request_timeline_state(trace)
        assert sorted(st.seq_ids) == sorted(trace.prompts)
        for s in trace.steps:
            for e in s.scheduled:
                kind = "prefill" if e.prefill_tokens else "decode"
                assert st.kinds[e.seq_id][s.step] == kind
                assert st.tokens[e.seq_id][s.step] == e.prefill_tokens + e.decode_tokens
            for sid in s.preempted:
                assert st.kinds[sid][s.step] == "preempted"
        for sid, p in zip(sorted(trace.prompts), params):
            kinds = st.kinds[sid]
            # the first token comes with the last prefill chunk
            assert kinds.count("decode") == p.max_tokens - 1
            assert all(k == "done" for k in kinds[st.finished_step[sid] + 1:])


def test_run_summary_counts(runs):
    prompts, params, traces = runs
    for (budget, _), trace in traces.items():
        sm = run_summary(trace)
        assert sm.steps == len(trace.steps) and sm.budget == budget
        assert sm.preemptions == sum(len(s.preempted) for s in trace.steps)
        assert sm.computed_tokens == sum(s.num_batched_tokens for s in trace.steps)
        if not sm.preemptions:  # no recompute: every prompt once, minus its prefix hits, and every decode
            assert sm.recomputed_tokens == 0
    assert run_summary(traces[16, 10]).recomputed_tokens > 0
    assert run_summary(traces[16, 40]).chunked_steps > run_summary(traces[64, 40]).chunked_steps


def test_explorer_sliders_switch_runs(runs):
    _, _, traces = runs
    view = ScheduleExplorer(traces, budget=16, num_blocks=10, step=3)
    first = (view._summary.value, view._batch.value, view._lanes.value)
    assert view.step == 3 and view.step_slider.max == len(traces[16, 10].steps) - 1
    view.pool_slider.value = 40
    assert view.trace is traces[16, 40] and view.step_slider.max == len(traces[16, 40].steps) - 1
    assert view._summary.value != first[0] and view._lanes.value != first[2]
    view.budget_slider.value = 64
    view.step = len(traces[64, 40].steps) - 1
    assert "step" in view._info.value
    view.budget_slider.value, view.pool_slider.value = 16, 10
    assert view.step <= len(traces[16, 10].steps) - 1
    for svg in (vhtml.request_lanes_svg(view.lane_states[16, 10], 2),
                vhtml.batch_svg(view.batch_states[16, 10], 2)):
        ET.fromstring(svg)  # well-formed
    with pytest.raises(ValueError, match="missing"):
        ScheduleExplorer({k: v for k, v in traces.items() if k != (64, 40)})
