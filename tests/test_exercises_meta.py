"""The exercise machinery: exercises/ is in sync with solutions/, and the exercise tests can fail:
each one FAILS on freshly generated (untouched) stubs, with the NotImplementedError of its own exercise,
and PASSES on the reference solutions."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoengine import check

ROOT = Path(__file__).resolve().parents[1]


def make_exercises():
    spec = importlib.util.spec_from_file_location("make_exercises", ROOT / "scripts" / "make_exercises.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_exercises_in_sync_with_solutions():
    problems = make_exercises().check(ROOT)
    assert not problems, "\n".join(problems) + "\nrun: python scripts/make_exercises.py"


def test_stub_generation_and_marker_errors(tmp_path):
    mk = make_exercises()
    good = tmp_path / "ch07_demo.py"
    good.write_text('def f(x):\n    """Exercise 7.1: double it."""\n    # BEGIN SOLUTION\n    y = 2 * x\n'
                    '    return y\n    # END SOLUTION\n')
    stub = mk.stub_source(good)
    assert 'raise NotImplementedError("Exercise 7.1: double it - see book/07_demo.ipynb")' in stub
    assert "2 * x" not in stub and "BEGIN SOLUTION" not in stub
    compile(stub, "stub", "exec")
    bad = {
        "unclosed": '"""Exercise 7.1: x."""\n# BEGIN SOLUTION\nx = 1\n',
        "no label": "def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n",
        "wrong chapter": '"""Exercise 6.1: x."""\n# BEGIN SOLUTION\nx = 1\n# END SOLUTION\n',
        "stray end": "# END SOLUTION\n",
        "no markers": "x = 1\n",
    }
    for what, text in bad.items():
        good.write_text(text)
        with pytest.raises(mk.MarkerError):
            mk.stub_source(good)
            pytest.fail(f"no MarkerError for a solution file with {what}")


def run_suite(impl: str | Path, tmp_path: Path) -> list:
    xml = tmp_path / f"results-{Path(impl).name}.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env.update(NANOENGINE_IMPL=str(impl), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/exercises", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", "--tb=line", f"--junitxml={xml}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert xml.is_file() and proc.returncode in (0, 1), (
        f"pytest on tests/exercises (impl {impl}) could not run (exit {proc.returncode}):\n"
        + (proc.stdout + proc.stderr)[-3000:])
    results = check._parse_junit(xml)
    assert results, f"no exercise tests collected for impl {impl}"
    return results


def solution_exercises() -> dict[str, set[str]]:
    """chapter -> exercise numbers ("3.1", ...) declared in solutions/."""
    chapters = {}
    for path in sorted((ROOT / "solutions").glob("ch[0-9][0-9]_*.py")):
        chapters[path.name[:4]] = set(check._exercise_titles(ROOT / "solutions", path.name[:4]))
    return chapters


@pytest.mark.slow
def test_every_exercise_test_fails_on_untouched_stubs(tmp_path):
    stubs = tmp_path / "stubs"
    make_exercises().write(stubs)
    results = run_suite(stubs, tmp_path)
    passed = [r.name for r in results if r.outcome == "pass"]
    assert not passed, f"these exercise tests PASS on the untouched stubs, so they check nothing: {passed}"
    wrong = [f"{r.name}: {r.message[:200]}" for r in results
             if r.outcome != "todo" or f"Exercise {r.exercise}:" not in r.message]
    assert not wrong, ("these tests fail on the stubs, but not with the NotImplementedError of their own "
                       "exercise (a test must reach the learner's code first):\n" + "\n".join(wrong))
    tested = {r.exercise for r in results}
    for chapter, numbers in solution_exercises().items():
        assert len(numbers) >= 3, f"{chapter} has {len(numbers)} exercises; a chapter needs at least 3"
        untested = numbers - tested
        assert not untested, f"{chapter}: exercises {sorted(untested)} have no test_N_k_* test"


@pytest.mark.slow
def test_every_exercise_test_passes_on_solutions(tmp_path, request):
    in_session = {Path(item.path) for item in request.session.items}
    if (os.environ.get("NANOENGINE_IMPL") == "solutions"
            and set((ROOT / "tests" / "exercises").glob("test_*.py")) <= in_session):
        pytest.skip("tests/exercises runs in this session against the solutions (NANOENGINE_IMPL=solutions, "
                    "as `make test` sets it): its own results are this check")
    results = run_suite("solutions", tmp_path)
    failed = [f"{r.name}: {r.message[:300]}" for r in results if r.outcome != "pass"]
    assert not failed, "exercise tests fail on the reference solutions:\n" + "\n".join(failed)
