"""ipywidgets views of a recorded run: block table, batch composition, KV usage, prefix tree, step timeline,
and the schedule explorer (several runs of the same requests). Chapters 03 (block table), 04 (prefix tree),
05 (batch composition, schedule explorer) and the timeline used from 03 on.

    from nanoengine.viz import show_timeline
    show_timeline(llm.trace)

Each view keeps its `state` (a dataclass from `nanoengine.viz.state`) and draws it as HTML/SVG in plain
`ipywidgets.HTML` children, so it runs in JupyterLab with a plain kernel and in headless tests. Steps move
through the Python-side `step` trait (slider and play button are linked to it).
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import traitlets

from nanoengine.trace import RunTrace
from nanoengine.viz import html
from nanoengine.viz.state import (
    BatchCompositionState,
    BlockCell,
    BlockTableState,
    KVUsageState,
    batch_composition_state,
    block_table_states,
    check_step,
    check_trace,
    kv_usage_state,
    short_text,
)
from nanoengine.viz.state_prefix import PrefixTreeState, prefix_tree_state
from nanoengine.viz.state_timeline import request_timeline_state, run_summary


class _StepView(widgets.VBox):
    """A VBox with a validated `step` trait (negative steps count from the end)."""

    step = traitlets.Int(0)

    def _init_steps(self, trace: RunTrace) -> None:
        self.trace = check_trace(trace)
        self.num_steps = len(self.trace.steps)
        super().__init__()

    @traitlets.validate("step")
    def _valid_step(self, proposal):
        return check_step(self.trace, proposal["value"])

    def _slider(self) -> widgets.IntSlider:
        slider = widgets.IntSlider(value=self.step, min=0, max=self.num_steps - 1, description="step",
                                   continuous_update=True, layout=widgets.Layout(width="480px"))
        widgets.link((slider, "value"), (self, "step"))
        return slider


class BlockTableView(_StepView):
    """The KV pool after one step: blocks coloured by owner, shared blocks with their ref count, cached-free
    blocks hatched, each running sequence's block table beside it; hover a block, or pick one, for its hash
    and tokens. `view.step = k` moves it; `view.state` is what it shows."""

    selected_block = traitlets.Int(-1)

    def __init__(self, trace: RunTrace, step: int = 0, tokenizer: Any = None, slider: bool = True) -> None:
        self._init_steps(trace)
        self.states: list[BlockTableState] = block_table_states(self.trace)
        self.tokenizer = tokenizer
        self._summary, self._grid = widgets.HTML(), widgets.HTML()
        self._tables, self._detail = widgets.HTML(), widgets.HTML()
        picker = widgets.Dropdown(options=[("(none)", -1)] + [(f"block {b}", b) for b in
                                                              range(self.states[0].num_blocks)],
                                  value=-1, description="block", layout=widgets.Layout(width="180px"))
        widgets.link((picker, "value"), (self, "selected_block"))
        top = [self._slider()] if slider else []
        self.children = [*top, self._summary,
                         widgets.HBox([self._grid, self._tables],
                                      layout=widgets.Layout(grid_gap="24px", align_items="flex-start")),
                         widgets.HBox([picker, self._detail], layout=widgets.Layout(grid_gap="12px"))]
        self.step = step
        self.observe(lambda _: self.redraw(), names=["step", "selected_block"])
        self.redraw()

    @property
    def state(self) -> BlockTableState:
        return self.states[self.step]

    @property
    def cells(self) -> list[BlockCell]:
        return self.state.cells

    @property
    def colors(self) -> list[str]:
        return self.state.colors

    @property
    def ref_counts(self) -> dict[int, int]:
        return self.state.ref_counts

    def redraw(self) -> None:
        st = self.state
        self._summary.value = html.step_summary_html(st)
        self._grid.value = html.block_grid_svg(st, self.tokenizer, self.selected_block)
        self._tables.value = html.block_tables_html(st)
        self._detail.value = html.block_detail_html(st, self.selected_block, self.tokenizer)


class BatchCompositionView(_StepView):
    """One stacked bar per step (prefill and decode tokens per sequence) against the token budget, with
    preemptions (✕) and finishes (▼); the current `step` is highlighted and described below the chart."""

    def __init__(self, trace: RunTrace, step: int = 0, slider: bool = False) -> None:
        self._init_steps(trace)
        self.state: BatchCompositionState = batch_composition_state(self.trace)
        self._chart, self._info = widgets.HTML(), widgets.HTML()
        top = [self._slider()] if slider else []
        self.children = [*top, self._chart, self._info]
        self.step = step
        self.observe(lambda _: self.redraw(), names="step")
        self.redraw()

    def redraw(self) -> None:
        st, s = self.state, self.step
        self._chart.value = html.batch_svg(st, s)
        self._info.value = html.batch_step_html(st, s)


class KVUsageView(_StepView):
    """Share of the KV pool in use and cached-but-free, and the cumulative prefix-cache hit rate."""

    def __init__(self, trace: RunTrace, step: int = 0) -> None:
        self._init_steps(trace)
        self.state: KVUsageState = kv_usage_state(self.trace)
        self._chart = widgets.HTML()
        self.children = [self._chart]
        self.step = step
        self.observe(lambda _: self.redraw(), names="step")
        self.redraw()

    def redraw(self) -> None:
        self._chart.value = html.kv_svg(self.state, self.step)


class PrefixTreeView(widgets.VBox):
    """Requests as paths over shared full blocks (a trie of prompt prefixes); green blocks were reused from
    the prefix cache, red ones only computed. Pick a request to outline its path and list its blocks."""

    selected_seq = traitlets.Int(-1)

    def __init__(self, trace: RunTrace, tokenizer: Any = None) -> None:
        super().__init__()
        self.trace = check_trace(trace)
        self.tokenizer = tokenizer
        self.state: PrefixTreeState = prefix_tree_state(self.trace)
        self._chart, self._info = widgets.HTML(), widgets.HTML()
        picker = widgets.Dropdown(options=[("(none)", -1)] + [(f"seq {lf.seq_id}", lf.seq_id)
                                                              for lf in self.state.leaves],
                                  value=-1, description="request")
        widgets.link((picker, "value"), (self, "selected_seq"))
        st = self.state
        rate = st.hit_tokens / st.prompt_tokens if st.prompt_tokens else 0.0
        summary = widgets.HTML(f"<div style='{html.FONT}'>{len(st.leaves)} requests over {len(st.nodes) - 1} "
                               f"distinct full blocks of {st.block_size} tokens; {st.hit_tokens} of "
                               f"{st.prompt_tokens} prompt tokens came from the prefix cache "
                               f"({rate:.0%})</div>")
        self.children = [summary, picker, self._chart, self._info]
        self.observe(lambda _: self.redraw(), names="selected_seq")
        self.redraw()

    def redraw(self) -> None:
        sel = self.selected_seq if self.selected_seq >= 0 else None
        self._chart.value = html.prefix_tree_svg(self.state, self.tokenizer, sel)
        if sel is None:
            self._info.value = ""
            return
        rows = [f"block {n.depth - 1}: {n.hits} hit / {n.misses} miss, physical {n.block_ids}: "
                f"{short_text(self.tokenizer, n.tokens, 60)}" for n in self.state.path(sel)]
        leaf = next(lf for lf in self.state.leaves if lf.seq_id == sel)
        rows.append(f"+ {leaf.tail_tokens} tokens in a partial block (never cached until full)")
        self._info.value = f"<div style='{html.FONT}'>" + "<br>".join(html.escape(r) for r in rows) + "</div>"


class StepTimeline(_StepView):
    """Scrub or play through a recorded run: the block table, the batch bars and the KV usage / hit rate
    move together with the step slider."""

    def __init__(self, trace: RunTrace, tokenizer: Any = None, step: int = 0, interval: int = 600) -> None:
        self._init_steps(trace)
        self.blocks = BlockTableView(self.trace, step, tokenizer, slider=False)
        self.batch = BatchCompositionView(self.trace, step)
        self.kv = KVUsageView(self.trace, step)
        self.play = widgets.Play(value=0, min=0, max=self.num_steps - 1, interval=interval,
                                 description="play")
        slider = self._slider()
        widgets.link((self.play, "value"), (slider, "value"))
        for view in (self.blocks, self.batch, self.kv):
            widgets.dlink((self, "step"), (view, "step"))
        title = widgets.HTML(f"<div style='{html.FONT}'><b>Engine run</b>: {self.num_steps} steps, "
                             f"{len(self.trace.prompts)} sequences, {self.blocks.state.num_blocks} KV blocks "
                             f"of {self.trace.block_size} tokens, budget {self.trace.max_num_batched_tokens} "
                             "tokens/step</div>")
        self.children = [title, widgets.HBox([self.play, slider]), self.blocks,
                         widgets.HTML(f"<div style='{html.FONT}'><b>batch composition</b></div>"), self.batch,
                         widgets.HTML(f"<div style='{html.FONT}'><b>KV usage and hit rate</b></div>"),
                         self.kv]
        self.step = step


class ScheduleExplorer(widgets.VBox):
    """The same requests run under several scheduler settings: pick the token budget and the KV pool size with
    the sliders, and scrub the steps of that run. Shows the run's totals, the batch composition (tokens per
    sequence per step, against the budget) and one lane per request (waiting, prefill, decode, preempted).

    `runs` maps (max_num_batched_tokens, num_kvcache_blocks) to the RunTrace of a real run; every view is
    computed once up front, so moving a slider only swaps drawings."""

    step = traitlets.Int(0)

    def __init__(self, runs: dict[tuple[int, int], RunTrace], budget: int | None = None,
                 num_blocks: int | None = None, step: int = 0) -> None:
        super().__init__()
        if not runs:
            raise ValueError("ScheduleExplorer needs at least one run: "
                             "{(budget, num_blocks): llm.trace, ...}")
        self.runs = {key: check_trace(t) for key, t in runs.items()}
        self.budgets = sorted({b for b, _ in self.runs})
        self.pools = sorted({p for _, p in self.runs})
        missing = [(b, p) for b in self.budgets for p in self.pools if (b, p) not in self.runs]
        if missing:
            raise ValueError("ScheduleExplorer needs a run for every budget and pool size; "
                             f"missing {missing}")
        self.batch_states = {k: batch_composition_state(t) for k, t in self.runs.items()}
        self.lane_states = {k: request_timeline_state(t) for k, t in self.runs.items()}
        self.summaries = {k: run_summary(t) for k, t in self.runs.items()}
        self.budget_slider = widgets.SelectionSlider(options=self.budgets, value=budget or self.budgets[0],
                                                     description="token budget",
                                                     layout=widgets.Layout(width="420px"))
        self.pool_slider = widgets.SelectionSlider(options=self.pools, value=num_blocks or self.pools[0],
                                                   description="KV blocks",
                                                   layout=widgets.Layout(width="420px"))
        self.step_slider = widgets.IntSlider(min=0, max=0, description="step",
                                             layout=widgets.Layout(width="640px"))
        widgets.link((self.step_slider, "value"), (self, "step"))
        self._summary, self._batch, self._info, self._lanes = (widgets.HTML() for _ in range(4))
        self.children = [self.budget_slider, self.pool_slider, self._summary, self.step_slider, self._batch,
                         self._info, self._lanes]
        self.budget_slider.observe(lambda _: self._pick_run(), names="value")
        self.pool_slider.observe(lambda _: self._pick_run(), names="value")
        self.observe(lambda _: self.redraw(), names="step")
        self._pick_run(step)

    @property
    def key(self) -> tuple[int, int]:
        return (self.budget_slider.value, self.pool_slider.value)

    @property
    def trace(self) -> RunTrace:
        return self.runs[self.key]

    def _pick_run(self, step: int | None = None) -> None:
        n = len(self.trace.steps)
        target = min(self.step if step is None else step, n - 1)
        with self.hold_trait_notifications():
            self.step_slider.max = n - 1
        self.step = check_step(self.trace, target)
        sm, t = self.summaries[self.key], self.trace
        self._summary.value = html.run_summary_html(sm, self.key[0], self.key[1], t.block_size)
        self.redraw()

    @traitlets.validate("step")
    def _valid_step(self, proposal):
        return check_step(self.trace, proposal["value"])

    def redraw(self) -> None:
        st, s = self.batch_states[self.key], self.step
        self._batch.value = html.batch_svg(st, s)
        self._lanes.value = html.request_lanes_svg(self.lane_states[self.key], s)
        self._info.value = html.batch_step_html(st, s)


def show_timeline(trace: RunTrace, tokenizer: Any = None, step: int = 0, interval: int = 600) -> StepTimeline:
    """The step timeline widget for `llm.trace` (LLM(..., trace=True) then generate())."""
    return StepTimeline(trace, tokenizer=tokenizer, step=step, interval=interval)
