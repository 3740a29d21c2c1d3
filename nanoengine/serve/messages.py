"""What the HTTP handlers and the engine thread (`async_engine.py`) pass each other. Chapter 05 (appendix).

- to the engine thread, on its command queue: `AddRequests` (a request's prompts, or its conversation: a
  `ChatPrompt`, which the engine thread renders through the chat template),
  `Abort` (a client that went away), `Call` (a function to run on the engine between steps), `Wake` (look at
  the shutdown flags now);
- back to a handler, on its request's `RequestStream`: `Delta(index, text)` for new text,
  `ChoiceDone(index, finish_reason, stop_reason)` when a completion finishes, `RequestDone` when one prompt's
  request has (with its RequestOutput), or `Failed` with the error its handler raises. With logprobs, a
  Delta or ChoiceDone carries those of the tokens put in place since the choice's last event (all of them
  add up to the completion's), and a choice's first event the prompt's (with prompt_logprobs);
- the two errors a handler may get beside the engine's own: `ServerBusyError` (HTTP 503) and
  `EngineStepError` (HTTP 500).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoengine.outputs import PositionLogprobs, RequestOutput
from nanoengine.parsers import reasoning_state
from nanoengine.sampling_params import SamplingParams
from nanoengine.tokenizer import encode_text
from nanoengine.tools import render_with_tools

if TYPE_CHECKING:  # the engine (and torch) load where one is built, not in the data-parallel front end
    from nanoengine.engine.llm_engine import LLMEngine


class ServerBusyError(RuntimeError):
    """The server is shutting down, or its engine thread is gone, or its queue is full (HTTP 503; with
    `retry_after` seconds, a Retry-After header)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStepError(RuntimeError):
    """The engine raised while stepping; every request in flight was aborted (HTTP 500)."""


# ------------------------------------------------------------------ a request's events (engine -> handler)
@dataclass
class Delta:
    index: int  # choice index: prompt number * n + completion number
    text: str
    logprobs: list[PositionLogprobs] | None = None  # the new tokens' (with SamplingParams.logprobs)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # a choice's first event (prompt_logprobs)


@dataclass
class ChoiceDone:
    index: int
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list[PositionLogprobs] | None = None  # those not sent with a Delta yet
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # when it is the choice's first event


@dataclass
class RequestDone:
    prompt_index: int
    output: RequestOutput


@dataclass
class Failed:
    error: Exception


Event = Delta | ChoiceDone  # what a handler reads from `RequestStream.events()`


@dataclass
class RequestStream:
    """A handler's side of one HTTP request (one or more prompts, n completions each)."""

    request_id: str
    num_prompts: int
    n: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: asyncio.Future | None = None
    outputs: list[RequestOutput | None] = field(default_factory=list)
    done: bool = False
    request_ids: list[str] = field(default_factory=list)  # its engine requests (engine thread)
    # with echo: each prompt's text and its first token's (the engine thread decodes token-id prompts)
    echo: list[tuple[str, str]] | None = None

    def __post_init__(self) -> None:
        self.accepted = self.loop.create_future()
        self.outputs = [None] * self.num_prompts

    async def events(self) -> AsyncIterator[Event]:
        """Deltas and finished choices until every prompt's request is done; an engine failure raises."""
        remaining = self.num_prompts
        while remaining:
            ev = await self.queue.get()
            if isinstance(ev, RequestDone):
                self.outputs[ev.prompt_index] = ev.output
                remaining -= 1
            elif isinstance(ev, Failed):
                self.done = True
                raise ev.error
            else:
                yield ev
        self.done = True

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI's usage: prompt tokens once per prompt, completion tokens over every choice."""
        outs = [o for o in self.outputs if o is not None]
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ------------------------------------------------------------------ the commands (handler -> engine thread)
@dataclass
class ChatPrompt:
    """A chat request's conversation: its messages, tools and chat template arguments. The engine thread
    (the tokenizer's one user) renders it (`token_ids`), and notes where the thinking stands at the prompt's
    end (`thinking`, parsers.reasoning_state) for the handler's reasoning parser, which reads it once the
    request is accepted."""
    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_tags: tuple[str, str] | None = None
    thinking: str = "maybe"

    def token_ids(self, tokenizer: Any) -> list[int]:
        text = render_with_tools(tokenizer, self.messages, self.tools, **self.template_kwargs)
        if self.reasoning_tags is not None:
            self.thinking = reasoning_state(text, self.reasoning_tags)
        return encode_text(tokenizer, text, "conversation", add_special_tokens=False)


@dataclass
class AddRequests:
    """One engine request per prompt, or one for the conversation (a chat), answered on stream.accepted."""
    stream: RequestStream
    prompts: list[Any]
    params: SamplingParams
    conversation: ChatPrompt | None
    arrival: float  # time.perf_counter() when the HTTP request came in
    echo: bool = False  # the handler shows each prompt's text: the engine thread fills stream.echo

    @property
    def answer(self) -> asyncio.Future:
        return self.stream.accepted


@dataclass
class Abort:
    """Abort whatever of the stream's requests still runs (its client went away)."""
    stream: RequestStream


@dataclass
class Call:
    """fn(llm_engine) between steps; its result (or error) is the answer its caller awaits."""
    fn: Callable[[LLMEngine], Any]
    answer: asyncio.Future


@dataclass
class Wake:
    """Nothing to run: the engine thread looks at its shutdown and stop flags at once."""


Command = AddRequests | Abort | Call | Wake
