"""The learner's pieces inside the engine: `LLM(model, use_exercises=["ch02", "ch03"])`. All chapters.

Each chapter that builds an engine component plugs the learner's functions (exercises/chNN_*.py, or the
chapter files in `exercises_dir`) in behind the interface the engine's own component has, so that the rest
of the engine runs unchanged around them:

| chapter | your pieces | where they run |
|---|---|---|
| ch02 | RMSNorm, RoPE, causal GQA attention | the model's kernels (every norm and rotation); prompts' attention |
| ch03 | slot mapping and attention metadata; K/V store, paged decode and prefill attention | the input builder; an attention backend |
| ch04 | chained block hashes, prefix lookup, freeing; admitting a prompt | a BlockManager and a Scheduler subclass |
| ch05 | the scheduling step (with preemption), the sampler | a Scheduler and a Sampler subclass |
| ch06 | graph buckets, padded static inputs, capture/replay (the CPU stand-in) | the model runner's decode graphs |
| ch07 | a rank's rows of a weight, its vocabulary shard's lookup | the TPGroup every sharded layer asks |

An untouched stub is an error naming its exercise when the engine is built, never a quiet fallback to the
engine's code. In a notebook, `nanoengine.pieces.use_exercises("ch02")` makes every `LLM` built afterwards
use them (or `with use_exercises(...):` for a block). `nanoengine.check("chNN")` ends with the capstone:
the engine's greedy text on your pieces must equal its text on its own (`pieces/capstone.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from nanoengine.errors import InvalidTypeError, InvalidValueError

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = {
    "ch02": "RMSNorm, RoPE and causal GQA attention in the model's forward",
    "ch03": "slot mapping and attention metadata, K/V store, paged decode and prefill attention",
    "ch04": "chained block hashes, prefix-cache lookup and freeing in the block manager; prompt admission",
    "ch05": "the scheduling step with preemption, and the sampler",
    "ch06": "graph buckets, padded static inputs and stand-in graph capture/replay for decode steps (CPU)",
    "ch07": "a rank's shard of each weight, and its part of the vocab-parallel embedding",
}
# the functions of each chapter file that the pieces call (checked at once when an engine is built)
PIECES = {
    "ch02": ("rms_norm", "apply_rope", "causal_gqa_attention"),
    "ch03": ("batch_slot_mapping", "attention_metadata", "store_kv", "paged_decode_attention",
             "paged_prefill_attention"),
    "ch04": ("prefix_block_hashes", "count_cached_tokens", "PrefixCachingAllocator.free", "admit_prompts"),
    "ch05": ("preempt_until_fits", "schedule", "process_logits", "sample"),
    "ch06": ("graph_buckets", "pick_bucket", "load_static", "StandInGraphs.__init__", "StandInGraphs.capture",
             "StandInGraphs.replay"),
    "ch07": ("shard_merged_rows", "vocab_parallel_embedding"),
}
MODEL_CHAPTERS = ("ch02", "ch03")  # pieces inside the model's forward: eager torch attention, no graphs


def chapters_of(value: Any) -> tuple[str, ...]:
    """Normalize use_exercises ("ch02", ["ch02", 3], ...) to ("ch02", "ch03"), or raise naming the fix."""
    if value is None or value is False:
        return ()
    items = [value] if isinstance(value, (str, int)) and not isinstance(value, bool) else value
    if not isinstance(items, (list, tuple)):
        raise InvalidTypeError(f"use_exercises must be a chapter or a list of chapters like ['ch02', 'ch03'], got "
                               f"{value!r}")
    out = []
    for item in items:
        m = re.fullmatch(r"(?:ch)?(\d{1,2})", str(item).strip().lower()) if not isinstance(item, bool) else None
        name = f"ch{int(m.group(1)):02d}" if m else None
        if name not in CHAPTERS:
            raise InvalidValueError(f"use_exercises: {item!r} is not a chapter with engine pieces; choose from "
                                    f"{', '.join(CHAPTERS)} ({'; '.join(f'{k}: {v}' for k, v in CHAPTERS.items())})")
        if name not in out:
            out.append(name)
    return tuple(sorted(out))


def folder_of(exercises_dir: Any) -> Path:
    """The folder the chapter files come from: exercises/ by default; 'solutions' or 'exercises' by name."""
    if exercises_dir is None:
        return ROOT / "exercises"
    if str(exercises_dir) in ("exercises", "solutions") and not Path(exercises_dir).is_dir():
        return ROOT / str(exercises_dir)
    path = Path(exercises_dir).expanduser().resolve()
    if not path.is_dir():
        raise InvalidValueError(f"exercises_dir={str(exercises_dir)!r} is not a folder; point it at the folder with "
                                f"your chNN_*.py files (default {ROOT / 'exercises'})")
    return path


# what `use_exercises()` set for this process: the default of every LLM that does not say
_default: dict[str, Any] = {"chapters": (), "exercises_dir": None}


class use_exercises:
    """From now on (or inside `with`), every LLM runs on your pieces of these chapters unless it says otherwise.

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


