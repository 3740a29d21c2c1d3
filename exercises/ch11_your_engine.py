# Your exercises for book/11a_requests_in.ipynb, 11b_one_step.ipynb, 11c_served_and_measured.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch11")`, from nanoengine.check) or: pytest tests/exercises/test_ch11_your_engine.py
# Generated from solutions/ch11_your_engine.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
"""Chapter 11, book/11a_requests_in.ipynb .. 11c_served_and_measured.ipynb: your engine, end to end.

Exercise 11.1: a request in: your engine's state, then text (or token ids) to a queued request.
Exercise 11.2: one step of your engine: your chapter 05 pieces, tokens out as text deltas, stop strings.
Exercise 11.3: the rest of the engine protocol: abort, has_unfinished, load, close.

`MyEngine` speaks nanoengine's engine protocol (nanoengine/engine/protocol.py), so `LLM.from_engine`,
`nanoengine serve --engine ch11_your_engine:make_engine` and `nanoengine bench --engine ...` take it as they
take the engine's own. It runs over the engine's model weights and KV cache (`parts`, from
`nanoengine.pieces.own_engine.model_parts`) and over your chapter 05 pieces (`your_pieces()`: your `schedule`,
`build_inputs` and `sample`; the engine's own stands in for one that is still a stub), and your chapter 01
incremental detokenizer (`your_detokenizer(tokenizer)`: your Exercise 1.3, which makes each completion's text,
its streamed deltas and what its stop strings are found in; the engine's stands in while 1.3 is a stub). What
it needs from the engine's package besides: `new_request` (a checked Request: its Sequences and, per
completion, a Completion that keeps the text and watches the stop strings), and the result types of a step
(`StepResult`, `TextDelta`, `EngineLoad`).
"""

from __future__ import annotations

import time
from itertools import count
from typing import Any

import torch

from nanoengine.engine.request import Request, new_request
from nanoengine.engine.step import EngineLoad, StepResult, TextDelta
from nanoengine.pieces.ch01 import your_detokenizer
from nanoengine.pieces.own_engine import ModelParts, model_parts, your_pieces
from nanoengine.sampling_params import SamplingParams


class MyEngine:
    """Your own engine. Its methods are the engine protocol's (nanoengine/engine/protocol.py): `tokenizer`
    and `plan` (attributes), `make_request`, `add`, `step`, `abort`, `has_unfinished`, `load`, `close`."""

    def __init__(self, parts: ModelParts, max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                 num_blocks: int | None = None, seed: int = 0) -> None:
        """Exercise 11.1: your engine's state, over `parts`.

        In: `parts` (the model's forward `parts.logits`, a fresh Scheduler from `parts.scheduler(...)`, the
        tokenizer `parts.tokenizer`, the engine's facts `parts.plan`), the step's token budget, the most
        sequences at once, the KV blocks to use (None: all), the seed of the shared generator.
        What must hold: `self.tokenizer` and `self.plan` are set (the protocol reads them); your chapter 05
        pieces come from `your_pieces()`, your chapter 01 detokenizer from `your_detokenizer(tokenizer)`;
        whatever you keep lets `step` find, for each sequence, its request and completion, and for a seeded
        one its own generator.
        """
        raise NotImplementedError("Exercise 11.1: your engine's state, over `parts` - see book/11a_requests_in.ipynb")

    def make_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                     final_only: bool = False) -> Request:
        """Exercise 11.1: a checked Request for `prompt` (text, token ids or a vLLM-style dict), not queued.

        Out: `new_request(prompt, params, self.tokenizer, vocab_size, request_id, block_size, final_only)`'s
        Request, with a fresh request id when none is given (ids must not repeat). What must hold: a bad
        request raises here (new_request checks it), and one your engine cannot run (`self.sched`'s
        `check_admission`: too long for the pool or the model) raises here too, before anything is queued;
        each completion's text is made by your chapter 01 detokenizer (a Completion reads its `detokenizer`:
        give it `self.detokenizer(skip_special_tokens)`).
        """
        raise NotImplementedError("Exercise 11.1: a checked Request for `prompt` (text, token ids or a vLLM-style dict), not queued - see book/11a_requests_in.ipynb")

    def add(self, request: Request) -> None:
        """Exercise 11.1: queue a request made by make_request.

        What must hold: each of its completions' Sequence waits in your scheduler; a seeded request's
        completion i draws from its own generator seeded `seed + i` (vLLM's rule), the others from the shared
        one; `step` can find each sequence's request and completion.
        """
        raise NotImplementedError("Exercise 11.1: queue a request made by make_request - see book/11a_requests_in.ipynb")

    def step(self) -> StepResult:
        """Exercise 11.2: one step of your engine: what it sampled, the text it made, what it finished.

        Out: a StepResult: `sampled`, (sequence, [token]) per sampled row; `deltas`, a
        `TextDelta(request, completion index, text)` for every token that made new text; `finished`, the
        requests whose last completion ended in this step.
        What must hold (the checks use `LLM.from_engine(your engine)`, prompts you did not choose):
        - greedy text equals transformers' decoding of its greedy tokens, and the deltas of a request add up
          to its text (streaming);
        - a completion stops at its stop rules (`self.sched.stop_reason`) or at a stop string
          (`completion.push(tokens, finished)` returns the new text and sets `completion.stop_string`; the
          text is cut there): "stop" with that string as stop_reason; it leaves the scheduler with its blocks
          (`self.sched.finish(seq, reason, stop_reason)`) and forgets its generator;
        - the request's metrics: `first_token_time` at its first token, `finished_time` when it finishes
          (time.perf_counter());
        - your chapter 05 loop inside: the model runs every step (also one that samples nothing), each
          scheduled sequence's tokens count as computed once, each sampled row goes to its own sequence.
        """
        raise NotImplementedError("Exercise 11.2: one step of your engine: what it sampled, the text it made, what it finished - see book/11b_one_step.ipynb")

    def abort(self, request_id: str) -> None:
        """Exercise 11.3: forget a request.

        What must hold: every completion of it still running or waiting finishes with "abort", its blocks go
        back, its generator is forgotten; an unknown or finished request id changes nothing."""
        raise NotImplementedError("Exercise 11.3: forget a request - see book/11c_served_and_measured.ipynb")

    def has_unfinished(self) -> bool:
        """Exercise 11.3: whether `step` has work (a sequence running or waiting)."""
        raise NotImplementedError("Exercise 11.3: whether `step` has work (a sequence running or waiting) - see book/11c_served_and_measured.ipynb")

    def load(self) -> EngineLoad:
        """Exercise 11.3: how busy your engine is.

        Out: EngineLoad(running sequences, waiting ones, KV blocks in use, KV blocks in all)."""
        raise NotImplementedError("Exercise 11.3: how busy your engine is - see book/11c_served_and_measured.ipynb")

    def close(self) -> None:
        """Exercise 11.3: let go of every request (each unfinished one is aborted)."""
        raise NotImplementedError("Exercise 11.3: let go of every request (each unfinished one is aborted) - see book/11c_served_and_measured.ipynb")


def make_engine(model: str = "tiny-qwen3", **options: Any) -> MyEngine:
    """The factory `nanoengine serve --engine ch11_your_engine:make_engine` and `nanoengine bench --engine
    ...` call with the model: the engine's parts over `model` (float32, 256 KV blocks), your engine over
    them. `options` go to MyEngine (max_num_batched_tokens, max_num_seqs, num_blocks, seed)."""
    return MyEngine(model_parts(model, num_blocks=256), **options)


__all__ = ["MyEngine", "make_engine"]
