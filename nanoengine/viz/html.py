"""HTML and SVG renderings of the view states, for the ipywidgets views. Chapters 03 to 05.

Plain strings built from `nanoengine.viz.state` dataclasses: no JavaScript and no custom widget, so they
work in any JupyterLab with ipywidgets 8 (shown through `ipywidgets.HTML`) and are cheap to redraw on every
slider move. Hovering a block or a bar shows its details (the browser's tooltip, from `title`).
"""

from __future__ import annotations

from html import escape
from typing import Any

from nanoengine.viz.state import (
    CACHED,
    CACHED_COLOR,
    CACHED_EDGE_COLOR,
    FINISH_COLOR,
    FREE,
    HIT_COLOR,
    HIT_RATE_COLOR,
    KV_CACHED_COLOR,
    KV_USED_COLOR,
    MISS_COLOR,
    PREEMPT_COLOR,
    SHARED,
    STEP_COLOR,
    BatchCompositionState,
    BlockCell,
    BlockTableState,
    KVUsageState,
    grid_columns,
    ink,
    short_text,
)
from nanoengine.viz.state_prefix import PrefixTreeState
from nanoengine.viz.state_timeline import RequestTimelineState, RunSummary

FONT = "font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;"


def block_tooltip(cell: BlockCell, block_size: int, tokenizer: Any = None) -> str:
    """Plain-text details of one block: owners, ref count, fill, hash and tokens."""
    lines = [f"block {cell.block_id}: {cell.status}"]
    if cell.owners:
        lines.append(f"held by seq {', '.join(map(str, cell.owners))} (ref count {cell.ref_count})")
        lines.append(f"{cell.fill}/{block_size} slots computed")
    elif cell.last_owner is not None:
        lines.append(f"last held by seq {cell.last_owner}")
    if cell.hash is not None:
        lines.append(f"hash {cell.hash:016x}")
    if cell.tokens:
        lines.append(f"tokens: {short_text(tokenizer, cell.tokens, 120)}")
    return "\n".join(lines)


