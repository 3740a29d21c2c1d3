"""The draft-model proposer (vLLM's "draft_model" method). Chapter 09.

A small model that shares the target's tokenizer decodes the k drafts greedily. It runs on an engine of its
own (`nanoengine.launch.build_engine`: the same scheduler, paged KV cache and model runner, with a KV pool of
its own), so the machinery that serves requests also serves the drafts: each proposal is a greedy request of
k tokens whose prompt is the sequence so far. The draft engine's prefix cache keeps what it computed for the
last proposal, so a proposal recomputes only the tokens since (the last partial block and the newly accepted
tokens: one short prefill) and then decodes k - 1 tokens.

Its drafts are greedy, so the proposal distribution q is a point mass and the engine's verification (sample
each position, keep the drafts while they equal the model's tokens: nanoengine.spec.verify) is exact, for
greedy and for sampled requests alike. One sequence is proposed for at a time: a step with B speculating
sequences runs B draft requests (batching them into one draft engine run is the next step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanoengine.errors import InvalidValueError, NanoengineError
from nanoengine.sampling_params import SamplingParams

# the draft engine runs eagerly where the target's plan would pick overlap: a proposal waits for its tokens
DRAFT_OPTIONS = dict(async_scheduling=False, enable_prefix_caching=True, use_exercises=False)


class DraftModelProposer:
    def __init__(self, engine: Any, num_speculative_tokens: int) -> None:
        self.engine = engine  # the draft model's LLMEngine
        self.k = num_speculative_tokens

    @classmethod
    def build(cls, spec: Any, plan: Any, tokenizer: Any, num_kv_blocks: int,
              build_engine: Callable[..., Any]) -> DraftModelProposer:
        """The draft engine for `plan` (the target's), made by `build_engine` (nanoengine.launch's, handed
        down: spec/ never imports the engine's builder): same device, dtype, block size, length and batch
        limits, a pool of as many blocks as the target's; refused unless it shares the target's tokenizer."""
        from nanoengine import assets
        from nanoengine.tokenizer import load_tokenizer

        try:
            own = load_tokenizer(assets.resolve_model(spec.model))
        except NanoengineError as e:
            raise type(e)(f"speculative_config model {spec.model!r} (the draft): {e}") from None
        if own.get_vocab() != tokenizer.get_vocab():
            raise InvalidValueError(
                f"speculative_config model {spec.model!r}: its tokenizer ({len(own)} tokens) is not the "
                f"target's ({len(tokenizer)} tokens); a draft model must share the target's tokenizer (a "
                "smaller model of the same family), or use method 'ngram'")
        options = dict(device=plan.device, dtype=plan.dtype, block_size=plan.block_size,
                       max_model_len=plan.max_model_len, max_num_seqs=plan.max_num_seqs,
                       max_num_batched_tokens=plan.max_num_batched_tokens, num_kvcache_blocks=num_kv_blocks,
                       seed=plan.seed, quantization=spec.quantization, **DRAFT_OPTIONS)
        try:
            engine = build_engine(spec.model, **options)
        except NanoengineError as e:
            raise type(e)(f"speculative_config model {spec.model!r} (the draft): {e}") from None
        return cls(engine, spec.num_speculative_tokens)

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """The draft model's greedy continuation of `token_ids`: min(k, max_tokens) tokens."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if k <= 0:
            return []
        engine = self.engine
        request = engine.make_request(list(token_ids), SamplingParams(temperature=0, max_tokens=k,
                                                                      ignore_eos=True), final_only=True)
        engine.add(request)
        try:
            while not request.finished:
                engine.step()
            return list(request.seqs[0].completion_token_ids)
        finally:
            engine.abort(request.request_id)  # (finished: lets go; its blocks stay in the prefix cache)

    def close(self) -> None:
        self.engine.close()
