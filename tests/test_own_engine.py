"""Chapter 05's behavioural checks can fail, name the exercise, and let a different correct design pass.

Each planted mistake is a copy of the reference solution with one change; the check it belongs to must fail
within seconds with a message that names the exercise and says what broke (5.1 and 5.2:
nanoengine/pieces/schedule_checks.py, no model; 5.6: nanoengine/pieces/own_engine.py, tiny-qwen3). Other
copies make different but valid choices (another preemption victim, another freeing order, siblings that
wait, the engine's own policy) and must pass the same checks."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from pathlib import Path

import pytest

from nanoengine.engine.scheduler import Scheduler
from nanoengine.pieces import own_engine, schedule_checks

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "ch05_continuous_batching.py"
pytestmark = pytest.mark.xdist_group("ex_ch05")

# 5.2 admits through 5.0 (admit_prompts): the reference hands it the front of the queue at once
ADMIT_ALL = '''        room = max(sched.max_num_seqs - len(sched.running), 0)
        for seq, n in admit_prompts(bm, list(islice(sched.waiting, room)), budget):  # your 5.0
            sched.waiting.remove(seq)
'''
ADMIT_ONE_BY_ONE = '''        while sched.waiting and budget > 0 and len(sched.running) < sched.max_num_seqs:
            admitted = admit_prompts(bm, [sched.waiting[0]], budget)
            if not admitted:
                break
            seq, n = admitted[0]
            sched.waiting.popleft()
'''
UNDO = "            seq.num_computed_tokens = seq.num_cached_tokens = 0\n"
REGISTER = "        bm.cache_full_blocks(seq, seq.num_computed_tokens + n)\n"  # (5.2's running pass, and 5.0)
# mistake -> (exercise whose check runs, [(a line or block of the solution, what it becomes)], words the
# message must say). Mistakes planted in admit_prompts (5.0's code) must fail 5.2's check too: 5.2 admits
# through it
PLANTED_SCHEDULING = {
    "victim taken from the oldest (already scheduled)": (
        "5.1", [("        victim = sched.running.pop()\n", "        victim = sched.running.pop(0)\n")],
        "already scheduled in this step"),
    "victim keeps its computed tokens": (
        "5.1", [("        victim.num_computed_tokens = 0\n", "")], "num_computed_tokens is"),
    "victim sent to the back of the queue": (
        "5.1", [("        sched.waiting.appendleft(victim)\n", "        sched.waiting.append(victim)\n")],
        "FRONT of the queue"),
    "blocks registered at the end of the step": (
        "5.2", [(REGISTER, ""),
                ("    out.num_batched_tokens = sched.max_num_batched_tokens - budget\n",
                 "    for s in out.scheduled:\n        bm.cache_full_blocks(s.seq, s.start + "
                 "s.num_new_tokens)\n"
                 "    out.num_batched_tokens = sched.max_num_batched_tokens - budget\n")],
        "as soon as it is scheduled"),
    "blocks registered before the step computes them": (
        "5.2", [(REGISTER, "        bm.cache_full_blocks(seq, seq.num_tokens)\n")], "never before"),
    "admission past max_num_seqs": (
        "5.2", [("list(islice(sched.waiting, room))", "list(sched.waiting)")], "max_num_seqs is"),
    "the prefix hits listed as allocated blocks": (
        "5.2", [("seq.block_table[hits // bm.block_size:]", "list(seq.block_table)")],
        "out.blocks_allocated is"),
    "a loop that never ends": (
        "5.2", [(ADMIT_ALL, ADMIT_ONE_BY_ONE.replace("                break\n",
                                                     "                continue\n"))],
        "a loop that never ends"),
    # in admit_prompts (5.0), which 5.2 calls
    "a later waiting sequence overtakes one that does not fit": (
        "5.2", [(UNDO + "            break\n", UNDO + "            continue\n")], "first come, first served"),
    "a full prefix hit counted as computed": (
        "5.2", [("        seq.num_computed_tokens = min(hits, seq.num_tokens - 1)\n",
                 "        seq.num_computed_tokens = hits\n")], "last prompt token"),
    "no chunked prefill": (
        "5.2", [("        n = min(seq.num_tokens - seq.num_computed_tokens, budget)\n"
                 "        if not bm.can_allocate(seq, n):\n",
                 "        n = seq.num_tokens - seq.num_computed_tokens\n"
                 "        if n > budget or not bm.can_allocate(seq, n):\n")], "is chunked"),
    "prefix hits of a sequence not admitted kept": (
        "5.2", [("            bm.free(seq)\n" + UNDO, UNDO)], "gives its prefix hits back"),
}

# different valid choices: each must pass 5.1's and 5.2's checks
LARGEST_VICTIM = '''    bm = sched.block_manager
    start = sched.running.index(seq)
    while not bm.can_allocate(seq, num_new_tokens):
        # another policy: the not-yet-scheduled sequence holding the most blocks (ties: the oldest)
        victim = max(sched.running[start:], key=lambda s: len(s.block_table))
        sched.running.remove(victim)
        freed = bm.release(list(reversed(victim.block_table)))  # another freeing order: head first
        victim.block_table.clear()
        out.blocks_freed += sorted(freed)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        sched.waiting.appendleft(victim)
        out.preempted.append(victim)
        if victim is seq:
            return False
    return True
'''
NEWEST_FIRST = '''    bm = sched.block_manager
    while not bm.can_allocate(seq, num_new_tokens):
        victim = sched.running.pop()
        out.blocks_freed += bm.free(victim)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        sched.waiting.appendleft(victim)
        out.preempted.append(victim)
        if victim is seq:
            return False
    return True
'''
SIBLINGS_WAIT = '''        room = max(sched.max_num_seqs - len(sched.running), 0)
        ready = [s for s in sched.waiting if s.wait_for is None or s.wait_for.is_finished
                 or s.wait_for.num_computed_tokens >= s.wait_for.num_prompt_tokens]
        for seq, n in admit_prompts(bm, ready[:room], budget):
            sched.waiting.remove(seq)
'''
VALID = {
    "the largest victim, its blocks freed head first": [(NEWEST_FIRST, LARGEST_VICTIM)],
    "siblings wait for the first completion's prompt, and the largest victim": [
        (NEWEST_FIRST, LARGEST_VICTIM), (ADMIT_ALL, SIBLINGS_WAIT)],
    "one admission at a time through 5.0": [(ADMIT_ALL, ADMIT_ONE_BY_ONE)],
}


def with_changes(tmp_path: Path, changes: list[tuple[str, str]]):
    """A copy of the reference solution with each (old, new) applied (every old must be there)."""
    source = SOLUTION.read_text()
    for old, new in changes:
        assert old in source, f"the planted text {old!r} is no longer in {SOLUTION}: update this test"
        source = source.replace(old, new)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / SOLUTION.name
    path.write_text(source)
    name = f"_planted_{abs(hash(str(tmp_path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def scheduling_check(exercise: str, module) -> str:
    return (schedule_checks.check_preempt(module.preempt_until_fits) if exercise == "5.1"
            else schedule_checks.check_schedule(module))


@pytest.mark.parametrize("mistake", list(PLANTED_SCHEDULING))
def test_a_planted_scheduling_mistake_is_named(mistake, tmp_path):
    exercise, changes, named = PLANTED_SCHEDULING[mistake]
    module = with_changes(tmp_path, changes)
    t0 = time.perf_counter()
    with pytest.raises(AssertionError) as failed:
        scheduling_check(exercise, module)
    message = str(failed.value)
    assert named in message and f"Exercise {exercise}" in message, f"{mistake}: the check said {message}"
    assert time.perf_counter() - t0 < 15, f"{mistake}: took {time.perf_counter() - t0:.1f} s to be named"


@pytest.mark.parametrize("choice", list(VALID))
def test_a_different_valid_policy_passes_5_1_and_5_2(choice, tmp_path):
    module = with_changes(tmp_path, VALID[choice])
    schedule_checks.check_preempt(module.preempt_until_fits)
    schedule_checks.check_schedule(module)


def test_the_engines_own_policy_passes_5_1_and_5_2():
    """The checks are not the reference solution in disguise: the engine's Scheduler.pick passes them."""
    schedule_checks.check_preempt(schedule_checks.engine_preempt)
    engine = type("EngineAsModule", (), {"schedule": staticmethod(Scheduler.pick),
                                          "preempt_until_fits": staticmethod(schedule_checks.engine_preempt)})
    schedule_checks.check_schedule(engine)


