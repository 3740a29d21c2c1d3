"""Agents: thinking and tool calls (nanoengine/parsers.py, nanoengine/tools.py, the server's chat route).

The parsers against every split of a text (hypothesis) and of a real Qwen3 token stream; Qwen3's real chat
template with enable_thinking on and off, tools, calls and tool answers; the grammar that waits for the end
of the thinking (the engine's matcher, unit-level); the offline LLM.chat with tools and parse_chat_outputs;
then `nanoengine serve` through the `openai` client: a whole agent loop (a forced call, the tool's answer,
the reply), streamed and not, on tiny-qwen3 and on SmolLM2-135M (whose template has no tools: they go in
words), and the bad inputs, each a 400 naming its field (and the CLI's refusal of an unknown parser).
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoengine.parsers import ChatOutputParser, ParserOptions, parse_text, reasoning_state
from nanoengine.tools import render_with_tools, tool_grammar

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                                     "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QWEN3_OUTPUT = ('<think>\nThe user wants the weather. <tool_call>\n{"name": "get_time", "arguments": {}}\n'
                '</tool_call> is not what I need.\n</think>\n\nLet me look.\n<tool_call>\n'
                '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def run_parser(pieces: list[str], reasoning: str | None = "qwen3", tools: str | None = "hermes",
               state: str = "maybe") -> tuple[str, str, list[tuple[str, str]]]:
    """What a stream of pieces adds up to: (reasoning, content, [(name, arguments)])."""
    p = ChatOutputParser(reasoning, tools, state)
    r = c = ""
    calls = []
    for piece in [*pieces, None]:
        parts = p.feed(piece or "", final=piece is None)
        r, c = r + parts.reasoning, c + parts.content
        calls += [(k.name, k.arguments) for k in parts.tool_calls]
    return r, c, calls


def whole(text: str, **kw) -> tuple[str, str, list[tuple[str, str]]]:
    p = parse_text(text, kw.get("reasoning", "qwen3"), kw.get("tools", "hermes"), kw.get("state", "maybe"))
    return p.reasoning_content or "", p.content or "", [(k.name, k.arguments) for k in p.tool_calls]


# ------------------------------------------------------------------------------------------ the parsers
def test_parsers_split_thinking_answer_and_calls():
    r, c, calls = whole(QWEN3_OUTPUT)
    assert r.startswith("The user wants") and "<tool_call>" in r  # a call inside the thinking is not a call
    assert c == "Let me look."
    assert calls == [("get_weather", '{"city": "Paris", "unit": "C"}'), ("get_time", '{"zone": "CET"}')]
    assert parse_text(QWEN3_OUTPUT, "qwen3", "hermes").finish_reason == "tool_calls"
    # no thinking (enable_thinking=False closes it in the prompt); the opening in the prompt (DeepSeek-R1)
    assert whole("Hi <think>x</think>", state="closed") == ("", "Hi <think>x</think>", [])
    assert whole("plan\n</think>\n\nanswer", state="open") == ("plan", "answer", [])
    # max_tokens inside the thinking: what there is, as thinking
    p = parse_text("<think>\nhalf a tho", "qwen3", "hermes", reason="length")
    assert (p.reasoning_content, p.content, p.finish_reason) == ("half a tho", None, "length")
    # invalid JSON stays text; an unclosed last call counts when its JSON is whole
    assert whole("a <tool_call>{oops</tool_call> b") == ("", "a <tool_call>{oops</tool_call> b", [])
    assert whole('<tool_call>{"name": "f", "arguments": {"x": 1}}')[2] == [("f", '{"x": 1}')]
    assert whole("<think>a</think>b", reasoning=None, tools=None) == ("", "<think>a</think>b", [])
    assert reasoning_state("...assistant\n<think>\n\n</think>\n\n") == "closed"
    assert reasoning_state("...assistant\n<think>\n") == "open"
    assert reasoning_state("<|im_start|>assistant\n") == "maybe"


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "\n\n", "hello", "x",
             '{"name": "f", "arguments": {"a": [1, 2]}}', '{"name": "g"}', "{bad", "<", "</", "<tool", "</th",
             "<think", "ink>", "é€"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.lists(st.integers(0, 400), max_size=12),
       st.sampled_from(["maybe", "open", "closed"]), st.booleans())
def test_any_chunking_gives_the_same_parts(fragments, cuts, state, tools):
    """Streamed in any pieces, the parts add up to those of the whole text."""
    text = "".join(fragments)
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    kw = dict(tools="hermes" if tools else None, state=state)
    assert run_parser(pieces, "qwen3", kw["tools"], state) == whole(text, **kw)


def test_a_real_token_stream_in_every_split(qwen3_tokenizer_path):
    """The Qwen3 tokenizer's own pieces of a thinking + tool-call answer, grouped every way a stream's
    events can group them (each token alone, pairs, ..., all at once), parse like the whole text."""
    from nanoengine.tokenizer import IncrementalDetokenizer, load_tokenizer

    tok = load_tokenizer(qwen3_tokenizer_path)
    ids = tok.encode(QWEN3_OUTPUT, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<tool_call>") in ids and tok.convert_tokens_to_ids("</think>") in ids
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == QWEN3_OUTPUT
    want = whole(QWEN3_OUTPUT)
    for group in range(1, len(pieces) + 1):
        for offset in range(group):
            cut = [0, *range(offset or group, len(pieces), group), len(pieces)]
            events = ["".join(pieces[a:b]) for a, b in zip(cut, cut[1:])]
            assert run_parser(events) == want, (group, offset)


def test_parser_names_and_flags_are_checked():
    from nanoengine import assets
    from nanoengine.serve.protocol import ChatCompletionRequest, ProtocolError
    from nanoengine.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match="no such reasoning parser.*qwen3"):
        ParserOptions(reasoning_parser="qwen4")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ParserOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="'<think>' is not a token of smollm2-135m"):  # a start-up error
        ParserOptions("qwen3").check_vocabulary(load_tokenizer(assets.ensure("smollm2-135m")), "smollm2-135m")
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                 tool_choice="auto")
    with pytest.raises(ProtocolError, match="--enable-auto-tool-choice") as e:
        body.effective_tool_choice(auto_tool_choice=False)  # a server without the flags
    assert e.value.param == "tool_choice"
    assert body.model_copy(update={"tool_choice": None}).effective_tool_choice(False) == "none"


# ------------------------------------------------------------------------------------------ Qwen3's template
def test_qwen3_template_with_thinking_tools_calls_and_answers(qwen3_tokenizer_path):
    from nanoengine.tokenizer import load_tokenizer

    tok = load_tokenizer(qwen3_tokenizer_path)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    on = render_with_tools(tok, user)
    off = render_with_tools(tok, user, enable_thinking=False)
    assert reasoning_state(on) == "maybe" and on.endswith("<|im_start|>assistant\n")
    assert reasoning_state(off) == "closed" and off.endswith("<think>\n\n</think>\n\n")
    convo = [*user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    text = render_with_tools(tok, convo, TOOLS)
    assert "# Tools" in text and '"name": "get_weather"' in text and '"name": "get_time"' in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    assert call in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    from nanoengine.errors import InvalidValueError

    with pytest.raises(InvalidValueError, match="tool_call_id"):
        render_with_tools(tok, [*convo[:2], {"role": "tool", "content": "18 C"}], TOOLS)


# ------------------------------------------------------------------------------------------ offline
@pytest.fixture(scope="module")
def llm():
    from nanoengine import LLM

    return LLM("tiny-qwen3", dtype="float32", block_size=16, max_model_len=1024, num_kvcache_blocks=256)


def _allowed(mask, token: int) -> bool:
    return bool((int(mask.bitmask[0, token // 32]) >> (token % 32)) & 1)


def test_grammar_waits_for_the_end_of_the_thinking(llm):
    """The matcher takes no thinking token: no mask while the thinking is open, the grammar's after
    `</think>`; when the model may open it, the first token is the grammar's or `<think>`."""
    from nanoengine import SamplingParams
    from nanoengine.structured import StructuredOutputsParams

    tok, eng = llm.tokenizer, llm.engine
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    yes, call = tok.encode("yes")[0], tok.convert_tokens_to_ids("<tool_call>")
    so = StructuredOutputsParams(choice=["yes", "no"], reasoning_tags=("<think>", "</think>"))
    params = SamplingParams(max_tokens=8, structured_outputs=so)

    def seq(prompt: str):
        s = eng.make_request({"prompt_token_ids": tok.encode(prompt)}, params).seqs[0]
        eng.structured.add(s)
        return s

    closed = seq("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    m = eng.structured.mask([closed])
    assert m.rows == [0] and _allowed(m, yes) and not _allowed(m, think)
    opened = seq("<|im_start|>assistant\n<think>\n")
    assert eng.structured.mask([opened]) is None
    eng.structured.advance([(opened, [call, yes, call])])  # thinking: the matcher takes none of it
    assert eng.structured.mask([opened]) is None
    eng.structured.advance([(opened, [end])])
    m = eng.structured.mask([opened])
    assert m.rows == [0] and _allowed(m, yes) and not _allowed(m, call)
    maybe = seq("<|im_start|>assistant\n")
    m = eng.structured.mask([maybe])
    assert _allowed(m, yes) and _allowed(m, think) and not _allowed(m, call)
    eng.structured.advance([(maybe, [think])])
    assert eng.structured.mask([maybe]) is None
    for s in (closed, opened, maybe):
        eng.structured.release(s)


def test_offline_chat_with_tools_and_parse(llm):
    """LLM.chat(tools=..., chat_template_kwargs=...) and a forced call's grammar: even random weights
    return a valid call; parse_chat_outputs reads it into the server's shape."""
    from nanoengine import SamplingParams

    user = [{"role": "user", "content": "Weather in Paris?"}]
    grammar = tool_grammar(TOOLS, "required", False, reasoning_tags=("<think>", "</think>"))
    params = SamplingParams(max_tokens=120, temperature=0, structured_outputs=grammar)
    outs = llm.chat(user, params, use_tqdm=False, tools=TOOLS,
                    chat_template_kwargs={"enable_thinking": False})
    assert "<tools>" in llm.tokenizer.decode(outs[0].prompt_token_ids)
    (parsed,) = llm.parse_chat_outputs(outs)[0:1][0]
    assert parsed.finish_reason == "tool_calls" and parsed.reasoning_content is None, outs[0].outputs[0].text
    for c in parsed.tool_calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    msg = parsed.message()
    assert msg["role"] == "assistant"
    assert msg["tool_calls"][0]["function"]["name"] == parsed.tool_calls[0].name
    follow = [*user, msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "18 C"}]
    out = llm.chat(follow, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False, tools=TOOLS)[0]
    assert "<tool_response>\n18 C\n</tool_response>" in llm.tokenizer.decode(out.prompt_token_ids)


