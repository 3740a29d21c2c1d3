"""Static matplotlib renderings of the views: for `figures/`, for CI, and for readers without a kernel.
Chapters 03 (block table), 04 (prefix tree), 05 (batch composition, KV usage).

Each `plot_*` draws the state computed in `nanoengine.viz.state` onto an Axes (a new figure when `ax` is
None) and returns the Axes; the widgets draw the very same state as HTML.
"""

from __future__ import annotations

import math
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from nanoengine.trace import RunTrace
from nanoengine.viz.state import (
    CACHED,
    CACHED_COLOR,
    CACHED_EDGE_COLOR,
    FINISH_COLOR,
    FREE,
    FREE_COLOR,
    HIT_COLOR,
    HIT_RATE_COLOR,
    KV_CACHED_COLOR,
    KV_USED_COLOR,
    MISS_COLOR,
    PREEMPT_COLOR,
    SHARED,
    STEP_COLOR,
    BlockTableState,
    batch_composition_state,
    block_table_state,
    grid_columns,
    ink,
    kv_usage_state,
    short_text,
)
from nanoengine.viz.state_prefix import prefix_tree_state


def _new_axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


# ------------------------------------------------------------------------------------------------ block table
def plot_block_table(trace: RunTrace, step: int, ax: Axes | None = None, ncols: int | None = None,
                     table_rows: int | None = None) -> Axes:
    """The KV pool after `step` as a grid of blocks coloured by owner, with every block table beside it.

    Shared blocks are striped with their owners' colours and marked with their ref count; cached-but-free
    blocks are hatched and keep their short hash; partly filled blocks are pale above their fill level.
    """
    return draw_block_table(block_table_state(trace, step), ax=ax, ncols=ncols, table_rows=table_rows)