def test_a_stub_5_1_is_stood_in_for_by_the_engines(tmp_path):
    stub = '    raise NotImplementedError("Exercise 5.1: stub")\n'
    module = with_changes(tmp_path, [(NEWEST_FIRST, stub)])
    assert "the engine's 5.1 stood in" in schedule_checks.check_schedule(module)


def solution_body(first: str, last: str) -> str:
    source = SOLUTION.read_text()
    start = source.index(first)
    return source[start:source.index(last, start) + len(last)]


def test_a_stub_5_0_stops_5_2s_check_naming_5_0(tmp_path):
    """5.2 admits through 5.0 (part 05a): while 5.0 is the stub, 5.2's check stops as 5.0's todo, which
    check() shows as "5.2 uses your 5.0, still todo"; an untouched 5.2 is still 5.2's own todo."""
    from nanoengine.check import _stub_of

    admit = solution_body("    admitted = []\n", "    return admitted\n")
    module = with_changes(tmp_path / "a", [(admit, '    raise NotImplementedError("Exercise 5.0: stub")\n')])
    with pytest.raises(NotImplementedError) as todo:
        schedule_checks.check_schedule(module)
    message = str(todo.value)
    assert message.startswith("Exercise 5.0: your schedule (Exercise 5.2) admits through admit_prompts, "
                              "which is still the stub") and "book/05a_admission.ipynb" in message, message
    assert _stub_of(f"NotImplementedError: {message}") == "5.0"

    step = solution_body("    bm = sched.block_manager\n    out = SchedulerOutput()\n", "    return out\n")
    module = with_changes(tmp_path / "b", [(admit, '    raise NotImplementedError("Exercise 5.0: stub")\n'),
                                           (step, '    raise NotImplementedError("Exercise 5.2: stub")\n')])
    with pytest.raises(NotImplementedError, match=r"^Exercise 5\.2: stub$"):
        schedule_checks.check_schedule(module)


