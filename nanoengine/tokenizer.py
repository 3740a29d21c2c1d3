"""Tokenizers: loading a Hugging Face tokenizer, chat prompts, and incremental detokenization. Chapter 01.

Byte-level BPE can split one UTF-8 character over several tokens, so decoding token by token would print
broken characters. `IncrementalDetokenizer` decodes a small window of recent tokens and only emits text
once it no longer ends in the replacement character U+FFFD.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from nanoengine.errors import InvalidTypeError, InvalidValueError

REPLACEMENT_CHAR = "\ufffd"


# path and tokenizer files' stamps -> a loaded tokenizer; each engine gets its own deep copy of it (loading
# the Qwen3 tokenizer is mostly parsing its JSON in Python, which a copy skips), so an engine that edits its
# tokenizer (a chat template, added tokens) changes no other engine's
_LOADED: dict[tuple, Any] = {}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer of a model folder (or hub-style name), a fresh copy for each caller."""
    folder = Path(path)
    if folder.is_dir():
        files = [folder / f for f in TOKENIZER_FILES if (folder / f).is_file()]
        key = (str(folder.resolve()), *((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files))
        if key not in _LOADED:
            _LOADED[key] = _load_tokenizer(folder)
        return copy.deepcopy(_LOADED[key])
    return _load_tokenizer(path)


def _load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    from nanoengine.errors import CheckpointError

    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json")  # transformers would build an empty one
    if Path(path).is_dir() and not any((Path(path) / f).is_file() for f in vocab_files):
        raise CheckpointError(f"{path}: its tokenizer could not be loaded (none of "
                              f"{', '.join(vocab_files)}); a model folder needs its tokenizer files "
                              "(tokenizer.json and tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: its tokenizer could not be loaded ({type(e).__name__}: "
                              f"{str(e)[:200]}); a model folder needs its tokenizer files "
                              "(tokenizer.json and tokenizer_config.json)") from e


def eos_token_ids(model_path: Path, hf_config: Any, tokenizer: Any) -> set[int]:
    """Every id the model may use to end a turn: generation_config's eos ids, config's, the tokenizer's."""
    ids: set[int] = set()
    gen = Path(model_path) / "generation_config.json"
    values = [json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None,
              getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    for value in values:
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
    return ids


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Any) -> list[dict]:
    """A conversation is a non-empty list of {"role": one of CHAT_ROLES, "content": ...} dicts, the content a
    string or a list of text parts (OpenAI's shape); returned with each content as one string. An agent's
    turns too: an assistant message with `tool_calls` may have no content (None), and a "tool" message
    answers one call, named by its `tool_call_id`."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidTypeError(f"a conversation is a non-empty list of messages, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidTypeError(f"message {i} must be a dict with 'role' and 'content', "
                                   f"got {type(m).__name__}")
        calls = m.get("role") == "assistant" and m.get("tool_calls")
        if "role" not in m or ("content" not in m and not calls):
            raise InvalidValueError(f"message {i} needs 'role' and 'content'; it has {sorted(m)}")
        if m["role"] not in CHAT_ROLES:
            raise InvalidValueError(f"message {i} has role {m['role']!r}; use one of {CHAT_ROLES}")
        if m["role"] == "tool" and not (isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]):
            raise InvalidValueError(f"message {i} has role 'tool' but no 'tool_call_id'; add the id of the "
                                    "tool call it answers")
        if m.get("content") is not None or not calls:
            check_utf8(message_text(m["content"], i), f"content of message {i}")
    return [{**m, "content": "" if m.get("content") is None else message_text(m["content"], i)}
            for m in messages]


def message_text(content: Any, i: int) -> str:
    """Message i's content as one string: a string, or a list of text parts {"type": "text", "text": ...}
    joined; any other part (an image, audio) is refused, naming its type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise InvalidTypeError(f"message {i}'s content must be a string or a list of text parts, "
                               f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"has type {kind!r}" if isinstance(kind, str) else "has no string 'type'"
            raise InvalidValueError(f"message {i}'s content part {j} {what}; nanoengine serves text models: "
                                    "only 'text' parts are supported")
        if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
            raise InvalidValueError(f"message {i}'s content part {j} is a text part: it takes exactly 'type' "
                                    f"and a string 'text', got keys {sorted(part)}")
        texts.append(part["text"])
    return "".join(texts)


def check_utf8(text: str, what: str) -> None:
    """Refuse text the tokenizer cannot take, naming where: a lone surrogate (say "\ud800", half of a UTF-16
    pair) has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidValueError(f"the {what} cannot be encoded as UTF-8: character {text[e.start]!r} at "
                                f"position {e.start} is a lone surrogate (half of a UTF-16 pair); remove it, "
                                "or decode the source text with errors='replace'") from None


def encode_text(tokenizer: Any, text: str, what: str = "prompt", **kwargs: Any) -> list[int]:
    """Token ids of `text`, checked first (check_utf8). The engine checks lengths against max_model_len
    itself, so the tokenizer's own "sequence length is longer than the maximum" warning is not shown."""
    check_utf8(text, what)
    return tokenizer.encode(text, verbose=False, **kwargs)


def render_chat(tokenizer: Any, messages: list[dict], **kwargs: Any) -> str:
    """The conversation as the model's chat template writes it, ending with the assistant's turn; kwargs:
    the template's arguments (`tools`, `enable_thinking`, ...)."""
    messages = check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidValueError("this model's tokenizer has no chat template; "
                                "use generate() with plain prompts")
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except (TypeError, TemplateError) as e:  # e.g. a message the template cannot join or refuses
        raise InvalidValueError(f"the chat template could not render this conversation ({e}); check "
                                "chat_template_kwargs and the messages") from None


def apply_chat_template(tokenizer: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    return encode_text(tokenizer, render_chat(tokenizer, messages, **kwargs), "conversation",
                       add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas that never split a character."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a fast tokenizer's Rust backend decodes without the overhead of the Python wrapper (which only adds
        # clean-up of spaces when the tokenizer asks for it); this runs once per generated token
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # tokens before this are already emitted as text
        self.prefix_text = ""  # decode(token_ids[prefix_offset:read_offset]), kept until the offsets move
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (may be '' while a character is incomplete)."""
        self.token_ids.append(token_id)
        prefix_text = self.prefix_text
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        self.text += delta
        return delta

    def decode_all(self) -> str:
        """The text of every token pushed so far, in one decode (what the deltas add up to, after flush)."""
        return self._decode(self.token_ids)

    def flush(self) -> str:
        """At the end: whatever is left (a truly invalid byte sequence decodes to U+FFFD)."""
        full = self.decode_all()
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        self.read_offset = len(self.token_ids)
        return delta


class TokenTexts:
    """Each token's own text (vLLM's `decoded_token` of a logprob: the token decoded alone), cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self.tokenizer.decode([token_id])
        return text