def draw_block_table(st: BlockTableState, ax: Axes | None = None, ncols: int | None = None,
                     table_rows: int | None = None) -> Axes:
    """Draw a BlockTableState; `table_rows` reserves room for that many block tables (same layout over
    steps)."""
    n = st.num_blocks
    ncols = ncols or grid_columns(n)
    nrows = math.ceil(n / ncols)
    small = n > 64
    longest = max((len(t) for t in st.tables.values()), default=0)
    table_w = 0 if small else 2.2 + 0.55 * max(longest, 3)
    rows_y = [] if small else [0.55 - 0.62 * max(len(st.tables), table_rows or 1, 1) + 0.3]
    bottom = min([-(nrows - 1), *rows_y])  # lowest grid row or block-table row
    ax = _new_axes(ax, (max(6.0, 0.62 * (ncols + table_w) + 0.5), 0.62 * (2.55 - bottom) + 0.5))
    pad = 0.06
    for c in st.cells:
        x, y = c.block_id % ncols, -(c.block_id // ncols)
        w = (1 - 2 * pad) / len(c.colors)
        for k, col in enumerate(c.colors):
            x0 = x + pad + k * w
            if c.status in (FREE, CACHED):
                ax.add_patch(Rectangle((x0, y + pad), w, 1 - 2 * pad, facecolor=col, edgecolor="none"))
            else:
                frac = c.fill / st.block_size
                h = (1 - 2 * pad) * frac
                ax.add_patch(Rectangle((x0, y + pad), w, h, facecolor=col, edgecolor="none"))
                ax.add_patch(Rectangle((x0, y + pad + h), w, 1 - 2 * pad - h, facecolor=col, alpha=0.3,
                                       edgecolor="none"))
        edge = dict(facecolor="none", edgecolor="#999999", linewidth=0.8)
        if c.status == CACHED:
            edge.update(hatch="....", edgecolor=CACHED_EDGE_COLOR, linestyle="--")
        elif c.status == SHARED:
            edge.update(edgecolor="black", linewidth=2.2)
        elif c.new:
            edge.update(edgecolor="#333333", linewidth=1.4)
        ax.add_patch(Rectangle((x + pad, y + pad), 1 - 2 * pad, 1 - 2 * pad, **edge))
        if small:
            continue
        text_color = ink(c.colors[-1]) if c.status not in (FREE, CACHED) and c.fill else "#333333"
        ax.text(x + 0.12, y + 0.86, str(c.block_id), fontsize=7, va="top", ha="left",
                color=(ink(c.colors[0]) if c.status not in (FREE, CACHED) and c.fill == st.block_size
                       else "#333333"))
        if c.status == SHARED:
            ax.text(x + 0.5, y + 0.42, f"×{c.ref_count}", fontsize=11, fontweight="bold", ha="center",
                    va="center", color="black",
                    bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8))
        if c.hash is not None:
            ax.text(x + 0.88, y + 0.12, f"#{c.hash:016x}"[:5], fontsize=5.5, ha="right", va="bottom",
                    color=text_color, family="monospace")
    # the block tables, one row per running sequence
    if not small:
        x0 = ncols + 0.6
        ax.text(x0, 1.15, "block tables (logical → physical)", fontsize=8, fontweight="bold", va="bottom")
        refs = st.ref_counts
        for r, (sid, table) in enumerate(st.tables.items()):
            y = 0.55 - r * 0.62
            col = st.seq_colors[sid]
            ax.add_patch(Rectangle((x0, y - 0.2), 0.4, 0.4, facecolor=col, edgecolor="none"))
            ax.text(x0 + 0.5, y, f"seq {sid}", fontsize=8, va="center")
            for i, b in enumerate(table):
                bx = x0 + 1.7 + 0.55 * i
                ax.add_patch(Rectangle((bx, y - 0.22), 0.5, 0.44, facecolor="white", edgecolor=col,
                                       linewidth=2.4 if refs.get(b, 0) > 1 else 1.2))
                ax.text(bx + 0.25, y, str(b), fontsize=7, ha="center", va="center")
            ax.text(x0 + 1.75 + 0.55 * len(table), y, f"{st.computed_tokens.get(sid, 0)} tok", fontsize=6.5,
                    va="center", color="#555555")
        if not st.tables:
            ax.text(x0, 0.55, "(no running sequences)", fontsize=8, color="#777777", va="center")
    events = []
    if st.preempted:
        events.append("preempted: " + ", ".join(f"seq {s}" for s in st.preempted))
    if st.finished:
        events.append("finished: " + ", ".join(f"seq {s}" for s in st.finished))
    hits = [f"seq {s} +{h}" for s, h in st.cache_hits if h]
    if hits:
        events.append("prefix hits: " + ", ".join(hits))
    ax.text(0, bottom - 0.1, "   ".join(events), fontsize=8, va="top",
            color=PREEMPT_COLOR if st.preempted else "#333333")
    ax.set_title(f"KV pool after step {st.step}: {st.num_used}/{n} blocks used, {st.num_cached} cached-free, "
                 f"{len(st.shared)} shared  (block size {st.block_size})", fontsize=9)
    handles = [Patch(facecolor="#888888", label="used (pale: unfilled slots)"),
               Patch(facecolor="white", edgecolor="black", linewidth=2, label="shared (×ref count)"),
               Patch(facecolor=CACHED_COLOR, edgecolor=CACHED_EDGE_COLOR, hatch="....", linestyle="--",
                     label="free, still cached"),
               Patch(facecolor=FREE_COLOR, edgecolor="#999999", label="free")]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 0), ncol=4, fontsize=7, frameon=False,
              borderaxespad=0.1)
    ax.set_xlim(-0.1, ncols + table_w + 0.3)
    ax.set_ylim(bottom - 1.05, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


# ------------------------------------------------------------------------------------------ batch composition
def plot_batch_composition(trace: RunTrace, ax: Axes | None = None, step: int | None = None) -> Axes:
    """One stacked bar per step: prefill (solid) and decode (hatched) tokens per sequence, against the budget.

    Preemptions are marked with a red ✕ and finishes with a black ▼ above the bar; `step` highlights one.
    """
    st = batch_composition_state(trace)
    ax = _new_axes(ax, (max(7.0, min(16.0, 0.16 * st.num_steps + 3)), 3.6))
    width = 0.85
    for g in st.segments:
        decode = g.kind == "decode"
        ax.bar(g.step, g.tokens, bottom=g.bottom, width=width, color=g.color, alpha=0.55 if decode else 1.0,
               hatch="////" if decode else None, edgecolor="white" if not decode else g.color, linewidth=0.4)
    steps = list(range(st.num_steps))
    ax.step(steps, st.budgets, where="mid", color="#444444", linestyle="--", linewidth=1)
    top = st.max_budget or max(st.totals, default=1)
    lift = 0.04 * top
    for s, ids in st.preempted.items():
        ax.scatter([s], [st.totals[s] + lift], marker="X", s=60, color=PREEMPT_COLOR, zorder=5)
        ax.annotate(", ".join(map(str, ids)), (s, st.totals[s] + lift), xytext=(4, 4),
                    textcoords="offset points", fontsize=6.5, color=PREEMPT_COLOR)
    for s in st.finished:
        ax.scatter([s], [st.totals[s] + 2.2 * lift], marker="v", s=28, color=FINISH_COLOR, zorder=5)
    if step is not None:
        ax.axvspan(step - 0.5, step + 0.5, color=STEP_COLOR, alpha=0.35, zorder=0)
    ax.set_xlim(-0.7, st.num_steps - 0.3)
    ax.set_ylim(0, top * 1.18)
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens in the batch")
    ax.set_title("Batch composition: prefill and decode tokens per sequence, per step", fontsize=10)
    handles = [Patch(facecolor="#777777", label="prefill (solid)"),
               Patch(facecolor="#777777", alpha=0.55, hatch="////", edgecolor="#777777",
                     label="decode (hatched)"),
               Line2D([], [], color="#444444", linestyle="--", label="token budget"),
               Line2D([], [], marker="X", color=PREEMPT_COLOR, linestyle="none", label="preempted"),
               Line2D([], [], marker="v", color=FINISH_COLOR, linestyle="none", label="finished")]
    if len(st.seq_colors) <= 16:
        handles += [Patch(facecolor=c, label=f"seq {s}") for s, c in st.seq_colors.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False,
              ncol=1 if len(handles) <= 10 else 2)
    return ax


# ------------------------------------------------------------------------------------------------- KV usage
def plot_kv_usage(trace: RunTrace, ax: Axes | None = None, step: int | None = None) -> Axes:
    """KV pool occupancy (used, cached-but-free) and the cumulative prefix-cache hit rate over the steps."""
    st = kv_usage_state(trace)
    ax = _new_axes(ax, (7.5, 3.2))
    x = list(range(len(st.used_blocks)))
    ax.stackplot(x, [st.usage, st.cached_fraction], colors=[KV_USED_COLOR, KV_CACHED_COLOR], step="mid",
                 labels=["blocks in use", "free, still cached"], alpha=0.85)
    ax.plot(x, st.hit_rate, color=HIT_RATE_COLOR, linewidth=2, label="prefix-cache hit rate (cumulative)")
    for k, s in enumerate(st.preempt_steps):
        ax.axvline(s, color=PREEMPT_COLOR, linestyle=":", linewidth=1.2,
                   label="preemption" if k == 0 else None)
    if step is not None:
        ax.axvline(step, color="black", linewidth=1)
    ax.set_xlim(0, max(x[-1], 1))
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.set_xlabel("engine step")
    ax.set_ylabel(f"share of {st.num_blocks} blocks / tokens")
    ax.set_title("KV cache usage and prefix-cache hit rate", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    return ax


# ---------------------------------------------------------------------------------------------- prefix tree
def plot_prefix_tree(trace: RunTrace, ax: Axes | None = None, tokenizer: Any = None) -> Axes:
    """The prompts as paths over full KV blocks: a node per distinct prefix block, a leaf per request.

    Green nodes were served from the prefix cache at least once, red ones were only ever computed; each node
    says how many admissions hit or missed it and which physical blocks held it. Leaves give each request's
    prefix-cache hit tokens (first admission) out of its prompt.
    """
    st = prefix_tree_state(trace)
    rows = max(len(st.leaves), 1)
    ax = _new_axes(ax, (2.0 * (st.max_depth + 1) + 3.2, 0.48 * rows + 1.6))
    bw, bh = 0.86, 0.7

    def right(node) -> float:  # where edges leave a node
        return node.x + (bw / 2 if node.parent is not None else 0.14)

    for node in st.nodes[1:]:
        parent = st.nodes[node.parent]
        ax.plot([right(parent), node.x - bw / 2], [-parent.y, -node.y], color="#888888",
                linewidth=0.8 + 1.2 * math.log2(len(node.seq_ids)), zorder=1, solid_capstyle="round")
    for leaf in st.leaves:
        node = st.nodes[leaf.node_id]
        ax.plot([right(node), leaf.x - 0.08], [-node.y, -leaf.y], color=st.seq_colors[leaf.seq_id],
                linewidth=1, linestyle="--", zorder=1)
    ax.text(0, -st.root.y, "start", ha="center", va="center", fontsize=8,
            bbox=dict(boxstyle="circle,pad=0.3", facecolor="white", edgecolor="#888888"))
    for node in st.nodes[1:]:
        face = HIT_COLOR if node.hits else MISS_COLOR
        ax.add_patch(FancyBboxPatch((node.x - bw / 2, -node.y - bh / 2), bw, bh, boxstyle="round,pad=0.02",
                                    facecolor=face, edgecolor="#555555", linewidth=0.8, zorder=2))
        ax.text(node.x, -node.y + 0.15, short_text(tokenizer, node.tokens, 21), ha="center", va="center",
                fontsize=6, zorder=3)
        blocks = ",".join(map(str, node.block_ids[:4])) + ("…" if len(node.block_ids) > 4 else "")
        ax.text(node.x, -node.y - 0.15,
                f"{node.hits} hit · {node.misses} miss" + (f" · [{blocks}]" if blocks else ""),
                ha="center", va="center", fontsize=5.5, color="#333333", zorder=3)
    for leaf in st.leaves:
        ax.text(leaf.x, -leaf.y,
                f"seq {leaf.seq_id}: {leaf.hit_tokens}/{leaf.prompt_tokens} prompt tokens hit",
                ha="left", va="center", fontsize=7, color="black",
                bbox=dict(boxstyle="round,pad=0.2", facecolor=st.seq_colors[leaf.seq_id], alpha=0.35,
                          edgecolor="none"))
    for d in range(1, st.max_depth + 1):
        ax.text(d, 0.75, f"block {d - 1}\ntokens {(d - 1) * st.block_size}–{d * st.block_size - 1}",
                ha="center", va="bottom", fontsize=6.5, color="#555555")
    rate = st.hit_tokens / st.prompt_tokens if st.prompt_tokens else 0.0
    ax.set_title(f"Prefix sharing: {len(st.leaves)} requests over {len(st.nodes) - 1} distinct full blocks; "
                 f"{st.hit_tokens} of {st.prompt_tokens} prompt tokens from the prefix cache ({rate:.0%})",
                 fontsize=9)
    handles = [Patch(facecolor=HIT_COLOR, edgecolor="#555555",
                     label="reused from the prefix cache at least once"),
               Patch(facecolor=MISS_COLOR, edgecolor="#555555", label="only ever computed"),
               Line2D([], [], color="#888888", linewidth=3, label="edge width: requests through it")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), ncol=3, fontsize=7, frameon=False)
    ax.set_xlim(-0.4, st.max_depth + 3.0)
    ax.set_ylim(-rows + 0.4, 1.45)
    ax.axis("off")
    return ax