# ----------------------------------------------------------------------------------------------- 5.6
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
    "the forward is skipped on a step that samples nothing": (
        "        logits = self.parts.logits(flat, out.scheduled)  # [num_sampled, vocab], run every step\n"
        "        if not flat.sample_rows:\n            return []\n",
        "        if not flat.sample_rows:\n            return []\n"
        "        logits = self.parts.logits(flat, out.scheduled)  # [num_sampled, vocab], run every step\n",
        "prefilled in chunks"),
    "a seeded request drawn from the shared generator": (
        "                        [self.generators.get(seq.seq_id) for seq in seqs], self.shared_generator)\n",
        "                        [None for seq in seqs], self.shared_generator)\n",
        "own sequence's generator"),
    "the stop rules asked before the token is appended": (
        "            seq.token_ids.append(int(token))\n"
        "            reason, stop_token = self.sched.stop_reason(seq, int(token))\n",
        "            reason, stop_token = self.sched.stop_reason(seq, int(token))\n"
        "            seq.token_ids.append(int(token))\n",
        "differ from transformers'"),
}


@pytest.fixture(scope="module")
def parts():
    return own_engine.model_parts()


@pytest.mark.parametrize("mistake", list(PLANTED))
def test_a_planted_loop_mistake_is_named(mistake, parts, tmp_path):
    old, new, named = PLANTED[mistake]
    module = with_changes(tmp_path, [(old, new)])
    t0 = time.perf_counter()
    with pytest.raises(AssertionError) as failed:
        own_engine.check_engine(module.MyEngine, parts, seed=2026)
    assert named in str(failed.value) and "Exercise 5." in str(failed.value), (
        f"{mistake}: the check said {failed.value}")
    assert time.perf_counter() - t0 < 60, f"{mistake}: took {time.perf_counter() - t0:.1f} s to be named"


