"""The server's logprobs and echo: OpenAI's two shapes built from hand-made engine outputs (no model), a
stream's chunks adding up to the reply, then over HTTP on tiny-qwen3 (a server in this process): the values
equal the engine's own RequestOutput's and transformers' log_softmax, streamed equals not streamed, echo with
max_tokens 0 scores the prompt alone, and the 400s (over --max-logprobs, top_logprobs without logprobs,
max_tokens 0 without echo)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from nanoengine.outputs import CompletionOutput, Logprob, RequestOutput
from nanoengine.serve.choices import CompletionChunks, CompletionShape, completion_choices
from nanoengine.serve.logprobs import MIN_LOGPROB, chat_logprobs, completion_logprobs
from nanoengine.serve.messages import ChoiceDone, Delta, RequestStream

MODEL = "tiny-qwen3"
ENGINE = {"dtype": "float32", "num_kvcache_blocks": 128, "max_model_len": 256}


def _pos(own: tuple[int, str, float, int], *top: tuple[int, str, float, int]) -> dict[int, Logprob]:
    """One position's dict as the engine makes it: its own token first, then the top k by rank."""
    return {t: Logprob(lp, rank, text) for t, text, lp, rank in (own, *top)}


# a prompt of 3 tokens ("Hi", " there", "!") and a completion of 2 (" yes", "."), top 2
PROMPT_LPS = [None, _pos((2, " there", -1.5, 2), (7, " you", -0.5, 1)),
              _pos((3, "!", -0.25, 1), (4, "?", -2.0, 2))]
OUT_LPS = [_pos((5, " yes", -0.1, 1), (6, " no", -2.5, 2)),
           _pos((8, ".", -3.0, 3), (9, ",", -1.0, 1), (10, "!", float("-inf"), 2))]


def test_completion_shape_of_echoed_positions():
    lp = completion_logprobs(PROMPT_LPS + OUT_LPS, unscored="Hi")
    assert lp.tokens == ["Hi", " there", "!", " yes", "."]
    assert lp.token_logprobs == [None, -1.5, -0.25, -0.1, -3.0]
    assert lp.top_logprobs[0] is None
    assert lp.top_logprobs[1] == {" there": -1.5, " you": -0.5}  # the token and the top k (k + 1 at most)
    assert lp.top_logprobs[4] == {".": -3.0, ",": -1.0, "!": MIN_LOGPROB}  # -inf is -9999.0, as OpenAI's
    assert lp.text_offset == [0, 2, 8, 9, 13]


def test_chat_shape_top_by_rank():
    content = chat_logprobs(OUT_LPS, top_logprobs=2)
    assert [c.token for c in content] == [" yes", "."] and content[0].bytes == list(b" yes")
    assert [t.token for t in content[1].top_logprobs] == [",", "!"]  # ranks 1, 2: the token itself is rank 3
    assert content[1].top_logprobs[1].logprob == MIN_LOGPROB
    assert chat_logprobs(OUT_LPS, top_logprobs=0)[0].top_logprobs == []


@pytest.mark.parametrize("echo_only", [False, True])
def test_stream_chunks_add_up_to_the_reply(echo_only):
    """Hand-made events (text held back and split unlike the tokens) against the reply built from the
    finished RequestOutput: the same text and the same logprobs, offsets included."""
    loop = asyncio.new_event_loop()
    stream = RequestStream("cmpl-1", num_prompts=1, n=1, loop=loop)
    loop.close()  # (only its accepted future is made on it)
    stream.echo = [("Hi there!", "Hi")]
    out = CompletionOutput(0, " yes.", [5, 8], "length", logprobs=OUT_LPS)
    stream.outputs = [RequestOutput("r", "Hi there!", [1, 2, 3], [out], True, prompt_logprobs=PROMPT_LPS)]
    shape = CompletionShape(logprobs=True, echo=True, echo_only=echo_only)
    reply = completion_choices(stream, 1, shape)[0]
    chunks = CompletionChunks(shape, stream)
    events = [Delta(0, "", OUT_LPS[:1], PROMPT_LPS), Delta(0, " yes.", OUT_LPS[1:]),
              ChoiceDone(0, "length", None, [])]
    parts = [chunks(ev) for ev in events]
    assert "".join(p.text for p in parts) == reply.text == ("Hi there!" if echo_only else "Hi there! yes.")
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(p.logprobs, field) for p in parts), []) == getattr(reply.logprobs, field), field
    assert len(reply.logprobs.tokens) == (3 if echo_only else 5) and parts[-1].finish_reason == "length"


# ------------------------------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def server():
    from nanoengine.serve.server import Server

    with Server(MODEL, port=0, log_level="warning", engine_options={**ENGINE, "max_logprobs": 5}) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    from nanoengine import LLM

    return LLM(MODEL, **ENGINE)


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/{route}", json={"model": MODEL, "temperature": 0, **body}, timeout=60)


def _stream(server, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/{route}", json={"model": MODEL, "temperature": 0, "stream": True,
                                                            **body}, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:])["choices"][0] for ln in lines[:-1]]


