"""Exercises of book/01_tokenization.ipynb, checked against the real Qwen3 tokenizer (Hugging Face
`tokenizers`) and nanoengine's chat prompt and incremental detokenizer (its deltas and read offset step by
step; the prefix offset, a free choice, only within bounds). A wrong answer is also compared with the classic
mistakes (no NFC normalization, decoding each token alone, emitting half a character, decoding the whole
output every step, a window that never moves), so the message can say which one it looks like; each test also
checks that it names them."""

from __future__ import annotations

import functools
import random

import pytest
from ex_helpers import assert_detects, assert_equal, assert_same_list, book, explained

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


def encode_without_nfc(tok, text):
    """The ids of `text` pre-tokenized and merged as Qwen3 does, but without its NFC normalization."""
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    return [t.id for piece, _ in pieces for t in tok.backend_tokenizer.model.tokenize(piece)]


NO_NFC = ("encoding without NFC normalization: unicodedata.normalize(\"NFC\", text) first, so that e + a combining "
          "accent becomes the one character é, as the tokenizer's normalizer does")


def check_encode(encode, tok, where: str) -> None:
    for text in SAMPLES + random_texts(100, seed=2):
        want = tok.encode(text, add_special_tokens=False)
        got = encode(text)
        with explained(got, {NO_NFC: lambda text=text: encode_without_nfc(tok, text)},
                       same=lambda a, b: list(a) == b if isinstance(a, (list, tuple)) else False):
            assert_same_list(got, want, f"ids of {text!r}", where)


def test_1_2_encode_matches_qwen3_tokenizer(ex, tok, ranks):
    where = book(NB, "1.2")
    check_encode(lambda text: ex.encode(text, ranks), tok, where)

    def no_nfc(text):
        return encode_without_nfc(tok, text)
    assert_detects(lambda fn: check_encode(fn, tok, where), no_nfc, NO_NFC)


def detok_alone(decode, ids, prefix_offset, read_offset):
    """Decodes the newest token by itself."""
    return decode(ids[-1:]), prefix_offset, len(ids)


def detok_no_hold_back(decode, ids, prefix_offset, read_offset):
    """Emits whatever the window adds, half a character (U+FFFD) included."""
    prefix_text, new_text = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(new_text) <= len(prefix_text):
        return "", prefix_offset, read_offset
    return new_text[len(prefix_text):], read_offset, len(ids)


def detok_whole(decode, ids, prefix_offset, read_offset):
    """Right deltas and offsets, but decodes the whole output every step."""
    full, before = decode(ids), decode(ids[:read_offset])
    if len(full) <= len(before) or full.endswith("\ufffd"):
        return "", prefix_offset, read_offset
    return full[len(before):], read_offset, len(ids)


DETOK_MISTAKES = {
    "decoding each token alone: a token may hold part of a character, which decodes to U+FFFD by itself; "
    "decode the window token_ids[prefix_offset:] and emit what it adds to token_ids[prefix_offset:read_offset]":
        detok_alone,
    "emitting half a character: while the window's text ends in U+FFFD, hold back (return '' and the same "
    "offsets); the next token completes it": detok_no_hold_back,
}
WHOLE = ("decoding the whole output every step: decode only from prefix_offset on, so that a step costs the "
         "same at token 10,000 as at token 10")


WINDOW_SLACK = 8  # tokens of context a prefix_offset may keep beyond the engine's (vLLM starts with 5)


def detok_old_prefix(decode, ids, prefix_offset, read_offset):
    """Right deltas, but the window never moves forward (prefix_offset stays 0): each step's work grows."""
    prefix_text, new_text = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return "", prefix_offset, read_offset
    return new_text[len(prefix_text):], prefix_offset, len(ids)


