"""Chapter 01's piece in an engine of your own (chapter 11): your incremental detokenizer (Exercise 1.3)
behind the interface of the engine's `IncrementalDetokenizer` (nanoengine/tokenizer.py).

A `Completion` (engine/request.py) makes its text, its streamed deltas and its stop strings from what its
detokenizer's `push` returns, so a completion given a `YourDetokenizer` makes all three with your code: each
`push` calls your `detokenize_incrementally(decode, token_ids, prefix_offset, read_offset)` once. What 1.3
does not cover stays the engine's: `flush` (at the end, a truly invalid byte sequence decodes to U+FFFD), and
`decode_all` replays your 1.3 over every token (a completion whose text is read only once it is done).
`your_detokenizer(tokenizer)` makes them; while your 1.3 is still the untouched stub, the engine's own
detokenizer stands in (`stood_in == ["1.3"]`), so chapter 11's engine can be written first. The engine's `LLM`
does not take this piece (there is no use_exercises "ch01"): chapter 11's `MyEngine` hands one to each
completion it makes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from nanoengine.pieces.learner import check_result, is_stub, load, piece
from nanoengine.tokenizer import IncrementalDetokenizer


class YourDetokenizer(IncrementalDetokenizer):
    """The engine's IncrementalDetokenizer with `push` on your Exercise 1.3 (`step`)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, step: Callable) -> None:
        super().__init__(tokenizer, skip_special_tokens)
        self.step = step

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        got = self.step(self._decode, self.token_ids, self.prefix_offset, self.read_offset)
        ok = (isinstance(got, tuple) and len(got) == 3 and isinstance(got[0], str)
              and 0 <= got[1] <= got[2] <= len(self.token_ids))
        check_result(ok, self.step, f"{got!r} after {len(self.token_ids)} tokens; it must return (delta, "
                     "prefix_offset, read_offset) with 0 <= prefix_offset <= read_offset <= len(token_ids)")
        delta, self.prefix_offset, self.read_offset = got
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: what your deltas have not said yet (an incomplete character's U+FFFD)."""
        full = self._decode(self.token_ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        self.read_offset = len(self.token_ids)
        return delta

    def decode_all(self) -> str:
        """The text of every token pushed so far, as your 1.3 makes it token by token (then flushed)."""
        replay = YourDetokenizer(self.tokenizer, self.skip_special_tokens, self.step)
        for token in self.token_ids:
            replay.push(token)
        replay.flush()
        return replay.text


class DetokenizerPiece:
    """Makes each completion's detokenizer: yours (Exercise 1.3), or the engine's while yours is a stub.
    `calls` counts the calls your 1.3 got (the "all your pieces" run shows them)."""

    def __init__(self, tokenizer: Any, step: Callable | None, source: str) -> None:
        self.tokenizer, self.source, self.calls = tokenizer, source, 0
        self.stood_in = [] if step is not None else ["1.3"]
        self.step = None
        if step is not None:
            @functools.wraps(step)
            def counted(*args: Any) -> Any:
                self.calls += 1
                return step(*args)

            self.step = counted

    def __call__(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        if self.step is None:
            return IncrementalDetokenizer(self.tokenizer, skip_special_tokens)
        return YourDetokenizer(self.tokenizer, skip_special_tokens, self.step)


def your_detokenizer(tokenizer: Any, folder: Any = None) -> DetokenizerPiece:
    """Your Exercise 1.3 from your ch01 file (exercises/, or what NANOENGINE_IMPL names), ready to give each
    completion a detokenizer (`piece(skip_special_tokens)`); the engine's stands in while 1.3 is a stub."""
    from nanoengine.pieces import folder_of

    where = folder_of(folder)
    module = load("ch01", where)
    if is_stub(module.detokenize_incrementally):
        return DetokenizerPiece(tokenizer, None, "the engine's (your 1.3 is a stub)")
    return DetokenizerPiece(tokenizer, piece(module, "detokenize_incrementally", "ch01"),
                            f"yours ({where.name}/)")
