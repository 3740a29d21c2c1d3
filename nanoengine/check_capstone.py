"""A chapter's capstone in check(): once every exercise of a chapter with pieces passes, the engine on the
learner's pieces must give the engine's own greedy text (`add_capstone`); a failed row names the piece most
likely at fault, from what differs (`suspect`, by the rules in SUSPECTS). Chapter: all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoengine.check import ChapterResult

_STUB = re.compile(r"Exercise (\d+\.\d+):")


# The piece of a chapter most likely at fault when its capstone differs while every exercise test passes, by
# what differs: "first" (a prompt's first generated token: the prompt's forward), "later" (a token after the
# first: decode steps), what the row says of the schedule or the pool ("prefix-hit tokens", "preemptions",
# "blocks in use", "sequences", "prefill tokens", "decode tokens"), or "other" (over the budget, too many
# steps). Each rule: the pieces, most likely first, and why.
SUSPECTS: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "ch02": {"first": (("causal_gqa_attention", "apply_rope", "rms_norm"),
                       "a prompt's first token comes from its forward, where all three of yours run"),
             "later": (("apply_rope", "rms_norm"),
                       "later tokens come from decode steps: your norms and RoPE (at positions past the "
                       "prompt) run there, the attention is the engine's paged one")},
    "ch03": {"first": (("paged_prefill_attention", "store_kv", "batch_slot_mapping", "attention_metadata"),
                       "a prompt that continues a cached prefix (a prefix hit, or its second chunk) attends "
                       "over the blocks your store filled, with your prefill attention"),
             "later": (("paged_decode_kernel", "store_kv", "batch_slot_mapping", "attention_metadata"),
                       "tokens after the first come from decode steps: your kernel (3.6 without triton) "
                       "over the slots your 3.1 chose")},
    "ch04": {"prefix-hit tokens": (("count_cached_tokens", "prefix_block_hashes"),
                                   "how many tokens hit is your lookup's answer, over your hashes"),
             "blocks in use": (("PrefixCachingAllocator.free",),
                               "blocks in use change when your free keeps them or gives them back"),
             "preemptions": (("PrefixCachingAllocator.free",),
                             "a pool that runs out early has blocks your free did not give back"),
             "first": (("prefix_block_hashes", "count_cached_tokens"),
                       "a prompt read another prefix's K/V: a hash that does not chain the whole prefix, or "
                       "a lookup that counts a block whose tokens differ"),
             "other": (("count_cached_tokens", "prefix_block_hashes"),
                       "a step's token counts start from your lookup's hits")},
    "ch05": {"prefix-hit tokens": (("admit_prompts", "schedule"),
                                   "admission, with its prefix hits, is 5.0's, called by 5.2"),
             "preemptions": (("preempt_until_fits", "schedule"), "preemption is 5.1's, called by 5.2"),
             "blocks in use": (("preempt_until_fits", "schedule", "admit_prompts"),
                               "blocks are taken and given back there"),
             "first": (("sample", "process_logits"), "same schedule, other tokens: the sampler (greedy)"),
             "later": (("sample", "process_logits"), "same schedule, other tokens: the sampler (greedy)"),
             "other": (("schedule", "admit_prompts", "preempt_until_fits"),
                       "a step's sequences and token counts are 5.2's, its admissions 5.0's")},
    "ch06": {"later": (("load_static", "StandInGraphs.replay", "pick_bucket", "graph_buckets"),
                       "decode steps replay your graphs: a padding row that writes, or a stale static input"),
             "other": (("pick_bucket", "StandInGraphs.replay"), "the steps your graphs replay")},
    "ch07": {"first": (("shard_merged_rows", "row_parallel_forward", "column_parallel_forward",
                        "vocab_parallel_embedding_forward"),
                       "every token runs through your shards and collectives on both ranks")},
    "ch09": {"decode tokens": (("propose_ngram",), "a decode step's tokens include the drafts proposed"),
             "blocks in use": (("rollback_blocks",), "rejected drafts' blocks are given back by your 9.4"),
             "later": (("accept_greedy", "propose_ngram"),
                       "a token that differs after drafting is a draft kept that the model did not choose"),
             "other": (("accept_greedy", "propose_ngram", "rollback_blocks"),
                       "accepted drafts decide how far each step moves")},
    "ch10": {"first": (("route", "grouped_experts"),
                       "every token of every MoE layer is routed by your 10.1 and computed by your 10.2")},
}
_TOKEN_DIFF = re.compile(r"generated token (\d+) differs")
# what a failed capstone row says -> the symptom it is; a row may name several, read in their order
_SYMPTOMS = (("prefix-hit tokens", "prefix-hit tokens"), ("preemptions", "preemptions"),
             ("blocks in use", "blocks in use"), ("blocks of a pool", "blocks in use"),
             ("still held", "blocks in use"), ("decode tokens", "decode tokens"),
             ("prefill tokens", "prefill tokens"), ("sequences", "sequences"), ("over the budget", "other"),
             (" steps", "other"))


def _exercise_numbers(impl_dir: Path, chapter: str) -> dict[str, str]:
    """Function (or "Class.method") -> its exercise ("4.3"), from the docstrings of the chapter file."""
    numbers: dict[str, str] = {}
    for path in sorted(impl_dir.glob(f"{chapter}_*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in tree.body:
            inner = [(f"{node.name}.{n.name}", n) for n in getattr(node, "body", [])
                     if isinstance(node, ast.ClassDef) and isinstance(n, ast.FunctionDef)]
            for name, fn in [(getattr(node, "name", ""), node), *inner]:
                if isinstance(fn, (ast.FunctionDef, ast.ClassDef)):
                    m = _STUB.match(ast.get_docstring(fn) or "")
                    if m:
                        numbers.setdefault(name, m.group(1))
    return numbers


def suspect(chapter: str, detail: str, impl_dir: Path) -> str:
    """The pieces most likely at fault for a capstone row that failed (`detail`), most likely first, and why;
    "" when the detail already names an exercise (a piece that raised) or the chapter has no rule."""
    if re.search(r"Exercise \d+\.\d+", detail):
        return ""
    token = _TOKEN_DIFF.search(detail)
    rules = SUSPECTS.get(chapter, {})
    symptoms = ["first" if token and token.group(1) == "0" else "later"] if token else []
    if not token:
        found = sorted((detail.find(phrase), symptom) for phrase, symptom in _SYMPTOMS if phrase in detail)
        symptoms += [symptom for _, symptom in found]
    rule = next((rules[s] for s in symptoms if s in rules), None)
    if rule is None and token:  # a chapter whose pieces run in both: its one rule for tokens
        rule = rules.get("first" if "later" in symptoms else "later")
    rule = rule or rules.get("other")
    if rule is None:
        return ""
    numbers = _exercise_numbers(impl_dir, chapter)
    names = [f"{numbers[n]} ({n})" if n in numbers else n for n in rule[0]]
    then = f", then {', '.join(names[1:])}" if names[1:] else ""
    return f"most likely at fault: your {names[0]}{then}: {rule[1]}"


_CAPSTONES: dict[tuple, Any] = {}  # source stamps -> the capstone of a chapter whose tests all passed


def add_capstone(result: ChapterResult, impl_dir: Path, key: tuple) -> None:
    """Once every exercise passes, run the chapter's capstone:
    LLM on the learner's pieces == LLM on its own."""
    from nanoengine.pieces import CHAPTERS

    if result.chapter not in CHAPTERS:
        result.capstone_note = (f"{result.chapter} plugs no piece into the engine (chapters "
                                f"{', '.join(CHAPTERS)} do: LLM(model, use_exercises=[...]))")
        return
    if not result.passed:
        result.capstone_note = (f"once every {result.chapter} exercise passes, the engine runs on your "
                                "pieces here and must give its own greedy text")
        return
    if key not in _CAPSTONES:
        from nanoengine.pieces.capstone import capstone

        _CAPSTONES.clear()
        _CAPSTONES[key] = capstone(result.chapter, impl_dir)
    result.capstone = _CAPSTONES[key]
    result.suspects = [suspect(result.chapter, detail, impl_dir) for _, ok, detail in result.capstone.rows
                       if not ok]