# ------------------------------------------------------------------------------------------ the server
def _stream(client, **kw):
    """A streamed chat as the client saw it: (reasoning, content, calls {index: [id, name, args]},
    finish_reason, chunks' deltas)."""
    reasoning = content = ""
    calls: dict[int, list] = {}
    finish, deltas = None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            deltas.append(d.model_dump(exclude_none=True))
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or ():
                if tc.id is not None:  # a call's first chunk: its id and name, before any arguments
                    assert tc.index not in calls and tc.function.name and tc.function.arguments == ""
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    calls[tc.index][2] += tc.function.arguments
            finish = ch.finish_reason or finish
    return reasoning, content, calls, finish, deltas


def _agent_loop(client, model: str, choice, extra: dict | None = None) -> None:
    """Call a tool (forced), answer it, get the reply: non-streamed and streamed agree."""
    messages = [{"role": "user", "content": "What is the weather in Paris, in C?"}]
    kw = dict(model=model, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0,
              parallel_tool_calls=False, extra_body=extra)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg
    assert msg.tool_calls and all(c.type == "function" and c.id.startswith("call_") for c in msg.tool_calls)
    for c in msg.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.tool_calls] == [choice["function"]["name"]]
    _, content, calls, finish, _ = _stream(client, **kw)
    assert finish == "tool_calls" and content == (msg.content or "")
    assert [(c[1], c[2]) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                      for c in msg.tool_calls]
    answer = json.dumps({"temperature": 18, "sky": "sunny"})
    messages += [msg.model_dump(exclude_none=True),
                 *({"role": "tool", "tool_call_id": c.id, "content": answer} for c in msg.tool_calls)]
    reply = client.chat.completions.create(**{**kw, "messages": messages, "tool_choice": "none",
                                              "max_tokens": 8})
    assert reply.choices[0].finish_reason in ("stop", "length") and not reply.choices[0].message.tool_calls
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its answer went back in


