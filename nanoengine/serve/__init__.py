"""`nanoengine serve`: an OpenAI-compatible HTTP server on the same continuous-batching engine. Chapter 05
(appendix).

- `protocol.py` and `responses.py`: the request and the response bodies, in OpenAI's shapes (pydantic);
- `async_engine.py`: one background thread steps the `LLMEngine`; handlers submit through a thread-safe queue
  and read their deltas from per-request asyncio queues (`messages.py`: what travels both ways; `faults.py`:
  a failure injected for the tests);
- `limits.py`: `ServerLimits`, what one request and the queue may be (body, n, prompt tokens, queued
  sequences, first-token timeout, unread stream chunks);
- `metrics.py`: the Prometheus metrics behind `GET /metrics`;
- `http.py`: what every HTTP app of ours needs: OpenAI's error format, the API key, the body limit, SSE
  framing, a client that went away, the socket, uvicorn's clean shutdown;
- `routes.py`: the OpenAI routes (the SSE chunks written once for completions and chats; `choices.py` builds
  the bodies, `logprobs.py` their logprobs in OpenAI's two shapes; a chat's thinking and tool calls are read
  by `nanoengine/parsers.py`, its tools checked and forced by `nanoengine/tools.py`), `/health`,
  `/server_info`, `/metrics`, `/v1/trace`;
- `server.py`: the process: `Server` (uvicorn on a bound socket, clean shutdown): `run()` in the foreground
  (`nanoengine serve`) or `start()` / `with Server(...)` from a background thread (the book);
- `trace_json.py`: the engine's step trace as JSON and back (`GET /v1/trace`, for the book's widgets).
- `router.py`, `replicas.py` and `data_parallel.py`: `--data-parallel-size N`, N replica processes behind one
  front end that sends each request to the replica caching its prompt's longest prefix (or round-robin).

    nanoengine serve tiny-qwen3 --port 8000
    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    print(client.completions.create(model="tiny-qwen3", prompt="Once upon", max_tokens=8).choices[0].text)
"""
