"""Reading a chat model's output: its thinking (`<think>...</think>`) and its Hermes tool calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), from a whole text or a stream of text pieces.
Chapter 05 (serving: reasoning and tool calls).

Qwen3 thinks before it answers and calls tools in the Hermes format. A server splits that text into OpenAI's
parts (vLLM's `--reasoning-parser qwen3` and `--tool-call-parser hermes`): `reasoning_content`, `content`
and `tool_calls`. `ChatOutputParser` does it as text arrives: `feed(piece)` returns the new parts (a tag
split over several pieces is held back until it is whole), `feed("", final=True)` what is left. A whole
text is one `feed(text, final=True)`, so streaming and not give the same parts however the text is split.

The rules:
- reasoning: where the thinking starts depends on the prompt (`reasoning_state`): Qwen3's template leaves
  the model to open `<think>` itself ("maybe": the output's first non-blank text decides), with
  `enable_thinking=False` it closes it in the prompt ("closed": all is answer), and a DeepSeek-R1-style
  template opens it in the prompt ("open"). The thinking runs to `</think>`, or to the end (a `length`
  finish inside it); blank lines around it are dropped.
- tool calls are read in the answer only (a `<tool_call>` inside the thinking is not a call). A call is
  sent when its JSON is whole: a block that is not a JSON object with a string "name" (and an object
  "arguments") stays text, so a streamed reply never differs from the whole one. Whitespace around a
  call is dropped. An unclosed last block counts if its JSON is whole.
`parse_chat_output` reads an offline `RequestOutput` (`LLM.chat`) the same way.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

REASONING_PARSERS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}  # vLLM's names
TOOL_PARSERS = {"hermes": ("<tool_call>", "</tool_call>")}
STATES = ("maybe", "open", "closed")


def check_parser(kind: str, name: str | None) -> None:
    """A reasoning or tool-call parser name that nanoengine has (None: none asked for)."""
    known = REASONING_PARSERS if kind == "reasoning" else TOOL_PARSERS
    if name is not None and name not in known:
        flag = "--reasoning-parser" if kind == "reasoning" else "--tool-call-parser"
        raise ValueError(f"{flag} {name!r}: nanoengine has no such {kind} parser; use one of "
                         f"{', '.join(known)}")


@dataclass(frozen=True)
class ParserOptions:
    """A server's parsers (vLLM's flags): `--reasoning-parser NAME` splits the thinking off,
    `--enable-auto-tool-choice --tool-call-parser NAME` reads the calls of a tool_choice "auto" request (a
    "required" or named one is read whatever the flags: its grammar writes Hermes blocks)."""
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        check_parser("reasoning", self.reasoning_parser)
        check_parser("tool call", self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs a parser for the calls: add --tool-call-parser "
                             f"({', '.join(TOOL_PARSERS)})")

    @property
    def reasoning_tags(self) -> tuple[str, str] | None:
        return None if self.reasoning_parser is None else REASONING_PARSERS[self.reasoning_parser]

    def check_vocabulary(self, tokenizer: Any, model: str) -> None:
        """The reasoning parser's tags must be tokens of the model (the grammar waits for `</think>`)."""
        for tag in self.reasoning_tags or ():
            i = tokenizer.convert_tokens_to_ids(tag)
            if not isinstance(i, int) or tokenizer.convert_ids_to_tokens(i) != tag:
                raise ValueError(f"--reasoning-parser {self.reasoning_parser}: {tag!r} is not a token of "
                                 f"{model}'s vocabulary, so it does not think in these tags; leave the "
                                 "flag out")


def reasoning_state(prompt_text: str, tags: tuple[str, str] = REASONING_PARSERS["qwen3"]) -> str:
    """Where the thinking stands when the output starts: "open" (the prompt ends with `<think>`), "closed"
    (it ends with `</think>`: Qwen3 with enable_thinking=False) or "maybe" (the model may open it)."""
    tail = prompt_text.rstrip()
    return "open" if tail.endswith(tags[0]) else "closed" if tail.endswith(tags[1]) else "maybe"


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back until known)."""
    i = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while i >= 0:  # (the longest such end starts at the first of tag's first character in the window)
        if tag.startswith(text[i:]):
            return len(text) - i
        i = text.find(tag[0], i + 1)
    return 0


@dataclass
class ToolCall:
    """One call, in OpenAI's terms: `arguments` is a JSON string."""
    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's shape, as an assistant message's `tool_calls` holds it."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def parse_call(body: str) -> ToolCall | None:
    """A Hermes block's JSON as a call (None: not one)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class Parts:
    """What a piece of output adds: thinking, answer text, and whole tool calls, in that order."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class _Reasoning:
    """Splits text into thinking and answer (see the module's rules)."""

    def __init__(self, tags: tuple[str, str], state: str) -> None:
        if state not in STATES:
            raise ValueError(f"reasoning state must be one of {STATES}, got {state!r}")
        self.start, self.end = tags
        self.state, self.buf = state, ""
        self.lead = state == "open"  # blank text at the start of the thinking is dropped
        self.held = ""  # the thinking's trailing blank text, sent once more thinking follows
        self.after = False  # blank text right after `</think>` is dropped

    def _think(self, text: str, closing: bool) -> str:
        text = self.held + text
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        kept = text.rstrip()
        self.held = "" if closing else text[len(kept):]
        return kept

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.buf += text
        thinking, answer = [], []
        while True:
            if self.state == "maybe":
                head = self.buf.lstrip()
                if head.startswith(self.start):
                    self.buf, self.state, self.lead = head[len(self.start):], "open", True
                elif final or not self.start.startswith(head):
                    self.state = "closed"
                else:
                    return "", ""  # still could be the opening tag
            elif self.state == "open":
                i = self.buf.find(self.end)
                if i >= 0:
                    thinking.append(self._think(self.buf[:i], closing=True))
                    self.buf, self.state, self.after = self.buf[i + len(self.end):], "closed", True
                    continue
                keep = 0 if final else _partial(self.buf, self.end)
                thinking.append(self._think(self.buf[:len(self.buf) - keep], closing=final))
                self.buf = self.buf[len(self.buf) - keep:]
                return "".join(thinking), ""
            else:
                piece, self.buf = self.buf, ""
                if self.after:
                    piece = piece.lstrip()
                    self.after = not piece
                answer.append(piece)
                return "".join(thinking), "".join(answer)


