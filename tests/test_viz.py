"""The views (nanoengine.viz) against a real engine run: their state must say what the trace and the block
manager say. Chapters 03-05.

One small tiny-qwen3 run (module fixture, a few seconds): 8 prompts sharing a system prompt, 4 at a time, on
a 14-block pool, so that later requests hit the prefix cache, blocks are shared, freed blocks stay cached,
and one sequence is preempted. A second, step-by-step run compares every step with the live block manager.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nanoengine.viz import (  # noqa: E402
    BatchCompositionView,
    BlockTableView,
    PrefixTreeView,
    StepTimeline,
    batch_composition_state,
    block_table_states,
    kv_usage_state,
    plot_batch_composition,
    plot_block_table,
    plot_kv_usage,
    plot_prefix_tree,
    prefix_tree_state,
    show_timeline,
)
from nanoengine.viz import html as vhtml  # noqa: E402
from nanoengine.viz.state import CACHED, CACHED_COLOR, FREE, FREE_COLOR, SHARED, USED  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a careful assistant inside a small inference engine. Answer in one short paragraph, "
          "name the data structure involved, and say what it costs in memory. ")
QUESTIONS = ["What is a KV cache?", "Why are KV blocks fixed-size?", "What does a block table map?",
             "When is a block shared?", "What happens on preemption?", "Why hash whole prefixes?",
             "What is chunked prefill?", "Why put decodes first?"]
MAX_TOKENS = [8, 40, 16, 48, 24, 36, 12, 40]


@pytest.fixture(scope="module")
def run(tiny_qwen3_path):
    from nanoengine import LLM, SamplingParams

    llm = LLM("tiny-qwen3", trace=True, block_size=16, num_kvcache_blocks=12, max_num_batched_tokens=64,
              max_num_seqs=4, enable_prefix_caching=True)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    llm.generate([SYSTEM + q for q in QUESTIONS], params, use_tqdm=False)
    bm = llm.engine.block_manager
    # the block manager right after the run (a later test steps the same engine again)
    snapshot = {"ref_counts": [b.ref_count for b in bm.blocks], "hashes": [b.hash for b in bm.blocks],
                "tokens": [list(b.token_ids) for b in bm.blocks], "free": set(bm.free_block_ids),
                "cached_free": bm.get_cached_free_block_ids(), "num_blocks": bm.num_blocks}
    trace = llm.trace
    states = block_table_states(trace)
    # the workload must exercise what the views show; if the engine changes, retune the run above
    assert any(s.preempted for s in trace.steps), "the test run needs a preemption: shrink num_kvcache_blocks"
    assert any(st.shared for st in states), (
        "the test run needs a shared block (prefix-cache hit while running)")
    assert any(st.num_cached for st in states), "the test run needs cached-free blocks"
    return llm, trace, states, snapshot


# ------------------------------------------------------------------------------------------------ block table
def test_one_cell_per_block_of_the_pool(run):
    llm, trace, states, snap = run
    n = llm.engine.block_manager.num_blocks
    assert trace.num_blocks == n
    for st in states:
        assert len(st.cells) == n, f"step {st.step}: {len(st.cells)} cells for a pool of {n} blocks"
        assert [c.block_id for c in st.cells] == list(range(n))
    view = BlockTableView(trace, step=3)
    assert len(view.cells) == n


def test_owner_colours_are_the_same_in_every_step(run):
    _, trace, states, _ = run
    seen: dict[int, set[str]] = {}
    for st in states:
        assert st.seq_colors == states[0].seq_colors
        for c in st.cells:
            if c.owners:
                assert c.colors == tuple(st.seq_colors[o] for o in c.owners), (
                    f"step {st.step} block {c.block_id}")
                for o, col in zip(c.owners, c.colors):
                    seen.setdefault(o, set()).add(col)
            else:
                assert c.colors == ((CACHED_COLOR,) if c.status == CACHED else (FREE_COLOR,))
    assert all(len(cols) == 1 for cols in seen.values()), seen
    assert len(seen) == len(trace.prompts), "every sequence should own blocks at some step"
    assert len({next(iter(c)) for c in seen.values()}) == len(seen), "two sequences share a colour"
    # the widget shows the same colours as it moves
    view = BlockTableView(trace)
    for st in states[::5]:
        view.step = st.step
        assert view.colors == st.colors


def test_ref_counts_match_block_tables_at_every_step(run):
    _, trace, states, _ = run
    for s, st in zip(trace.steps, states):
        held = Counter(b for table in s.block_tables.values() for b in table)
        assert dict(held) == s.ref_counts, f"step {s.step}: trace ref_counts disagree with the block tables"
        assert st.ref_counts == s.ref_counts
        for c in st.cells:
            assert c.ref_count == len(c.owners) == held.get(c.block_id, 0)
            assert (c.status == SHARED) == (c.ref_count > 1)
            assert (c.status == USED) == (c.ref_count == 1)
        assert {c.block_id for c in st.cells if c.status == CACHED} == set(s.cached_free_blocks)
        assert st.num_free_blocks == sum(c.status in (FREE, CACHED) for c in st.cells)


def test_last_step_matches_the_block_manager(run):
    _, _, states, snap = run
    last = states[-1]
    assert len(last.cells) == snap["num_blocks"]
    for c in last.cells:
        assert c.ref_count == snap["ref_counts"][c.block_id], f"block {c.block_id}"
        assert c.hash == snap["hashes"][c.block_id], f"block {c.block_id}"
        assert (c.status in (FREE, CACHED)) == (c.block_id in snap["free"])
        if c.hash is not None:
            assert list(c.tokens) == snap["tokens"][c.block_id]
    assert [c.block_id for c in last.cells if c.status == CACHED] == sorted(snap["cached_free"])


def test_every_step_matches_the_live_block_manager(run):
    """Step the same engine by hand (its prefix cache is warm now) and compare each step's view state with
    the block manager and the scheduler at that moment: shared blocks' ref counts included."""
    from nanoengine import SamplingParams

    llm = run[0]
    engine, bm = llm.engine, llm.engine.block_manager
    trace = engine.start_trace()
    for q, m in zip(QUESTIONS[:5], [6, 20, 10, 24, 14]):
        engine.add(engine.make_request(SYSTEM + q,
                                       SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)))
    shared_seen = 0
    while engine.has_unfinished():
        engine.step()
        st = block_table_states(trace)[-1]
        assert st.ref_counts == {b.block_id: b.ref_count for b in bm.blocks if b.ref_count > 0}
        assert [c.ref_count for c in st.cells] == [b.ref_count for b in bm.blocks]
        assert [c.hash for c in st.cells] == [b.hash for b in bm.blocks]
        assert st.tables == {s.seq_id: list(s.block_table) for s in engine.scheduler.running}
        shared_seen += len(st.shared)
    assert shared_seen, "no shared block in the step-by-step run"