@pytest.fixture(scope="module")
def qwen_server():
    from serve_proc import Server

    s = Server("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.mark.slow
def test_agent_loop_on_tiny_qwen3(qwen_server):
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    _agent_loop(qwen_server.client, "tiny-qwen3", {"type": "function", "function": {"name": "get_weather"}},
                no_thinking)
    _agent_loop(qwen_server.client, "tiny-qwen3", "required", no_thinking)


@pytest.mark.slow
def test_served_thinking_and_auto(qwen_server):
    """enable_thinking false: no reasoning part, and a grammar applies from the first token; "auto" reads
    whatever the model wrote (random weights: text), streamed as it is whole."""
    client = qwen_server.client
    messages = [{"role": "user", "content": "Answer in JSON."}]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model="tiny-qwen3", messages=messages, max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    assert getattr(m, "reasoning_content", None) is None
    assert json.loads(m.content) in ({"ok": True}, {"ok": False})
    kw = dict(model="tiny-qwen3", messages=messages, tools=TOOLS, max_tokens=12, temperature=0)
    r = client.chat.completions.create(**kw)  # tool_choice left out: "auto" on this server
    reasoning, content, calls, finish, _ = _stream(client, **kw)
    m = r.choices[0].message
    assert (getattr(m, "reasoning_content", None) or "", m.content or "") == (reasoning, content)
    assert finish == r.choices[0].finish_reason


@pytest.mark.slow
def test_bad_agent_requests_are_400s_naming_the_field(qwen_server):
    url = f"{qwen_server.url}/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]

    def bad(param: str, **body):
        body = {"model": "tiny-qwen3", "messages": user, "max_tokens": 2, **body}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        return r.json()["error"]["message"]

    assert "name" in bad("tools", tools=[{"type": "function", "function": {"parameters": {}}}])
    assert "cannot compile" in bad("tools", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objectx"}}}])
    named = {"type": "function", "function": {"name": "nope"}}
    assert "nope" in bad("tool_choice", tools=TOOLS, tool_choice=named)
    assert "needs tools" in bad("tool_choice", tool_choice="required")
    assert "tool_call_id" in bad("messages", messages=[*user, {"role": "tool", "content": "18 C"}])
    assert "both" in bad("tool_choice", tools=TOOLS, tool_choice="required",
                         response_format={"type": "json_object"})
    assert httpx.get(f"{qwen_server.url}/health").json() == {"status": "ok"}  # and it serves on


def test_cli_refuses_unknown_parsers():
    for flags, says in ((["--reasoning-parser", "qwen4"], "no such reasoning parser"),
                        (["--enable-auto-tool-choice"], "--tool-call-parser"),
                        (["--tool-call-parser", "json"], "no such tool call parser")):
        r = subprocess.run([sys.executable, "-m", "nanoengine", "serve", "tiny-qwen3", *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and says in r.stderr, r.stderr


@pytest.mark.slow
def test_agent_loop_on_smollm2():
    """SmolLM2's template has no tools: they go in words (the system prompt, Hermes blocks, <tool_response>
    turns); a forced call is as valid, and "auto" serves whatever the model wrote."""
    from serve_proc import Server

    s = Server("--enable-auto-tool-choice", "--tool-call-parser", "hermes", model="smollm2-135m")
    try:
        _agent_loop(s.client, "smollm2-135m", "required")
        try:
            s.client.chat.completions.create(model="smollm2-135m", tools=TOOLS, tool_choice="auto",
                                             messages=[{"role": "user", "content": "hi"}], max_tokens=24,
                                             temperature=0)
        except openai.APIError as e:  # pragma: no cover - the assertion says what went wrong
            pytest.fail(f"auto tool choice failed: {e}")
    finally:
        s.stop()
