"""Chapter 11's checks: your engine, end to end, judged on behaviour through the engine protocol.

`MyEngine` (exercises/ch11_your_engine.py) is driven as `LLM`, the server and the benchmark drive any engine
(make_request, add, step, abort, has_unfinished, load, close), each run bounded in steps and in time:
- 11.1: it speaks the protocol (an empty class is told where to start), makes checked requests from text or
  token ids, refuses one that can never run, gives each completion your chapter 01 detokenizer (once your
  1.3 is done: `nanoengine.pieces.ch01`), and queues them;
- 11.2: greedy tokens equal transformers' on text prompts it did not choose, the text is the tokenizer's
  decoding of them, the streamed deltas add up to it, a stop string cuts it ("stop", the string as
  stop_reason), an n = 2 seeded request's first completion equals the same request with n = 1, and the
  metrics are stamped;
- 11.3: an aborted request finishes with "abort" while the others go on unchanged, and at the end nothing
  runs, waits or holds a block; `LLM.from_engine` runs it.
"""

from __future__ import annotations

import random
from typing import Any

from nanoengine.book import see
from nanoengine.engine.protocol import METHODS
from nanoengine.pieces.ch01 import YourDetokenizer
from nanoengine.pieces.own_engine import ModelParts, transformers_greedy
from nanoengine.pieces.schedule_checks import time_limit
from nanoengine.sampling_params import SamplingParams


def where(exercise: str) -> str:
    return see(exercise, "11a_requests_in.ipynb")


def check_protocol(engine_class: type, parts: ModelParts) -> Any:
    """Your class speaks the engine protocol; returns an engine made over `parts`."""
    missing = [m for m in METHODS if not callable(getattr(engine_class, m, None))]
    if len(missing) == len(METHODS):
        raise AssertionError(
            f"{engine_class.__name__} is still empty: an engine speaks the protocol of "
            "nanoengine/engine/protocol.py (make_request, add, step, abort, has_unfinished, load, close; "
            "tokenizer and plan). Start with __init__(self, parts, ...), make_request and add "
            f"{where('11.1')}")
    if missing:
        first = {"make_request": "11.1", "add": "11.1", "step": "11.2"}.get(missing[0], "11.3")
        raise AssertionError(f"{engine_class.__name__} has no {', '.join(missing)} yet: write "
                             f"{missing[0]} next {where(first)}")
    engine = engine_class(parts)
    for attr in ("tokenizer", "plan"):
        if not hasattr(engine, attr):
            raise AssertionError(f"your engine has no `{attr}` attribute: the server and LLM read it "
                                 f"(parts.{attr}) {where('11.1')}")
    return engine


def unseen_texts(parts: ModelParts, seed: int | None, n: int = 3) -> list[str]:
    """Text prompts the learner did not choose: the decoding of random token ids."""
    rng = random.Random(seed)
    tok = parts.tokenizer
    return [tok.decode([rng.randrange(1000, 30000) for _ in range(rng.randint(6, 40))]) for _ in range(n)]


def drive(engine: Any, requests: list, max_steps: int = 300, abort_after: tuple[int, str] | None = None,
          exercise: str = "11.2") -> dict[str, Any]:
    """Add the requests, step until nothing is unfinished (at most `max_steps`): per request id its streamed
    text per completion and how often it was reported finished."""
    streamed: dict[tuple[str, int], str] = {}
    finished: dict[str, int] = {}
    for req in requests:
        engine.add(req)
    for step in range(max_steps):
        if not engine.has_unfinished():
            break
        if abort_after is not None and step == abort_after[0]:
            engine.abort(abort_after[1])
        result = engine.step()
        for d in result.deltas:
            key = (d.request.request_id, d.index)
            streamed[key] = streamed.get(key, "") + d.text
        for req in result.finished:
            finished[req.request_id] = finished.get(req.request_id, 0) + 1
    else:
        raise AssertionError(f"{max_steps} steps and your engine still has unfinished work "
                             f"(has_unfinished() is True): does step finish a completion at its max_tokens? "
                             f"{where(exercise)}")
    return {"streamed": streamed, "finished": finished}


