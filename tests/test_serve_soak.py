"""A soak of `nanoengine serve` (a subprocess on loopback): 1,000 requests over HTTP after 100 of warm-up, 16
at a time, mixed streaming and not, completions and chats, some clients hanging up mid-stream, some over the
server's limits. Every answer is what its kind must get (200, or the limit's 400), and afterwards nothing
runs or waits, no KV block is held, and the server's resident memory is flat within a few percent of what it
was after the warm-up. Bounded in count (and so in time: about 30 s here)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter

import httpx
import pytest
from serve_proc import MODEL, Server

pytestmark = [pytest.mark.xdist_group("serve-abuse"), pytest.mark.slow]

WARMUP, REQUESTS, CONCURRENCY = 100, 1000, 16
KINDS = ("complete", "stream", "chat_stream", "hang_up", "too_many_n", "too_long")
WEIGHTS = (35, 30, 15, 10, 5, 5)
WANT = {"complete": 200, "stream": 200, "chat_stream": 200, "hang_up": 200, "too_many_n": 400,
        "too_long": 400}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random, tally: Counter) -> None:
    body = {"model": MODEL, "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0.0, 0.8]),
            "prompt": " ".join(rng.choice(["once", "upon", "a", "time", "there", "was"])
                               for _ in range(rng.randint(1, 40)))}
    if kind == "too_many_n":
        body["n"] = 3
    if kind == "too_long":
        body["prompt"] = list(range(100, 400))  # 300 tokens: over --max-prompt-tokens 200
    url = "/v1/completions"
    if kind == "chat_stream":
        url, body = "/v1/chat/completions", {**{k: v for k, v in body.items() if k != "prompt"},
                                             "messages": [{"role": "user", "content": body["prompt"]}]}
    if kind in ("stream", "chat_stream", "hang_up"):
        body["stream"] = True
        async with client.stream("POST", url, json=body) as r:
            chunks, last = 0, None
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    chunks, last = chunks + 1, line
                    if kind == "hang_up" and chunks == 2:
                        break  # leaving the block closes the connection mid-stream
            done = kind == "hang_up" or last == "data: [DONE]"
            tally[(kind, r.status_code if done else "unfinished stream")] += 1
            tally["tokens"] += max(0, chunks - 2)
        return
    r = await client.post(url, json=body)
    tally[(kind, r.status_code)] += 1
    if r.status_code == 200:
        tally["tokens"] += r.json()["usage"]["completion_tokens"]
    else:
        tally[("error", r.json()["error"]["param"])] += 1


async def load(base: str, count: int, seed: int) -> Counter:
    rng, tally, gate = random.Random(seed), Counter(), asyncio.Semaphore(CONCURRENCY)
    kinds = rng.choices(KINDS, WEIGHTS, k=count)

    async def guarded(kind: str) -> None:
        async with gate:
            await one(client, kind, rng, tally)

    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        await asyncio.gather(*(guarded(k) for k in kinds))
    return tally


def engine_metrics(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
            for s in fam.samples if not s.labels}


def test_a_soak_of_mixed_requests_leaves_nothing_behind_and_memory_flat():
    s = Server("--max-num-seqs", "16", "--max-n", "2", "--max-prompt-tokens", "200")
    try:
        t0 = time.monotonic()
        warm = asyncio.run(load(s.url, WARMUP, seed=1))
        rss_before = rss_mb(s.proc.pid)
        tally = asyncio.run(load(s.url, REQUESTS, seed=2))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = engine_metrics(s.url)
            if not (m["nanoengine_num_requests_running"] or m["nanoengine_num_requests_waiting"]
                    or m["nanoengine_kv_cache_used_blocks"]):
                break
            time.sleep(0.1)
        rss_after = rss_mb(s.proc.pid)
        report = {"requests": REQUESTS, "warmup": WARMUP, "seconds": round(time.monotonic() - t0, 1),
                  "by_kind_and_status": {f"{k[0]} {k[1]}": v for k, v in sorted(tally.items(), key=str)
                                         if isinstance(k, tuple)},
                  "tokens": tally["tokens"], "rss_mb": [round(rss_before, 1), round(rss_after, 1)]}
        print(json.dumps(report, indent=1))
        if os.environ.get("NANOENGINE_SOAK_REPORT"):
            with open(os.environ["NANOENGINE_SOAK_REPORT"], "w") as f:
                json.dump(report, f, indent=1)
        answers = {k: v for k, v in tally.items() if isinstance(k, tuple) and k[0] in WANT}
        wrong = {k: v for k, v in answers.items() if k[1] != WANT[k[0]]}
        assert not wrong and sum(answers.values()) == REQUESTS, (wrong, report)
        assert sum(v for k, v in warm.items() if isinstance(k, tuple) and k[0] in WANT) == WARMUP
        assert tally[("error", "n")] == tally[("too_many_n", 400)] and tally[("error", "prompt")] == \
            tally[("too_long", 400)]
        m = engine_metrics(s.url)
        assert m["nanoengine_num_requests_running"] == m["nanoengine_num_requests_waiting"] == 0, m
        assert m["nanoengine_kv_cache_used_blocks"] == 0, m
        assert rss_after < rss_before * 1.05, report
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()
