"""nanoengine.check: one exercise's inline check ("5.2") runs that exercise's tests only, the dependency note,
results reused while the files do not change (a chapter-end check runs only what is left), a failure's
difference shown aligned with hashes as short ids and its state whole, and a failed capstone naming the piece
most likely at fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoengine import book, check

ROOT = Path(__file__).resolve().parents[1]


# A chapter of its own (42), so that these tests read what check() does, not what a chapter's tests say today
FAKE_TESTS = '''
import importlib.util
import os
from pathlib import Path

HASH = 6874755648248605582


def ex():
    path = Path(os.environ["NANOENGINE_IMPL"]) / "ch42_fake.py"
    spec = importlib.util.spec_from_file_location("ch42_fake", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_42_1_first():
    assert ex().first() == [1, 2, 3]


def test_42_2_second():
    got, want = ex().second(), [(1, 4, False), (2, 1, False)]
    state = ("[state before: budget 16, 5 of 14 blocks free; "
             + ", ".join(f"running {i}(17/18 tok, 5 blk)" for i in range(60)) + "; waiting 7(22 tok)]")
    if got != want:
        raise AssertionError(f"schedule() at step 3 {state}: scheduled (seq_id, num_new_tokens, is_prefill): "
                             f"yours {got!r}, expected {want!r}. This looks like admitting a later request "
                             f"ahead of one that does not fit. (Exercise 42.2; see book/42_fake.ipynb)")


def test_42_3_cache():
    got = ex().cache()
    if got != {HASH: 1, 7: 2}:
        raise AssertionError(f"the prefix cache: yours {got!r}, expected {{{HASH}: 1, 7: 2}} "
                             "(Exercise 42.3; see book/42_fake.ipynb)")
'''
FAKE_SOLUTION = '''"""A chapter for tests.

