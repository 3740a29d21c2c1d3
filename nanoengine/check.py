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
This module keeps check(), run() and the table (ChapterResult); the failure rendering is in check_diff, the
pytest runs in check_runner, the capstone in check_capstone. Chapter: all.
"""

from __future__ import annotations

import re
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoengine import book

# the failure rendering, the pytest runs and the capstone live beside this module; their names stay importable
# from here (`from nanoengine.check import ...`, tests patching `check._start_pytest`: run() reads it here)
from nanoengine.check_capstone import _CAPSTONES, _STUB, SUSPECTS, add_capstone, suspect  # noqa: F401
from nanoengine.check_diff import difference, render_failure, short_ids, split_failure  # noqa: F401
from nanoengine.check_runner import (  # noqa: F401
    _BACKGROUND,
    _COMPLETE,
    _RESULTS,
    TestResult,
    _finish_pytest,
    _forget,
    _full_message,
    _parse_junit,
    _Pytest,
    _start_pytest,
    _stop,
)
from nanoengine.pieces import default_impl
from nanoengine.solution import show_solution  # noqa: F401  (the book's `from nanoengine.check import ...`)

ROOT = Path(__file__).resolve().parents[1]
_EXERCISE = re.compile(r"Exercise (\d+)\.(\d+): (.+?)\.?(?:\"\"\"|''')?\s*$")
_ONE_EXERCISE = re.compile(r"(\d{1,2})\.(\d{1,2})")


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