class _ToolCalls:
    """Splits answer text into text and Hermes tool calls (see the module's rules)."""

    def __init__(self, tags: tuple[str, str]) -> None:
        self.start, self.end = tags
        self.buf, self.in_call = "", False
        self.held = ""  # trailing blank text: dropped if a call follows, else sent with what follows
        self.after = False  # blank text right after a call is dropped

    def _text(self, piece: str, final: bool, out: list[str]) -> None:
        if self.after:
            piece = piece.lstrip()
            if not piece:
                return
            self.after = False
        text = self.held + piece
        kept = text if final else text.rstrip()
        self.held = text[len(kept):]
        out.append(kept)

    def _call(self, body: str, closed: bool, out: list[str], calls: list[ToolCall]) -> None:
        call = parse_call(body)
        if call is None:  # not a call: the block stays text, as written
            self._text(self.start + body + (self.end if closed else ""), not closed, out)
        else:
            calls.append(call)
            self.held, self.after = "", True

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self.in_call:
                j = self.buf.find(self.end)
                if j >= 0:
                    body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(self.end):], False
                    self._call(body, True, out, calls)
                    continue
                if final:
                    body, self.buf, self.in_call = self.buf, "", False
                    self._call(body, False, out, calls)
                return "".join(out), calls
            i = self.buf.find(self.start)
            if i >= 0:
                self._text(self.buf[:i], False, out)
                self.buf, self.in_call = self.buf[i + len(self.start):], True
                continue
            keep = 0 if final else _partial(self.buf, self.start)
            self._text(self.buf[:len(self.buf) - keep], final, out)
            self.buf = self.buf[len(self.buf) - keep:]
            return "".join(out), calls


class ChatOutputParser:
    """One completion's parser: `feed(piece)` -> the Parts it adds; `feed("", final=True)` at the end.

    reasoning_parser: a name in REASONING_PARSERS (None: no thinking is split off); tool_parser: a name in
    TOOL_PARSERS (None: no calls are read); state: where the thinking stands at the start
    (`reasoning_state` of the prompt)."""

    def __init__(self, reasoning_parser: str | None = None, tool_parser: str | None = None,
                 state: str = "maybe") -> None:
        check_parser("reasoning", reasoning_parser)
        check_parser("tool call", tool_parser)
        self.reasoning = None if reasoning_parser is None else _Reasoning(REASONING_PARSERS[reasoning_parser],
                                                                          state)
        self.tools = None if tool_parser is None else _ToolCalls(TOOL_PARSERS[tool_parser])
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> Parts:
        thinking, answer = ("", text) if self.reasoning is None else self.reasoning.feed(text, final)
        calls: list[ToolCall] = []
        if self.tools is not None:
            answer, calls = self.tools.feed(answer, final)
        self.num_calls += len(calls)
        return Parts(thinking, answer, calls)


@dataclass
class ParsedChat:
    """A chat completion read by the parsers: OpenAI's assistant message parts and the finish reason
    ("tool_calls" when it stopped after calling)."""
    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None

    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation for the next turn."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return msg


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's finish reason: "tool_calls" for a completion that stopped after calling a tool."""
    return "tool_calls" if num_calls and reason == "stop" else reason


def parse_text(text: str, reasoning_parser: str | None = None, tool_parser: str | None = None,
               state: str = "maybe", reason: str | None = "stop") -> ParsedChat:
    """A whole completion's text as a ParsedChat (what the streamed parts add up to)."""
    parser = ChatOutputParser(reasoning_parser, tool_parser, state)
    parts = parser.feed(text, final=True)
    split = bool(parts.reasoning or parts.tool_calls)
    return ParsedChat(parts.reasoning or None, None if split and not parts.content else parts.content,
                      parts.tool_calls, finish_reason(reason, len(parts.tool_calls)))


def parse_chat_output(output: Any, reasoning_parser: str | None = "qwen3", tool_parser: str | None = "hermes",
                      tokenizer: Any = None) -> list[ParsedChat]:
    """Each completion of an `LLM.chat` RequestOutput, read by the parsers (one ParsedChat per completion).
    With `tokenizer` (llm.get_tokenizer()), the prompt's end says where the thinking stands (needed for a
    template that opens `<think>` in the prompt; Qwen3's does not)."""
    state = "maybe"
    if tokenizer is not None and reasoning_parser is not None:
        check_parser("reasoning", reasoning_parser)
        tail = tokenizer.decode(list(output.prompt_token_ids[-8:]), skip_special_tokens=False)
        state = reasoning_state(tail, REASONING_PARSERS[reasoning_parser])
    return [parse_text(c.text, reasoning_parser, tool_parser, state, c.finish_reason) for c in output.outputs]
