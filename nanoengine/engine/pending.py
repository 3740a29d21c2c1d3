"""Pending tokens: every rule about a token that a launched step samples before the host knows it. Chapter 06.

When the scheduler commits a step (`Scheduler.schedule`), each sequence that reaches its end in it will get a
token from that step's draw: from then on the token is *pending*. It counts in the sequence's length
(`Sequence.num_tokens`, what scheduling reads) but has no id on the host (`Sequence.token_ids` holds known
tokens only) until the step's update puts it in place (`Scheduler.update`). Without overlap that is the same
engine step; with overlap scheduling (`async_scheduling`) the next step is scheduled and launched first, so
that the host's work for it hides behind the device's work for this one. The rules, in the order a token
lives them:
1. `hold_place`: committing a step gives each sequence it ends a pending token.
2. `ends_at_length`: a sequence whose pending tokens bring it to its length limit is not scheduled again,
   whatever they turn out to be (it will finish).
3. `input_id`: the next step's input at a pending position is not an id but a reference, -(row + 1), to row
   `row` of the tokens the step before sampled (the input builder writes it; `ModelInput.prev_sampled` says
   how many that step sampled) ...
4. `read_pending_ids`: ... which the model runner reads from those tokens on the device (no host sync).
5. `forget`: after a step failed, the steps committed and never finished are undone: their pending tokens
   are dropped and their sequences compute again from where those steps started (`Scheduler.forget` also
   takes their blocks out of the prefix cache and sends the sequences they admitted back to waiting).
A sequence that finishes drops its pending tokens (`Scheduler._finish`): steps in flight sampled past its end.
mini-sglang reads the next input ids from a per-request token pool on the device instead of a row of the last
step's tokens; the host side is the same (a count, no placeholder ids in host lists).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from nanoengine.engine.sequence import Sequence

if TYPE_CHECKING:
    from nanoengine.engine.scheduler_output import SchedulerOutput


def hold_place(seq: Sequence) -> None:
    """The committed step samples seq's next token: it is pending until the step's update."""
    seq.num_pending_tokens += 1


def ends_at_length(seq: Sequence, max_len: int) -> bool:
    """Whatever they turn out to be, seq's pending tokens bring it to its length limit (max_tokens, or
    `max_len`, the longest a sequence may grow)."""
    max_tokens = seq.sampling_params.max_tokens
    return ((max_tokens is not None and seq.num_tokens - seq.num_prompt_tokens >= max_tokens)
            or seq.num_tokens >= max_len)


def input_id(row: int) -> int:
    """The input id the builder writes at a pending position: row `row` of the step before's tokens."""
    return -1 - row


def read_pending_ids(input_ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """input_ids [num_tokens] with every reference (< 0) replaced by the token it names in prev_tokens
    [num_prev] (the step before's, on the same device)."""
    from_prev = prev_tokens[(-1 - input_ids).clamp_(min=0)]  # [num_tokens]
    return torch.where(input_ids >= 0, input_ids, from_prev)


def forget(steps: Iterable[SchedulerOutput]) -> None:
    """After a failed (or interrupted) step: as if the committed steps that never finished had not run."""
    for out in steps:
        for s in out.scheduled:
            seq = s.seq
            seq.num_pending_tokens = 0
            seq.spec_token_ids = []
            seq.num_computed_tokens = min(seq.num_computed_tokens, s.start)
