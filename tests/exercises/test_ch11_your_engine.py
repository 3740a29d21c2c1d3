"""Exercises of chapter 11 (book/11a_requests_in.ipynb .. 11c_served_and_measured.ipynb): your engine, end to
end, judged on behaviour through the engine protocol (nanoengine/pieces/your_engine.py): requests made and refused, greedy tokens against transformers on
text prompts you did not choose, the text and its streamed deltas, stop strings, seeded n = 2, abort, and
`LLM.from_engine`; each run bounded in steps and each check in time."""

from __future__ import annotations

import pytest

CHAPTER = "ch11_your_engine"
pytestmark = pytest.mark.xdist_group("ex_ch11")
UNSEEN = 2027


def own_stubs_first(cls, calls: dict) -> None:
    """Reach this exercise's own methods first: one still the untouched stub raises its own
    NotImplementedError (a stub never touches `self`), before the check needs 11.1's."""
    from nanoengine.pieces.learner import is_stub

    for name, args in calls.items():
        method = getattr(cls, name, None)
        if method is not None and is_stub(method):
            method(None, *args)


@pytest.fixture(scope="module")
def parts():
    from nanoengine.pieces.own_engine import model_parts

    return model_parts(num_blocks=256)


def test_11_1_your_engine_makes_and_queues_requests(ex, parts):
    from nanoengine.pieces.schedule_checks import time_limit
    from nanoengine.pieces.your_engine import check_requests

    with time_limit(60, "check_requests of your engine", "11.1"):
        check_requests(ex.MyEngine, parts)


def test_11_2_your_engine_gives_text_deltas_and_stops(ex, parts):
    from nanoengine.pieces.schedule_checks import time_limit
    from nanoengine.pieces.your_engine import check_stop_and_seeds, check_text

    own_stubs_first(ex.MyEngine, {"step": ()})
    with time_limit(60, "check_text of your engine", "11.2"):
        check_text(ex.MyEngine, parts, UNSEEN)
    with time_limit(60, "check_stop_and_seeds of your engine", "11.2"):
        check_stop_and_seeds(ex.MyEngine, parts, UNSEEN)


def test_11_3_your_engine_aborts_and_reports_its_load(ex, parts):
    from nanoengine.pieces.schedule_checks import time_limit
    from nanoengine.pieces.your_engine import check_abort

    own_stubs_first(ex.MyEngine, {"abort": ("x",), "has_unfinished": (), "load": (), "close": ()})
    with time_limit(60, "check_abort of your engine", "11.3"):
        check_abort(ex.MyEngine, parts, UNSEEN)

