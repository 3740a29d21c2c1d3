"""Run one chapter's exercise tests and print a short pass/fail table. The check cell at the end of every
book chapter (00-10) does:

    from nanoengine.check import check
    check("ch03")

a chapter split into parts of an hour (book/03a_..., 03b_...: nanoengine.book) ends each part with that part's
exercises, `check("ch03a")`, and its last part with the whole chapter's; an inline check cell after an
exercise runs that exercise's tests only: `check("5.2")`. A test that stops at the stub of an exercise it
builds on says so ("5.2 uses your 5.1, still todo"). A failure shows the difference first: "yours" and
"expected" on two aligned lines with the first differing item marked, a dict as the keys that differ, block
hashes as short ids (#5f66a1: the first 6 hex digits of the 64-bit value); then the hint, then the state the
test started from, whole, one part a line. Once all of a chapter's tests pass, the chapter-end check runs its
capstone (chapters 02-07, 09 and 10, `nanoengine.pieces.capstone`): the engine on the learner's pieces must
give the engine's own greedy text, and its last rows say so; when it does not, they name the piece most likely
at fault, from what differs (the first token, a later one, a step's prefix hits, preemptions, blocks or token
counts).

The tests (tests/exercises/test_chNN_*.py) run in a fresh `pytest` subprocess, so edits to your
exercises/ files are always picked up without restarting the kernel. Each exercise's results are reused until
your files or the tests change. The first one-exercise check after a change also runs the rest of the
chapter's tests behind it, in the background, so a Run All costs two pytest processes, not one per exercise.
By default they test your exercises/; `impl="solutions"` tests the reference answers (or set NANOENGINE_IMPL).
"""

from __future__ import annotations

import ast
import atexit
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoengine import book
from nanoengine.pieces import IMPL_VARIABLE, default_impl
from nanoengine.solution import show_solution  # noqa: F401  (the book's `from nanoengine.check import ...`)

ROOT = Path(__file__).resolve().parents[1]
_TEST_NAME = re.compile(r"test_(\d+)_(\d+)_(\w+?)(\[.*\])?$")
_EXERCISE = re.compile(r"Exercise (\d+)\.(\d+): (.+?)\.?(?:\"\"\"|''')?\s*$")
_ONE_EXERCISE = re.compile(r"(\d{1,2})\.(\d{1,2})")
_STUB = re.compile(r"Exercise (\d+\.\d+):")


@dataclass
class TestResult:
    name: str
    exercise: str  # "3.1"
    outcome: str  # "pass", "todo" (NotImplementedError), "fail", "skip" (cannot run here; the message: why)
    message: str = ""