def check_requests(engine_class: type, parts: ModelParts) -> str:
    """11.1: the protocol, checked requests from text and from token ids, a refused one, queued ones."""
    engine = check_protocol(engine_class, parts)
    a = engine.make_request("The paged KV cache", SamplingParams(temperature=0, max_tokens=4))
    b = engine.make_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4))
    if a.request_id == b.request_id:
        raise AssertionError(f"two requests got the same id {a.request_id!r}: make a fresh one each time "
                             f"{where('11.1')}")
    if (a.prompt_token_ids != parts.tokenizer.encode("The paged KV cache")
            or b.prompt_token_ids != [5, 6, 7, 8]):
        raise AssertionError(f"make_request's prompt token ids are {a.prompt_token_ids} and "
                             f"{b.prompt_token_ids}: the text is tokenized, token ids are taken as they are "
                             f"(new_request does both) {where('11.1')}")
    too_long = [7] * (parts.plan.max_model_len + 1)
    try:
        engine.make_request(too_long, SamplingParams(max_tokens=4))
    except ValueError:
        pass
    else:
        raise AssertionError(f"a prompt of {len(too_long)} tokens (max_model_len {parts.plan.max_model_len}) "
                             f"was accepted: make_request must refuse what can never run {where('11.1')}")
    yours = your_detokenizer_done()
    if yours and not all(isinstance(c.detokenizer, YourDetokenizer) for c in a.completions + b.completions):
        raise AssertionError("your Exercise 1.3 is done, yet the completions make_request returns make their "
                             "text with the engine's detokenizer: give each completion yours, "
                             "completion.detokenizer = self.detokenizer(skip_special_tokens), with "
                             f"self.detokenizer = your_detokenizer(self.tokenizer) {where('11.1')}")
    engine.add(a)
    engine.add(b)
    return ("requests made from text and token ids, a too-long one refused, both queued"
            + (", each completion's text on your 1.3" if yours else ""))


def your_detokenizer_done() -> bool:
    """Is your Exercise 1.3 done (in the folder your engine takes its pieces from)?"""
    from nanoengine.pieces import folder_of
    from nanoengine.pieces.learner import is_stub, load

    return not is_stub(load("ch01", folder_of(None)).detokenize_incrementally)


def check_text(engine_class: type, parts: ModelParts, seed: int | None = None) -> str:
    """11.2: greedy tokens, text, streamed deltas and metrics on unseen text prompts."""
    engine = check_protocol(engine_class, parts)
    texts = unseen_texts(parts, seed)
    max_tokens = [7, 12, 5]
    reqs = [engine.make_request(t, SamplingParams(temperature=0, max_tokens=n))
            for t, n in zip(texts, max_tokens)]
    run = drive(engine, reqs)
    eng = parts.llm.engine
    want = transformers_greedy(eng.model_path, [r.prompt_token_ids for r in reqs], max_tokens,
                               eng.eos_token_ids)
    for i, (req, expected) in enumerate(zip(reqs, want)):
        out = req.output().outputs[0]
        if out.token_ids != expected:
            raise AssertionError(f"prompt {i} ({texts[i][:30]!r}...): your engine's greedy tokens "
                                 f"{out.token_ids}, "
                                 f"transformers' {expected}: your chapter 05 loop inside step (its checks "
                                 f"name the piece) {where('11.2')}")
        text = parts.tokenizer.decode(expected, skip_special_tokens=True)
        if out.text != text:
            raise AssertionError(f"prompt {i}: the text is {out.text!r}, the tokens decode to {text!r}: "
                                 "push each "
                                 f"token to its completion (completion.push) {where('11.2')}")
        got = run["streamed"].get((req.request_id, 0), "")
        if got != out.text:
            raise AssertionError(f"prompt {i}: the streamed deltas add up to {got!r}, the text is "
                                 f"{out.text!r}: "
                                 f"report every delta push returns as a TextDelta {where('11.2')}")
        if run["finished"].get(req.request_id) != 1:
            raise AssertionError(f"prompt {i} was reported finished {run['finished'].get(req.request_id, 0)} "
                                 f"times: once, in the step where its last completion ends {where('11.2')}")
        if req.metrics.first_token_time is None or req.metrics.finished_time is None:
            raise AssertionError(f"prompt {i}: metrics.first_token_time or finished_time was never set "
                                 f"{where('11.2')}")
    return f"{len(reqs)} unseen text prompts: tokens equal to transformers', text and streamed deltas equal"