def check_detokenizer(fn, tok, token_bytes, where: str) -> None:
    from nanoengine.tokenizer import IncrementalDetokenizer

    texts = SAMPLES + ["🦜𝕏𓀀🜁 rare characters split over tokens", "ｈｅｌｌｏ　ｗｏｒｌｄ", "Straße, 東京 and 🚀 " * 8,
                       "an end of turn<|im_end|> and then 🦜<|im_start|>"] + random_texts(60, seed=3)
    seen = {"held back": 0, "emitted after holding back": 0, "special token": 0}
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        engine = IncrementalDetokenizer(tok)
        longest = 0

        def decode(window, engine=engine):
            nonlocal longest
            longest = max(longest, len(window))
            return engine._decode(window)

        prefix, read, have = 0, 0, ""
        for i, t in enumerate(ids):
            want = engine.push(t)
            want_state = (want, engine.prefix_offset, engine.read_offset)
            longest = 0
            got = fn(decode, ids[: i + 1], prefix, read)
            what = (f"detokenize_incrementally(decode, ids[:{i + 1}], prefix_offset={prefix}, read_offset={read}) "
                    f"for the {len(ids)} tokens of {text!r} (ids {ids[max(0, i - 3): i + 1]} at the end)")
            variants = {d: functools.partial(v, engine._decode, ids[: i + 1], prefix, read)
                        for d, v in DETOK_MISTAKES.items()}
            with explained(got, variants):
                if not (isinstance(got, (tuple, list)) and len(got) == 3):
                    raise AssertionError(f"{what}: return (delta, prefix_offset, read_offset), got {got!r} {where}")
                # the delta and the read offset are the contract (what was emitted, up to which token); the
                # prefix offset is free within bounds: any window start that keeps each step's work bounded
                assert_equal((got[0], got[2]), (want_state[0], want_state[2]),
                             f"(delta, read_offset) of {what}", where)
                slack = WINDOW_SLACK + (engine.read_offset - engine.prefix_offset)
                if not (0 <= got[1] <= got[2] and got[2] - got[1] <= slack):
                    raise AssertionError(
                        f"{what}: prefix_offset {got[1]} with read_offset {got[2]}: the window the next step "
                        f"decodes again must start at or before read_offset and at most {slack} tokens before "
                        f"it (the engine keeps {engine.read_offset - engine.prefix_offset}); move it forward as "
                        f"you emit, or each step's work grows with the output {where}")
            if longest > i + 1 - prefix:
                raise AssertionError(f"{what} decoded a window of {longest} tokens; only the "
                                     f"{i + 1 - prefix} from prefix_offset on are needed. This looks like {WHOLE}. "
                                     f"{where}")
            seen["held back"] += want == "" and t < len(token_bytes) and not token_bytes[t].isascii()
            seen["emitted after holding back"] += bool(want) and read < i
            seen["special token"] += t >= len(token_bytes)
            _, prefix, read = got
            have += got[0]
        assert_equal(have, engine.text, f"the text of all deltas of {text!r}", where)
    assert all(seen.values()), f"test bug: the texts should cover every case: {seen}"


def test_1_3_incremental_detokenizer_matches_the_engine(ex, tok, ranks):
    where = book(NB, "1.3")
    token_bytes = {i: b for b, i in ranks.items()}
    token_bytes = [token_bytes[i] for i in range(len(token_bytes))]
    check_detokenizer(ex.detokenize_incrementally, tok, token_bytes, where)
    for description, wrong in DETOK_MISTAKES.items():
        assert_detects(lambda fn: check_detokenizer(fn, tok, token_bytes, where), wrong, description)
    assert_detects(lambda fn: check_detokenizer(fn, tok, token_bytes, where), detok_whole, WHOLE)
    assert_detects(lambda fn: check_detokenizer(fn, tok, token_bytes, where), detok_old_prefix,
                   "each step's work grows")
    check_detokenizer(detok_context_kept, tok, token_bytes, where)  # another bounded window passes too


def detok_context_kept(decode, ids, prefix_offset, read_offset):
    """A right answer with another window: it keeps up to 4 tokens of context before read_offset."""
    prefix_text, new_text = decode(ids[prefix_offset:read_offset]), decode(ids[prefix_offset:])
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return "", prefix_offset, read_offset
    return new_text[len(prefix_text):], max(prefix_offset, read_offset - 4, 0), len(ids)


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
