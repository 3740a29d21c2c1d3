"""A failed or interrupted step leaves no trace (DESIGN: "a failed step leaves the engine as if the step had
never been scheduled"): the prefix cache, the queues and the counters after a failure at a prefill, a chunked
prefill, a decode and a verification step, overlap on and off, judged by greedy tokens and logprobs against a
fresh engine; the error paths keep what was done and raise the first error; `num_cached_tokens` is the first
admission's."""

from __future__ import annotations

import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.xdist_group("failed_step")

# SmolLM2 (its greedy output does not repeat one token), float32 and the torch attention, so a fresh engine
# and one that recovered compute the same numbers up to the rounding of differently shaped batches
OPTIONS = dict(block_size=4, dtype="float32", attention_backend="torch", num_kvcache_blocks=96,
               max_num_batched_tokens=32, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "row_cost": 0.15}
TEXTS = ["The paged KV cache keeps each sequence's keys and values in blocks of a few tokens, so",
         "The paged KV cache keeps each sequence's keys and values in blocks of a few tokens, and",
         "one two three four five six seven one two three four five six seven one two three four"]


def prompts(llm: LLM) -> list[dict]:
    """Two prompts sharing a long prefix, one of them twice (admitted in the same step, so its blocks are
    shared within the step), and a repetitive one (n-gram drafts)."""
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    return [{"prompt_token_ids": i} for i in (ids[0], ids[0], ids[1], ids[2])]


def results(outs) -> list[tuple[list[int], list[float]]]:
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]) for o in outs]


def assert_same(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=2e-3)


FAILS_AT = {  # which forward raises: (call number, the ModelInput, the engine) -> bool
    "prefill": lambda n, inp, engine: n == 1,
    "chunked prefill": lambda n, inp, engine: n == 2 and not inp.is_decode_only,
    "decode": lambda n, inp, engine: inp.is_decode_only and n >= 6,
    "verification": lambda n, inp, engine: any(s.spec_token_ids for s in engine.scheduler.running),
}


def failing(llm: LLM, where: str, error: BaseException) -> list[int]:
    """Make the engine's forward raise `error` once, where `where` says; returns the list of calls made."""
    executor, engine, calls, fired = llm.engine.executor, llm.engine, [], []
    real = executor.run_step

    def run_step(model_input, prev_tokens):
        calls.append(model_input)
        if not fired and FAILS_AT[where](len(calls), model_input, engine):
            fired.append(len(calls))
            raise error
        return real(model_input, prev_tokens)

    executor.run_step = run_step
    return fired


CASES = [(where, overlap) for where in FAILS_AT for overlap in (False, True) if not (
    where == "verification" and overlap)]  # (speculation does not overlap steps)


def engine_options(where: str, overlap: bool) -> dict:
    spec = {"speculative_config": NGRAM} if where == "verification" else {}
    return {**OPTIONS, "async_scheduling": overlap, **spec}


@pytest.fixture(scope="module")
def fresh():
    """What a fresh engine gives, per set of options (built once each)."""
    made: dict = {}

    def run(options: dict):
        key = repr(sorted(options.items()))
        if key not in made:
            llm = LLM("smollm2-135m", **options)
            made[key] = results(llm.generate(prompts(llm), GREEDY, use_tqdm=False))
            llm.close()
        return made[key]
    return run


@pytest.mark.parametrize(("where", "overlap"), CASES)
def test_an_interrupted_step_leaves_the_same_llm_giving_a_fresh_engines_tokens_and_logprobs(fresh, where,
                                                                                         overlap):
    options = engine_options(where, overlap)
    llm = LLM("smollm2-135m", **options)
    fired = failing(llm, where, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(llm), GREEDY, use_tqdm=False)
    assert fired, f"no {where} step was made"
    engine = llm.engine
    bm = engine.block_manager
    assert not engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    engine.block_manager.check_invariants([])
    assert_same(results(llm.generate(prompts(llm), GREEDY, use_tqdm=False)), fresh(options))


