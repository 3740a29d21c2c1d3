"""Regenerate the book's static figures from real engine runs on the offline assets (`make figures`).

Every figure is drawn by `nanoengine.viz` from the trace of an actual `LLM.generate` / `LLM.chat` run, so the
pictures in the book are what the engine did, not drawings of what it should do. The runs are small (a few
seconds each on a CPU); the whole script takes well under a minute.

    MPLBACKEND=Agg .venv/bin/python figures/make_figures.py             # writes figures/*.png
    .venv/bin/python figures/make_figures.py --out /tmp/figs --only prefix_tree

Figures (chapter: file):
  03  block_table.png          the KV pool mid-run: owners, shared blocks with ref counts, cached-free blocks
  03  preemption.png           the pool just before, at and after a preemption (blocks freed, then recomputed)
  04  prefix_tree.png          requests as paths over shared prompt blocks, hits vs misses
  05  batch_composition.png    SmolLM2-135M chat run: chunked prefill, decodes, preemption per step vs budget
  05  kv_usage.png             KV pool occupancy and prefix-cache hit rate over the same run
  03+ timeline.png             the step timeline widget as one static picture (block table, bars, KV usage)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")

import matplotlib  # noqa: E402

matplotlib.use(os.environ["MPLBACKEND"])
import matplotlib.pyplot as plt  # noqa: E402

FIGURES_DIR = Path(__file__).resolve().parent
DPI = 130

# a shared system prompt and short questions: later admissions hit the system prompt's blocks
SYSTEM = ("You are a careful assistant inside a small inference engine. Answer in one short paragraph, "
          "name the data structure involved, and say what it costs in memory. ")
QUESTIONS = ["What is a KV cache?", "Why are KV blocks fixed-size?", "What does a block table map?",
             "When is a block shared?", "What happens on preemption?", "Why hash whole prefixes?",
             "What is chunked prefill?", "Why put decodes first?"]
MAX_TOKENS = [8, 40, 16, 48, 24, 36, 12, 40]  # staggered finishes keep admitting new requests mid-run


@dataclass
class Run:
    llm: object
    trace: object
    seconds: float


def run_pool_pressure() -> Run:
    """tiny-qwen3, 12 blocks of 16 tokens, 4 seqs at a time: prefix sharing, cached-free blocks, a
    preemption."""
    from nanoengine import LLM, SamplingParams

    llm = LLM("tiny-qwen3", trace=True, block_size=16, num_kvcache_blocks=12, max_num_batched_tokens=64,
              max_num_seqs=4, enable_prefix_caching=True)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    t0 = time.perf_counter()
    llm.generate([SYSTEM + q for q in QUESTIONS], params, use_tqdm=False)
    return Run(llm, llm.trace, time.perf_counter() - t0)


def run_prefix_tree() -> Run:
    """tiny-qwen3 (real Qwen3 tokenizer): a system prompt of exactly two blocks, two instruction branches of
    one block each, then questions (the long ones fill a block of their own). Two sequences run at a time,
    so later requests find the earlier ones' blocks in the prefix cache."""
    from nanoengine import LLM, SamplingParams

    llm = LLM("tiny-qwen3", trace=True, block_size=16, num_kvcache_blocks=48, max_num_batched_tokens=256,
              max_num_seqs=2, enable_prefix_caching=True)
    enc = lambda text: llm.tokenizer.encode(text)
    system = enc(SYSTEM)[:32]  # cut to whole blocks so that every branch starts on a block boundary
    branches = {
        "Explain it to a first-year student, with one concrete example from daily life. ":
            ["What is paged attention, and why does a fixed block size make memory allocation so simple?",
             "Why batch?", "What is a token?"],
        "Review it like a systems engineer: list the trade-offs and what you would measure first. ":
            ["Prefix caching with least-recently-used eviction of free blocks, in a busy chat server.",
             "Preemption?", "Chunked prefill?"],
    }
    prompts = [{"prompt_token_ids": system + enc(b)[:16] + enc(q)} for b, qs in branches.items() for q in qs]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return Run(llm, llm.trace, time.perf_counter() - t0)