def test_preempted_sequence_loses_its_blocks_at_that_step(run):
    _, trace, states, _ = run
    checked = 0
    for s in trace.steps:
        for sid in s.preempted:
            before, now = states[s.step - 1], states[s.step]
            assert before.tables.get(sid), f"seq {sid} held no blocks before its preemption at step {s.step}"
            assert sid not in now.tables
            assert all(sid not in c.owners for c in now.cells)
            for b in before.tables[sid]:
                cell = now.cells[b]
                assert cell.status in (FREE, CACHED) or sid not in cell.owners
            checked += 1
    assert checked


# ------------------------------------------------------------------------------------------ batch composition
def test_bar_heights_are_the_scheduled_tokens_within_budget(run):
    _, trace, _, _ = run
    bc = batch_composition_state(trace)
    assert bc.num_steps == len(trace.steps)
    for s in trace.steps:
        bar = bc.bar(s.step)
        scheduled = sum(e.prefill_tokens + e.decode_tokens for e in s.scheduled)
        assert sum(g.tokens for g in bar) == bc.totals[s.step] == scheduled == s.num_batched_tokens
        assert bc.totals[s.step] <= bc.budgets[s.step] == trace.max_num_batched_tokens
        bottom = 0
        for g in bar:  # stacked without gaps or overlaps
            assert g.bottom == bottom and g.tokens > 0
            assert g.color == bc.seq_colors[g.seq_id]
            bottom += g.tokens
        assert {g.seq_id for g in bar} == {e.seq_id for e in s.scheduled}
    assert bc.preempted == {s.step: s.preempted for s in trace.steps if s.preempted}
    assert bc.finished == {s.step: s.finished for s in trace.steps if s.finished}
    assert {g.kind for g in bc.segments} == {"prefill", "decode"}


