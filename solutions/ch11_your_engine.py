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
        # BEGIN SOLUTION
        self.parts = parts
        self.tokenizer = parts.tokenizer
        self.plan = parts.plan
        self.pieces = your_pieces()
        self.detokenizer = your_detokenizer(self.tokenizer)
        self.sched = parts.scheduler(max_num_batched_tokens, max_num_seqs, num_blocks)
        self.shared_generator = torch.Generator().manual_seed(seed)
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> a seeded completion's generator
        self.requests: dict[str, Request] = {}  # request_id -> every request not yet finished
        self.owner: dict[int, tuple[Request, int]] = {}  # seq_id -> (its request, its completion's index)
        self.ids = count()
        # END SOLUTION

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
        # BEGIN SOLUTION
        rid = request_id if request_id is not None else f"mine-{next(self.ids)}"
        req = new_request(prompt, params, self.tokenizer, self.plan.hf_config.vocab_size, rid,
                          self.sched.block_size, final_only)
        for seq in req.seqs:
            self.sched.check_admission(seq)
        for completion in req.completions:
            completion.detokenizer = self.detokenizer(completion.params.skip_special_tokens)
        return req
        # END SOLUTION

    def add(self, request: Request) -> None:
        """Exercise 11.1: queue a request made by make_request.

        What must hold: each of its completions' Sequence waits in your scheduler; a seeded request's
        completion i draws from its own generator seeded `seed + i` (vLLM's rule), the others from the shared
        one; `step` can find each sequence's request and completion.
        """
        # BEGIN SOLUTION
        self.requests[request.request_id] = request
        for i, seq in enumerate(request.seqs):
            self.sched.add(seq)
            self.owner[seq.seq_id] = (request, i)
            if request.params.seed is not None:
                self.generators[seq.seq_id] = torch.Generator().manual_seed(request.params.seed + i)
        # END SOLUTION

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
        # BEGIN SOLUTION
        result = StepResult()
        p = self.pieces
        out = p.schedule(self.sched)
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        flat = p.build_inputs(out.scheduled, self.sched.block_size)
        logits = self.parts.logits(flat, out.scheduled)  # [num_sampled, vocab]
        if not flat.sample_rows:
            return result
        by_id = {s.seq.seq_id: s.seq for s in out.scheduled}
        seqs = [by_id[i] for i in flat.sample_seq_ids]
        sps = [seq.sampling_params for seq in seqs]
        tokens = p.sample(logits, [sp.temperature for sp in sps], [sp.top_k for sp in sps],
                          [sp.top_p for sp in sps], [sp.min_p for sp in sps],
                          [self.generators.get(seq.seq_id) for seq in seqs], self.shared_generator)
        now = time.perf_counter()
        for seq, token in zip(seqs, map(int, tokens)):
            req, index = self.owner[seq.seq_id]
            completion = req.completions[index]
            seq.token_ids.append(token)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            reason, stop = self.sched.stop_reason(seq, token)
            delta = completion.push([token], reason is not None)
            if completion.stop_string is not None:
                reason, stop = "stop", completion.stop_string
            result.sampled.append((seq, [token]))
            if delta:
                result.deltas.append(TextDelta(req, index, delta))
            if reason is not None:
                self.sched.finish(seq, reason, stop)
                self.generators.pop(seq.seq_id, None)
                del self.owner[seq.seq_id]
                if req.finished:
                    req.metrics.finished_time = now
                    del self.requests[req.request_id]
                    result.finished.append(req)
        return result
        # END SOLUTION

    def abort(self, request_id: str) -> None:
        """Exercise 11.3: forget a request.

        What must hold: every completion of it still running or waiting finishes with "abort", its blocks go
        back, its generator is forgotten; an unknown or finished request id changes nothing."""
        # BEGIN SOLUTION
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if self.sched.abort(seq):
                self.generators.pop(seq.seq_id, None)
                self.owner.pop(seq.seq_id, None)
        req.metrics.finished_time = time.perf_counter()
        # END SOLUTION

    def has_unfinished(self) -> bool:
        """Exercise 11.3: whether `step` has work (a sequence running or waiting)."""
        # BEGIN SOLUTION
        return self.sched.has_unfinished()
        # END SOLUTION

    def load(self) -> EngineLoad:
        """Exercise 11.3: how busy your engine is.

        Out: EngineLoad(running sequences, waiting ones, KV blocks in use, KV blocks in all)."""
        # BEGIN SOLUTION
        bm = self.sched.block_manager
        return EngineLoad(len(self.sched.running), len(self.sched.waiting), bm.num_used_blocks, bm.num_blocks)
        # END SOLUTION

    def close(self) -> None:
        """Exercise 11.3: let go of every request (each unfinished one is aborted)."""
        # BEGIN SOLUTION
        for rid in list(self.requests):
            self.abort(rid)
        # END SOLUTION


def make_engine(model: str = "tiny-qwen3", **options: Any) -> MyEngine:
    """The factory `nanoengine serve --engine ch11_your_engine:make_engine` and `nanoengine bench --engine
    ...` call with the model: the engine's parts over `model` (float32, 256 KV blocks), your engine over
    them. `options` go to MyEngine (max_num_batched_tokens, max_num_seqs, num_blocks, seed)."""
    return MyEngine(model_parts(model, num_blocks=256), **options)


__all__ = ["MyEngine", "make_engine"]
