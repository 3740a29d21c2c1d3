"""Sequence: the state of one request (one completion) inside the engine. Chapter 03.

Plain Python: token ids, how many of them already have their K/V in the cache (`num_computed_tokens`), the
block table, and the sampling parameters. `token_ids` holds only the tokens the host knows: a *pending* token
(engine/pending.py) counts in `num_pending_tokens` and `num_tokens` but has no id here. Speculative decoding
(chapter 09) keeps a step's drafts apart, in `spec_token_ids`: they are computed with the step but never in
`token_ids` until the model accepted them, so nothing that reads `token_ids` (the prefix cache's hashes, the
output) ever sees a rejected one.
"""

from __future__ import annotations

from enum import Enum, auto
from itertools import count
from typing import Any

from nanoengine.errors import InvalidValueError


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: Any, block_size: int,
                 seq_id: int | None = None) -> None:
        if not token_ids:
            raise InvalidValueError("a sequence needs at least one prompt token; got an empty prompt")
        self.seq_id = next(Sequence._ids) if seq_id is None else seq_id
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # tokens served by the prefix cache at the last admission
        self.num_prompt_cached_tokens: int | None = None  # ... at the first (what outputs report, as vLLM)
        self.block_table: list[int] = []
        # the chained prefix-cache hashes of its leading full blocks of known tokens (BlockManager.hashes_of)
        self.block_hashes: list[int] = []
        self.num_table_resets = 0  # times the block manager emptied or cut block_table (it grows between)
        self.finish_reason: str | None = None  # "stop", "length" or "abort" once finished
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it
        self.num_preemptions = 0
        self.num_pending_tokens = 0  # sampled by launched steps, ids not yet known here (0..2; pending.py)
        self.spec_token_ids: list[int] = []  # this step's drafts, verified after it (speculative decoding)
        self.wait_for: Sequence | None = None  # n > 1: siblings wait for the first one's prefill
        self.request_id: str | None = None
        self.index = 0  # which completion of its request (0..n-1)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.name})")

    @property
    def num_tokens(self) -> int:
        """Its length as scheduling sees it: the known tokens and the pending ones."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows: all but the pending ones (`token_ids`)."""
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def scored_until(self) -> int:
        """Its prompt rows before this position have their logits scored against the next prompt token (0:
        none): all of them where its request asked for prompt logprobs and it is the completion that computes
        them (the first). The input builder lays those rows out, and the scheduler computes them all."""
        if self.index == 0 and getattr(self.sampling_params, "prompt_logprobs", None) is not None:
            return self.num_prompt_tokens - 1
        return 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while the prompt (or, after preemption, the prompt + generated tokens) is not all in cache."""
        return (self.num_tokens - self.num_computed_tokens > 1
                or self.num_computed_tokens < self.num_prompt_tokens)

    def check_stop(self, token: int, eos_token_ids: set[int], max_len: int) -> tuple[str | None, int | None]:
        """The stop rules, once `token` was appended: (finish reason, the stop token id that caused it), or
        (None, None) to go on. "stop" for a stop token id, or an end-of-sequence id unless ignore_eos (before
        `min_tokens` the logits masks hold both back: engine/logits_masks.py); "length" at max_tokens or at
        `max_len` tokens in all (the longest a sequence may grow)."""
        sp = self.sampling_params
        known = len(self.token_ids)
        if token in sp.stop_token_ids:
            return "stop", token
        if not sp.ignore_eos and token in eos_token_ids:
            return "stop", None
        if sp.max_tokens is not None and known - self.num_prompt_tokens >= sp.max_tokens:
            return "length", None
        if known >= max_len:
            return "length", None
        return None, None

    def block_tokens(self, i: int) -> list[int]:
        """Token ids held by logical block i."""
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]
