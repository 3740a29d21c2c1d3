"""`nanoengine serve --data-parallel-size 2` (a subprocess on loopback, tiny-qwen3, one thread per replica)
through the openai client: streamed equals non-streamed; requests sharing a system prompt land on one replica,
whose own prefix cache then serves them (its /metrics, not the router's word); /metrics holds each replica
and the totals; a replica killed mid-request fails its requests with a clear error naming it while the other
serves on; SIGTERM stops every process with status 0; with every replica gone the front end exits with
status 1; a replica dies with its parent, however the parent ends. Bounded in count and time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_proc import MODEL, Server

pytestmark = [pytest.mark.xdist_group("serve"), pytest.mark.slow]

DP = ("--data-parallel-size", "2", "--threads", "1", "--device", "cpu")
SYSTEM = ("You are a terse assistant for a small bookshop. You answer questions about opening hours, "
          "orders, returns and gift cards in one short sentence, and you never make up a policy.")
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def health(s: Server) -> dict:
    return httpx.get(f"{s.url}/health").json()


def gone(pid: int, timeout: float = 15.0) -> bool:
    """The process has exited and been reaped, within timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def ask(s: Server, question: str, **kw):
    """A chat under SYSTEM; returns (text, replica)."""
    raw = s.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **{**GREEDY, **kw})
    return raw.parse().choices[0].message.content, int(raw.headers["x-nanoengine-replica"])


def test_two_replicas_serve_route_by_prefix_survive_a_death_and_stop_on_sigterm():
    s = Server(*DP)
    try:
        pids = [r["pid"] for r in health(s)["replicas"]]
        # streamed equals non-streamed (completions and chat)
        whole = s.client.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY).choices[0].text
        parts = s.client.completions.create(model=MODEL, prompt="Once upon a time", stream=True, **GREEDY)
        assert "".join(c.choices[0].text for c in parts) == whole and whole
        text, _ = ask(s, "When do you open?")
        chunks = s.client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": "When do you open?"}], stream=True, **GREEDY)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == text

        # one system prompt, many questions: one replica, and its prefix cache serves the system prompt
        before = s.metrics()
        owners = {ask(s, f"Question {i}: can I return book number {i}?")[1] for i in range(6)}
        after = s.metrics()
        assert len(owners) == 1, owners
        owner = owners.pop()
        hits = [after[f'nanoengine_prefix_cache_hit_tokens_total{{replica={i}}}']
                - before[f'nanoengine_prefix_cache_hit_tokens_total{{replica={i}}}'] for i in (0, 1)]
        assert hits[owner] >= 5 * 32 and hits[1 - owner] == 0, hits  # SYSTEM is over 2 blocks of 16
        assert after["nanoengine_prompt_tokens_total"] == sum(
            after[f"nanoengine_prompt_tokens_total{{replica={i}}}"] for i in (0, 1))
        assert after[f"nanoengine_router_requests_total{{reason=affinity,replica={owner}}}"] >= 5

        # a client that gives up on a plain request: the front end drops it, and so the replica aborts it
        aborted = after["nanoengine_request_aborted_total"]
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{s.url}/v1/completions", timeout=1.0, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 900, "ignore_eos": True})
        deadline = time.monotonic() + 20
        while s.metrics()["nanoengine_request_aborted_total"] == aborted and time.monotonic() < deadline:
            time.sleep(0.1)
        m = s.metrics()
        assert m["nanoengine_request_aborted_total"] == aborted + 1, m
        assert m["nanoengine_num_requests_running"] == 0, m

        # the owner dies with two requests in flight (a stream and a plain one); the other replica serves on
        def long_stream(question: str, max_tokens: int) -> str:
            stream = s.client.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": question}],
                stream=True, temperature=0, max_tokens=max_tokens, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].finish_reason or "" for c in stream)

        with ThreadPoolExecutor(3) as pool:
            doomed_stream = pool.submit(long_stream, "Tell me everything.", 900)
            doomed_plain = pool.submit(ask, s, "And again, everything.", max_tokens=900)
            deadline = time.monotonic() + 60
            while health(s)["replicas"][owner]["in_flight"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            # no full block to match: the least loaded replica
            survivor = pool.submit(lambda: [c.choices[0].finish_reason for c in s.client.completions.create(
                model=MODEL, prompt="hi", stream=True, **{**GREEDY, "max_tokens": 40})][-1])
            time.sleep(0.3)
            os.kill(pids[owner], signal.SIGKILL)
            why = f"replica {owner} \\(pid {pids[owner]}\\) was killed by signal 9 \\(SIGKILL\\)"
            with pytest.raises(openai.APIError, match=why):
                doomed_stream.result(60)
            with pytest.raises(openai.APIStatusError, match=why) as err:
                doomed_plain.result(60)
            assert err.value.status_code == 503
            assert survivor.result(60) == "length"
        state = health(s)
        assert state["replicas_up"] == 1 and not state["replicas"][owner]["up"], state
        assert ask(s, "Question 0: can I return book number 0?")[1] == 1 - owner  # its prefix moved
        m = s.metrics()
        assert m["nanoengine_router_replicas_up"] == 1
        assert m[f"nanoengine_router_lost_requests_total{{replica={owner}}}"] == 2

        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        assert gone(pids[1 - owner])
    finally:
        s.stop()


def test_with_every_replica_gone_the_front_end_exits_with_status_1():
    s = Server(*DP)
    try:
        pids = [r["pid"] for r in health(s)["replicas"]]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert s.proc.wait(30) == 1
        assert "no replica is left" in s.proc.stdout.read()
    finally:
        s.stop()


def test_a_replica_dies_with_its_parent_however_the_parent_ends():
    """The front end killed outright (no clean-up of its own): its replicas go by PR_SET_PDEATHSIG. Here the
    parent is a small Python process that starts `sleep` as the front end starts a replica."""
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, subprocess, sys, time\n"
        "from nanoengine.distributed.launcher import die_with_parent\n"
        "child = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent(os.getpid(), signal.SIGTERM))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        assert gone(child, timeout=5)
    finally:
        parent.kill()