def check_stop_and_seeds(engine_class: type, parts: ModelParts, seed: int | None = None) -> str:
    """11.2: a stop string cuts the text; an n = 2 seeded request's completions draw from seed and
    seed + 1."""
    text = unseen_texts(parts, seed, 1)[0]
    engine = check_protocol(engine_class, parts)
    full_req = engine.make_request(text, SamplingParams(temperature=0, max_tokens=12))
    drive(engine, [full_req])
    full = full_req.output().outputs[0].text
    stop = full[len(full) // 3: len(full) // 3 + 3]
    engine = check_protocol(engine_class, parts)
    req = engine.make_request(text, SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    drive(engine, [req])
    out = req.output().outputs[0]
    want = full[:full.find(stop)]
    if (out.text, out.finish_reason, out.stop_reason) != (want, "stop", stop):
        raise AssertionError(f"stop string {stop!r}: text {out.text!r}, finish {out.finish_reason!r}, "
                             f"stop_reason {out.stop_reason!r}; expected {want!r}, 'stop', {stop!r}: when "
                             "completion.stop_string is set the completion finishes with it "
                             f"{where('11.2')}")
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine = check_protocol(engine_class, parts)
    one = engine.make_request(text, sampled)
    drive(engine, [one])
    engine = check_protocol(engine_class, parts)
    two = engine.make_request(text, SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True,
                                                   n=2))
    drive(engine, [two])
    first, second = (c.token_ids for c in two.output().outputs)
    if first != one.output().outputs[0].token_ids or first == second:
        raise AssertionError(f"a seeded request with n=2 gave {first} and {second}; with n=1 it gives "
                             f"{one.output().outputs[0].token_ids}: completion i draws from its own "
                             f"generator "
                             f"seeded seed + i {where('11.1')}")
    return f"stop string {stop!r} cut the text; n=2 seeded completions drew from seed and seed + 1"


def check_abort(engine_class: type, parts: ModelParts, seed: int | None = None) -> str:
    """11.3: an abort finishes a request with "abort" and leaves the others as they were; at the end nothing
    runs, waits or holds a block; `LLM.from_engine` runs the engine."""
    texts = unseen_texts(parts, seed, 2)
    engine = check_protocol(engine_class, parts)
    alone = engine.make_request(texts[1], SamplingParams(temperature=0, max_tokens=8))
    drive(engine, [alone], exercise="11.3")
    engine = check_protocol(engine_class, parts)
    a = engine.make_request(texts[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    b = engine.make_request(texts[1], SamplingParams(temperature=0, max_tokens=8))
    drive(engine, [a, b], abort_after=(3, a.request_id), exercise="11.3")
    if [s.finish_reason for s in a.seqs] != ["abort"]:
        raise AssertionError(f"after abort({a.request_id!r}) its completion's finish_reason is "
                             f"{[s.finish_reason for s in a.seqs]}: it finishes with 'abort' {where('11.3')}")
    if b.output().outputs[0].token_ids != alone.output().outputs[0].token_ids:
        raise AssertionError(f"the request beside the aborted one gave {b.output().outputs[0].token_ids}, "
                             "alone "
                             f"{alone.output().outputs[0].token_ids}: an abort touches its own request only "
                             f"{where('11.3')}")
    engine.abort("no-such-request")  # an unknown id: nothing
    load = engine.load()
    if engine.has_unfinished() or tuple(load)[:3] != (0, 0, 0):
        raise AssertionError(f"every request is done, yet has_unfinished() is {engine.has_unfinished()} and "
                             f"load() is {load}: nothing runs, waits or holds a block (an aborted request "
                             f"gives its blocks back) {where('11.3')}")
    from nanoengine import LLM

    llm = LLM.from_engine(check_protocol(engine_class, parts))
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    if not all(o.finished for o in outs):
        raise AssertionError(f"LLM.from_engine(your engine).generate returned unfinished requests "
                             f"{where('11.3')}")
    llm.close()
    return ("an aborted request finished with 'abort', the other unchanged; load() back to 0; "
            "LLM.from_engine ran it")


def check_your_engine(engine_class: type, parts: ModelParts, seed: int | None = None) -> list[str]:
    """Every check, in order, each within 60 s; AssertionError at the first that fails."""
    out = []
    for check, args in ((check_requests, ()), (check_text, (seed,)), (check_stop_and_seeds, (seed,)),
                        (check_abort, (seed,))):
        with time_limit(60, f"{check.__name__} of your engine", "11"):
            out.append(check(engine_class, parts, *args))
    return out
