"""The learner's pieces inside the engine: `LLM(model, use_exercises=["ch02", "ch03"])`. All chapters.

Each chapter that builds an engine component plugs the learner's functions (exercises/chNN_*.py, or the
chapter files in `exercises_dir`) in behind the interface the engine's own component has, so that the rest
of the engine runs unchanged around them:

| chapter | your pieces | where they run |
|---|---|---|
| ch02 | RMSNorm, RoPE, causal GQA attention | the model's kernels (norms, rotation); prompts' attention |
| ch03 | slot mapping, attention metadata; K/V store, Triton decode, prefill | the input builder; a backend |
| ch04 | chained block hashes, prefix lookup, freeing | a BlockManager |
| ch05 | the scheduling step (admission, preemption), the sampler | a Scheduler and a Sampler subclass |
| ch06 | graph buckets, padded static inputs, capture/replay (the CPU stand-in) | the decode graphs |
| ch07 | a rank's rows of a weight; the parallel forwards, their collectives | every sharded layer's TPGroup |
| ch09 | n-gram drafts, greedy acceptance, rolling back rejected drafts' blocks | proposer, verify, rollback |
| ch10 | the MoE router (top-k, renormalized), the grouped expert forward | every MoE layer of the model |

This module is the selection: which chapters (`chapters_of`), from which folder (`folder_of`), the process
default `use_exercises()` sets, and `selected()`, which applies that default once, where an engine is built
(nanoengine.launch), into a `PieceSelection` the plan asks capability questions of. It imports nothing from
the engine. The adapters (`ch02.py` .. `ch10.py`, `learner.py`) wrap the learner's functions, and
`nanoengine.engine.parts.assemble` builds the engine's components on them. Chapter 11's engine of your own
takes your 1.3 detokenizer (`ch01.py`) and your chapter 05 pieces (`your_engine.py`), is traced from outside
(`traced.py`), and runs with every piece you have done (`all_pieces.py`).

An untouched stub is an error naming its exercise when the engine is built, never a quiet fallback to the
engine's code. In a notebook, `nanoengine.pieces.use_exercises("ch02")` makes every `LLM` built afterwards
use them (or `with use_exercises(...):` for a block). `nanoengine.check("chNN")` ends with the capstone:
the engine's greedy text on your pieces must equal its text on its own (`pieces/capstone.py`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoengine.errors import InvalidTypeError, InvalidValueError

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = {
    "ch02": "RMSNorm, RoPE and causal GQA attention in the model's forward",
    "ch03": "slot mapping and attention metadata, K/V store, paged decode (a Triton kernel; your 3.6 without "
            "triton) and prefill attention",
    "ch04": "chained block hashes, prefix-cache lookup and freeing in the block manager",
    "ch05": "the scheduling step with admission and preemption, and the sampler",
    "ch06": "graph buckets, padded static inputs and stand-in graph capture/replay for decode steps (CPU)",
    "ch07": "a rank's shard of each weight, and the column-, row- and vocab-parallel forwards with their "
            "collectives",
    "ch09": "speculative decoding's n-gram proposer, acceptance rule and block rollback (needs "
            "speculative_config)",
    "ch10": "the mixture-of-experts router (top-k with renormalization) and the grouped expert forward "
            "(needs an MoE model, e.g. tiny-qwen3-moe)",
}
# the functions of each chapter file that the pieces call (checked at once when an engine is built)
PIECES = {
    "ch02": ("rms_norm", "apply_rope", "causal_gqa_attention"),
    "ch03": ("batch_slot_mapping", "attention_metadata", "store_kv", "paged_decode_kernel",
             "triton_paged_decode", "paged_prefill_attention"),
    "ch04": ("prefix_block_hashes", "count_cached_tokens", "PrefixCachingAllocator.free"),
    "ch05": ("admit_prompts", "preempt_until_fits", "schedule", "process_logits", "sample"),
    "ch06": ("graph_buckets", "pick_bucket", "load_static", "StandInGraphs.__init__", "StandInGraphs.capture",
             "StandInGraphs.replay"),
    "ch07": ("shard_merged_rows", "column_parallel_forward", "row_parallel_forward",
             "vocab_parallel_embedding_forward"),
    "ch09": ("propose_ngram", "accept_greedy", "rollback_blocks"),
    "ch10": ("route", "grouped_experts"),
}
# pieces inside the model's forward (their Python may read tensors on the host): eager torch-family attention,
# no torch.compile, no CUDA graphs; the backends each can plug into, the first being the default
FORWARD_CHAPTERS = {"ch02": ("torch", "cpu"), "ch03": ("torch",), "ch10": ("torch", "cpu")}
GRAPH_CHAPTERS = ("ch06",)  # pieces that bring their own decode graphs (the CPU stand-in)
SPEC_CHAPTERS = ("ch09",)  # pieces that run only while speculating (speculative_config)
MOE_CHAPTERS = ("ch10",)  # pieces that run only in a mixture-of-experts model's layers
SCHEDULE_CHAPTERS = ("ch05",)  # pieces that replace the scheduler's pass (they know nothing of drafts)
BACKEND_ORDER = ("torch", "cpu")  # the attention backends pieces plug into, by preference


def chapters_of(value: Any) -> tuple[str, ...]:
    """Normalize use_exercises ("ch02", ["ch02", 3], ...) to ("ch02", "ch03"), or raise naming the fix."""
    if value is None or value is False:
        return ()
    items = [value] if isinstance(value, (str, int)) and not isinstance(value, bool) else value
    if not isinstance(items, (list, tuple)):
        raise InvalidTypeError("use_exercises must be a chapter or a list of chapters like ['ch02', 'ch03'], "
                               f"got {value!r}")
    out = []
    for item in items:
        m = (re.fullmatch(r"(?:ch)?(\d{1,2})", str(item).strip().lower())
             if not isinstance(item, bool) else None)
        name = f"ch{int(m.group(1)):02d}" if m else None
        if name not in CHAPTERS:
            raise InvalidValueError(f"use_exercises: {item!r} is not a chapter with engine pieces; "
                                    f"choose from {', '.join(CHAPTERS)} "
                                    f"({'; '.join(f'{k}: {v}' for k, v in CHAPTERS.items())})")
        if name not in out:
            out.append(name)
    return tuple(sorted(out))


IMPL_VARIABLE = "NANOENGINE_IMPL"  # which chapter files the book runs: the test suite sets it to "solutions"


def default_impl() -> str:
    """The chapter files a learner's code is taken from when nothing says: "exercises", or what the
    NANOENGINE_IMPL variable names ("solutions", or a folder), which is how the test suite runs the book on
    the reference answers without a line of plumbing in a chapter's cells."""
    return os.environ.get(IMPL_VARIABLE) or "exercises"