@pytest.mark.slow
def test_a_different_valid_policy_passes_the_ch05_capstone(tmp_path):
    """The engine on a 5.1 that preempts the largest sequence and frees head first, and a 5.2 whose siblings
    wait: the capstone judges tokens and outcomes, not the engine's schedule step by step."""
    from nanoengine.pieces.capstone import capstone

    with_changes(tmp_path, VALID["siblings wait for the first completion's prompt, and the largest victim"])
    result = capstone("ch05", tmp_path, models=("tiny-qwen3",))
    assert result.passed, result.rows


def test_show_solution_prints_one_labelled_reference_answer(capsys):
    from nanoengine.check import show_solution

    show_solution("5.2")
    shown = capsys.readouterr().out
    assert "REFERENCE SOLUTION of Exercise 5.2" in shown and "def schedule(" in shown
    assert "def preempt_until_fits(" not in shown and "# BEGIN SOLUTION" in shown
    with pytest.raises(LookupError):
        show_solution("5.9")


# ----------------------------------------------------------------------------------------------- chapter 11
def test_an_empty_engine_class_is_told_where_to_start(parts):
    from nanoengine.pieces.your_engine import check_protocol

    class MyEngine:
        pass

    with pytest.raises(AssertionError, match=r"still empty.*Start with __init__.*Exercise 11.1"):
        check_protocol(MyEngine, parts)

    class Half:
        def __init__(self, parts):
            pass

        def make_request(self, *a):
            pass

        def add(self, *a):
            pass

    with pytest.raises(AssertionError, match=r"has no step, abort.*write step next.*Exercise 11.2"):
        check_protocol(Half, parts)


def test_the_reference_engine_passes_chapter_11s_checks(parts):
    from nanoengine.pieces.your_engine import check_your_engine

    sys.path.insert(0, str(ROOT / "solutions"))
    try:
        module = importlib.import_module("ch11_your_engine")
    finally:
        sys.path.remove(str(ROOT / "solutions"))
    assert len(check_your_engine(module.MyEngine, parts, seed=11)) == 4


# ------------------------------------------------------------- chapter 11: your 1.3, traces, all your pieces
def stubbed(source: str, name: str) -> str:
    """`source` with the solution block of function (or method) `name` turned into the untouched stub."""
    start = source.index(f"def {name}(")
    begin = source.index("# BEGIN SOLUTION", start)
    end = source.index("# END SOLUTION", begin) + len("# END SOLUTION")
    return source[:begin] + 'raise NotImplementedError("Exercise: stub")' + source[end:]


def pieces_folder(tmp_path: Path, changes: dict[str, list[tuple[str, str] | str]],
                  stubs_of: tuple = ()) -> Path:
    """A folder of chapter files: the reference solutions; for the chapters in `stubs_of` the untouched
    exercises (every piece a stub); in `changes`, per file stem, names of functions to stub or (old, new)
    replacements."""
    folder = tmp_path / "pieces"
    folder.mkdir(parents=True)
    for path in sorted((ROOT / "solutions").glob("ch*.py")):
        chapter = path.name[:4]
        source = (ROOT / "exercises" / path.name if chapter in stubs_of else path).read_text()
        for change in changes.get(chapter, []):
            if isinstance(change, str):
                source = stubbed(source, change)
            else:
                assert change[0] in source, f"{change[0]!r} is no longer in {path}: update this test"
                source = source.replace(*change)
        (folder / path.name).write_text(source)
    return folder


