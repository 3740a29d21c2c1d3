"""See the engine: widgets and figures built only from a run's trace. Chapters 03 to 08.

    from nanoengine.viz import show_timeline
    show_timeline(llm.trace)   # slider + play: block table, batch bars, KV usage and hit rate, linked
    ScheduleExplorer({(budget, blocks): trace, ...})   # chapter 05: the same requests under other settings

`state` computes plain data from a `RunTrace`; `static` draws it with matplotlib; `html` and `widgets` draw
it as ipywidgets. The engine never imports this package.
"""

from nanoengine.viz.state import (
    BatchCompositionState,
    BlockCell,
    BlockTableState,
    KVUsageState,
    batch_composition_state,
    block_table_state,
    block_table_states,
    kv_usage_state,
    seq_colors,
)
from nanoengine.viz.state_prefix import PrefixTreeState, prefix_tree_state
from nanoengine.viz.state_timeline import request_timeline_state, run_summary
from nanoengine.viz.static import plot_batch_composition, plot_block_table, plot_kv_usage, plot_prefix_tree

WIDGETS = ("BatchCompositionView", "BlockTableView", "KVUsageView", "PrefixTreeView", "ScheduleExplorer",
           "StepTimeline", "show_timeline")


def __getattr__(name: str):
    """The ipywidgets views load on first use, so that what only draws (the benchmark's plots, on a machine
    without ipywidgets) imports this package without them."""
    if name in WIDGETS:
        from nanoengine.viz import widgets

        return getattr(widgets, name)
    raise AttributeError(f"module 'nanoengine.viz' has no attribute {name!r}")

__all__ = [
    "BatchCompositionState", "BlockCell", "BlockTableState", "KVUsageState", "PrefixTreeState",
    "batch_composition_state", "block_table_state", "block_table_states", "kv_usage_state",
    "prefix_tree_state",
    "request_timeline_state", "run_summary", "seq_colors",
    "plot_batch_composition", "plot_block_table", "plot_kv_usage", "plot_prefix_tree",
    "BatchCompositionView", "BlockTableView", "KVUsageView", "PrefixTreeView", "ScheduleExplorer",
    "StepTimeline", "show_timeline",
]
