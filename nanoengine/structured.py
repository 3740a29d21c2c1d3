"""Structured outputs: a request's tokens constrained to a JSON schema, any JSON object, a regex, one of a
list of choices, or an EBNF grammar. Chapter 05.

vLLM's names: `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))` (or `regex=`,
`choice=`, `grammar=`, `json_object=True`: exactly one). The grammar library is xgrammar (vLLM's and SGLang's
default; measured against llguidance on the Qwen3 tokenizer, CPU: tokenizer info 0.9 s vs 4.2 s, a small
schema compiled in 28 ms vs 5 ms, a mask filled in 0.003 ms vs 0.017 ms per row), imported only when a
request asks for structured outputs. How it runs in the engine (`StructuredOutputs`, one per engine):
- the grammars are made when a request first asks (engine/hooks.py's `NoGrammars.for_request`); a request's
  grammar is compiled when the request is made (`check`, from `LLMEngine.make_request`), so a schema the
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
  Speculator.propose);
- a thinking model (`reasoning_tags`, e.g. Qwen3's `<think>`/`</think>`, set by the server's
  `--reasoning-parser`): the grammar applies to the answer only, after the thinking ends (vLLM's rule). The
  prompt's end says where the thinking stands (`_thinking`): closed (`enable_thinking=False`), open, or not
  yet begun, when the first token may be `<think>` besides what the grammar allows; while it is open the row
  is unmasked and the matcher is fed nothing until `</think>`.
A `structural_tag` (xgrammar's JSON format) is how the server asks for tool calls (`nanoengine/tools.py`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoengine.errors import StructuredOutputsError
from nanoengine.sampling_params import KINDS, WHAT, StructuredOutputsParams

# (the request's side, StructuredOutputsParams, lives in sampling_params.py as in vLLM)
__all__ = ["KINDS", "WHAT", "StructuredOutputs", "StructuredOutputsError", "StructuredOutputsParams",
           "TokenMask"]

if TYPE_CHECKING:  # (torch only for the hints: SamplingParams and the server's front end import this module)
    import torch

    from nanoengine.engine.sequence import Sequence

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
# whitespace characters allowed in a row between JSON elements (indent 4, three levels deep, fits): unbounded,
# a small model can loop on whitespace until max_tokens and never close its JSON
JSON_MAX_WHITESPACE = 12


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
    if kind == "structural_tag":
        return compiler.compile_structural_tag(spec)
    return compiler.compile_grammar(spec)


def _library_message(e: Exception) -> str:
    """xgrammar's error without its timestamp and source location."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip()).strip()



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
        # seq_id -> [state, start id, end id] while its thinking is not over ("maybe" or "open")
        self.thinking: dict[int, list] = {}

    def for_request(self, params: Any) -> StructuredOutputs:
        """The grammars that serve any request: these (engine/hooks.py's NoGrammars made them)."""
        return self

    def made(self) -> StructuredOutputs:
        return self

    def check(self, params: Any) -> None:
        """A request's grammar (SamplingParams.structured_outputs, if any) compiled as the request is made
        (cached), so a schema the library cannot compile fails there (StructuredOutputsError)."""
        if params.structured_outputs is not None:
            self.compile(params.structured_outputs)

    def compile(self, params: Any) -> Any:
        """The compiled grammar of a StructuredOutputsParams (cached); StructuredOutputsError if the library
        cannot compile it, naming the problem."""
        kind, spec = params.key()
        if params.reasoning_tags is not None:
            self.tag_ids(params.reasoning_tags)
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
            if params.reasoning_tags is not None:
                start, end = self.tag_ids(params.reasoning_tags)
                state = self._thinking(seq.prompt_token_ids, start, end)
                if state != "closed":
                    self.thinking[seq.seq_id] = [state, start, end]

    def tag_ids(self, tags: tuple[str, str]) -> tuple[int, int]:
        """The token ids of the thinking's start and end; each must be one token of the vocabulary."""
        ids = []
        for tag in tags:
            i = self.tokenizer.convert_tokens_to_ids(tag)
            if not isinstance(i, int) or self.tokenizer.convert_ids_to_tokens(i) != tag:
                raise StructuredOutputsError(f"reasoning_tags: {tag!r} is not one token of this model's "
                                             "vocabulary, so the grammar cannot wait for it; this model does "
                                             "not think in these tags: leave the reasoning parser out")
            ids.append(i)
        return ids[0], ids[1]

    def _thinking(self, prompt: list[int], start: int, end: int) -> str:
        """Where the thinking stands after the prompt: its last token that is not blank is `start`
        ("open"), `end` ("closed"), or another ("maybe": the model may open it)."""
        for t in reversed(prompt[-8:]):
            if t in (start, end):
                return "open" if t == start else "closed"
            if self.tokenizer.decode([t]).strip():
                break
        return "maybe"

    def release(self, seq: Sequence) -> None:
        """A finished or aborted sequence drops its matcher."""
        self.matchers.pop(seq.seq_id, None)
        self.thinking.pop(seq.seq_id, None)

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
                if self.thinking and self._thinks(seq.seq_id, t):
                    continue
                if m.is_terminated():  # the grammar is done (e.g. ignore_eos): the rest is unconstrained
                    break
                if not m.accept_token(t):
                    raise RuntimeError(f"structured outputs: sequence {seq.seq_id} got token {t}, which its "
                                       "grammar refuses (the mask was not applied to its row)")

    def _thinks(self, seq_id: int, token: int) -> bool:
        """Whether `token` belongs to the thinking (the matcher does not take it); the thinking ends at its
        end token, or when the first token is not its start."""
        gate = self.thinking.get(seq_id)
        if gate is None:
            return False
        state, start, end = gate
        if state == "maybe" and token != start:
            del self.thinking[seq_id]
            return False
        if token == end:
            del self.thinking[seq_id]
        gate[0] = "open"
        return True

    def mask(self, seqs: list[Sequence]) -> TokenMask | None:
        """The mask of a step whose sampled rows are `seqs` (None: no row has a grammar)."""
        if not self.samples_grammar(seqs):
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)  # [B, W] all allowed
        rows = []
        for i, s in enumerate(seqs):
            m = self.matchers.get(s.seq_id)
            gate = self.thinking.get(s.seq_id)
            if m is not None and not m.is_terminated() and (gate is None or gate[0] == "maybe"):
                m.fill_next_token_bitmask(bitmask, i)  # (while thinking: the row is not masked)
                if gate is not None:  # the first token: the grammar's, or the thinking's start
                    word, bit = divmod(gate[1], 32)
                    bitmask[i, word] = int(bitmask[i, word]) | (1 << bit) - (1 << 32 if bit == 31 else 0)
                rows.append(i)
        return TokenMask(bitmask, rows, self.vocab_size) if rows else None
