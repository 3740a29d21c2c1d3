"""Structured outputs: a request's tokens constrained to a JSON schema, any JSON object, a regex, one of a
list of choices, or an EBNF grammar. Chapter 05.

vLLM's names: `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))` (or `regex=`,
`choice=`, `grammar=`, `json_object=True`: exactly one). The grammar library is xgrammar (vLLM's and SGLang's
default; measured against llguidance on the Qwen3 tokenizer, CPU: tokenizer info 0.9 s vs 4.2 s, a small
schema compiled in 28 ms vs 5 ms, a mask filled in 0.003 ms vs 0.017 ms per row), imported only when a
request asks for structured outputs. How it runs in the engine (`StructuredOutputs`, one per engine):
- a request's grammar is compiled when the request is made (`LLMEngine.make_request`), so a schema the
  library cannot compile is an InvalidValueError naming the problem (HTTP 400); compiled grammars are cached
  per (tokenizer, kind, canonical spec), and the tokenizer's info (the vocabulary as the library sees it,
  with the model's padding ids past the tokenizer's, which are never allowed) is built once per tokenizer;
- each sequence with a grammar (n > 1: each completion) gets a matcher when its request is added; it
  advances on every token the scheduler puts in place (`Scheduler.update`: it only ever sees kept tokens);
  preemption recomputes the same tokens, so the matcher's state stays right;
- when a step samples such a sequence, `mask(seqs)` lays out a bitmask over the step's sampled rows (rows
  without a grammar, and matchers that reached their end, allow everything) and the executor applies it to a
  copy of the logits before the sampler (`TokenMask.apply`: the raw logits stay unmasked);
- overlap scheduling: the next mask needs this step's tokens, so the engine finishes a step that sampled a
  grammar sequence before it schedules the next (steps without one overlap as before);
- speculative decoding: a sequence with a grammar gets no drafts (it decodes plainly;
  Scheduler.propose_drafts).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoengine.errors import InvalidTypeError, InvalidValueError

if TYPE_CHECKING:  # (torch only for the hints: SamplingParams and the server's front end import this module)
    import torch

    from nanoengine.engine.sequence import Sequence

KINDS = ("json", "regex", "choice", "grammar", "json_object")
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
# whitespace characters allowed in a row between JSON elements (indent 4, three levels deep, fits): unbounded,
# a small model can loop on whitespace until max_tokens and never close its JSON
JSON_MAX_WHITESPACE = 12


class StructuredOutputsError(InvalidValueError):
    """A structured-outputs request the library cannot compile; `param` names the field (the server's 400)."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's class and fields): exactly one of
    `json` (a JSON schema, as a dict or as JSON text), `regex`, `choice` (a list of strings), `grammar` (EBNF,
    xgrammar's dialect of GBNF) or `json_object=True` (any JSON object)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

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

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): equal for requests that compile to the same grammar (the cache's key)."""
        kind = self.kind
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise StructuredOutputsError(f"structured_outputs.json is not valid JSON ({e}); pass a "
                                                 "JSON schema") from None
            return kind, json.dumps(schema, separators=(",", ":"))  # (key order matters: properties)
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def _bad_type(name: str, value: Any, want: str) -> InvalidTypeError:
    return InvalidTypeError(f"StructuredOutputsParams: {name} must be {want}, got {value!r:.80} "
                            f"({type(value).__name__})")


# ------------------------------------------------------------------------------------------ compiling
_COMPILERS: dict[tuple, Any] = {}  # tokenizer key -> xgrammar.GrammarCompiler (holds the TokenizerInfo)


def _compiler(key: tuple, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """The tokenizer's compiler, built once per (tokenizer, model vocab size, stop ids): the vocabulary as
    xgrammar sees it, padded to the model's vocab_size (ids past the tokenizer's are never allowed)."""
    if key not in _COMPILERS:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_ids))
        _COMPILERS[key] = xgr.GrammarCompiler(info, cache_enabled=False)  # ours is below: bounded
    return _COMPILERS[key]


