# Your exercises for book/01_tokenization.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch01")`, from nanoengine.check) or: pytest tests/exercises/test_ch01_tokenization.py
# Generated from solutions/ch01_tokenization.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
"""Chapter 01, book/01_tokenization.ipynb: byte-level BPE on the real Qwen3 vocabulary, chat prompts,
incremental detokenization.

Exercise 1.1: BPE-merge one pre-token by merge ranks.
Exercise 1.2: encode a whole text: normalize, pre-tokenize, merge, look up ids.
Exercise 1.3: offset-based incremental detokenization, as the engine streams text.
Exercise 1.4: build the Qwen3 chat prompt by hand.

`load_ranks` and `PATTERN` are given: the vocabulary as {token bytes: id} and Qwen3's pre-tokenizer regex.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

import regex

from nanoengine.assets import QWEN_PATTERN as PATTERN  # Qwen3's pre-tokenizer regex (needs `regex`, not `re`)

__all__ = ["PATTERN", "load_ranks", "bpe_merge", "encode", "detokenize_incrementally", "chat_prompt"]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (how byte-level vocabularies are stored as text)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def load_ranks(tokenizer: Any) -> dict[bytes, int]:
    """The BPE vocabulary as {token bytes: id}; for Qwen3 the id is also the merge rank (lower merges first).
    Special tokens (<|im_start|> ...) are not part of it."""
    decode = {c: b for b, c in byte_to_unicode().items()}
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)  # {"Ġworld": 1879, ...}
    return {bytes(decode[c] for c in token): i for token, i in vocab.items()}


def bpe_merge(piece: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Exercise 1.1: split one pre-token into BPE tokens.

    If `piece` is itself a token, return [piece]. Otherwise start from single bytes and repeatedly merge
    the adjacent pair whose concatenation has the lowest rank in `ranks`, until no adjacent pair
    concatenates to a token. Return the parts (their concatenation is `piece`).
    """
    raise NotImplementedError("Exercise 1.1: split one pre-token into BPE tokens - see book/01_tokenization.ipynb")


def encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """Exercise 1.2: the token ids of `text` (no special tokens), as Qwen3's tokenizer computes them.

    NFC-normalize the text, split it into pre-tokens with `regex.finditer(PATTERN, text)`, encode each
    pre-token as UTF-8, BPE-merge it (Exercise 1.1) and look each part's id up in `ranks`.
    """
    raise NotImplementedError("Exercise 1.2: the token ids of `text` (no special tokens), as Qwen3's tokenizer computes them - see book/01_tokenization.ipynb")


def detokenize_incrementally(decode: Callable[[list[int]], str], token_ids: list[int], prefix_offset: int,
                             read_offset: int) -> tuple[str, int, int]:
    """Exercise 1.3: the text delta of the newest token, with two offsets: (delta, prefix_offset, read_offset)

    `token_ids` are all the ids so far, the new one last; `decode(ids)` is the tokenizer's decode. The text of
    token_ids[:read_offset] has been emitted already; token_ids[prefix_offset:read_offset] is a few tokens of
    context that are decoded again next to the new ones, because a token may decode differently alone than
    after its neighbours (a byte of a multi-byte character decodes to U+FFFD alone). Decode only from
    prefix_offset on, never the whole list, so each step costs the same however long the output grows.

    Return ("", prefix_offset, read_offset) (unchanged) while the new tokens add no text, or their text ends
    in U+FFFD (a character not complete yet). Otherwise return the text they add and move the window: the
    old read_offset becomes the prefix_offset, and read_offset moves to the end.
    """
    raise NotImplementedError("Exercise 1.3: the text delta of the newest token, with two offsets: (delta, prefix_offset, read_offset) - see book/01_tokenization.ipynb")


def chat_prompt(messages: list[dict[str, str]], enable_thinking: bool = True) -> str:
    """Exercise 1.4: the Qwen3 chat prompt for a conversation, ready for the assistant's next turn.

    Each message becomes `<|im_start|>{role}\\n{content}<|im_end|>\\n` (roles: an optional first "system",
    then "user" and "assistant" turns; the last message is from the user). Then add
    `<|im_start|>assistant\\n`, and when `enable_thinking` is False also an empty thinking block
    `<think>\\n\\n</think>\\n\\n`, which tells Qwen3 to answer without reasoning first.
    """
    raise NotImplementedError("Exercise 1.4: the Qwen3 chat prompt for a conversation, ready for the assistant's next turn - see book/01_tokenization.ipynb")
