"""nanoengine.check: one exercise's inline check ("5.2"), the dependency note, and one pytest run reused
while the files do not change."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoengine import check

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_exercise_dependency_note_and_reuse(tmp_path, monkeypatch):
    src = (ROOT / "solutions" / "ch05_continuous_batching.py").read_text()
    start = src.index("    # BEGIN SOLUTION\n    bm = sched.block_manager\n    while")
    end = src.index("    # END SOLUTION", start) + len("    # END SOLUTION")
    stub = '    raise NotImplementedError("Exercise 5.1: preempt - see book/05_continuous_batching.ipynb")'
    (tmp_path / "ch05_continuous_batching.py").write_text(src[:start] + stub + src[end:])
    check._RESULTS.clear()
    result = check.run("ch05", impl=str(tmp_path))
    assert result.status("5.1") == "todo" and result.status("5.3") == "PASS", result.table()
    assert "5.2 uses your 5.1, still todo" in result.table()

    calls = []
    monkeypatch.setattr(check, "_run_pytest", lambda *a: calls.append(a) or ([], "should not run"))
    one = check.run("5.3", impl=str(tmp_path))  # the files did not change: the same results, no new run
    assert not calls and set(one.exercises) == {"5.3"} and {t.exercise for t in one.tests} == {"5.3"}
    assert one.table().splitlines()[-1] == "1 of 1 exercises pass."
    (tmp_path / "ch05_continuous_batching.py").write_text(src)  # an edit: run again
    assert check.run("5.3", impl=str(tmp_path)).error == "should not run" and calls