def reference_engine():
    sys.path.insert(0, str(ROOT / "solutions"))
    try:
        return importlib.import_module("ch11_your_engine")
    finally:
        sys.path.remove(str(ROOT / "solutions"))


def test_my_engines_text_deltas_and_stop_strings_come_from_your_1_3(parts, tmp_path, monkeypatch):
    """A 1.3 of yours that marks each delta shows in MyEngine's text, its streamed deltas and its stop
    strings; while 1.3 is a stub the engine's detokenizer stands in and the text is the tokens' decoding."""
    from nanoengine import LLM, SamplingParams
    from nanoengine.pieces.learner import load

    marked = ("    return new_text[len(prefix_text):], read_offset, len(token_ids)\n",
              "    return '<' + new_text[len(prefix_text):] + '>', read_offset, len(token_ids)\n")
    monkeypatch.setenv("NANOENGINE_IMPL", str(pieces_folder(tmp_path, {"ch01": [marked]})))
    llm = LLM.from_engine(load("ch11", ROOT / "solutions").MyEngine(parts))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0].text
    deltas = list(llm.stream("Once upon a time", greedy))
    assert text.startswith("<") and text.endswith(">") and text.count("<") == 6, text
    assert "".join(deltas) == text and all(d.startswith("<") for d in deltas), (deltas, text)
    cut = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                          stop=["><"]), use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.stop_reason) == (text[:text.index("><")], "><"), cut

    monkeypatch.setenv("NANOENGINE_IMPL", str(ROOT / "exercises"))  # 1.3 a stub: the engine's stands in
    stand_in = LLM.from_engine(load("ch11", ROOT / "solutions").MyEngine(parts))
    out = stand_in.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0]
    assert out.text == parts.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_a_my_engine_that_leaves_out_your_1_3_is_named(parts, tmp_path, monkeypatch):
    from nanoengine.pieces.your_engine import check_requests

    skip = ("            completion.detokenizer = self.detokenizer(completion.params.skip_special_tokens)\n",
            "            pass\n")
    folder = pieces_folder(tmp_path, {"ch11": [skip]})
    monkeypatch.setenv("NANOENGINE_IMPL", str(folder))
    from nanoengine.pieces.learner import load

    with pytest.raises(AssertionError, match=r"1.3 is done, yet.*engine's detokenizer.*Exercise 11.1"):
        check_requests(load("ch11", folder).MyEngine, parts)


def test_a_traced_my_engine_records_the_engines_own_trace(parts):
    """traced(MyEngine) sees each step from outside; where MyEngine schedules as the engine does (the
    reference pieces), its RunTrace equals LLM(trace=True)'s on the same workload, field by field: with
    chunked prefills, prefix hits, preemptions (14 KV blocks) and shared blocks freed late."""
    import random

    from nanoengine import LLM, SamplingParams
    from nanoengine.pieces.traced import traced
    from nanoengine.viz import show_timeline

    rng = random.Random(0)
    shared = [rng.randrange(1000, 30000) for _ in range(40)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(1000, 30000) for _ in range(rng.randint(5, 60))]}
               for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 20), ignore_eos=True) for _ in prompts]
    engine = reference_engine().MyEngine(parts, max_num_batched_tokens=32, max_num_seqs=4, num_blocks=14)
    mine = LLM.from_engine(traced(engine))
    got = mine.generate(prompts, params, use_tqdm=False)
    ours = LLM("tiny-qwen3", dtype="float32", num_kvcache_blocks=14, max_num_batched_tokens=32,
               max_num_seqs=4, trace=True, async_scheduling=False)
    want = ours.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]

    def steps(trace):
        base = min(trace.prompts)
        return [([(e.seq_id - base, e.prefill_tokens, e.decode_tokens, e.num_computed_before)
                  for e in s.scheduled], sorted(s.blocks_allocated), sorted(s.blocks_freed),
                 [(i - base, h) for i, h in s.cache_hits], [i - base for i in s.preempted],
                 [i - base for i in s.finished], s.stats.used_blocks, s.stats.num_seqs,
                 s.stats.prefill_tokens, s.stats.decode_tokens, s.stats.cache_hit_tokens,
                 {k - base: v for k, v in s.block_tables.items()}, s.ref_counts, s.cached_free_blocks,
                 s.block_hashes) for s in trace.steps]

    yours, engines = steps(mine.trace), steps(ours.trace)
    assert sum(len(s[4]) for s in engines) and mine.trace.hit_tokens, "the workload must preempt and hit"
    assert len(yours) == len(engines)
    for i, (a, b) in enumerate(zip(yours, engines)):
        assert a == b, f"step {i}: traced {a}\nthe engine's {b}"
    assert show_timeline(mine.trace, tokenizer=mine.tokenizer).num_steps == len(engines)


