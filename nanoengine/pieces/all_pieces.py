"""All your pieces in one engine: chapter 11's last run.

`all_your_pieces()` builds your `MyEngine` (chapter 11) over the engine's model parts with every chapter
whose pieces run in that path plugged in where it is done: your incremental detokenizer (1.3) in every
completion, your RMSNorm, RoPE and attention (chapter 02) and your paged K/V store, decode and prefill
attention (chapter 03) in the model's forward, your prefix cache (chapter 04: hashes, lookup, freeing) in the
block manager, your scheduler, input layout and sampler (chapter 05) in the step. It runs a few greedy text
prompts (sharing a prefix, so the prefix cache hits; a small token budget, so prompts are chunked) and
compares their tokens with the engine's own `LLM` on the same prompts.

Each row of the table it returns says where a piece came from, read from what ran where the run can show it
(the engine's plan for chapters 02-04, each completion's detokenizer for 1.3, the class that ran for
MyEngine) and from your files for chapter 05 (`your_pieces`, what MyEngine runs): "yours", or "the engine's"
(or for MyEngine "the reference's", solutions/) standing in because yours is still a stub. A chapter
plugged into the engine is all or nothing (an untouched stub among its pieces keeps the whole chapter the
engine's); chapter 05's pieces stand in one by one. Chapters 06, 07, 09 and 10 plug in where MyEngine does
not go (decode graphs, tensor parallelism, speculation, MoE layers): their capstones run them in `LLM`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from nanoengine.engine.protocol import METHODS
from nanoengine.pieces import PIECES, ROOT, folder_of
from nanoengine.pieces.learner import _attr, exercise_of, is_stub, load

YOURS = "yours"
ENGINE = "the engine's"
REFERENCE = "the reference's (solutions/)"
PREFIX = "You are a careful assistant inside a small inference engine; answer in one short sentence. "
PROMPTS = [PREFIX + "What is a KV cache?", PREFIX + "Why batch requests?", "Once upon a time",
           PREFIX + "What does a scheduler do?"]
MAX_TOKENS = 10
# the pieces of each plugged chapter that run in MyEngine's path (chapter 03's slot mapping and metadata run
# in LLM's input builder, chapter 04's 4.5 in LLM's scheduler: in MyEngine your 5.3 and 5.2 do those jobs)
IN_MY_ENGINE = {"ch02": ("rms_norm", "apply_rope", "causal_gqa_attention"),
                "ch03": ("store_kv", "paged_decode_kernel", "paged_prefill_attention"),
                "ch04": ("prefix_block_hashes", "count_cached_tokens", "PrefixCachingAllocator.free")}
WHAT = {"ch02": "RMSNorm, RoPE, attention (the model's forward)",
        "ch03": "paged K/V store, decode and prefill attention",
        "ch04": "prefix cache: chained hashes, lookup, freeing"}
CH05 = (("scheduler: admission, preemption", ("5.0", "5.1", "5.2")), ("input layout", ("5.3",)),
        ("sampler", ("5.4", "5.5")))


@dataclass
class PieceRow:
    piece: str
    exercises: str
    source: str  # YOURS, ENGINE, REFERENCE, or "yours; the engine's 5.4"
    detail: str


@dataclass
class AllPiecesRun:
    rows: list[PieceRow]
    tokens: list[list[int]]  # each prompt's greedy tokens on your pieces
    reference: list[list[int]]  # ... on the engine's own LLM
    steps: int
    texts: list[str] = field(default_factory=list)  # each prompt's text, made by your 1.3 (or its stand-in)
    reference_texts: list[str] = field(default_factory=list)

    @property
    def same_tokens(self) -> bool:
        return self.tokens == self.reference

    @property
    def same_text(self) -> bool:
        return self.texts == self.reference_texts

    def source(self, piece: str) -> str:
        return next(r.source for r in self.rows if r.piece == piece or r.exercises == piece)

    def table(self) -> str:
        width = max(len(r.piece) for r in self.rows)
        lines = [f"{'piece':<{width}}  {'exercises':<17} {'from':<28} where it ran / why"]
        lines += [f"{r.piece:<{width}}  {r.exercises:<17} {r.source:<28} {r.detail}" for r in self.rows]
        made = sum(map(len, self.tokens))
        if not self.same_tokens:
            verdict = f"NOT the engine's tokens: {first_difference(self.tokens, self.reference)}"
        elif not self.same_text:
            verdict = f"the same tokens, but NOT the engine's text: {self.text_difference()}"
        else:
            verdict = "the same tokens and text as the engine's own LLM"
        lines.append(f"{len(self.tokens)} prompts, {made} greedy tokens in {self.steps} steps: {verdict}")
        return "\n".join(lines)

    def text_difference(self) -> str:
        p = next(i for i, (a, b) in enumerate(zip(self.texts, self.reference_texts)) if a != b)
        return f"prompt {p}: yours {self.texts[p]!r}, the engine's {self.reference_texts[p]!r} (Exercise 1.3)"

    def __str__(self) -> str:
        return self.table()


def first_difference(got: list[list[int]], want: list[list[int]]) -> str:
    for p, (a, b) in enumerate(zip(got, want)):
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"prompt {p}, token {i}: yours {a[i:i + 3]}..., the engine's {b[i:i + 3]}..."
    return "none"


def stubs(module: ModuleType, names: tuple[str, ...]) -> list[str]:
    """The exercises among the module's `names` that are still stubs (or missing: named as such)."""
    return sorted({exercise_of(_attr(module, n)) if _attr(module, n) is not None else f"{n} (missing)"
                   for n in names if _attr(module, n) is None or is_stub(_attr(module, n))})


