"""The LLM API: vLLM-shaped inputs and outputs, stop rules, seeds, n > 1, streaming, chat, clear errors."""

from __future__ import annotations

import pytest

from nanoengine import LLM, SamplingParams

pytestmark = pytest.mark.xdist_group("tiny")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["Hello", "The weather today is", "1, 2, 3, 4,", "A" * 50]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen3", block_size=4)


def no_leaks(llm):
    eng = llm.engine
    assert not eng.scheduler.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n must be"), ({"stop": [""]}, "stop"), ({"min_p": 2}, "min_p"), ({"top_k": -5}, "top_k"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_input_forms_and_order(llm):
    ids = llm.tokenizer.encode(PROMPTS[1])
    outs = llm.generate([PROMPTS[0], ids, {"prompt_token_ids": ids}, {"prompt": PROMPTS[1]}], GREEDY,
                        use_tqdm=False)
    assert [o.prompt for o in outs] == [PROMPTS[0], None, None, PROMPTS[1]]
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids
    single = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    no_leaks(llm)


def test_a_prompt_dict_with_ids_and_text_runs_the_ids_and_carries_the_text(llm):
    """vLLM's TokensPrompt: `prompt_token_ids` is what runs; `prompt` is only the output's text."""
    ids = llm.tokenizer.encode(PROMPTS[1])
    both, from_ids, from_text = llm.generate(
        [{"prompt_token_ids": ids, "prompt": PROMPTS[2]}, ids, PROMPTS[2]], GREEDY, use_tqdm=False)
    assert both.prompt == PROMPTS[2] and both.prompt_token_ids == ids
    assert both.outputs[0].token_ids == from_ids.outputs[0].token_ids
    assert both.outputs[0].token_ids != from_text.outputs[0].token_ids  # the text was not what ran
    no_leaks(llm)


def test_batched_equals_one_by_one(llm):
    batched = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, b in zip(PROMPTS, batched):
        alone = llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == b.outputs[0].token_ids
    no_leaks(llm)


def test_per_prompt_params_and_length(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 3, 7, 2)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3, 7, 2]
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    with pytest.raises(ValueError, match="2 SamplingParams for 4 prompts"):
        llm.generate(PROMPTS, params[:2], use_tqdm=False)


def test_bad_prompts_add_nothing(llm):
    too_long = [1] * (llm.plan.max_model_len + 1)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", too_long], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 10**7]], GREEDY, use_tqdm=False)
    no_leaks(llm)  # the good prompt in the batch was not left behind half-added


def test_stop_token_ids(llm):
    ref = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = 4
    stop_tok = ref[stop_at]
    first = ref.index(stop_tok)
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_stop_strings(llm):
    ref = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    text = ref.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "need a non-blank stop string from the greedy text"
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, stop=[stop, "never-there"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    incl = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, stop=stop,
                                                     include_stop_str_in_output=True), use_tqdm=False)[0]
    assert incl.outputs[0].text == text[: text.index(stop) + len(stop)]
    no_leaks(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=8, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    mixed = llm.generate([PROMPTS[3], PROMPTS[0], PROMPTS[1]], [unseeded, p, unseeded], use_tqdm=False)
    assert alone == again == mixed[1].outputs[0].token_ids
    other = llm.generate([PROMPTS[0]],
                         SamplingParams(temperature=1.0, top_k=50, seed=124, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_n_completions_share_the_prompt_blocks():
    llm = LLM("tiny-qwen3", block_size=4, trace=True)
    prompt = "shared prompt " * 8
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three samples should not all be equal"
    n_prompt = len(out.prompt_token_ids)
    hits = sorted(n for _, n in llm.trace.hit_tokens_by_seq())
    assert hits == [0, (n_prompt // 4) * 4, (n_prompt // 4) * 4], (
        f"siblings should hit the prompt's full blocks: {hits}")
    no_leaks(llm)


def test_streaming_matches_generate(llm):
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    deltas = list(llm.stream(PROMPTS[1], p))
    assert "".join(deltas) == llm.generate([PROMPTS[1]], p, use_tqdm=False)[0].outputs[0].text
    no_leaks(llm)


def test_chat_and_metrics(llm):
    conv = [{"role": "user", "content": "Hi there"}]
    outs = llm.chat([conv, conv + [{"role": "assistant", "content": "Hello"},
                                   {"role": "user", "content": "Bye"}]],
                    GREEDY, use_tqdm=False)
    want = llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert llm.tokenizer.decode(outs[0].prompt_token_ids) == want
    m = outs[0].metrics
    assert m.time_to_first_token > 0 and m.time_per_output_token > 0


def test_interrupted_generate_leaves_engine_clean(llm, monkeypatch):
    calls = {"n": 0}
    real_step = llm.engine.step

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", flaky_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    no_leaks(llm)
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_bf16_answers_and_stops_on_eos():
    from nanoengine.layers.linear import onednn_bf16_available

    # default dtype: float32 on a CPU without fast bf16; where oneDNN has bf16, the faster of float32 (fused,
    # bf16 weight copies) and bf16 (oneDNN), timed once per machine (nanoengine/dtype_choice.py)
    llm = LLM("smollm2-135m")
    if onednn_bf16_available() and llm.plan.dtype_source in ("measured", "cached"):
        assert llm.plan.dtype in ("bfloat16", "float32")
    else:
        assert llm.plan.dtype == ("bfloat16" if onednn_bf16_available() else "float32")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_one_process_executor_runs_rpcs_and_keeps_sampling_on_the_driver(llm):
    """The engine steps through its executor (one rank here): collective_rpc runs fn(runner, *args) on the
    rank's ModelRunner, one result per rank; a seeded request's generator lives with the driver's sampler
    while the request runs and goes when it finishes."""
    blocks = llm.engine.executor.num_kv_blocks
    assert llm.collective_rpc(lambda runner, k: (runner.num_blocks, k), 7) == [(blocks, 7)]
    sampler = llm.engine.sampling
    stream = llm.stream("hello", SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True))
    next(stream)
    assert len(sampler.generators) == 1  # the running request's own generator
    list(stream)
    assert sampler.generators == {}
    no_leaks(llm)