@dataclass
class ChapterResult:
    chapter: str  # "ch03"
    impl: str
    tests: list[TestResult] = field(default_factory=list)
    exercises: dict[str, str] = field(default_factory=dict)  # "3.1" -> title
    error: str = ""  # set when pytest could not run the tests at all
    # the engine on your pieces (nanoengine.pieces.capstone.CapstoneResult), once all pass
    capstone: Any = None
    capstone_note: str = ""  # why there is no capstone run (a chapter without pieces, exercises still to do)
    suspects: list[str] = field(default_factory=list)  # per failed capstone row: the likeliest piece at fault

    def status(self, exercise: str) -> str:
        outcomes = {t.outcome for t in self.tests if t.exercise == exercise}
        if not outcomes:
            return "no test"
        if outcomes == {"pass"}:
            return "PASS"
        if outcomes <= {"pass", "skip"}:
            return "skip"
        return "todo" if outcomes == {"todo"} else "FAIL"

    def __repr__(self) -> str:
        done = sum(self.status(n) == "PASS" for n in self.exercises)
        return f"<{self.chapter}: {done} of {len(self.exercises)} exercises pass ({self.impl})>"

    @property
    def passed(self) -> bool:
        """Every exercise test passed (and, where it ran, the capstone)."""
        tests_pass = (not self.error and bool(self.tests)
                      and all(t.outcome in ("pass", "skip") for t in self.tests))
        return tests_pass and (self.capstone is None or self.capstone.passed)

    def table(self) -> str:
        lines = [f"{self.chapter} exercises ({self.impl})"]
        if self.error:
            return "\n".join(lines + [f"  could not run the tests: {self.error}"])
        numbers = sorted(set(self.exercises) | {t.exercise for t in self.tests},
                         key=lambda s: tuple(int(x) for x in s.split(".")))
        width = max((len(self.exercises.get(n, "")) for n in numbers), default=0)
        width = min(max(width, 10), 60)
        for n in numbers:
            tests = [t for t in self.tests if t.exercise == n]
            ok = sum(t.outcome == "pass" for t in tests)
            title = self.exercises.get(n, "")
            title = title if len(title) <= width else title[: width - 3] + "..."
            lines.append(f"  {n:>5}  {title:<{width}}  {self.status(n):<7} {ok}/{len(tests)} tests")
            needs = sorted({dep for t in tests if t.outcome == "todo" for dep in [_stub_of(t.message)]
                            if dep and dep != n})
            if needs:
                lines.append(f"         -> {n} uses your {', '.join(needs)}, still todo")
            skipped = next((t for t in tests if t.outcome == "skip"), None)
            if skipped is not None and self.status(n) == "skip":
                lines.append(f"         -> skipped: {skipped.message}")
            first_fail = next((t for t in tests if t.outcome == "fail"), None)
            if first_fail is not None:
                lines.extend(render_failure(first_fail.name, first_fail.message))
        done = sum(self.status(n) == "PASS" for n in numbers)
        lines.append(f"{done} of {len(numbers)} exercises pass.")
        if self.capstone is not None:
            lines.append(f"capstone: the engine on your {self.chapter} pieces vs on its own (greedy, fp32)")
            for model, ok, detail in self.capstone.rows:
                lines.append(f"  {model:<14} {'PASS' if ok else 'FAIL':<5} {detail}")
            for note in dict.fromkeys(s for s in self.suspects if s):
                lines.extend(textwrap.wrap(note, 110, initial_indent="  -> ", subsequent_indent=" " * 5))
        elif self.capstone_note:
            lines.append(f"capstone: {self.capstone_note}")
        return "\n".join(lines)


def _stub_of(message: str) -> str | None:
    """The exercise whose untouched stub raised in this test ("5.1"), if the message names one."""
    m = _STUB.search(message)
    return m.group(1) if m else None


