"""`nanoengine serve` through the real `openai` client, on a free loopback port, the server in a subprocess
started and stopped here: completions and chats (against the offline LLM as the oracle), streaming equal to
non-streaming, seeded n=2, 16 concurrent streams batched together, a client that disconnects (its blocks come
back), ten kinds of bad request (each a 400 naming the problem, then the server still serves), SIGTERM with a
request in flight, the step trace, and `bench --online --url` against the server."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from serve_proc import MODEL, Server

# every test but the last needs a server subprocess (~5 s to start here, ~20 s on a busy machine)
pytestmark = [pytest.mark.xdist_group("serve"), pytest.mark.slow]


@pytest.fixture(scope="module")
def server():
    s = Server("--trace")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline():
    """The offline LLM on the same engine options: the oracle for the served text."""
    from nanoengine import LLM

    return LLM(MODEL, dtype="float32", num_kvcache_blocks=512, max_model_len=1024)


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_server_info_is_the_engine_plan_as_json(server, offline):
    """GET /server_info (vLLM's route): what the engine was planned with; the data-parallel front end reads
    its replicas' block size here."""
    r = httpx.get(f"{server.url}/server_info")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    info, plan = r.json(), offline.plan
    assert info["model"] == MODEL and info["num_kv_blocks"] == 512  # serve_proc's --num-kvcache-blocks
    for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "enable_prefix_caching", "device", "dtype", "attention_backend", "tensor_parallel_size",
                 "async_scheduling", "quantization"):
        assert info[name] == getattr(plan, name), name
    assert info["max_model_len"] == 1024 and info["decode_mode"] == plan.decode_mode.value


def test_completion_and_chat_match_offline_llm(server, offline):
    from nanoengine import SamplingParams

    prompt = "The capital of France is"
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text == want.outputs[0].text
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    c = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == want.outputs[0].text
    assert c.usage.prompt_tokens == len(want.prompt_token_ids)
    assert c.usage.completion_tokens == len(want.outputs[0].token_ids) == 10

    # n=2 with a seed: reproducible, and the same draws as the offline engine's
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, n=2, seed=1234)
    a, b = server.client.completions.create(**kw), server.client.completions.create(**kw)
    texts = [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)]
    assert texts == [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(a.choices, key=lambda ch: ch.index)] == [0, 1]
    want = offline.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=1234),
                            use_tqdm=False)[0]
    assert texts == [o.text for o in want.outputs]
    assert a.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)


def test_streamed_chat_concatenates_to_non_streamed(server):
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    full = server.client.chat.completions.create(**kw)
    chunks = list(server.client.chat.completions.create(**kw, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content and text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    # a completion stream, raw: server-sent events ending with [DONE]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    streamed = "".join(c["text"] for c in (json.loads(ln[6:])["choices"][0] for ln in lines[:-1]))
    plain = server.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                             temperature=0)
    assert streamed == plain.choices[0].text


def test_sixteen_concurrent_streams_are_batched(server):
    before = server.metrics()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i} says", max_tokens=24 + i, temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, finish = None, None
        async for ch in stream:
            if ch.usage:
                usage = ch.usage.completion_tokens
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        return i, usage, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert [(i, n, f) for i, n, f in results] == [(i, 24 + i, "length") for i in range(16)]
    after = server.metrics()
    assert after["nanoengine_batch_size_peak"] > 1
    # steps of this test with more than one sequence (the histogram's counts, before and after)
    batched = lambda m: m["nanoengine_step_batch_size_count"] - m["nanoengine_step_batch_size_bucket{le=1.0}"]
    assert batched(after) - batched(before) > 0
    assert after["nanoengine_generation_tokens_total"] - before["nanoengine_generation_tokens_total"] == \
        sum(24 + i for i in range(16))
    assert after["nanoengine_kv_cache_used_blocks"] == 0 and after["nanoengine_num_requests_running"] == 0
    assert after["nanoengine_request_success_total{finish_reason=length}"] - \
        before.get("nanoengine_request_success_total{finish_reason=length}", 0) == 16
    assert after["nanoengine_time_to_first_token_seconds_count"] >= 16


