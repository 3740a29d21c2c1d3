"""How the engine's events and outputs become OpenAI's bodies: a completion's reply and chunks, a chat's
reply and chunks, and the choices inside them. Chapter 05 (appendix).

A completion's reply and each of its stream's chunks have one shape (`completion_response`); a chat's reply
holds messages and its chunks deltas (`ChatCompletionResponse`, `chat_chunk`). A choice's index is prompt
number * n + completion number.
"""

from __future__ import annotations

from nanoengine.serve.messages import Delta, Event, RequestStream
from nanoengine.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    Usage,
)


def _usage(usage: dict | None) -> Usage | None:
    return Usage(**usage) if usage else None


def completion_response(rid: str, model_name: str, choices: list[CompletionChoice],
                        usage: dict | None = None) -> CompletionResponse:
    """A completion's reply, and each of its SSE chunks (the same shape)."""
    return CompletionResponse(id=rid, model=model_name, choices=choices, usage=_usage(usage))


def completion_choice(ev: Event) -> CompletionChoice:
    if isinstance(ev, Delta):
        return CompletionChoice(index=ev.index, text=ev.text)
    return CompletionChoice(index=ev.index, text="", finish_reason=ev.finish_reason,
                            stop_reason=ev.stop_reason)


def completion_choices(stream: RequestStream, n: int) -> list[CompletionChoice]:
    """Every finished choice of every prompt, indexed prompt number * n + completion number."""
    return [CompletionChoice(index=i * n + c.index, text=c.text, finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason)
            for i, out in enumerate(stream.outputs) for c in out.outputs]


def chat_chunk(rid: str, model_name: str, choices: list[ChatChunkChoice],
               usage: dict | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=rid, model=model_name, choices=choices, usage=_usage(usage))


def chat_role_choices(n: int) -> list[ChatChunkChoice]:
    """A chat stream's first chunk: each choice's role, no content yet."""
    return [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(n)]


def chat_chunk_choice(ev: Event) -> ChatChunkChoice:
    if isinstance(ev, Delta):
        return ChatChunkChoice(index=ev.index, delta=ChatDelta(content=ev.text))
    return ChatChunkChoice(index=ev.index, delta=ChatDelta(), finish_reason=ev.finish_reason)


def chat_choices(stream: RequestStream) -> list[ChatChoice]:
    return [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason,
                       stop_reason=c.stop_reason) for c in stream.outputs[0].outputs]
