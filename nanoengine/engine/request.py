"""Request and Completion: what the engine keeps per request, and per output stream. Chapter 05.

`parse_prompt` turns what a user passes (text, token ids, or a vLLM-style dict) into token ids, checked.

A request asks for `n` completions of one prompt. Each completion is one `Sequence` (the scheduler's view:
tokens, blocks, status) plus a `Completion` (the user's view: the detokenizer, the text so far, and stop
strings). `Completion.push(tokens, finished)` is the one place sampled tokens become text. `new_request`
makes a checked Request (any engine's `make_request` starts from it: engine/protocol.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from nanoengine.engine.sequence import Sequence
from nanoengine.errors import InvalidTypeError, InvalidValueError
from nanoengine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from nanoengine.sampling_params import SamplingParams
from nanoengine.tokenizer import IncrementalDetokenizer, encode_text

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def parse_prompt(prompt: Any, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as a string, a list of token ids, or a dict with
    'prompt_token_ids' (and optionally 'prompt') or 'prompt'; a clear error for anything else.

    A dict with both keys is vLLM's TokensPrompt with its optional text: the ids are what runs, and the text
    (not tokenized, not checked against the ids) is only carried into RequestOutput.prompt."""
    if isinstance(prompt, dict):
        unknown = [k for k in prompt if k not in PROMPT_KEYS]
        if unknown:
            raise InvalidValueError(f"a prompt dict takes the keys {PROMPT_KEYS}; "
                                    f"got unknown key(s) {unknown}")
        if "prompt" in prompt and not isinstance(prompt["prompt"], str):
            raise InvalidTypeError("a prompt dict's 'prompt' must be a string, "
                                   f"got {type(prompt['prompt']).__name__}")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), check_token_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" not in prompt:
            raise InvalidValueError("a prompt dict needs 'prompt' or 'prompt_token_ids', "
                                    f"got keys {list(prompt)}")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidValueError("empty prompt: give at least one character or token id")
        return prompt, encode_text(tokenizer, prompt)
    if isinstance(prompt, (list, tuple)):
        return None, check_token_ids(prompt, vocab_size)
    raise InvalidTypeError("a prompt is a string, a list of token ids or a dict; "
                           f"got {type(prompt).__name__}")


def check_token_ids(ids: Any, vocab_size: int, what: str = "prompt token ids") -> list[int]:
    """ids as a list of ints in [0, vocab_size), or an error naming the first bad one."""
    if not isinstance(ids, (list, tuple)):
        raise InvalidTypeError(f"{what} must be a list of ints, got {type(ids).__name__}")
    not_ints = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
    if not_ints:
        raise InvalidTypeError(f"{what} must be ints; got {not_ints[0]!r} ({type(not_ints[0]).__name__})")
    if not ids and what == "prompt token ids":
        raise InvalidValueError("empty prompt: give at least one token id")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return list(ids)


