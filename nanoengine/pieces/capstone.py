"""The capstone of a chapter: the engine on your pieces gives the same greedy text as the engine on its
own, with outcomes judged on behaviour (see `outcome_problem`). Chapters 02-07, 09 and 10
(`nanoengine.check("chNN")` runs it once every exercise passes).

One fixed workload per model (fp32, tiny-qwen3 and smollm2-135m): prompts that share a long prefix (prefix-
cache hits), a token budget small enough to chunk the prefills, and a KV pool small enough to preempt. Both
runs are greedy, so every token must match; the outcomes must hold too, which catch a piece that is wrong
without changing the text (a prefix lookup that never hits, a scheduler that leaves its budget unused or
keeps blocks): no step over the budget or the pool, every block back, prefix hits where the engine has them,
steps within half again the engine's. The schedule step by step is not compared: another valid policy
passes. Chapter 07 runs your sharding in
two processes (tensor_parallel_size=2, over gloo) against the engine in one, on tiny-qwen3 only (SmolLM2's
9 heads do not split in two). Chapter 03 decodes with your Triton kernel (3.8); without a GPU that runs in
Triton's interpreter, so there it runs tiny-qwen3 only; where triton is not installed it decodes with your 3.6
(`online_decode_attention`). Chapter 09 speculates (n-gram, k = 3) on both sides: the
engine's reference run speculates too, and the greedy text must also equal the engine's without speculation
(exactness), with some drafts accepted. Chapter 10 runs tiny-qwen3-moe, the one model whose layers route.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from nanoengine.pieces import CHAPTERS

MODELS = ("tiny-qwen3", "smollm2-135m")
PREFIX = ("You are a careful assistant. Answer in one short sentence, and say so when you do not know. "
          "Here is the question: ")
PROMPTS = [PREFIX + "What is the capital of France?", PREFIX + "Why is the sky blue?",
           "def fibonacci(n):", PREFIX + "Name a prime number larger than ten."]
# without overlap scheduling: the schedule is compared step by step, and with overlap the engine's own
# scheduler skips a sequence whose pending token ends it (pending.ends_at_length); exercise 5.2's does not
WORKLOAD = dict(dtype="float32", max_num_batched_tokens=40, num_kvcache_blocks=8, block_size=16,
                async_scheduling=False)
MAX_TOKENS = 16
# options the engine runs with on both sides: ch07's two ranks; ch09's speculation (its reference runs the
# engine's own proposer with the same options, and its greedy text must also equal the engine's without it;
# row_cost fixed: with the measured cost, which steps draft would depend on each run's timing)
# ch03's pieces meet only what chapter 03 teaches: whole prompts (a budget no prompt is chunked by) and no
# prefix cache (chapter 04), on both sides
CHAPTER_OPTIONS = {"ch03": dict(enable_prefix_caching=False, max_num_batched_tokens=256),
                   "ch07": dict(tensor_parallel_size=2),
                   "ch09": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                    "row_cost": 0.15})}
# options the reference run takes too (tensor parallelism gives the same tokens as one rank: not these)
REFERENCE_OPTIONS = ("speculative_config", "enable_prefix_caching", "max_num_batched_tokens")
# ch10's pieces run only in a mixture-of-experts model's layers
CHAPTER_MODELS = {"ch07": ("tiny-qwen3",), "ch10": ("tiny-qwen3-moe",)}
# chapter 03 decodes with the learner's Triton kernel (3.8), which without a GPU runs in Triton's interpreter
# (or, without triton, with the learner's 3.6, a Python loop over blocks): there SmolLM2's 30 layers take
# about 90 s, tiny-qwen3's 2 about 5 s, so a CPU checks tiny-qwen3 only
INTERPRETED_MODELS = {"ch03": ("tiny-qwen3",)}
PACKAGE = Path(__file__).resolve().parents[1]  # nanoengine/


def reference_file(model: str, options: dict | None = None) -> Path:
    """Where the engine's own run of the workload is kept: one file per model, engine source, torch build,
    machine and chapter options (the run is deterministic given those), so each chapter's capstone runs only
    the learner's side."""
    import torch

    from nanoengine import assets

    h = hashlib.sha1()
    for f in sorted(PACKAGE.rglob("*.py")) + sorted(PACKAGE.rglob("*.cpp")) + sorted(PACKAGE.rglob("*.h")):
        h.update(f.read_bytes())
    folder = assets.resolve_model(model)
    for f in sorted(folder.iterdir()):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    h.update(repr((PROMPTS, WORKLOAD, MAX_TOKENS, torch.__version__, platform.machine(), platform.processor(),
                   torch.backends.cpu.get_cpu_capability())).encode())
    if options:  # (none: the file name every chapter without options shares)
        h.update(json.dumps(options, sort_keys=True).encode())
    return assets.home() / "capstone" / f"{Path(model).name}-{h.hexdigest()[:16]}.json"


def reference(model: str, options: dict | None = None) -> tuple[list[list[int]], list[tuple]]:
    """The engine's own run of the workload on `model` (with a chapter's options): (token ids per prompt,
    per-step schedule)."""
    path = reference_file(model, options)
    if path.is_file():
        kept = json.loads(path.read_text())
        return kept["token_ids"], [tuple(step) for step in kept["steps"]]
    ids, steps, _ = run_workload(model, use_exercises=(), **(options or {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"token_ids": ids, "steps": steps}))
    tmp.replace(path)
    return ids, steps


@dataclass
class CapstoneResult:
    chapter: str
    rows: list[tuple[str, bool, str]] = field(default_factory=list)  # (model, equal, detail)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(ok for _, ok, _ in self.rows)


