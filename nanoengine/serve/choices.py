"""How the engine's events and outputs become OpenAI's bodies: a completion's reply and chunks, a chat's
reply and chunks, and the choices inside them. Chapter 05 (appendix).

A completion's reply and each of its stream's chunks have one shape (`completion_response`); a chat's reply
holds messages and its chunks deltas (`ChatCompletionResponse`, `chat_chunk`). A choice's index is prompt
number * n + completion number.

With logprobs (`logprobs.py` shapes them) a chunk carries those of the tokens its event brought. A
completion with echo shows each prompt before its completion, the prompt's logprobs before the completion's
(in a stream, in the choice's first chunk); echo with max_tokens 0 (`echo_only`) shows the prompt alone: the
one token generated for it is dropped, as vLLM does.

A chat read by parsers (`ChatParsing`: the server's reasoning parser, a tool-call parser when the request's
tool_choice reads calls) has each completion split by `nanoengine/parsers.py`: a reply's message gets
`reasoning_content`, `content` and `tool_calls`; a stream's event may become several chunks (`ChatChunks`):
the thinking first, then the answer, then each whole call as OpenAI streams one (its index, id and name with
arguments "", then its arguments), and the finish reason "tool_calls" when it stopped after calling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoengine.outputs import PositionLogprobs
from nanoengine.parsers import ChatOutputParser, ToolCall, finish_reason, parse_text
from nanoengine.serve.logprobs import chat_logprobs, completion_logprobs, next_offset
from nanoengine.serve.messages import Delta, Event, RequestStream
from nanoengine.serve.protocol import CompletionRequest
from nanoengine.serve.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunction,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    Usage,
)


def _usage(usage: dict | None) -> Usage | None:
    return Usage(**usage) if usage else None


def completion_response(rid: str, model_name: str, choices: list[CompletionChoice],
                        usage: dict | None = None) -> CompletionResponse:
    """A completion's reply, and each of its SSE chunks (the same shape)."""
    return CompletionResponse(id=rid, model=model_name, choices=choices, usage=_usage(usage))


@dataclass
class CompletionShape:
    """What a completion request asks its choices to show beside the text."""
    logprobs: bool = False  # each token's logprobs
    echo: bool = False  # the prompt first
    echo_only: bool = False  # the prompt alone (max_tokens 0)

    @classmethod
    def of(cls, body: CompletionRequest) -> CompletionShape:
        return cls(body.logprobs is not None, bool(body.echo), body.echo_only)


def _choice(shape: CompletionShape, index: int, echo: tuple[str, str] | None,
            prompt_logprobs: list[PositionLogprobs | None] | None, text: str,
            logprobs: list[PositionLogprobs] | None, offset: int = 0) -> CompletionChoice:
    """A choice (or a chunk's) with the prompt first when `echo` ((prompt text, its first token's text))."""
    if shape.echo_only:
        text, logprobs = "", []
    lp = None
    if shape.logprobs:
        lp = CompletionLogprobs()
        if echo is not None:
            completion_logprobs(prompt_logprobs or [], offset, unscored=echo[1], into=lp)
            offset = next_offset(lp) if lp.tokens else offset
        completion_logprobs(logprobs or [], offset, into=lp)
    return CompletionChoice(index=index, text=(echo[0] if echo is not None else "") + text, logprobs=lp)


