"""Exercises of book/01_tokenization.ipynb, checked against the real Qwen3 tokenizer (Hugging Face
`tokenizers`) and nanoengine's chat prompt and detokenizer."""

from __future__ import annotations

import random

import pytest
from ex_helpers import assert_equal, assert_same_list, book

CHAPTER = "ch01_tokenization"
pytestmark = pytest.mark.xdist_group("ex_ch01")
NB = "01_tokenization.ipynb"

SAMPLES = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "naïve café déjà vu", "东京大学 and 日本語",
    "x² + y² = z²", "emoji: 🚀🚀 👍🏽 🦜", "def f(x):\n\treturn x * 12345\n", "I'm sure they'll've left",
    "   leading and trailing spaces   ", "line one\r\nline two\n\n\nthree", "Straße ﬁnal Åström", "1234567890",
    "<div class=\"a\">&nbsp;</div>", "한국어 텍스트", "tabs\t\tand\u00a0nbsp", "e\u0301 (e + combining acute)",
]
ALPHABET = ("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789     \n\t.,!?'\"-_()[]{}<>/\\#@%&*+=:;"
            "éüßñçøåæœ東京大学日本語한국어🚀😀👍🏽ﬁ\u0301\u00a0€£")


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    from nanoengine import assets
    from nanoengine.tokenizer import load_tokenizer

    return load_tokenizer(assets.ensure("qwen3-tokenizer"))


@pytest.fixture(scope="module")
def ranks(ex, tok):
    return ex.load_ranks(tok)


def pre_tokens(tok, text):
    """The tokenizer's own pre-tokens of `text`, as bytes."""
    decode = {c: b for b, c in byte_map().items()}
    norm = tok.backend_tokenizer.normalizer.normalize_str(text)
    return [bytes(decode[c] for c in piece) for piece, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(norm)]


def byte_map():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def test_1_1_bpe_merge_matches_qwen3_tokenizer(ex, tok, ranks):
    where = book(NB, "1.1")
    texts = SAMPLES + random_texts(60, seed=1)
    checked = 0
    for text in texts:
        for piece in pre_tokens(tok, text):
            want_ids = tok.backend_tokenizer.model.tokenize(bytes_as_str(piece))
            want = [bytes_of(t.value) for t in want_ids]
            got = ex.bpe_merge(piece, ranks)
            assert_same_list(got, want, f"BPE parts of pre-token {piece!r}", where)
            checked += 1
    assert checked > 200


def bytes_as_str(piece: bytes) -> str:
    m = byte_map()
    return "".join(m[b] for b in piece)


def bytes_of(token: str) -> bytes:
    decode = {c: b for b, c in byte_map().items()}
    return bytes(decode[c] for c in token)


def test_1_2_encode_matches_qwen3_tokenizer(ex, tok, ranks):
    where = book(NB, "1.2")
    for text in SAMPLES + random_texts(100, seed=2):
        want = tok.encode(text, add_special_tokens=False)
        got = ex.encode(text, ranks)
        assert_same_list(got, want, f"ids of {text!r}", where)


def test_1_3_stream_decode_never_splits_a_character(ex, tok, ranks):
    where = book(NB, "1.3")
    token_bytes = {i: b for b, i in ranks.items()}
    texts = SAMPLES + ["🦜𝕏𓀀🜁 rare characters split over tokens", "ｈｅｌｌｏ　ｗｏｒｌｄ"] + random_texts(60, seed=3)
    split_seen = False
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        got = ex.stream_decode(ids, token_bytes)
        assert_equal(len(got) if isinstance(got, list) else got, len(ids),
                     f"number of deltas for the {len(ids)} tokens of {text!r}", where)
        for i in range(len(ids)):
            # what a reader may have seen after token i: every complete character so far, nothing more
            want_so_far = tok.decode(ids[: i + 1]).rstrip("\ufffd")
            have = "".join(got[: i + 1])
            if have != want_so_far:
                raise AssertionError(
                    f"text after token {i} of {text!r} (ids {ids[: i + 1]}): your deltas give {have!r}, "
                    f"expected {want_so_far!r} (emit each character in the delta of the token that completes "
                    f"it, never a partial one) {where}")
            split_seen |= got[i] == "" and i + 1 < len(ids)
    assert split_seen, "test texts should include characters split over tokens"


def random_conversation(rng: random.Random) -> list[dict[str, str]]:
    words = ["hello", "Paris", "naïve", "东京", "🚀", "line\nbreak", "  spaced  ", "42", "code: `x = 1`", "?"]
    say = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
    msgs = [{"role": "system", "content": say()}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(0, 3)):
        msgs += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
    return msgs + [{"role": "user", "content": say()}]


def test_1_4_chat_prompt_matches_qwen3_template(ex, tok):
    from nanoengine.tokenizer import apply_chat_template

    where = book(NB, "1.4")
    rng = random.Random(4)
    for n in range(30):
        msgs = random_conversation(rng)
        thinking = n % 3 != 0
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=thinking)
        got = ex.chat_prompt(msgs, enable_thinking=thinking)
        if got != want:
            i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(
                f"chat prompt (enable_thinking={thinking}): first difference at character {i}: yours "
                f"...{got[max(0, i - 30): i + 30]!r}, expected ...{want[max(0, i - 30): i + 30]!r} {where}; "
                f"conversation: {msgs}")
        # and it tokenizes to what nanoengine's LLM.chat sends the model
        assert_same_list(tok.encode(got, add_special_tokens=False),
                         apply_chat_template(tok, msgs, enable_thinking=thinking),
                         "token ids of your chat prompt vs nanoengine's", where)