Exercise 42.1: the first piece.
Exercise 42.2: the second piece.
Exercise 42.3: the cache.
"""


def first():
    """Exercise 42.1: the first piece."""
    return [1, 2, 3]


def second():
    """Exercise 42.2: the second piece."""
    return [(first()[0], 4, False), (2, 1, False)]


def cache():
    """Exercise 42.3: the cache."""
    return {6874755648248605582: 1, 7: 2}
'''


@pytest.fixture
def fake_chapter(tmp_path, monkeypatch):
    """(the folder of chapter 42's answers, where its tests ran): check() reading a fake checkout."""
    root, impl = tmp_path / "root", tmp_path / "impl"
    (root / "tests" / "exercises").mkdir(parents=True)
    (root / "tests" / "exercises" / "test_ch42_fake.py").write_text(FAKE_TESTS)
    impl.mkdir()
    (impl / "ch42_fake.py").write_text(FAKE_SOLUTION)
    monkeypatch.setattr(check, "ROOT", root)
    check._RESULTS.clear()
    yield impl
    check._RESULTS.clear()


def test_one_exercise_runs_its_tests_only_and_the_chapter_runs_the_rest(fake_chapter, monkeypatch):
    """check("42.2") runs 42.2's tests and starts the rest of the chapter behind it; the next checks, the
    chapter's included, take their results from there, so a Run All costs two pytest processes. An edit
    stops a background run and starts over."""
    impl = fake_chapter
    src = (impl / "ch42_fake.py").read_text()
    stub = '    raise NotImplementedError("Exercise 42.1: first - see book/42_fake.ipynb")'
    (impl / "ch42_fake.py").write_text(src.replace("    return [1, 2, 3]", stub))
    started = []
    real = check._start_pytest
    monkeypatch.setattr(check, "_start_pytest",
                        lambda files, impl, select="", background=False:
                        started.append((select, background)) or real(files, impl, select, background))
    one = check.run("42.2", impl=str(impl))
    assert started == [("test_42_2_", False), ("not test_42_2_", True)], started
    assert [t.name for t in one.tests] == ["test_42_2_second"], one.tests  # that exercise's tests only
    assert one.status("42.2") == "todo" and "42.2 uses your 42.1, still todo" in one.table(), one.table()
    assert set(one.exercises) == {"42.2"} and one.table().splitlines()[-1] == "0 of 1 exercises pass."
    assert check.run("42.3", impl=str(impl)).status("42.3") == "PASS"  # from the background run
    whole = check.run("ch42", impl=str(impl))
    assert [whole.status(n) for n in ("42.1", "42.2", "42.3")] == ["todo", "todo", "PASS"], whole.table()
    assert len(started) == 2 and not check._BACKGROUND, started  # no third process

    (impl / "ch42_fake.py").write_text(src)  # an edit: the one exercise again, the rest behind it
    assert check.run("42.1", impl=str(impl)).status("42.1") == "PASS"
    assert started[2:] == [("test_42_1_", False), ("not test_42_1_", True)], started
    [background] = check._BACKGROUND.values()
    (impl / "ch42_fake.py").write_text(src + "\n")  # another edit while it runs: it is stopped
    assert check.run("ch42", impl=str(impl)).passed and background.proc.poll() is not None
    assert started[4:] == [("", False)], started  # the whole chapter, in the foreground


def test_a_failure_shows_the_difference_and_the_whole_hint_before_the_state(fake_chapter):
    """A failure through pytest and its junit file (a long message: the attribute is cut, the element text
    is not): yours and expected on aligned lines with the first differing item marked, the hint whole, then
    the state the test started from, whole, one part a line; a hash as a short id."""
    impl = fake_chapter
    src = (impl / "ch42_fake.py").read_text()
    (impl / "ch42_fake.py").write_text(src.replace("(2, 1, False)]", "(2, 1, False), (3, 14, True)]")
                                       .replace("{6874755648248605582: 1, 7: 2}", "{6874755648248605582: 3}"))
    result = check.run("ch42", impl=str(impl))
    assert [result.status(n) for n in ("42.1", "42.2", "42.3")] == ["PASS", "FAIL", "FAIL"], result.table()
    lines = result.table().splitlines()
    table = "\\n".join(lines)
    start = next(i for i, line in enumerate(lines) if "-> test_42_2_second: schedule() at step 3:" in line)
    at = next(i for i, line in enumerate(lines) if line.split()[0] == "yours")
    lead = " ".join(" ".join(lines[start:at]).split())
    assert lead.endswith("scheduled (seq_id, num_new_tokens, is_prefill):"), table
    yours, expected, mark = lines[at:at + 3]
    assert expected.split()[0] == "expected" and yours.index("[(") == expected.index("[("), table  # aligned
    assert mark.strip() == "^ item 2: yours (3, 14, True), expected nothing (yours has 3 items, expected 2)"
    assert yours[mark.index("^")] == "(", table  # the mark stands under the first item that differs
    end = next(i for i, line in enumerate(lines) if "42.3" in line and "FAIL" in line)
    rest = " ".join(" ".join(lines[at + 3:end]).split())
    hint = "This looks like admitting a later request ahead of one that does not fit."
    assert rest.startswith(hint) and rest.index(hint) < rest.index("state before: budget 16"), table
    assert ", ".join(f"running {i}(17/18 tok, 5 blk)" for i in range(60)) in rest, table  # the state, whole
    assert lines[end - 1].strip() == "waiting 7(22 tok)", table  # one part a line
    cache = " ".join(" ".join(lines[end + 1:]).split())
    assert "6874755648248605582" not in cache and "{#5f6809: 3}" in cache and "block hashes" in cache, table
    assert "keys yours lack (1): 7: 2" in cache and "at #5f6809: yours 3, expected 1" in cache, table


def test_split_failure_keeps_the_dump_whole_and_difference_aligns():
    hint = "This looks like " + "a long description of a classic mistake, " * 12 + "and what to do instead."
    dump = "[state before: " + ", ".join(f"seq {i}(3/4 tok)" for i in range(200)) + "; waiting 7(3 tok)]"
    where = "(Exercise 5.2; see x)"
    message = f"AssertionError: step 3 {dump}: slots: yours [1, 2], expected [1, -1]. {hint} {where}"
    lead, dumps = check.split_failure(message)
    assert lead == f"step 3: slots: yours [1, 2], expected [1, -1]. {hint} {where}"
    assert dumps == [dump]
    lines = check.render_failure("test_5_2_x", message)
    assert dump[1:dump.index(";")] in " ".join(" ".join(lines).split()), lines  # whole
    assert lines[-1].strip() == "waiting 7(3 tok)", lines  # one part a line
    # a value's repr is not a dump; junit's cut attribute gives way to the element text
    assert check.split_failure("x: yours [True, False], expected [(1, 2)]") == (
        "x: yours [True, False], expected [(1, 2)]", [])
    cut = "AssertionError: abc...\n[truncated; full report in element text]"
    assert check._full_message(cut, "E   AssertionError: abcdef\nE   more") == "AssertionError: abcdef\nmore"
    short = "AssertionError: short"
    assert check._full_message(short, "E   AssertionError: short") == short

    # a long list: a window around the first difference, the mark under it
    got, want = list(range(100)), [*range(50), -1, *range(51, 100)]
    y, e, mark = check.difference(repr(got), repr(want))
    assert y.startswith("yours    [..., 48, 49, 50,") and e.startswith("expected [..., 48, 49, -1,")
    assert y[mark.index("^"):].startswith("50") and e[mark.index("^"):].startswith("-1")
    assert "item 50: yours 50, expected -1" in mark
    # a hash table: the keys that differ, hashes as short ids (the same id for the same hash)
    h1, h2, h3 = 6874755648248605582, 10928139816351906738, 2**63 + 12345
    lines = check.difference(repr({h1: 1, h2: 2}), repr({h1: 1, h2: 4, h3: 5}))
    assert f"at #{h2:x}"[:8] in " ".join(lines) and "yours 2, expected 4" in " ".join(lines), lines
    assert "keys yours lack (1): #800000: 5" in lines, lines
    assert check.short_ids(f"[{h1}, {h1}, 12345]") == f"[#{h1:x}"[:8] + f", #{h1:x}"[:9] + ", 12345]"
    message = (f"AssertionError: cache: yours {{{h1}: 1, {h2}: 2, 7: 0}}, "
               f"expected {{{h1}: 1, {h2}: 4, 7: 0}}. (Exercise 4.4; see x)")
    rendered = "\n".join(check.render_failure("t", message))
    assert str(h1) not in rendered and "#5f6809" in rendered and "block hashes" in rendered, rendered


def test_a_failed_capstone_names_the_piece_most_likely_at_fault(monkeypatch):
    """The capstone's own difference messages, read for which piece they point at, with its exercise number
    from the chapter file."""
    from nanoengine.pieces import capstone as cap

    solutions = ROOT / "solutions"
    step = (f"same text, but step 4 differs (yours vs the engine's): {cap.STEP_FIELDS[4]} 0 vs 16, "
            f"{cap.STEP_FIELDS[3]} 5 vs 4 [2.0 s]")
    assert check.suspect("ch04", step, solutions).startswith(
        "most likely at fault: your 4.2 (count_cached_tokens), then ")

    class Tok:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)

    first = cap.first_difference(Tok(), [[1, 2], [3, 4]], [[1, 2], [5, 4]], "the engine's")
    later = cap.first_difference(Tok(), [[1, 2], [3, 4]], [[1, 2], [3, 5]], "the engine's")
    assert check.suspect("ch03", first, solutions).startswith("most likely at fault: your 3.5 (paged_prefill")
    assert check.suspect("ch03", later, solutions).startswith("most likely at fault: your 3.8 (paged_decode")
    assert check.suspect("ch02", later, solutions).startswith("most likely at fault: your 2.2 (apply_rope)")
    assert "9.4 (rollback_blocks)" in check.suspect("ch09", step, solutions)  # no prefix-hit rule: blocks
    # the outcome messages (the text equal, the behaviour not)
    leak = "same text, but 3 blocks are still held after every request finished (a leak) [4.1 s]"
    assert check.suspect("ch04", leak, solutions).startswith("most likely at fault: your 4.4 (PrefixCaching")
    assert check.suspect("ch09", leak, solutions).startswith("most likely at fault: your 9.4 (rollback_")
    never = "same text, but prefix-hit tokens 0 vs the engine's 64: prompts sharing a prefix never hit"
    assert check.suspect("ch04", never, solutions).startswith("most likely at fault: your 4.2 (count_cached")
    over = "same text, but step 3 computed 44 tokens, over the budget of 40"
    assert check.suspect("ch04", over, solutions).startswith("most likely at fault: your 4.2 (count_cached")
    assert check.suspect("ch04", "ExerciseError: use_exercises: your Exercise 4.3 raised", solutions) == ""

    # wired into the table: a failed row is followed by its suspect
    result = check.ChapterResult("ch04", "solutions/", exercises={"4.1": "x"},
                                 tests=[check.TestResult("test_4_1_x", "4.1", "pass")])
    monkeypatch.setattr(cap, "capstone", lambda chapter, d: cap.CapstoneResult(chapter, [("tiny-qwen3", False,
                                                                                          step)]))
    check._CAPSTONES.clear()
    check.add_capstone(result, solutions, ("a key",))
    assert not result.passed and "  -> most likely at fault: your 4.2 (count_cached_tokens)" in result.table()
    check._CAPSTONES.clear()


