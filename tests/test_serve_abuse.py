"""`nanoengine serve` under abuse: every limit refuses with its status and a message naming its flag, and the
server serves on (with no KV block held afterwards); an engine step that raises (an injected RuntimeError or
MemoryError) fails every request in flight with a 500, turns /health unhealthy and ends the process with a
non-zero status within a few seconds. All on loopback, bounded in count and time."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import MODEL, Server

pytestmark = [pytest.mark.xdist_group("serve-abuse"), pytest.mark.slow]

ENGINE = {"dtype": "float32", "num_kvcache_blocks": 256, "max_model_len": 2048, "max_num_seqs": 1}
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status and err["message"], err
    return err


def wait_idle(server, timeout: float = 30.0) -> None:
    """Until the engine holds no request and no block (read from this thread: counts only)."""
    eng, deadline = server.llm_engine, time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not eng.scheduler.running and not eng.scheduler.waiting and eng.block_manager.num_used_blocks == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine is not idle: {len(eng.scheduler.running)} running, "
                         f"{len(eng.scheduler.waiting)} waiting, {eng.block_manager.num_used_blocks} blocks")


def test_each_limit_refuses_clearly_and_the_server_serves_on():
    from nanoengine.serve.limits import ServerLimits
    from nanoengine.serve.server import Server as InProcess

    limits = ServerLimits(max_body_bytes=4096, max_n=2, max_prompt_tokens=32, first_token_timeout_s=1.0,
                          max_unread_chunks=64)
    server = InProcess(MODEL, port=0, log_level="warning", limits=limits, engine_options=ENGINE)
    # small socket buffers (a slow network): a client that stops reading fills them in a few hundred chunks
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with server:
        base = server.url.removesuffix("/v1")
        url = f"{base}/v1/completions"

        def served() -> None:
            r = httpx.post(url, json=BODY, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text

        # the body: by its Content-Length, and chunked (no length) once it passes the limit
        big = {**BODY, "prompt": "x" * 5000}
        assert "--max-body-bytes" in error_of(httpx.post(url, json=big), 413)["message"]
        chunks = (json.dumps(big).encode()[i:i + 1000] for i in range(0, 6000, 1000))
        assert "--max-body-bytes" in error_of(httpx.post(url, content=chunks), 413)["message"]
        served()
        # n, and prompt tokens (as token ids, and as a chat)
        err = error_of(httpx.post(url, json={**BODY, "n": 3}), 400)
        assert err["param"] == "n" and "--max-n 2" in err["message"], err
        err = error_of(httpx.post(url, json={**BODY, "prompt": list(range(100, 140))}), 400)
        assert err["param"] == "prompt" and "40 tokens" in err["message"] and "--max-prompt-tokens 32" in \
            err["message"], err
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 60}], "max_tokens": 2}
        assert error_of(httpx.post(f"{base}/v1/chat/completions", json=chat), 400)["param"] == "messages"
        served()

        # the first-token timeout: one sequence runs at a time, so requests behind a long one wait past 1 s
        long = {**BODY, "max_tokens": 1500, "stream": True}
        with httpx.stream("POST", url, json=long, timeout=60) as first:
            lines = first.iter_lines()
            next(lines)
            with ThreadPoolExecutor(1) as pool:
                behind = pool.submit(httpx.post, url, json=BODY, timeout=60)
                with httpx.stream("POST", url, json={**BODY, "stream": True}, timeout=60) as streamed:
                    events = [line for line in streamed.iter_lines() if line.startswith("data:")]
                r = behind.result()
            err = error_of(r, 503)
            assert "no first token within 1 s" in err["message"] and "--first-token-timeout" in err["message"]
            assert int(r.headers["Retry-After"]) >= 1
            assert streamed.status_code == 200 and events[-1] == "data: [DONE]", events
            assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 503, events
            assert len(server.llm_engine.scheduler.waiting) == 0  # both were taken off the queue
        wait_idle(server)  # (leaving the block hung up on the long one)

        # a client that stops reading its stream: aborted once 64 chunks wait unread, not generated on
        host, port = base.removeprefix("http://").rsplit(":", 1)
        before = server.llm_engine.step_count
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            body = json.dumps({**BODY, "max_tokens": 1900, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.5)
            t0 = time.monotonic()
            wait_idle(server, timeout=60)
            steps = server.llm_engine.step_count - before  # ~420 here, of the 1900 asked for
            assert 64 < steps < 1200, f"the unread stream ran {steps} steps"
            assert time.monotonic() - t0 < 60
        served()
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        wait_idle(server)
        families = text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
        refused = {s.labels["reason"]: s.value for fam in families for s in fam.samples
                   if s.name == "nanoengine_requests_refused_total"}
        assert refused == {"body_too_large": 2, "n": 1, "prompt_tokens": 2, "first_token_timeout": 2,
                           "unread_chunks": 1}, refused


def test_an_injected_runtime_error_fails_requests_in_flight_and_the_server_exits_non_zero():
    """The step raises at step 30: the stream in flight ends with a 500 error chunk, a request waiting behind
    it gets a 500, /health is 503 naming the error, and the process exits with status 1 within a few
    seconds."""
    s = Server("--max-num-seqs", "1", env={"NANOENGINE_INJECT_FAULT": "RuntimeError@30"})
    try:
        base = s.url
        with ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                              json={**BODY, "max_tokens": 500, "stream": True}) as streamed:
                lines = streamed.iter_lines()
                next(lines)
                behind = pool.submit(httpx.post, f"{base}/v1/completions", json=BODY, timeout=60)
                events = [line for line in lines if line.startswith("data:")]
            t0 = time.monotonic()
            err = json.loads(events[-2].removeprefix("data: "))["error"]
            assert err["code"] == 500 and "RuntimeError: injected" in err["message"], events[-3:]
            err = error_of(behind.result(), 500)
            assert "RuntimeError: injected by NANOENGINE_INJECT_FAULT" in err["message"], err
        try:
            health = httpx.get(f"{base}/health", timeout=5)
            assert health.status_code == 503 and "engine failed" in health.json()["error"]["message"]
        except httpx.TransportError:
            pass  # it exited already
        code = s.proc.wait(timeout=10)
        assert code == 1 and time.monotonic() - t0 < 8, code
        out = s.proc.stdout.read()
        assert "the engine failed (RuntimeError: injected" in out and "exiting with status 1" in out, out
    finally:
        s.stop()


def test_a_memory_error_in_a_step_fails_the_request_and_ends_the_server(monkeypatch):
    from nanoengine.serve.server import Server as InProcess

    monkeypatch.setenv("NANOENGINE_INJECT_FAULT", "MemoryError@3")
    server = InProcess(MODEL, port=0, log_level="critical", engine_options=ENGINE)
    server.start()
    try:
        base = server.url.removesuffix("/v1")
        err = error_of(httpx.post(f"{base}/v1/completions", json={**BODY, "max_tokens": 20}, timeout=60), 500)
        assert "MemoryError" in err["message"] and "exiting" in err["message"], err
        deadline = time.monotonic() + 10
        while server._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server._thread.is_alive() and server.exit_code == 1
    finally:
        server.stop()
