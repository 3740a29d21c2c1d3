"""Request outputs, shaped like vLLM's (`out.outputs[0].text`, `.token_ids`, `.finish_reason`). Chapter 05."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log probability at one position (vLLM's shape): `rank` 1 is the most likely token."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one dict per position: token id -> Logprob; the position's own token (sampled, or the prompt's) first, then
# the top k in rank order (a token in both appears once)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop id or stop string), "length", "abort", None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None  # the sum of the tokens' logprobs (with SamplingParams.logprobs)
    logprobs: list[PositionLogprobs] | None = None  # one per generated token (with SamplingParams.logprobs)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first completion)
    # with SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
