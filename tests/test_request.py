"""Completion.push: tokens in, the text delta out, cut at stop strings (vLLM's rules), on a
character-per-token tokenizer so the oracle is plain string slicing."""

from __future__ import annotations

import pytest

from nanoengine.engine.request import Completion, parse_prompt
from nanoengine.engine.sequence import Sequence, SequenceStatus
from nanoengine.sampling_params import SamplingParams


class CharTokenizer:
    """Token i is chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    def encode(self, text, **kwargs):  # (as a Hugging Face tokenizer, e.g. verbose=False)
        return [ord(c) for c in text]


def run(text: str, **params) -> tuple[list[str], Completion]:
    seq = Sequence([1], SamplingParams(**params), 4)
    completion = Completion(seq, CharTokenizer())
    deltas = []
    for ch in text:
        seq.token_ids.append(ord(ch))
        deltas.append(completion.push([ord(ch)], False))
        if completion.stop_string is not None:
            break
    return deltas, completion


def test_deltas_add_up_to_the_text():
    deltas, c = run("hello world")
    assert "".join(deltas) == c.text == "hello world" and c.stop_string is None


@pytest.mark.parametrize("include", [False, True])
def test_earliest_stop_string_cuts_the_text(include):
    deltas, c = run("say STOP now, END", stop=["END", "STOP"], include_stop_str_in_output=include)
    assert c.stop_string == "STOP"
    assert c.text == ("say STOP" if include else "say ") and "".join(deltas) == c.text


def test_stop_strings_wait_for_min_tokens():
    _, c = run("ab ab ab", stop="ab", min_tokens=4)
    assert c.stop_string == "ab" and c.text == "ab "  # the first "ab" came before min_tokens


def test_finished_sequence_flushes_and_reports_its_reasons():
    seq = Sequence([1], SamplingParams(), 4)
    c = Completion(seq, CharTokenizer())
    seq.token_ids.append(ord("x"))
    seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, "stop", 7
    assert c.push([ord("x")], True) == "x"
    out = c.output()
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == ("x", [ord("x")], "stop", 7)


def test_parse_prompt_forms_and_errors():
    tok = CharTokenizer()
    assert parse_prompt("hi", tok, 200) == ("hi", [104, 105])
    assert parse_prompt([3, 4], tok, 200) == (None, [3, 4])
    assert parse_prompt({"prompt_token_ids": [5], "prompt": "x"}, tok, 200) == ("x", [5])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        parse_prompt([300], tok, 200)
    with pytest.raises(ValueError, match="needs 'prompt' or 'prompt_token_ids'"):
        parse_prompt({}, tok, 200)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['text'\]"):
        parse_prompt({"text": "x"}, tok, 200)
    with pytest.raises(TypeError, match=r"must be ints; got True"):
        parse_prompt([1, True], tok, 200)
    with pytest.raises(TypeError, match="a prompt is a string"):
        parse_prompt(3.5, tok, 200)


def test_a_stream_never_shows_text_that_a_stop_string_takes_back():
    deltas, c = run("say STOP now", stop=["STOP", "NEVER"])
    assert "".join(deltas) == c.text == "say "
    assert all(d in ("", "s", "a", "y", " ") for d in deltas)  # no "S", "T", "O" shown and then cut


def test_held_back_text_comes_out_when_the_sequence_finishes():
    seq = Sequence([1], SamplingParams(stop="XYZ"), 4)
    c = Completion(seq, CharTokenizer())
    shown = []
    for ch in "abXY":
        seq.token_ids.append(ord(ch))
        shown.append(c.push([ord(ch)], ch == "Y"))  # the last token ends it: e.g. max_tokens reached
    assert shown == ["", "", "a", "bXY"] and c.text == "abXY"


@pytest.mark.parametrize("include", [False, True])
def test_several_tokens_at_once_stop_at_the_one_that_completes_a_stop_string(include):
    """A verification's kept tokens come in one push: the text is the same as one token at a time, and the
    tokens after the one that completed the stop string are counted as dropped."""
    text = "say STOP now"
    seq = Sequence([1], SamplingParams(stop="STOP", include_stop_str_in_output=include), 4)
    c = Completion(seq, CharTokenizer())
    first = c.push([ord(ch) for ch in text[:5]], False)
    # the same as one by one ("sa": " S" is held back while it may begin "STOP", unless the stop is shown)
    assert first == "".join(run(text[:5], stop="STOP", include_stop_str_in_output=include)[0])
    assert c.stop_string is None and c.num_dropped == 0
    delta = c.push([ord(ch) for ch in text[5:]], False)
    one_by_one = run(text, stop="STOP", include_stop_str_in_output=include)[1]
    assert c.text == one_by_one.text and first + delta == c.text and c.stop_string == "STOP"
    assert c.num_dropped == len(" now")  # "TOP" completed it; " now" is not kept