def run_chat() -> Run:
    """smollm2-135m answering real questions (stops at EOS): its chat template's default system prompt is a
    shared prefix; a 48-token budget chunks the prefills and mixes them with decodes."""
    from nanoengine import LLM, SamplingParams

    llm = LLM("smollm2-135m", trace=True, block_size=16, num_kvcache_blocks=18, max_num_batched_tokens=48,
              max_num_seqs=6, enable_prefix_caching=True)
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about autumn leaves.", "What is 12 times 12?",
                 "Explain in two sentences why the sky is blue.", "Give one tip for learning a new language.",
                 "What does a CPU do?", "Say hello in Spanish."]
    t0 = time.perf_counter()
    llm.chat([[{"role": "user", "content": q}] for q in questions],
             SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    return Run(llm, llm.trace, time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------- figures
def interesting_step(trace) -> int:
    """A step worth a picture: most shared blocks, then most cached-free ones, among steps with 3+ running."""
    from nanoengine.viz import block_table_states

    states = block_table_states(trace)
    busy = [s for s in states if len(s.tables) >= 3] or states
    return max(busy, key=lambda s: (sum(c.ref_count for c in s.shared), s.num_cached, -s.step)).step


def fig_block_table(run: Run):
    from nanoengine.viz import plot_block_table

    return plot_block_table(run.trace, interesting_step(run.trace)).figure


def fig_preemption(run: Run):
    from nanoengine.viz import plot_block_table

    steps = [s.step for s in run.trace.steps if s.preempted]
    if not steps:
        raise RuntimeError("the pool-pressure run had no preemption; shrink num_kvcache_blocks in "
                           "run_pool_pressure")
    p = steps[0]
    readmit = next((s.step for s in run.trace.steps[p + 1:]
                    if any(sid in run.trace.steps[p].preempted for sid, _ in s.cache_hits)), p + 1)
    shown = [p - 1, p, min(readmit, len(run.trace) - 1)]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9.5, 2.9 * len(shown)), layout="constrained")
    rows = max(len(run.trace.steps[s].block_tables) for s in shown)
    for ax, s in zip(axes, shown):
        plot_block_table(run.trace, s, ax=ax, table_rows=rows)
    victims = run.trace.steps[p].preempted
    hits = sum(n for sid, n in run.trace.steps[shown[-1]].cache_hits if sid in victims)
    fig.suptitle(f"Preemption by recomputation: seq {', '.join(map(str, victims))} loses all its blocks at "
                 f"step {p} and is readmitted at step {shown[-1]} with {hits} prefix-cache hit tokens",
                 fontsize=10)
    return fig


def fig_prefix_tree(run: Run):
    from nanoengine.viz import plot_prefix_tree

    return plot_prefix_tree(run.trace, tokenizer=run.llm.tokenizer).figure


def fig_batch_composition(run: Run):
    from nanoengine.viz import plot_batch_composition

    return plot_batch_composition(run.trace).figure


def fig_kv_usage(run: Run):
    from nanoengine.viz import plot_kv_usage

    return plot_kv_usage(run.trace).figure


def fig_timeline(run: Run):
    from nanoengine.viz import plot_batch_composition, plot_block_table, plot_kv_usage

    step = interesting_step(run.trace)
    fig = plt.figure(figsize=(12, 9), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[0.8, 1])
    plot_block_table(run.trace, step, ax=top.subplots())
    ax_bars, ax_kv = bottom.subplots(2, 1, sharex=True)
    plot_batch_composition(run.trace, ax=ax_bars, step=step)
    plot_kv_usage(run.trace, ax=ax_kv, step=step)
    ax_bars.set_xlabel("")
    fig.suptitle(f"Step timeline at step {step} of {len(run.trace)}: the widget "
                 "`show_timeline(llm.trace)` as one picture", fontsize=11)
    return fig


# name -> (run it needs, figure function)
FIGURES: dict[str, tuple[str, Callable]] = {
    "block_table": ("pool", fig_block_table),
    "preemption": ("pool", fig_preemption),
    "prefix_tree": ("tree", fig_prefix_tree),
    "batch_composition": ("chat", fig_batch_composition),
    "kv_usage": ("chat", fig_kv_usage),
    "timeline": ("pool", fig_timeline),
}
RUNS = {"pool": run_pool_pressure, "tree": run_prefix_tree, "chat": run_chat}


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=FIGURES_DIR, help="output folder (default: figures/)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(FIGURES)}")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(FIGURES)
    unknown = sorted(set(names) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figure(s) {unknown}; choose from {list(FIGURES)}")
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)  # several jobs share the CPU; one thread is fastest then
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Run] = {}
    written = []
    for name in names:
        kind, draw = FIGURES[name]
        if kind not in runs:
            t0 = time.perf_counter()
            runs[kind] = RUNS[kind]()
            print(f"run {kind}: {len(runs[kind].trace)} steps, generate {runs[kind].seconds:.1f}s "
                  f"(with loading {time.perf_counter() - t0:.1f}s)", flush=True)
        fig = draw(runs[kind])
        path = args.out / f"{name}.png"
        fig.savefig(path, dpi=DPI, bbox_inches="tight", facecolor="white")
        plt.close(fig)
        written.append(path)
        print(f"wrote {path}", flush=True)
    return written


if __name__ == "__main__":
    main(sys.argv[1:])
