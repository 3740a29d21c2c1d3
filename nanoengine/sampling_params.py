"""SamplingParams: how one request is decoded (vLLM's names and defaults). Chapter 05.

temperature 0 means greedy. top_k=-1 (or 0) and top_p=1 and min_p=0 switch those filters off. Every field
is checked here, type and range, with an error naming the field, the value and what is allowed
(`InvalidValueError` / `InvalidTypeError`, subclasses of ValueError / TypeError).

`logprobs=k` asks for each generated token's logprob and rank and the k most likely tokens at its step;
`prompt_logprobs=k` the same for every prompt token after the first (vLLM's fields; 0 = the token's own only).
Which distribution they come from is the engine's `logprobs_mode` (config.py; nanoengine/layers/logprobs.py).

`structured_outputs=StructuredOutputsParams(...)` (defined here, as in vLLM) says what the output must match;
nanoengine/structured.py compiles it and masks the logits, imported only when a request asks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from nanoengine.errors import InvalidTypeError, InvalidValueError, StructuredOutputsError

MIN_TEMPERATURE = 1e-6  # below this, logits / temperature overflow float32; 0 is greedy
MAX_SEED = 2**63 - 2**20  # a seed plus a completion index stays a valid torch seed


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
    logprobs: int | None = None  # top logprobs per generated token (None: none; 0: the sampled token's only)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice... (structured.py)
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.n = _integer("n", self.n, lo=1)
        self.temperature = _number("temperature", self.temperature, lo=0.0,
                                   fix="use 0 for greedy decoding, or a positive temperature such as 0.7")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise _bad(f"temperature={self.temperature!r} is too small to differ from greedy and overflows "
                       "the scaled logits", f"use 0 for greedy decoding, or at least {MIN_TEMPERATURE}")
        self.top_k = (-1 if self.top_k is None
                      else _integer("top_k", self.top_k, lo=-1, fix="use -1 to disable"))
        if self.top_k == 0:
            self.top_k = -1
        self.top_p = _number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True, fix="use 1.0 to disable")
        self.min_p = _number("min_p", self.min_p, lo=0.0, hi=1.0, fix="use 0.0 to disable")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, lo=-MAX_SEED, hi=MAX_SEED, fix="pass an integer, or None")
        if self.max_tokens is not None:
            self.max_tokens = _integer("max_tokens", self.max_tokens, lo=1,
                                       fix="None means: up to the model's maximum length")
        self.min_tokens = _integer("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens,
                                   fix="min_tokens is at most max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name), lo=0,
                                             fix="None: none, 0: the token's own, k: and the top k"))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"{name} must be True or False, got {getattr(self, name)!r}", "pass a bool",
                           InvalidTypeError)
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, (list, tuple)):
            self._stop_list = list(self.stop)
        else:
            raise _bad(f"stop must be a string or a list of strings, got {type(self.stop).__name__}",
                       "pass e.g. stop=['\\n\\n']", InvalidTypeError)
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise _bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}",
                       "remove empty stops")
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple)):
            raise _bad(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}",
                       "pass e.g. [2]", InvalidTypeError)
        self.stop_token_ids = [_integer("stop_token_ids", t, lo=0, fix="token ids are >= 0") for t in ids]
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise _bad(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}",
                       "pass e.g. StructuredOutputsParams(json=schema) (nanoengine.structured)",
                       InvalidTypeError)

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _bad(what: str, fix: str, kind: type[Exception] = InvalidValueError) -> Exception:
    return kind(f"SamplingParams: {what}; {fix}")


def _integer(name: str, value: Any, lo: int, hi: int | None = None, fix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {value!r} ({type(value).__name__})", fix or "pass an int",
                   InvalidTypeError)
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(f"{name} must be {allowed}, got {value}", fix or f"pass an integer {allowed}")
    return value


def _number(name: str, value: Any, lo: float, hi: float | None = None, lo_open: bool = False,
            fix: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{name} must be a number, got {value!r} ({type(value).__name__})", fix, InvalidTypeError)
    value = float(value)
    too_low = value <= lo if lo_open else value < lo
    if not math.isfinite(value) or too_low or (hi is not None and value > hi):
        allowed = (f"{'>' if lo_open else '>='} {lo}" if hi is None else
                   f"in {'(' if lo_open else '['}{lo}, {hi}]")
        raise _bad(f"{name} must be {allowed}, got {value}", fix)
    return value


# ----------------------------------------------------------------------------------------- structured outputs
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
        "json_object": "JSON object grammar", "structural_tag": "structural tag"}


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's class and fields): exactly one of
    `json` (a JSON schema, as a dict or as JSON text), `regex`, `choice` (a list of strings), `grammar` (EBNF,
    xgrammar's dialect of GBNF), `json_object=True` (any JSON object) or `structural_tag` (xgrammar's
    structural tag, as a dict or JSON text). `reasoning_tags` (start, end): the model thinks between these
    two tokens first, and the grammar applies only after the end (None: from the first token)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    reasoning_tags: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidValueError(
                f"StructuredOutputsParams: give exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise _bad_type("json", self.json, "a JSON schema as a dict or as JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad_type(name, value, "a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise _bad_type("choice", self.choice, "a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise _bad_type("json_object", self.json_object, "True (or leave it out)")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise _bad_type("structural_tag", self.structural_tag, "a structural tag (a dict or JSON text)")
        tags = self.reasoning_tags
        if tags is not None and (not isinstance(tags, (tuple, list)) or len(tags) != 2
                                 or not all(isinstance(t, str) and t for t in tags)):
            raise _bad_type("reasoning_tags", tags, "two tokens' text: (start, end)")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): equal for requests that compile to the same grammar (the cache's key)."""
        kind = self.kind
        if kind in ("json", "structural_tag"):
            spec = getattr(self, kind)
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as e:
                    raise StructuredOutputsError(f"structured_outputs.{kind} is not valid JSON ({e}); pass "
                                                 f"a {WHAT[kind]}") from None
            return kind, json.dumps(spec, separators=(",", ":"))  # (key order matters: properties)
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def _bad_type(name: str, value: Any, want: str) -> InvalidTypeError:
    return InvalidTypeError(f"StructuredOutputsParams: {name} must be {want}, got {value!r:.80} "
                            f"({type(value).__name__})")