def test_kv_usage_and_hit_rate(run):
    _, trace, states, _ = run
    kv = kv_usage_state(trace)
    for s, st in zip(trace.steps, states):
        assert kv.used_blocks[s.step] == len(s.ref_counts) == st.num_used
        assert kv.cached_free_blocks[s.step] == st.num_cached
    assert kv.hit_tokens[-1] == trace.hit_tokens > 0
    assert kv.prefill_tokens[-1] == sum(s.prefill_tokens for s in trace.steps)
    assert all(0 <= r <= 1 for r in kv.hit_rate)
    assert kv.preempt_steps == [s.step for s in trace.steps if s.preempted]


# ---------------------------------------------------------------------------------------------- prefix tree
def test_prefix_tree_paths_hashes_and_hits(run):
    _, trace, _, _ = run
    pt = prefix_tree_state(trace)
    bs = trace.block_size
    assert [lf.seq_id for lf in pt.leaves] == sorted(trace.prompts)
    for lf in pt.leaves:
        path = pt.path(lf.seq_id)
        prompt = trace.prompts[lf.seq_id]
        assert len(path) == len(prompt) // bs
        assert [list(n.tokens) for n in path] == [prompt[i * bs:(i + 1) * bs] for i in range(len(path))]
        first = next(h for s in trace.steps for sid, h in s.cache_hits if sid == lf.seq_id)
        assert lf.hit_tokens == first
    # the tree's chained hashes are the block manager's: every computed node was seen in some block
    hashes = {h: b for s in trace.steps for b, h in s.block_hashes.items()}
    for node in pt.nodes[1:]:
        if node.misses:
            assert node.block_ids, f"node at depth {node.depth} was computed but no block held its hash"
        for b in node.block_ids:
            assert any(s.block_hashes.get(b) == node.hash for s in trace.steps)
        if node.hash in hashes:
            assert node.block_ids
    # every admission counts once per full prompt block on its path
    admissions = Counter(sid for s in trace.steps for sid, _ in s.cache_hits)
    for node in pt.nodes[1:]:
        assert node.hits + node.misses == sum(admissions[sid] for sid in node.seq_ids)
    # a hit of h tokens serves h // block_size blocks of the prompt
    hit_blocks = sum(min(h, len(trace.prompts[sid]) // bs * bs) // bs
                     for s in trace.steps for sid, h in s.cache_hits)
    assert sum(node.hits for node in pt.nodes) == hit_blocks > 0
    shared_root = pt.nodes[pt.root.children[0]]
    assert len(shared_root.seq_ids) == len(trace.prompts) and shared_root.hits > 0


# ---------------------------------------------------------------------------------------------- widgets
def test_widgets_move_together_and_expose_state(run):
    llm, trace, states, _ = run
    tl = show_timeline(trace, tokenizer=llm.tokenizer)
    assert isinstance(tl, StepTimeline)
    slider = tl.children[1].children[1]
    p = next(s.step for s in trace.steps if s.preempted)
    slider.value = p
    assert tl.step == tl.blocks.step == tl.batch.step == tl.kv.step == p
    assert tl.blocks.state is not None and tl.blocks.ref_counts == trace.steps[p].ref_counts
    assert "preempted" in tl.blocks._summary.value
    tl.play.value = 2  # the play button drives the slider
    assert slider.value == tl.blocks.step == 2
    shared = next(st for st in states if st.shared)
    tl.step = shared.step
    block = shared.shared[0]
    tl.blocks.selected_block = block.block_id
    assert block.hash is not None and f"{block.hash:016x}" in tl.blocks._detail.value
    assert f"ref count {block.ref_count}" in tl.blocks._detail.value
    view = BlockTableView(trace, step=-1)
    assert view.step == len(trace.steps) - 1
    with pytest.raises(IndexError, match="outside"):
        view.step = len(trace.steps)
    with pytest.raises(ValueError, match="trace=True"):
        show_timeline(None)
    bcv = BatchCompositionView(trace)
    bcv.step = p
    assert "preempted" in bcv._info.value
    ptv = PrefixTreeView(trace, tokenizer=llm.tokenizer)
    ptv.selected_seq = max(trace.prompts)
    assert "hit" in ptv._info.value


def test_svg_is_well_formed(run):
    llm, trace, states, _ = run
    for st in states[::7]:
        ET.fromstring(vhtml.block_grid_svg(st, llm.tokenizer, selected=0))
    ET.fromstring(vhtml.batch_svg(batch_composition_state(trace), step=1))
    ET.fromstring(vhtml.kv_svg(kv_usage_state(trace), step=1))
    pt = prefix_tree_state(trace)
    ET.fromstring(vhtml.prefix_tree_svg(pt, llm.tokenizer, selected_seq=pt.leaves[-1].seq_id))


# --------------------------------------------------------------------------------------- static renderings
def _png_ok(fig, path: Path) -> None:
    fig.savefig(path, dpi=60)
    plt.close(fig)
    img = plt.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 150, img.shape
    assert float(np.std(img[..., :3])) > 0.05, f"{path.name} is nearly blank"


def test_static_renderings_are_images(run, tmp_path):
    llm, trace, states, _ = run
    step = next(st.step for st in states if st.shared)
    axes = {"block_table": plot_block_table(trace, step), "batch": plot_batch_composition(trace, step=step),
            "kv": plot_kv_usage(trace), "tree": plot_prefix_tree(trace, tokenizer=llm.tokenizer)}
    for name, ax in axes.items():
        assert isinstance(ax, matplotlib.axes.Axes)
        _png_ok(ax.figure, tmp_path / f"{name}.png")
    fig, ax = plt.subplots()
    assert plot_block_table(trace, 0, ax=ax) is ax
    _png_ok(fig, tmp_path / "given_ax.png")


def _load_make_figures():
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "figures" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_make_figures_main_writes_pngs(tmp_path, tiny_qwen3_path):
    written = _load_make_figures().main(["--out", str(tmp_path), "--only", "block_table,prefix_tree"])
    assert [p.name for p in written] == ["block_table.png", "prefix_tree.png"]
    for p in written:
        img = plt.imread(p)
        assert float(np.std(img[..., :3])) > 0.05


@pytest.mark.slow
def test_make_figures_runs_headless(tmp_path, tiny_qwen3_path, smollm2_path):
    """All figures, as `make figures` runs them: a fresh process, no display, no backend chosen."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND", "WAYLAND_DISPLAY")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, str(ROOT / "figures" / "make_figures.py"), "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == sorted(f"{n}.png" for n in _load_make_figures().FIGURES)


def test_engine_never_imports_viz():
    for path in (ROOT / "nanoengine").rglob("*.py"):
        parts = path.relative_to(ROOT / "nanoengine").parts
        if "viz" in parts or "bench" in parts:  # the benchmark reads results like the views do; it may plot
            continue
        text = path.read_text()
        assert "nanoengine.viz" not in text and "from nanoengine import viz" not in text, path
