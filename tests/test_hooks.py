"""The engine's declared hooks (engine/hooks.py): an extension written here, not by the engine, plugs in at
the draft-source seam or as a step observer, and the core step runs it without knowing who it is."""

from __future__ import annotations

import random

import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.engine.hooks import NoDrafts

PROMPTS = ["The paged KV cache stores keys and values in", "Once upon a time", "1, 2, 3, 4,"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen3", dtype="float32", block_size=4, max_num_batched_tokens=64)


class AnswerDrafts(NoDrafts):
    """A draft source of the test's own: it proposes the plain run's next tokens, every third one wrong, and
    keeps each sequence's drafts while they equal the model's tokens (the greedy acceptance rule)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], k: int = 3) -> None:
        self.answers, self.k, self.rng = answers, k, random.Random(0)
        self.proposed = self.accepted = 0

    def propose(self, scheduler) -> None:
        for seq in scheduler.running:
            seq.spec_token_ids = []
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            answer = self.answers[tuple(seq.prompt_token_ids)]
            done = seq.num_completion_tokens
            room = min(self.k, len(answer) - done - 1)  # the model adds one of its own
            drafts = [t if self.rng.random() < 0.67 else t + 1 for t in answer[done:done + max(room, 0)]]
            seq.spec_token_ids = drafts
            self.proposed += len(drafts)

    def verify(self, out, tokens: list[int]) -> list[int]:
        kept_tokens, i = [], 0
        self.kept_of = {}
        for seq in out.sampled:
            drafts = seq.spec_token_ids
            new = tokens[i:i + 1 + len(drafts)]
            i += len(new)
            n = 0
            while n < len(drafts) and drafts[n] == new[n]:
                n += 1
            out.num_drafts -= len(drafts) - n
            seq.spec_token_ids = drafts[:n]
            self.accepted += n
            kept_tokens += new[:n + 1]
        return kept_tokens

    def verified(self, scheduler, out, update) -> None:
        for seq, _ in update.appended:
            seq.spec_token_ids = []
            if not seq.is_finished:  # the blocks only rejected drafts wrote
                out.blocks_freed += scheduler.block_manager.truncate(seq, seq.num_tokens)


def run(llm: LLM) -> tuple[list[list[int]], int]:
    eng = llm.engine
    ids = [eng.add_request(p, PARAMS) for p in PROMPTS]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        eng.block_manager.check_invariants(eng.scheduler.running)
    tokens = [eng.requests[i].output().outputs[0].token_ids for i in ids]
    for i in ids:
        eng.abort(i)
    return tokens, steps


def test_a_draft_source_of_ones_own_gives_the_same_tokens_in_fewer_steps(llm):
    plain, plain_steps = run(llm)
    eng = llm.engine
    answers = {tuple(eng.tokenizer.encode(p)): t for p, t in zip(PROMPTS, plain)}
    eng.drafts = drafts = AnswerDrafts(answers)
    try:
        got, steps = run(llm)
    finally:
        eng.drafts = NoDrafts()
    assert got == plain  # a verified draft is the model's own token
    assert 0 < drafts.accepted < drafts.proposed  # kept drafts and rejected ones both happened
    assert steps < plain_steps, (steps, plain_steps)


class Counter:
    """A step observer: counts what it is told."""

    def __init__(self) -> None:
        self.seqs, self.steps, self.tokens = 0, 0, 0

    def added(self, seqs) -> None:
        self.seqs += len(seqs)

    def observe(self, step, update, stats) -> None:
        self.steps += 1
        self.tokens += sum(len(new) for _, new in update.appended)


def test_a_step_observer_is_told_every_request_and_every_step(llm):
    eng = llm.engine
    counter = Counter()
    eng.observers.append(counter)
    try:
        before = eng.step_count
        tokens, steps = run(llm)
    finally:
        eng.observers.remove(counter)
    assert counter.seqs == len(PROMPTS)
    assert counter.steps == eng.step_count - before == steps
    assert counter.tokens == sum(len(t) for t in tokens)


def test_the_default_engine_has_no_draft_source_and_imports_no_speculation():
    import subprocess
    import sys

    code = ("import sys; from nanoengine import LLM, SamplingParams; "
            "llm = LLM('tiny-qwen3', dtype='float32'); "
            "llm.generate(['hi'], SamplingParams(max_tokens=2), use_tqdm=False); "
            "print(type(llm.engine.drafts).__name__, 'nanoengine.spec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.stdout.split()[-2:] == ["NoDrafts", "False"], out.stdout + out.stderr
