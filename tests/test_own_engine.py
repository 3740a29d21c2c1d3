"""Exercise 5.6's checks (nanoengine/pieces/own_engine.py) name the mistakes a hand-written step loop makes:
each is planted in a copy of the reference solution, and the check must fail with a message that says
what broke. The reference itself passes them (tests/exercises/test_ch05_continuous_batching.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from nanoengine.pieces import own_engine

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "ch05_continuous_batching.py"
pytestmark = pytest.mark.xdist_group("ex_ch05")

PLANTED = {  # mistake -> (the line of the solution it changes, what it becomes, words the message must say)
    "a finished sequence is never freed": ("                self.sched.block_manager.free(seq)\n", "",
                                           "still holds blocks"),
    "a finished sequence stays in running": ("                self.sched.running.remove(seq)\n", "",
                                             "is still in sched.running"),
    "a preempted sequence is not reset": ("        victim.num_computed_tokens = 0\n", "",
                                          "was preempted"),
    "the step's tokens are never counted as computed": (
        "            s.seq.num_computed_tokens += s.num_new_tokens\n", "            pass\n",
        "count the scheduled"),
}


@pytest.fixture(scope="module")
def parts():
    return own_engine.model_parts()


def with_mistake(tmp_path: Path, old: str, new: str):
    source = SOLUTION.read_text()
    assert source.count(old) == 1, f"the planted line {old!r} is no longer in {SOLUTION}: update PLANTED"
    path = tmp_path / SOLUTION.name
    path.write_text(source.replace(old, new))
    name = f"_planted_{abs(hash(str(tmp_path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mistake", list(PLANTED))
def test_a_planted_loop_mistake_is_named(mistake, parts, tmp_path):
    old, new, named = PLANTED[mistake]
    module = with_mistake(tmp_path, old, new)
    with pytest.raises(AssertionError) as failed:
        own_engine.check_engine(module.MyEngine, parts, seed=2026)
    assert named in str(failed.value), f"{mistake}: the check said {failed.value}"
