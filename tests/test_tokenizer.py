"""Incremental detokenization never splits a multi-byte character and adds up to the full decode."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoengine import assets
from nanoengine.tokenizer import IncrementalDetokenizer, load_tokenizer


@functools.cache
def qwen3_tokenizer():
    return load_tokenizer(assets.ensure("qwen3-tokenizer"))

TEXTS = ["Hello, world!", "naïve café", "東京タワー 🚀🚀 emoji", "x² + y² = z²", "  spaces\tand\nlines  "]


def deltas_for(tok, ids):
    d = IncrementalDetokenizer(tok)
    out = [d.push(t) for t in ids]
    out.append(d.flush())
    return out


def test_deltas_sum_to_full_decode(qwen3_tokenizer_path):
    tok = load_tokenizer(qwen3_tokenizer_path)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        parts = deltas_for(tok, ids)
        assert "".join(parts) == text
        assert not any("\ufffd" in p for p in parts), f"a delta split a character: {parts}"


def test_special_tokens_are_skipped_but_tags_kept():
    tok = qwen3_tokenizer()
    for text, want in [("a<|im_end|>b", "ab"), ("<|box_start|>", ""),
                       ("<think>x</think>", "<think>x</think>")]:
        assert "".join(deltas_for(tok, tok.encode(text, add_special_tokens=False))) == want


def test_character_split_over_tokens_waits():
    tok = qwen3_tokenizer()
    char = next(c for c in "🦜𝕏𓀀🜁" if len(tok.encode(c, add_special_tokens=False)) > 1)
    ids = tok.encode(char, add_special_tokens=False)
    parts = deltas_for(tok, ids)
    assert parts[: len(ids) - 1] == [""] * (len(ids) - 1), f"emitted part of {char!r} early: {parts}"
    assert "".join(parts) == char


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30))
def test_any_text_round_trips(text):
    tok = qwen3_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)  # what the detokenizer emits by default
    parts = deltas_for(tok, ids)
    assert "".join(parts) == full
    assert all("\ufffd" not in p for p in parts[:-1]) or "\ufffd" in full
