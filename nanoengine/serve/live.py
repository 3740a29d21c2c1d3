"""The engine thread's record of one engine request it serves, and the events its steps make. Chapter 05.

`Live` ties an engine `Request` to the `RequestStream` its HTTP handler reads: which of its choices were
reported done, how many of each choice's logprobs were sent. After a step, `events(texts)` turns the step's
text deltas for it and its newly finished choices into messages (messages.py), in that order, each with the
logprobs of the tokens put in place since its choice's last event (and a choice's first event, the prompt's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoengine.serve.messages import ChoiceDone, Delta, RequestStream

if TYPE_CHECKING:
    from nanoengine.engine.request import Request


@dataclass
class Live:
    request: Request
    stream: RequestStream
    prompt_index: int
    reported: set[int] = field(default_factory=set)  # completion indices whose ChoiceDone was sent
    logprobs_sent: dict[int, int] = field(default_factory=dict)  # completion index -> positions sent
    prompt_sent: set[int] = field(default_factory=set)  # completion indices sent the prompt's logprobs
    num_tokens: int = 0  # completion tokens counted so far (for the generation-tokens metric)

    def events(self, texts: Any) -> tuple[list[Any], int]:
        """Its new text (the engine's (completion index, text) deltas) and newly finished choices, in that
        order; and the completion tokens made since the last call."""
        n = self.stream.n
        events: list[Any] = [Delta(self.prompt_index * n + i, text, *self.logprobs(i)) for i, text in texts]
        tokens = 0
        for c in self.request.completions:
            seq = c.seq
            tokens += seq.num_completion_tokens
            if seq.is_finished and seq.index not in self.reported:
                self.reported.add(seq.index)
                events.append(ChoiceDone(self.prompt_index * n + seq.index, seq.finish_reason,
                                         seq.stop_reason, *self.logprobs(seq.index)))
        new, self.num_tokens = tokens - self.num_tokens, tokens
        return events, new

    def logprobs(self, index: int) -> tuple[list | None, list | None]:
        """Completion `index`'s logprobs not sent yet (those of its tokens in place, None without
        SamplingParams.logprobs), and the prompt's on its first event (None without prompt_logprobs)."""
        req = self.request
        new = prompt = None
        if req.params.logprobs is not None:
            c = req.completions[index]
            start, end = self.logprobs_sent.get(index, 0), min(len(c.logprobs), c.seq.num_completion_tokens)
            new, self.logprobs_sent[index] = c.logprobs[start:end], max(start, end)
        if req.params.prompt_logprobs is not None and index not in self.prompt_sent:
            self.prompt_sent.add(index)
            prompt = list(req.prompt_logprobs or ())
        return new, prompt