@pytest.mark.parametrize(("where", "overlap"), CASES)
def test_an_engine_that_goes_on_after_a_failed_step_finishes_its_requests_as_a_fresh_one(fresh, where,
                                                                                        overlap):
    """The requests stay queued through the failure (LLMEngine used directly, as the server's loop or a
    notebook would): the step is undone and done again."""
    options = engine_options(where, overlap)
    llm = LLM("smollm2-135m", **options)
    engine: LLMEngine = llm.engine
    fired = failing(llm, where, RuntimeError("the forward failed"))
    ids = [engine.add_request(p, GREEDY) for p in prompts(llm)]
    requests = [engine.requests[i] for i in ids]
    failures = 0
    for _ in range(200):
        if not engine.has_unfinished():
            break
        try:
            engine.step()
        except RuntimeError:
            failures += 1
        engine.block_manager.check_invariants(engine.scheduler.running)
    assert fired and failures == 1
    assert_same(results([r.output() for r in requests]), fresh(options))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_seeded_request_draws_the_same_tokens_after_a_failed_step(overlap):
    """The failed step's draws are put back: its seeded generator is as before the step."""
    options = {**OPTIONS, "async_scheduling": overlap}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    want = LLM("smollm2-135m", **options).generate(TEXTS[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("smollm2-135m", **options)
    engine, fired = llm.engine, []
    sampler = engine.executor.sampler

    def draw_then_fail(logits, batch):  # the step fails after its draw (e.g. Ctrl-C right after it)
        tokens = sampler(logits, batch)
        if not fired and len(calls) == 6:
            fired.append(1)
            raise RuntimeError("after the draw")
        return tokens

    calls = []
    real_run = engine.executor.run_step
    engine.executor.run_step = lambda *a: (calls.append(1), real_run(*a))[1]
    engine.executor.sampler = draw_then_fail
    request = engine.requests[engine.add_request(TEXTS[0], seeded)]
    while engine.has_unfinished():
        try:
            engine.step()
        except RuntimeError:
            pass
    assert fired and request.output().outputs[0].token_ids == want


def test_the_failed_steps_blocks_are_no_prefix_hits():
    """The minimal case: the first forward raises; the prefix cache holds nothing it would have written."""
    llm = LLM("smollm2-135m", **OPTIONS)
    failing(llm, "prefill", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(llm), GREEDY, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.hash_to_block_id == {} and not bm.get_cached_free_block_ids()
    assert llm.engine.scheduler.num_steps == 0  # the counter too: as if never scheduled
    again = llm.generate(prompts(llm)[:1], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0


# ------------------------------------------------------------------------------------------- error paths
@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-qwen3", block_size=4, num_kvcache_blocks=64)


def test_generate_failing_part_way_through_adding_leaves_nothing_queued(tiny, monkeypatch):
    engine, real, added = tiny.engine, tiny.engine.add, []

    def add(request):
        if added:
            raise RuntimeError("the second add fails")
        added.append(request)
        real(request)

    monkeypatch.setattr(engine, "add", add)
    with pytest.raises(RuntimeError, match="the second add fails"):
        tiny.generate(["one", "two", "three"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert added and not engine.requests and not engine.has_unfinished()


def test_the_first_error_is_the_one_raised_when_cleaning_up_fails_too(tiny, monkeypatch):
    def fails(message):
        def raise_it(*args):
            raise RuntimeError(message)
        return raise_it

    monkeypatch.setattr(tiny.engine.executor, "run_step", fails("first"))
    monkeypatch.setattr(tiny.engine, "drain", fails("second"))
    with pytest.raises(RuntimeError, match="first") as caught:
        tiny.generate(["one"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert any("second" in note for note in getattr(caught.value, "__notes__", []))
    with pytest.raises(RuntimeError, match="first"):
        list(tiny.stream("one", SamplingParams(max_tokens=4)))


def test_a_stream_keeps_the_text_of_a_drained_step_when_the_next_fails(tiny_qwen3_path):
    """Overlap with a grammar: a step drains the one in flight (its grammar needs its tokens), then the
    scheduling of the next one fails. The drained step's text still reaches the stream, then the error."""
    from nanoengine.structured import StructuredOutputsParams

    llm = LLM(tiny_qwen3_path, block_size=4, num_kvcache_blocks=64, async_scheduling=True)
    engine, calls = llm.engine, []
    real = engine.scheduler.schedule

    def schedule():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("scheduling failed")
        return real()

    engine.scheduler.schedule = schedule
    added, real_add = [], engine.add
    engine.add = lambda request: (added.append(request), real_add(request))
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{30}"))
    deltas = []
    with pytest.raises(RuntimeError, match="scheduling failed"):
        for delta in llm.stream("Spell a word:", params):
            deltas.append(delta)
    completion = added[0].completions[0]
    assert len(calls) == 4 and completion.num_sent >= 3  # three steps' letters were put in place
    assert not completion.seq.is_finished or completion.seq.finish_reason == "abort"
    # every delta the engine made reached the stream (the drained step's too), then the error
    assert "".join(deltas) == completion.text[:completion.num_sent]


# ------------------------------------------------------------------------------------------ num_cached_tokens
def test_num_cached_tokens_is_the_first_admissions_after_a_preemption(tiny_qwen3_path):
    llm = LLM(tiny_qwen3_path, block_size=4, num_kvcache_blocks=14, max_num_seqs=2, max_num_batched_tokens=64)
    engine = llm.engine
    prompt = {"prompt_token_ids": list(range(100, 116))}  # 4 full blocks
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = engine.add_request(prompt, params)
    engine.step()  # the first one's prompt is cached
    second = engine.add_request(prompt, params)
    seq = engine.requests[second].seqs[0]
    seen = None
    while engine.has_unfinished():
        engine.step()
        if seen is None and seq.block_table:
            seen = seq.num_cached_tokens  # what its first admission hit
    out = engine.requests[second].output()
    assert seq.num_preemptions >= 1, "the pool was meant to preempt the second request"
    assert seen == 16 and seq.num_cached_tokens != seen  # its re-admission hit a different count
    assert out.num_cached_tokens == seen
    assert engine.requests[first].output().num_cached_tokens == 0


# ------------------------------------------------------------------------------------------ held Ctrl-C
def test_ctrl_c_waits_for_the_end_of_a_held_stretch_and_never_for_a_stale_handler():
    import os
    import signal
    import time

    from nanoengine.engine.interrupts import HELD, held_interrupts

    done = []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append("the stretch ran to its end")
    assert done
    # someone's own handler, set for a while (tensor parallelism's, a server's): a stretch inside it hands the
    # signal to it, and puts it back after; once theirs is gone, Ctrl-C raises as usual again
    theirs = []
    before = signal.signal(signal.SIGINT, lambda *a: theirs.append(1))
    try:
        with held_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert theirs == [1] and signal.getsignal(signal.SIGINT) != HELD.handler
    finally:
        signal.signal(signal.SIGINT, before)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