@dataclass
class CompletionChunks:
    """A completion stream's choice for each event (`__call__`), remembering per choice whether its prompt
    was shown and where its next token's text starts."""
    shape: CompletionShape
    stream: RequestStream
    started: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=dict)

    def __call__(self, ev: Event) -> CompletionChoice:
        echo = None
        if self.shape.echo and ev.index not in self.started:
            echo = self.stream.echo[ev.index // self.stream.n]
        self.started.add(ev.index)
        text = ev.text if isinstance(ev, Delta) else ""
        choice = _choice(self.shape, ev.index, echo, ev.prompt_logprobs, text, ev.logprobs,
                         self.offsets.get(ev.index, 0))
        if choice.logprobs is not None and choice.logprobs.tokens:
            self.offsets[ev.index] = next_offset(choice.logprobs)
        if not isinstance(ev, Delta):
            choice.finish_reason, choice.stop_reason = ev.finish_reason, ev.stop_reason
        return choice


def completion_choices(stream: RequestStream, n: int,
                       shape: CompletionShape | None = None) -> list[CompletionChoice]:
    """Every finished choice of every prompt, indexed prompt number * n + completion number."""
    shape = shape or CompletionShape()
    choices = []
    for i, out in enumerate(stream.outputs):
        for c in out.outputs:
            echo = stream.echo[i] if shape.echo else None
            choice = _choice(shape, i * n + c.index, echo, out.prompt_logprobs, c.text, c.logprobs)
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
            choices.append(choice)
    return choices


def chat_chunk(rid: str, model_name: str, choices: list[ChatChunkChoice],
               usage: dict | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=rid, model=model_name, choices=choices, usage=_usage(usage))


def chat_role_choices(n: int) -> list[ChatChunkChoice]:
    """A chat stream's first chunk: each choice's role, no content yet."""
    return [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(n)]


def _chat_logprobs(logprobs: list[PositionLogprobs] | None, top_logprobs: int | None) -> ChatLogprobs | None:
    if top_logprobs is None:
        return None
    return ChatLogprobs(content=chat_logprobs(logprobs or [], top_logprobs))


def chat_chunk_choice(ev: Event, top_logprobs: int | None = None) -> ChatChunkChoice:
    """top_logprobs: None without logprobs, else k (the request's top_logprobs, 0 when left out)."""
    lp = _chat_logprobs(ev.logprobs, top_logprobs)
    if isinstance(ev, Delta):
        return ChatChunkChoice(index=ev.index, delta=ChatDelta(content=ev.text), logprobs=lp)
    return ChatChunkChoice(index=ev.index, delta=ChatDelta(), finish_reason=ev.finish_reason,
                           logprobs=lp if lp is not None and lp.content else None)


@dataclass
class ChatParsing:
    """How a chat's completions are read: the reasoning parser (None: the thinking stays in the content),
    the tool-call parser (None: calls are not read), where the thinking stands when the output starts."""
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    thinking: str = "maybe"

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tool_parser is not None

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(self.reasoning_parser, self.tool_parser, self.thinking)


def _calls_out(calls: list[ToolCall]) -> list[ToolCallOut] | None:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls] or None


def chat_choices(stream: RequestStream, top_logprobs: int | None = None,
                 parsing: ChatParsing | None = None) -> list[ChatChoice]:
    choices = []
    for c in stream.outputs[0].outputs:
        message, reason = ChatMessageOut(content=c.text), c.finish_reason
        if parsing is not None and parsing.active:
            p = parse_text(c.text, parsing.reasoning_parser, parsing.tool_parser, parsing.thinking, reason)
            message = ChatMessageOut(content=p.content, reasoning_content=p.reasoning_content,
                                     tool_calls=_calls_out(p.tool_calls))
            reason = p.finish_reason
        lp = _chat_logprobs(c.logprobs, top_logprobs)
        choices.append(ChatChoice(index=c.index, message=message, finish_reason=reason,
                                  stop_reason=c.stop_reason, logprobs=lp))
    return choices


@dataclass
class ChatChunks:
    """A parsed chat stream's chunk choices for each event (`__call__`), with a parser per choice."""
    parsing: ChatParsing
    top_logprobs: int | None = None
    parsers: dict[int, ChatOutputParser] = field(default_factory=dict)

    def __call__(self, ev: Event) -> list[ChatChunkChoice]:
        i, done = ev.index, not isinstance(ev, Delta)
        parser = self.parsers.get(i) or self.parsers.setdefault(i, self.parsing.parser())
        calls_before = parser.num_calls
        parts = parser.feed("" if done else ev.text, final=done)
        out = []
        if parts.reasoning:
            out.append(ChatChunkChoice(index=i, delta=ChatDelta(reasoning_content=parts.reasoning)))
        if parts.content:
            out.append(ChatChunkChoice(index=i, delta=ChatDelta(content=parts.content)))
        for k, call in enumerate(parts.tool_calls, calls_before):
            first = DeltaToolCall(index=k, id=call.id, type="function",
                                  function=DeltaFunction(name=call.name, arguments=""))
            out += [ChatChunkChoice(index=i, delta=ChatDelta(tool_calls=[first])),
                    ChatChunkChoice(index=i, delta=ChatDelta(tool_calls=[
                        DeltaToolCall(index=k, function=DeltaFunction(arguments=call.arguments))]))]
        if done:
            out.append(ChatChunkChoice(index=i, delta=ChatDelta(),
                                       finish_reason=finish_reason(ev.finish_reason, parser.num_calls)))
        lp = _chat_logprobs(ev.logprobs, self.top_logprobs)
        if lp is not None and lp.content:  # on the event's first chunk (an empty delta if it has none)
            if not out:
                out.append(ChatChunkChoice(index=i, delta=ChatDelta()))
            out[0].logprobs = lp
        return out