def choice_grammar(choice: list[str]) -> str:
    """EBNF for one of the strings (vLLM turns a choice into a grammar the same way)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _compile(tokenizer_key: tuple, kind: str, spec: str) -> Any:
    compiler = _COMPILERS[tokenizer_key]
    if kind in ("json", "json_object"):  # a JSON object: OpenAI's json_object (xgrammar's builtin: any value)
        schema = spec if kind == "json" else '{"type": "object"}'
        return compiler.compile_json_schema(schema, strict_mode=True, max_whitespace_cnt=JSON_MAX_WHITESPACE)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(spec)))
    return compiler.compile_grammar(spec)


def _library_message(e: Exception) -> str:
    """xgrammar's error without its timestamp and source location."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip()).strip()


WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
        "json_object": "JSON object grammar"}


# ------------------------------------------------------------------------------------------ in the engine
@dataclass
class TokenMask:
    """A step's grammar mask: `bitmask` [num_sampled, ceil(vocab / 32)] int32 (bit j of a row: token j is
    allowed), filled only on `rows` (the sampled rows with a grammar), on the logits' device."""
    bitmask: torch.Tensor
    rows: list[int]
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [num_sampled, V] with every token the grammars refuse at -inf, as a new tensor (the raw
        logits stay as they are)."""
        import xgrammar as xgr

        masked = logits.clone()  # [num_sampled, V]
        xgr.apply_token_bitmask_inplace(masked, self.bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size, indices=self.rows)
        return masked


class StructuredOutputs:
    """An engine's grammars: compiling (cached), a matcher per sequence, the step's mask."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (the tokenizer's may be smaller)
        self.stop_ids = tuple(sorted(stop_token_ids))
        # the tokenizer's folder names its vocabulary (engines over the same model share the compiler)
        name = getattr(tokenizer, "name_or_path", "") or f"id {id(tokenizer)}"
        self.key = (name, len(tokenizer), vocab_size, self.stop_ids)
        self.matchers: dict[int, Any] = {}  # seq_id -> xgrammar.GrammarMatcher

    def compile(self, params: Any) -> Any:
        """The compiled grammar of a StructuredOutputsParams (cached); StructuredOutputsError if the library
        cannot compile it, naming the problem."""
        kind, spec = params.key()
        _compiler(self.key, self.tokenizer, self.vocab_size, self.stop_ids)
        try:
            return _compile(self.key, kind, spec)
        except Exception as e:  # noqa: BLE001 - whatever the library refuses in a request is the request's fault
            raise StructuredOutputsError(f"structured_outputs: xgrammar cannot compile this {WHAT[kind]}: "
                                         f"{_library_message(e)}; fix it or leave it out") from None

    def add(self, seq: Sequence) -> None:
        """A matcher for a sequence whose request asks for structured outputs."""
        params = seq.sampling_params.structured_outputs
        if params is not None:
            import xgrammar as xgr

            self.matchers[seq.seq_id] = xgr.GrammarMatcher(self.compile(params))

    def release(self, seq: Sequence) -> None:
        """A finished or aborted sequence drops its matcher."""
        self.matchers.pop(seq.seq_id, None)

    def samples_grammar(self, seqs: Iterable[Sequence]) -> bool:
        """Whether any of a step's sampled sequences has a matcher."""
        matchers = self.matchers
        return bool(matchers) and any(s.seq_id in matchers for s in seqs)

    def advance(self, appended: Iterable[tuple[Sequence, list[int]]]) -> None:
        """Each matcher takes the tokens its sequence got (in place, after Scheduler.update)."""
        if not self.matchers:
            return
        for seq, tokens in appended:
            m = self.matchers.get(seq.seq_id)
            for t in tokens if m is not None else ():
                if m.is_terminated():  # the grammar is done (e.g. ignore_eos): the rest is unconstrained
                    break
                if not m.accept_token(t):
                    raise RuntimeError(f"structured outputs: sequence {seq.seq_id} got token {t}, which its "
                                       "grammar refuses (the mask was not applied to its row)")

    def mask(self, seqs: list[Sequence]) -> TokenMask | None:
        """The mask of a step whose sampled rows are `seqs` (None: no row has a grammar)."""
        if not self.samples_grammar(seqs):
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)  # [B, W] all allowed
        rows = []
        for i, s in enumerate(seqs):
            m = self.matchers.get(s.seq_id)
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, i)
                rows.append(i)
        return TokenMask(bitmask, rows, self.vocab_size) if rows else None