def _joined(chunks: list[dict]) -> dict:
    lps = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    return {"text": "".join(c["text"] for c in chunks),
            **{k: sum((lp[k] for lp in lps), []) for k in ("tokens", "token_logprobs", "top_logprobs",
                                                           "text_offset")}}


def _legacy(position: dict[int, Logprob]) -> tuple[float, dict[str, float]]:
    own = next(iter(position.values()))
    return own.logprob, {lp.decoded_token: lp.logprob for lp in position.values()}


@pytest.mark.slow
def test_completion_logprobs_and_echo_equal_the_engine_streamed_or_not(server, offline):
    from nanoengine import SamplingParams

    prompt = "The capital of France is"
    r = _post(server, "completions", {"prompt": prompt, "max_tokens": 5, "logprobs": 3, "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=3)
    want = offline.generate([prompt], params, use_tqdm=False)[0]
    positions = want.prompt_logprobs + want.outputs[0].logprobs
    lp = choice["logprobs"]
    assert choice["text"] == prompt + want.outputs[0].text
    assert len(lp["tokens"]) == len(want.prompt_token_ids) + 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i, position in enumerate(positions[1:], 1):
        logprob, top = _legacy(position)
        assert lp["token_logprobs"][i] == pytest.approx(logprob, abs=1e-5)
        assert lp["top_logprobs"][i] == pytest.approx(top, abs=1e-5)
        assert len(top) in (3, 4)  # the top 3, and the token when it is not among them
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]

    streamed = _joined(_stream(server, "completions", {"prompt": prompt, "max_tokens": 5, "logprobs": 3,
                                                          "echo": True}))
    assert streamed == {"text": choice["text"], **{k: v for k, v in lp.items()}}

    # without echo: the completion's tokens only
    r = _post(server, "completions", {"prompt": prompt, "max_tokens": 5, "logprobs": 0}).json()["choices"][0]
    assert r["logprobs"]["tokens"] == lp["tokens"][-5:] and r["text"] == want.outputs[0].text
    assert r["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"][-5:], abs=1e-5)
    assert all(len(top) == 1 for top in r["logprobs"]["top_logprobs"])


@pytest.mark.slow
def test_echo_with_max_tokens_0_is_transformers_log_softmax_of_the_prompt(server, tiny_qwen3_path):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [785, 6722, 315, 9625, 374, 12095, 13]  # token ids, as lm-eval sends them
    r = _post(server, "completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None  # the prompt alone
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)  # [T, V]
    want = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]  # [T - 1]
    assert lp["token_logprobs"][1:] == pytest.approx(want.tolist(), abs=1e-4)
    for i, top in enumerate(lp["top_logprobs"][1:]):
        best = sorted(top.values(), reverse=True)[:2]
        assert best == pytest.approx(logp[i].topk(2).values.tolist(), abs=1e-4)
    streamed = _joined(_stream(server, "completions", {"prompt": prompt, "max_tokens": 0, "echo": True,
                                                          "logprobs": 2}))
    assert streamed["tokens"] == lp["tokens"] and streamed["text"] == body["choices"][0]["text"]

    # echo without logprobs: the prompt's text before the completion, no logprobs
    r = _post(server, "completions", {"prompt": "Hello there", "max_tokens": 2, "echo": True}).json()
    assert r["choices"][0]["text"].startswith("Hello there") and r["choices"][0]["logprobs"] is None


@pytest.mark.slow
def test_chat_logprobs_equal_the_engine_streamed_or_not(server, offline):
    from nanoengine import SamplingParams

    messages = [{"role": "user", "content": "Name a color."}]
    body = {"messages": messages, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    r = _post(server, "chat/completions", body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0]
    assert len(content) == 6
    for entry, position in zip(content, want.outputs[0].logprobs, strict=True):
        own = next(iter(position.values()))
        assert entry["token"] == own.decoded_token
        assert entry["logprob"] == pytest.approx(own.logprob, abs=1e-5)
        assert entry["bytes"] == list(own.decoded_token.encode())
        best = sorted((lp for lp in position.values() if lp.rank <= 2), key=lambda lp: lp.rank)
        assert [t["token"] for t in entry["top_logprobs"]] == [lp.decoded_token for lp in best]
        assert math.isclose(entry["top_logprobs"][0]["logprob"], best[0].logprob, abs_tol=1e-5)
    chunks = _stream(server, "chat/completions", body)
    streamed = sum((c["logprobs"]["content"] for c in chunks if c.get("logprobs")), [])
    assert streamed == content
    plain = _post(server, "chat/completions", {"messages": messages, "max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.slow
@pytest.mark.parametrize("route, body, param, words", [
    ("completions", {"prompt": "Hi", "logprobs": 6}, "logprobs", ["max_logprobs (5)", "--max-logprobs"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                             "top_logprobs": 6}, "top_logprobs", ["max_logprobs (5)", "--max-logprobs"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2},
     "top_logprobs", ["logprobs=true"]),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens", ["echo"]),
    ("completions", {"prompt": "Hi", "logprobs": -1}, "logprobs", [">= 0"]),
])
def test_bad_logprobs_requests_are_400(server, route, body, param, words):
    r = _post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err