def _shorten(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


# A state dump inside a failure message: a bracketed span that opens with words ("[state before: ...",
# "[case 3: ...", "[temperatures ...", "[seq 4: ..."), unlike a value's repr ("[(4, 1, False)]", "[True]").
_DUMP_START = re.compile(r"\[[a-z][a-z_]*[ :]")
_HINT = re.compile(r"This looks like .*?\.(?=\s*(?:This looks like|\(|$))", re.S)
_JUNIT_CUT = re.compile(r"\n\[(?:truncated|\+\d+ more lines?); full report in element text\]$")
LEAD_CHARS = 900  # what is kept of the text between hints, should a difference be a huge repr
SHOWN_WHOLE = 150  # a value's repr up to this long is shown whole beside the other; longer, around the change
# a block hash (a chained 64-bit xxhash, or Python's hash): an integer of 12 digits or more
_HASH = re.compile(r"(?<![\w.#])-?\d{12,}(?![\w.])")
_YOURS = re.compile(r"\byours (?=[\[({])")
_EXPECTED = re.compile(r",? (?:expected|the engine's|the engine) (?=[\[({])")


def short_ids(text: str) -> str:
    """Block hashes (integers of 12 digits or more) as '#' and the first 6 hex digits of their 64-bit value:
    the same hash gets the same id wherever it appears."""
    return _HASH.sub(lambda m: "#" + format(int(m.group(0)) % (1 << 64), "x")[:6], text)


def _full_message(message: str, text: str) -> str:
    """The whole failure message: junit's attribute cuts long ones, its element text (--tb=line: the
    message's lines as "E   ..." or a "file.py:12: ..." line) holds all of it."""
    if not _JUNIT_CUT.search(message) or not text.strip():
        return message
    lines = [line[4:] if line.startswith("E   ") else re.sub(r"^\S+\.py:\d+: ", "", line)
             for line in text.strip().splitlines()]
    return "\n".join(lines)


def _literal_end(text: str, i: int) -> int | None:
    """The end of the bracketed span (a repr, or a state dump) that opens at text[i], or None."""
    if i >= len(text) or text[i] not in "[({":
        return None
    depth, quote, j = 0, "", i
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = ""
        elif c in "'\"" and text[j - 1] in " [({,:":  # a string opens (an apostrophe in a word does not)
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _dumps(text: str) -> list[tuple[int, int]]:
    """(start, end) of each state dump in `text`, brackets balanced."""
    spans, i = [], 0
    while (m := _DUMP_START.search(text, i)) is not None:
        end = _literal_end(text, m.start()) or len(text)
        spans.append((m.start(), end))
        i = end
    return spans


def _top_level_split(text: str, sep: str) -> list[str]:
    """`text` split at each `sep` outside brackets."""
    parts, depth, at = [], 0, 0
    for j, c in enumerate(text):
        depth += {"[": 1, "(": 1, "{": 1, "]": -1, ")": -1, "}": -1}.get(c, 0)
        if depth == 0 and text.startswith(sep, j):
            parts.append(text[at:j])
            at = j + len(sep)
    return [p.strip() for p in [*parts, text[at:]] if p.strip()]


def split_failure(message: str) -> tuple[str, list[str]]:
    """(lead, dumps) of a failure message. The lead is what to read first: the message without its state
    dumps, so the difference and every "This looks like ..." sentence come whole, in the message's order; the
    dumps are the state the test started from, each whole.

    "schedule() at step 19 [state before: ...]: scheduled ...: yours ..., expected .... This looks like ..."
    leads with "schedule() at step 19: scheduled ...: yours ..., expected .... This looks like ...", and the
    state follows it."""
    text = " ".join(message.split()).removeprefix("AssertionError: ")
    dumps = [text[a:b] for a, b in _dumps(text)]
    lead = text
    for dump in dumps:
        lead = lead.replace(dump, "")
    lead = " ".join(lead.split()).replace(" :", ":").replace(" .", ".")
    def cut(piece: str) -> str:  # (only in a pathological case) text that holds no difference to show
        return piece.strip() if _literal_pairs(piece) else _shorten(piece, LEAD_CHARS)

    pieces, at = [], 0
    for m in _HINT.finditer(lead):
        pieces += [cut(lead[at:m.start()]), m.group(0)]
        at = m.end()
    lead = " ".join(p for p in [*pieces, cut(lead[at:])] if p)
    return lead, dumps


def _literal_pairs(text: str) -> list[tuple[int, int, str, str]]:
    """(start, end, yours, expected) of each "yours <repr>, expected <repr>" in `text` (both bracketed)."""
    pairs, i = [], 0
    while (m := _YOURS.search(text, i)) is not None:
        a1 = _literal_end(text, m.end())
        sep = _EXPECTED.match(text, a1) if a1 else None
        b1 = _literal_end(text, sep.end()) if sep else None
        if b1 is None:
            i = m.end()
            continue
        pairs.append((m.start(), b1, text[m.end():a1], text[sep.end():b1]))
        i = b1
    return pairs


def _r(x: Any) -> str:
    return short_ids(repr(x))


def _items(value: Any) -> str:
    """A list's or tuple's repr with block hashes as short ids."""
    inner = ", ".join(_r(x) for x in value)
    return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"


def difference(got: str, want: str) -> list[str]:
    """The lines that show how the repr `got` differs from the repr `want`: both on aligned lines with the
    first differing item marked (a list or tuple), or the keys that differ (a dict)."""
    try:
        g, w = ast.literal_eval(got), ast.literal_eval(want)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        g = w = None
    if isinstance(g, dict) and isinstance(w, dict):
        lines = []
        if len(_r(g)) + len(_r(w)) <= 2 * SHOWN_WHOLE:
            lines += [f"yours    {_r(g)}", f"expected {_r(w)}"]
        keys = [k for k in w if k in g and g[k] != w[k]]
        extra, missing = [k for k in g if k not in w], [k for k in w if k not in g]
        for k in keys[:6]:
            lines.append(f"at {_r(k)}: yours {_r(g[k])}, expected {_r(w[k])}")
        if len(keys) > 6:
            lines.append(f"... and {len(keys) - 6} more keys differ")
        for what, ks, d in (("keys only yours have", extra, g), ("keys yours lack", missing, w)):
            if ks:
                shown = ", ".join(f"{_r(k)}: {_r(d[k])}" for k in ks[:6])
                lines.append(f"{what} ({len(ks)}): {shown}{', ...' if len(ks) > 6 else ''}")
        return lines
    if isinstance(g, (list, tuple)) and isinstance(w, (list, tuple)):
        i = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        whole = max(len(_items(g)), len(_items(w))) <= SHOWN_WHOLE
        lo, hi = (0, max(len(g), len(w))) if whole else (max(0, i - 2), i + 3)
        shown = []
        for v in (g, w):
            s = _items(type(v)(v[lo:hi]))
            s = s[:-1] + ", ...]" if len(v) > hi else s
            shown.append("[..., " + s[1:] if lo else s)
        gs, ws = shown
        prefix = "[..., " if lo else ""
        at = len(prefix or "[") + sum(len(_r(x)) + 2 for x in g[lo:i])
        where = (f"item {i}: yours {_r(g[i]) if i < len(g) else 'nothing'}, expected "
                 f"{_r(w[i]) if i < len(w) else 'nothing'}")
        if len(g) != len(w):
            where += f" (yours has {len(g)} items, expected {len(w)})"
        return [f"yours    {gs}", f"expected {ws}", " " * (9 + at) + "^ " + where]
    a, b = short_ids(got), short_ids(want)
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return [f"yours    {a}", f"expected {b}", " " * (9 + at) + "^"]


def render_failure(name: str, message: str, width: int = 110) -> list[str]:
    """The table's lines for a failed test: the difference (yours and expected aligned) and the hints first,
    whole; then the state the test started from, whole, one part a line."""
    lead, dumps = split_failure(message)
    lines: list[str] = []
    text, first = f"-> {name}: ", True

    def say(words: str) -> None:
        nonlocal first
        if words.strip():
            lines.extend(textwrap.wrap(short_ids(words), width, initial_indent=" " * (9 if first else 12),
                                       subsequent_indent=" " * 12, break_on_hyphens=False))
            first = False

    at = 0
    for start, end, got, want in _literal_pairs(lead):
        if len(got) + len(want) < 60 and not got.startswith("{"):  # a short list reads well inline
            continue
        say(text + lead[at:start].rstrip())
        text = ""
        lines.extend(" " * 14 + line for line in difference(got, want))
        at = end
    say(text + lead[at:].lstrip(" ,;:."))
    for dump in dumps:
        parts = _top_level_split(dump[1:-1], "; ")
        for k, part in enumerate(parts):
            lines.extend(textwrap.wrap(short_ids(part), width, initial_indent=" " * (12 if k == 0 else 14),
                                       subsequent_indent=" " * 16, break_on_hyphens=False))
    if _HASH.search(message):
        lines.append(" " * 12 + "(#5f66a1 and the like: block hashes, by the first 6 hex digits of their "
                     "64-bit value)")
    return lines


def _chapter_files(chapter: str | int) -> tuple[str, list[Path]]:
    m = re.fullmatch(r"(?:ch)?(\d{1,2})", str(chapter).strip().lower())
    if not m:
        raise ValueError(f"chapter {chapter!r}: use 'ch03', '03' or 3 (a part: 'ch03b'; an exercise: '3.4')")
    nn = f"{int(m.group(1)):02d}"
    tests_dir = ROOT / "tests" / "exercises"
    if not tests_dir.is_dir():
        raise FileNotFoundError(f"{tests_dir} not found: nanoengine.check needs the source checkout "
                                "(git clone, then pip install -e .)")
    files = sorted(tests_dir.glob(f"test_ch{nn}_*.py"))
    if not files:
        raise FileNotFoundError(f"no exercise tests for chapter {nn} in {tests_dir}")
    return f"ch{nn}", files


def _exercise_titles(impl_dir: Path, chapter: str) -> dict[str, str]:
    titles: dict[str, str] = {}
    for path in sorted(impl_dir.glob(f"{chapter}_*.py")):
        for line in path.read_text().splitlines():
            m = _EXERCISE.search(line)
            if m and f"{m.group(1)}.{m.group(2)}" not in titles:
                titles[f"{m.group(1)}.{m.group(2)}"] = m.group(3).split(" - see book/")[0]
    return titles


def _parse_junit(path: Path) -> list[TestResult]:
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        m = _TEST_NAME.match(name)
        exercise = f"{m.group(1)}.{m.group(2)}" if m else "?"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            message = _full_message(problem.get("message") or "", problem.text or "")
            outcome = "todo" if "NotImplementedError" in message else "fail"
            results.append(TestResult(name, exercise, outcome, message))
        elif skipped is not None:
            results.append(TestResult(name, exercise, "skip", skipped.get("message") or ""))
        else:
            results.append(TestResult(name, exercise, "pass"))
    return results


# source stamps -> {exercise: its tests' results}, and whether every test of the chapter has run
_RESULTS: dict[tuple, dict[str, list[TestResult]]] = {}
_COMPLETE: set[tuple] = set()
# source stamps -> the run of the rest of the chapter that a one-exercise check started behind it
_BACKGROUND: dict[tuple, Any] = {}


def _forget() -> None:
    """Drop every kept result, and stop a background run whose files have changed."""
    for run in _BACKGROUND.values():
        _stop(run)
    _BACKGROUND.clear()
    _RESULTS.clear()
    _COMPLETE.clear()


atexit.register(_forget)


def _stamp(impl_dir: Path, chapter: str) -> tuple:
    """What a chapter's test results depend on that a learner edits: their files and the tests."""
    paths = [*sorted(impl_dir.glob(f"{chapter}_*.py")), *sorted((ROOT / "tests" / "exercises").glob("*.py"))]
    return (str(impl_dir), chapter, *((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in paths))


def _selector(number: str) -> str:
    """The pytest -k word that selects exercise "5.3"'s tests (test_5_3_*)."""
    return "test_{}_{}_".format(*number.split("."))


def run(chapter: str | int, impl: str | None = None, timeout: float = 600) -> ChapterResult:
    """Run a chapter's exercise tests ("ch05"), one part's ("ch03b": the exercises that part of the book
    sets), or one exercise's only ("5.2"); return the results (check() prints them). Each exercise's results
    are kept until the chapter's exercise files or the tests change. The first check of some exercises after a
    change also starts the rest of the chapter's tests in the background (at a lower priority; stopped if the
    files change again), so that a Run All's inline checks and its part-end table cost two pytest processes,
    not one per exercise. The capstone runs with the whole chapter's check."""
    text = str(chapter).strip().lower()
    one = _ONE_EXERCISE.fullmatch(text)
    part = re.fullmatch(r"(?:ch)?(\d{1,2})([a-z])", text)
    wanted: list[str] = []  # the exercises asked for; [] for the whole chapter
    if one:
        chapter = one.group(1)
        wanted = [f"{int(one.group(1))}.{int(one.group(2))}"]
    elif part:
        chapter = part.group(1)
        wanted = book.part_exercises(f"{int(part.group(1)):02d}{part.group(2)}")
        if not wanted:
            raise ValueError(f"check({text!r}): no part {int(part.group(1)):02d}{part.group(2)} in book/ "
                             f"sets an exercise; the chapter's notebooks are "
                             f"{[p.name for p in book.chapter_notebooks(part.group(1))]}")
    name, files = _chapter_files(chapter)
    impl = impl or default_impl()
    impl_dir = ROOT / impl if impl in ("exercises", "solutions") else Path(impl)
    result = ChapterResult(name + (part.group(2) if part else ""),
                           f"{impl}/" if impl in ("exercises", "solutions") else impl,
                           exercises=_exercise_titles(impl_dir, name))
    key = _stamp(impl_dir, name)
    if key not in _RESULTS:
        _forget()  # keep one chapter's results at a time
        _RESULTS[key] = {}
    done = _RESULTS[key]
    missing = [n for n in wanted if n not in done]
    if key in _BACKGROUND and (missing or not wanted):  # the rest of the chapter: wait for it
        tests, error = _finish_pytest(_BACKGROUND.pop(key), timeout)
        if not error:
            for t in tests:
                done.setdefault(t.exercise, []).append(t)
            _COMPLETE.add(key)
        missing = [n for n in wanted if n not in done]
    if missing and key not in _COMPLETE:
        select = " or ".join(_selector(n) for n in missing)
    elif not wanted and key not in _COMPLETE:
        select = " and ".join(f"not {_selector(n)}" for n in sorted(done))
    else:
        select = None  # nothing left to run
    if select is not None:
        first = not done
        tests, error = _run_pytest(files, impl, timeout, select)
        if error:
            result.tests, result.error = tests, error
            return result
        for n in missing:
            done[n] = []
        for t in tests:
            done.setdefault(t.exercise, []).append(t)
        if not wanted:
            _COMPLETE.add(key)
        elif first:  # the first check since the files changed: run the rest behind it
            rest = " and ".join(f"not {_selector(n)}" for n in missing)
            _BACKGROUND[key] = _start_pytest(files, impl, rest, background=True)
    result.tests = [t for n, ts in done.items() if not wanted or n in wanted for t in ts]
    if wanted:
        result.exercises = {k: v for k, v in result.exercises.items() if k in wanted}
        if part:
            pieces = " and then the engine on your pieces" if name in _chapters_with_pieces() else ""
            result.capstone_note = (f"the whole chapter's check, check(\"{name}\") at the end of its last "
                                    f"part, runs every exercise of it{pieces}")
    else:
        add_capstone(result, impl_dir, key)
    return result


def _chapters_with_pieces() -> dict:
    from nanoengine.pieces import CHAPTERS

    return CHAPTERS


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
    "ch05": {"preemptions": (("preempt_until_fits", "schedule"), "preemption is 5.1's, called by 5.2"),
             "blocks in use": (("preempt_until_fits", "schedule"), "blocks are taken and given back there"),
             "first": (("sample", "process_logits"), "same schedule, other tokens: the sampler (greedy)"),
             "later": (("sample", "process_logits"), "same schedule, other tokens: the sampler (greedy)"),
             "other": (("schedule", "preempt_until_fits"), "a step's sequences and token counts are 5.2's")},
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


@dataclass
class _Pytest:
    """A pytest process started on a chapter's tests, and where its junit file goes."""
    proc: subprocess.Popen
    tmp: tempfile.TemporaryDirectory
    xml: Path


def _start_pytest(files: list[Path], impl: str, select: str = "", background: bool = False) -> _Pytest:
    """Start the chapter's tests (those pytest's -k `select` picks, if given) in a fresh pytest process; a
    background run has a lower CPU priority, so it does not slow the learner's own work."""
    env = dict(os.environ, **{IMPL_VARIABLE: impl}, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    tmp = tempfile.TemporaryDirectory()
    xml = Path(tmp.name) / "results.xml"
    cmd = [sys.executable, "-m", "pytest", *map(str, files), "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", "--tb=line", f"--junitxml={xml}", *(["-k", select] if select else [])]
    nice = (lambda: os.nice(10)) if background and hasattr(os, "nice") else None
    with open(Path(tmp.name) / "output.txt", "w") as out:  # a file, not a pipe: nothing waits on a reader
        # a session of its own: stopping it stops whatever its tests started too (`_stop`)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=nice,
                                start_new_session=hasattr(os, "killpg"))
    return _Pytest(proc, tmp, xml)


def _finish_pytest(run: _Pytest, timeout: float) -> tuple[list[TestResult], str]:
    """Wait for a started run: (results, error); error is "" when pytest ran (selecting no test included)."""
    try:
        run.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(run)
        return [], f"the tests took more than {timeout:.0f} s"
    try:
        if not run.xml.is_file() or run.proc.returncode not in (0, 1, 5):  # 5: no test selected
            output = (run.xml.parent / "output.txt").read_text(errors="replace")
            tail = "\n".join(output.strip().splitlines()[-15:])
            return ((_parse_junit(run.xml) if run.xml.is_file() else []),
                    f"pytest exited with code {run.proc.returncode}:\n{tail}")
        return _parse_junit(run.xml), ""
    finally:
        run.tmp.cleanup()


def _stop(run: _Pytest) -> None:
    """End a run this module started, with every process its tests started (its session), and drop its
    files: a stopped run leaves nothing running beside what comes next."""
    try:
        os.killpg(run.proc.pid, signal.SIGKILL)
    except (AttributeError, ProcessLookupError, PermissionError):  # (no process groups here, or none left)
        if run.proc.poll() is None:
            run.proc.kill()
    run.proc.wait()
    run.tmp.cleanup()


def _run_pytest(files: list[Path], impl: str, timeout: float,
                select: str = "") -> tuple[list[TestResult], str]:
    """The chapter's tests (those pytest's -k `select` picks, if given) in a fresh pytest process: (results,
    error); error is "" when pytest ran (selecting no test included)."""
    return _finish_pytest(_start_pytest(files, impl, select), timeout)


def check(chapter: str | int, impl: str | None = None) -> ChapterResult:
    """Run chapter `chapter`'s exercise tests ("ch05"), or one exercise's ("5.2"), against your exercises/ by
    default, and print a pass/fail table."""
    result = run(chapter, impl)
    print(result.table())
    return result


class _CallableModule(types.ModuleType):
    """`nanoengine.check("ch03")` works as well as `from nanoengine.check import check`."""

    def __call__(self, chapter: str | int, impl: str | None = None) -> ChapterResult:
        return check(chapter, impl)


sys.modules[__name__].__class__ = _CallableModule
