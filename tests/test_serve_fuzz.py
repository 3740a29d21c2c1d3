"""The server's HTTP surface, fuzzed from its own OpenAPI schema with schemathesis (hypothesis underneath):
every generated request to every route gets a status the schema documents, with the documented content type,
never a 5xx, within the timeout; an error is OpenAI's error object. Afterwards the server holds no request
and no KV block, and answers a known greedy request with the same text as before. Loopback only, a fixed
number of examples per route, derandomized (the same requests on every run)."""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance
from serve_proc import MODEL

pytestmark = [pytest.mark.xdist_group("serve-abuse"), pytest.mark.slow]

EXAMPLES = 60  # per route (300 found nothing more here: 900 requests, 54 s)
KNOWN = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def served():
    from nanoengine.serve.limits import ServerLimits
    from nanoengine.serve.server import Server

    limits = ServerLimits(max_body_bytes=64 * 1024, max_n=4, first_token_timeout_s=20.0)
    server = Server(MODEL, port=0, log_level="critical", trace=True, limits=limits,
                    engine_options={"dtype": "float32", "num_kvcache_blocks": 128, "max_model_len": 128,
                                    "max_num_seqs": 8})
    with server:
        yield server


def known_text(base: str) -> str:
    r = httpx.post(f"{base}/v1/completions", json=KNOWN, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def fuzz_operation(op, base: str, seen: dict) -> None:
    """EXAMPLES requests generated from one operation's schema, each answered as documented."""
    route = f"{op.method.upper()} {op.path}"

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def fuzz(case):
        response = case.call(base_url=base, timeout=30)
        seen[(route, response.status_code)] = seen.get((route, response.status_code), 0) + 1
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                 content_type_conformance])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"] and error["code"] == response.status_code, error

    fuzz()


def test_fuzzed_requests_get_documented_answers_and_the_server_serves_on(served):
    base = served.url.removesuffix("/v1")
    before = known_text(base)
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/health", "/v1/models", "/v1/completions",
                                              "/v1/chat/completions", "/metrics", "/v1/trace"}
    seen: dict[tuple[str, int], int] = {}
    for op in operations:
        fuzz_operation(op, base, seen)
    # the fuzzer reached the engine (accepted generations) and its checks (refusals), on both endpoints
    for path in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert seen.get((path, 200)) and seen.get((path, 400)), seen
    eng, deadline = served.llm_engine, time.monotonic() + 30
    while eng.scheduler.has_unfinished() or eng.block_manager.num_used_blocks:
        assert time.monotonic() < deadline, "the engine did not go idle after the fuzzing"
        time.sleep(0.05)
    assert not eng.scheduler.has_unfinished() and eng.block_manager.num_used_blocks == 0
    assert known_text(base) == before