def test_a_part_runs_the_exercises_it_sets(fake_chapter, monkeypatch):
    """check("ch42b") runs the exercises that part of the book sets (its `### Exercise` headings), starts the
    rest of the chapter behind them, and leaves the capstone to the whole chapter's check."""
    impl = fake_chapter
    book_dir = fake_chapter.parent / "root" / "book"
    book_dir.mkdir()

    def notebook(name: str, *numbers: str) -> None:
        cells = [{"cell_type": "markdown", "id": f"c{i}", "metadata": {},
                  "source": [f"### Exercise {n}: x\n", "\n", "text\n"]} for i, n in enumerate(numbers)]
        (book_dir / name).write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                                 "nbformat_minor": 5}))

    notebook("42a_fake.ipynb", "42.1")
    notebook("42b_fake.ipynb", "42.2", "42.3")
    assert [p.name for p in book.notebooks(book_dir)] == ["42a_fake.ipynb", "42b_fake.ipynb"]
    assert book.part_exercises("42b", book_dir) == ["42.2", "42.3"], book.part_exercises("42b", book_dir)
    assert book.part_of(book_dir / "42a_fake.ipynb") == "42a"
    assert book.notebook_of("42.3", book_dir).name == "42b_fake.ipynb"
    assert book.notebook_of("42.9", book_dir) is None
    monkeypatch.setattr(book, "BOOK", book_dir)
    started = []
    real = check._start_pytest
    monkeypatch.setattr(check, "_start_pytest",
                        lambda files, impl, select="", background=False:
                        started.append((select, background)) or real(files, impl, select, background))
    part = check.run("ch42b", impl=str(impl))
    assert started == [("test_42_2_ or test_42_3_", False),
                       ("not test_42_2_ and not test_42_3_", True)], started
    assert part.chapter == "ch42b" and set(part.exercises) == {"42.2", "42.3"}, part.table()
    assert {t.exercise for t in part.tests} == {"42.2", "42.3"} and part.passed, part.table()
    assert 'check("ch42")' in part.table() and part.capstone is None
    assert check.run("ch42", impl=str(impl)).passed and len(started) == 2  # the rest came from behind
    with pytest.raises(ValueError, match="no part 42c"):
        check.run("ch42c", impl=str(impl))