def test_disconnect_mid_stream_frees_blocks(server):
    before = server.metrics()
    stream = server.client.completions.create(model=MODEL, prompt="A very long story begins", max_tokens=900,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    during = server.metrics()
    assert during["nanoengine_kv_cache_used_blocks"] > 0 and during["nanoengine_num_requests_running"] == 1
    stream.close()  # the client goes away with ~890 tokens still to generate
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["nanoengine_kv_cache_used_blocks"] == 0:
            break
        time.sleep(0.05)
    assert m["nanoengine_kv_cache_used_blocks"] == 0 and m["nanoengine_num_requests_running"] == 0
    assert m["nanoengine_request_aborted_total"] - before["nanoengine_request_aborted_total"] == 1
    # it stopped: far fewer than the 900 tokens asked for were generated
    assert m["nanoengine_generation_tokens_total"] - before["nanoengine_generation_tokens_total"] < 300


BAD_REQUESTS = [  # (what, request fields over a good completion request, words the message must contain)
    ("unknown model", {"model": "gpt-17"}, ["gpt-17", MODEL]),
    ("negative temperature", {"temperature": -0.5}, ["temperature", ">= 0"]),
    ("top_p out of range", {"top_p": 1.5}, ["top_p"]),
    ("max_tokens 0", {"max_tokens": 0}, ["max_tokens"]),
    ("n 0", {"n": 0}, ["n must be"]),
    ("temperature as a string", {"temperature": "hot"}, ["temperature", "number"]),
    ("prompt over max_model_len", {"prompt": [11] * 1100}, ["max_model_len"]),
    ("unknown field", {"logit_bias_v2": {"1": 2}}, ["logit_bias_v2"]),
    ("top_k below -1", {"top_k": -5}, ["top_k"]),
    ("stop token outside the vocabulary", {"stop_token_ids": [10**9]}, ["stop_token_ids", "vocabulary"]),
    ("empty prompt", {"prompt": ""}, ["empty prompt"]),
    ("an unsupported penalty", {"presence_penalty": 0.5}, ["presence_penalty"]),
]


def test_bad_requests_are_400_and_the_server_keeps_serving(server):
    good = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    for what, fields, words in BAD_REQUESTS:
        r = httpx.post(f"{server.url}/v1/completions", json={**good, **fields}, timeout=30)
        assert r.status_code == 400, (what, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error", what
        assert all(w in err["message"] for w in words), (what, err["message"])
    # through the openai client: its BadRequestError carries our message
    with pytest.raises(openai.BadRequestError, match="role"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              top_p=0)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "tiny-qwen3", "messages": [',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    # a field error names the field as OpenAI's `param`
    r = httpx.post(f"{server.url}/v1/completions", json={**good, "temperature": -1}, timeout=30)
    assert r.json()["error"]["param"] == "temperature"
    # content parts: text parts are joined (the same answer as one string); an image part is named
    chat = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    whole = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "messages": [
        {"role": "user", "content": "Why is the sky blue?"}]}, timeout=30).json()
    parts = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Why is the sky "},
                                     {"type": "text", "text": "blue?"}]}]}, timeout=30).json()
    assert parts["choices"][0]["message"] == whole["choices"][0]["message"]
    assert parts["usage"] == whole["usage"]
    image = [{"type": "text", "text": "What is in it?"},
             {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    for content, words in [(image, ["message 1's content part 1 has type 'image_url'", "only 'text' parts"]),
                           ([{"type": "text", "text": 3}], ["message 1's content part 0", "string 'text'"])]:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert all(w in err["message"] for w in words) and err["param"] == "messages", err
    with pytest.raises(openai.BadRequestError, match="has type 'image_url'"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": image}])
    ok = server.client.completions.create(**good)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 4
    assert server.metrics()["nanoengine_kv_cache_used_blocks"] == 0


def test_trace_endpoint_feeds_the_widgets(server):
    from nanoengine.serve.trace_json import fetch_trace, update_trace
    from nanoengine.viz.state import batch_composition_state

    trace = fetch_trace(server.url)
    before = len(trace.steps)
    r = server.client.completions.create(model=MODEL, prompt=["one two three", "four five"], max_tokens=5,
                                         temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 10
    tail = fetch_trace(server.url, since=before)
    assert tail.block_size == 16 and tail.num_blocks == 512 and len(tail.steps) >= 5
    assert max(len(s.scheduled) for s in tail.steps) == 2  # the two prompts ran in one batch
    assert all(isinstance(k, int) for s in tail.steps for k in s.block_tables)
    st = batch_composition_state(tail)
    assert st.num_steps == len(tail.steps) and sum(st.totals) == sum(s.num_batched_tokens for s in tail.steps)
    update_trace(trace, server.url)  # only the new steps are fetched and appended, in order
    assert [s.step for s in trace.steps] == list(range(len(trace.steps)))
    assert ([s.stats for s in trace.steps[before:]]
            == [s.stats for s in tail.steps][:len(trace.steps) - before])
    assert set(trace.prompts) >= set(tail.prompts)


def test_bench_online_against_the_server(server, tmp_path):
    from nanoengine.bench.online import report_served, run_served
    from nanoengine.bench.workload import make_workload

    r = run_served(server.url + "/v1", "smoke", request_rate=float("inf"))
    wl = make_workload("smoke")
    assert r["output_tokens"] == wl.num_output_tokens and r["num_requests"] == len(wl)
    assert r["latency"]["ttft_s"]["p50"] > 0 and len(r["latency"]["samples"]["ttft_s"]) == len(wl)
    assert r["server_steps"]["num_steps"] > 0 and r["server_steps"]["mean_batch_size"] > 1
    assert "TTFT p50/p99" in report_served(r)
    from nanoengine import cli

    assert cli.main(["bench", "--online", "--url", server.url, "--workload", "smoke", "--request-rate", "20",
                     "--out-dir", str(tmp_path)]) == 0
    assert list(tmp_path.glob("served_*smoke_r20.json"))


def test_sigterm_with_a_request_in_flight_exits_within_5_s():
    s = Server()
    try:
        stream = s.client.completions.create(model=MODEL, prompt="Keep talking", max_tokens=900,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it), next(it)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        finishes = []
        try:
            for ch in it:
                finishes += [c.finish_reason for c in ch.choices if c.finish_reason]
        except (httpx.HTTPError, openai.APIError):
            pass  # the connection may close before the last chunk
        s.proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0, f"the server took {elapsed:.1f} s to exit after SIGTERM"
        assert s.proc.returncode == 0, s.proc.stdout.read()
        assert finishes in ([], ["abort"])
    finally:
        s.stop()


def test_server_in_a_thread_of_this_process():
    """The book's way: the same Server from a background thread, stopped by leaving the with block."""
    from nanoengine.serve.server import Server

    server = Server(MODEL, port=0, log_level="warning",
                    engine_options={"dtype": "float32", "num_kvcache_blocks": 64, "max_model_len": 256})
    with server:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    assert server._thread is None and server.sock.fileno() == -1  # stopped, and the port let go
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url.removesuffix("/v1") + "/health", timeout=5)


def test_bench_url_refuses_what_it_would_ignore(capsys):
    from nanoengine import cli

    assert cli.main(["bench", "--url", "http://127.0.0.1:9"]) == 2  # --url needs --online
    assert "--online" in capsys.readouterr().err
    assert cli.main(["bench", "--online", "--url", "http://127.0.0.1:9", "--threads", "2"]) == 2
    assert "--threads" in capsys.readouterr().err
    assert cli.main(["bench", "--online", "--url", "127.0.0.1:9"]) == 2
    assert "http" in capsys.readouterr().err


def test_an_api_key_guards_every_v1_route_and_health_stays_open():
    """With api_key, /v1/* and /server_info (and /metrics with protect_metrics) answer 401 in OpenAI's format
    without the right `Authorization: Bearer` header (before the body is looked at), and serve with it."""
    from nanoengine.serve.http import is_loopback
    from nanoengine.serve.protocol import ProtocolError
    from nanoengine.serve.server import Server as InProcess

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.7") and not is_loopback("example.org")
    with pytest.raises(ProtocolError, match="protect_metrics needs an api_key"):
        InProcess(MODEL, port=0, protect_metrics=True)
    with pytest.raises(ProtocolError, match="api_key must be a non-empty string"):
        InProcess(MODEL, port=0, api_key=" ")
    server = InProcess(MODEL, port=0, log_level="warning", api_key="sekrit", protect_metrics=True,
                       engine_options={"dtype": "float32", "num_kvcache_blocks": 64, "max_model_len": 256})
    assert server.warnings == []  # loopback
    with server:
        base = server.url.removesuffix("/v1")
        good = {"Authorization": "Bearer sekrit"}
        assert httpx.get(f"{base}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            for method, path, body in (("GET", "/v1/models", None), ("GET", "/metrics", None),
                                       ("GET", "/server_info", None),
                                       ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}),
                                       ("POST", "/v1/chat/completions", {"bad": "body"})):
                r = httpx.request(method, base + path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                err = r.json()["error"]
                assert err["code"] == 401 and "API key" in err["message"], err
                assert r.headers["WWW-Authenticate"] == "Bearer"
        assert httpx.get(f"{base}/v1/models", headers=good).status_code == 200
        assert httpx.get(f"{base}/metrics", headers=good).status_code == 200
        info = httpx.get(f"{base}/server_info", headers=good)
        assert info.status_code == 200 and info.json()["max_model_len"] == 256, info.text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=server.url, api_key="sekrit", max_retries=0, timeout=60)
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_a_full_queue_refuses_with_503_and_retry_after_and_the_server_keeps_serving():
    """max_queued_seqs=2 with one sequence running at a time: while one request runs, two more wait and
    the next is refused at once (503, Retry-After), queuing nothing; afterwards the server serves again."""
    from concurrent.futures import ThreadPoolExecutor

    from nanoengine.errors import InvalidValueError
    from nanoengine.serve.limits import ServerLimits
    from nanoengine.serve.server import Server as InProcess

    with pytest.raises(InvalidValueError, match=r"max_queued_seqs \(--max-queued-seqs\) must be an integer"):
        ServerLimits(max_queued_seqs=0)
    server = InProcess(MODEL, port=0, log_level="warning", limits=ServerLimits(max_queued_seqs=2),
                       engine_options={"dtype": "float32", "num_kvcache_blocks": 128, "max_model_len": 1024,
                                       "max_num_seqs": 1})
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    long = {**body, "max_tokens": 1000, "stream": True}  # seconds of decoding: the others wait meanwhile
    with server:
        base = server.url.removesuffix("/v1")
        url = f"{base}/v1/completions"
        with httpx.stream("POST", url, json=long, timeout=60) as first:
            lines = first.iter_lines()  # (kept: a dropped iterator closes the stream, and aborts it)
            next(lines)  # it runs: the one sequence at a time
            with ThreadPoolExecutor(2) as pool:
                waiting = [pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=60)
                           for _ in range(2)]
                deadline = time.monotonic() + 30
                while len(server.llm_engine.scheduler.waiting) < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                refused = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
                assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
                assert "--max-queued-seqs 2" in refused.json()["error"]["message"]
                assert [f.result().status_code for f in waiting] == [200, 200]
            assert sum(1 for _ in lines) > 1
        again = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