def test_all_your_pieces_on_the_reference_answers(monkeypatch):
    from nanoengine.pieces.all_pieces import YOURS, all_your_pieces

    monkeypatch.setenv("NANOENGINE_IMPL", str(ROOT / "solutions"))
    run = all_your_pieces()
    assert [r.source for r in run.rows] == [YOURS] * 8, run.table()
    assert run.same_tokens and "the same tokens and text as the engine's own LLM" in run.table(), run.table()
    assert "2.1, 2.2, 2.3" in run.table() and "prefix-hit tokens" in run.table()


def test_all_your_pieces_says_which_piece_stood_in(tmp_path, monkeypatch):
    """Your 1.3, one of your 3.x, your 5.0 and 5.3 and your MyEngine.step still stubs: each is reported as
    stood in (and MyEngine's by the reference's), every other piece as yours, and the tokens are the
    engine's."""
    from nanoengine.pieces.all_pieces import ENGINE, REFERENCE, YOURS, all_your_pieces

    folder = pieces_folder(tmp_path, {"ch01": ["detokenize_incrementally"], "ch03": ["store_kv"],
                                      "ch05": ["admit_prompts", "build_inputs"], "ch11": ["step"]})
    monkeypatch.setenv("NANOENGINE_IMPL", str(folder))
    run = all_your_pieces()
    assert {r.exercises: r.source for r in run.rows} == {
        "1.3": ENGINE, "2.1, 2.2, 2.3": YOURS, "3.3, 3.5, 3.8": ENGINE, "4.1, 4.2, 4.4": YOURS,
        "5.0, 5.1, 5.2": "yours; the engine's 5.0", "5.3": ENGINE, "5.4, 5.5": YOURS,
        "11.1-11.3": REFERENCE}, run.table()
    assert "your 3.3 still stub" in run.table() and "your step still stubs" in run.table(), run.table()
    assert run.same_tokens and run.same_text, run.table()


def test_all_your_pieces_catches_tokens_or_text_that_differ(tmp_path, monkeypatch):
    from nanoengine.pieces.all_pieces import all_your_pieces

    off_by_one = ("        for seq, token in zip(seqs, map(int, tokens)):\n",
                  "        for seq, token in zip(seqs, (int(t) + 1 for t in tokens)):\n")
    folder = pieces_folder(tmp_path, {"ch11": [off_by_one]}, stubs_of=("ch02", "ch03", "ch04"))
    monkeypatch.setenv("NANOENGINE_IMPL", str(folder))
    run = all_your_pieces()
    assert not run.same_tokens and "NOT the engine's tokens: prompt 0, token 0" in run.table(), run.table()

    marked = ("    return new_text[len(prefix_text):], read_offset, len(token_ids)\n",
              "    return '<' + new_text[len(prefix_text):] + '>', read_offset, len(token_ids)\n")
    monkeypatch.setenv("NANOENGINE_IMPL", str(pieces_folder(tmp_path / "text", {"ch01": [marked]},
                                                            stubs_of=("ch02", "ch03", "ch04"))))
    run = all_your_pieces()
    assert run.same_tokens and "the same tokens, but NOT the engine's text: prompt 0" in run.table(), (
        run.table())