def run_workload(model: str, **options) -> tuple[list[list[int]], list[tuple], object]:
    """(token ids per prompt, the per-step schedule, the LLM) of the fixed workload."""
    from nanoengine import LLM, SamplingParams

    with LLM(model, **{**WORKLOAD, **options}) as llm:  # closing stops tensor-parallel workers
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    steps = [(s.num_seqs, s.prefill_tokens, s.decode_tokens, s.used_blocks, s.cache_hit_tokens,
              s.num_preempted) for s in llm.engine.stats]
    return [list(o.outputs[0].token_ids) for o in outs], steps, llm


STEP_FIELDS = ("sequences", "prefill tokens", "decode tokens", "blocks in use", "prefix-hit tokens",
               "preemptions")


def first_difference(tok, got_ids: list[list[int]], want_ids: list[list[int]], whose: str) -> str | None:
    """A message naming the first token where two runs' texts differ, or None when they are equal."""
    for p, (got, want) in enumerate(zip(got_ids, want_ids)):
        if got != want:
            i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return (f"prompt {p} ({PROMPTS[p][-24:]!r}): generated token {i} differs: yours "
                    f"{tok.decode(got[i:i + 1])!r}, {whose} {tok.decode(want[i:i + 1])!r}, after "
                    f"{tok.decode(want[:i])!r}")
    return None


def compare(model: str, chapter: str, exercises_dir: Path) -> tuple[bool, str]:
    options = CHAPTER_OPTIONS.get(chapter, {})
    shared = {k: v for k, v in options.items() if k in REFERENCE_OPTIONS}
    want_ids, want_steps = reference(model, shared)
    got_ids, got_steps, llm = run_workload(model, use_exercises=[chapter], exercises_dir=str(exercises_dir),
                                           **options)
    tok = llm.get_tokenizer()
    differs = first_difference(tok, got_ids, want_ids, "the engine's")
    if differs:
        return False, differs
    spec_note = ""
    if "speculative_config" in shared:  # speculation is exact: the same text as decoding without it
        differs = first_difference(tok, got_ids, reference(model)[0], "the engine's without speculation")
        if differs:
            return False, differs
        counts = llm.engine.spec_counts
        if counts.accepted == 0:
            return False, (f"same text, but no draft was accepted ({counts.proposed} proposed): your "
                           "Exercise 9.1 or 9.2 keeps nothing")
        spec_note = f", {counts.accepted} of {counts.proposed} drafts accepted"
    problem = outcome_problem(got_steps, want_steps, llm, {**WORKLOAD, **options}["max_num_batched_tokens"])
    if problem:
        return False, f"same text, but {problem}"
    hits = sum(st[4] for st in got_steps)
    preempted = sum(st[5] for st in got_steps)
    return True, (f"{len(PROMPTS)} prompts x {MAX_TOKENS} tokens equal, in {len(got_steps)} steps (the "
                  f"engine's: {len(want_steps)}; {hits} prefix-hit tokens, {preempted} "
                  f"preemptions{spec_note})")


def outcome_problem(got_steps: list[tuple], want_steps: list[tuple], llm, budget: int) -> str | None:
    """What the run's outcomes get wrong, judged on behaviour (the text is already equal), or None: no step
    over the token budget or the KV pool, every block back at the end, the prefix cache hitting when the
    engine's does, and no more steps than half again the engine's plus 4. Not the engine's step-by-step
    schedule: another valid policy (another victim, another freeing order) passes."""
    pool = WORKLOAD["num_kvcache_blocks"]
    for s, (_, prefill, decode, used, _, _) in enumerate(got_steps):
        if prefill + decode > budget:
            return f"step {s} computed {prefill + decode} tokens, over the budget of {budget}"
        if used > pool:
            return f"step {s} used {used} blocks of a pool of {pool}"
    bm = llm.engine.block_manager
    free, total = getattr(bm, "num_free_blocks", None), getattr(bm, "num_blocks", None)
    if free is not None and total is not None and free != total:
        return f"{total - free} blocks are still held after every request finished (a leak)"
    hits, want_hits = sum(st[4] for st in got_steps), sum(st[4] for st in want_steps)
    if want_hits and not hits:
        return (f"prefix-hit tokens 0 vs the engine's {want_hits}: prompts sharing a {len(PREFIX)}-character "
                "prefix never hit the prefix cache")
    bound = math.ceil(1.5 * len(want_steps)) + 4
    if len(got_steps) > bound:
        return (f"{len(got_steps)} steps, the engine needs {len(want_steps)}: at most {bound} (half again "
                "the engine's, plus 4) for a scheduler that fills each step's budget")
    return None


def default_models(chapter: str) -> tuple[str, ...]:
    """The models a chapter's capstone runs on here."""
    import torch

    if chapter in INTERPRETED_MODELS and not torch.cuda.is_available():
        return INTERPRETED_MODELS[chapter]
    return CHAPTER_MODELS.get(chapter, MODELS)


def capstone(chapter: str, exercises_dir: Path, models: tuple[str, ...] | None = None) -> CapstoneResult:
    """Run the chapter's capstone: the fixed workload on your pieces vs on the engine's own, per model."""
    models = models or default_models(chapter)
    if chapter not in CHAPTERS:
        raise ValueError(f"{chapter} plugs no pieces into the engine; chapters with pieces: "
                         f"{', '.join(CHAPTERS)}")
    result = CapstoneResult(chapter)
    for model in models:
        t0 = time.perf_counter()
        try:
            ok, detail = compare(model, chapter, exercises_dir)
        except Exception as e:  # a learner's piece failing inside the engine is a result, not a crash
            ok, detail = False, f"{type(e).__name__}: {e}"
        result.rows.append((model, ok, f"{detail} [{time.perf_counter() - t0:.1f} s]"))
    return result