def block_grid_svg(st: BlockTableState, tokenizer: Any = None, selected: int | None = None,
                   ncols: int | None = None) -> str:
    """The pool as a grid of blocks: owners' colours side by side (pale above the fill level), shared blocks
    outlined with ×ref count, cached-but-free blocks dotted with their short hash, free blocks grey."""
    n = st.num_blocks
    ncols = ncols or grid_columns(n)
    size = 46 if n <= 64 else 22 if n <= 512 else 12
    gap = 4
    nrows = -(-n // ncols)
    width, height = ncols * (size + gap) + gap, nrows * (size + gap) + gap
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' style='{FONT}'>",
           "<defs><pattern id='ne-cached-dots' width='5' height='5' patternUnits='userSpaceOnUse'>"
           f"<rect width='5' height='5' fill='{CACHED_COLOR}'/>"
           "<circle cx='2.5' cy='2.5' r='0.9' fill='#c9ad4f'/>"
           "</pattern></defs>"]
    for c in st.cells:
        x, y = gap + (c.block_id % ncols) * (size + gap), gap + (c.block_id // ncols) * (size + gap)
        out.append(f"<g><title>{escape(block_tooltip(c, st.block_size, tokenizer))}</title>")
        if c.status == FREE:
            out.append(f"<rect x='{x}' y='{y}' width='{size}' height='{size}' fill='{c.color}'/>")
        elif c.status == CACHED:
            out.append(f"<rect x='{x}' y='{y}' width='{size}' height='{size}' fill='url(#ne-cached-dots)'/>")
        else:
            w = size / len(c.colors)
            for k, col in enumerate(c.colors):
                out.append(f"<rect x='{x + k * w:.1f}' y='{y}' width='{w:.1f}' height='{size}' "
                           f"fill='{col}'/>")
            pale = size * (1 - c.fill / st.block_size)
            if pale > 0:
                out.append(f"<rect x='{x}' y='{y}' width='{size}' height='{pale:.1f}' fill='white' "
                           "opacity='.65'/>")
        stroke = ("stroke='#000' stroke-width='2.5'" if c.status == SHARED else
                  f"stroke='{CACHED_EDGE_COLOR}' stroke-dasharray='3 2'" if c.status == CACHED else
                  "stroke='#999'")
        if c.block_id == selected:
            stroke = "stroke='#ff9800' stroke-width='3.5'"
        out.append(f"<rect x='{x}' y='{y}' width='{size}' height='{size}' fill='none' {stroke}/>")
        if size >= 40:
            solid = c.status not in (FREE, CACHED)
            top_ink = ink(c.colors[0]) if solid and c.fill == st.block_size else "#333"
            low_ink = ink(c.colors[-1]) if solid and c.fill else "#333"
            out.append(f"<text x='{x + 3}' y='{y + 10}' font-size='9' fill='{top_ink}'>{c.block_id}</text>")
            if c.status == SHARED:
                out.append(f"<rect x='{x + size / 2 - 13}' y='{y + size / 2 - 9}' width='26' height='17' "
                           "rx='3' fill='white' opacity='.85'/>"
                           f"<text x='{x + size / 2}' y='{y + size / 2 + 4}' "
                           f"text-anchor='middle' font-size='13' font-weight='bold'>×{c.ref_count}</text>")
            if c.hash is not None:
                short_hash = f"#{c.hash:016x}"[:5]
                out.append(f"<text x='{x + size - 2}' y='{y + size - 3}' text-anchor='end' font-size='8' "
                           f"fill='{low_ink}' font-family='monospace'>{short_hash}</text>")
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def block_tables_html(st: BlockTableState) -> str:
    """Each running sequence's block table: logical index -> physical block chips in the owner's colour."""
    refs = st.ref_counts
    rows = []
    for sid, table in st.tables.items():
        col = st.seq_colors[sid]
        chips = "".join(
            f"<span title='logical block {i} → physical block {b} (ref count {refs.get(b, 0)})' "
            f"style='display:inline-block;min-width:22px;text-align:center;margin-right:3px;"
            f"border:{3 if refs.get(b, 0) > 1 else 1}px solid {col};border-radius:3px'>{b}</span>"
            for i, b in enumerate(table))
        rows.append(f"<tr><td><span style='display:inline-block;width:12px;height:12px;background:{col}'>"
                    f"</span> seq {sid}</td><td>{chips}</td>"
                    f"<td style='color:#666'>{st.computed_tokens.get(sid, 0)} tok</td></tr>")
    body = "".join(rows) or "<tr><td style='color:#777'>(no running sequences)</td></tr>"
    return (f"<div style='{FONT}'><b>block tables</b> (logical → physical)"
            f"<table style='border-spacing:4px 3px'>{body}</table></div>")


def step_summary_html(st: BlockTableState) -> str:
    parts = [f"<b>step {st.step}</b>: {st.num_used}/{st.num_blocks} blocks used, "
             f"{st.num_cached} cached-free, {len(st.shared)} shared"]
    sched = ", ".join(f"seq {s} " + (f"prefill {p}" if p else f"decode {d}") for s, p, d in st.scheduled)
    parts.append(f"batch: {sched or '(empty)'}")
    hits = [f"seq {s} +{h} tokens" for s, h in st.cache_hits]
    if hits:
        parts.append("admitted (prefix hits): " + ", ".join(hits))
    if st.preempted:
        parts.append(f"<span style='color:{PREEMPT_COLOR}'><b>preempted</b>: "
                     + ", ".join(f"seq {s}" for s in st.preempted)
                     + " (blocks freed, recomputed later)</span>")
    if st.finished:
        parts.append("finished: " + ", ".join(f"seq {s}" for s in st.finished))
    return f"<div style='{FONT}'>" + "<br>".join(parts) + "</div>"


def block_detail_html(st: BlockTableState, block_id: int, tokenizer: Any = None) -> str:
    if not 0 <= block_id < st.num_blocks:
        return f"<div style='{FONT};color:#777'>select a block to see its hash and tokens</div>"
    text = escape(block_tooltip(st.cells[block_id], st.block_size, tokenizer)).replace("\n", "<br>")
    return f"<div style='{FONT}'>{text}</div>"


# ------------------------------------------------------------------------------------------------- SVG charts
def batch_svg(st: BatchCompositionState, step: int | None = None, width: int = 640, height: int = 190) -> str:
    """Stacked bars per step (prefill solid, decode pale), budget dashed, preempt ✕ and finish ▼ marks."""
    left, right, top, bottom = 40, 8, 18, 22
    w, h = width - left - right, height - top - bottom
    n = max(st.num_steps, 1)
    ymax = max(st.max_budget, max(st.totals, default=1), 1) * 1.12
    bw = w / n
    sx = lambda s: left + s * bw
    sy = lambda v: top + h - h * v / ymax
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' style='{FONT}'>"]
    if step is not None:
        out.append(f"<rect x='{sx(step):.1f}' y='{top}' width='{bw:.1f}' height='{h}' fill='{STEP_COLOR}' "
                   f"opacity='.45'/>")
    for g in st.segments:
        y0, y1 = sy(g.bottom), sy(g.bottom + g.tokens)
        op = ".5" if g.kind == "decode" else "1"
        out.append(f"<rect x='{sx(g.step) + 0.1 * bw:.1f}' y='{y1:.1f}' width='{max(0.8 * bw, 1):.1f}' "
                   f"height='{max(y0 - y1, 0.5):.1f}' fill='{g.color}' fill-opacity='{op}'>"
                   f"<title>step {g.step}: seq {g.seq_id} {g.kind} {g.tokens} tokens</title></rect>")
    pts = " ".join(f"{sx(s):.1f},{sy(b):.1f} {sx(s + 1):.1f},{sy(b):.1f}" for s, b in enumerate(st.budgets))
    out.append(f"<polyline points='{pts}' fill='none' stroke='#444' stroke-dasharray='4 3'/>")
    for s, ids in st.preempted.items():
        out.append(f"<text x='{sx(s) + bw / 2:.1f}' y='{sy(st.totals[s]) - 3:.1f}' fill='{PREEMPT_COLOR}' "
                   f"text-anchor='middle' font-weight='bold'>✕<title>step {s}: preempted seq "
                   f"{', '.join(map(str, ids))}</title></text>")
    for s, ids in st.finished.items():
        out.append(f"<text x='{sx(s) + bw / 2:.1f}' y='{top - 4}' fill='{FINISH_COLOR}' text-anchor='middle' "
                   f"font-size='9'>▼<title>step {s}: finished seq {', '.join(map(str, ids))}</title></text>")
    out.append(f"<line x1='{left}' y1='{top + h}' x2='{left + w}' y2='{top + h}' stroke='#333'/>")
    out.append(f"<text x='{left - 4}' y='{sy(st.max_budget) + 4:.1f}' text-anchor='end' font-size='10'>"
               f"{st.max_budget}</text>"
               f"<text x='{left - 4}' y='{top + h}' text-anchor='end' font-size='10'>0</text>")
    out.append(f"<text x='{left + w / 2}' y='{height - 4}' text-anchor='middle' font-size='10'>engine step "
               f"(bars: tokens per sequence; solid prefill, pale decode; dashed: budget)</text></svg>")
    return "".join(out)


def batch_step_html(st: BatchCompositionState, step: int) -> str:
    """One line on a step's batch: tokens used of the budget, each scheduled sequence, preemptions,
    finishes."""
    parts = [f"seq {g.seq_id} {g.kind} {g.tokens}" for g in st.bar(step)]
    extra = ""
    if step in st.preempted:
        extra += f"; preempted seq {', '.join(map(str, st.preempted[step]))}"
    if step in st.finished:
        extra += f"; finished seq {', '.join(map(str, st.finished[step]))}"
    return (f"<div style='{FONT}'>step {step}: {st.totals[step]}/{st.budgets[step]} tokens "
            f"({', '.join(parts) or 'nothing scheduled'}){extra}</div>")


def kv_svg(st: KVUsageState, step: int | None = None, width: int = 640, height: int = 170) -> str:
    """Used and cached-free shares of the pool (areas) and the cumulative prefix-cache hit rate (line)."""
    left, right, top, bottom = 40, 8, 24, 24
    w, h = width - left - right, height - top - bottom
    n = max(len(st.used_blocks), 1)
    sx = lambda s: left + w * (s + 0.5) / n
    sy = lambda v: top + h - h * v
    usage, cached = st.usage, st.cached_fraction
    used_pts = " ".join(f"{sx(s):.1f},{sy(u):.1f}" for s, u in enumerate(usage))
    stack_pts = " ".join(f"{sx(s):.1f},{sy(u + c):.1f}" for s, (u, c) in enumerate(zip(usage, cached)))
    back = " ".join(f"{sx(s):.1f},{sy(u):.1f}" for s, u in reversed(list(enumerate(usage))))
    hit_pts = " ".join(f"{sx(s):.1f},{sy(r):.1f}" for s, r in enumerate(st.hit_rate))
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' style='{FONT}'>",
           f"<polygon points='{stack_pts} {back}' fill='{KV_CACHED_COLOR}'><title>free, still cached</title>"
           "</polygon>",
           f"<polygon points='{sx(0):.1f},{sy(0):.1f} {used_pts} {sx(n - 1):.1f},{sy(0):.1f}' "
           f"fill='{KV_USED_COLOR}'><title>blocks in use</title></polygon>",
           f"<polyline points='{hit_pts}' fill='none' stroke='{HIT_RATE_COLOR}' stroke-width='2'>"
           f"<title>prefix-cache hit rate</title></polyline>"]
    for s in st.preempt_steps:
        out.append(f"<line x1='{sx(s):.1f}' y1='{top}' x2='{sx(s):.1f}' y2='{top + h}' "
                   f"stroke='{PREEMPT_COLOR}' stroke-dasharray='2 2'>"
                   f"<title>step {s}: preemption</title></line>")
    if step is not None:
        out.append(f"<line x1='{sx(step):.1f}' y1='{top}' x2='{sx(step):.1f}' y2='{top + h}' "
                   "stroke='black'/>")
        out.append(f"<text x='{left}' y='{top - 8}' font-size='11'>step {step}: KV blocks in use "
                   f"{usage[step]:.0%}, free but cached {cached[step]:.0%}, prefix-cache hit rate so far "
                   f"{st.hit_rate[step]:.0%}</text>")
    out.append(f"<text x='{left - 4}' y='{top + 8}' text-anchor='end' font-size='10'>100%</text>"
               f"<text x='{left - 4}' y='{top + h}' text-anchor='end' font-size='10'>0</text>"
               f"<line x1='{left}' y1='{top + h}' x2='{left + w}' y2='{top + h}' stroke='#333'/>")
    legend = [(KV_USED_COLOR, "■ in use"), ("#d4b24c", "■ free, still cached"),
              (HIT_RATE_COLOR, "— hit rate (cumulative)"), (PREEMPT_COLOR, "┆ preemption")]
    for k, (col, label) in enumerate(legend):
        out.append(f"<text x='{left + k * w / 4:.0f}' y='{height - 6}' font-size='10' "
                   f"fill='{col}'>{label}</text>")
    out.append("</svg>")
    return "".join(out)