def folder_of(exercises_dir: Any) -> Path:
    """The folder the chapter files come from: `default_impl()` when None; 'solutions' or 'exercises' by
    name, or a folder."""
    if exercises_dir is None:
        exercises_dir = default_impl()
    if str(exercises_dir) in ("exercises", "solutions") and not Path(exercises_dir).is_dir():
        return ROOT / str(exercises_dir)
    path = Path(exercises_dir).expanduser().resolve()
    if not path.is_dir():
        raise InvalidValueError(f"exercises_dir={str(exercises_dir)!r} is not a folder; point it at the "
                                f"folder with your chNN_*.py files (default {ROOT / 'exercises'})")
    return path


# what `use_exercises()` set for this process: the default of every LLM that does not say
_default: dict[str, Any] = {"chapters": (), "exercises_dir": None}


class use_exercises:
    """From now on (or inside `with`), every LLM runs on your pieces of these chapters
    unless it says otherwise.

        nanoengine.pieces.use_exercises(["ch02", "ch03"])   # or use_exercises("ch02", exercises_dir=...)
    """

    def __init__(self, chapters: Any, exercises_dir: str | Path | None = None) -> None:
        self.previous = dict(_default)
        chosen = chapters_of(chapters)
        folder = str(folder_of(exercises_dir)) if chosen else None
        _default.update(chapters=chosen, exercises_dir=folder)
        names = ", ".join(chosen) or "none (the engine's own pieces)"
        print(f"LLMs built from now on use your pieces of: {names}" + (f" (from {folder})" if chosen else ""))

    def __enter__(self) -> use_exercises:
        return self

    def __exit__(self, *exc: Any) -> None:
        _default.clear()
        _default.update(self.previous)


