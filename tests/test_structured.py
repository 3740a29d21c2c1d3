"""Structured outputs (nanoengine/structured.py): the parameters, the grammar mask, and the engine's rules.

- the parameters' checks and the grammar cache: plain Python;
- the mask against an oracle: the first tokens a choice grammar allows are exactly the tokens whose text
  starts one of the choices; the model's padding ids past the tokenizer's and rows without a grammar;
- the engine on tiny-qwen3 (random weights, greedy): every constrained output satisfies its constraint
  (jsonschema for JSON, re.fullmatch, the choice set), and a request without one gets the same tokens alone
  and in a batch with grammar requests; the same tokens with overlap scheduling on and off and with a pool
  tight enough to preempt; a speculative engine proposes no drafts for a grammar request and gives it the
  same tokens as a plain engine; a grammar the library cannot compile is an error naming it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.errors import InvalidTypeError, InvalidValueError
from nanoengine.structured import StructuredOutputs, StructuredOutputsParams, _compile

# bounded, so that a random model's greedy walk through it ends (enums, an integer range, a short string)
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "maxLength": 4}},
          "required": ["color", "size", "tag"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[a-c]{3}-\d{2}"
GRAMMAR = 'root ::= "(" [0-9] ("+" [0-9])? ")"'
PROMPTS = ["The paged KV cache stores keys and values in fixed-size blocks, so that", "Hi",
           "Once upon a time, in a land far away,", "x " * 30, "Answer in JSON:"]
BASE = dict(dtype="float32", block_size=16)


def constrained(**kind) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=160, structured_outputs=StructuredOutputsParams(**kind))


PLAIN = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def mixed() -> list[SamplingParams]:
    return [constrained(json=SCHEMA), PLAIN, constrained(choice=CHOICES), constrained(regex=REGEX),
            constrained(json_object=True), constrained(grammar=GRAMMAR)]


def check_constraints(outs, params) -> None:
    for out, p in zip(outs, params):
        so = p.structured_outputs
        for c in out.outputs:
            if so is None:
                continue
            if so.json_object and c.finish_reason == "length":  # random weights: an endless key; the
                assert c.text.startswith("{")  # matcher took every token (it raises on one it refuses)
                continue
            assert c.finish_reason == "stop", f"{so.kind}: {c.text!r} did not end ({c.finish_reason})"
            if so.json is not None:
                jsonschema.validate(json.loads(c.text), SCHEMA)
            elif so.json_object:
                assert isinstance(json.loads(c.text), dict), c.text
            elif so.choice is not None:
                assert c.text in CHOICES
            elif so.regex is not None:
                assert re.fullmatch(REGEX, c.text), c.text
            else:
                assert re.fullmatch(r"\(\d(\+\d)?\)", c.text), c.text


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen3", **BASE)


# ------------------------------------------------------------------------------------------ parameters
@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json_object": False}, "got none")])
def test_params_need_exactly_one(kwargs, message):
    with pytest.raises(InvalidValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"choice": []}, {"choice": ["a", 1]}, {"regex": ""}, {"json": 3},
                                    {"grammar": b"x"}, {"json_object": "yes"}])
def test_params_check_their_types(kwargs):
    with pytest.raises(InvalidTypeError, match=next(iter(kwargs))):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_only_the_class():
    with pytest.raises(InvalidTypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_equal_specs_share_one_compiled_grammar(llm):
    so = llm.engine.structured
    a = so.compile(StructuredOutputsParams(json=SCHEMA))
    b = so.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2)))  # as text, other spacing
    assert a is b and _compile.cache_info().hits > 0


# ------------------------------------------------------------------------------------------ the mask
def test_the_mask_allows_what_the_grammar_allows_and_nothing_past_the_tokenizer(llm):
    tok, vocab = llm.engine.tokenizer, llm.engine.plan.hf_config.vocab_size
    assert vocab > len(tok), "tiny-qwen3's model vocab is padded past its tokenizer's"
    so = StructuredOutputs(tok, vocab, llm.engine.eos_token_ids)

    class Seq:  # what the mask reads of a sequence
        def __init__(self, seq_id, params):
            self.seq_id, self.sampling_params = seq_id, params

    grammar, plain = Seq(-1, constrained(choice=CHOICES)), Seq(-2, PLAIN)
    so.add(grammar)
    so.add(plain)
    mask = so.mask([plain, grammar])
    assert mask.rows == [1]
    logits = torch.zeros(2, vocab)  # [2, V]
    masked = mask.apply(logits)
    assert torch.equal(logits, torch.zeros(2, vocab)), "the raw logits stay unmasked"
    assert torch.isfinite(masked[0]).all(), "a row without a grammar allows everything"
    allowed = set(torch.isfinite(masked[1]).nonzero().flatten().tolist())
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    oracle = {i for i, t in enumerate(texts) if t and any(c.startswith(t) for c in CHOICES)}
    assert allowed == oracle
    so.release(grammar)
    assert so.mask([plain, grammar]) is None


# ------------------------------------------------------------------------------------------ the engine
def test_constraints_hold_and_a_plain_request_is_untouched(llm):
    params = mixed()
    outs = llm.generate(PROMPTS[:1] * len(params), params, use_tqdm=False)
    check_constraints(outs, params)
    alone = llm.generate(PROMPTS[:1], PLAIN, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    # n > 1 with sampling: a matcher per completion
    sampled = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
    check_constraints(llm.generate(PROMPTS[1:2], sampled, use_tqdm=False), [sampled])
    assert not llm.engine.structured.matchers, "finished sequences drop their matchers"


@pytest.mark.slow
def test_overlap_and_preemption_keep_the_tokens(llm):
    params = [p for p in mixed() for _ in range(2)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    want = llm.generate(prompts, params, use_tqdm=False)
    check_constraints(want, params)
    tight = dict(max_num_batched_tokens=32, num_kvcache_blocks=12, trace=True)
    for overlap in (False, True):
        other = LLM("tiny-qwen3", async_scheduling=overlap, **BASE, **tight)
        got = other.generate(prompts, params, use_tqdm=False)
        assert tokens(got) == tokens(want), f"async_scheduling={overlap}"
        assert any(s.preempted for s in other.trace.steps), "the tight pool should have forced a preemption"
        assert other.engine.in_flight is None and not other.engine.structured.matchers


def test_speculation_drafts_nothing_for_a_grammar_request(llm):
    prompt = "one two three four one two three four one two three four one two"
    params = [constrained(regex=r"( one| two| three| four){6}"), SamplingParams(temperature=0, max_tokens=12)]
    want = llm.generate([prompt, prompt], params, use_tqdm=False)
    spec = LLM("tiny-qwen3", speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **BASE)
    drafted = []
    propose_many = spec.engine.drafts.propose_many  # (a step's decoding sequences, their limits)
    spec.engine.drafts.propose_many = lambda seqs, limits: drafted.extend(
        zip(seqs, d := propose_many(seqs, limits))) or d
    got = spec.generate([prompt, prompt], params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    assert re.fullmatch(r"( one| two| three| four){6}", got[0].outputs[0].text)
    assert all(not d for s, d in drafted if s.sampling_params.structured_outputs is not None)
    assert spec.engine.spec_counts.proposed > 0, "the plain request should have been drafted for"


@pytest.mark.parametrize("kind, spec, message", [
    ("json", {"type": "object", "properties": {"a": {"type": "strnig"}}},
     'JSON schema: Unsupported type "strnig"'),
    ("json", "{not json", "structured_outputs.json is not valid JSON"),
    ("regex", "a(b", "regex: Regex parsing error"),
    ("grammar", "root ::= ", "grammar: EBNF parser error")])
def test_what_the_library_cannot_compile_is_an_error_naming_it(llm, kind, spec, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**{kind: spec}))
    with pytest.raises(InvalidValueError, match=re.escape(message)):
        llm.generate(["Hi"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


# ------------------------------------------------------------------------------------------ the server
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                     "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
ASKS = ["Describe a fictional person as JSON.", "Who is Ada Lovelace? Answer in JSON.",
        "Make up a pirate captain and give their details.", "Tell me about your best friend, in JSON.",
        "Give a JSON profile of a retired chess champion."]


@pytest.fixture(scope="module")
def served():
    import openai

    from nanoengine.serve.server import Server

    server = Server("smollm2-135m", port=0, log_level="warning",
                    engine_options={"dtype": "float32", "num_kvcache_blocks": 128, "max_model_len": 1024})
    with server:
        yield server, openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)


@pytest.mark.slow
def test_openai_response_format_json_schema_validates_on_every_prompt(served):
    _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for ask in ASKS:
        r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": ask}],
                                           response_format=fmt, max_tokens=200, temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (ask, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    ask = "Reply with a JSON object with one key, ok, set to true."
    r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": ask}],
                                       response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    # vLLM's fields, through extra_body: structured_outputs and the older guided_*
    r = client.completions.create(model="smollm2-135m", prompt="Is the sky blue?", max_tokens=8,
                                  temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model="smollm2-135m", prompt="A date:", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].text)


@pytest.mark.slow
@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format", ["JSON schema", "strnig"]),
    ({"guided_regex": "a(b"}, "guided_regex", ["regex", "parenthesis"]),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ["exactly one"]),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", ["not guided_regex and guided_choice"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     ["json_schema.schema"]),
    ({"response_format": {"type": "yaml"}}, "response_format", []),
])
def test_what_cannot_be_compiled_or_is_given_twice_is_a_400_naming_it(served, fields, param, words):
    import httpx

    server, _ = served
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **fields}
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


# ------------------------------------------------------------------------------------------ the benchmark
@pytest.mark.slow
def test_structured_bench_writes_its_json(tmp_path):
    from nanoengine.bench import structured as bench

    argv = ["--batches", "1,4", "--max-tokens", "6", "--repeats", "1", "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    result = json.loads(next(tmp_path.glob("structured_tiny-qwen3_structured-mask_*.json")).read_text())
    for batch in ("1", "4"):
        r = result["batches"][batch]
        assert r["decode_step_ms_with"] > 0 and r["decode_step_ms_without"] > 0
        assert r["fill_ms"] > 0 and r["apply_ms"] > 0


def test_logprobs_raw_are_the_models_and_processed_are_the_masked_ones(llm):
    """Raw logprobs come from the unmasked logits (a plain request's at the same position); processed ones
    from the distribution the token was drawn from, the grammar's: only its tokens are finite."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    raw = llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0]
    plain = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    first = raw.token_ids[0]
    model_top = {t: lp.logprob for t, lp in plain[0].outputs[0].logprobs[0].items()}  # the model's top 5
    assert first not in model_top, "the grammar should have forced a token the model did not rank high"
    assert {t: lp.logprob for t, lp in raw.logprobs[0].items() if t != first} == model_top
    processed = LLM("tiny-qwen3", logprobs_mode="processed_logprobs", **BASE)
    out = processed.generate(["Hi"], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == raw.token_ids and raw.text in CHOICES
    tok = processed.get_tokenizer()
    for position in out.logprobs:
        finite = [t for t, lp in position.items() if lp.logprob > float("-inf")]
        assert all(any(c.startswith(tok.decode([t])) or tok.decode([t]) == "" for c in CHOICES)
                   or t in processed.engine.eos_token_ids for t in finite)
    assert out.logprobs[0][out.token_ids[0]].logprob > raw.logprobs[0][first].logprob  # mass renormalized