class Completion:
    """One output stream: its sequence, its detokenizer, its text, and the stop string it hit (if any)."""

    def __init__(self, seq: Sequence, tokenizer: Any, final_only: bool = False) -> None:
        """final_only: nobody reads the text before the sequence ends (LLM.generate; vLLM's FINAL_ONLY
        output kind), so with no stop string to watch for it is decoded once, at the end, instead of token by
        token: no text deltas, and no detokenizing inside the step loop."""
        self.seq = seq
        self.params: SamplingParams = seq.sampling_params
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.params.skip_special_tokens)
        self.deferred = final_only and not self.params.stop_strings
        self.text = ""
        self.stop_string: str | None = None  # set when the text reached one of params.stop_strings
        self.num_dropped = 0  # then: the pushed tokens after the one that completed it (they are not kept)
        self.num_sent = 0  # characters of `text` already returned as deltas
        # with SamplingParams.logprobs: one entry per token put in place (the engine adds them before `push`),
        # and each token's own logprob (what cumulative_logprob adds up)
        self.logprobs: list[PositionLogprobs] | None = [] if self.params.logprobs is not None else None
        self.token_logprobs: list[float] = []
        # a stop string may be completed by a later token, so the last len(longest stop) - 1 characters are
        # held back until it is clear they stay (vLLM does the same); with the stop string kept in the output,
        # nothing ever needs taking back
        stops = self.params.stop_strings
        self.holdback = 0 if self.params.include_stop_str_in_output or not stops else max(map(len, stops)) - 1

    def push(self, tokens: list[int], finished: bool) -> str:
        """Take the tokens the scheduler just put in place (one, or a verification's kept tokens; `finished`:
        the sequence ended with the last of them); return the new text to show. When the text reaches a stop
        string it is cut there (after it with include_stop_str_in_output), `stop_string` is set and
        `num_dropped` counts the tokens after the one that completed it: the caller then finishes the
        sequence without them. The deltas add up to `text`."""
        if self.deferred:
            return ""  # the text is made at the end (output)
        text = self.text
        for n, token in enumerate(tokens, 1):
            new = self.detokenizer.push(token)
            if finished and n == len(tokens):
                new += self.detokenizer.flush()
            text += new
            stop = self.find_stop_string(text, len(new))
            if stop is not None:
                cut, self.stop_string = stop
                text = text[:cut]
                self.num_dropped = len(tokens) - n
                break
        self.text = text
        done = finished or self.stop_string is not None
        end = len(text) if done else max(self.num_sent, len(text) - self.holdback)
        delta, self.num_sent = text[self.num_sent:end], end
        return delta

    def find_stop_string(self, text: str, new_chars: int) -> tuple[int, str] | None:
        """(cut position, stop string) of the earliest stop string that the last `new_chars` characters
        completed, else None. Stop strings count only after min_tokens."""
        params = self.params
        if not params.stop_strings or len(self.detokenizer.token_ids) <= params.min_tokens or not new_chars:
            return None
        best = None
        for stop in params.stop_strings:
            start = max(0, len(text) - new_chars - len(stop) + 1)
            idx = text.find(stop, start)
            if idx != -1 and (best is None or idx < best[2]):
                cut = idx + len(stop) if params.include_stop_str_in_output else idx
                best = (cut, stop, idx)
        return None if best is None else best[:2]

    def output(self) -> CompletionOutput:
        seq = self.seq
        ids = seq.completion_token_ids
        if self.deferred and len(self.detokenizer.token_ids) != len(ids):  # the text so far, in one decode
            self.detokenizer.token_ids = list(ids)
            self.text = self.detokenizer.text = self.detokenizer.decode_all()
        logprobs = cumulative = None
        if self.logprobs is not None:  # (a stop string may have dropped the last tokens: theirs go too)
            logprobs, cumulative = self.logprobs[:len(ids)], sum(self.token_logprobs[:len(ids)])
        return CompletionOutput(index=seq.index, text=self.text, token_ids=list(ids),
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                cumulative_logprob=cumulative, logprobs=logprobs)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[Completion]
    metrics: RequestMetrics
    # with SamplingParams.prompt_logprobs: one per prompt token, filled as the prompt is computed (None for
    # the first, which nothing predicts)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.completions]

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    def output(self) -> RequestOutput:
        first = self.completions[0].seq
        self.metrics.num_output_tokens = first.num_completion_tokens
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.output() for c in self.completions], self.finished, self.metrics,
                             first.num_prompt_cached_tokens or 0,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs))


def new_request(prompt: Any, params: SamplingParams | None, tokenizer: Any, vocab_size: int, request_id: str,
                block_size: int = 16, final_only: bool = False) -> Request:
    """A checked Request of `params.n` completions of `prompt` (a string, token ids or a vLLM-style dict),
    each a Sequence (in blocks of `block_size`) and its Completion; what every engine's `make_request`
    starts from (engine/protocol.py). final_only: its text is read only once it is done (see Completion)."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InvalidTypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    text, ids = parse_prompt(prompt, tokenizer, vocab_size)
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    seqs = [Sequence(ids, params, block_size) for _ in range(params.n)]
    for i, s in enumerate(seqs):
        s.index, s.request_id = i, request_id
    return Request(request_id, text, ids, params, [Completion(s, tokenizer, final_only) for s in seqs],
                   RequestMetrics(time.perf_counter()),
                   None if params.prompt_logprobs is None else [None] * len(ids))