def exercises(module: ModuleType, names: tuple[str, ...]) -> str:
    return ", ".join(sorted({exercise_of(_attr(module, n)) for n in names if _attr(module, n) is not None}))


def engine_class_of(folder: Path) -> tuple[type, list[str]]:
    """Your MyEngine, or the reference's while a method of yours is a stub (and which are)."""
    cls = load("ch11", folder).MyEngine
    stubbed = [m for m in ("__init__", *METHODS) if is_stub(getattr(cls, m))]
    if stubbed:
        cls = load("ch11", ROOT / "solutions").MyEngine
    return cls, stubbed


def all_your_pieces(reference: Any = None, model: str = "tiny-qwen3", max_steps: int = 400) -> AllPiecesRun:
    """Your MyEngine on every piece of yours that is done (from your exercises/, or the folder
    NANOENGINE_IMPL names, as MyEngine itself takes them), on PROMPTS, beside `reference` (an LLM of the
    engine's own on `model`; made here when None). Bounded in steps."""
    from nanoengine import LLM, SamplingParams
    from nanoengine.pieces.ch01 import YourDetokenizer
    from nanoengine.pieces.own_engine import model_parts, your_pieces

    folder = folder_of(None)
    rows = []
    modules = {c: load(c, folder) for c in ("ch01", "ch02", "ch03", "ch04")}
    plugged = [c for c in ("ch02", "ch03", "ch04") if not stubs(modules[c], PIECES[c])]
    parts = model_parts(model, num_blocks=64, use_exercises=plugged,
                        exercises_dir=folder if plugged else None)
    engine_class, stubbed = engine_class_of(folder)
    engine = engine_class(parts, max_num_batched_tokens=32, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    requests = [engine.make_request(p, params) for p in PROMPTS]
    for r in requests:
        engine.add(r)
    steps = 0
    while engine.has_unfinished():
        if steps == max_steps:
            raise AssertionError(f"{max_steps} steps and your engine still has unfinished work")
        engine.step()
        steps += 1
    tokens = [list(r.output().outputs[0].token_ids) for r in requests]
    reference = reference or LLM(model, dtype="float32", num_kvcache_blocks=64)
    outs = [o.outputs[0] for o in reference.generate(PROMPTS, params, use_tqdm=False)]

    # 1.3: each completion's detokenizer says whose code made its text
    ch01_stubs = stubs(modules["ch01"], ("detokenize_incrementally",))
    detoks = [c.detokenizer for r in requests for c in r.completions]
    yours = [d for d in detoks if isinstance(d, YourDetokenizer)]
    if yours and len(yours) == len(detoks):
        rows.append(PieceRow("incremental detokenizer", "1.3", YOURS,
                             f"made the text of {len(detoks)} completions, "
                             f"{sum(len(d.token_ids) for d in yours)} tokens pushed"))
    else:
        why = ("your 1.3 is a stub" if ch01_stubs else
               "your 1.3 is done, but your MyEngine does not give it to each completion (Exercise 11.1)")
        rows.append(PieceRow("incremental detokenizer", "1.3", ENGINE, why))

    # chapters 02-04: what the engine's plan was built with
    chapters = parts.llm.engine.plan.pieces.chapters
    for chapter in ("ch02", "ch03", "ch04"):
        left = stubs(modules[chapter], PIECES[chapter])
        numbers = exercises(modules[chapter], IN_MY_ENGINE[chapter])
        if chapter in chapters:
            hits = sum(s.num_cached_tokens for r in requests for s in r.seqs)
            detail = {"ch02": "in every layer's forward", "ch03": f"attention backend "
                      f"{parts.llm.engine.plan.attention_backend}, your cache layout",
                      "ch04": f"{parts.block_manager_class.__name__}, {hits} prefix-hit tokens"}[chapter]
            rows.append(PieceRow(WHAT[chapter], numbers, YOURS, detail))
        else:
            rows.append(PieceRow(WHAT[chapter], numbers, ENGINE,
                                 f"your {', '.join(left)} still stub{'s' if len(left) > 1 else ''}: "
                                 "a chapter plugs in whole"))

    # chapter 05: your_pieces, as MyEngine takes them
    stood_in = your_pieces().stood_in
    for what, numbers in CH05:
        engine_own = [n for n in numbers if n in stood_in]
        source = (YOURS if not engine_own else ENGINE if len(engine_own) == len(numbers)
                  else f"yours; the engine's {', '.join(engine_own)}")
        detail = (f"your {', '.join(engine_own)} still stub{'s' if len(engine_own) > 1 else ''}" if engine_own
                  else "in every step of MyEngine")
        rows.append(PieceRow(what, ", ".join(numbers), source, detail))

    rows.append(PieceRow("MyEngine (the step loop, text, abort)", "11.1-11.3",
                         REFERENCE if stubbed else YOURS,
                         f"your {', '.join(stubbed)} still stubs" if stubbed else
                         f"{Path(sys.modules[engine_class.__module__].__file__).parent.name}/ MyEngine ran "
                         f"{steps} steps"))
    return AllPiecesRun(rows, tokens, [list(o.token_ids) for o in outs], steps,
                        [r.output().outputs[0].text for r in requests], [o.text for o in outs])