def selected(chapters: Any = None, exercises_dir: Any = None) -> PieceSelection:
    """The pieces an engine is built with: `chapters` (EngineConfig.use_exercises) and `exercises_dir`, where
    chapters=None takes what `use_exercises()` set for this process. Called once, where the engine is
    built."""
    if chapters is None:
        chapters, exercises_dir = _default["chapters"], exercises_dir or _default["exercises_dir"]
    chosen, folder = checked_option(chapters, exercises_dir)
    return PieceSelection(chosen, folder or str(folder_of(None))) if chosen else NO_PIECES


def checked_option(chapters: Any, exercises_dir: Any) -> tuple[tuple[str, ...] | None, str | None]:
    """EngineConfig's use_exercises and exercises_dir, normalized (chapters None stays None: not said) and
    checked: a folder with no chapters is an error."""
    chosen = None if chapters is None else chapters_of(chapters)
    folder = None if exercises_dir is None else str(folder_of(exercises_dir))
    if chosen == () and folder is not None:
        raise InvalidValueError("exercises_dir is set but use_exercises is empty; name the chapters whose "
                                "pieces to use, e.g. use_exercises=['ch02']")
    return chosen, folder


@dataclass(frozen=True)
class PieceSelection:
    """Which chapters' pieces an engine runs on, and from which folder; plain data, so a worker process
    rebuilds the same pieces from it (nanoengine.engine.parts). The engine's plan asks it what the pieces
    need (`forward_pieces`, `graph_pieces`, `attention_backends`), never for chapter names."""
    chapters: tuple[str, ...] = ()
    folder: str | None = None

    def __bool__(self) -> bool:
        return bool(self.chapters)

    @property
    def option(self) -> str:
        """How the user asked for them, for messages: "use_exercises=['ch02', 'ch03']"."""
        return f"use_exercises={list(self.chapters)}"

    @property
    def forward_pieces(self) -> tuple[str, ...]:
        """The chosen chapters whose pieces run inside the model's forward: they need eager attention of the
        torch family, and neither torch.compile nor CUDA graphs."""
        return tuple(c for c in self.chapters if c in FORWARD_CHAPTERS)

    @property
    def graph_pieces(self) -> tuple[str, ...]:
        """The chosen chapters that bring their own decode graphs (a CPU stand-in of CUDA graphs)."""
        return tuple(c for c in self.chapters if c in GRAPH_CHAPTERS)

    @property
    def schedule_pieces(self) -> tuple[str, ...]:
        """The chosen chapters whose pieces schedule each step themselves (speculative decoding needs the
        engine's own pass, which gives a decode its drafts)."""
        return tuple(c for c in self.chapters if c in SCHEDULE_CHAPTERS)

    @property
    def spec_pieces(self) -> tuple[str, ...]:
        """The chosen chapters whose pieces run only with speculative decoding on."""
        return tuple(c for c in self.chapters if c in SPEC_CHAPTERS)

    @property
    def moe_pieces(self) -> tuple[str, ...]:
        """The chosen chapters whose pieces run only in a mixture-of-experts model's layers."""
        return tuple(c for c in self.chapters if c in MOE_CHAPTERS)

    @property
    def attention_backends(self) -> tuple[str, ...]:
        """The attention backends the forward pieces plug into (every one of them), the default first."""
        allowed = [b for b in BACKEND_ORDER if all(b in FORWARD_CHAPTERS[c] for c in self.forward_pieces)]
        return tuple(allowed)


NO_PIECES = PieceSelection()  # the engine's own