def prefix_tree_svg(st: PrefixTreeState, tokenizer: Any = None, selected_seq: int | None = None) -> str:
    """The prefix trie as SVG: the same layout as the static figure; a selected request's path is outlined."""
    col_w, row_h, bw, bh = 150, 30, 124, 26
    left, top = 30, 30
    width = int(left + col_w * (st.max_depth + 1) + 240)
    height = int(top + row_h * max(len(st.leaves), 1) + 10)
    px = lambda x: left + x * col_w
    py = lambda y: top + y * row_h + row_h / 2
    on_path = {n.node_id for n in st.path(selected_seq)} if selected_seq is not None else set()
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' style='{FONT}'>"]
    for d in range(1, st.max_depth + 1):
        out.append(f"<text x='{px(d):.0f}' y='12' text-anchor='middle' font-size='10' fill='#555'>"
                   f"block {d - 1}</text>")
    for node in st.nodes[1:]:
        p = st.nodes[node.parent]
        x0 = px(p.x) + (bw / 2 if p.parent is not None else 10)
        wide = 1 + len(node.seq_ids).bit_length()
        out.append(f"<line x1='{x0:.0f}' y1='{py(p.y):.0f}' x2='{px(node.x) - bw / 2:.0f}' "
                   f"y2='{py(node.y):.0f}' stroke='#999' stroke-width='{wide}'/>")
    for leaf in st.leaves:
        node = st.nodes[leaf.node_id]
        x0 = px(node.x) + (bw / 2 if node.parent is not None else 10)
        col = st.seq_colors[leaf.seq_id]
        sel = leaf.seq_id == selected_seq
        out.append(f"<line x1='{x0:.0f}' y1='{py(node.y):.0f}' x2='{px(leaf.x) - 6:.0f}' "
                   f"y2='{py(leaf.y):.0f}' stroke='{col}' stroke-dasharray='4 3' "
                   f"stroke-width='{2.5 if sel else 1}'/>")
        out.append(f"<rect x='{px(leaf.x) - 4:.0f}' y='{py(leaf.y) - 9:.0f}' width='230' height='18' rx='3' "
                   f"fill='{col}' fill-opacity='.35' stroke='{'#000' if sel else 'none'}'/>"
                   f"<text x='{px(leaf.x):.0f}' y='{py(leaf.y) + 4:.0f}'>seq {leaf.seq_id}: "
                   f"{leaf.hit_tokens}/{leaf.prompt_tokens} prompt tokens hit</text>")
    out.append(f"<circle cx='{px(0):.0f}' cy='{py(st.root.y):.0f}' r='10' fill='white' stroke='#888'/>")
    for node in st.nodes[1:]:
        face = HIT_COLOR if node.hits else MISS_COLOR
        stroke = "stroke='#ff9800' stroke-width='3'" if node.node_id in on_path else "stroke='#555'"
        tip = (f"block {node.depth - 1} of the prompt; {node.hits} hit, {node.misses} miss; requests "
               f"{', '.join(map(str, node.seq_ids))}; physical blocks {node.block_ids}"
               + (f"; hash {node.hash:016x}" if node.hash is not None else "")
               + f"\ntokens: {short_text(tokenizer, node.tokens, 120)}")
        out.append(f"<g><title>{escape(tip)}</title><rect x='{px(node.x) - bw / 2:.0f}' "
                   f"y='{py(node.y) - bh / 2:.0f}' width='{bw}' height='{bh}' rx='4' fill='{face}' {stroke}/>"
                   f"<text x='{px(node.x):.0f}' y='{py(node.y) - 2:.0f}' text-anchor='middle' font-size='9'>"
                   f"{escape(short_text(tokenizer, node.tokens, 22))}</text>"
                   f"<text x='{px(node.x):.0f}' y='{py(node.y) + 10:.0f}' text-anchor='middle' font-size='8' "
                   f"fill='#333'>{node.hits} hit · {node.misses} miss</text></g>")
    out.append("</svg>")
    return "".join(out)


