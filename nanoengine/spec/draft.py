"""The draft-model proposer (vLLM's "draft_model" method). Chapter 09.

A small model that shares the target's tokenizer decodes the k drafts greedily. It runs on an engine of its
own (`nanoengine.launch.build_engine`: the same scheduler, paged KV cache and model runner, with a KV pool of
its own), so the machinery that serves requests also serves the drafts: each proposal is a greedy request of
k tokens whose prompt is the sequence so far. The draft engine's prefix cache keeps what it computed for the
last proposal, so a proposal recomputes only the tokens since (the last partial block and the newly accepted
tokens: one short prefill) and then decodes k - 1 tokens.

Its drafts are greedy, so the proposal distribution q is a point mass and the engine's verification (sample
each position, keep the drafts while they equal the model's tokens: nanoengine.spec.verify) is exact, for
greedy and for sampled requests alike. A step with B speculating sequences runs one draft engine run for all
B (`propose_many`: B requests added, stepped until all are done: their short prefills in one step, their
decodes batched). The draft's sequences are not kept between steps: the prefix cache stands for them, at the
price of recomputing the last partial block at each proposal.
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
        return self.propose_many([token_ids], [self.k if max_tokens is None else max_tokens])[0]

    def propose_many(self, token_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """The draft model's greedy continuations of several sequences, min(k, max_tokens[i]) tokens each,
        in one run of the draft engine: a request each, stepped together until all are done (their prefills
        and decodes batched as the engine batches any requests)."""
        engine = self.engine
        requests = []
        try:
            for ids, m in zip(token_ids, max_tokens):
                k = min(self.k, m)
                if k <= 0:
                    requests.append(None)
                    continue
                request = engine.make_request(list(ids), SamplingParams(temperature=0, max_tokens=k,
                                                                        ignore_eos=True), final_only=True)
                engine.add(request)
                requests.append(request)
            while any(r is not None and not r.finished for r in requests):
                engine.step()
            return [[] if r is None else list(r.seqs[0].completion_token_ids) for r in requests]
        finally:
            for r in requests:  # (finished: lets go; its blocks stay in the prefix cache)
                if r is not None:
                    engine.abort(r.request_id)

    def close(self) -> None:
        self.engine.close()

