"""Run one chapter's exercise tests and print a short pass/fail table. The check cell at the end of every
book chapter (00-10) does:

    from nanoengine.check import check
    check("ch03")

and an inline check cell after an exercise shows that exercise's tests: `check("5.2")`. A test that stops at
the stub of an exercise it builds on says so ("5.2 uses your 5.1, still todo"). Once all of a chapter's tests
pass, the chapter-end check runs its capstone (chapters 02-07, 09 and 10, `nanoengine.pieces.capstone`): the
engine on the learner's pieces must give the engine's own greedy text, and its last rows say so.

The tests (tests/exercises/test_chNN_*.py) run in a fresh `pytest` subprocess, so edits to your
exercises/ files are always picked up without restarting the kernel; the results of a run are reused until
your files or the tests change. By default they test your
exercises/; `impl="solutions"` tests the reference answers (or set NANOENGINE_IMPL).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
DUMP_CHARS = 240  # what is kept of a state dump; the difference and the hints are never cut
LEAD_CHARS = 900  # what is kept of the text between hints, should a difference be a huge repr


def _full_message(message: str, text: str) -> str:
    """The whole failure message: junit's attribute cuts long ones, its element text (--tb=line: the
    message's lines as "E   ..." or a "file.py:12: ..." line) holds all of it."""
    if not _JUNIT_CUT.search(message) or not text.strip():
        return message
    lines = [line[4:] if line.startswith("E   ") else re.sub(r"^\S+\.py:\d+: ", "", line)
             for line in text.strip().splitlines()]
    return "\n".join(lines)


def _dumps(text: str) -> list[tuple[int, int]]:
    """(start, end) of each state dump in `text`, brackets balanced."""
    spans, i = [], 0
    while (m := _DUMP_START.search(text, i)) is not None:
        depth, j = 0, m.start()
        for j in range(m.start(), len(text)):
            depth += {"[": 1, "]": -1}.get(text[j], 0)
            if depth == 0:
                break
        spans.append((m.start(), j + 1))
        i = j + 1
    return spans


def split_failure(message: str) -> tuple[str, str]:
    """(lead, detail) of a failure message. The lead is what to read first: the message without its state
    dumps, so the difference and every "This looks like ..." sentence come whole, in the message's order; the
    detail is the state dumps, each cut to DUMP_CHARS.

    "schedule() at step 19 [state before: ...]: scheduled ...: yours ..., expected .... This looks like ..."
    leads with "schedule() at step 19: scheduled ...: yours ..., expected .... This looks like ...", and the
    state follows it."""
    text = " ".join(message.split()).removeprefix("AssertionError: ")
    dumps = [text[a:b] for a, b in _dumps(text)]
    lead = text
    for dump in dumps:
        lead = lead.replace(dump, "")
    lead = " ".join(lead.split()).replace(" :", ":").replace(" .", ".")
    pieces, at = [], 0
    for m in _HINT.finditer(lead):  # cut (only in a pathological case) what lies between the hints
        pieces += [_shorten(lead[at:m.start()], LEAD_CHARS), m.group(0)]
        at = m.end()
    lead = " ".join(p for p in [*pieces, _shorten(lead[at:], LEAD_CHARS)] if p)
    detail = " ".join(d if len(d) <= DUMP_CHARS else d[:DUMP_CHARS - 5] + " ...]" for d in dumps)
    return lead, detail


def render_failure(name: str, message: str, width: int = 110) -> list[str]:
    """The table's lines for a failed test: the difference and the hints first, whole; then the detail."""
    lead, detail = split_failure(message)
    lines = textwrap.wrap(f"-> {name}: {lead}", width, initial_indent=" " * 9, subsequent_indent=" " * 12,
                          break_on_hyphens=False)
    return lines + textwrap.wrap(detail, width, initial_indent=" " * 12, subsequent_indent=" " * 12,
                                 break_on_hyphens=False)


def _chapter_files(chapter: str | int) -> tuple[str, list[Path]]:
    m = re.fullmatch(r"(?:ch)?(\d{1,2})", str(chapter).strip().lower())
    if not m:
        raise ValueError(f"chapter {chapter!r}: use 'ch03', '03' or 3")
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


_RESULTS: dict[tuple, tuple[list[TestResult], str]] = {}  # source stamps -> (tests, error) of a finished run


def _stamp(impl_dir: Path, chapter: str) -> tuple:
    """What a chapter's test results depend on that a learner edits: their files and the tests."""
    paths = [*sorted(impl_dir.glob(f"{chapter}_*.py")), *sorted((ROOT / "tests" / "exercises").glob("*.py"))]
    return (str(impl_dir), chapter, *((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in paths))


def run(chapter: str | int, impl: str | None = None, timeout: float = 600) -> ChapterResult:
    """Run a chapter's exercise tests ("ch05"), or show one exercise's ("5.2"); return the results (check()
    prints them). The whole chapter runs either way, and its results are kept until the chapter's exercise
    files or the tests change, so the inline checks and the chapter-end table of a Run All cost one run."""
    one = _ONE_EXERCISE.fullmatch(str(chapter).strip())
    if one:
        chapter = one.group(1)
    name, files = _chapter_files(chapter)
    impl = impl or default_impl()
    impl_dir = ROOT / impl if impl in ("exercises", "solutions") else Path(impl)
    result = ChapterResult(name, f"{impl}/" if impl in ("exercises", "solutions") else impl,
                           exercises=_exercise_titles(impl_dir, name))
    key = _stamp(impl_dir, name)
    if key not in _RESULTS:
        tests, error = _run_pytest(files, impl, timeout)
        if error:
            result.tests, result.error = tests, error
            return result
        _RESULTS.clear()  # keep one chapter's results at a time
        _RESULTS[key] = (tests, error)
    result.tests = list(_RESULTS[key][0])
    if not one:
        add_capstone(result, impl_dir, key)
    if one:
        number = f"{int(one.group(1))}.{int(one.group(2))}"
        result.exercises = {k: v for k, v in result.exercises.items() if k == number}
        result.tests = [t for t in result.tests if t.exercise == number]
    return result


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


def _run_pytest(files: list[Path], impl: str, timeout: float) -> tuple[list[TestResult], str]:
    """The chapter's tests in a fresh pytest process: (results, error); error is "" when pytest ran."""
    env = dict(os.environ, **{IMPL_VARIABLE: impl}, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "results.xml"
        cmd = [sys.executable, "-m", "pytest", *map(str, files), "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", "--tb=line", f"--junitxml={xml}"]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [], f"the tests took more than {timeout:.0f} s"
        if not xml.is_file() or proc.returncode not in (0, 1):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            return (_parse_junit(xml) if xml.is_file() else []), ("pytest exited with code "
                                                                  f"{proc.returncode}:\n" + "\n".join(tail))
        return _parse_junit(xml), ""


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
