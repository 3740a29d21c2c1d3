"""Logprobs in the step loop: what a step asks the executor to reduce beside the draw, and where the rows it
returns go. Chapter 05.

The reduction itself (log_softmax, the token's rank, the top k) runs on the logits' device next to the
sampler (nanoengine/layers/logprobs.py, imported only when a request asks). Here, on the host:
- `check(params)`: as a request is made, that it asks for at most the engine's `max_logprobs`;
- `wanted(sampling, prompt_rows, targets)`: before a step is launched, the row reducer the executor runs after
  its draw (engine/hooks.py; `NO_REDUCTION` when no request in it asked): the sampled rows' top k (the most
  any of its requests asked for), and the prompt rows' targets (the next prompt token of each row,
  `SamplingParams.prompt_logprobs`);
- `deliver(step, update, requests)`: once its tokens are in place, each generated token's entry to its
  Completion and each prompt token's to its Request (a preempted prompt computed again writes the same
  entries again), each entry the token itself first, then the top k (`PositionLogprobs`, vLLM's shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nanoengine.engine.hooks import NO_REDUCTION, NoReduction
from nanoengine.errors import InvalidValueError
from nanoengine.outputs import Logprob, PositionLogprobs
from nanoengine.tokenizer import TokenTexts

if TYPE_CHECKING:
    from nanoengine.engine.inputs import PromptRows
    from nanoengine.engine.request import Request
    from nanoengine.engine.scheduler_output import StepUpdate
    from nanoengine.engine.step import LaunchedStep
    from nanoengine.layers.logprobs import LogprobsWanted
    from nanoengine.layers.sampler import SamplingBatch
    from nanoengine.sampling_params import SamplingParams


class LogprobOutputs:
    def __init__(self, tokenizer: Any, mode: str, max_logprobs: int) -> None:
        self.mode = mode  # the engine's logprobs_mode (raw or processed: config.py)
        self.max_logprobs = max_logprobs  # the most top logprobs a request may ask for (config.py)
        self.token_texts = TokenTexts(tokenizer)  # each entry's decoded token

    def check(self, params: SamplingParams) -> None:
        """A request's logprobs and prompt_logprobs ask for at most `max_logprobs` (InvalidValueError)."""
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise InvalidValueError(f"{name}={k} is more than this engine's max_logprobs="
                                        f"{self.max_logprobs}; ask for fewer, or raise max_logprobs "
                                        "(the server's --max-logprobs)")

    def wanted(self, sampling: SamplingBatch | None, prompt_rows: list[PromptRows],
               targets: list[int]) -> LogprobsWanted | NoReduction:
        """The row reducer of a step's rows (`NO_REDUCTION`: no request in it asked)."""
        k = None if sampling is None else sampling.num_logprobs  # (None: no row is sampled)
        if k is None and not prompt_rows:
            return NO_REDUCTION
        from nanoengine.layers.logprobs import LogprobsWanted

        wanted = LogprobsWanted(k, self.mode)
        if prompt_rows:
            wanted.prompt_targets = torch.tensor(targets)  # [P]
            wanted.prompt_k = max(r.seq.sampling_params.prompt_logprobs for r in prompt_rows)
        return wanted

    def deliver(self, step: LaunchedStep, update: StepUpdate, requests: dict[str, Request]) -> None:
        """The step's rows to the requests that asked (see the module docstring)."""
        forward = step.forward
        if forward is None:
            return
        if forward.sampled_logprobs is not None:
            rows = forward.sampled_logprobs.rows()
            for (seq, new), row in zip(update.appended, update.rows):
                completion = requests[seq.request_id].completions[seq.index]
                if completion.logprobs is None:
                    continue
                k = seq.sampling_params.logprobs
                for token, (logprob, rank, top_ids, top) in zip(new, rows[row:row + len(new)]):
                    completion.logprobs.append(self.entry(token, logprob, rank, top_ids[:k], top[:k]))
                    completion.token_logprobs.append(logprob)
        if step.prompt_rows:
            rows, at = forward.prompt_logprobs.rows(), 0
            for seq, first, count in step.prompt_rows:
                req = requests.get(seq.request_id)
                if req is not None:  # (None: aborted meanwhile)
                    k, ids = seq.sampling_params.prompt_logprobs, req.prompt_token_ids
                    for i, (logprob, rank, top_ids, top) in enumerate(rows[at:at + count], first):
                        req.prompt_logprobs[i] = self.entry(ids[i], logprob, rank, top_ids[:k], top[:k])
                at += count

    def entry(self, token: int, logprob: float, rank: int, top_ids: list[int],
              top_logprobs: list[float]) -> PositionLogprobs:
        """One position's entry: its own token first, then the top k (a token in both appears once)."""
        texts = self.token_texts
        entry = {token: Logprob(logprob, rank, texts(token))}
        for r, (t, value) in enumerate(zip(top_ids, top_logprobs), 1):
            if t not in entry:
                entry[t] = Logprob(value, r, texts(t))
        return entry