def settle(chapters: Any, exercises_dir: Any) -> tuple[tuple[str, ...], str | None]:
    """EngineConfig's use_exercises and exercises_dir, resolved: None takes use_exercises()' default."""
    if chapters is None:
        chapters, exercises_dir = _default["chapters"], exercises_dir or _default["exercises_dir"]
    chosen = chapters_of(chapters)
    if not chosen:
        if exercises_dir is not None:
            raise InvalidValueError("exercises_dir is set but use_exercises is empty; name the chapters whose "
                                    "pieces to use, e.g. use_exercises=['ch02']")
        return (), None
    return chosen, str(folder_of(exercises_dir))


@dataclass
class Pieces:
    """The learner's chapter modules an engine was configured with, and the components built on them."""
    modules: dict[str, ModuleType]

    @classmethod
    def for_config(cls, config: Any) -> Pieces | None:
        if not config.use_exercises:
            return None
        from nanoengine.pieces import learner

        folder = Path(config.exercises_dir)
        modules = {ch: learner.load(ch, folder) for ch in config.use_exercises}
        learner.check_done([(modules[ch], name, ch) for ch in modules for name in PIECES[ch]])
        return cls(modules)

    def attention_backend(self, base: type) -> type:
        from nanoengine.pieces import ch02, ch03

        if "ch03" in self.modules:
            base = ch03.with_paged_kv(base, self.modules["ch03"])
        if "ch02" in self.modules:
            base = ch02.with_prompt_attention(base, self.modules["ch02"])
        return base

    def kernels(self, engine_kernels: Any, hf_config: Any) -> Any:
        if "ch02" not in self.modules:
            return engine_kernels
        from nanoengine.models.hf_config import rope_theta
        from nanoengine.pieces import ch02

        return ch02.Kernels(self.modules["ch02"], rope_theta(hf_config))

    def attention_metadata(self):
        if "ch03" not in self.modules:
            return None
        from nanoengine.pieces import ch03

        return ch03.attention_metadata(self.modules["ch03"])

    def block_manager_class(self, engine_class: type) -> type:
        if "ch04" not in self.modules:
            return engine_class
        from nanoengine.pieces import ch04

        return ch04.block_manager_class(self.modules["ch04"])

    def scheduler_class(self, engine_class: type) -> type:
        from nanoengine.pieces import ch04, ch05

        if "ch04" in self.modules:  # your admission pass (4.5)
            engine_class = ch04.scheduler_class(self.modules["ch04"], engine_class)
        if "ch05" in self.modules:  # your whole scheduling step (5.2), which admits by itself
            engine_class = ch05.scheduler_class(self.modules["ch05"], engine_class)
        return engine_class

    def graphs(self, engine_graphs: Callable[[], Any], *args: Any) -> Any:
        """The decode graphs: yours (ch06) built with the runner's (forward, max_num_seqs, max_blocks,
        hidden_size, block_size, dtype), else the engine's `engine_graphs()`."""
        if "ch06" not in self.modules:
            return engine_graphs()
        from nanoengine.pieces import ch06

        return ch06.LearnerGraphs(self.modules["ch06"], *args)

    def tp_group(self, group: Any) -> Any:
        if "ch07" not in self.modules:
            return group
        from nanoengine.pieces import ch07

        return ch07.tp_group(self.modules["ch07"], group)

    def sampler(self, engine_sampler: Any, seed: int) -> Any:
        if "ch05" not in self.modules:
            return engine_sampler
        from nanoengine.pieces import ch05

        return ch05.LearnerSampler(self.modules["ch05"], seed)
