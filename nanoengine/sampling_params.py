"""SamplingParams: how one request is decoded (vLLM's names and defaults). Chapter 05.

temperature 0 means greedy. top_k=-1 (or 0) and top_p=1 and min_p=0 switch those filters off.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(what: str, fix: str) -> ValueError:
            return ValueError(f"SamplingParams: {what}; {fix}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}", "ask for at least one completion")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}", "use 0 for greedy decoding")
        if self.top_k is None:
            self.top_k = -1
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}", "use -1 to disable")
        if self.top_k == 0:
            self.top_k = -1
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "use 1.0 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}", "use 0.0 to disable")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}",
                      "None means: up to the model's maximum length")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad(f"min_tokens={self.min_tokens} must be in [0, max_tokens]", "lower min_tokens")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an int or None, got {self.seed!r}", "pass an integer seed")
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        else:
            self._stop_list = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}", "remove empty stops")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
