"""The engine protocol (nanoengine/engine/protocol.py): `LLM`, `nanoengine serve` and `nanoengine bench`
take an engine that is not ours. The one here (tests/small_engine.py: transformers' model, greedy, no
paging, no prefix cache) shares no code with LLMEngine's step; its text must equal ours (both equal
transformers' greedy decoding), offline, over HTTP to the openai client (streamed and not), and measured
beside ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.engine.protocol import check_engine, load_engine
from nanoengine.errors import InvalidTypeError, InvalidValueError

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from serve_proc import Server  # noqa: E402
from small_engine import SmallEngine  # noqa: E402

pytestmark = pytest.mark.xdist_group("engine_protocol")
PROMPTS = ["The paged KV cache", "Once upon a time", "1 2 3 4"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def ours():
    llm = LLM("tiny-qwen3", dtype="float32")
    return {p: o.outputs[0] for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))}


@pytest.fixture(scope="module")
def small():
    return LLM.from_engine(SmallEngine("tiny-qwen3"))


def test_llm_runs_an_engine_of_ones_own(ours, small):
    outs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == ours[p].token_ids and out.outputs[0].text == ours[p].text
        assert out.finished and out.metrics.first_token_time is not None
    assert "".join(small.stream(PROMPTS[0], GREEDY)) == ours[PROMPTS[0]].text
    stop = ours[PROMPTS[1]].text[6:9]  # a stop string inside its text: the same cut as ours
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    want = LLM("tiny-qwen3", dtype="float32").generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    got = small.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)


def test_an_object_that_does_not_speak_it_is_refused_naming_what_it_lacks():
    class Half:
        tokenizer = plan = None

        def step(self):
            return None

    with pytest.raises(InvalidTypeError, match="no make_request, add, abort, has_unfinished, load, close"):
        LLM.from_engine(Half())
    with pytest.raises(InvalidValueError, match="give module:factory"):
        load_engine("small_engine", "tiny-qwen3")
    with pytest.raises(InvalidValueError, match="has no callable 'nope'"):
        load_engine("small_engine:nope", "tiny-qwen3")
    with pytest.raises(InvalidTypeError, match="no tokenizer, plan"):
        check_engine(SmallEngine)  # the class, not an engine


@pytest.mark.slow
def test_nanoengine_serve_serves_it_to_the_openai_client(ours):
    server = Server("--engine", "small_engine:make_engine", env=ENV, engine_flags=())
    try:
        client = server.client
        for p in PROMPTS[:2]:
            done = client.completions.create(model="tiny-qwen3", prompt=p, max_tokens=12, temperature=0)
            assert done.choices[0].text == ours[p].text
            chunks = client.completions.create(model="tiny-qwen3", prompt=p, max_tokens=12, temperature=0,
                                               stream=True)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == ours[p].text
        chat = client.chat.completions.create(model="tiny-qwen3", max_tokens=8, temperature=0, stream=True,
                                              messages=[{"role": "user", "content": "hi"}])
        assert [c for c in chat if c.choices and c.choices[0].finish_reason][0].choices[0].finish_reason
        import openai

        with pytest.raises(openai.BadRequestError, match="does not support structured outputs"):
            client.completions.create(model="tiny-qwen3", prompt="x", max_tokens=4, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[a-z]+"}})
    finally:
        server.stop()


@pytest.mark.slow
def test_nanoengine_bench_measures_it_beside_ours(tmp_path):
    done = subprocess.run([sys.executable, "-m", "nanoengine", "bench", "--model", "tiny-qwen3",
                           "--engine", "small_engine:make_engine", "--workload", "smoke",
                           "--out-dir", str(tmp_path), "--quiet", "--engine-options", '{"dtype": "float32"}'],
                          capture_output=True, text=True, env={**os.environ, **ENV, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "yours / nanoengine" in done.stdout
    result = json.loads(next(tmp_path.glob("beside_smoke_*.json")).read_text())
    for name in ("nanoengine", "yours"):
        assert result[name]["output_tokens_per_s"] > 0 and result[name]["latency"]["ttft_s"]["p50"] > 0
    assert result["yours_over_nanoengine"] > 0