LANE_COLORS = {"wait": "#e6e6e6", "stalled": "#fff2b3", "done": "#ffffff"}


def request_lanes_svg(st: RequestTimelineState, step: int | None = None, width: int = 640) -> str:
    """One lane per sequence: grey while waiting, solid while prefilling, pale while decoding, yellow when
    running but left out of the batch, a red ✕ where it was preempted, ▼ where it finished."""
    left, right, top = 52, 8, 6
    lane = 14 if len(st.seq_ids) <= 16 else 9
    n = max(st.num_steps, 1)
    w = width - left - right
    cw = w / n
    height = top + lane * len(st.seq_ids) + 22
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' style='{FONT}'>"]
    if step is not None:
        out.append(f"<rect x='{left + step * cw:.1f}' y='0' width='{cw:.1f}' height='{height - 18}' "
                   f"fill='{STEP_COLOR}' opacity='.45'/>")
    for r, sid in enumerate(st.seq_ids):
        y = top + r * lane
        color = st.seq_colors[sid]
        out.append(f"<text x='{left - 4}' y='{y + lane - 4}' text-anchor='end' font-size='9'>"
                   f"seq {sid}</text>")
        for s, kind in enumerate(st.kinds[sid]):
            x = left + s * cw
            tip = (f"step {s}: seq {sid} {kind}"
                   + (f" {st.tokens[sid][s]} tokens" if st.tokens[sid][s] else ""))
            if kind in ("prefill", "decode"):
                op = "1" if kind == "prefill" else ".45"
                out.append(f"<rect x='{x:.1f}' y='{y + 1}' width='{max(cw, 0.8):.1f}' height='{lane - 2}' "
                           f"fill='{color}' fill-opacity='{op}'><title>{tip}</title></rect>")
            elif kind == "preempted":
                out.append(f"<text x='{x + cw / 2:.1f}' y='{y + lane - 3}' text-anchor='middle' "
                           f"font-size='{lane - 2}' font-weight='bold' fill='{PREEMPT_COLOR}'>"
                           f"✕<title>{tip}</title></text>")
            elif kind in ("wait", "stalled"):
                out.append(f"<rect x='{x:.1f}' y='{y + 3}' width='{max(cw, 0.8):.1f}' height='{lane - 6}' "
                           f"fill='{LANE_COLORS[kind]}'><title>{tip}</title></rect>")
        if sid in st.finished_step:
            s = st.finished_step[sid]
            out.append(f"<text x='{left + (s + 1) * cw + 1:.1f}' y='{y + lane - 3}' font-size='{lane - 4}' "
                       f"fill='{FINISH_COLOR}'>▼<title>step {s}: seq {sid} finished</title></text>")
    out.append(f"<text x='{left + w / 2}' y='{height - 6}' text-anchor='middle' font-size='10'>engine step "
               "(solid: prefill, pale: decode, grey: waiting, yellow: running but not in the batch, "
               "✕ preempted, ▼ finished)</text></svg>")
    return "".join(out)


def run_summary_html(sm: RunSummary, budget: int, num_blocks: int, block_size: int) -> str:
    return (f"<div style='{FONT}'><b>budget {budget} tokens/step, "
            f"{num_blocks} KV blocks of {block_size}</b>: "
            f"{sm.steps} steps ({sm.seconds:.2f} s), {sm.computed_tokens} token positions computed for "
            f"{sm.prompt_tokens} prompt tokens; batch {sm.mean_batch_tokens:.1f} tokens on average "
            f"({sm.mean_fill:.0%} of the budget); {sm.chunked_steps} steps with a chunked prompt; "
            f"{sm.preemptions} preemptions, {sm.recomputed_tokens} tokens recomputed</div>")
