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


@pytest.mark.slow
def test_a_failure_shows_the_difference_and_the_whole_hint_before_the_state(tmp_path):
    """Exercise 5.2's real failure on a planted mistake (skipping ahead of a waiting request that does not
    fit): the table's line names the difference first and carries the "This looks like" hint whole; the
    state dump comes after them, and only it is cut."""
    src = (ROOT / "solutions" / "ch05_continuous_batching.py").read_text()
    stop = "                seq.num_computed_tokens = seq.num_cached_tokens = 0\n                break\n"
    assert src.count(stop) == 1
    skip = "                seq.num_computed_tokens = seq.num_cached_tokens = 0\n                j += 1\n" \
           "                continue\n"
    (tmp_path / "ch05_continuous_batching.py").write_text(src.replace(stop, skip))
    check._RESULTS.clear()
    result = check.run("5.2", impl=str(tmp_path))
    [test] = result.tests
    assert test.outcome == "fail" and "[truncated" not in test.message, test.message
    hint = ("This looks like skipping a waiting request that does not fit and admitting a later one; stop "
            "admitting at the first that does not fit (first come, first served, as vLLM v1 does), so a long "
            "prompt is not overtaken forever by short ones.")
    table = result.table()
    failure = " ".join(" ".join(table.splitlines()[2:-1]).split())  # the failure's lines, unwrapped
    lead = f"-> {test.name}: schedule() at step "
    assert failure.startswith(lead), table
    difference = failure.index("scheduled (seq_id, num_new_tokens, is_prefill): yours [(")
    assert hint in failure, table
    state = failure.index("[state before: budget 16")
    assert difference < failure.index(hint) < state, table  # the difference, the hint, then the state
    assert failure.count("[state before") == 1 and len(failure) - state <= check.DUMP_CHARS + 1, table


def test_split_failure_cuts_only_the_dump():
    hint = "This looks like " + "a long description of a classic mistake, " * 12 + "and what to do instead."
    dump = "[state before: " + ", ".join(f"seq {i}(3/4 tok)" for i in range(200)) + "]"
    where = "(Exercise 5.2; see x)"
    message = f"AssertionError: step 3 {dump}: slots: yours [1, 2], expected [1, -1]. {hint} {where}"
    lead, detail = check.split_failure(message)
    assert lead == f"step 3: slots: yours [1, 2], expected [1, -1]. {hint} {where}"
    assert detail.startswith("[state before: seq 0(3/4 tok)") and detail.endswith(" ...]")
    assert len(detail) == check.DUMP_CHARS
    # a value's repr is not a dump; junit's cut attribute gives way to the element text
    assert check.split_failure("x: yours [True, False], expected [(1, 2)]") == (
        "x: yours [True, False], expected [(1, 2)]", "")
    cut = "AssertionError: abc...\n[truncated; full report in element text]"
    assert check._full_message(cut, "E   AssertionError: abcdef\nE   more") == "AssertionError: abcdef\nmore"
    short = "AssertionError: short"
    assert check._full_message(short, "E   AssertionError: short") == short
