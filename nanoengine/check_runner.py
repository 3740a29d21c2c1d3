"""The pytest side of check(): a chapter's exercise tests (those a -k selection picks) in a fresh pytest
process, in the foreground or behind the learner's work at a lower priority (`_start_pytest`,
`_finish_pytest`, `_stop`); their junit file read back as one TestResult per test, a long failure message
whole (`_parse_junit`); and the results kept per chapter until its files change (`_RESULTS`, `_COMPLETE`,
`_BACKGROUND`). Chapter: all.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoengine.pieces import IMPL_VARIABLE

_TEST_NAME = re.compile(r"test_(\d+)_(\d+)_(\w+?)(\[.*\])?$")
_JUNIT_CUT = re.compile(r"\n\[(?:truncated|\+\d+ more lines?); full report in element text\]$")


@dataclass
class TestResult:
    name: str
    exercise: str  # "3.1"
    outcome: str  # "pass", "todo" (NotImplementedError), "fail", "skip" (cannot run here; the message: why)
    message: str = ""


def _full_message(message: str, text: str) -> str:
    """The whole failure message: junit's attribute cuts long ones, its element text (--tb=line: the
    message's lines as "E   ..." or a "file.py:12: ..." line) holds all of it."""
    if not _JUNIT_CUT.search(message) or not text.strip():
        return message
    lines = [line[4:] if line.startswith("E   ") else re.sub(r"^\S+\.py:\d+: ", "", line)
             for line in text.strip().splitlines()]
    return "\n".join(lines)


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
        # cwd: the checkout the tests come from, check.ROOT (files: <root>/tests/exercises/test_chNN_*.py)
        proc = subprocess.Popen(cmd, cwd=files[0].parents[2], env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=nice, start_new_session=hasattr(os, "killpg"))
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
